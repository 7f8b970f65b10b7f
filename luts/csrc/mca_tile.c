/* The LUT-GEMV's inner loop alone, for llvm-mca: one tile (32 inputs x 16 rows) of BITS planes per
 * iteration, between llvm-mca's region markers, with the tables and accumulators as gemv_rows keeps them for
 * groups of 64 inputs (2 tiles, as `bench lut` runs). */
#include NPUMOE_ISA_FILE

ISA_GEMV_BEGIN
void mca_tiles(const uint8_t *tile, const void *tq, int tiles, int32_t *out) {
    vi a[RV][ACC];
    for (int rv = 0; rv < RV; rv++)
        for (int j = 0; j < ACC; j++) a[rv][j] = i_zero();
    for (int kt = 0; kt < tiles; kt++, tile += BITS * LUT_TILE_BYTES) {
        __asm__ volatile("# LLVM-MCA-BEGIN tile");
        const kt_tables tables = load_tables(tq, kt);
        tile_dots(a, tile, &tables, BITS, 2);
        __asm__ volatile("# LLVM-MCA-END tile");
    }
    for (int rv = 0; rv < RV; rv++)
        for (int j = 0; j < ACC; j++) memcpy(out + (rv * ACC + j) * W, &a[rv][j], sizeof a[rv][j]);
}
ISA_GEMV_END
