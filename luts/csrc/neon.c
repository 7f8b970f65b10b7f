/* AArch64 NEON (ARMv8.0 baseline): a tile is four vectors of 4 rows.
 *
 * GEMV core: each nibble, tagged with its byte position p (idx | p << 4), picks from the
 * 64-byte table of runs 8t..8t+3 held in four registers (tbl); two pairwise widening adds
 * sum a row's four bytes, and a multiply-accumulate applies the plane weight 2^i.
 */
#include <arm_neon.h>
#include <string.h>

#include "isa.h"

#define ISA(name) name##_neon
#define W 4
#define ACC 4
#define GEMM_MR NEON_MR
#define GEMV_MR NEON_GEMV_MR
#define GEMM_ROW_BLOCKS 1 /* 4 × 16 microkernel: 16 accumulators */

typedef float32x4_t vf;
typedef int32x4_t vi;

#define U8(v) vreinterpretq_u8_s32(v)
#define S32(v) vreinterpretq_s32_u8(v)
#define f_zero() vdupq_n_f32(0.0f)
#define f_set1 vdupq_n_f32
#define f_load vld1q_f32
#define f_store vst1q_f32
#define f_add vaddq_f32
#define f_sub vsubq_f32
#define f_mul vmulq_f32
#define f_fmadd(a, b, c) vfmaq_f32(c, a, b)
#define f_max vmaxq_f32
#define f_abs vabsq_f32
#define f_xor(a, b) vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(a), vreinterpretq_u32_f32(b)))
#define f_reduce_max vmaxvq_f32
#define f_from_i vcvtq_f32_s32
#define f_half(p) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(p))))
#define i_zero() vdupq_n_s32(0)
#define i_load(p) S32(vld1q_u8((const uint8_t *)(p)))
#define i_add vaddq_s32
#define i_sub vsubq_s32
#define i_or vorrq_s32
#define i_set1 vdupq_n_s32
#define i_add_u8_times(a, p, c) vmlaq_n_s32(a, i_u8(p), c)
#define i_table16(p) S32(vld1q_u8(p))
#define i_lookup16(t, idx) S32(vqtbl1q_u8(U8(t), U8(idx)))
#define i_nibble(v, h) S32((h) ? vshrq_n_u8(U8(v), 4) : vandq_u8(U8(v), vdupq_n_u8(0x0F)))

static const uint8_t DWORD_BYTES[16] = {0, 0x80, 0x80, 0x80, 4, 0x80, 0x80, 0x80, 8, 0x80, 0x80, 0x80, 12, 0x80, 0x80, 0x80};
#define i_byte(v, p) S32(vqtbl1q_u8(U8(v), vaddq_u8(vld1q_u8(DWORD_BYTES), vdupq_n_u8((uint8_t)(p)))))

static inline vi i_u8(const uint8_t *p) {
    uint32_t four;
    memcpy(&four, p, sizeof four);
    return vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(four)))));
}

static inline void store_run(int8_t *dst, const vf *t, vf inv) {
    int16x8_t lo = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(t[0], inv))), vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(t[1], inv))));
    int16x8_t hi = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(t[2], inv))), vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(t[3], inv))));
    vst1q_s8(dst, vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)));
}

typedef struct {
    int8x16x4_t lo, hi; /* tables of runs 8t..8t+3 and 8t+4..8t+7 */
} kt_tables;

static inline kt_tables load_tables(const void *tq, int kt) {
    const int8_t *at = (const int8_t *)tq + (size_t)kt * 128;
    kt_tables t = {{{vld1q_s8(at), vld1q_s8(at + 16), vld1q_s8(at + 32), vld1q_s8(at + 48)}},
                   {{vld1q_s8(at + 64), vld1q_s8(at + 80), vld1q_s8(at + 96), vld1q_s8(at + 112)}}};
    return t;
}

static inline __attribute__((always_inline)) void tile_dot(vi a[][ACC], const uint8_t *tile, const kt_tables *t, int i) {
    const uint8x16_t positions = vreinterpretq_u8_u32(vdupq_n_u32(0x30201000)), nibble = vdupq_n_u8(0x0F);
    for (int rv = 0; rv < 4; rv++) {
        const uint8x16_t v = vld1q_u8(tile + 16 * rv);
        const int8x16_t lo = vqtbl4q_s8(t->lo, vorrq_u8(vandq_u8(v, nibble), positions));
        const int8x16_t hi = vqtbl4q_s8(t->hi, vorrq_u8(vshrq_n_u8(v, 4), positions));
        const int16x8_t pairs = vaddq_s16(vpaddlq_s8(lo), vpaddlq_s8(hi)); /* |.| ≤ 508 */
        a[rv][i & 1] = vmlaq_n_s32(a[rv][i & 1], vpaddlq_s16(pairs), 1 << i);
    }
}

#include "simd_kernels.h"
