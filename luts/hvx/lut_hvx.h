/* T-MAN's LUT-GEMV on HVX (128-byte vectors), split as T-MAN splits it:
 *   precompute  activations → int16 tables in VLUT16 register order, scale and Σx per group;
 *   linear      VLUT16 lookups accumulated in int32 over runs and bit planes: A[n, g];
 *   finalize    y[n] = Σ_g s·t_scale/2·(A + (2^b − 1 − 2z)·Xq).
 * Layouts (written by luts/hvx/layout.py; every assumption is tested against luts/spec.py):
 *   tiles   [NB][G][b][P][128] u8, P = group/8 run pairs: byte j of a vector holds row
 *           HVX_ROW(j) of the 128-row block; low nibble run 2p, high nibble run 2p+1.
 *   tables  [K/16][64] i16: four runs per vector; entry e of the run at selector t sits at
 *           halfword 2·(16·(t & 1) + e) + (t >> 1), the slot VLUT16 reads for Rt = t.
 *   A       [NB][G][128] i32 in natural row order (the HVX_ROW permutation undoes VLUT16's
 *           even/odd byte split and vadd's even/odd halfword split).
 */
#ifndef NPUMOE_LUT_HVX_H
#define NPUMOE_LUT_HVX_H

#include <stddef.h>
#include <stdint.h>

#define HVX_BYTES 128
#define HVX_ROWS 128
#define HVX_ROW(j) (32 * ((0xD8 >> (2 * ((j) & 3)) & 3)) + ((j) >> 2)) /* 0,2,1,3 quarters */

typedef struct {
    int bits, group, row_blocks, k;
    const uint8_t *tiles;
    const float *scales;  /* [NB][G][128], fp16 values widened exactly */
    const uint8_t *zeros; /* [NB][G][128] */
} hvx_weight;

typedef struct {
    int16_t *tables; /* [K/16][64] */
    float *t_scales; /* [G] */
    int32_t *xq;     /* [G] */
} hvx_tables;

/* K / group without a divide (Hexagon has none and there is no libgcc); group ∈ {32, 64, 128}. */
static inline int hvx_groups(int k, int group) { return k >> (group == 32 ? 5 : group == 64 ? 6 : 7); }

void hvx_precompute(const float *x, int k, int group, const hvx_tables *t);
int hvx_linear_supported(int bits, int group);
void hvx_linear(const hvx_weight *w, const int16_t *tables, int32_t *acc);
void hvx_linear_reference(const hvx_weight *w, const int16_t *tables, int32_t *acc);
void hvx_finalize(const hvx_weight *w, const int32_t *acc, const hvx_tables *t, float *y);

#endif
