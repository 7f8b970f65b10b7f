/* AVX-512 (F/BW/VL/DQ + VBMI + VNNI): one vector is one whole tile (16 rows × 64 bytes).
 *
 * GEMV core: each nibble, tagged with its byte position p (idx | p << 4), picks from the
 * four 16-entry tables of runs 8t+p held in one register (vpermb); vpdpbusd sums each
 * row's four bytes into its int32 lane with the plane weight 2^i as the multiplier.
 */
#include <immintrin.h>

#include "isa.h"

#define ISA(name) name##_avx512
#define W 16
#define ACC 8 /* a pair per plane up to 4 bits: short dpbusd chains per group, +3-5 % of DRAM bandwidth at int4 */
#define GEMM_MR AVX512_MR
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
#define i_byte(v, p) _mm512_shuffle_epi8(v, _mm512_add_epi32(_mm512_set4_epi32((int)0x8080800C, (int)0x80808008, \
                                                         (int)0x80808004, (int)0x80808000), _mm512_set1_epi32(p)))

static inline void store_run(int8_t *dst, const vf *t, vf inv) {
    _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(t[0], inv))));
}

typedef struct {
    __m512i lo, hi; /* tables of runs 8t..8t+3 and 8t+4..8t+7 */
} kt_tables;

static inline kt_tables load_tables(const void *tq, int kt) {
    const int8_t *at = (const int8_t *)tq + (size_t)kt * 128;
    kt_tables t = {_mm512_loadu_si512(at), _mm512_loadu_si512(at + 64)};
    return t;
}

static inline __attribute__((always_inline)) void tile_dot(vi a[][ACC], const uint8_t *tile, const kt_tables *t, int i) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), positions = _mm512_set1_epi32(0x30201000);
    const __m512i v = _mm512_loadu_si512(tile);
    const __m512i lo = _mm512_ternarylogic_epi32(v, nibble, positions, 0xEA); /* (v & 15) | p << 4 */
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), nibble, positions, 0xEA);
    const __m512i weight = _mm512_set1_epi8((char)(1 << i));
    vi *pair = a[0] + 2 * i % ACC;
    pair[0] = _mm512_dpbusd_epi32(pair[0], weight, _mm512_permutexvar_epi8(lo, t->lo));
    pair[1] = _mm512_dpbusd_epi32(pair[1], weight, _mm512_permutexvar_epi8(hi, t->hi));
}

#include "simd_kernels.h"
