/* bf16 weights × fp32 activations → fp32: the decode GEMV of a model kept in its stored bf16.
 *
 * A bf16 value is the top half of an fp32 one, so widening is a 16-bit shift: the weights stream
 * from memory at 2 bytes each and every product and sum is fp32, which is what the CPU executor's
 * `linear` does by widening the matrix first (torch's own bf16 GEMV runs at a fraction of the
 * read bandwidth on CPUs without AVX-512 BF16). Written with GCC vector extensions, so each ISA
 * build (AVX2, AVX-512, NEON, portable) compiles it to its own vectors.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "lut.h"

/* Lanes per vector: 512-bit registers where the build has them (the 256-bit loop is compute-bound on one
 * AVX-512 core, which streams more weights with wider vectors: docs/performance.md, "bf16 GEMV"), 256-bit
 * elsewhere. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
#define STEP (2 * VL) /* inputs per vector step: VL even ones and VL odd ones */

typedef float fvec __attribute__((vector_size(VL * 4)));
typedef uint32_t uvec __attribute__((vector_size(VL * 4)));

#define BF16_ROWS 4       /* rows per pass: x is loaded once for four weight streams */
#define BF16_L1_AHEAD 4096 /* elements: 8 KB (2 KB was too near: docs/performance.md, "bf16 GEMV") */
/* A one-row GEMV's single stream: into L2 16 KB ahead, into L1 4 KB ahead, the best of the distances tried
 * (docs/performance.md, "bf16 GEMV"). */
#define BF16_FAR 8192 /* elements */
#define BF16_NEAR 2048

/* VL 32-bit words of bf16 pairs widen with no shuffle: the even element of each pair is the
 * word shifted left 16, the odd one the word with its low half cleared. So x is split once into
 * its even and odd elements, and every weight costs a load, a shift or an and, and a multiply-add
 * (a zero-extending widen needs cross-lane shuffles, one port's worth, and was far slower). */
static inline void widen_pairs(const uint16_t *p, fvec *even, fvec *odd) {
    uvec w, lo, hi;
    memcpy(&w, p, sizeof w);
#if defined(__AVX2__) && (defined(__GNUC__) || defined(__clang__))
    /* In a register: GCC folded the load into both the shift and the and, two load-port slots per vector, which
     * held back the multi-row GEMV (docs/performance.md, "bf16 GEMV"). */
    __asm__("" : "+x"(w));
#endif
    lo = w << 16;
    hi = w & 0xffff0000u;
    memcpy(even, &lo, sizeof *even);
    memcpy(odd, &hi, sizeof *odd);
}

/* c + a·b, fused where the build has FMA: one instruction for two, which speeds up the multi-row GEMV (one row is
 * bound by reading: docs/performance.md, "bf16 GEMV"). */
static inline fvec fma_(fvec a, fvec b, fvec c) {
#if defined(__AVX512F__)
    return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__) && VL == 8
    return _mm256_fmadd_ps(a, b, c);
#else
    return c + a * b;
#endif
}

static inline float hsum(fvec v) {
    float s = 0;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

typedef struct {
    const uint16_t *w;
    const float *x;      /* [m][k] */
    const float *split;  /* [m][kv]: per STEP inputs, the VL even ones then the VL odd ones */
    float *y;
    int n, k, m;
} bf16_job;

/* Finish outputs (i, r..r+rows-1) from their even/odd accumulators: the tail inputs past the last STEP, then store. */
static void bf16_store(const bf16_job *job, int i, int r, int rows, const uint16_t *const *w, const fvec *even,
                       const fvec *odd) {
    const int k = job->k, kv = k / STEP * STEP;
    const float *x = job->x + (size_t)i * k;
    for (int j = 0; j < rows; j++) {
        float s = hsum(even[j] + odd[j]);
        for (int kk = kv; kk < k; kk++) s += lut_bf16_to_float(w[j][kk]) * x[kk];
        job->y[(size_t)i * job->n + r + j] = s;
    }
}

#if VL == 16
/* Two activation rows against the four weight rows: each weight vector widened once for both (prefill, where
 * widening, not reading, bounds the loop). 16 accumulators, 4 activation and 2 weight vectors fit AVX-512's 32
 * registers; every output sums the same products in the same order as the one-row loop, so it is bit-identical. */
static void bf16_block_pair(const bf16_job *job, int i, const uint16_t *const *w, int r, int rows) {
    const int kv = job->k / STEP * STEP;
    const float *xs0 = job->split + (size_t)i * kv, *xs1 = xs0 + kv;
    fvec ev0[BF16_ROWS] = {{0}}, od0[BF16_ROWS] = {{0}}, ev1[BF16_ROWS] = {{0}}, od1[BF16_ROWS] = {{0}};
    for (int kk = 0; kk < kv; kk += STEP) {
        fvec xe0, xo0, xe1, xo1, e, o;
        memcpy(&xe0, xs0 + kk, sizeof xe0), memcpy(&xo0, xs0 + kk + VL, sizeof xo0);
        memcpy(&xe1, xs1 + kk, sizeof xe1), memcpy(&xo1, xs1 + kk + VL, sizeof xo1);
        for (int j = 0; j < BF16_ROWS; j++) {
            widen_pairs(w[j] + kk, &e, &o);
            ev0[j] = fma_(e, xe0, ev0[j]), od0[j] = fma_(o, xo0, od0[j]);
            ev1[j] = fma_(e, xe1, ev1[j]), od1[j] = fma_(o, xo1, od1[j]);
        }
    }
    bf16_store(job, i, r, rows, w, ev0, od0);
    bf16_store(job, i + 1, r, rows, w, ev1, od1);
}
#endif

/* Output r of activation rows 0 .. mr-1 (mr ≤ BF16_NARROW, one for decode), its weight row w streamed alone and
 * each weight vector widened once for all mr rows: the same two accumulators and order as a row of bf16_block's
 * four, so bit-identical to it. Row after row the weights are one contiguous read, which the prefetches keep ahead
 * of; four rows side by side are four streams a row apart, which read cold matrices at a lower share of the
 * bandwidth. On AVX2 bf16_block also waits on memory at 2-3 rows of x, where this streams; AVX-512's pairs of rows
 * stay ahead there (docs/performance.md, "bf16 GEMV"). */
#if VL == 8
#define BF16_NARROW 3
#else
#define BF16_NARROW 1
#endif
static inline __attribute__((always_inline)) void bf16_rows(const bf16_job *job, int r, const uint16_t *w,
                                                            const int mr) {
    const int kv = job->k / STEP * STEP;
    fvec even[BF16_NARROW], odd[BF16_NARROW], e, o;
    for (int a = 0; a < mr; a++) even[a] = odd[a] = (fvec){0};
    for (int kk = 0; kk < kv; kk += STEP) {
        if (kk % 32 == 0) /* once a 64-byte line (32 weights) */
            __builtin_prefetch(w + kk + BF16_FAR, 0, 2), __builtin_prefetch(w + kk + BF16_NEAR, 0, 3);
        widen_pairs(w + kk, &e, &o);
        for (int a = 0; a < mr; a++) {
            fvec xe, xo;
            memcpy(&xe, job->split + (size_t)a * kv + kk, sizeof xe);
            memcpy(&xo, job->split + (size_t)a * kv + kk + VL, sizeof xo);
            even[a] = fma_(e, xe, even[a]), odd[a] = fma_(o, xo, odd[a]);
        }
    }
    for (int a = 0; a < mr; a++) bf16_store(job, a, r, 1, &w, &even[a], &odd[a]);
}

/* Rows r .. r+3 (a short last block repeats its last row; only real rows are stored). Four explicit
 * weight streams and eight accumulators stay in registers, which a loop over the rows did not. */
static void bf16_block(const bf16_job *job, int r) {
    const int k = job->k, kv = k / STEP * STEP, rows = job->n - r < BF16_ROWS ? job->n - r : BF16_ROWS;
    const size_t next = (size_t)BF16_ROWS * k; /* the same place in the next block, 4 rows on */
    const uint16_t *w[BF16_ROWS];
    for (int j = 0; j < BF16_ROWS; j++) w[j] = job->w + (size_t)(r + (j < rows ? j : rows - 1)) * k;
    if (job->m <= BF16_NARROW) { /* (a compile-time row count keeps the accumulators in registers) */
        for (int j = 0; j < rows; j++) {
            if (job->m == 1)
                bf16_rows(job, r + j, w[j], 1);
#if BF16_NARROW > 1
            else if (job->m == 2)
                bf16_rows(job, r + j, w[j], 2);
            else
                bf16_rows(job, r + j, w[j], 3);
#endif
        }
        return;
    }
    int i = 0;
#if VL == 16
    for (const int passes = job->m / 2; i + 1 < job->m; i += 2) {
        for (int kk = 32 * (i / 2); kk < kv; kk += 32 * passes) /* the next block's lines into L2, a share a pass */
            for (int j = 0; j < BF16_ROWS; j++) __builtin_prefetch(w[j] + kk + next, 0, 2);
        bf16_block_pair(job, i, w, r, rows);
    }
#endif
    for (; i < job->m; i++) {
        const float *xs = job->split + (size_t)i * kv;
        fvec a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0}, c0 = {0}, c1 = {0}, d0 = {0}, d1 = {0}, e, o;
        for (int kk = 0, line = 0; kk < kv; kk += STEP) {
            if (kk % 32 == 0) {
                if (i == 0) /* each row's line 8 KB ahead into L1 */
                    for (int j = 0; j < BF16_ROWS; j++) __builtin_prefetch(w[j] + kk + BF16_L1_AHEAD, 0, 3);
                if (line == i) /* the next block's lines into L2, every m-th in each pass (line = kk / 32 mod m): as a
                                * burst in the first pass they held up the loads of the rows in use (cold matrices,
                                * docs/performance.md, "bf16 GEMV") */
                    for (int j = 0; j < BF16_ROWS; j++) __builtin_prefetch(w[j] + kk + next, 0, 2);
                line = line + 1 == job->m ? 0 : line + 1;
            }
            fvec xe, xo;
            memcpy(&xe, xs + kk, sizeof xe);
            memcpy(&xo, xs + kk + VL, sizeof xo);
            widen_pairs(w[0] + kk, &e, &o), a0 = fma_(e, xe, a0), a1 = fma_(o, xo, a1);
            widen_pairs(w[1] + kk, &e, &o), b0 = fma_(e, xe, b0), b1 = fma_(o, xo, b1);
            widen_pairs(w[2] + kk, &e, &o), c0 = fma_(e, xe, c0), c1 = fma_(o, xo, c1);
            widen_pairs(w[3] + kk, &e, &o), d0 = fma_(e, xe, d0), d1 = fma_(o, xo, d1);
        }
        const fvec even[BF16_ROWS] = {a0, b0, c0, d0}, odd[BF16_ROWS] = {a1, b1, c1, d1};
        bf16_store(job, i, r, rows, w, even, odd);
    }
}

/* Several GEMVs in one parallel job (a decode step's experts: lut_parallel_tasks over their row blocks). */
static void bf16_span(void *ctx, int t, int b0, int b1) {
    const bf16_job *job = (const bf16_job *)ctx + t;
    for (int b = b0; b < b1; b++) bf16_block(job, b * BF16_ROWS);
}

/* For each task, y [m][n] = x [m][k] · Wᵀ for W [n][k] in bf16 (row-major): each weight row read once for
 * all m rows of x. Returns -1 if it cannot allocate the split activations. */
NPUMOE_API int npumoe_bf16_gemv_many(const npumoe_bf16_task *tasks, int count, int threads) {
    size_t split_floats = 1, weight_bytes = 0;
    for (int t = 0; t < count; t++) split_floats += (size_t)tasks[t].m * (tasks[t].k / STEP * STEP);
    float *split = malloc(sizeof(float) * split_floats);
    bf16_job *jobs = malloc(sizeof(bf16_job) * (count + 1));
    int *first_block = malloc(sizeof(int) * (count + 1));
    if (!split || !jobs || !first_block) {
        free(split), free(jobs), free(first_block);
        return -1;
    }
    float *at = split;
    first_block[0] = 0;
    for (int t = 0; t < count; t++) {
        const npumoe_bf16_task *task = &tasks[t];
        const int k = task->k, kv = k / STEP * STEP;
        for (int i = 0; i < task->m; i++)
            for (int kk = 0; kk < kv; kk += STEP)
                for (int j = 0; j < VL; j++) {
                    at[(size_t)i * kv + kk + j] = task->x[(size_t)i * k + kk + 2 * j];
                    at[(size_t)i * kv + kk + VL + j] = task->x[(size_t)i * k + kk + 2 * j + 1];
                }
        jobs[t] = (bf16_job){task->w, task->x, at, task->y, task->n, k, task->m};
        at += (size_t)task->m * kv;
        first_block[t + 1] = first_block[t] + (task->n + BF16_ROWS - 1) / BF16_ROWS;
        weight_bytes += (size_t)task->n * k * sizeof(uint16_t);
    }
    lut_parallel_tasks(bf16_span, jobs, first_block, count, weight_bytes, threads);
    free(split), free(jobs), free(first_block);
    return 0;
}

NPUMOE_API int npumoe_bf16_gemv(const uint16_t *w, const float *x, int m, int n, int k, float *y, int threads) {
    const npumoe_bf16_task task = {w, x, y, m, n, k};
    return npumoe_bf16_gemv_many(&task, 1, threads);
}
