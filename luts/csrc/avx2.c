/* AVX2 + FMA + F16C: a tile is two vectors of 8 rows.
 *
 * GEMV core: vpshufb looks up 16 entries per 128-bit lane, but the four bytes of a row
 * need four different tables, so each lookup is four shuffles merged by two constant
 * byte-position blends; vpmaddubsw + vpmaddwd then sum a row's four bytes times 2^i.
 * About three times the work per byte of the AVX-512 core.
 */
#include <immintrin.h>

#include "isa.h"

#define ISA(name) name##_avx2
#define W 8
#define ACC 4
#define GEMM_MR AVX2_MR
#define GEMV_MR AVX2_GEMV_MR
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
#define i_zero _mm256_setzero_si256
#define i_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define i_u8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define i_add _mm256_add_epi32
#define i_sub _mm256_sub_epi32
#define i_or _mm256_or_si256
#define i_set1 _mm256_set1_epi32
#define i_add_u8_times(a, p, c) _mm256_add_epi32(a, _mm256_madd_epi16(i_u8(p), _mm256_set1_epi32(c))) /* z in the low word */
#define i_table16(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p)))
#define i_lookup16 _mm256_shuffle_epi8
#define i_nibble(v, h) _mm256_and_si256((h) ? _mm256_srli_epi16(v, 4) : (v), _mm256_set1_epi8(0x0F))
#define i_byte(v, p) _mm256_shuffle_epi8(v, _mm256_add_epi32(_mm256_setr_epi32((int)0x80808000, (int)0x80808004, \
    (int)0x80808008, (int)0x8080800C, (int)0x80808000, (int)0x80808004, (int)0x80808008, (int)0x8080800C),   \
                                                              _mm256_set1_epi32(p)))

static inline float f_reduce_max(vf v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

static inline void store_run(int8_t *dst, const vf *t, vf inv) {
    __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(t[0], inv)), hi = _mm256_cvtps_epi32(_mm256_mul_ps(t[1], inv));
    __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8); /* entries 0..15 in order */
    __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128((__m128i *)dst, bytes);
}

typedef struct {
    __m256i lo[4], hi[4]; /* the table of run 8t+p (lo) and 8t+4+p (hi), in both lanes */
} kt_tables;

static inline kt_tables load_tables(const void *tq, int kt) {
    const int8_t *at = (const int8_t *)tq + (size_t)kt * 128;
    kt_tables t;
    for (int p = 0; p < 4; p++) {
        t.lo[p] = i_table16(at + 16 * p);
        t.hi[p] = i_table16(at + 64 + 16 * p);
    }
    return t;
}

/* Byte 4r+p looked up in table p. */
static inline __m256i lookup_by_position(const __m256i table[4], __m256i idx) {
    const __m256i odd = _mm256_set1_epi32((int)0x80008000), high = _mm256_set1_epi32((int)0x80800000);
    __m256i r01 = _mm256_blendv_epi8(_mm256_shuffle_epi8(table[0], idx), _mm256_shuffle_epi8(table[1], idx), odd);
    __m256i r23 = _mm256_blendv_epi8(_mm256_shuffle_epi8(table[2], idx), _mm256_shuffle_epi8(table[3], idx), odd);
    return _mm256_blendv_epi8(r01, r23, high);
}

static inline __attribute__((always_inline)) void tile_dot(vi a[][ACC], const uint8_t *tile, const kt_tables *t, int i) {
    const __m256i weight = _mm256_set1_epi8((char)(1 << i)), ones = _mm256_set1_epi16(1);
    for (int rv = 0; rv < 2; rv++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(tile + 32 * rv));
        const __m256i lo = lookup_by_position(t->lo, i_nibble(v, 0)), hi = lookup_by_position(t->hi, i_nibble(v, 1));
        /* |2^i · (two entries)| ≤ 128 · 254 fits int16, so vpmaddubsw never saturates */
        a[rv][i & 1] = _mm256_add_epi32(a[rv][i & 1], _mm256_madd_epi16(_mm256_maddubs_epi16(weight, lo), ones));
        a[rv][2 + (i & 1)] = _mm256_add_epi32(a[rv][2 + (i & 1)], _mm256_madd_epi16(_mm256_maddubs_epi16(weight, hi), ones));
    }
}

#include "simd_kernels.h"
