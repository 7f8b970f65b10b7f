/* The scalar C model of `linear`: the same tile and table layouts read one lookup at a time,
 * so a disagreement with the HVX kernel points at an intrinsic's lane order, not the data. */
#include "lut_hvx.h"

void hvx_linear_reference(const hvx_weight *w, const int16_t *tables, int32_t *acc) {
    const int groups = hvx_groups(w->k, w->group), pairs = w->group / 8;
    const uint8_t *vec = w->tiles;
    for (int rb = 0; rb < w->row_blocks; rb++)
        for (int g = 0; g < groups; g++, acc += HVX_ROWS) {
            for (int r = 0; r < HVX_ROWS; r++) acc[r] = 0;
            for (int i = 0; i < w->bits; i++)
                for (int p = 0; p < pairs; p++, vec += HVX_BYTES)
                    for (int j = 0; j < HVX_BYTES; j++)
                        for (int nibble = 0; nibble < 2; nibble++) {
                            const int run = g * pairs * 2 + 2 * p + nibble, sel = run & 3;
                            const int e = (vec[j] >> (4 * nibble)) & 15;
                            acc[HVX_ROW(j)] +=
                                tables[(run >> 2) * 64 + 2 * (16 * (sel & 1) + e) + (sel >> 1)] * (1 << i);
                        }
        }
}
