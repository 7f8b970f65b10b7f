/* The exported entry points (loaded with ctypes by luts/kernels.py) and the choice of
 * kernels for the instruction set this library was compiled for.
 */
#include <stdlib.h>
#include <string.h>

#include "lut.h"
#include "isa.h"

#if defined(NEON_INT8_DOTS) && !defined(__ARM_FEATURE_DOTPROD) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

typedef struct {
    const char *name;
    void (*tables8)(const float *, int, int, int, void *, float *, int32_t *);
    void (*gemv8)(const lut_weight *, const lut_tables *, int, int, float *, int32_t *);
    void (*dequant_tile)(const lut_weight *, int, int, float *, int);
    void (*gemm)(const lut_weight *, const float *, int, int, int, int, float *, int);
    int gemm_mr; /* the GEMM pads the activation rows to a multiple of this */
    void (*gemv8_multi)(const lut_weight *, const lut_tables *const *, int, int, float *const *, int); /* or NULL */
    int gemv_mr; /* the most activation rows gemv8_multi takes at once */
    void (*gemm_i8)(const lut_weight *, const int8_t *, const float *, const int32_t *, int, int, int, float *, int);
    void (*int8_rows)(const float *, int, int, int, int8_t *, float *, int32_t *); /* its activations */
    void (*bf16_gemm)(const uint16_t *, int, int, const float *, const float *, int, int, int, float *); /* or NULL */
    void (*bf16_xtb)(const float *, int, int, int, int, float *);                         /* its activations */
} lut_isa;

static const lut_isa ISA =
#if defined(NPUMOE_ISA_AVX512)
    {"avx512", tables_avx512, gemv_avx512, dequant_tile_avx512, gemm_avx512, AVX512_MR, gemv_multi_avx512,
     AVX512_GEMV_MR, gemm_i8_avx512, int8_rows_avx512, bf16_gemm_avx512, bf16_xtb_avx512};
#elif defined(NPUMOE_ISA_AVX2)
    {"avx2", tables_avx2, gemv_avx2, dequant_tile_avx2, gemm_avx2, AVX2_MR, gemv_multi_avx2, AVX2_GEMV_MR, gemm_i8_avx2,
     int8_rows_avx2, bf16_gemm_avx2, bf16_xtb_avx2};
#elif defined(NPUMOE_ISA_NEON)
    {"neon", tables_neon, gemv_neon, dequant_tile_neon, gemm_neon, NEON_MR, gemv_multi_neon, NEON_GEMV_MR,
#ifdef NEON_INT8_DOTS
     gemm_i8_neon, int8_rows_neon,
#else
     NULL, NULL,
#endif
     bf16_gemm_neon, bf16_xtb_neon};
#else
    {"portable", tables_portable, gemv_portable, dequant_tile_portable, gemm_portable, 1, NULL, 1, NULL, NULL, NULL,
     NULL};
#endif

NPUMOE_API const char *npumoe_lut_isa(void) { return ISA.name; }

int lut_prefetch_far = LUT_PREFETCH_FAR;

NPUMOE_API int npumoe_lut_set_prefetch(int far_bytes) {
    return lut_prefetch_far = far_bytes < 128 ? 128 : far_bytes & ~63;
}

/* Bit 0: AVX2+FMA+F16C; bit 1: AVX-512 F/BW/VL/DQ + VBMI + VNNI; bit 2: NEON. */
NPUMOE_API unsigned npumoe_cpu_features(void) {
    unsigned f = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) f |= 1;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi") &&
        __builtin_cpu_supports("avx512vnni"))
        f |= 2;
#elif defined(__aarch64__)
    f |= 4;
#endif
    return f;
}

NPUMOE_API void npumoe_lut_tables(const float *x, int k, int group, int table_bits, void *tq, float *t_scales,
                                  int32_t *xq) {
    (table_bits == 8 ? ISA.tables8 : tables_portable)(x, k, group, table_bits, tq, t_scales, xq);
}

typedef struct {
    const lut_weight *w;
    const lut_tables *t;
    float *y;
    int32_t *acc;
} gemv_job;

static void gemv_range(void *ctx, int rb0, int rb1) {
    gemv_job *job = ctx;
    (job->t->table_bits == 8 ? ISA.gemv8 : gemv_portable)(job->w, job->t, rb0, rb1, job->y, job->acc);
}

/* The weight entry points take one prepared lut_weight (built once per weight by the caller), not its
 * seven fields: a decode step calls them per expert matrix, with the caller's own state cold in cache. */

/* Bytes of one row's tables against w: the group arrays first, so each stays 4-byte aligned whatever the
 * table size. */
static size_t table_bytes(const lut_weight *w, int table_bits) {
    return sizeof(float) * 5 * (size_t)(w->k / w->group) + (size_t)w->k * 4 * (table_bits / 8);
}

/* The tables of one row x against w, built in block (table_bytes of it). */
static lut_tables prepared_tables(const lut_weight *w, const float *x, int table_bits, char *block) {
    const int groups = w->k / w->group;
    float *t_scales = (float *)block, *half_ts = t_scales + groups;
    int32_t *xq = (int32_t *)(half_ts + groups), *bias = xq + groups, *zero_coef = bias + groups;
    void *tq = zero_coef + groups;
    npumoe_lut_tables(x, w->k, w->group, table_bits, tq, t_scales, xq);
    for (int g = 0; g < groups; g++) {
        half_ts[g] = t_scales[g] * 0.5f;
        bias[g] = w->zeros ? ((1 << w->bits) - 1) * xq[g] : -xq[g];
        zero_coef[g] = -2 * xq[g];
    }
    return (lut_tables){tq, t_scales, xq, table_bits, half_ts, bias, zero_coef};
}

static size_t row_block_bytes(const lut_weight *w) {
    return (size_t)w->k / LUT_TILE_K * w->bits * LUT_TILE_BYTES +
           (size_t)(w->k / w->group) * LUT_ROWS * (sizeof(uint16_t) + (w->zeros ? 1 : 0));
}

typedef struct {
    const lut_weight *w;
    const lut_tables *t; /* [m] */
    float *y;            /* [m][row_blocks*16] */
    int m;
} gemv_multi_job;

/* Rows a multi-row pass covers before the next activation rows read them again: 4 row blocks (64 KB of a 2048-wide
 * int4 matrix) stay in L2 across the passes. */
#define MULTI_ROW_BLOCKS 4

static void gemv_multi_range(void *ctx, int rb0, int rb1) {
    const gemv_multi_job *job = ctx;
    const size_t rows = (size_t)job->w->row_blocks * LUT_ROWS;
    for (int rb = rb0; rb < rb1; rb += MULTI_ROW_BLOCKS) {
        const int end = rb + MULTI_ROW_BLOCKS < rb1 ? rb + MULTI_ROW_BLOCKS : rb1;
        for (int i0 = 0; i0 < job->m; i0 += ISA.gemv_mr) {
            const int count = job->m - i0 < ISA.gemv_mr ? job->m - i0 : ISA.gemv_mr;
            const lut_tables *t[LUT_MAX_GEMV_MR];
            float *y[LUT_MAX_GEMV_MR];
            for (int r = 0; r < count; r++) t[r] = &job->t[i0 + r], y[r] = job->y + (i0 + r) * rows;
            ISA.gemv8_multi(job->w, t, rb, end, y, count);
        }
    }
}

/* y [m][row_blocks*16] = x [m][k] · Wᵀ; acc (optional) [m][row_blocks*16][G] gets the int32 accumulators. Several
 * rows with 8-bit tables go through the multi-row GEMV (each tile read once for all of them), else row by row. */
NPUMOE_API int npumoe_lut_gemv(const lut_weight *w, const float *x, int m, int table_bits, float *y, int32_t *acc,
                               int threads) {
    const int k = w->k, groups = k / w->group, row_blocks = w->row_blocks;
    if (m > 1 && table_bits == 8 && !acc && ISA.gemv8_multi) {
        char *blocks = malloc(table_bytes(w, table_bits) * m);
        lut_tables *t = malloc(sizeof(lut_tables) * m);
        if (!blocks || !t) {
            free(blocks), free(t);
            return -1;
        }
        for (int i = 0; i < m; i++)
            t[i] = prepared_tables(w, x + (size_t)i * k, table_bits, blocks + table_bytes(w, table_bits) * i);
        gemv_multi_job job = {w, t, y, m};
        lut_parallel(gemv_multi_range, &job, row_blocks, threads, 1);
        free(blocks), free(t);
        return 0;
    }
    char *block = malloc(table_bytes(w, table_bits));
    if (!block) return -1;
    const size_t rows = (size_t)row_blocks * LUT_ROWS;
    for (int i = 0; i < m; i++) {
        const lut_tables t = prepared_tables(w, x + (size_t)i * k, table_bits, block);
        gemv_job job = {w, &t, y + i * rows, acc ? acc + i * rows * groups : NULL};
        lut_parallel(gemv_range, &job, row_blocks, threads, (int)(LUT_STREAM_CHUNK / row_block_bytes(w) + 1));
    }
    free(block);
    return 0;
}

/* Several one-row GEMVs in one parallel job (a decode step's experts, q/k/v: lut_parallel_tasks over their row
 * blocks). Tasks that read one activation against alike matrices (q, k, v; every expert's gate and up) share one
 * build of its tables. Each result equals npumoe_lut_gemv's for its task. */
typedef struct {
    const npumoe_lut_task *tasks;
    const lut_tables *tables;
} gemv_batch;

static void gemv_batch_span(void *ctx, int t, int rb0, int rb1) {
    const gemv_batch *batch = ctx;
    const lut_tables *tables = &batch->tables[t];
    (tables->table_bits == 8 ? ISA.gemv8 : gemv_portable)(batch->tasks[t].w, tables, rb0, rb1, batch->tasks[t].y, NULL);
}

/* The earlier task whose tables task t can use (same activation, width, group, bits and zero-point form), or t. */
static int table_source(const npumoe_lut_task *tasks, int t) {
    const lut_weight *w = tasks[t].w;
    for (int s = 0; s < t; s++) {
        const lut_weight *v = tasks[s].w;
        if (tasks[s].x == tasks[t].x && v->k == w->k && v->group == w->group && v->bits == w->bits &&
            !v->zeros == !w->zeros)
            return s;
    }
    return t;
}

NPUMOE_API int npumoe_lut_gemv_many(const npumoe_lut_task *tasks, int count, int table_bits, int threads) {
    size_t bytes = 1, weight_bytes = 0;
    for (int t = 0; t < count; t++) bytes += table_bytes(tasks[t].w, table_bits);
    char *block = malloc(bytes);
    lut_tables *tables = malloc(sizeof(lut_tables) * (count + 1));
    int *first_block = malloc(sizeof(int) * (count + 1));
    if (!block || !tables || !first_block) {
        free(block), free(tables), free(first_block);
        return -1;
    }
    char *at = block;
    first_block[0] = 0;
    for (int t = 0; t < count; t++) {
        const lut_weight *w = tasks[t].w;
        const int source = table_source(tasks, t);
        if (source == t) {
            tables[t] = prepared_tables(w, tasks[t].x, table_bits, at);
            at += table_bytes(w, table_bits);
        } else {
            tables[t] = tables[source];
        }
        first_block[t + 1] = first_block[t] + w->row_blocks;
        weight_bytes += (size_t)w->row_blocks * row_block_bytes(w);
    }
    gemv_batch batch = {tasks, tables};
    lut_parallel_tasks(gemv_batch_span, &batch, first_block, count, weight_bytes, threads);
    free(block), free(tables), free(first_block);
    return 0;
}

typedef struct {
    const lut_weight *w;
    float *out;
} dequant_job;

static void dequant_range(void *ctx, int rb0, int rb1) {
    dequant_job *job = ctx;
    const lut_weight *w = job->w;
    float panel[LUT_TILE_K * LUT_ROWS];
    for (int rb = rb0; rb < rb1; rb++)
        for (int kt = 0; kt < lut_k_tiles(w); kt++) {
            ISA.dequant_tile(w, rb, kt, panel, LUT_ROWS);
            for (int r = 0; r < LUT_ROWS; r++)
                for (int kk = 0; kk < LUT_TILE_K; kk++)
                    job->out[((size_t)rb * LUT_ROWS + r) * w->k + kt * LUT_TILE_K + kk] = panel[kk * LUT_ROWS + r];
        }
}

/* out [row_blocks*16][k] fp32: the two-level LUT dequantisation, bit-identical to the spec. */
NPUMOE_API void npumoe_lut_dequant(const lut_weight *w, float *out, int threads) {
    dequant_job job = {w, out};
    lut_parallel(dequant_range, &job, w->row_blocks, threads, 1);
}

typedef struct {
    const lut_weight *w;
    const float *xt;
    int m_pad, m, ldy;
    float *y;
} gemm_job;

static void gemm_range(void *ctx, int rb0, int rb1) {
    gemm_job *job = ctx;
    ISA.gemm(job->w, job->xt, job->m_pad, job->m, rb0, rb1, job->y, job->ldy);
}

/* y [m][row_blocks*16] = x [m][k] · Wᵀ with W dequantised tile by tile into registers/L1 (prefill). */
NPUMOE_API int npumoe_lut_gemm(const lut_weight *w, const float *x, int m, float *y, int threads) {
    const int k = w->k, m_pad = (m + ISA.gemm_mr - 1) / ISA.gemm_mr * ISA.gemm_mr;
    float *xt = calloc((size_t)k * m_pad, sizeof(float)); /* xᵀ, so a microkernel's rows are adjacent */
    if (!xt) return -1;
    for (int i = 0; i < m; i++)
        for (int kk = 0; kk < k; kk++) xt[(size_t)kk * m_pad + i] = x[(size_t)i * k + kk];
    gemm_job job = {w, xt, m_pad, m, w->row_blocks * LUT_ROWS, y};
    lut_parallel(gemm_range, &job, w->row_blocks, threads, 1);
    free(xt);
    return 0;
}

typedef struct {
    const uint16_t *w;
    const float *x;
    float *xtb;
    int n, k, m;
    float *y;
} bf16_gemm_job;

static void bf16_xtb_span(void *ctx, int t, int blk0, int blk1) {
    const bf16_gemm_job *job = (const bf16_gemm_job *)ctx + t;
    ISA.bf16_xtb(job->x, BF16_BLOCK_ROWS(job->m), job->k, blk0, blk1, job->xtb);
}

static void bf16_gemm_span(void *ctx, int t, int b0, int b1) {
    const bf16_gemm_job *job = (const bf16_gemm_job *)ctx + t;
    ISA.bf16_gemm(job->w, job->n, job->k, job->x, job->xtb, job->m, b0, b1, job->y);
}

/* An earlier task of these with task t's very x, or -1. */
static int same_x(const npumoe_bf16_task *tasks, int t) {
    for (int u = 0; u < t; u++)
        if (tasks[u].x == tasks[t].x && tasks[u].m == tasks[t].m && tasks[u].k == tasks[t].k) return u;
    return -1;
}

static int xtb_blocks(const npumoe_bf16_task *task) { return (BF16_BLOCK_ROWS(task->m) + 15) / 16; }
static size_t xtb_floats(const npumoe_bf16_task *task) { return (size_t)xtb_blocks(task) * 16 * task->k; }

/* Scratch task t of a batch adds to it (0 where it shares an earlier task's), in the batch's own unit. */
typedef size_t (*added_scratch_fn)(const void *batch, int t);
/* Runs a batch of count tasks given the scratch they need; -1 if it cannot allocate. */
typedef int (*batch_fn)(const void *batch, int count, size_t scratch, int threads);

/* The tasks in consecutive batches, each as many as fit in `budget` of scratch (at least one task): a long prompt's
 * experts would otherwise hold a prepared copy of all their inputs at once. */
static int in_batches(const void *tasks, size_t task_size, int count, size_t budget, added_scratch_fn added,
                      batch_fn run, int threads) {
    for (int first = 0, end; first < count; first = end) {
        const char *batch = (const char *)tasks + task_size * first;
        size_t scratch = 0;
        for (end = first; end < count; end++) {
            const size_t more = added(batch, end - first);
            if (end > first && scratch + more > budget) break;
            scratch += more;
        }
        if (run(batch, end - first, scratch, threads)) return -1;
    }
    return 0;
}

/* The tasks in two parallel jobs: every distinct x transposed (an expert's gate and up share theirs) into floats
 * of scratch, then every matrix's weight blocks, so that a prompt's experts, a few rows each, fill the threads
 * together. */
static int bf16_gemm_together(const void *batch, int count, size_t floats, int threads) {
    const npumoe_bf16_task *tasks = batch;
    size_t x_bytes = 0, weight_bytes = 0;
    float *xtb = malloc(sizeof(float) * (floats + 1)); /* each x transposed in blocks of 16 rows */
    bf16_gemm_job *jobs = malloc(sizeof(bf16_gemm_job) * (count + 1));
    int *first_x = malloc(sizeof(int) * (count + 1)), *first_w = malloc(sizeof(int) * (count + 1));
    if (!xtb || !jobs || !first_x || !first_w) {
        free(xtb), free(jobs), free(first_x), free(first_w);
        return -1;
    }
    float *at = xtb;
    first_x[0] = first_w[0] = 0;
    for (int t = 0; t < count; t++) {
        const npumoe_bf16_task *task = &tasks[t];
        const int same = same_x(tasks, t);
        jobs[t] = (bf16_gemm_job){task->w, task->x, same < 0 ? at : jobs[same].xtb, task->n, task->k, task->m, task->y};
        if (same < 0) at += xtb_floats(task), x_bytes += xtb_floats(task) * sizeof(float);
        first_x[t + 1] = first_x[t] + (same < 0 ? xtb_blocks(task) : 0);
        first_w[t + 1] = first_w[t] + (task->n + BF16_GEMM_ROWS - 1) / BF16_GEMM_ROWS;
        weight_bytes += (size_t)task->n * task->k * sizeof(uint16_t);
    }
    lut_parallel_tasks(bf16_xtb_span, jobs, first_x, count, x_bytes, threads);
    lut_parallel_tasks(bf16_gemm_span, jobs, first_w, count, weight_bytes, threads);
    free(xtb), free(jobs), free(first_x), free(first_w);
    return 0;
}

/* x transposed for as many tasks at once as fit in this many floats (at least one task): a long prompt's experts
 * would otherwise hold a second copy of all their inputs (a 32k-token prompt, top-8 of 2048-wide: 2 GB). */
#define BF16_XTB_FLOATS (16u << 20)

static size_t bf16_added_floats(const void *batch, int t) {
    const npumoe_bf16_task *tasks = batch;
    return same_x(tasks, t) < 0 ? xtb_floats(&tasks[t]) : 0;
}

/* For each task, y [m][n] = x [m][k] · Wᵀ for W [n][k] bf16, k a multiple of 16: exact fp32 arithmetic on the
 * widened weights (a bf16 prompt where the CPU has no bf16 dot products), BF16_XTB_FLOATS of transposed inputs at a
 * time. Returns -2 where this build has no such kernel or a k is not a multiple of 16, -1 if it cannot allocate. */
NPUMOE_API int npumoe_bf16_gemm_many(const npumoe_bf16_task *tasks, int count, int threads) {
    if (!ISA.bf16_gemm) return -2;
    for (int t = 0; t < count; t++)
        if (tasks[t].k % 16) return -2;
    return in_batches(tasks, sizeof *tasks, count, BF16_XTB_FLOATS, bf16_added_floats, bf16_gemm_together, threads);
}

NPUMOE_API int npumoe_bf16_gemm(const uint16_t *w, const float *x, int m, int n, int k, float *y, int threads) {
    const npumoe_bf16_task task = {w, x, y, m, n, k};
    return npumoe_bf16_gemm_many(&task, 1, threads);
}

typedef struct {
    const lut_weight *w;
    const int8_t *xq;
    const float *xs;
    const int32_t *xsum;
    int m;
    float *y;
} gemm_i8_job;

static void gemm_i8_range(void *ctx, int rb0, int rb1) {
    const gemm_i8_job *job = ctx;
    ISA.gemm_i8(job->w, job->xq, job->xs, job->xsum, job->m, rb0, rb1, job->y, job->w->row_blocks * LUT_ROWS);
}

/* Whether this CPU runs the build's int8 GEMM: a NEON build compiled for ARMv8.0 carries one for ARMv8.2's dot
 * products, which only the OS reports. */
static int int8_dots_usable(void) {
#if !defined(NEON_INT8_DOTS) || defined(__ARM_FEATURE_DOTPROD)
    return 1;
#elif defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
    return 0;
#endif
}

/* y [m][row_blocks*16] = x [m][k] · Wᵀ with x quantised to int8 per group (3-4-bit weights, prefill). Returns -2
 * where this build (or, NEON, this CPU) has no int8 GEMM, -1 if it cannot allocate. */
NPUMOE_API int npumoe_lut_gemm_i8(const lut_weight *w, const float *x, int m, float *y, int threads) {
    if (!ISA.gemm_i8 || !int8_dots_usable() || w->bits < 3 || w->bits > 4) return -2;
    const int groups = w->k / w->group;
    int8_t *xq = malloc((size_t)m * w->k);
    float *xs = malloc(sizeof(float) * m * groups);
    int32_t *xsum = malloc(sizeof(int32_t) * m * groups);
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return -1;
    }
    ISA.int8_rows(x, m, w->k, w->group, xq, xs, xsum);
    gemm_i8_job job = {w, xq, xs, xsum, m, y};
    lut_parallel(gemm_i8_range, &job, w->row_blocks, threads, 1);
    free(xq), free(xs), free(xsum);
    return 0;
}

/* y [m][row_blocks*16] = x [m][k] · Wᵀ for the first `valid` rows (clamped to 0..m; the others, a prefill chunk's
 * padding, come out zero) by the path npumoe::lut_linear takes for all m rows (luts/torch_op.py, lut_product), as the
 * engine runs a padded chunk whole: the int8 GEMM from int8_from rows (3-4 bits, where the build and CPU have it), else
 * the dequantising GEMM from dequant_from rows × bits, else the LUT-GEMV with 8-bit tables; 0 for a path: never. Each
 * path computes a row alone, so the real rows are the whole chunk's, bit for bit. The crossovers come from the caller
 * (an exported program carries those the exporting machine measured, luts/tuning.py), so a program and the engine
 * choose alike. npumoe::lut_linear_rows is this one call, eagerly and in npumoe-run. Returns -1 if a path cannot
 * allocate. */
NPUMOE_API int npumoe_lut_linear(const lut_weight *w, const float *x, int m, int valid, float *y, int int8_from,
                                 int dequant_from, int threads) {
    const int rows = valid < 0 ? 0 : valid > m ? m : valid;
    int status = 0;
    const size_t outputs = (size_t)w->row_blocks * LUT_ROWS;
    memset(y + rows * outputs, 0, sizeof(float) * (m - rows) * outputs);
    if (!rows) return 0;
    if (int8_from > 0 && m >= int8_from && (status = npumoe_lut_gemm_i8(w, x, rows, y, threads)) != -2) return status;
    if (dequant_from > 0 && m * w->bits >= dequant_from) return npumoe_lut_gemm(w, x, rows, y, threads);
    return npumoe_lut_gemv(w, x, rows, 8, y, NULL, threads);
}

/* Several LUT-GEMVs of a few rows each (a prompt's experts below the int8 GEMM's rows, or at 1-2 bits) in two
 * parallel jobs: every row's 8-bit tables (an expert's gate and up share theirs), then every matrix's row blocks as one
 * run, each through the path npumoe_lut_gemv takes for its rows, so each result is that call's, bit for bit. */
typedef struct {
    const npumoe_lut_rows_task *task;
    lut_tables *tables; /* [m] */
    char *blocks;       /* their storage, table_bytes(w, 8) a row */
} gemv_rows_job;

static void tables_span(void *ctx, int t, int r0, int r1) {
    const gemv_rows_job *job = (const gemv_rows_job *)ctx + t;
    const lut_weight *w = job->task->w;
    for (int r = r0; r < r1; r++)
        job->tables[r] = prepared_tables(w, job->task->x + (size_t)r * w->k, 8, job->blocks + table_bytes(w, 8) * r);
}

static void gemv_rows_span(void *ctx, int t, int rb0, int rb1) {
    const gemv_rows_job *job = (const gemv_rows_job *)ctx + t;
    const npumoe_lut_rows_task *task = job->task;
    const size_t outputs = (size_t)task->w->row_blocks * LUT_ROWS;
    if (task->m > 1 && ISA.gemv8_multi) {
        gemv_multi_job multi = {task->w, job->tables, task->y, task->m};
        gemv_multi_range(&multi, rb0, rb1);
    } else {
        for (int r = 0; r < task->m; r++) ISA.gemv8(task->w, &job->tables[r], rb0, rb1, task->y + r * outputs, NULL);
    }
}

/* An earlier task of these with task t's very activations, width, grouping and zero-point form (its tables), or -1. */
static int same_tables(const npumoe_lut_rows_task *tasks, int t) {
    for (int u = 0; u < t; u++)
        if (tasks[u].x == tasks[t].x && tasks[u].m == tasks[t].m && tasks[u].w->k == tasks[t].w->k &&
            tasks[u].w->group == tasks[t].w->group && tasks[u].w->bits == tasks[t].w->bits &&
            !tasks[u].w->zeros == !tasks[t].w->zeros)
            return u;
    return -1;
}

static int gemv_rows_together(const void *batch, int count, size_t bytes, int threads) {
    const npumoe_lut_rows_task *tasks = batch;
    size_t rows = 0;
    for (int t = 0; t < count; t++) rows += tasks[t].m;
    char *scratch = malloc(bytes + 1);
    lut_tables *tables = malloc(sizeof(lut_tables) * (rows + 1));
    gemv_rows_job *jobs = malloc(sizeof(gemv_rows_job) * (count + 1));
    int *first_x = malloc(sizeof(int) * (count + 1)), *first_w = malloc(sizeof(int) * (count + 1));
    if (!scratch || !tables || !jobs || !first_x || !first_w) {
        free(scratch), free(tables), free(jobs), free(first_x), free(first_w);
        return -1;
    }
    size_t x_bytes = 0, weight_bytes = 0;
    char *at = scratch;
    lut_tables *next = tables;
    first_x[0] = first_w[0] = 0;
    for (int t = 0; t < count; t++) {
        const npumoe_lut_rows_task *task = &tasks[t];
        const int same = same_tables(tasks, t);
        if (same >= 0) {
            jobs[t] = jobs[same], jobs[t].task = task;
        } else {
            jobs[t] = (gemv_rows_job){task, next, at};
            next += task->m, at += table_bytes(task->w, 8) * task->m;
            x_bytes += (size_t)task->m * task->w->k * sizeof(float);
        }
        first_x[t + 1] = first_x[t] + (same < 0 ? task->m : 0);
        first_w[t + 1] = first_w[t] + task->w->row_blocks;
        weight_bytes += (size_t)task->w->row_blocks * row_block_bytes(task->w) * task->m;
    }
    lut_parallel_tasks(tables_span, jobs, first_x, count, x_bytes, threads);
    lut_parallel_tasks(gemv_rows_span, jobs, first_w, count, weight_bytes, threads);
    free(scratch), free(tables), free(jobs), free(first_x), free(first_w);
    return 0;
}

/* Tables held at once (at least one task's): 4 bytes an input a row. */
#define TABLES_MANY_BYTES (64u << 20)

static size_t tables_added_bytes(const void *batch, int t) {
    const npumoe_lut_rows_task *tasks = batch;
    return same_tables(tasks, t) < 0 ? table_bytes(tasks[t].w, 8) * tasks[t].m : 0;
}

/* For each task, npumoe_lut_gemv with 8-bit tables: y [m][row_blocks*16] = x [m][k] · Wᵀ, all in one parallel job per
 * TABLES_MANY_BYTES of tables. Returns -1 if it cannot allocate. */
NPUMOE_API int npumoe_lut_gemv_rows_many(const npumoe_lut_rows_task *tasks, int count, int threads) {
    return in_batches(tasks, sizeof *tasks, count, TABLES_MANY_BYTES, tables_added_bytes, gemv_rows_together,
                      threads);
}

/* Several int8 GEMMs (a prompt's experts, a few rows each) in two parallel jobs: every distinct x quantised to int8
 * (an expert's gate and up share theirs), then every matrix's row blocks as one run. Called one by one, each small
 * product is split over the threads, which wake and meet again for it; here they share the experts. Each result is
 * npumoe_lut_gemm_i8's for its task, bit for bit. */
typedef struct {
    const npumoe_lut_rows_task *task;
    int8_t *xq;
    float *xs;
    int32_t *xsum;
} gemm_i8_many_job;

static void int8_rows_span(void *ctx, int t, int r0, int r1) {
    const gemm_i8_many_job *job = (const gemm_i8_many_job *)ctx + t;
    const lut_weight *w = job->task->w;
    const int k = w->k, groups = k / w->group;
    ISA.int8_rows(job->task->x + (size_t)r0 * k, r1 - r0, k, w->group, job->xq + (size_t)r0 * k,
                  job->xs + (size_t)r0 * groups, job->xsum + (size_t)r0 * groups);
}

static void gemm_i8_span(void *ctx, int t, int rb0, int rb1) {
    const gemm_i8_many_job *job = (const gemm_i8_many_job *)ctx + t;
    const npumoe_lut_rows_task *task = job->task;
    ISA.gemm_i8(task->w, job->xq, job->xs, job->xsum, task->m, rb0, rb1, task->y, task->w->row_blocks * LUT_ROWS);
}

/* An earlier task of these with task t's very activations, width and grouping, or -1. */
static int same_rows(const npumoe_lut_rows_task *tasks, int t) {
    for (int u = 0; u < t; u++)
        if (tasks[u].x == tasks[t].x && tasks[u].m == tasks[t].m && tasks[u].w->k == tasks[t].w->k &&
            tasks[u].w->group == tasks[t].w->group)
            return u;
    return -1;
}

/* A task's quantised activations: int8 codes, then each group's scale and sum. */
static size_t int8_rows_bytes(const npumoe_lut_rows_task *task) {
    const size_t groups = (size_t)task->m * (task->w->k / task->w->group);
    return (size_t)task->m * task->w->k + groups * (sizeof(float) + sizeof(int32_t));
}

static int gemm_i8_together(const void *batch, int count, size_t bytes, int threads) {
    const npumoe_lut_rows_task *tasks = batch;
    char *scratch = malloc(bytes + 1);
    gemm_i8_many_job *jobs = malloc(sizeof(gemm_i8_many_job) * (count + 1));
    int *first_x = malloc(sizeof(int) * (count + 1)), *first_w = malloc(sizeof(int) * (count + 1));
    if (!scratch || !jobs || !first_x || !first_w) {
        free(scratch), free(jobs), free(first_x), free(first_w);
        return -1;
    }
    size_t x_bytes = 0, weight_bytes = 0;
    char *at = scratch;
    first_x[0] = first_w[0] = 0;
    for (int t = 0; t < count; t++) {
        const npumoe_lut_rows_task *task = &tasks[t];
        const int same = same_rows(tasks, t);
        if (same >= 0) {
            jobs[t] = jobs[same], jobs[t].task = task;
        } else {
            const size_t codes = (size_t)task->m * task->w->k, groups = (size_t)task->m * (task->w->k / task->w->group);
            float *xs = (float *)(at + (codes + 3) / 4 * 4); /* (int8 codes first; the groups' arrays 4-byte aligned) */
            jobs[t] = (gemm_i8_many_job){task, (int8_t *)at, xs, (int32_t *)(xs + groups)};
            at = (char *)(jobs[t].xsum + groups);
            x_bytes += (size_t)task->m * task->w->k * sizeof(float);
        }
        first_x[t + 1] = first_x[t] + (same < 0 ? task->m : 0);
        first_w[t + 1] = first_w[t] + task->w->row_blocks;
        weight_bytes += (size_t)task->w->row_blocks * row_block_bytes(task->w);
    }
    lut_parallel_tasks(int8_rows_span, jobs, first_x, count, x_bytes, threads);
    lut_parallel_tasks(gemm_i8_span, jobs, first_w, count, weight_bytes, threads);
    free(scratch), free(jobs), free(first_x), free(first_w);
    return 0;
}

/* Quantised activations held at once (at least one task's): a long prompt's experts would otherwise hold an int8 copy
 * of all their inputs. */
#define I8_MANY_BYTES (64u << 20)

static size_t int8_added_bytes(const void *batch, int t) {
    const npumoe_lut_rows_task *tasks = batch;
    return same_rows(tasks, t) < 0 ? int8_rows_bytes(&tasks[t]) + 8 : 0; /* (+ the alignment of its groups' arrays) */
}

/* For each task, npumoe_lut_gemm_i8 (y = x · Wᵀ with x quantised to int8 per group, 3-4-bit W), all in one parallel
 * job per I8_MANY_BYTES of quantised activations. Returns -2 where this build or CPU has no int8 GEMM or a W is not
 * 3-4 bits (nothing run), -1 if it cannot allocate. */
NPUMOE_API int npumoe_lut_gemm_i8_many(const npumoe_lut_rows_task *tasks, int count, int threads) {
    if (!ISA.gemm_i8 || !int8_dots_usable()) return -2;
    for (int t = 0; t < count; t++)
        if (tasks[t].w->bits < 3 || tasks[t].w->bits > 4) return -2;
    return in_batches(tasks, sizeof *tasks, count, I8_MANY_BYTES, int8_added_bytes, gemm_i8_together, threads);
}

typedef struct {
    const uint64_t *words;
    size_t count, prefetch_words;
    uint64_t sums[LUT_MAX_THREADS];
} stream_job;

static void stream_range(void *ctx, int part0, int part1) {
    stream_job *job = ctx;
    for (int part = part0; part < part1; part++) {
        size_t begin = job->count * part / LUT_MAX_THREADS, end = job->count * (part + 1) / LUT_MAX_THREADS;
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        size_t i = begin;
        for (; i + 8 <= end; i += 8) {
            if (job->prefetch_words) __builtin_prefetch(job->words + i + job->prefetch_words, 0, 2);
            s0 ^= job->words[i] ^ job->words[i + 4], s1 ^= job->words[i + 1] ^ job->words[i + 5];
            s2 ^= job->words[i + 2] ^ job->words[i + 6], s3 ^= job->words[i + 3] ^ job->words[i + 7];
        }
        for (; i < end; i++) s0 ^= job->words[i];
        job->sums[part] = s0 ^ s1 ^ s2 ^ s3;
    }
}

/* Read `bytes` once with `threads` threads, each line prefetched into L2 `prefetch` bytes ahead
 * (0: left to the hardware prefetchers): the machine's streaming-read bandwidth probe. */
NPUMOE_API uint64_t npumoe_stream_read(const void *buf, size_t bytes, int threads, size_t prefetch) {
    stream_job job = {buf, bytes / sizeof(uint64_t), prefetch / sizeof(uint64_t), {0}};
    lut_parallel(stream_range, &job, LUT_MAX_THREADS, threads,
                 (int)(LUT_STREAM_CHUNK * LUT_MAX_THREADS / (bytes + 1)) + 1);
    uint64_t s = 0;
    for (int i = 0; i < LUT_MAX_THREADS; i++) s ^= job.sums[i];
    return s;
}
