/* A command-line front end to the exported kernels, for running another architecture's
 * build under an emulator (qemu-user) where ctypes cannot load it. luts/emulated.py
 * writes the request and reads the response.
 *
 *   driver REQUEST RESPONSE
 *   request:  int32 op, m, row_blocks, k, bits, group, table_bits, has_zeros, then
 *             op 1 tables:  x[k] f32                  -> tq[k/4][16], t_scales[G] f32, xq[G] i32
 *             op 2 gemv:    x[m][k] f32, weight       -> y[m][NB*16] f32, acc[m][NB*16][G] i32
 *             op 3 dequant: weight                    -> w[NB*16][k] f32
 *             op 4 gemm:    x[m][k] f32, weight       -> y[m][NB*16] f32
 *             op 5 bf16:    x[m][k] f32, w[NB][k] bf16 -> y[m][NB] f32   (NB: rows, not blocks, here)
 *             op 6 bf16 GEMM: as op 5
 *             op 7 int8 GEMM: x[m][k] f32, weight -> y[m][NB*16] f32; exit status 3 where the build or CPU has none
 *   weight:   tiles[NB][k/32][bits][64] u8, scales[NB][G][16] f16, zeros[NB][G][16] u8 if has_zeros
 */
#include <stdio.h>
#include <stdlib.h>

#include "lut.h"

const char *npumoe_lut_isa(void);
void npumoe_lut_tables(const float *, int, int, int, void *, float *, int32_t *);
int npumoe_lut_gemv(const lut_weight *, const float *, int, int, float *, int32_t *, int);
void npumoe_lut_dequant(const lut_weight *, float *, int);
int npumoe_lut_gemm(const lut_weight *, const float *, int, float *, int);
int npumoe_bf16_gemv(const uint16_t *, const float *, int, int, int, float *, int);
int npumoe_bf16_gemm(const uint16_t *, const float *, int, int, int, float *, int);
int npumoe_lut_gemm_i8(const lut_weight *, const float *, int, float *, int);

static void *take(FILE *f, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "driver: short request\n");
        exit(2);
    }
    return p;
}

static void give(FILE *f, const void *p, size_t bytes) {
    if (fwrite(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "driver: cannot write the response\n");
        exit(2);
    }
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s REQUEST RESPONSE (kernels: %s)\n", argv[0], npumoe_lut_isa());
        return 2;
    }
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (!in || !out) {
        perror("driver");
        return 2;
    }
    int32_t *h = take(in, 8 * sizeof(int32_t));
    const int op = h[0], m = h[1], nb = h[2], k = h[3], bits = h[4], group = h[5], table_bits = h[6];
    const size_t groups = (size_t)k / group, rows = (size_t)nb * LUT_ROWS, threads = 2;
    float *x = op == 1 ? take(in, sizeof(float) * k) : op != 3 ? take(in, sizeof(float) * m * k) : NULL;
    uint8_t *tiles = NULL, *zeros = NULL;
    uint16_t *scales = NULL;
    if ((op >= 2 && op <= 4) || op == 7) {
        tiles = take(in, (size_t)nb * (k / LUT_TILE_K) * bits * LUT_TILE_BYTES);
        scales = take(in, sizeof(uint16_t) * rows * groups);
        zeros = h[7] ? take(in, rows * groups) : NULL;
    }
    const lut_weight w = {tiles, scales, zeros, nb, k, bits, group};
    if (op == 1) {
        void *tq = malloc((size_t)k * 4 * (table_bits / 8));
        float *t_scales = malloc(sizeof(float) * groups);
        int32_t *xq = malloc(sizeof(int32_t) * groups);
        npumoe_lut_tables(x, k, group, table_bits, tq, t_scales, xq);
        give(out, tq, (size_t)k * 4 * (table_bits / 8));
        give(out, t_scales, sizeof(float) * groups);
        give(out, xq, sizeof(int32_t) * groups);
    } else if (op == 2) {
        float *y = malloc(sizeof(float) * m * rows);
        int32_t *acc = malloc(sizeof(int32_t) * m * rows * groups);
        if (npumoe_lut_gemv(&w, x, m, table_bits, y, acc, threads)) return 1;
        give(out, y, sizeof(float) * m * rows);
        give(out, acc, sizeof(int32_t) * m * rows * groups);
    } else if (op == 3) {
        float *dense = malloc(sizeof(float) * rows * k);
        npumoe_lut_dequant(&w, dense, threads);
        give(out, dense, sizeof(float) * rows * k);
    } else if (op == 4) {
        float *y = malloc(sizeof(float) * m * rows);
        if (npumoe_lut_gemm(&w, x, m, y, threads)) return 1;
        give(out, y, sizeof(float) * m * rows);
    } else if (op == 7) {
        float *y = malloc(sizeof(float) * m * rows);
        const int status = npumoe_lut_gemm_i8(&w, x, m, y, threads);
        if (status) return status == -2 ? 3 : 1;
        give(out, y, sizeof(float) * m * rows);
    } else if (op == 5 || op == 6) {
        uint16_t *bf16 = take(in, sizeof(uint16_t) * nb * k);
        float *y = malloc(sizeof(float) * m * nb);
        if ((op == 5 ? npumoe_bf16_gemv : npumoe_bf16_gemm)(bf16, x, m, nb, k, y, threads)) return 1;
        give(out, y, sizeof(float) * m * nb);
    } else {
        fprintf(stderr, "driver: unknown op %d\n", op);
        return 2;
    }
    return fclose(out) ? 1 : 0;
}
