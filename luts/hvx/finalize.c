/* Finalize: the spec's epilogue in scalar fp32 (qemu's HVX has no float; on v68+ hardware
 * this is a handful of qfloat multiplies per 128 rows and group, negligible beside linear). */
#include "lut_hvx.h"

void hvx_finalize(const hvx_weight *w, const int32_t *acc, const hvx_tables *t, float *y) {
    const int groups = hvx_groups(w->k, w->group), levels = (1 << w->bits) - 1;
    for (int rb = 0; rb < w->row_blocks; rb++, y += HVX_ROWS) {
        for (int r = 0; r < HVX_ROWS; r++) y[r] = 0.0f;
        for (int g = 0; g < groups; g++) {
            const size_t at = ((size_t)rb * groups + g) * HVX_ROWS;
            const float half_ts = t->t_scales[g] * 0.5f;
            for (int r = 0; r < HVX_ROWS; r++) {
                const int zero_term = levels - 2 * w->zeros[at + r];
                const float total = (float)acc[at + r] + (float)zero_term * (float)t->xq[g];
                y[r] += w->scales[at + r] * half_ts * total;
            }
        }
    }
}
