/* bf16 weights × bf16-rounded activations → fp32: the prefill GEMM of a model kept in its stored bf16.
 *
 * Widening bf16 to fp32 and multiplying in fp32 (bf16.c) is bound by the fused multiply-adds: 16 products per
 * instruction. AVX-512 BF16's vdpbf16ps takes 32 (pairs of bf16 products summed into fp32 lanes), so where a
 * prompt has enough rows to be compute-bound the activations are rounded to bf16 once (round to nearest even)
 * and the weights are used as stored, as torch's bf16 matmul and llama.cpp's F16 path (activations to fp16)
 * do. Products of two bf16 values are exact in fp32; sums are fp32 (spec.bf16_dot_gemm is the contract, to
 * fp32 summation order). Decode stays on bf16.c's exact GEMV: one row is bound by reading the weights.
 *
 * Run by the AVX-512 build on an x86-64 CPU with AVX-512 BF16 (the function carries its own target, so the build
 * still loads on CPUs without BF16, such as Ice Lake, which take the widening GEMM of simd_kernels.h instead).
 */
#define _GNU_SOURCE /* syscall, for the tiles' permission */
#include <stdint.h>
#include <stdlib.h>

#include "lut.h"

#if defined(NPUMOE_ISA_AVX512) && \
    ((defined(__GNUC__) && __GNUC__ >= 10) || (defined(__clang__) && __clang_major__ >= 9))
#define HAVE_BF16_DOT 1
#include <immintrin.h>
#endif
#if defined(HAVE_BF16_DOT) && defined(__linux__) && \
    ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || (defined(__clang__) && __clang_major__ >= 12))
#define HAVE_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define DOT_NR 6 /* weight rows per block */
#define DOT_MR 4 /* activation rows per pass: 24 accumulators, 6 weight vectors and one activation in registers */
#define DOT_K 32 /* inputs per instruction */
#define DOT_M_TILE 64 /* activation rows kept hot while a thread's weight blocks pass (64 × 4 KB at K = 2048) */
#define DOT_HINT _MM_HINT_T0 /* where the next block's rows are fetched to */

typedef struct {
    const uint16_t *w;  /* [n][k] */
    const uint16_t *xb; /* [m][k], bf16-rounded */
    float *y;           /* [m][n] */
    int m, n, k;
} dot_job;

#ifdef HAVE_BF16_DOT
/* Activation rows i .. i+mr-1 (mr ≤ DOT_MR, a constant where inlined) against weight rows w, into y's columns
 * r .. r+rows-1; prefetching rows p, p + passes, … of the next block. */
__attribute__((target("avx512f,avx512bf16"), always_inline)) static inline void dot_pass(
    const dot_job *job, const uint16_t *const *w, int r, int rows, const uint16_t *next, int next_rows, int pass,
    int passes, int i, const int mr) {
    const int k = job->k;
    const uint16_t *x[DOT_MR];
    for (int a = 0; a < mr; a++) x[a] = job->xb + (size_t)(i + a) * k;
    __m512 acc[DOT_MR][DOT_NR];
    for (int a = 0; a < mr; a++)
        for (int j = 0; j < DOT_NR; j++) acc[a][j] = _mm512_setzero_ps();
    for (int kk = 0; kk < k; kk += DOT_K) {
        for (int j = pass; j < next_rows; j += passes) _mm_prefetch((const char *)(next + (size_t)j * k + kk), DOT_HINT);
        __m512bh wv[DOT_NR];
        for (int j = 0; j < DOT_NR; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + kk);
        for (int a = 0; a < mr; a++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[a] + kk);
            for (int j = 0; j < DOT_NR; j++) acc[a][j] = _mm512_dpbf16_ps(acc[a][j], xv, wv[j]);
        }
    }
    for (int a = 0; a < mr; a++)
        for (int j = 0; j < rows; j++) job->y[(size_t)(i + a) * job->n + r + j] = _mm512_reduce_add_ps(acc[a][j]);
}

/* Weight rows r .. r+DOT_NR-1 (a short last block repeats its last row) against activation rows i0 .. i1-1, DOT_MR
 * at a time and the rest in one shorter pass.
 *
 * A block's rows are read from memory by its first pass over the activations and from cache by the rest, and a
 * row of 2048 inputs is one 4 KB page, where the hardware prefetchers stop: so the passes also fetch the next
 * block's rows, spread over them, which the first pass of the next block would otherwise wait for. */
__attribute__((target("avx512f,avx512bf16"))) static void dot_block(const dot_job *job, int r, int i0, int i1) {
    const int k = job->k, rows = job->n - r < DOT_NR ? job->n - r : DOT_NR;
    const int next_rows = job->n - r - DOT_NR < DOT_NR ? job->n - r - DOT_NR : DOT_NR;
    const int passes = (i1 - i0 + DOT_MR - 1) / DOT_MR;
    const uint16_t *w[DOT_NR], *next = job->w + (size_t)(r + DOT_NR) * k;
    for (int j = 0; j < DOT_NR; j++) w[j] = job->w + (size_t)(r + (j < rows ? j : rows - 1)) * k;
    int i = i0, pass = 0;
    for (; i + DOT_MR <= i1; i += DOT_MR, pass++) dot_pass(job, w, r, rows, next, next_rows, pass, passes, i, DOT_MR);
    switch (i1 - i) {
        case 3: dot_pass(job, w, r, rows, next, next_rows, pass, passes, i, 3); break;
        case 2: dot_pass(job, w, r, rows, next, next_rows, pass, passes, i, 2); break;
        case 1: dot_pass(job, w, r, rows, next, next_rows, pass, passes, i, 1); break;
    }
}

/* n fp32 values → bf16 bits, rounded to nearest even (spec.bf16_round; a NaN stays a quiet NaN), sixteen at a
 * time (n is a multiple of 16: K is one of 32). */
__attribute__((target("avx512f"))) static void round_to_bf16(const float *x, uint16_t *out, size_t n) {
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x40);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    for (size_t e = 0; e < n; e += 16) {
        const __m512i v = _mm512_loadu_si512(x + e), high = _mm512_srli_epi32(v, 16);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(v, bias), _mm512_and_si512(high, one)), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(v, magnitude), inf);
        r = _mm512_mask_or_epi32(r, nan, high, quiet);
        _mm256_storeu_si256((__m256i *)(out + e), _mm512_cvtepi32_epi16(r));
    }
}

/* Weight rows r0 .. r1-1 (r0 a block's first) against every activation row, DOT_M_TILE activation rows at a time:
 * the tile stays in L2 while the blocks stream past it, instead of every block reading all m rows from further out. */
static void dot_rows(const dot_job *job, int r0, int r1) {
    for (int i = 0; i < job->m; i += DOT_M_TILE)
        for (int r = r0; r < r1; r += DOT_NR) dot_block(job, r, i, i + DOT_M_TILE < job->m ? i + DOT_M_TILE : job->m);
}

/* A thread's run of a task's weight blocks. */
static void dot_span(void *ctx, int t, int b0, int b1) {
    dot_rows((const dot_job *)ctx + t, b0 * DOT_NR, b1 * DOT_NR);
}
#endif

#ifdef HAVE_AMX
/* ---- AMX tiles (Sapphire Rapids and later) ----
 *
 * TDPBF16PS multiplies a 16 × 32 bf16 tile by a 32 × 16 one into 16 × 16 fp32 sums: 8192 products an instruction,
 * where vdpbf16ps makes 32. A weight tile is 16 of W's rows as stored (A: row stride K); the activations go over as
 * B in the pairs layout the instruction reads (input pairs down, 16 activation rows across: built once per
 * distinct x), so each tile holds Wᵀ's products for 16 weight rows × 16 activation rows, stored transposed into y.
 * A unit of 32 weight rows (rows of 2048 inputs: 32 pages read side by side, as many as the L2 streamer follows)
 * took less time than 64 at 16 activation rows and alike at 64; prefetching the rows ahead only slowed it. */
#define AMX_UNIT 32 /* weight rows a unit: two sum tiles share each activation tile */
#define AMX_CHUNK 32 /* inputs a tile step: 16 pairs */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

typedef struct {
    dot_job dot;          /* the rows past the last full tile go through dot_block */
    const uint32_t *xv;   /* [m blocks][K / 32][16 pairs][16 rows] pairs of bf16 */
} amx_job;

static int amx_wanted = 1; /* npumoe_bf16_amx_set */

/* The CPU has AMX-BF16 and the kernel lets this process use the tiles (Linux asks each process to request them). */
static int amx_usable(void) {
    static int state; /* 0 unknown, 1 usable, -1 not (requesting twice is harmless) */
    if (!state) {
        unsigned a, b, c, d;
        const int tiles = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1);
        state = tiles && !syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? 1 : -1;
    }
    return state > 0;
}

/* x's bf16 rows [m][k] as B tiles: block b, chunk c, pair p, row j ← rows 16b + j's inputs 32c + 2p, +1 (0 past m). */
static void amx_pairs(const uint16_t *xb, int m, int k, uint32_t *xv) {
    const uint32_t *rows = (const uint32_t *)xb;
    const int chunks = k / AMX_CHUNK, blocks = (m + 15) / 16;
    for (int b = 0; b < blocks; b++)
        for (int c = 0; c < chunks; c++)
            for (int p = 0; p < 16; p++, xv += 16)
                for (int j = 0; j < 16; j++)
                    xv[j] = 16 * b + j < m ? rows[(size_t)(16 * b + j) * (k / 2) + 16 * c + p] : 0;
}

/* Weight rows r .. r+31 against every activation row. */
__attribute__((target("amx-tile,amx-bf16,avx512f"))) static void amx_unit(const amx_job *job, int r) {
    const dot_job *d = &job->dot;
    const int k = d->k, chunks = k / AMX_CHUNK;
    const uint16_t *w = d->w + (size_t)r * k;
    const size_t stride = (size_t)k * sizeof(uint16_t);
    float sums[2][16][16];
    for (int b = 0; b < (d->m + 15) / 16; b++) {
        const uint32_t *xv = job->xv + (size_t)b * chunks * 256;
        _tile_zero(0);
        _tile_zero(1);
        for (int c = 0; c < chunks; c++) {
            const uint16_t *at = w + c * AMX_CHUNK;
            _tile_loadd(4, xv + c * 256, 64);
            _tile_loadd(5, at, stride);
            _tile_dpbf16ps(0, 5, 4);
            _tile_loadd(6, at + 16 * (size_t)k, stride);
            _tile_dpbf16ps(1, 6, 4);
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        const int rows = d->m - 16 * b < 16 ? d->m - 16 * b : 16;
        for (int j = 0; j < rows; j++) {
            float *y = d->y + (size_t)(16 * b + j) * d->n + r;
            for (int t = 0; t < 2; t++)
                for (int i = 0; i < 16; i++) y[16 * t + i] = sums[t][i][j];
        }
    }
}

/* A thread's run of a task's units: the tile configuration is each thread's own. */
__attribute__((target("amx-tile,amx-bf16,avx512f"))) static void amx_span(void *ctx, int t, int u0, int u1) {
    const amx_job *job = (const amx_job *)ctx + t;
    amx_config config = {.palette = 1};
    for (int i = 0; i < 8; i++) config.rows[i] = 16, config.colsb[i] = 64;
    _tile_loadconfig(&config);
    for (int u = u0; u < u1; u++) {
        const int r = u * AMX_UNIT;
        if (job->dot.n - r >= AMX_UNIT)
            amx_unit(job, r);
        else
            dot_rows(&job->dot, r, job->dot.n);
    }
    _tile_release();
}

/* npumoe_bf16_dot_gemm_many's products on AMX tiles, their activations already rounded (each job's xb). */
static int amx_gemm_many(const dot_job *dots, int count, size_t weight_bytes, int threads) {
    size_t words = 1;
    for (int t = 0; t < count; t++) words += (size_t)(dots[t].m + 15) / 16 * 16 * dots[t].k / 2;
    uint32_t *xv = malloc(sizeof(uint32_t) * words);
    amx_job *jobs = malloc(sizeof(amx_job) * (count + 1));
    int *first_unit = malloc(sizeof(int) * (count + 1));
    if (!xv || !jobs || !first_unit) {
        free(xv), free(jobs), free(first_unit);
        return -1;
    }
    uint32_t *at = xv;
    first_unit[0] = 0;
    for (int t = 0; t < count; t++) {
        const size_t size = (size_t)(dots[t].m + 15) / 16 * 16 * dots[t].k / 2;
        if (!(t && dots[t].xb == dots[t - 1].xb)) amx_pairs(dots[t].xb, dots[t].m, dots[t].k, at), at += size;
        jobs[t] = (amx_job){dots[t], at - size};
        first_unit[t + 1] = first_unit[t] + (dots[t].n + AMX_UNIT - 1) / AMX_UNIT;
    }
    lut_parallel_tasks(amx_span, jobs, first_unit, count, weight_bytes, threads);
    free(xv), free(jobs), free(first_unit);
    return 0;
}
#endif

/* Whether the dot-product GEMM uses AMX tiles where the CPU has them (the default) or AVX-512 BF16 alone: both are
 * tested on a machine that has both. Returns whether it will use the tiles. */
NPUMOE_API int npumoe_bf16_amx_set(int use) {
#ifdef HAVE_AMX
    amx_wanted = use;
    return use && amx_usable();
#else
    (void)use;
    return 0;
#endif
}

/* The AVX-512 build's, on a CPU with AVX-512 BF16: a build forced to AVX2 stands for an AVX2 machine (which
 * takes simd_kernels.h's widening bf16 GEMM instead), so that every path can be run here. */
NPUMOE_API int npumoe_bf16_dot_available(void) {
#ifdef HAVE_BF16_DOT
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* For each task, y [m][n] = bf16(x) [m][k] · Wᵀ for W [n][k] in bf16, k a multiple of 32. Returns -1 if it
 * cannot allocate the rounded activations, -2 where the CPU or compiler has no AVX-512 BF16. */
NPUMOE_API int npumoe_bf16_dot_gemm_many(const npumoe_bf16_task *tasks, int count, int threads) {
#ifdef HAVE_BF16_DOT
    if (!npumoe_bf16_dot_available()) return -2;
    size_t elements = 1, weight_bytes = 0;
    for (int t = 0; t < count; t++) elements += (size_t)tasks[t].m * tasks[t].k;
    uint16_t *xb = malloc(sizeof(uint16_t) * elements);
    dot_job *jobs = malloc(sizeof(dot_job) * (count + 1));
    int *first_block = malloc(sizeof(int) * (count + 1));
    if (!xb || !jobs || !first_block) {
        free(xb), free(jobs), free(first_block);
        return -1;
    }
    uint16_t *at = xb;
    first_block[0] = 0;
    for (int t = 0; t < count; t++) {
        const npumoe_bf16_task *task = &tasks[t];
        const size_t size = (size_t)task->m * task->k;
        /* gate and up read the same rows: round them once */
        const int same_rows = t && task->x == tasks[t - 1].x && task->m == tasks[t - 1].m && task->k == tasks[t - 1].k;
        if (!same_rows) round_to_bf16(task->x, at, size), at += size;
        jobs[t] = (dot_job){task->w, at - size, task->y, task->m, task->n, task->k};
        first_block[t + 1] = first_block[t] + (task->n + DOT_NR - 1) / DOT_NR;
        weight_bytes += (size_t)task->n * task->k * sizeof(uint16_t);
    }
    int status = 0;
#ifdef HAVE_AMX
    if (amx_wanted && amx_usable())
        status = amx_gemm_many(jobs, count, weight_bytes, threads);
    else
#endif
        lut_parallel_tasks(dot_span, jobs, first_block, count, weight_bytes, threads);
    free(xb), free(jobs), free(first_block);
    return status;
#else
    (void)tasks, (void)count, (void)threads;
    return -2;
#endif
}
