/* LUT-GEMV and LUT-dequant GEMM over npumoe's tiled bit-serial weights.
 *
 * The arithmetic is defined by luts/spec.py and the tile arrangement by luts/layout.py;
 * this header only names the pieces. One shared library is built per instruction set
 * (NPUMOE_ISA_PORTABLE / _AVX2 / _AVX512 / _NEON); each holds the portable reference
 * kernels plus, when not portable, that ISA's fast versions of the same functions.
 */
#ifndef NPUMOE_LUT_H
#define NPUMOE_LUT_H

#include <stddef.h>
#include <stdint.h>

#define LUT_ROWS 16       /* output rows per tile: one 32-bit lane each */
#define LUT_TILE_K 32     /* inputs per tile */
#define LUT_TILE_BYTES 64
#define LUT_TILE_BYTE(r, p) (16 * (p) + (r)) /* row r's byte position p in a plane: runs 8t+p | 8t+4+p (layout.py) */
#define LUT_MAX_THREADS 64
/* The GEMV requests every weight cache line twice: into L2 far ahead (hardware prefetchers stop at 4 KB pages, and a
 * compute-heavy loop keeps too few misses in flight on its own), then into L1 half as far (an L2 hit still stalls the
 * loop). Only the second goes to L1: each byte is used once, and lines brought in far ahead would evict the tables
 * and tiles in use. A third request between the two (for prefetches the memory system drops when its queues are
 * full) cost more instructions than it brought. The best distance is about twice DRAM's latency at one core's read
 * rate and differs from machine to machine (32 KB, tuned on Zen 4, was too far on a Zen 5 VM), so it is measured at
 * first use (luts/tuning.py) and set here; LUT_PREFETCH_FAR until then. Measurements: docs/performance.md,
 * "LUT-GEMV prefetch". */
#define LUT_PREFETCH_FAR 12288
/* The distance in force, set between calls (npumoe_lut_set_prefetch): one load from L1 per use, beside the tile's
 * dozens of instructions. The llvm-mca harnesses (csrc/mca_*.c) model the loop with the default as a constant. */
#ifdef LUT_PREFETCH_CONSTANT
#define lut_prefetch_far LUT_PREFETCH_FAR
#else
extern int lut_prefetch_far;
#endif
/* Scales and zeros (elements ahead; a row block's group is 16 of each): 2 KB and 1 KB, as far ahead
 * in time as 16 KB of weights at 2 bits. A quarter of that cost int2 bandwidth; anywhere from half to
 * twice it measures alike (docs/performance.md, "LUT-GEMV prefetch"). */
#define LUT_PREFETCH_PARAMS 1024
#define lut_prefetch_line(p)                                            \
    (__builtin_prefetch((const char *)(p) + lut_prefetch_far, 0, 2), \
     __builtin_prefetch((const char *)(p) + (lut_prefetch_far >> 1), 0, 3))

#if defined(_WIN32)
#define NPUMOE_API __declspec(dllexport)
#else
#define NPUMOE_API __attribute__((visibility("default")))
#endif

typedef struct {
    const uint8_t *tiles;   /* [NB][K/32][bits][64] */
    const uint16_t *scales; /* [NB][G][16] float16 bits */
    const uint8_t *zeros;   /* [NB][G][16], or NULL: symmetric, z = 2^(bits-1) */
    int row_blocks, k, bits, group;
} lut_weight;

typedef struct {
    const void *tq;         /* [K/4][16] int8 or int16 */
    const float *t_scales;  /* [G] */
    const int32_t *xq;      /* [G]: sum of entry 15 over the group */
    int table_bits;         /* 8 or 16 */
    /* Per group, for the SIMD epilogue (lut_epilogue_terms): the total A + (2^b − 1 − 2z)·Xq is
     * bias + A + z·zero_coef, so the accumulators start at bias and zeros need one multiply-add. */
    const float *half_ts;      /* [G] t_scales / 2 */
    const int32_t *bias;       /* [G] (2^b − 1)·Xq, or −Xq for symmetric weights (z = 2^(b−1)) */
    const int32_t *zero_coef;  /* [G] −2·Xq: |·| < 2^15 for int8 tables, a 16-bit multiplier */
} lut_tables;

static inline int lut_groups(const lut_weight *w) { return w->k / w->group; }
static inline int lut_k_tiles(const lut_weight *w) { return w->k / LUT_TILE_K; }
static inline const uint8_t *lut_tile(const lut_weight *w, int rb, int kt) {
    return w->tiles + ((size_t)rb * lut_k_tiles(w) + kt) * w->bits * LUT_TILE_BYTES;
}
static inline size_t lut_block_param(const lut_weight *w, int rb, int g) {
    return ((size_t)rb * lut_groups(w) + g) * LUT_ROWS;
}
static inline int lut_zero(const lut_weight *w, size_t at) {
    return w->zeros ? w->zeros[at] : 1 << (w->bits - 1);
}
/* 2^b - 1 - 2z, the coefficient of Xq in the epilogue. */
static inline int lut_zero_term(const lut_weight *w, size_t at) {
    return (1 << w->bits) - 1 - 2 * lut_zero(w, at);
}

float lut_half_to_float(uint16_t h);
static inline float lut_bf16_to_float(uint16_t h) { /* a bf16 value is the top half of an fp32 one */
    const uint32_t w = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &w, sizeof f);
    return f;
}
extern const uint32_t lut_repack[8][16]; /* level-1 dequant table: bit j of idx -> bit i of byte j */
extern const uint8_t lut_repack_bytes[8][4][16]; /* byte j of lut_repack[i][idx], for byte shuffles */

/* One implementation of each step; an ISA file provides the subset it speeds up. */
void tables_portable(const float *x, int k, int group, int table_bits, void *tq, float *t_scales, int32_t *xq);
void gemv_portable(const lut_weight *w, const lut_tables *t, int rb0, int rb1, float *y, int32_t *acc);
void dequant_tile_portable(const lut_weight *w, int rb, int kt, float *panel, int ld); /* panel [32][ld] */
void gemm_portable(const lut_weight *w, const float *xt, int m_pad, int m, int rb0, int rb1, float *y, int ldy);

/* Batched one-activation GEMVs (api.c, bf16.c): each call streams all its tasks' matrices as one run. */
typedef struct {
    const lut_weight *w;
    const float *x; /* [k] */
    float *y;       /* [row_blocks*16] */
} npumoe_lut_task;
/* Sets lut_prefetch_far for every later call: bytes, rounded down to a cache line, at least two. Returns the
 * distance set. */
NPUMOE_API int npumoe_lut_set_prefetch(int far_bytes);
NPUMOE_API int npumoe_lut_gemv_many(const npumoe_lut_task *tasks, int count, int table_bits, int threads);

typedef struct { /* y [m][row_blocks*16] = x [m][k] · Wᵀ */
    const lut_weight *w;
    const float *x;
    float *y;
    int m;
} npumoe_lut_rows_task;
NPUMOE_API int npumoe_lut_gemm_i8_many(const npumoe_lut_rows_task *tasks, int count, int threads);
NPUMOE_API int npumoe_lut_gemv_rows_many(const npumoe_lut_rows_task *tasks, int count, int threads);

typedef struct { /* W [n][k] bf16, x [m][k] and y [m][n] fp32, all row-major */
    const uint16_t *w;
    const float *x;
    float *y;
    int m, n, k;
} npumoe_bf16_task;
NPUMOE_API int npumoe_bf16_gemv_many(const npumoe_bf16_task *tasks, int count, int threads);
NPUMOE_API int npumoe_bf16_dot_available(void);
NPUMOE_API int npumoe_bf16_dot_gemm_many(const npumoe_bf16_task *tasks, int count, int threads);
NPUMOE_API int npumoe_bf16_gemm_many(const npumoe_bf16_task *tasks, int count, int threads);

/* Thread pool: fn(ctx, begin, end) over contiguous chunks covering [0, units), of at least min_chunk
 * (≥ 1) units where there are enough for one chunk per thread. */
typedef void (*lut_range_fn)(void *ctx, int begin, int end);
void lut_parallel(lut_range_fn fn, void *ctx, int units, int threads, int min_chunk);
/* Bytes a chunk of a streaming job (GEMV, bandwidth probe) covers at least: each chunk restarts the
 * read stream, whose first 12 KB come without the far prefetch, so a matrix cut into many small
 * chunks reads below the plain read's rate (docs/performance.md, "Streaming chunks"). */
#define LUT_STREAM_CHUNK (1 << 20)
/* Several matrices as one parallel job: their units (row blocks, rows) numbered one after another, task t's from
 * first[t], first[count] in all, so the threads stream one long run of weights instead of restarting (and waking)
 * per matrix. fn(ctx, t, begin, end) gets each chunk's part of task t as the task's own units begin..end-1; chunks
 * cover LUT_STREAM_CHUNK of the weight_bytes at least, but one chunk per thread at most. */
typedef void (*lut_span_fn)(void *ctx, int task, int begin, int end);
void lut_parallel_tasks(lut_span_fn fn, void *ctx, const int *first, int count, size_t weight_bytes, int threads);

#endif
