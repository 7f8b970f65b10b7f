/* Linear: the HVX LUT-GEMV inner kernel, one 128-row block × one weight group per call.
 *
 * Per bit plane and run pair p: one 128-byte load of indices (row HVX_ROW(j) in byte j),
 * VLUT16 on the low nibbles with selector 2(p & 1) and, after one halfword shift by 4,
 * on the high nibbles with selector 2(p & 1) + 1 (:nomatch ignores the upper nibble), then
 * two widening adds into int32 (vadd .h → .w): 128 lookups per VLUT16, every one exact.
 * Planes are combined Horner-style, A = 2·A + plane (vasl-accumulate), top plane first.
 * Each (bits, group) pair gets its own fully unrolled block: straight-line code that the
 * VLIW packetizer software-pipelines (next loads beside current lookups), and whose
 * instructions `npumoe bench hvx` counts in the disassembly.
 */
#include <hexagon_types.h>
#include <hexagon_protos.h>

#include "lut_hvx.h"

typedef void (*block_fn)(const HVX_Vector *tiles, const HVX_Vector *tables, HVX_Vector *acc);

static inline __attribute__((always_inline)) void block(const HVX_Vector *tiles, const HVX_Vector *tables,
                                                        HVX_Vector *acc, const int bits, const int group) {
    const int pairs = group / 8;
    HVX_Vector total[4];
#pragma unroll
    for (int i = bits - 1; i >= 0; i--) {
        const HVX_Vector *plane = tiles + i * pairs;
        HVX_VectorPair lo, hi;
#pragma unroll
        for (int p = 0; p < pairs; p++) {
            const HVX_Vector idx = plane[p], table = tables[p >> 1];
            HVX_VectorPair a = Q6_Wh_vlut16_VbVhR_nomatch(idx, table, 2 * (p & 1));
            HVX_VectorPair b = Q6_Wh_vlut16_VbVhR_nomatch(Q6_Vuh_vlsr_VuhR(idx, 4), table, 2 * (p & 1) + 1);
            if (p == 0) {
                lo = Q6_Ww_vadd_VhVh(Q6_V_lo_W(a), Q6_V_lo_W(b));
                hi = Q6_Ww_vadd_VhVh(Q6_V_hi_W(a), Q6_V_hi_W(b));
            } else {
                lo = Q6_Ww_vaddacc_WwVhVh(lo, Q6_V_lo_W(a), Q6_V_lo_W(b));
                hi = Q6_Ww_vaddacc_WwVhVh(hi, Q6_V_hi_W(a), Q6_V_hi_W(b));
            }
        }
        const HVX_Vector plane_sum[4] = {Q6_V_lo_W(lo), Q6_V_hi_W(lo), Q6_V_lo_W(hi), Q6_V_hi_W(hi)};
#pragma unroll
        for (int v = 0; v < 4; v++)
            total[v] = i == bits - 1 ? plane_sum[v] : Q6_Vw_vaslacc_VwVwR(plane_sum[v], total[v], 1);
    }
#pragma unroll
    for (int v = 0; v < 4; v++) acc[v] = total[v];
}

#define BLOCK(b, g)                                                                                      \
    __attribute__((noinline)) void hvx_block_b##b##_g##g(const HVX_Vector *tiles, const HVX_Vector *tables, \
                                                         HVX_Vector *acc) {                              \
        block(tiles, tables, acc, b, g);                                                                 \
    }
#define GROUPS(b) BLOCK(b, 32) BLOCK(b, 64) BLOCK(b, 128)
GROUPS(1) GROUPS(2) GROUPS(3) GROUPS(4) GROUPS(5) GROUPS(6) GROUPS(8)

#define ROW(b) {hvx_block_b##b##_g32, hvx_block_b##b##_g64, hvx_block_b##b##_g128}
static const block_fn blocks[9][3] = {[1] = ROW(1), [2] = ROW(2), [3] = ROW(3), [4] = ROW(4), [5] = ROW(5),
                                      [6] = ROW(6), [8] = ROW(8)};

static block_fn find(int bits, int group) {
    if (bits < 1 || bits > 8 || (group != 32 && group != 64 && group != 128)) return 0;
    return blocks[bits][group == 32 ? 0 : group == 64 ? 1 : 2];
}

int hvx_linear_supported(int bits, int group) { return find(bits, group) != 0; }

void hvx_linear(const hvx_weight *w, const int16_t *tables, int32_t *acc) {
    const block_fn fn = find(w->bits, w->group);
    const int groups = hvx_groups(w->k, w->group), per_group = w->bits * w->group / 8; /* vectors of indices */
    const HVX_Vector *tiles = (const HVX_Vector *)w->tiles, *t = (const HVX_Vector *)tables;
    HVX_Vector *out = (HVX_Vector *)acc;
    for (int rb = 0; rb < w->row_blocks; rb++)
        for (int g = 0; g < groups; g++, tiles += per_group, out += 4) fn(tiles, t + g * (w->group / 16), out);
}
