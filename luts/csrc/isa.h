/* The fast kernels each instruction set provides: same contracts as the *_portable ones in
 * lut.h (tables and GEMV for 8-bit tables; 16-bit tables always use the portable path).
 */
#ifndef NPUMOE_ISA_H
#define NPUMOE_ISA_H

#include "lut.h"

#define ISA_KERNELS(isa)                                                                                     \
    void tables_##isa(const float *x, int k, int group, int table_bits, void *tq, float *t_scales, int32_t *xq); \
    void gemv_##isa(const lut_weight *w, const lut_tables *t, int rb0, int rb1, float *y, int32_t *acc);       \
    void gemv_multi_##isa(const lut_weight *w, const lut_tables *const *t, int rb0, int rb1, float *const *y,      \
                          int rows);                                                                             \
    void dequant_tile_##isa(const lut_weight *w, int rb, int kt, float *panel, int ld);                               \
    void gemm_##isa(const lut_weight *w, const float *xt, int m_pad, int m, int rb0, int rb1, float *y, int ldy);    \
    void bf16_gemm_##isa(const uint16_t *w, int n, int k, const float *x, const float *xtb, int m, int b0, int b1, \
                         float *y);                                                                                 \
    void bf16_xtb_##isa(const float *x, int m, int k, int blk0, int blk1, float *xtb);

#define AVX512_MR 8 /* GEMM microkernel: 8 activation rows × 32 output rows */
#define AVX2_MR 6   /* 6 × 16 */
#define NEON_MR 4   /* 4 × 16 */

/* Activation rows a multi-row GEMV takes at once: as many as their tables and accumulators leave registers for. */
#define AVX512_GEMV_MR 4
#define AVX2_GEMV_MR 4 /* at 1-2 bits; 2 above (avx2.c's GEMV_WIDE) */
#define NEON_GEMV_MR 2
#define LUT_MAX_GEMV_MR 4

/* bf16_gemm: y [m][n] = x · Wᵀ for weight blocks b0..b1-1 of 6 rows (W [n][k] bf16, k a multiple of 16), from xtb
 * (x transposed in blocks of 16 rows: [m_pad/16][k][16]), which bf16_xtb writes a range of blocks of. */
#define BF16_GEMM_ROWS 6
/* The activation rows that go through xtb's blocks: all but the 1-BF16_DOT_TAIL past the last whole 8, which take
 * dot products (simd_kernels.h, bf16_dot_chunk), so are neither transposed nor padded to a block. */
#define BF16_DOT_TAIL 4
#define BF16_BLOCK_ROWS(m) ((m) - ((m) % 8 <= BF16_DOT_TAIL ? (m) % 8 : 0))

/* 3-4-bit weights × int8 activations, where the ISA has byte dot products (simd_kernels.h): int8_rows quantises
 * x [m][k] per group (spec's quantize_activations) into xq in the order gemm_i8 reads it (per 32-input tile, input
 * 16h + 4p + j at byte 4(4h + j) + p), with each group's scale xs and Σ xq. */
#define ISA_INT8_KERNELS(isa)                                                                                    \
    void int8_rows_##isa(const float *x, int m, int k, int group, int8_t *xq, float *xs, int32_t *xsum);        \
    void gemm_i8_##isa(const lut_weight *w, const int8_t *xq, const float *xs, const int32_t *xsum, int m, int rb0, \
                       int rb1, float *y, int ldy);

ISA_KERNELS(avx512)
ISA_INT8_KERNELS(avx512)
ISA_KERNELS(avx2)
ISA_INT8_KERNELS(avx2)
ISA_KERNELS(neon)
/* NEON's int8 GEMM takes ARMv8.2's dot products (sdot): built where the compiler targets them, or (GCC) can
 * target them in the int8 functions alone, and run only where the CPU reports them (npumoe_lut_gemm_i8). */
#if defined(__aarch64__) && (defined(__ARM_FEATURE_DOTPROD) || (defined(__GNUC__) && !defined(__clang__)))
#define NEON_INT8_DOTS 1
ISA_INT8_KERNELS(neon)
#endif

#endif
