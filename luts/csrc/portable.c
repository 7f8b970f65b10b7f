/* Portable scalar kernels: the C transcription of luts/spec.py over the tiled layout.
 * Always built; the ISA files must match these bit for bit (tables, accumulators,
 * dequantised weights). Compiled with -ffp-contract=off so no multiply-add is fused.
 */
#include <math.h>
#include <string.h>

#include "lut.h"

float lut_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant) { /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define R(i, idx) ((((idx) & 1u) << (i)) | ((((idx) >> 1) & 1u) << (8 + (i))) | \
                   ((((idx) >> 2) & 1u) << (16 + (i))) | ((((idx) >> 3) & 1u) << (24 + (i))))
#define ROW(i) {R(i, 0), R(i, 1), R(i, 2), R(i, 3), R(i, 4), R(i, 5), R(i, 6), R(i, 7), \
                R(i, 8), R(i, 9), R(i, 10), R(i, 11), R(i, 12), R(i, 13), R(i, 14), R(i, 15)}
const uint32_t lut_repack[8][16] = {ROW(0), ROW(1), ROW(2), ROW(3), ROW(4), ROW(5), ROW(6), ROW(7)};
#define B(i, j, idx) ((uint8_t)((R(i, idx) >> (8 * (j))) & 0xFF))
#define BYTES(i, j) {B(i, j, 0), B(i, j, 1), B(i, j, 2), B(i, j, 3), B(i, j, 4), B(i, j, 5), B(i, j, 6), B(i, j, 7), \
                     B(i, j, 8), B(i, j, 9), B(i, j, 10), B(i, j, 11), B(i, j, 12), B(i, j, 13), B(i, j, 14), \
                     B(i, j, 15)}
#define PLANE(i) {BYTES(i, 0), BYTES(i, 1), BYTES(i, 2), BYTES(i, 3)}
const uint8_t lut_repack_bytes[8][4][16] = {PLANE(0), PLANE(1), PLANE(2), PLANE(3), PLANE(4), PLANE(5), PLANE(6),
                                            PLANE(7)};

/* T[e] for one run of four activations: odd e computed left to right, even e mirrored. */
static void run_table(const float *x, float *t) {
    for (int e = 1; e < 16; e += 2) {
        float v = x[0];
        v = (e & 2) ? v + x[1] : v - x[1];
        v = (e & 4) ? v + x[2] : v - x[2];
        v = (e & 8) ? v + x[3] : v - x[3];
        t[e] = v;
        t[15 - e] = -v;
    }
}

void tables_portable(const float *x, int k, int group, int table_bits, void *tq, float *t_scales, int32_t *xq) {
    const int runs = group / 4;
    const float qmax = table_bits == 8 ? 127.0f : 32767.0f;
    float t[128 / 4][16];
    for (int g = 0; g < k / group; g++) {
        float amax = 0.0f;
        for (int c = 0; c < runs; c++) {
            run_table(x + (size_t)(g * runs + c) * 4, t[c]);
            for (int e = 1; e < 16; e += 2) amax = fmaxf(amax, fabsf(t[c][e]));
        }
        const float inv = amax > 0.0f ? qmax / amax : 0.0f;
        t_scales[g] = amax / qmax;
        int32_t sum = 0;
        for (int c = 0; c < runs; c++) {
            size_t at = (size_t)(g * runs + c) * 16;
            for (int e = 0; e < 16; e++) {
                int v = (int)nearbyintf(t[c][e] * inv);
                if (table_bits == 8) ((int8_t *)tq)[at + e] = (int8_t)v;
                else ((int16_t *)tq)[at + e] = (int16_t)v;
            }
            sum += table_bits == 8 ? ((int8_t *)tq)[at + 15] : ((int16_t *)tq)[at + 15];
        }
        xq[g] = sum;
    }
}

static inline int32_t entry(const lut_tables *t, int run, int idx) {
    return t->table_bits == 8 ? ((const int8_t *)t->tq)[run * 16 + idx] : ((const int16_t *)t->tq)[run * 16 + idx];
}

void gemv_portable(const lut_weight *w, const lut_tables *t, int rb0, int rb1, float *y, int32_t *acc) {
    const int groups = lut_groups(w), tiles_per_group = w->group / LUT_TILE_K;
    for (int rb = rb0; rb < rb1; rb++) {
        float out[LUT_ROWS] = {0};
        for (int g = 0; g < groups; g++) {
            int32_t a[LUT_ROWS] = {0};
            for (int kt = g * tiles_per_group; kt < (g + 1) * tiles_per_group; kt++) {
                const uint8_t *tile = lut_tile(w, rb, kt);
                for (int i = 0; i < w->bits; i++, tile += LUT_TILE_BYTES)
                    for (int r = 0; r < LUT_ROWS; r++)
                        for (int p = 0; p < 4; p++) {
                            uint8_t byte = tile[LUT_TILE_BYTE(r, p)];
                            a[r] += (entry(t, 8 * kt + p, byte & 15) + entry(t, 8 * kt + 4 + p, byte >> 4)) * (1 << i);
                        }
            }
            const size_t at = lut_block_param(w, rb, g);
            const float half_ts = t->t_scales[g] * 0.5f;
            for (int r = 0; r < LUT_ROWS; r++) {
                if (acc) acc[((size_t)rb * LUT_ROWS + r) * groups + g] = a[r];
                float total = (float)a[r] + (float)lut_zero_term(w, at + r) * (float)t->xq[g]; /* exact: < 2^24 */
                out[r] += lut_half_to_float(w->scales[at + r]) * half_ts * total;
            }
        }
        memcpy(y + (size_t)rb * LUT_ROWS, out, sizeof out);
    }
}

void dequant_tile_portable(const lut_weight *w, int rb, int kt, float *panel, int ld) {
    const uint8_t *tile = lut_tile(w, rb, kt);
    const size_t at = lut_block_param(w, rb, kt * LUT_TILE_K / w->group);
    for (int r = 0; r < LUT_ROWS; r++) {
        const int z = lut_zero(w, at + r);
        const float s = lut_half_to_float(w->scales[at + r]);
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < 4; p++) {
                uint32_t word = 0; /* level 1: four codes as four bytes */
                for (int i = 0; i < w->bits; i++)
                    word |= lut_repack[i][(tile[i * LUT_TILE_BYTES + LUT_TILE_BYTE(r, p)] >> (4 * h)) & 15];
                for (int j = 0; j < 4; j++) /* level 2: fp32(q - z) * s, the value table's entry */
                    panel[(16 * h + 4 * p + j) * ld + r] = (float)((int)((word >> (8 * j)) & 0xFF) - z) * s;
            }
    }
}

void gemm_portable(const lut_weight *w, const float *xt, int m_pad, int m, int rb0, int rb1, float *y, int ldy) {
    float panel[LUT_TILE_K * LUT_ROWS];
    for (int rb = rb0; rb < rb1; rb++) {
        for (int row = 0; row < m; row++) memset(y + (size_t)row * ldy + rb * LUT_ROWS, 0, LUT_ROWS * sizeof(float));
        for (int kt = 0; kt < lut_k_tiles(w); kt++) {
            dequant_tile_portable(w, rb, kt, panel, LUT_ROWS);
            for (int row = 0; row < m; row++) {
                float *out = y + (size_t)row * ldy + rb * LUT_ROWS;
                for (int kk = 0; kk < LUT_TILE_K; kk++) {
                    const float xv = xt[(size_t)(kt * LUT_TILE_K + kk) * m_pad + row];
                    for (int r = 0; r < LUT_ROWS; r++) out[r] += xv * panel[kk * LUT_ROWS + r];
                }
            }
        }
    }
}
