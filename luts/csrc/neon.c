/* AArch64 NEON (ARMv8.0 baseline): a tile is four vectors of 4 rows.
 *
 * GEMV core: a tile plane's 16-byte quarters are its byte positions, so one register holds one
 * run's indices for 16 rows and each lookup is a one-register tbl; widening adds sum a row's runs in int16,
 * and a tile's planes (times 2^i) too, widened to int32 once a tile (tile_dots).
 */
#include <arm_neon.h>
#include <string.h>

#include "isa.h"

#define ISA(name) name##_neon
#define W 4
#define ACC 1 /* one int32 accumulator a row vector: tile_dots sums a tile's planes in int16 first */
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
#define f_bf16(p) vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)(p)), 16))
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

#define i_store(p, v) vst1q_u8((uint8_t *)(p), U8(v))

/* v[c] lane t = v[t] lane c, for c, t < 4. */
static inline __attribute__((always_inline)) void f_transpose(vf v[4]) {
    const float32x4x2_t a = vtrnq_f32(v[0], v[1]), b = vtrnq_f32(v[2], v[3]);
    for (int q = 0; q < 2; q++) {
        v[q] = vcombine_f32(vget_low_f32(a.val[q]), vget_low_f32(b.val[q]));
        v[2 + q] = vcombine_f32(vget_high_f32(a.val[q]), vget_high_f32(b.val[q]));
    }
}

static inline vi i_u8(const uint8_t *p) {
    uint32_t four;
    memcpy(&four, p, sizeof four);
    return vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(four)))));
}

static inline void store_run(int8_t *dst, const vf *t, vf inv) {
    int16x8_t lo = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(t[0], inv))),
                                vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(t[1], inv))));
    int16x8_t hi = vcombine_s16(vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(t[2], inv))),
                                vqmovn_s32(vcvtnq_s32_f32(vmulq_f32(t[3], inv))));
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

/* The low (runs 8t..8t+3) and high (8t+4..8t+7) nibbles of one byte position p of all 16 rows, looked up
 * and summed per row in int16 into rows[0] (rows 0-7) and rows[1] (8-15). */
static inline __attribute__((always_inline)) void position_sums(uint8x16_t p_bytes, int8x16_t lo_table,
                                                                int8x16_t hi_table, int16x8_t rows[2]) {
    const int8x16_t lo = vqtbl1q_s8(lo_table, vandq_u8(p_bytes, vdupq_n_u8(0x0F)));
    const int8x16_t hi = vqtbl1q_s8(hi_table, vshrq_n_u8(p_bytes, 4));
    rows[0] = vaddq_s16(rows[0], vaddl_s8(vget_low_s8(lo), vget_low_s8(hi)));
    rows[1] = vaddq_s16(rows[1], vaddl_high_s8(lo, hi));
}

/* All planes of a tile. Each 16 bytes of a plane are one byte position of all 16 rows (layout.py), so a register
 * holds one run's indices and every lookup is a one-register tbl. Up to 5 bits the planes sum in int16 (each row
 * at most (2^5 − 1) · 8 · 127 = 31496) and widen once a tile; wider codes widen every plane. */
#define ISA_OWN_TILE_DOTS
static inline __attribute__((always_inline)) void tile_dots(vi a[][ACC], const uint8_t *tile, const kt_tables *t,
                                                            const int bits, const int tiles) {
    (void)tiles;
    int16x8_t total[2] = {vdupq_n_s16(0), vdupq_n_s16(0)};
#pragma GCC unroll 8
    for (int i = 0; i < bits; i++) {
        lut_prefetch_line(tile + i * LUT_TILE_BYTES);
        int16x8_t plane[2] = {vdupq_n_s16(0), vdupq_n_s16(0)};
        for (int p = 0; p < 4; p++)
            position_sums(vld1q_u8(tile + i * LUT_TILE_BYTES + LUT_TILE_BYTE(0, p)), t->lo.val[p], t->hi.val[p], plane);
        if (bits <= 5) {
            total[0] = vmlaq_n_s16(total[0], plane[0], (int16_t)(1 << i));
            total[1] = vmlaq_n_s16(total[1], plane[1], (int16_t)(1 << i));
        } else
            for (int h = 0; h < 2; h++) {
                a[2 * h][0] = vmlaq_n_s32(a[2 * h][0], vmovl_s16(vget_low_s16(plane[h])), 1 << i);
                a[2 * h + 1][0] = vmlaq_n_s32(a[2 * h + 1][0], vmovl_high_s16(plane[h]), 1 << i);
            }
    }
    if (bits <= 5)
        for (int h = 0; h < 2; h++) {
            a[2 * h][0] = vaddw_s16(a[2 * h][0], vget_low_s16(total[h]));
            a[2 * h + 1][0] = vaddw_high_s16(a[2 * h + 1][0], total[h]);
        }
}

/* The int8 GEMM (simd_kernels.h) on ARMv8.2's sdot: four byte products a lane summed into int32, the activations'
 * word as its lane operand, so one instruction per code vector and activation row (the fp32 GEMM's fmla takes four
 * products). */
#ifdef NEON_INT8_DOTS
#define ISA_INT8_DOTS
#ifdef __ARM_FEATURE_DOTPROD
#define ISA_INT8_TARGET_BEGIN
#define ISA_INT8_TARGET_END
#else
#define ISA_INT8_TARGET_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"arch=armv8.2-a+dotprod\")")
#define ISA_INT8_TARGET_END _Pragma("GCC pop_options")
#endif
#define I8_ROWS 4 /* 4 rows × 4 row vectors of accumulators */
#define i_from_f vcvtnq_s32_f32 /* round half to even */
#define i_mul vmulq_s32

ISA_INT8_TARGET_BEGIN
/* Rows 4rv..4rv+3 of a plane in row order: byte 4r + p from byte 16p + 4rv + r, one four-register tbl. */
static inline vi plane_rows(const uint8_t *plane, int rv) {
    static const uint8_t by_row[16] = {0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51};
    return S32(vqtbl4q_u8(vld1q_u8_x4(plane), vaddq_u8(vld1q_u8(by_row), vdupq_n_u8((uint8_t)(4 * rv)))));
}

/* A tile's 32 activations (int32, |·| ≤ 127) as int8, input 16h + 4p + j to byte 4(4h + j) + p: narrowed in input
 * order (q[4h + p] lane j is input 16h + 4p + j), then a 4 × 4 byte transpose per half. */
static inline void i8_store_tile(int8_t *to, const vi *q) {
    static const uint8_t transpose[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    for (int h = 0; h < 2; h++) {
        const int16x8_t p01 = vcombine_s16(vmovn_s32(q[4 * h]), vmovn_s32(q[4 * h + 1]));
        const int16x8_t p23 = vcombine_s16(vmovn_s32(q[4 * h + 2]), vmovn_s32(q[4 * h + 3]));
        vst1q_s8(to + 16 * h, vqtbl1q_s8(vcombine_s8(vmovn_s16(p01), vmovn_s16(p23)), vld1q_u8(transpose)));
    }
}

/* acc[r][rv] lane q += Σ_{h,j,p} (byte 4q + p of codes[rv][h][j]) · (row r's a[4(4h + j) + p]), for the rows at
 * a + r·k: activation word j of each 16 bytes is sdot's lane operand for codes[rv][h][j] (codes are 0-15, so
 * signed bytes too). Each code vector is loaded once for all the rows, and consecutive sdots add into different
 * accumulators, where row by row every row reloaded the tile's 32 code vectors and an in-order core's sdot waited
 * for the one before it; the big cores are held by their sdot issue rate either way (llvm-mca estimates from
 * `npumoe bench neon`: docs/performance.md, "bench neon"). */
#define ISA_OWN_I8_ROWS
#define I8_LANE_DOTS(j)                                                                                        \
    do {                                                                                                        \
        const int8x16_t c = vreinterpretq_s8_s32(codes[rv][h][j]);                                              \
        for (int r = 0; r < rows; r++) sum[r][rv] = vdotq_laneq_s32(sum[r][rv], c, x[r], j);                   \
    } while (0)
static inline __attribute__((always_inline)) void i8_tile_rows(vi acc[][LUT_ROWS / W], const vi codes[][2][4],
                                                               const int8_t *a, int k, const int rows) {
    vi sum[I8_ROWS][LUT_ROWS / W]; /* acc and codes are both vi arrays that may alias: a copy lets sums stay put */
    for (int r = 0; r < rows; r++)
        for (int rv = 0; rv < LUT_ROWS / W; rv++) sum[r][rv] = acc[r][rv];
    for (int h = 0; h < 2; h++) {
        int8x16_t x[I8_ROWS];
        for (int r = 0; r < rows; r++) x[r] = vld1q_s8(a + (size_t)r * k + 16 * h);
        for (int rv = 0; rv < LUT_ROWS / W; rv++) {
            I8_LANE_DOTS(0);
            I8_LANE_DOTS(1);
            I8_LANE_DOTS(2);
            I8_LANE_DOTS(3);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int rv = 0; rv < LUT_ROWS / W; rv++) acc[r][rv] = sum[r][rv];
}
#undef I8_LANE_DOTS
ISA_INT8_TARGET_END
#endif

#include "simd_kernels.h"
