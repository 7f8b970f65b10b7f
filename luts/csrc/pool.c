/* A small persistent thread pool: a GEMV at memory speed takes ~0.1-1 ms, so creating
 * threads per call (tens of µs each) would cost more than it saves. Workers spin briefly
 * after each job, so back-to-back decode calls start at once, then sleep on a condition
 * variable.
 *
 * Work is handed out in contiguous chunks from one atomic word holding (job, chunk count,
 * next chunk), and the caller waits for the chunks to be done, not for every worker to
 * check in: on a busy machine a preempted worker costs at most the chunk it holds, and a
 * worker that wakes up late finds its job gone and cannot claim from the next one. Up to
 * eight chunks a thread; streaming jobs ask for fewer, longer ones (lut.h, LUT_STREAM_CHUNK).
 * Calls are serialised; a forked child starts a fresh pool.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "lut.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* How long a worker spins for the next job before it sleeps. By time, not by rounds: a pause lasts
 * from a few cycles (AMD Zen) to ~140 (Intel Skylake+), and a fixed count of them kept a worker
 * spinning long after each job on a 2-core Zen VM, where torch's own threads then waited for its
 * core (docs/performance.md, "Thread pool"). 30 µs covers the gap between the GEMVs of one
 * decode step's expert. */
#define SPIN_NS 30000LL

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}
#define CHUNKS_PER_THREAD 8

/* claim word: job << 32 | participants << 24 | chunks << 12 | next chunk (chunks ≤ 8·64 < 4096) */
#define CLAIM(job, parts, chunks) ((uint64_t)(job) << 32 | (uint64_t)(parts) << 24 | (uint64_t)(chunks) << 12)

static struct {
    pthread_mutex_t call_lock, sleep_lock;
    pthread_cond_t wake;
    int workers;
    pid_t owner;
    atomic_uint generation; /* bumped per job: what sleeping workers wait on */
    atomic_uint_least64_t claim;
    atomic_int done;        /* chunks finished in the current job */
    atomic_int sleepers;
    unsigned start_job[LUT_MAX_THREADS]; /* the job count when worker id was created */
    lut_range_fn fn;
    void *ctx;
    int units;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

/* Participant `id` (0 = the caller) runs chunks of job `job` until none is left; it returns at
 * once if that job is over or takes fewer participants. */
static void run_chunks(unsigned job, int id) {
    uint64_t word = atomic_load_explicit(&pool.claim, memory_order_acquire);
    for (;;) {
        const unsigned parts = (word >> 24) & 0xFF, chunks = (word >> 12) & 0xFFF, next = word & 0xFFF;
        if ((unsigned)(word >> 32) != job || (unsigned)id >= parts || next >= chunks) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &word, word + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        /* the job cannot finish, so its fn/ctx/units cannot change, until this chunk is done */
        const int begin = (int)((long long)pool.units * next / chunks);
        const int end = (int)((long long)pool.units * (next + 1) / chunks);
        if (begin < end) pool.fn(pool.ctx, begin, end);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        word = atomic_load_explicit(&pool.claim, memory_order_acquire);
    }
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg; /* 1..workers; the caller is participant 0 */
    unsigned seen = pool.start_job[id];
    for (;;) {
        unsigned now;
        const long long spin_until = now_ns() + SPIN_NS;
        int spins = 0;
        while ((now = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen &&
               (++spins % 64 || now_ns() < spin_until))
            CPU_RELAX();
        if (now == seen) {
            pthread_mutex_lock(&pool.sleep_lock);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((now = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.sleep_lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.sleep_lock);
        }
        seen = now;
        run_chunks(now, id);
    }
    return NULL;
}

static void grow(int workers) {
    if (pool.owner != getpid()) { /* first use, or a forked child: the old workers do not exist here */
        pool.workers = 0;
        pool.owner = getpid();
    }
    for (; pool.workers < workers; pool.workers++) {
        const int id = pool.workers + 1;
        pthread_t thread;
        pool.start_job[id] = atomic_load(&pool.generation);
        if (pthread_create(&thread, NULL, worker, (void *)(intptr_t)id)) break;
        pthread_detach(thread);
    }
}

void lut_parallel(lut_range_fn fn, void *ctx, int units, int threads, int min_chunk) {
    if (threads > LUT_MAX_THREADS) threads = LUT_MAX_THREADS;
    if (threads > units) threads = units;
    if (threads <= 1) {
        if (units > 0) fn(ctx, 0, units);
        return;
    }
    pthread_mutex_lock(&pool.call_lock);
    grow(threads - 1);
    const int parts = pool.workers + 1 < threads ? pool.workers + 1 : threads;
    int chunks = units / min_chunk; /* of at least min_chunk units, but one for every participant */
    if (chunks > CHUNKS_PER_THREAD * parts) chunks = CHUNKS_PER_THREAD * parts;
    if (chunks < parts) chunks = parts;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.units = units;
    atomic_store(&pool.done, 0);
    pthread_mutex_lock(&pool.sleep_lock);
    const unsigned job = atomic_load(&pool.generation) + 1;
    atomic_store_explicit(&pool.claim, CLAIM(job, parts, chunks), memory_order_release);
    atomic_store_explicit(&pool.generation, job, memory_order_release);
    if (atomic_load(&pool.sleepers)) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep_lock);
    run_chunks(job, 0);
    /* Wait for chunks still held by workers: spin a little, then yield. On a busy machine the worker
     * holding the last chunk may be waiting for this very core, and a caller that only spins keeps it
     * off until the scheduler preempts it (seen beside one CPU-bound process: docs/performance.md,
     * "Thread pool"). */
    const long long spin_until = now_ns() + SPIN_NS;
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < chunks;)
        if (++spins % 64 || now_ns() < spin_until)
            CPU_RELAX();
        else
            sched_yield();
    pthread_mutex_unlock(&pool.call_lock);
}

typedef struct {
    lut_span_fn fn;
    void *ctx;
    const int *first; /* [count + 1] */
} task_spans_job;

/* Units b0..b1-1 as each task's own span of them (a task without units gets no call). */
static void task_spans(void *ctx, int b0, int b1) {
    const task_spans_job *job = ctx;
    int t = 0;
    while (job->first[t + 1] <= b0) t++;
    for (; b0 < b1; t++) {
        const int end = job->first[t + 1] < b1 ? job->first[t + 1] : b1;
        if (end > b0) job->fn(job->ctx, t, b0 - job->first[t], end - job->first[t]);
        b0 = end;
    }
}

void lut_parallel_tasks(lut_span_fn fn, void *ctx, const int *first, int count, size_t weight_bytes, int threads) {
    const int units = first[count];
    if (units <= 0) return;
    int min_chunk = (int)(LUT_STREAM_CHUNK / (weight_bytes / units + 1) + 1);
    if (threads > 1 && min_chunk > units / threads) min_chunk = units / threads > 0 ? units / threads : 1;
    task_spans_job job = {fn, ctx, first};
    lut_parallel(task_spans, &job, units, threads, min_chunk);
}
