/* The int8 GEMM's inner loop alone, for llvm-mca: one tile's unpacked codes (16 rows x 32 inputs) dotted with
 * I8_ROWS activation rows per iteration, as gemm_i8_group runs it (i8_rows_dots) once a group's tiles are unpacked.
 * Left out: the unpacking (once a tile for all of a prompt's rows), the activations' quantisation and the group
 * epilogue. The region's marker names its row count, so the estimate counts the multiply-adds the build does. */
#include NPUMOE_ISA_FILE

#define MCA_TEXT(x) #x
#define MCA_BEGIN(rows) "# LLVM-MCA-BEGIN i8 rows=" MCA_TEXT(rows)

ISA_INT8_TARGET_BEGIN
void mca_i8(const vi (*codes)[RV][2][4], const int8_t *xq, int k, int tiles, int32_t *out) {
    vi acc[I8_ROWS][RV];
    for (int r = 0; r < I8_ROWS; r++)
        for (int rv = 0; rv < RV; rv++) acc[r][rv] = i_zero();
    for (int t = 0; t < tiles; t++) {
        __asm__ volatile(MCA_BEGIN(I8_ROWS));
        i8_rows_dots(acc, codes[t], xq + (size_t)t * LUT_TILE_K, k, I8_ROWS);
        __asm__ volatile("# LLVM-MCA-END i8");
    }
    for (int r = 0; r < I8_ROWS; r++)
        for (int rv = 0; rv < RV; rv++) memcpy(out + (r * RV + rv) * W, &acc[r][rv], sizeof acc[r][rv]);
}
ISA_INT8_TARGET_END
