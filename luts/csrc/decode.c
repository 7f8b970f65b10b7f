/* A decode token's blocks in one call each: the attention block (norm, q/k/v, rope, the cache, attention, o, the
 * residual and the next norm), the routing, the routed experts (Σ_e weight_e · down_e(silu(gate_e x) ⊙ up_e x)),
 * a MoE layer, and a whole decode step (embedding, every layer, final norm, LM head).
 *
 * Through the graph interpreter a token's layer is some forty Python-level steps, each a trip through host state
 * that the weights streamed since have evicted: at Qwen3-30B-A3B widths they cost about as much as the layer's
 * weight reads (docs/performance.md, "Fused decode"). Here each block is a few parallel jobs: the matrices that read
 * one activation streamed as one run on one table build (q, k, v; every expert's gate and up), then the rest.
 * The matrices are fp32, bf16 or LUT-packed, per matrix; each bf16 or LUT GEMV equals its own call's result bit for
 * bit, and the rest is the graph ops' arithmetic in another summation order.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lut.h"

typedef struct { /* one of lut, bf16, f32 */
    const lut_weight *lut; /* packed */
    const uint16_t *bf16;  /* [n][k] */
    const float *f32;      /* [n][k] */
    int n, k;
} npumoe_matrix;

typedef struct {
    npumoe_matrix gate, up, down; /* gate, up [inter][hidden]; down [hidden][inter] */
} npumoe_swiglu;

/* Bytes a step between the matrix reads (attention over the cache, the router) reads from which it is split over
 * the threads: below, waking a worker costs more than it saves. */
#define THREADED_BYTES (1 << 18)

static int padded_rows(const npumoe_matrix *m) { return m->lut ? m->lut->row_blocks * LUT_ROWS : m->n; }

#if defined(__AVX512F__)
#define DVL 16
#else
#define DVL 8
#endif
typedef float dvec __attribute__((vector_size(DVL * 4)));

/* The lanes' sum as a tree: one chain through them would wait on each add. */
static inline float lanes_sum(dvec v) {
    for (int w = DVL / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) v[l] += v[l + w];
    return v[0];
}

#define DOT_ROWS 4
/* out[r] = a · b_r for the rows (≤ DOT_ROWS) b_r = b + r·stride: a chain of adds for each, side by side, where one
 * dot product alone waits on every add (attention's keys, the router's experts). */
static inline __attribute__((always_inline)) void dots(const float *a, const float *b, size_t stride, const int rows,
                                                       int n, float *out) {
    dvec acc[DOT_ROWS] = {{0}};
    int i = 0;
    for (; i + DVL <= n; i += DVL) {
        dvec va;
        memcpy(&va, a + i, sizeof va);
        for (int r = 0; r < rows; r++) {
            dvec vb;
            memcpy(&vb, b + r * stride + i, sizeof vb);
            acc[r] += va * vb;
        }
    }
    for (int r = 0; r < rows; r++) {
        out[r] = lanes_sum(acc[r]);
        for (int t = i; t < n; t++) out[r] += a[t] * b[r * stride + t];
    }
}

/* out[r] = a · b_r for all `rows` of b [rows][n]. */
static void dot_rows(const float *a, const float *b, int rows, int n, float *out) {
    int r = 0;
    for (; r + DOT_ROWS <= rows; r += DOT_ROWS) dots(a, b + (size_t)r * n, n, DOT_ROWS, n, out + r);
    for (; r < rows; r++) dots(a, b + (size_t)r * n, n, 1, n, out + r);
}

/* y += Σ_r a[r] · x_r for the rows (≤ DOT_ROWS) x_r = x + r·stride: y read and written once for them all. */
static inline __attribute__((always_inline)) void axpys(float *y, const float *a, const float *x, size_t stride,
                                                        const int rows, int n) {
    int i = 0;
    for (; i + DVL <= n; i += DVL) {
        dvec vy;
        memcpy(&vy, y + i, sizeof vy);
        for (int r = 0; r < rows; r++) {
            dvec vx;
            memcpy(&vx, x + r * stride + i, sizeof vx);
            vy += a[r] * vx;
        }
        memcpy(y + i, &vy, sizeof vy);
    }
    for (; i < n; i++)
        for (int r = 0; r < rows; r++) y[i] += a[r] * x[r * stride + i];
}

/* y += Σ_r a[r] · x_r over all `rows` of x [rows][n]. */
static void axpy_rows(float *y, const float *a, const float *x, int rows, int n) {
    int r = 0;
    for (; r + DOT_ROWS <= rows; r += DOT_ROWS) axpys(y, a + r, x + (size_t)r * n, n, DOT_ROWS, n);
    for (; r < rows; r++) axpys(y, a + r, x + (size_t)r * n, n, 1, n);
}

/* fp32 matrices (a model computed in fp32): each row one contiguous read, prefetched as the bf16 GEMV's rows are. */
typedef struct {
    const npumoe_matrix *m;
    const float *x;
    float *y;
} f32_task;

static void f32_rows(void *ctx, int t, int r0, int r1) {
    const f32_task *task = (const f32_task *)ctx + t;
    const int k = task->m->k;
    for (int r = r0; r < r1; r++) {
        const float *w = task->m->f32 + (size_t)r * k;
        dvec even = {0}, odd = {0};
        int i = 0;
        for (; i + 2 * DVL <= k; i += 2 * DVL) {
            __builtin_prefetch(w + i + 4096, 0, 2), __builtin_prefetch(w + i + 1024, 0, 3); /* 16 KB, 4 KB ahead */
            dvec a, b, c, d;
            memcpy(&a, w + i, sizeof a), memcpy(&b, task->x + i, sizeof b);
            memcpy(&c, w + i + DVL, sizeof c), memcpy(&d, task->x + i + DVL, sizeof d);
            even += a * b, odd += c * d;
        }
        float sum = 0.0f;
        for (int l = 0; l < DVL; l++) sum += even[l] + odd[l];
        for (; i < k; i++) sum += w[i] * task->x[i];
        task->y[r] = sum;
    }
}

static void f32_gemv_many(const f32_task *tasks, int count, int threads) {
    int first_row[count + 1];
    size_t bytes = 0;
    first_row[0] = 0;
    for (int t = 0; t < count; t++) {
        first_row[t + 1] = first_row[t] + tasks[t].m->n;
        bytes += (size_t)tasks[t].m->n * tasks[t].m->k * sizeof(float);
    }
    lut_parallel_tasks(f32_rows, (void *)tasks, first_row, count, bytes, threads);
}

/* y_i = x_i · W_iᵀ for each of `count` matrices: the LUT ones in one job (8-bit tables, as the decode path's GEMV),
 * the bf16 ones in another, the fp32 ones in a third. */
static int gemv_each(const npumoe_matrix *const *m, const float *const *x, float *const *y, int count, int threads) {
    npumoe_lut_task lut[count + 1];
    npumoe_bf16_task bf16[count + 1];
    f32_task f32[count + 1];
    int luts = 0, bf16s = 0, f32s = 0;
    for (int i = 0; i < count; i++)
        if (m[i]->lut)
            lut[luts++] = (npumoe_lut_task){m[i]->lut, x[i], y[i]};
        else if (m[i]->bf16)
            bf16[bf16s++] = (npumoe_bf16_task){m[i]->bf16, x[i], y[i], 1, m[i]->n, m[i]->k};
        else
            f32[f32s++] = (f32_task){m[i], x[i], y[i]};
    if (luts && npumoe_lut_gemv_many(lut, luts, 8, threads)) return -1;
    if (bf16s && npumoe_bf16_gemv_many(bf16, bf16s, threads)) return -1;
    if (f32s) f32_gemv_many(f32, f32s, threads);
    return 0;
}

/* y [hidden] = Σ_e weights[e] · expert_e(x), summed in expert order. Returns -1 if it cannot allocate. */
NPUMOE_API int npumoe_swiglu_experts(const npumoe_swiglu *const *experts, const float *weights, int count,
                                     const float *x, float *y, int threads) {
    if (count <= 0) return 0;
    const int hidden = experts[0]->down.n;
    size_t floats = 0;
    for (int e = 0; e < count; e++)
        floats += (size_t)padded_rows(&experts[e]->gate) + padded_rows(&experts[e]->up) +
                  padded_rows(&experts[e]->down);
    float *scratch = malloc(sizeof(float) * (floats + 1));
    if (!scratch) return -1;
    const npumoe_matrix *m[2 * count];
    const float *in[2 * count];
    float *out[2 * count], *at = scratch;
    for (int e = 0; e < count; e++) {
        m[2 * e] = &experts[e]->gate, m[2 * e + 1] = &experts[e]->up;
        in[2 * e] = in[2 * e + 1] = x;
        out[2 * e] = at, at += padded_rows(&experts[e]->gate);
        out[2 * e + 1] = at, at += padded_rows(&experts[e]->up);
    }
    int failed = gemv_each(m, in, out, 2 * count, threads);
    for (int e = 0; e < count && !failed; e++) { /* silu(gate) ⊙ up into gate's buffer: down's activation */
        float *g = out[2 * e];
        const float *u = out[2 * e + 1];
        for (int i = 0; i < experts[e]->gate.n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        m[e] = &experts[e]->down, in[e] = g, out[e] = at, at += padded_rows(&experts[e]->down);
    }
    if (!failed) failed = gemv_each(m, in, out, count, threads);
    if (!failed)
        for (int i = 0; i < hidden; i++) {
            float s = 0.0f;
            for (int e = 0; e < count; e++) s += weights[e] * out[e][i];
            y[i] = s;
        }
    free(scratch);
    return failed;
}

/* ---- attention ---- */

/* out = x · rsqrt(mean(x²) + eps) · w (out may be x) */
static void rms_norm(float *out, const float *x, const float *w, int n, float eps) {
    float squares;
    dots(x, x, 0, 1, n, &squares);
    const float r = 1.0f / sqrtf(squares / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* The halves' rotation: lo[i] with hi[i], by entries i and half + i. */
static void rotate_halves(float *restrict lo, float *restrict hi, const float *cos, const float *sin, int half) {
    for (int i = 0; i < half; i++) {
        const float xa = lo[i], xb = hi[i];
        lo[i] = xa * cos[i] - xb * sin[i];
        hi[i] = xb * cos[half + i] + xa * sin[half + i];
    }
}

/* Rotary embedding of one head in place: cos/sin rows hold each frequency twice (halves repeated), as cos_sin
 * gives them; pairs (i, i + D/2), or with `interleaved` (2i, 2i + 1) with entry i. */
static void rope(float *x, const float *cos, const float *sin, int d, int interleaved) {
    const int half = d / 2;
    if (!interleaved) {
        rotate_halves(x, x + half, cos, sin, half);
        return;
    }
    for (int i = 0; i < half; i++) {
        const float xa = x[2 * i], xb = x[2 * i + 1];
        x[2 * i] = xa * cos[i] - xb * sin[i];
        x[2 * i + 1] = xb * cos[i] + xa * sin[i];
    }
}

/* Each of x's rows [rows][n] normalised into out (which may be x): a prompt's norms, the ops the graph would run as
 * five passes over the rows, one pass here. */
NPUMOE_API void npumoe_rms_norm_rows(const float *x, const float *w, int rows, int n, float eps, float *out) {
    for (int r = 0; r < rows; r++) rms_norm(out + (size_t)r * n, x + (size_t)r * n, w, n, eps);
}

/* x [rows][heads][d] rotated in place, row r's heads by cos and sin row r ([rows][d], as cos_sin gives them). */
NPUMOE_API void npumoe_rope_rows(float *x, const float *cos, const float *sin, int rows, int heads, int d,
                                 int interleaved) {
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++)
            rope(x + ((size_t)r * heads + h) * d, cos + (size_t)r * d, sin + (size_t)r * d, d, interleaved);
}

typedef struct {
    npumoe_matrix q, k, v, o;
    const float *q_bias, *k_bias, *v_bias, *o_bias; /* or NULL */
    const float *attn_norm, *ffn_norm;              /* [hidden] */
    const float *q_norm, *k_norm;                   /* [head_dim] per head, or all heads' (qk_norm_full), or NULL */
    float norm_eps, qk_norm_eps, scale;
    int hidden, heads, kv_heads, head_dim, qk_norm_full, interleaved;
} npumoe_attention;

typedef struct {
    const npumoe_attention *a;
    const float *q, *k_cache, *v_cache; /* q [heads][D]; caches [kv_heads][capacity][D] */
    float *scores, *out;                /* [heads][slots], [heads][D] */
    int slots, capacity;
} attention_job;

static void attention_heads(void *ctx, int h0, int h1) {
    const attention_job *job = ctx;
    const int d = job->a->head_dim, groups = job->a->heads / job->a->kv_heads, n = job->slots;
    for (int h = h0; h < h1; h++) {
        const float *q = job->q + (size_t)h * d;
        const float *k = job->k_cache + (size_t)(h / groups) * job->capacity * d;
        const float *v = job->v_cache + (size_t)(h / groups) * job->capacity * d;
        float *s = job->scores + (size_t)h * n, *out = job->out + (size_t)h * d, top = -INFINITY, sum = 0.0f;
        dot_rows(q, k, n, d, s);
        for (int j = 0; j < n; j++) s[j] *= job->a->scale, top = s[j] > top ? s[j] : top;
        for (int j = 0; j < n; j++) s[j] = expf(s[j] - top), sum += s[j];
        memset(out, 0, sizeof(float) * d);
        for (int j = 0; j < n; j++) s[j] /= sum;
        axpy_rows(out, s, v, n, d);
    }
}

static void add_bias(float *y, const float *bias, int n) {
    if (bias)
        for (int i = 0; i < n; i++) y[i] += bias[i];
}

/* The attention block of one decode token at `position`: its key and value written to the caches' slot
 * `position` ([kv_heads][capacity][head_dim] fp32 each), attention over slots 0..position, then
 * h = x + o(attention) and z = ffn_norm(h). Returns -1 if it cannot allocate. */
NPUMOE_API int npumoe_attention_decode(const npumoe_attention *a, const float *x, const float *cos, const float *sin,
                                       int position, float *k_cache, float *v_cache, int capacity, float *h, float *z,
                                       int threads) {
    const int d = a->head_dim, nq = a->heads * d, nk = a->kv_heads * d, slots = position + 1;
    const size_t floats = (size_t)a->hidden + padded_rows(&a->q) + padded_rows(&a->k) + padded_rows(&a->v) + nq +
                          padded_rows(&a->o) + (size_t)a->heads * slots;
    float *scratch = malloc(sizeof(float) * floats);
    if (!scratch) return -1;
    float *xn = scratch, *q = xn + a->hidden, *k = q + padded_rows(&a->q), *v = k + padded_rows(&a->k);
    float *attn = v + padded_rows(&a->v), *o = attn + nq, *scores = o + padded_rows(&a->o);
    rms_norm(xn, x, a->attn_norm, a->hidden, a->norm_eps);
    const npumoe_matrix *m[3] = {&a->q, &a->k, &a->v};
    const float *in[3] = {xn, xn, xn};
    float *out[3] = {q, k, v};
    int failed = gemv_each(m, in, out, 3, threads);
    if (!failed) {
        add_bias(q, a->q_bias, nq), add_bias(k, a->k_bias, nk), add_bias(v, a->v_bias, nk);
        if (a->q_norm && a->qk_norm_full) {
            rms_norm(q, q, a->q_norm, nq, a->qk_norm_eps);
            rms_norm(k, k, a->k_norm, nk, a->qk_norm_eps);
        }
        for (int hd = 0; hd < a->heads; hd++) {
            if (a->q_norm && !a->qk_norm_full) rms_norm(q + hd * d, q + hd * d, a->q_norm, d, a->qk_norm_eps);
            rope(q + hd * d, cos, sin, d, a->interleaved);
        }
        for (int g = 0; g < a->kv_heads; g++) {
            if (a->k_norm && !a->qk_norm_full) rms_norm(k + g * d, k + g * d, a->k_norm, d, a->qk_norm_eps);
            rope(k + g * d, cos, sin, d, a->interleaved);
            memcpy(k_cache + ((size_t)g * capacity + position) * d, k + g * d, sizeof(float) * d);
            memcpy(v_cache + ((size_t)g * capacity + position) * d, v + g * d, sizeof(float) * d);
        }
        attention_job job = {a, q, k_cache, v_cache, scores, attn, slots, capacity};
        lut_parallel(attention_heads, &job, a->heads, (size_t)slots * nk * 8 > THREADED_BYTES ? threads : 1, 1);
        const npumoe_matrix *mo = &a->o;
        const float *in_o = attn;
        failed = gemv_each(&mo, &in_o, &o, 1, threads);
    }
    if (!failed) {
        add_bias(o, a->o_bias, a->hidden);
        for (int i = 0; i < a->hidden; i++) h[i] = x[i] + o[i];
        rms_norm(z, h, a->ffn_norm, a->hidden, a->norm_eps);
    }
    free(scratch);
    return failed;
}

/* ---- routing ---- */

typedef struct {
    const float *z, *w;
    float *logits;
    int hidden;
} router_job;

static void router_rows(void *ctx, int e0, int e1) {
    const router_job *job = ctx;
    dot_rows(job->z, job->w + (size_t)e0 * job->hidden, e1 - e0, job->hidden, job->logits + e0);
}

/* A decode token's softmax routing: logits [experts] = W z (W [experts][hidden] fp32), probabilities by softmax,
 * the k most probable (the lower index first among equals) into top_i / top_w, renormalised to sum to 1 when
 * `normalize`, then times `scaling`. */
NPUMOE_API void npumoe_route_softmax(const float *z, const float *w, int experts, int hidden, int k, int normalize,
                                     float scaling, float *logits, int64_t *top_i, float *top_w, int threads) {
    router_job job = {z, w, logits, hidden};
    lut_parallel(router_rows, &job, experts, (size_t)experts * hidden * 4 > THREADED_BYTES ? threads : 1, 1);
    float top = -INFINITY, sum = 0.0f, picked = 0.0f;
    for (int e = 0; e < experts; e++) top = logits[e] > top ? logits[e] : top;
    float p[experts];
    for (int e = 0; e < experts; e++) p[e] = expf(logits[e] - top), sum += p[e];
    for (int e = 0; e < experts; e++) p[e] /= sum;
    unsigned char taken[experts];
    memset(taken, 0, sizeof taken);
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < experts; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = 1, top_i[j] = best, top_w[j] = p[best], picked += p[best];
    }
    for (int j = 0; j < k; j++) top_w[j] = (normalize ? top_w[j] / picked : top_w[j]) * scaling;
}

/* ---- a MoE layer ---- */

typedef struct {
    const float *router;                 /* [experts][hidden] fp32 */
    const npumoe_swiglu *const *experts; /* [experts] */
    int num_experts, hidden, top_k, normalize;
    float scaling;
} npumoe_moe;

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* A decode token's MoE layer on the CPU: softmax routing (npumoe_route_softmax), then its top-k experts
 * (npumoe_swiglu_experts) into y [hidden]. The routing's wall time goes to *routing_seconds: it is host work,
 * the experts are the layer's matrix reads. Returns -1 if it cannot allocate. */
NPUMOE_API int npumoe_moe_decode(const npumoe_moe *moe, const float *z, float *y, float *logits, int64_t *top_i,
                                 float *top_w, double *routing_seconds, int threads) {
    const double start = seconds_now();
    npumoe_route_softmax(z, moe->router, moe->num_experts, moe->hidden, moe->top_k, moe->normalize, moe->scaling,
                         logits, top_i, top_w, threads);
    *routing_seconds = seconds_now() - start;
    const npumoe_swiglu *picked[moe->top_k];
    for (int j = 0; j < moe->top_k; j++) picked[j] = moe->experts[top_i[j]];
    return npumoe_swiglu_experts(picked, top_w, moe->top_k, z, y, threads);
}

/* ---- a decode token through the whole model ---- */

typedef struct {
    const npumoe_attention *attention;
    const npumoe_moe *moe;
    float *k_cache, *v_cache;   /* [kv_heads][capacity][head_dim] fp32 */
    const float *cos, *sin;     /* rope tables [positions][head_dim]: row `position` is this token's */
    int capacity;
} npumoe_layer;

typedef struct {
    const npumoe_layer *layers;
    int count;
    npumoe_matrix embedding; /* [vocab][hidden], bf16 or fp32 */
    float embedding_scale;
    const float *norm;       /* the final RMS norm [hidden] */
    float norm_eps;
    npumoe_matrix head;      /* [vocab][hidden] */
} npumoe_model;

/* One decode token: its embedding row, every layer (attention block, MoE layer, residual) with no host step
 * between them, the final norm and the LM head into logits [vocab]; layer l's routing into top_i / top_w
 * [l][top_k], their summed wall time into *routing_seconds. Returns -1 if it cannot allocate. */
NPUMOE_API int npumoe_decode_step(const npumoe_model *model, int64_t token, int position, float *logits,
                                  int64_t *top_i, float *top_w, double *routing_seconds, int threads) {
    const int hidden = model->layers[0].attention->hidden;
    int experts = 0;
    for (int l = 0; l < model->count; l++)
        experts = model->layers[l].moe->num_experts > experts ? model->layers[l].moe->num_experts : experts;
    float *scratch = malloc(sizeof(float) * (4 * (size_t)hidden + experts + padded_rows(&model->head)));
    if (!scratch) return -1;
    float *x = scratch, *h = x + hidden, *z = h + hidden, *y = z + hidden, *router = y + hidden;
    float *head = router + experts;
    const size_t row = (size_t)token * hidden;
    const npumoe_matrix *table = &model->embedding;
    for (int i = 0; i < hidden; i++)
        x[i] = (table->bf16 ? lut_bf16_to_float(table->bf16[row + i]) : table->f32[row + i]) * model->embedding_scale;
    int failed = 0;
    *routing_seconds = 0.0;
    for (int l = 0; l < model->count && !failed; l++) {
        const npumoe_layer *layer = &model->layers[l];
        const size_t at = (size_t)position * layer->attention->head_dim;
        double routing = 0.0;
        failed = npumoe_attention_decode(layer->attention, x, layer->cos + at, layer->sin + at, position,
                                         layer->k_cache, layer->v_cache, layer->capacity, h, z, threads) ||
                 npumoe_moe_decode(layer->moe, z, y, router, top_i, top_w, &routing, threads);
        *routing_seconds += routing;
        for (int i = 0; i < hidden; i++) x[i] = h[i] + y[i];
        top_i += layer->moe->top_k, top_w += layer->moe->top_k;
    }
    if (!failed) {
        rms_norm(z, x, model->norm, hidden, model->norm_eps);
        const npumoe_matrix *m = &model->head;
        const float *in = z;
        failed = gemv_each(&m, &in, &head, 1, threads);
    }
    if (!failed) memcpy(logits, head, sizeof(float) * model->head.n);
    free(scratch);
    return failed;
}

/* ---- routed experts over stacked matrices (the ExecuTorch custom ops npumoe::lut_swiglu_experts, swiglu_experts) ---- */

typedef struct { /* every expert's packed matrix of one name, stacked as the tiled layout lays one out */
    const uint8_t *tiles;   /* [experts][row_blocks][k/32][bits][64] */
    const uint16_t *scales; /* [experts][row_blocks][k/group][16] float16 bits */
    const uint8_t *zeros;   /* the same shape, or NULL: symmetric */
    int n, k, bits, group, experts;
} npumoe_lut_stack;

typedef struct { /* every expert's fp32 matrix of one name, stacked: [experts][n][k] */
    const float *f32;
    int n, k, experts;
} npumoe_f32_stack;

/* Expert e's matrix of a stack as the decode path takes it; `lut` holds a packed one's weight. */
typedef npumoe_matrix (*stack_matrix)(const void *stack, int64_t e, lut_weight *lut);

static npumoe_matrix lut_stack_matrix(const void *stack, int64_t e, lut_weight *lut) {
    const npumoe_lut_stack *s = stack;
    const int row_blocks = (s->n + LUT_ROWS - 1) / LUT_ROWS;
    const size_t tiles = (size_t)row_blocks * (s->k / LUT_TILE_K) * s->bits * LUT_TILE_BYTES;
    const size_t params = (size_t)row_blocks * (s->k / s->group) * LUT_ROWS;
    *lut = (lut_weight){s->tiles + e * tiles, s->scales + e * params, s->zeros ? s->zeros + e * params : NULL,
                        row_blocks, s->k, s->bits, s->group};
    return (npumoe_matrix){lut, NULL, NULL, s->n, s->k};
}

static npumoe_matrix f32_stack_matrix(const void *stack, int64_t e, lut_weight *lut) {
    const npumoe_f32_stack *s = stack;
    (void)lut;
    return (npumoe_matrix){NULL, NULL, s->f32 + (size_t)e * s->n * s->k, s->n, s->k};
}

/* y[r] = Σ_j weights[r][j] · expert_{ids[r][j]}(x[r]) for each of `rows` rows of x [rows][hidden], k experts a row,
 * each expert down(silu(gate x) ⊙ up x) read in place from the stacks (npumoe_swiglu_experts, the engine's fused
 * decode call, per row). Returns -1 if it cannot allocate, -2 for an expert id out of range. */
static int swiglu_rows(const void *gate, const void *up, const void *down, stack_matrix matrix, int experts,
                       int hidden, const int64_t *ids, const float *weights, int rows, int k, const float *x, float *y,
                       int threads) {
    for (int i = 0; i < rows * k; i++)
        if (ids[i] < 0 || ids[i] >= experts) return -2;
    for (int r = 0; r < rows; r++) {
        lut_weight w[3 * k];
        npumoe_swiglu chosen[k];
        const npumoe_swiglu *picked[k];
        for (int j = 0; j < k; j++) {
            const int64_t e = ids[(size_t)r * k + j];
            chosen[j] = (npumoe_swiglu){matrix(gate, e, &w[3 * j]), matrix(up, e, &w[3 * j + 1]),
                                        matrix(down, e, &w[3 * j + 2])};
            picked[j] = &chosen[j];
        }
        if (npumoe_swiglu_experts(picked, weights + (size_t)r * k, k, x + (size_t)r * hidden, y + (size_t)r * hidden,
                                  threads))
            return -1;
    }
    return 0;
}

/* swiglu_rows over stacked packed matrices (npumoe::lut_swiglu_experts). */
NPUMOE_API int npumoe_lut_swiglu_rows(const npumoe_lut_stack *gate, const npumoe_lut_stack *up,
                                      const npumoe_lut_stack *down, const int64_t *ids, const float *weights, int rows,
                                      int k, const float *x, float *y, int threads) {
    return swiglu_rows(gate, up, down, lut_stack_matrix, gate->experts, down->n, ids, weights, rows, k, x, y, threads);
}

/* swiglu_rows over stacked fp32 matrices (npumoe::swiglu_experts: an unquantised program's experts). */
NPUMOE_API int npumoe_f32_swiglu_rows(const npumoe_f32_stack *gate, const npumoe_f32_stack *up,
                                      const npumoe_f32_stack *down, const int64_t *ids, const float *weights, int rows,
                                      int k, const float *x, float *y, int threads) {
    return swiglu_rows(gate, up, down, f32_stack_matrix, gate->experts, down->n, ids, weights, rows, k, x, y, threads);
}

/* y [rows][n] = x [rows][k] · Wᵀ for W [n][k] fp32 read in place, each row the decode path's GEMV
 * (npumoe::f32_linear_rows: an exported program's LM head, of which XNNPACK would keep a packed copy). */
NPUMOE_API void npumoe_f32_linear_rows(const float *w, int n, int k, const float *x, int rows, float *y, int threads) {
    const npumoe_matrix m = {NULL, NULL, w, n, k};
    for (int r = 0; r < rows; r++) {
        const f32_task task = {&m, x + (size_t)r * k, y + (size_t)r * n};
        f32_gemv_many(&task, 1, threads);
    }
}
