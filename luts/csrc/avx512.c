/* AVX-512 (F/BW/VL/DQ + VBMI + VNNI): one vector is one whole tile (16 rows × 64 bytes).
 *
 * GEMV core: a plane is put in row order (vpermb), then each nibble, tagged with its byte
 * position p (idx | p << 4), picks from the four 16-entry tables of runs 8t+p held in one
 * register (vpermb); vpdpbusd sums each row's four bytes into its int32 lane with the plane
 * weight 2^i as the multiplier.
 */
#include <immintrin.h>
#include <string.h>

#include "isa.h"

#define ISA(name) name##_avx512
#define W 16
#define ACC 8 /* four pairs, planes sharing one two by two (tile_dot) */
#define GEMM_MR AVX512_MR
#define GEMV_MR AVX512_GEMV_MR
#define GEMM_ROW_BLOCKS 2 /* 8 × 32 microkernel: 16 accumulators, 10 loads per 16 FMAs */

typedef __m512 vf;
typedef __m512i vi;

#define f_zero _mm512_setzero_ps
#define f_set1 _mm512_set1_ps
#define f_load _mm512_loadu_ps
#define f_store _mm512_storeu_ps
#define f_add _mm512_add_ps
#define f_sub _mm512_sub_ps
#define f_mul _mm512_mul_ps
#define f_fmadd _mm512_fmadd_ps
#define f_max _mm512_max_ps
#define f_abs _mm512_abs_ps
#define f_xor _mm512_xor_ps
#define f_reduce_max _mm512_reduce_max_ps
#define f_from_i _mm512_cvtepi32_ps
#define f_half(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define f_bf16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define i_zero _mm512_setzero_si512
#define i_load(p) _mm512_loadu_si512((const void *)(p))
#define i_u8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define i_add _mm512_add_epi32
#define i_sub _mm512_sub_epi32
#define i_or _mm512_or_si512
#define i_set1 _mm512_set1_epi32
#define i_add_u8_times(a, p, c) _mm512_dpwssd_epi32(a, i_u8(p), _mm512_set1_epi32(c)) /* z < 2^8 in the low word */
#define i_table16(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p)))
#define i_lookup16 _mm512_shuffle_epi8
#define i_nibble(v, h) _mm512_and_si512((h) ? _mm512_srli_epi16(v, 4) : (v), _mm512_set1_epi8(0x0F))
#define i_store(p, v) _mm512_storeu_si512((void *)(p), v)

typedef struct {
    __m512i lo, hi; /* tables of runs 8t..8t+3 and 8t+4..8t+7 */
} kt_tables;

/* v[c] lane t = v[t] lane c, for c, t < 16: 4 × 4 transposes within 128-bit lanes, then of the lanes. */
static inline __attribute__((always_inline)) void f_transpose(vf v[16]) {
    vf t[16], u[16], w[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) /* lane L of u[4g + q]: input 4L + q of rows 4g .. 4g + 3 */
        for (int i = 0; i < 2; i++) {
            u[4 * g + 2 * i] = _mm512_shuffle_ps(t[4 * g + i], t[4 * g + 2 + i], 0x44);
            u[4 * g + 2 * i + 1] = _mm512_shuffle_ps(t[4 * g + i], t[4 * g + 2 + i], 0xEE);
        }
    for (int h = 0; h < 2; h++)
        for (int q = 0; q < 4; q++) {
            w[8 * h + q] = _mm512_shuffle_f32x4(u[8 * h + q], u[8 * h + 4 + q], 0x88);
            w[8 * h + 4 + q] = _mm512_shuffle_f32x4(u[8 * h + q], u[8 * h + 4 + q], 0xDD);
        }
    for (int q = 0; q < 4; q++) {
        v[q] = _mm512_shuffle_f32x4(w[q], w[8 + q], 0x88), v[8 + q] = _mm512_shuffle_f32x4(w[q], w[8 + q], 0xDD);
        v[4 + q] = _mm512_shuffle_f32x4(w[4 + q], w[12 + q], 0x88);
        v[12 + q] = _mm512_shuffle_f32x4(w[4 + q], w[12 + q], 0xDD);
    }
}

static inline kt_tables load_tables(const void *tq, int kt) {
    const int8_t *at = (const int8_t *)tq + (size_t)kt * 128;
    kt_tables t = {_mm512_loadu_si512(at), _mm512_loadu_si512(at + 64)};
    return t;
}

/* A plane in row order, byte 4r + p (layout.py stores 16p + r): each 32-bit lane one row, as vpdpbusd sums
 * (rv: the row vector, always 0 here where one vector holds all 16 rows). */
static inline __m512i plane_rows(const uint8_t *plane, int rv) {
    (void)rv;
    static const uint8_t byte_of_row[64] = {
        0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
        6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
        12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
    return _mm512_permutexvar_epi8(_mm512_loadu_si512(byte_of_row), _mm512_loadu_si512(plane));
}

static inline __attribute__((always_inline)) void tile_dot(vi a[][ACC], const uint8_t *tile, const kt_tables *t,
                                                           int i) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), positions = _mm512_set1_epi32(0x30201000);
    const __m512i v = plane_rows(tile, 0);
    const __m512i lo = _mm512_ternarylogic_epi32(v, nibble, positions, 0xEA); /* (v & 15) | p << 4 */
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nibble, positions, 0xEA);
    const __m512i weight = _mm512_set1_epi8((char)(1 << i));
    /* Planes i and i + 1 share an accumulator pair: at 1-2 bits all go to one pair, as a group has only
     * 2-8 dot products a pair and each extra accumulator costs an add per group; at 4 bits two pairs do as
     * well as four (docs/performance.md, "LUT-GEMV on AVX-512"). */
    vi *pair = a[0] + 2 * (i / 2) % ACC;
    pair[0] = _mm512_dpbusd_epi32(pair[0], weight, _mm512_permutexvar_epi8(lo, t->lo));
    pair[1] = _mm512_dpbusd_epi32(pair[1], weight, _mm512_permutexvar_epi8(hi, t->hi));
}

/* Tables, 16 runs at a time with one run per lane (the shared builder holds one run's 16 entries
 * per vector and pays four broadcasts per run): the eight odd entries are ((x0 ± x1) ± x2) ± x3
 * across lanes, the same fp32 operations in the same order as the shared builder's, each even entry
 * is its mirror's negation, and a byte transpose (vpermi2b) turns the entry-major bytes into the
 * run-major tables. Bit-identical to the shared builder, and faster (docs/performance.md, "Activation tables"). */
#define ISA_OWN_TABLES

/* x_j of runs c = 0..15 (x[4c + j]) in lane c, from 16 runs' inputs (8: the rest are zero). */
static inline void run_inputs(const float *x, int runs, __m512 xj[4]) {
    static const int pick[2][16] = {{0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29},
                                    {2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31}};
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const __m512 v2 = runs > 8 ? _mm512_loadu_ps(x + 32) : _mm512_setzero_ps();
    const __m512 v3 = runs > 8 ? _mm512_loadu_ps(x + 48) : _mm512_setzero_ps();
    for (int h = 0; h < 2; h++) { /* x_2h and x_2h+1 of runs 0-7 from v0:v1, of runs 8-15 from v2:v3 */
        const __m512i idx = _mm512_loadu_si512(pick[h]);
        const __m512 lo = _mm512_permutex2var_ps(v0, idx, v1), hi = _mm512_permutex2var_ps(v2, idx, v3);
        xj[2 * h] = _mm512_shuffle_f32x4(lo, hi, 0x44);
        xj[2 * h + 1] = _mm512_shuffle_f32x4(lo, hi, 0xEE);
    }
}

/* Odd entry 2o + 1 of each lane's run into e[o] (+x_j where bit j of the entry is set, else −x_j);
 * returns each lane's largest magnitude. */
static inline __m512 odd_entries(const float *x, int runs, __m512 e[8]) {
    __m512 xj[4], a[2], c[4];
    run_inputs(x, runs, xj);
    for (int b = 0; b < 2; b++) a[b] = b ? _mm512_add_ps(xj[0], xj[1]) : _mm512_sub_ps(xj[0], xj[1]);
    for (int i = 0; i < 4; i++) c[i] = i >> 1 ? _mm512_add_ps(a[i & 1], xj[2]) : _mm512_sub_ps(a[i & 1], xj[2]);
    __m512 amax = _mm512_setzero_ps();
    for (int o = 0; o < 8; o++) {
        e[o] = o >> 2 ? _mm512_add_ps(c[o & 3], xj[3]) : _mm512_sub_ps(c[o & 3], xj[3]);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(e[o]));
    }
    return amax;
}

/* Bytes of four quantised entries: 16 bytes (one per run) each. */
static inline __m512i entry_rows(const __m512i q[4]) {
    __m512i z = _mm512_castsi128_si512(_mm512_cvtsepi32_epi8(q[0]));
    for (int i = 1; i < 4; i++) z = _mm512_inserti32x4(z, _mm512_cvtsepi32_epi8(q[i]), i);
    return z;
}

/* The 16-byte tables of `runs` runs (16 or 8), entries quantised with each lane's `inv`; returns the
 * int32 entry 15 of every lane. */
static inline __m512i store_tables(int8_t *tq, int runs, const __m512 e[8], __m512 inv) {
    /* Byte 16r + e of an output vector (run r of its four, entry e) is byte 16·row + r of a pair of entry
     * rows below: odd e from odd_lo|hi (row (e − 1)/2 mod 4), even e from the second source even_lo|hi
     * (64 + 16·row, row (6 − e mod 8)/2): the same offsets for entries 0-7 and 8-15. */
    static const uint8_t entry_source[16] = {112, 0, 96, 16, 80, 32, 64, 48, 112, 0, 96, 16, 80, 32, 64, 48};
    const __m512i where = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)entry_source)),
                                          _mm512_set_epi32(0x03030303, 0x03030303, 0x03030303, 0x03030303,
                                                           0x02020202, 0x02020202, 0x02020202, 0x02020202,
                                                           0x01010101, 0x01010101, 0x01010101, 0x01010101, 0, 0, 0, 0));
    __m512i q[8];
    for (int o = 0; o < 8; o++) q[o] = _mm512_cvtps_epi32(_mm512_mul_ps(e[o], inv));
    const __m512i odd_lo = entry_rows(q), odd_hi = entry_rows(q + 4);        /* entries 1 3 5 7 | 9 11 13 15 */
    const __m512i even_hi = _mm512_sub_epi8(_mm512_setzero_si512(), odd_lo); /* entries 14 12 10 8 */
    const __m512i even_lo = _mm512_sub_epi8(_mm512_setzero_si512(), odd_hi); /* entries 6 4 2 0 */
    for (int j = 0; j < runs / 4; j++) { /* runs 4j..4j+3 */
        const __m512i at = _mm512_add_epi8(where, _mm512_set1_epi8((char)(4 * j)));
        const __m512i lo = _mm512_permutex2var_epi8(odd_lo, at, even_lo);
        const __m512i hi = _mm512_permutex2var_epi8(odd_hi, at, even_hi);
        _mm512_storeu_si512(tq + 64 * j, _mm512_mask_blend_epi8(0xFF00FF00FF00FF00ull, lo, hi));
    }
    return q[7];
}

void tables_avx512(const float *x, int k, int group, int table_bits, void *tq_out, float *t_scales, int32_t *xq) {
    (void)table_bits; /* 8 only: 16-bit tables take the portable path */
    int8_t *tq = tq_out;
    const int group_runs = group / 4, runs = k / 4;
    const int chunk = group_runs > 16 ? group_runs : 16; /* whole groups and whole vectors: 1 or 2 of each */
    for (int r0 = 0; r0 < runs; r0 += chunk) {
        const int here = runs - r0 < chunk ? runs - r0 : chunk, blocks = (here + 15) / 16;
        const int groups = here / group_runs, g0 = r0 / group_runs;
        __m512 e[2][8], lane_max[2];
        for (int b = 0; b < blocks; b++) lane_max[b] = odd_entries(x + 4 * (r0 + 16 * b), here - 16 * b, e[b]);
        if (blocks == 2) lane_max[0] = _mm512_max_ps(lane_max[0], lane_max[1]);
        __m512 inv = _mm512_setzero_ps();
        for (int h = 0; h < groups; h++) { /* two groups in a vector: lanes 0-7 and 8-15 */
            const __mmask16 lanes = groups == 1 ? 0xFFFF : (__mmask16)(0xFF << 8 * h);
            const float am = _mm512_mask_reduce_max_ps(lanes, lane_max[0]);
            t_scales[g0 + h] = am / 127.0f;
            inv = _mm512_mask_mov_ps(inv, lanes, _mm512_set1_ps(am > 0.0f ? 127.0f / am : 0.0f));
        }
        __m512i last = _mm512_setzero_si512();
        for (int b = 0; b < blocks; b++)
            last = _mm512_add_epi32(last, store_tables(tq + 16 * (r0 + 16 * b), here - 16 * b, e[b], inv));
        for (int h = 0; h < groups; h++)
            xq[g0 + h] = _mm512_mask_reduce_add_epi32(groups == 1 ? 0xFFFF : (__mmask16)(0xFF << 8 * h), last);
    }
}

/* The int8 GEMM's dot products (simd_kernels.h): vpdpbusd sums a row's four code × activation products. */
#define ISA_INT8_DOTS
#define I8_ROWS 8 /* activation rows a pass keeps accumulators for */
#define i_from_f _mm512_cvtps_epi32 /* round half to even */
#define i_mul _mm512_mullo_epi32

static inline void i8_store_tile(int8_t *to, const vi *q) {
    /* byte 4j + p of each 16-byte half from byte 4p + j: a 4 × 4 transpose */
    const __m256i order =
        _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    const __m256i bytes = _mm256_set_m128i(_mm512_cvtepi32_epi8(q[1]), _mm512_cvtepi32_epi8(q[0]));
    _mm256_storeu_si256((__m256i *)to, _mm256_shuffle_epi8(bytes, order));
}

static inline __attribute__((always_inline)) void i8_tile_dots(vi acc[], const vi codes[][2][4], const int8_t *a) {
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++) {
            int32_t word;
            memcpy(&word, a + 4 * (4 * h + j), sizeof word);
            acc[0] = _mm512_dpbusd_epi32(acc[0], codes[0][h][j], _mm512_set1_epi32(word));
        }
}

#include "simd_kernels.h"

