/* The emulated front end: a request on stdin, the raw outputs on stdout (luts/hvx/driver.py).
 *   header  int32[8]: op, rt or row blocks, k, bits, group, reference flag, 0, 0
 *   op 1    VLUT16 probe: idx u8[128], table i16[64] → the :nomatch pair, lo then hi, i16[128]
 *   op 2    GEMV: x f32[K], tiles u8, scales f32[NB·G·128], zeros u8[NB·G·128] →
 *           tables i16[K/16·64], t_scales f32[G], xq i32[G], A i32[NB·G·128],
 *           the scalar model's A (if the flag is set), y f32[NB·128]
 */
#include <hexagon_types.h>
#include <hexagon_protos.h>

#include "lut_hvx.h"
#include "rt.h"

enum { OP_PROBE = 1, OP_GEMV = 2 };

static void *input(size_t bytes) {
    void *p = rt_alloc(bytes);
    rt_read(p, bytes);
    return p;
}

static void probe(int rt) {
    const HVX_Vector *idx = input(HVX_BYTES), *table = input(HVX_BYTES);
    HVX_VectorPair *out = rt_alloc(sizeof(HVX_VectorPair));
    *out = Q6_Wh_vlut16_VbVhR_nomatch(*idx, *table, rt);
    rt_write(out, sizeof *out);
}

static void gemv(const int32_t *h) {
    const int row_blocks = h[1], k = h[2], bits = h[3], group = h[4], reference = h[5];
    if (!hvx_linear_supported(bits, group) || k <= 0 || k & (group - 1) || row_blocks <= 0)
        rt_fail("unsupported GEMV shape");
    const size_t groups = (size_t)hvx_groups(k, group), params = (size_t)row_blocks * groups * HVX_ROWS;
    const float *x = input((size_t)k * 4);
    const hvx_weight w = {bits, group, row_blocks, k, input(params * bits * group / 8), input(params * 4),
                          input(params)};
    const hvx_tables t = {rt_alloc((size_t)k / 16 * 128), rt_alloc(groups * 4), rt_alloc(groups * 4)};
    int32_t *acc = rt_alloc(params * 4);
    float *y = rt_alloc((size_t)row_blocks * HVX_ROWS * 4);
    hvx_precompute(x, k, group, &t);
    hvx_linear(&w, t.tables, acc);
    hvx_finalize(&w, acc, &t, y);
    rt_write(t.tables, (size_t)k / 16 * 128);
    rt_write(t.t_scales, groups * 4);
    rt_write(t.xq, groups * 4);
    rt_write(acc, params * 4);
    if (reference) {
        hvx_linear_reference(&w, t.tables, acc);
        rt_write(acc, params * 4);
    }
    rt_write(y, (size_t)row_blocks * HVX_ROWS * 4);
}

int main(void) {
    int32_t header[8];
    rt_read(header, sizeof header);
    if (header[0] == OP_PROBE) probe(header[1]);
    else if (header[0] == OP_GEMV) gemv(header);
    else rt_fail("unknown request");
    return 0;
}
