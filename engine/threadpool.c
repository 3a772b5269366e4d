/*
 * threadpool.c — persistent worker threads for the hot path (see threadpool.h).
 *
 * A job is published by bumping a generation counter; workers spin on it
 * for a short while (decode issues a few hundred small jobs per token, so
 * most jobs are picked up without a system call) and then park on a futex
 * (a condition variable where futexes do not exist).
 *
 * The indices ith = 1..n-1 are claimed from a shared counter rather than
 * bound to threads: the caller runs ith = 0, then claims whatever indices
 * no worker has picked up yet, and finally waits (spin-then-park) for the
 * `pending` count of claimed indices to reach zero. On a busy machine a
 * worker that the scheduler has not run yet therefore never holds up a
 * job: its share is done by the caller.
 */
#include "threadpool.h"

#include <dirent.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#define KV_HAVE_FUTEX 1
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define KV_POOL_MAX 512
#define SPIN_ITERS 20000 /* pause iterations before parking (~0.1-1 ms) */

typedef struct {
    kv_pool *pool;
    int ith;
} kv_worker;

struct kv_pool {
    int n;
    pthread_t *threads;
    kv_worker *workers;
    int started; /* threads actually created */
    int oversub; /* more threads than CPUs: yield instead of pausing */

    kv_task_fn fn;
    void *arg;
    atomic_int gen;      /* bumped once per job (and at shutdown) */
    atomic_int next;     /* next index to claim (>= n: none left) */
    atomic_int pending;  /* indices 1..n-1 not finished yet */
    atomic_int sleepers; /* workers parked on gen */
    atomic_int waiting;  /* caller parked on pending */
    atomic_int stop;
#ifndef KV_HAVE_FUTEX
    pthread_mutex_t mu;
    pthread_cond_t cv_gen, cv_done;
#endif
};

/* ---- park / wake ----------------------------------------------------------- */

#ifdef KV_HAVE_FUTEX
static void park(kv_pool *p, atomic_int *addr, int val, int is_gen) {
    (void)p, (void)is_gen;
    syscall(SYS_futex, (int *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}
static void wake(kv_pool *p, atomic_int *addr, int is_gen) {
    (void)p, (void)is_gen;
    syscall(SYS_futex, (int *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}
#else
static void park(kv_pool *p, atomic_int *addr, int val, int is_gen) {
    pthread_mutex_lock(&p->mu);
    if (atomic_load(addr) == val) pthread_cond_wait(is_gen ? &p->cv_gen : &p->cv_done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
static void wake(kv_pool *p, atomic_int *addr, int is_gen) {
    (void)addr;
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(is_gen ? &p->cv_gen : &p->cv_done);
    pthread_mutex_unlock(&p->mu);
}
#endif

/* One step of a spin-wait; returns 0 when it is time to park. */
static inline int spin_step(const kv_pool *p, int *spins) {
    if (p->oversub) {
        if (++*spins > 50) return 0;
        sched_yield();
        return 1;
    }
    if (++*spins > SPIN_ITERS) return 0;
    cpu_relax();
    return 1;
}

/* ---- workers --------------------------------------------------------------- */

static void *worker_main(void *v) {
    kv_worker *w = v;
    kv_pool *p = w->pool;
    int seen = 0; /* gen is 0 when the pool is created: a job published before
                     this thread first looks is still seen as new */
    for (;;) {
        int g;
        int spins = 0;
        while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen) {
            if (spin_step(p, &spins)) continue;
            atomic_fetch_add(&p->sleepers, 1);
            if (atomic_load(&p->gen) == seen) park(p, &p->gen, seen, 1);
            atomic_fetch_sub(&p->sleepers, 1);
        }
        seen = g;
        if (atomic_load(&p->stop)) break;
        for (;;) {
            int i = atomic_fetch_add(&p->next, 1);
            if (i >= p->n) break;
            p->fn(p->arg, i, p->n);
            if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->waiting))
                wake(p, &p->pending, 0);
        }
    }
    return NULL;
}

static void shutdown_workers(kv_pool *p) {
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->gen, 1);
    wake(p, &p->gen, 1);
    for (int i = 0; i < p->started; i++) pthread_join(p->threads[i], NULL);
    p->started = 0;
}

/* ---- public API -------------------------------------------------------------- */

kv_status kv_pool_create(int n_threads, kv_pool **out, kv_error *e) {
    if (!out) return kv_fail(e, KV_ERR_ARG, "kv_pool_create: out is NULL");
    *out = NULL;
    if (n_threads < 1 || n_threads > KV_POOL_MAX)
        return kv_fail(e, KV_ERR_ARG, "thread pool size %d out of range 1..%d", n_threads,
                       KV_POOL_MAX);
    kv_pool *p = calloc(1, sizeof *p);
    if (!p) return kv_fail(e, KV_ERR_NOMEM, "thread pool: out of memory");
    p->n = n_threads;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    p->oversub = ncpu > 0 && n_threads > ncpu;
    atomic_init(&p->gen, 0);
    atomic_init(&p->pending, 0);
    atomic_init(&p->next, n_threads);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->waiting, 0);
    atomic_init(&p->stop, 0);
#ifndef KV_HAVE_FUTEX
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_gen, NULL);
    pthread_cond_init(&p->cv_done, NULL);
#endif
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (!p->threads || !p->workers) {
            kv_pool_destroy(p);
            return kv_fail(e, KV_ERR_NOMEM, "thread pool: out of memory");
        }
        for (int i = 0; i < n_threads - 1; i++) {
            p->workers[i].pool = p;
            p->workers[i].ith = i + 1;
            int rc = pthread_create(&p->threads[i], NULL, worker_main, &p->workers[i]);
            if (rc != 0) {
                kv_pool_destroy(p);
                return kv_fail(e, KV_ERR_NOMEM, "thread pool: cannot create thread %d of %d: %s",
                               i + 1, n_threads, strerror(rc));
            }
            p->started++;
        }
    }
    *out = p;
    return KV_OK;
}

void kv_pool_destroy(kv_pool *p) {
    if (!p) return;
    shutdown_workers(p);
#ifndef KV_HAVE_FUTEX
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv_gen);
    pthread_cond_destroy(&p->cv_done);
#endif
    free(p->threads);
    free(p->workers);
    free(p);
}

int kv_pool_size(const kv_pool *p) { return p ? p->n : 1; }

void kv_pool_run(kv_pool *p, kv_task_fn fn, void *arg) {
    if (!p || p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    atomic_store(&p->pending, p->n - 1);
    atomic_store(&p->next, 1);    /* from here on indices can be claimed */
    atomic_fetch_add(&p->gen, 1); /* wakes the spinners */
    if (atomic_load(&p->sleepers) > 0) wake(p, &p->gen, 1);

    fn(arg, 0, p->n);
    for (;;) { /* indices no worker has claimed yet */
        int i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n) break;
        fn(arg, i, p->n);
        atomic_fetch_sub(&p->pending, 1);
    }

    int spins = 0, v;
    while ((v = atomic_load_explicit(&p->pending, memory_order_acquire)) != 0) {
        if (spin_step(p, &spins)) continue;
        atomic_store(&p->waiting, 1);
        if ((v = atomic_load(&p->pending)) != 0) park(p, &p->pending, v, 0);
        atomic_store(&p->waiting, 0);
    }
}

/* ---- topology ----------------------------------------------------------------- */

static int read_int_file(const char *path, int *v) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int ok = fscanf(f, "%d", v) == 1;
    fclose(f);
    return ok ? 0 : -1;
}

int kv_physical_cores(void) {
    /* Distinct (package, core) pairs among /sys/devices/system/cpu/cpuN. */
    enum { MAXC = 1024 };
    int pairs[MAXC][2];
    int npairs = 0;
    DIR *d = opendir("/sys/devices/system/cpu");
    if (d) {
        struct dirent *de;
        while ((de = readdir(d)) != NULL && npairs < MAXC) {
            int cpu;
            char tail;
            if (sscanf(de->d_name, "cpu%d%c", &cpu, &tail) != 1) continue;
            char path[256];
            int core, pkg, online = 1;
            snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/online", cpu);
            if (read_int_file(path, &online) == 0 && !online) continue;
            snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/core_id", cpu);
            if (read_int_file(path, &core) != 0) continue;
            snprintf(path, sizeof path,
                     "/sys/devices/system/cpu/cpu%d/topology/physical_package_id", cpu);
            if (read_int_file(path, &pkg) != 0) pkg = 0;
            int dup = 0;
            for (int i = 0; i < npairs && !dup; i++) dup = pairs[i][0] == pkg && pairs[i][1] == core;
            if (!dup) {
                pairs[npairs][0] = pkg;
                pairs[npairs][1] = core;
                npairs++;
            }
        }
        closedir(d);
    }
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (npairs > 0) return (online > 0 && npairs > online) ? (int)online : npairs;
    return online > 0 ? (int)online : 1;
}
