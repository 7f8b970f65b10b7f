/* AVX2 + FMA + F16C: a tile is two vectors of 8 rows.
 *
 * GEMV core: vpshufb looks up 16 entries per 128-bit lane, and each lane of a plane is one
 * byte position of 16 rows (layout.py), so one vpshufb per table; with two planes' indices
 * interleaved vpmaddubsw weighs and adds a row's pair of planes, and a tile's planes sum in
 * int16 (tile_dots).
 */
#include <immintrin.h>
#include <string.h>

#include "isa.h"

#define ISA(name) name##_avx2
#define W 8
#define ACC 1 /* one accumulator a row vector: int16 where INT16_GROUP allows a whole group, else int32 */
#define GEMM_MR AVX2_MR
#define GEMV_MR AVX2_GEMV_MR
/* Four rows a pass spill the tables and sums to the stack, which pays at 1-2 bits, where a tile has few planes,
 * not above, nor for 2-3 rows, whose pass would repeat rows (docs/performance.md, "Multi-row LUT-GEMV"). */
#define GEMV_NARROW_MR 2
#define GEMV_WIDE(bits, rows) ((bits) <= 2 && (rows) > 2)
#define GEMM_ROW_BLOCKS 1 /* 6 × 16 microkernel: 12 accumulators */

typedef __m256 vf;
typedef __m256i vi;

#define f_zero _mm256_setzero_ps
#define f_set1 _mm256_set1_ps
#define f_load _mm256_loadu_ps
#define f_store _mm256_storeu_ps
#define f_add _mm256_add_ps
#define f_sub _mm256_sub_ps
#define f_mul _mm256_mul_ps
#define f_fmadd _mm256_fmadd_ps
#define f_max _mm256_max_ps
#define f_abs(v) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v)
#define f_xor _mm256_xor_ps
#define f_from_i _mm256_cvtepi32_ps
#define f_half(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define f_bf16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define i_zero _mm256_setzero_si256
#define i_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define i_u8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define i_add _mm256_add_epi32
#define i_sub _mm256_sub_epi32
#define i_or _mm256_or_si256
#define i_set1 _mm256_set1_epi32
#define i_add_u8_times(a, p, c) \
    _mm256_add_epi32(a, _mm256_madd_epi16(i_u8(p), _mm256_set1_epi32(c))) /* z in the low word */
#define i_table16(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define i_lookup16 _mm256_shuffle_epi8
#define i_nibble(v, h) _mm256_and_si256((h) ? _mm256_srli_epi16(v, 4) : (v), _mm256_set1_epi8(0x0F))
#define i_store(p, v) _mm256_storeu_si256((__m256i *)(p), v)

static inline float f_reduce_max(vf v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

/* v[c] lane t = v[t] lane c, for c, t < 8. */
static inline __attribute__((always_inline)) void f_transpose(vf v[8]) {
    vf t[8], s[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) /* within each 128-bit lane, inputs 4L + q of rows 4h .. 4h + 3 in s[4h + q] */
        for (int i = 0; i < 2; i++) {
            s[4 * h + 2 * i] = _mm256_shuffle_ps(t[4 * h + i], t[4 * h + 2 + i], 0x44);
            s[4 * h + 2 * i + 1] = _mm256_shuffle_ps(t[4 * h + i], t[4 * h + 2 + i], 0xEE);
        }
    for (int q = 0; q < 4; q++)
        v[q] = _mm256_permute2f128_ps(s[q], s[4 + q], 0x20), v[4 + q] = _mm256_permute2f128_ps(s[q], s[4 + q], 0x31);
}

static inline void store_run(int8_t *dst, const vf *t, vf inv) {
    __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(t[0], inv)), hi = _mm256_cvtps_epi32(_mm256_mul_ps(t[1], inv));
    __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8); /* entries 0..15 in order */
    __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128((__m128i *)dst, bytes);
}

typedef struct {
    __m256i lo01, lo23, hi01, hi23; /* runs 8t+{0|1}, {2|3} (low nibbles), {4|5}, {6|7} (high ones) in lanes 0|1 */
} kt_tables;

static inline kt_tables load_tables(const void *tq, int kt) {
    const int8_t *at = (const int8_t *)tq + (size_t)kt * 128;
    return (kt_tables){i_load(at), i_load(at + 32), i_load(at + 64), i_load(at + 96)};
}

/* One plane's lookups as int16 sums of run pairs: rows 0-7 in lo and 8-15 in hi, lane 0 of each summing runs
 * 0, 2, 4, 6 and lane 1 runs 1, 3, 5, 7. Each 128-bit lane of the plane's two vectors is one byte position (one
 * run's indices) of all 16 rows (layout.py), so a lane needs one table and each lookup is one vpshufb. */
static inline __attribute__((always_inline)) void plane_sums(const uint8_t *plane, const kt_tables *t, __m256i *lo,
                                                             __m256i *hi) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi8(1);
    const __m256i p01 = i_load(plane), p23 = i_load(plane + 32); /* positions 0 | 1 and 2 | 3 */
    const __m256i r01 = _mm256_shuffle_epi8(t->lo01, _mm256_and_si256(p01, nibble));
    const __m256i r23 = _mm256_shuffle_epi8(t->lo23, _mm256_and_si256(p23, nibble));
    const __m256i r45 = _mm256_shuffle_epi8(t->hi01, _mm256_and_si256(_mm256_srli_epi16(p01, 4), nibble));
    const __m256i r67 = _mm256_shuffle_epi8(t->hi23, _mm256_and_si256(_mm256_srli_epi16(p23, 4), nibble));
    /* a byte pair (run p, run p+2) of one row each */
    *lo = _mm256_add_epi16(_mm256_maddubs_epi16(ones, _mm256_unpacklo_epi8(r01, r23)),
                           _mm256_maddubs_epi16(ones, _mm256_unpacklo_epi8(r45, r67)));
    *hi = _mm256_add_epi16(_mm256_maddubs_epi16(ones, _mm256_unpackhi_epi8(r01, r23)),
                           _mm256_maddubs_epi16(ones, _mm256_unpackhi_epi8(r45, r67)));
}

/* `sums` plus both nibbles of a vector of indices looked up (low ones in `low_tables`, high in `high_tables`), each
 * byte pair summed with its weights (vpmaddubsw: the weights unsigned, the table entries signed) into int16 words.
 * Added one after the other: a tree of adds measured slower at int4 (docs/performance.md, "LUT-GEMV on AVX2"). */
static inline __attribute__((always_inline)) __m256i add_nibble_lookups(__m256i sums, __m256i indices,
                                                                      __m256i low_tables, __m256i high_tables,
                                                                      __m256i weights) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i low = _mm256_shuffle_epi8(low_tables, _mm256_and_si256(indices, nibble));
    const __m256i high = _mm256_shuffle_epi8(high_tables, _mm256_and_si256(_mm256_srli_epi16(indices, 4), nibble));
    sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(weights, low));
    return _mm256_add_epi16(sums, _mm256_maddubs_epi16(weights, high));
}

/* Two planes at once, plane i+1 (`upper`) and plane i, added into int16 row sums (rows 0-7 in lo, 8-15 in hi,
 * lanes as plane_sums). Interleaving the two planes' index bytes puts a row's two indices into one run's table side
 * by side, so each vpshufb serves both planes and vpmaddubsw, its multipliers the planes' weights (2^(i+1), 2^i),
 * adds them: per int2 tile 4 unpacks where plane_sums takes 8, and no doubling between planes. */
static inline __attribute__((always_inline)) void plane_pair_sums(const uint8_t *upper, const uint8_t *lower,
                                                                  const kt_tables *t, __m256i weights, __m256i *lo,
                                                                  __m256i *hi) {
    for (int half = 0; half < 2; half++) { /* byte positions 0 | 1, then 2 | 3 */
        const __m256i up = i_load(upper + 32 * half), down = i_load(lower + 32 * half);
        const __m256i low_tables = half ? t->lo23 : t->lo01, high_tables = half ? t->hi23 : t->hi01;
        const __m256i rows07 = _mm256_unpacklo_epi8(up, down), rows815 = _mm256_unpackhi_epi8(up, down);
        *lo = add_nibble_lookups(*lo, rows07, low_tables, high_tables, weights);
        *hi = add_nibble_lookups(*hi, rows815, low_tables, high_tables, weights);
    }
}

/* int16 row sums, lane 0 and lane 1 (the same 8 rows), into int32 accumulators. */
static inline __m256i widen_lanes(__m256i acc, __m256i sums) {
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(sums)),
                                                  _mm256_cvtepi16_epi32(_mm256_extracti128_si256(sums, 1))));
}

/* All planes of a tile, in pairs from the highest (plane_pair_sums), an odd plane 0 alone. Up to 5 bits each pair
 * carries its weight and the sums stay int16 for a tile, each lane's at most (2^bits − 1) · 4 · 127 (15748 at 5
 * bits), and for the whole group where its tiles keep that in int16 (INT16_GROUP: groups to 256 inputs at 1-3 bits,
 * 128 at 4, 64 at 5); group_totals widens them once. Widening every tile took a sixth of an int2 tile's
 * instructions. Wider codes widen every pair, its weight 2^i applied in int32. Pairs against planes one by one:
 * docs/performance.md, "LUT-GEMV on AVX2". */
#define INT16_GROUP(bits, tiles) ((bits) <= 5 && (tiles) * ((1 << (bits)) - 1) * 4 * 127 <= 32767)
#define ISA_OWN_TILE_DOTS
static inline __attribute__((always_inline)) void tile_dots(vi a[][ACC], const uint8_t *tile, const kt_tables *t,
                                                            const int bits, const int tiles) {
    __m256i rows_lo = _mm256_setzero_si256(), rows_hi = _mm256_setzero_si256(), lo, hi;
    for (int i = bits - 2; i >= 0; i -= 2) {
        const uint8_t *upper = tile + (i + 1) * LUT_TILE_BYTES, *lower = tile + i * LUT_TILE_BYTES;
        const int int16 = bits <= 5; /* else the pair's weight 2^i is applied in int32 */
        lut_prefetch_line(upper);
        lut_prefetch_line(lower);
        lo = hi = _mm256_setzero_si256(); /* a chain of adds a pair: shorter than one through all pairs */
        plane_pair_sums(upper, lower, t, _mm256_set1_epi16((short)((int16 ? 1 << i : 1) * (1 << 8 | 2))), &lo, &hi);
        if (int16) {
            rows_lo = _mm256_add_epi16(rows_lo, lo), rows_hi = _mm256_add_epi16(rows_hi, hi);
        } else {
            a[0][0] = _mm256_add_epi32(a[0][0], _mm256_slli_epi32(widen_lanes(_mm256_setzero_si256(), lo), i));
            a[1][0] = _mm256_add_epi32(a[1][0], _mm256_slli_epi32(widen_lanes(_mm256_setzero_si256(), hi), i));
        }
    }
    if (bits & 1) { /* plane 0 alone */
        lut_prefetch_line(tile);
        plane_sums(tile, t, &lo, &hi);
        rows_lo = _mm256_add_epi16(rows_lo, lo), rows_hi = _mm256_add_epi16(rows_hi, hi);
    }
    if (INT16_GROUP(bits, tiles))
        a[0][0] = _mm256_add_epi16(a[0][0], rows_lo), a[1][0] = _mm256_add_epi16(a[1][0], rows_hi);
    else
        a[0][0] = widen_lanes(a[0][0], rows_lo), a[1][0] = widen_lanes(a[1][0], rows_hi);
}

/* The group's totals (simd_kernels.h). A whole group's int16 sums whose two lanes (the same rows) still fit int16 once
 * added, INT16_MERGED, add there: rows 0-7 | 8-15 in one vector, widened with one extract. Where the zero term fits
 * beside them too, ZEROS_IN_INT16 (|z·zero_coef| ≤ (2^b − 1) · 2 · tiles · 8 · 127), it is added in int16 for all 16
 * rows at once: three instructions a group, not six (docs/performance.md, "LUT-GEMV on AVX2"). */
#define INT16_MERGED(bits, tiles) ((bits) <= 5 && (tiles) * ((1 << (bits)) - 1) * 8 * 127 <= 32767)
#define ZEROS_IN_INT16(bits, tiles) ((bits) <= 5 && (tiles) * ((1 << (bits)) - 1) * 24 * 127 <= 32767)
#define ISA_OWN_GROUP_TOTAL
static inline void group_totals(vi totals[2], const vi a[2][ACC], int32_t bias, const uint8_t *zeros,
                                int32_t zero_coef, const int bits, const int tiles) {
    const __m256i biased = _mm256_set1_epi32(bias);
    if (INT16_MERGED(bits, tiles)) {
        __m256i rows = _mm256_add_epi16(_mm256_permute2x128_si256(a[0][0], a[1][0], 0x21), /* lo.1 | hi.0 */
                                        _mm256_blend_epi32(a[0][0], a[1][0], 0xF0));   /* lo.0 | hi.1 */
        if (zeros && ZEROS_IN_INT16(bits, tiles)) {
            const __m256i z = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)zeros));
            rows = _mm256_add_epi16(rows, _mm256_mullo_epi16(z, _mm256_set1_epi16((short)zero_coef)));
            zeros = NULL;
        }
        totals[0] = _mm256_add_epi32(biased, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(rows)));
        totals[1] = _mm256_add_epi32(biased, _mm256_cvtepi16_epi32(_mm256_extracti128_si256(rows, 1)));
    } else {
        for (int rv = 0; rv < 2; rv++)
            totals[rv] = INT16_GROUP(bits, tiles) ? widen_lanes(biased, a[rv][0]) : _mm256_add_epi32(a[rv][0], biased);
    }
    if (zeros)
        for (int rv = 0; rv < 2; rv++) totals[rv] = i_add_u8_times(totals[rv], zeros + rv * W, zero_coef);
}

/* The int8 GEMM's dot products (simd_kernels.h): vpmaddubsw multiplies codes (unsigned) by activations (signed)
 * and adds pairs into int16, which sum over a tile's 8 products per word (|·| ≤ 8 · 2 · 15 · 127 = 30480 at 4
 * bits) before vpmaddwd widens them once. */
#define ISA_INT8_DOTS
#define I8_ROWS 4 /* 4 rows × 2 row vectors of accumulators */
#define i_from_f _mm256_cvtps_epi32 /* round half to even */
#define i_mul _mm256_mullo_epi32

/* Rows 8rv..8rv+7 of a plane in row order (byte 4r + p): positions 0 and 2, 1 and 3 interleaved as byte pairs,
 * rows 0-3 and 4-7 brought into one lane each, then each row's four bytes gathered within its lane. */
static inline __m256i plane_rows(const uint8_t *plane, int rv) {
    const __m256i by_row = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                            0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m256i p01 = i_load(plane), p23 = i_load(plane + 32);
    const __m256i pairs = rv ? _mm256_unpackhi_epi8(p01, p23) : _mm256_unpacklo_epi8(p01, p23);
    return _mm256_shuffle_epi8(_mm256_permute4x64_epi64(pairs, 0xD8), by_row);
}

static inline void i8_store_tile(int8_t *to, const vi *q) {
    /* packs leave inputs 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31 as dwords; then byte 4j + p of each
     * 16-byte half from byte 4p + j: a 4 × 4 transpose */
    const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i order = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)to, _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(bytes, in_order), order));
}

static inline __attribute__((always_inline)) void i8_tile_dots(vi acc[], const vi codes[][2][4], const int8_t *a) {
    __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++) {
            int32_t word;
            memcpy(&word, a + 4 * (4 * h + j), sizeof word);
            const __m256i x = _mm256_set1_epi32(word);
            for (int rv = 0; rv < 2; rv++)
                sums[rv] = _mm256_add_epi16(sums[rv], _mm256_maddubs_epi16(codes[rv][h][j], x));
        }
    for (int rv = 0; rv < 2; rv++)
        acc[rv] = _mm256_add_epi32(acc[rv], _mm256_madd_epi16(sums[rv], _mm256_set1_epi16(1)));
}

/* GCC schedules the LUT-GEMV with register pressure in mind: without it the int4 tile's 16 registers overflow and
 * its group sums go through the stack (llvm-mca: a loop-carried spill). Not for the whole file: the bf16 GEMM and
 * GEMV are slower with it (docs/performance.md, "LUT-GEMV on AVX2"). */
#if defined(__GNUC__) && !defined(__clang__)
#define ISA_GEMV_BEGIN _Pragma("GCC push_options") _Pragma("GCC optimize(\"schedule-insns\", \"sched-pressure\")")
#define ISA_GEMV_END _Pragma("GCC pop_options")
#endif
#include "simd_kernels.h"
