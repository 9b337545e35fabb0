/* The kernels' thread pool: run_parallel hands out the parts of one job (BLOCK_P panels of a linear,
 * one attention part: a sequence, or a KV head of one) to `threads` threads, the caller being one of
 * them. Workers spin briefly between calls (a step makes hundreds of calls microseconds apart), then
 * sleep. The pool is the package's own: numba's OpenMP layer beside torch's OpenMP runtime took
 * milliseconds a call (cpu/kernels.py). */
#include "cpu_kernels.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

typedef struct {
    task_fn fn;
    void* ctx;
    int64_t parts;
    atomic_long next; /* the next part to claim */
    atomic_long done; /* parts finished */
} job_t;

#define MAX_WORKERS 255
#define SPIN_NS 200000 /* how long a worker polls for the next job before it sleeps */

/* Parts are claimed one at a time by whoever is free, the caller included: a worker the OS has
 * not scheduled yet (a busy machine) leaves its share to the others instead of stalling the call. */
static struct {
    pthread_mutex_t job_mu; /* one job at a time (callers from several Python threads queue here) */
    pthread_mutex_t mu;
    pthread_cond_t wake;
    atomic_long gen; /* bumped once per job */
    atomic_int sleepers;
    atomic_int busy; /* workers between taking the job pointer and letting it go */
    _Atomic(job_t*) job;
    int workers;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, NULL, 0};

static inline void relax(int64_t spins) {
    if ((spins & 63) == 63) sched_yield(); /* let a descheduled worker run on a busy machine */
#if defined(__x86_64__) || defined(__i386__)
    else __builtin_ia32_pause();
#endif
}

static void work_on(job_t* j) {
    int64_t p;
    while ((p = atomic_fetch_add(&j->next, 1)) < j->parts) {
        j->fn(j->ctx, p);
        atomic_fetch_add_explicit(&j->done, 1, memory_order_release);
    }
}

static void* worker_main(void* arg) {
    long seen = (long)(intptr_t)arg; /* the last job before this worker was made */
    for (;;) {
        long g;
        int64_t since = now_ns(), spins = 0;
        while ((g = atomic_load_explicit(&pool.gen, memory_order_acquire)) == seen) {
            relax(++spins);
            if ((spins & 255) || now_ns() - since < SPIN_NS) continue;
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.wake, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = g;
        atomic_fetch_add(&pool.busy, 1);
        job_t* j = atomic_load(&pool.job);
        if (j) work_on(j);
        atomic_fetch_sub(&pool.busy, 1);
    }
    return NULL;
}

/* in a forked child (pthread_atfork, module.c): the workers did not come along */
void pool_after_fork_child(void) {
    pool.workers = 0;
    atomic_store(&pool.busy, 0);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.job, NULL);
    pthread_mutex_init(&pool.job_mu, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
}

void run_parallel(task_fn fn, void* ctx, int64_t parts, int64_t threads) {
    if (threads > MAX_WORKERS + 1) threads = MAX_WORKERS + 1;
    if (threads <= 1 || parts <= 1) {
        for (int64_t p = 0; p < parts; p++) fn(ctx, p);
        return;
    }
    pthread_mutex_lock(&pool.job_mu);
    while (pool.workers < threads - 1) {
        pthread_t th;
        if (pthread_create(&th, NULL, worker_main, (void*)(intptr_t)atomic_load(&pool.gen)) != 0) break;
        pthread_detach(th);
        pool.workers++;
    }
    job_t j = {fn, ctx, parts, 0, 0};
    atomic_store(&pool.job, &j);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add_explicit(&pool.gen, 1, memory_order_release);
    if (atomic_load(&pool.sleepers)) pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    work_on(&j);
    for (int64_t spins = 0; atomic_load_explicit(&j.done, memory_order_acquire) < parts;) relax(++spins);
    atomic_store(&pool.job, NULL); /* then wait for workers still holding it: j lives on this stack */
    for (int64_t spins = 0; atomic_load(&pool.busy) > 0;) relax(++spins);
    pthread_mutex_unlock(&pool.job_mu);
}
