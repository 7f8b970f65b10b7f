/* The SIMD kernels, written once over a small vector vocabulary. avx512.c, avx2.c and
 * neon.c each define the vocabulary below and then include this file; it yields
 * tables_<isa>, gemv_<isa>, dequant_tile_<isa> and gemm_<isa> with the contracts of the
 * *_portable functions (lut.h), bit for bit.
 *
 * Vocabulary (W = 32-bit lanes per vector = tile rows per vector):
 *   ISA(name)                     name##_<isa>
 *   vf, vi                        float and integer vectors
 *   f_zero f_set1 f_load f_store f_add f_sub f_mul f_fmadd(a,b,c)=a·b+c f_max f_abs f_xor
 *   f_reduce_max f_from_i         (int32 → float) f_half(p) (W float16 → float) f_bf16(p) (W bf16 → float)
 *   i_zero i_load(p) i_u8(p)      (W bytes → int32) i_add i_sub i_set1
 *   i_add_u8_times(a, p, c)       a + (W bytes at p) · c, for |c| < 2^15
 *   i_table16(p)                  a 16-byte table in every 128-bit lane
 *   i_lookup16(table, idx)        per-byte lookup, idx < 16
 *   i_nibble(v, h)                nibble h (0 low, 1 high) of every byte
 *   i_store(p, v)                 4W bytes to p
 *   store_run(dst, t[16/W], inv)  16 table entries · inv, rounded half-even, as int8 (not needed when the
 *                                 ISA file defines ISA_OWN_TABLES and its own tables_<isa>)
 *   kt_tables load_tables(tq, kt) and tile_dot(a[RV][ACC], tile, &tables, i): the GEMV core,
 *     adding 2^i · (row's four looked-up bytes, low and high nibbles) into int32 lanes, spread
 *     over ACC accumulators per row vector (summed at the end of each group); or, with
 *     ISA_OWN_TILE_DOTS, tile_dots(a, tile, &tables, bits, tiles) for all planes of a tile at once (tiles: the
 *     group's), and with ISA_OWN_GROUP_TOTAL, group_totals(totals, a, bias, zeros, zero_coef, bits, tiles) the
 *     group's int32 totals of all RV row vectors from accumulators it keeps its own way
 *   GEMM_ROW_BLOCKS, GEMM_MR      microkernel shape: MR activations × 16·GEMM_ROW_BLOCKS rows
 *   ISA_GEMV_BEGIN / _END         optional: compiler options for the LUT-GEMV's section alone
 */
#include <stdlib.h>
#include <string.h>

#define RV (LUT_ROWS / W)  /* vectors per 16 rows */
#define EV (16 / W)        /* vectors per 16 table entries */
#define KC 256             /* inputs per GEMM panel: 256 × 32 floats = 32 KB, inside L1 */
#define PANEL_LD (GEMM_ROW_BLOCKS * LUT_ROWS)

#define FOR_BITS(call)                  \
    switch (w->bits) {                  \
    case 1: call(1); break;             \
    case 2: call(2); break;             \
    case 3: call(3); break;             \
    case 4: call(4); break;             \
    case 5: call(5); break;             \
    case 6: call(6); break;             \
    default: call(8); break;            \
    }

#ifndef ISA_OWN_TABLES
/* The fp32 table entries of one group's runs into t, returning their largest magnitude. */
static inline __attribute__((always_inline)) float group_entries(const float *x, int runs, const float minus[4][16],
                                                                 const float *mirror, vf t[][EV]) {
    vf amax = f_zero();
    for (int c = 0; c < runs; c++) {
        const float *xc = x + (size_t)c * 4;
        for (int v = 0; v < EV; v++) {
            vf e = f_set1(xc[0]); /* odd entries left to right; even ones negated */
            for (int j = 1; j < 4; j++) e = f_add(e, f_xor(f_set1(xc[j]), f_load(minus[j] + v * W)));
            t[c][v] = f_xor(e, f_load(mirror + v * W));
            amax = f_max(amax, f_abs(t[c][v]));
        }
    }
    return f_reduce_max(amax);
}

/* Groups are built one ahead of their quantisation, so the wait for each group's maximum and
 * scale (a reduction and two divisions) overlaps the next group's entries. */
void ISA(tables)(const float *x, int k, int group, int table_bits, void *tq_out, float *t_scales, int32_t *xq) {
    (void)table_bits; /* 8 only: 16-bit tables take the portable path */
    int8_t *tq = tq_out;
    const int runs = group / 4, groups = k / group;
    float minus[4][16], mirror[16]; /* −0.0 where entry e (via its odd partner) subtracts x_j; where e is even */
    for (int e = 0; e < 16; e++) {
        const int partner = e & 1 ? e : 15 - e;
        for (int j = 1; j < 4; j++) minus[j][e] = (partner >> j) & 1 ? 0.0f : -0.0f;
        mirror[e] = e & 1 ? 0.0f : -0.0f;
    }
    vf t[2][128 / 4][EV];
    float am = group_entries(x, runs, minus, mirror, t[0]);
    for (int g = 0; g < groups; g++) {
        const float next =
            g + 1 < groups ? group_entries(x + (size_t)(g + 1) * group, runs, minus, mirror, t[(g + 1) & 1]) : 0.0f;
        const vf inv = f_set1(am > 0.0f ? 127.0f / am : 0.0f);
        t_scales[g] = am / 127.0f;
        int32_t sum = 0;
        for (int c = 0; c < runs; c++) {
            int8_t *run = tq + (size_t)(g * runs + c) * 16;
            store_run(run, t[g & 1][c], inv);
            sum += run[15];
        }
        xq[g] = sum;
        am = next;
    }
}
#endif

/* One group's share for W rows, s · ts/2 · total, added to out; the total, A + (2^b − 1 − 2z)·Xq (group_totals), is
 * an integer below 2^24, so its float is exact. */
static inline __attribute__((always_inline)) vf epilogue(const uint16_t *scales, vf half_ts, vi total, vf out) {
    return f_fmadd(f_mul(f_half(scales), half_ts), f_from_i(total), out);
}

#ifndef ISA_OWN_GROUP_TOTAL
/* A group's totals per row vector: its int32 row sums A (the accumulators, zero at the group's start) plus the bias
 * and zero terms of lut_tables, bias + z·zero_coef (zeros NULL: symmetric weights, whose bias covers z). */
static inline void group_totals(vi totals[RV], const vi a[RV][ACC], int32_t bias, const uint8_t *zeros,
                                int32_t zero_coef, const int bits, const int tiles) {
    (void)bits, (void)tiles;
    for (int rv = 0; rv < RV; rv++) {
        totals[rv] = i_set1(bias);
        for (int j = 0; j < ACC; j++) totals[rv] = i_add(totals[rv], a[rv][j]);
        if (zeros) totals[rv] = i_add_u8_times(totals[rv], zeros + rv * W, zero_coef);
    }
}
#endif

#ifndef ISA_OWN_TILE_DOTS
/* A tile's planes, one tile_dot each (an ISA whose planes can share wider work defines its own). */
static inline __attribute__((always_inline)) void tile_dots(vi a[][ACC], const uint8_t *tile, const kt_tables *t,
                                                            const int bits, const int tiles) {
    (void)tiles;
#pragma GCC unroll 8
    for (int i = 0; i < bits; i++) {
        lut_prefetch_line(tile + i * LUT_TILE_BYTES);
        tile_dot(a, tile + i * LUT_TILE_BYTES, t, i);
    }
}
#endif

#ifndef ISA_GEMV_BEGIN /* what the LUT-GEMV's functions need beyond the build's flags (nothing if unset) */
#define ISA_GEMV_BEGIN
#define ISA_GEMV_END
#endif
ISA_GEMV_BEGIN
/* Everything the loops need is copied into locals first: through the pointers the compiler
 * cannot rule out that a store to y or acc changes w->k, and would redo k / group per group. */
static inline __attribute__((always_inline)) void gemv_rows(const lut_weight *w, const lut_tables *t, int rb0, int rb1,
                                                            float *y, int32_t *acc, const int bits,
                                                            const int tiles_per_group) {
    const int groups = lut_groups(w);
    const size_t tile_stride = (size_t)lut_k_tiles(w) * bits * LUT_TILE_BYTES, param_stride = (size_t)groups * LUT_ROWS;
    const void *tq = t->tq;
    const float *half_ts = t->half_ts;
    const int32_t *bias = t->bias, *zero_coef = t->zero_coef;
    for (int rb = rb0; rb < rb1; rb++) {
        const uint8_t *tile = w->tiles + rb * tile_stride;
        const uint16_t *scales = w->scales + rb * param_stride;
        const uint8_t *zeros = w->zeros ? w->zeros + rb * param_stride : NULL;
        vf out[RV];
        for (int rv = 0; rv < RV; rv++) out[rv] = f_zero();
        for (int g = 0; g < groups; g++, scales += LUT_ROWS, zeros = zeros ? zeros + LUT_ROWS : NULL) {
            vi a[RV][ACC];
            for (int rv = 0; rv < RV; rv++)
                for (int j = 0; j < ACC; j++) a[rv][j] = i_zero();
            for (int kt = g * tiles_per_group; kt < (g + 1) * tiles_per_group; kt++, tile += bits * LUT_TILE_BYTES) {
                const kt_tables tables = load_tables(tq, kt);
                tile_dots(a, tile, &tables, bits, tiles_per_group);
            }
            __builtin_prefetch(scales + LUT_PREFETCH_PARAMS, 0, 2);
            if (zeros) __builtin_prefetch(zeros + LUT_PREFETCH_PARAMS, 0, 2);
            const vf group_half_ts = f_set1(half_ts[g]);
            vi totals[RV];
            if (acc) {
                group_totals(totals, a, 0, NULL, 0, bits, tiles_per_group);
                for (int rv = 0; rv < RV; rv++) {
                    int32_t lanes[W];
                    memcpy(lanes, &totals[rv], sizeof lanes);
                    for (int r = 0; r < W; r++) acc[((size_t)rb * LUT_ROWS + rv * W + r) * groups + g] = lanes[r];
                }
            }
            group_totals(totals, a, bias[g], zeros, zero_coef[g], bits, tiles_per_group);
            for (int rv = 0; rv < RV; rv++) out[rv] = epilogue(scales + rv * W, group_half_ts, totals[rv], out[rv]);
        }
        for (int rv = 0; rv < RV; rv++) f_store(y + (size_t)rb * LUT_ROWS + rv * W, out[rv]);
    }
}

/* At 1-2 bits a group is at most four tiles, and a loop over a run-time count of them costs as much
 * as the tiles (accumulators copied between registers each time round, the loop set up per group):
 * with the count fixed at compile time the group is straight-line code. At 4 bits the same code is
 * no faster (docs/performance.md, "LUT-GEMV group loop"). */
#define WITH_TILES_PER_GROUP(call, bits, group) \
    if ((bits) > 2)                             \
        call((group) / LUT_TILE_K);             \
    else if ((group) == 32)                     \
        call(1);                                \
    else if ((group) == 64)                     \
        call(2);                                \
    else                                        \
        call(4);

static inline __attribute__((always_inline)) void gemv_bits(const lut_weight *w, const lut_tables *t, int rb0, int rb1,
                                                            float *y, int32_t *acc, const int bits) {
#define ROWS(tiles) gemv_rows(w, t, rb0, rb1, y, acc, bits, tiles)
    WITH_TILES_PER_GROUP(ROWS, bits, w->group)
#undef ROWS
}

void ISA(gemv)(const lut_weight *w, const lut_tables *t, int rb0, int rb1, float *y, int32_t *acc) {
/* acc NULL (every call but the accumulators' tests) a constant: the group loop without its stores keeps its pointers
 * in registers (docs/performance.md, "LUT-GEMV group loop"). */
#define GEMV(b)                                           \
    if (acc)                                              \
        gemv_bits(w, t, rb0, rb1, y, acc, b);             \
    else                                                  \
        gemv_bits(w, t, rb0, rb1, y, NULL, b);
    FOR_BITS(GEMV)
#undef GEMV
}

/* The same rows against mr ≤ GEMV_MR activation rows at once (prefill: an expert's few tokens): each tile plane is
 * loaded and split once for all of them, and every row keeps the one-row loop's accumulators and order, so each
 * y[r] equals gemv's bit for bit. */
static inline __attribute__((always_inline)) void gemv_rows_multi(const lut_weight *w, const lut_tables *const *t,
                                                                  int rb0, int rb1, float *const *y, const int bits,
                                                                  const int tiles_per_group, const int mr) {
    const int groups = lut_groups(w);
    const size_t tile_stride = (size_t)lut_k_tiles(w) * bits * LUT_TILE_BYTES, param_stride = (size_t)groups * LUT_ROWS;
    for (int rb = rb0; rb < rb1; rb++) {
        const uint8_t *tile = w->tiles + rb * tile_stride;
        const uint16_t *scales = w->scales + rb * param_stride;
        const uint8_t *zeros = w->zeros ? w->zeros + rb * param_stride : NULL;
        vf out[GEMV_MR][RV];
        for (int r = 0; r < mr; r++)
            for (int rv = 0; rv < RV; rv++) out[r][rv] = f_zero();
        for (int g = 0; g < groups; g++, scales += LUT_ROWS, zeros = zeros ? zeros + LUT_ROWS : NULL) {
            vi a[GEMV_MR][RV][ACC];
            for (int r = 0; r < mr; r++)
                for (int rv = 0; rv < RV; rv++)
                    for (int j = 0; j < ACC; j++) a[r][rv][j] = i_zero();
            for (int kt = g * tiles_per_group; kt < (g + 1) * tiles_per_group; kt++, tile += bits * LUT_TILE_BYTES) {
                kt_tables tables[GEMV_MR];
                for (int r = 0; r < mr; r++) tables[r] = load_tables(t[r]->tq, kt);
#ifdef ISA_OWN_TILE_DOTS
                for (int r = 0; r < mr; r++) tile_dots(a[r], tile, &tables[r], bits, tiles_per_group);
#else
#pragma GCC unroll 8
                for (int i = 0; i < bits; i++) {
                    lut_prefetch_line(tile + i * LUT_TILE_BYTES);
                    for (int r = 0; r < mr; r++) tile_dot(a[r], tile + i * LUT_TILE_BYTES, &tables[r], i);
                }
#endif
            }
            __builtin_prefetch(scales + LUT_PREFETCH_PARAMS, 0, 2);
            if (zeros) __builtin_prefetch(zeros + LUT_PREFETCH_PARAMS, 0, 2);
            for (int r = 0; r < mr; r++) {
                const vf group_half_ts = f_set1(t[r]->half_ts[g]);
                vi totals[RV];
                group_totals(totals, a[r], t[r]->bias[g], zeros, t[r]->zero_coef[g], bits, tiles_per_group);
                for (int rv = 0; rv < RV; rv++)
                    out[r][rv] = epilogue(scales + rv * W, group_half_ts, totals[rv], out[r][rv]);
            }
        }
        for (int r = 0; r < mr; r++)
            for (int rv = 0; rv < RV; rv++) f_store(y[r] + (size_t)rb * LUT_ROWS + rv * W, out[r][rv]);
    }
}

/* Passes of mr rows over t/y's `rows` entries, a short last one repeating its last row (same values, place). */
static inline __attribute__((always_inline)) void gemv_passes(const lut_weight *w, const lut_tables *const *t,
                                                              int rb0, int rb1, float *const *y, int rows,
                                                              const int bits, const int mr) {
    for (int r0 = 0; r0 < rows; r0 += mr) {
        const lut_tables *tp[GEMV_MR];
        float *yp[GEMV_MR];
        for (int r = 0; r < mr; r++) {
            const int i = r0 + r < rows ? r0 + r : rows - 1;
            tp[r] = t[i], yp[r] = y[i];
        }
#define ROWS(tiles) gemv_rows_multi(w, tp, rb0, rb1, yp, bits, tiles, mr)
        WITH_TILES_PER_GROUP(ROWS, bits, w->group)
#undef ROWS
    }
}

/* `rows` ≤ GEMV_MR activation rows: one pass of GEMV_MR, or where the ISA says that many lose (GEMV_WIDE false),
 * passes of GEMV_NARROW_MR. */
void ISA(gemv_multi)(const lut_weight *w, const lut_tables *const *t, int rb0, int rb1, float *const *y, int rows) {
#ifdef GEMV_NARROW_MR
#define GEMV_MULTI(b)                                                             \
    if (GEMV_WIDE(b, rows))                                                       \
        gemv_passes(w, t, rb0, rb1, y, rows, b, GEMV_MR);                         \
    else                                                                          \
        gemv_passes(w, t, rb0, rb1, y, rows, b, GEMV_NARROW_MR);
#else
#define GEMV_MULTI(b) gemv_passes(w, t, rb0, rb1, y, rows, b, GEMV_MR);
#endif
    FOR_BITS(GEMV_MULTI)
#undef GEMV_MULTI
}
ISA_GEMV_END

/* Level 1 of the dequantisation (byte j of the spec's repack word, a plane at a time), from one vector of each of
 * a tile's planes split into nibbles (nib[h][i]: nibble h of plane i): byte b of q[h] is the code of the input
 * whose index is nibble h of byte b, position j within its run of four. One j at a time, so a caller can use each
 * before the next (dequant_tile: 8 codes vectors live at once spill AVX2's registers and slow its GEMM). */
static inline __attribute__((always_inline)) void plane_nibbles(const vi *v, const int bits, vi nib[2][8]) {
    for (int i = 0; i < bits; i++) {
        nib[0][i] = i_nibble(v[i], 0);
        nib[1][i] = i_nibble(v[i], 1);
    }
}

static inline __attribute__((always_inline)) void repack_codes(vi nib[2][8], const int bits, const int j, vi q[2]) {
    q[0] = q[1] = i_zero();
    for (int i = 0; i < bits; i++) {
        const vi table = i_table16(lut_repack_bytes[i][j]);
        for (int h = 0; h < 2; h++) q[h] = i_or(q[h], i_lookup16(table, nib[h][i]));
    }
}

/* Level 1 runs over whole vectors of a tile's planes into codes, whose byte LUT_TILE_BYTE(r, p) of [h][j] is the
 * code of row r's input 16h + 4p + j; level 2 reads W rows of one position p at a time, as the panel's float rows
 * want them. */
static inline __attribute__((always_inline)) void dequant_tile_bits(const lut_weight *w, int rb, int kt, float *panel,
                                                                    int ld, const int bits) {
    const uint8_t *tile = lut_tile(w, rb, kt);
    const size_t at = lut_block_param(w, rb, kt * LUT_TILE_K / w->group);
    uint8_t codes[2][4][LUT_TILE_BYTES] __attribute__((aligned(64)));
    for (int c = 0; c < LUT_TILE_BYTES; c += 4 * W) { /* a vector holds 4W bytes */
        vi v[8], nib[2][8];
        for (int i = 0; i < bits; i++) v[i] = i_load(tile + i * LUT_TILE_BYTES + c);
        plane_nibbles(v, bits, nib);
        for (int j = 0; j < 4; j++) {
            vi q[2];
            repack_codes(nib, bits, j, q);
            for (int h = 0; h < 2; h++) i_store(codes[h][j] + c, q[h]);
        }
    }
    for (int rv = 0; rv < RV; rv++) {
        const vf s = f_half(w->scales + at + rv * W);
        const vf z = w->zeros ? f_from_i(i_u8(w->zeros + at + rv * W)) : f_set1((float)(1 << (bits - 1)));
        const vf minus_sz = f_sub(f_zero(), f_mul(s, z)); /* exact, so q·s − s·z rounds to (q − z)·s */
        for (int h = 0; h < 2; h++)
            for (int p = 0; p < 4; p++)
                for (int j = 0; j < 4; j++)
                    f_store(panel + (16 * h + 4 * p + j) * ld + rv * W,
                            f_fmadd(f_from_i(i_u8(codes[h][j] + LUT_TILE_BYTE(rv * W, p))), s, minus_sz));
    }
}

void ISA(dequant_tile)(const lut_weight *w, int rb, int kt, float *panel, int ld) {
#define DEQUANT(b) dequant_tile_bits(w, rb, kt, panel, ld, b)
    FOR_BITS(DEQUANT)
#undef DEQUANT
}

/* y[0..rows) × PANEL_LD columns (+)= xtᵀ [GEMM_MR][kc] · panel [kc][PANEL_LD]; `vecs` columns are real. */
static inline void microkernel(const float *xt, int m_pad, const float *panel, int kc, float *y, int ldy, int rows,
                               int first, int vecs) {
    enum { NV = PANEL_LD / W };
    vf c[GEMM_MR][NV];
    for (int r = 0; r < GEMM_MR; r++)
        for (int v = 0; v < NV; v++)
            c[r][v] = !first && r < rows && v < vecs ? f_load(y + (size_t)r * ldy + v * W) : f_zero();
    for (int kk = 0; kk < kc; kk++) {
        vf b[NV];
        for (int v = 0; v < NV; v++) b[v] = f_load(panel + kk * PANEL_LD + v * W);
        const float *a = xt + (size_t)kk * m_pad;
#pragma GCC unroll 8
        for (int r = 0; r < GEMM_MR; r++) {
            const vf ar = f_set1(a[r]);
            for (int v = 0; v < NV; v++) c[r][v] = f_fmadd(ar, b[v], c[r][v]);
        }
    }
    for (int r = 0; r < GEMM_MR && r < rows; r++)
        for (int v = 0; v < vecs; v++) f_store(y + (size_t)r * ldy + v * W, c[r][v]);
}

void ISA(gemm)(const lut_weight *w, const float *xt, int m_pad, int m, int rb0, int rb1, float *y, int ldy) {
    float panel[KC * PANEL_LD] __attribute__((aligned(64)));
    for (int rb = rb0; rb < rb1; rb += GEMM_ROW_BLOCKS) {
        const int blocks = rb1 - rb < GEMM_ROW_BLOCKS ? rb1 - rb : GEMM_ROW_BLOCKS;
        if (blocks < GEMM_ROW_BLOCKS) memset(panel, 0, sizeof panel);
        for (int k0 = 0; k0 < w->k; k0 += KC) {
            const int kc = w->k - k0 < KC ? w->k - k0 : KC;
            for (int kt = k0 / LUT_TILE_K; kt < (k0 + kc) / LUT_TILE_K; kt++)
                for (int b = 0; b < blocks; b++)
                    ISA(dequant_tile)(w, rb + b, kt, panel + (kt * LUT_TILE_K - k0) * PANEL_LD + b * LUT_ROWS,
                                      PANEL_LD);
            for (int m0 = 0; m0 < m_pad; m0 += GEMM_MR)
                microkernel(xt + (size_t)k0 * m_pad + m0, m_pad, panel, kc, y + (size_t)m0 * ldy + rb * LUT_ROWS, ldy,
                            m - m0, k0 == 0, blocks * RV);
        }
    }
}

/* ---- bf16 GEMM: a bf16 model's prompt where the CPU has no bf16 dot products ----
 *
 * The weights take the broadcast side: a pair of blocks of BF16_GEMM_ROWS (6) rows, widened BF16_KC inputs at a
 * time into an L1 scratch, each input a broadcast, times 16 activation rows from xᵀ blocks (xtb [m_pad/16][k][16],
 * zero-padded). Nothing is transposed but the activations (bf16_xtb), and y = x · Wᵀ is exact fp32 arithmetic on the
 * widened weights, in input order (torch's F.linear on W.float(), to summation order; the last few rows,
 * bf16_dot_chunk, sum in W interleaved partial sums). Each chunk is widened once
 * for all the activation blocks of a BF16_M_TILE tile, whose accumulators go to a small scratch between chunks: when
 * a pass widened its rows for every 16 activation rows, the widening's instructions held the multiply-adds below the
 * FMA ports' rate. A prompt's experts get ragged row counts and cold weights: a last block of at most 8 rows takes
 * half the vectors, and widening a chunk asks for the next pair's same inputs (docs/performance.md, "bf16 GEMM"). */
#define BF16_NV (16 / W) /* vectors of activation rows a pass: 12 accumulators on AVX2, 24 on NEON */
#define BF16_KC 256      /* inputs widened at a time: 12 KB a pair of blocks */
#define BF16_M_TILE 128  /* activation rows a widened chunk serves (their xᵀ chunk: 128 KB, in L2) */

/* acc [JR][16] (+)= JR widened weight rows of one chunk of kc inputs times NV vectors of activation rows from the
 * xᵀ block at xb: (JR, NV) is (BF16_GEMM_ROWS, BF16_NV) for a full block of 16 activation rows, or twice the rows
 * and half the vectors for a last block of at most 8 (SIMD widths below 16): as many accumulators, half the
 * padding. Stored and reloaded a chunk at a time, the sums still run over the inputs in order. */
static inline __attribute__((always_inline)) void bf16_gemm_chunk(const float *xb, int kc, const float (*wide)[BF16_KC],
                                                                  const int JR, const int NV, float (*acc)[16],
                                                                  const int first) {
    vf c[2 * BF16_GEMM_ROWS][BF16_NV];
    for (int j = 0; j < JR; j++)
        for (int v = 0; v < NV; v++) c[j][v] = first ? f_zero() : f_load(acc[j] + v * W);
    for (int kk = 0; kk < kc; kk++) {
        vf x[BF16_NV];
        for (int v = 0; v < NV; v++) x[v] = f_load(xb + (size_t)kk * 16 + v * W);
        for (int j = 0; j < JR; j++) {
            const vf a = f_set1(wide[j][kk]);
            for (int v = 0; v < NV; v++) c[j][v] = f_fmadd(a, x[v], c[j][v]);
        }
    }
    for (int j = 0; j < JR; j++)
        for (int v = 0; v < NV; v++) f_store(acc[j] + v * W, c[j][v]);
}

/* xtb blocks blk0 .. blk1-1 from x [m][k], rows past m zero: W × W transposes, 16 / W a block for every W inputs, on
 * all threads (element by element on the calling thread, the transpose was a noticeable share of the product:
 * docs/performance.md, "bf16 GEMM"). */
void ISA(bf16_xtb)(const float *x, int m, int k, int blk0, int blk1, float *xtb) {
    for (int b = blk0; b < blk1; b++)
        for (int h = 0; h < 16 / W; h++) {
            const int r0 = 16 * b + h * W, rows = m - r0;
            for (int kk = 0; kk < k; kk += W) {
                vf v[W];
                for (int t = 0; t < W; t++) v[t] = t < rows ? f_load(x + (size_t)(r0 + t) * k + kk) : f_zero();
                f_transpose(v);
                for (int c = 0; c < W; c++) f_store(xtb + ((size_t)b * k + kk + c) * 16 + h * W, v[c]);
            }
        }
}

/* tail[t][j] (+)= W lanes of partial dot products of activation row t of x (row-major: the last `rows` ≤
 * BF16_DOT_TAIL of the call) with widened weight row j over one chunk. The few rows past the last whole 8
 * (BF16_BLOCK_ROWS) take dot products on the chunk already widened instead of filling a block with padding rows,
 * which a prompt's experts, each with its own row count, paid for (docs/performance.md, "bf16 GEMM"). */
static inline __attribute__((always_inline)) void bf16_dot_chunk(const float *x, int k, int rows, int k0, int kc,
                                                                const float (*wide)[BF16_KC], const int JR,
                                                                vf (*tail)[2 * BF16_GEMM_ROWS], const int first) {
    for (int t = 0; t < rows; t++) {
        vf a[2 * BF16_GEMM_ROWS];
        for (int j = 0; j < JR; j++) a[j] = first ? f_zero() : tail[t][j];
        for (int kk = 0; kk < kc; kk += W) {
            const vf xv = f_load(x + (size_t)t * k + k0 + kk);
            for (int j = 0; j < JR; j++) a[j] = f_fmadd(f_load(wide[j] + kk), xv, a[j]);
        }
        for (int j = 0; j < JR; j++) tail[t][j] = a[j];
    }
}

void ISA(bf16_gemm)(const uint16_t *w, int n, int k, const float *x, const float *xtb, int m, int b0, int b1,
                    float *y) {
    enum { R = BF16_GEMM_ROWS, HALF = BF16_NV / 2 };
    float wide[2 * R][BF16_KC] __attribute__((aligned(64)));
    float acc[BF16_M_TILE / 16][2 * R][16] __attribute__((aligned(64)));
    vf tail[BF16_DOT_TAIL][2 * R];
    const int whole = BF16_BLOCK_ROWS(m); /* rows the blocks take; the rest, dot products */
    for (int mt = 0; mt < m; mt += BF16_M_TILE) {
        const int m_end = m < mt + BF16_M_TILE ? m : mt + BF16_M_TILE, block_end = whole < m_end ? whole : m_end;
        const int tail_rows = m_end == m ? m - whole : 0;
        for (int b = b0; b < b1; b += 2) { /* blocks in pairs: a last activation block of ≤ 8 rows takes both */
            const int r0 = b * R, pair = b + 1 < b1, jr = (1 + pair) * R, rows = n - r0 < jr ? n - r0 : jr;
            const uint16_t *src[2 * R]; /* (a short last block repeats its last row) */
            for (int j = 0; j < jr; j++) src[j] = w + (size_t)(r0 + (j < rows ? j : rows - 1)) * k;
            for (int k0 = 0; k0 < k; k0 += BF16_KC) {
                const int kc = k - k0 < BF16_KC ? k - k0 : BF16_KC;
                for (int j = 0; j < jr; j++) { /* widened once for the tile's activation blocks */
                    for (int kk = 0; kk < kc; kk += W) f_store(wide[j] + kk, f_bf16(src[j] + k0 + kk));
                    if (r0 + jr + j < n) /* the next pair's same inputs, which the next widening reads */
                        for (int kk = 0; kk < kc; kk += 32) __builtin_prefetch(src[j] + (size_t)jr * k + k0 + kk, 0, 2);
                }
                for (int mb = mt; mb < block_end; mb += 16) {
                    const float *xb = xtb + (size_t)mb * k + (size_t)k0 * 16;
                    float (*a)[16] = acc[(mb - mt) / 16];
                    if (HALF && block_end - mb <= 8 && pair)
                        bf16_gemm_chunk(xb, kc, wide, 2 * R, HALF, a, k0 == 0);
                    else if (HALF && block_end - mb <= 8)
                        bf16_gemm_chunk(xb, kc, wide, R, HALF, a, k0 == 0);
                    else
                        for (int h = 0; h <= pair; h++)
                            bf16_gemm_chunk(xb, kc, wide + h * R, R, BF16_NV, a + h * R, k0 == 0);
                }
                if (tail_rows && pair)
                    bf16_dot_chunk(x + (size_t)whole * k, k, tail_rows, k0, kc, wide, 2 * R, tail, k0 == 0);
                else if (tail_rows)
                    bf16_dot_chunk(x + (size_t)whole * k, k, tail_rows, k0, kc, wide, R, tail, k0 == 0);
            }
            for (int mb = mt; mb < block_end; mb++) /* each activation row's outputs as one short run */
                for (int j = 0; j < rows; j++) y[(size_t)mb * n + r0 + j] = acc[(mb - mt) / 16][j][(mb - mt) % 16];
            for (int t = 0; t < tail_rows; t++)
                for (int j = 0; j < rows; j++) {
                    float lanes[W], sum = 0.0f;
                    f_store(lanes, tail[t][j]);
                    for (int l = 0; l < W; l++) sum += lanes[l];
                    y[(size_t)(whole + t) * n + r0 + j] = sum;
                }
        }
    }
}

#ifdef ISA_INT8_DOTS
#ifndef ISA_INT8_TARGET_BEGIN /* (the build's flags suffice) */
#define ISA_INT8_TARGET_BEGIN
#define ISA_INT8_TARGET_END
#endif
ISA_INT8_TARGET_BEGIN
/* ---- prefill with int8 activations ----
 *
 * At 3-4 bits a LUT-GEMV row costs two table lookups and two dot products per bit plane, where a 4-way byte dot
 * product (AVX-512 VNNI vpdpbusd; AVX2 vpmaddubsw) multiplies a vector of weight codes by int8 activations in one
 * or two instructions. So for a few rows or more, each tile's codes are unpacked once (repack_codes: dequant_tile's
 * level 1, without the float step) and every row's activations, quantised per group to int8
 * (spec.quantize_activations), are dotted with them: y = Σ_g s·xs_g·(Σ q·xq − z·Σ xq).
 *
 * Vocabulary: I8_ROWS (activation rows a pass), i_from_f (float → int32, half to even), i_mul (int32 low product),
 * ISA_INT8_TARGET_BEGIN / _END (what the section's functions need beyond the build's flags; nothing if unset),
 * plane_rows(plane, rv) (row vector rv of a plane in row order, byte 4r + p),
 * i8_tile_dots(acc[RV], codes[RV][2][4], a): acc[rv] lane r += Σ_{h,j,p} (byte 4r + p of codes[rv][h][j]) ·
 * a[4(4h + j) + p] (or, with ISA_OWN_I8_ROWS, i8_tile_rows(acc[rows][RV], codes, a, k, rows) the same for the rows
 * at a + r·k at once), and i8_store_tile(to, q[32/W]): a tile's 32 activations (int32, |·| ≤ 127) as int8, input
 * 16h + 4p + j to byte 4(4h + j) + p. */

/* q[rv][h][j], lane r: the codes of row rv·W + r's inputs 16h + 4p + j in byte p (p = 0..3). */
static inline __attribute__((always_inline)) void tile_codes(const uint8_t *tile, const int bits, vi q[RV][2][4]) {
    for (int rv = 0; rv < RV; rv++) {
        vi v[8], nib[2][8];
        for (int i = 0; i < bits; i++) v[i] = plane_rows(tile + i * LUT_TILE_BYTES, rv);
        plane_nibbles(v, bits, nib);
        for (int j = 0; j < 4; j++) {
            vi byte_j[2];
            repack_codes(nib, bits, j, byte_j);
            q[rv][0][j] = byte_j[0], q[rv][1][j] = byte_j[1];
        }
    }
}

/* `rows` activation rows at a + r·k against one tile's codes: the ISA's own pass over all the rows where it has one
 * (ISA_OWN_I8_ROWS), else row by row. */
static inline __attribute__((always_inline)) void i8_rows_dots(vi acc[][RV], const vi codes[][2][4], const int8_t *a,
                                                               int k, const int rows) {
#ifdef ISA_OWN_I8_ROWS
    i8_tile_rows(acc, codes, a, k, rows);
#else
    for (int r = 0; r < rows; r++) i8_tile_dots(acc[r], codes, a + (size_t)r * k);
#endif
}

/* `rows` activation rows (xq per row: k int8 in tile order, see int8_rows) against one group's unpacked tiles. */
static inline __attribute__((always_inline)) void gemm_i8_group(const vi (*codes)[RV][2][4], const int tiles,
                                                                const int8_t *xq, int k, int kt0, vi acc[][RV],
                                                                const int rows) {
    for (int r = 0; r < rows; r++)
        for (int rv = 0; rv < RV; rv++) acc[r][rv] = i_zero();
    for (int t = 0; t < tiles; t++) i8_rows_dots(acc, codes[t], xq + (size_t)(kt0 + t) * LUT_TILE_K, k, rows);
}

/* Row block rb against m activation rows into out [m][16]: each group's tiles unpacked once, then dotted with
 * every row's activations, I8_ROWS rows a pass. */
static inline __attribute__((always_inline)) void gemm_i8_block(const lut_weight *w, const int8_t *xq, const float *xs,
                                                                const int32_t *xsum, int m, int rb, float *out,
                                                                const int bits, const int tiles) {
    const int groups = lut_groups(w), k = w->k;
    for (int r = 0; r < m; r++)
        for (int rv = 0; rv < RV; rv++) f_store(out + (size_t)r * LUT_ROWS + rv * W, f_zero());
    for (int g = 0; g < groups; g++) {
        vi codes[4][RV][2][4];
        for (int t = 0; t < tiles; t++) {
            const uint8_t *tile = lut_tile(w, rb, g * tiles + t);
            for (int i = 0; i < bits; i++) lut_prefetch_line(tile + i * LUT_TILE_BYTES);
            tile_codes(tile, bits, codes[t]);
        }
        const size_t at = lut_block_param(w, rb, g);
        vf s[RV];
        vi z[RV];
        for (int rv = 0; rv < RV; rv++) {
            s[rv] = f_half(w->scales + at + rv * W);
            z[rv] = w->zeros ? i_u8(w->zeros + at + rv * W) : i_set1(1 << (bits - 1));
        }
        for (int r0 = 0; r0 < m; r0 += I8_ROWS) {
            const int rows = m - r0 < I8_ROWS ? m - r0 : I8_ROWS;
            vi acc[I8_ROWS][RV];
            const int8_t *a = xq + (size_t)r0 * k;
#define I8_GROUP(n) gemm_i8_group(codes, tiles, a, k, g * tiles, acc, n)
            switch (rows) { /* (a compile-time row count keeps the accumulators in registers) */
            case 1: I8_GROUP(1); break;
            case 2: I8_GROUP(2); break;
            case 3: I8_GROUP(3); break;
#if I8_ROWS > 4
            case 4: I8_GROUP(4); break;
            case 5: I8_GROUP(5); break;
            case 6: I8_GROUP(6); break;
            case 7: I8_GROUP(7); break;
#endif
            default: I8_GROUP(I8_ROWS); break;
            }
#undef I8_GROUP
            for (int r = 0; r < rows; r++) {
                const size_t row = (size_t)(r0 + r) * groups + g;
                const vf row_scale = f_set1(xs[row]);
                const vi row_sum = i_set1(xsum[row]);
                float *o = out + (size_t)(r0 + r) * LUT_ROWS;
                for (int rv = 0; rv < RV; rv++) {
                    const vi total = i_sub(acc[r][rv], i_mul(z[rv], row_sum));
                    f_store(o + rv * W, f_fmadd(f_mul(s[rv], row_scale), f_from_i(total), f_load(o + rv * W)));
                }
            }
        }
    }
}

void ISA(gemm_i8)(const lut_weight *w, const int8_t *xq, const float *xs, const int32_t *xsum, int m, int rb0, int rb1,
                  float *y, int ldy) {
    float *out = malloc(sizeof(float) * LUT_ROWS * (size_t)m); /* one row block's outputs, every row */
    if (!out) return; /* (the caller's allocations are far larger: it would have failed first) */
    for (int rb = rb0; rb < rb1; rb++) {
#define BLOCK(b, t) gemm_i8_block(w, xq, xs, xsum, m, rb, out, b, t)
        const int tiles = w->group / LUT_TILE_K;
        if (w->bits == 3)
            tiles == 1 ? BLOCK(3, 1) : tiles == 2 ? BLOCK(3, 2) : BLOCK(3, 4);
        else
            tiles == 1 ? BLOCK(4, 1) : tiles == 2 ? BLOCK(4, 2) : BLOCK(4, 4);
#undef BLOCK
        for (int r = 0; r < m; r++) memcpy(y + (size_t)r * ldy + (size_t)rb * LUT_ROWS, out + (size_t)r * LUT_ROWS,
                                           sizeof(float) * LUT_ROWS);
    }
    free(out);
}

/* x [m][k] quantised per group (spec.quantize_activations: 127 / max|x|, half to even) into xq in the order
 * i8_tile_dots reads it: per 32-input tile, input 16h + 4p + j at byte 4(4h + j) + p; with each group's scale xs
 * and Σ xq. */
void ISA(int8_rows)(const float *x, int m, int k, int group, int8_t *xq, float *xs, int32_t *xsum) {
    const int groups = k / group;
    for (int i = 0; i < m; i++)
        for (int g = 0; g < groups; g++) {
            const float *v = x + (size_t)i * k + (size_t)g * group;
            vf top = f_zero();
            for (int c = 0; c < group; c += W) top = f_max(top, f_abs(f_load(v + c)));
            const float amax = f_reduce_max(top);
            const vf inv = f_set1(amax > 0.0f ? 127.0f / amax : 0.0f);
            vi sums = i_zero();
            for (int c = 0; c < group; c += LUT_TILE_K) {
                vi q[LUT_TILE_K / W];
                for (int e = 0; e < LUT_TILE_K / W; e++) {
                    q[e] = i_from_f(f_mul(f_load(v + c + e * W), inv));
                    sums = i_add(sums, q[e]);
                }
                i8_store_tile(xq + (size_t)i * k + (size_t)g * group + c, q);
            }
            int32_t lanes[W], sum = 0;
            i_store(lanes, sums);
            for (int r = 0; r < W; r++) sum += lanes[r];
            xs[(size_t)i * groups + g] = amax / 127.0f;
            xsum[(size_t)i * groups + g] = sum;
        }
}
ISA_INT8_TARGET_END
#endif
