/* test_threadpool.c — every index of every job runs exactly once; pools of
 * 1..4 threads; create/destroy cycles; bad sizes are refused. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "threadpool.h"

#include "check.h"

#define MAXT 8

typedef struct {
    atomic_int hits[MAXT];
    atomic_int bad_nth;
    int expect_nth;
    atomic_long work;
} job_t;

static void task(void *arg, int ith, int nth) {
    job_t *j = arg;
    if (nth != j->expect_nth || ith < 0 || ith >= nth || ith >= MAXT) {
        atomic_fetch_add(&j->bad_nth, 1);
        return;
    }
    atomic_fetch_add(&j->hits[ith], 1);
    atomic_fetch_add(&j->work, ith + 1);
}

/* A job whose items are split by index: sum of 0..n-1 computed in pieces. */
typedef struct {
    long n;
    long partial[MAXT];
} sum_t;

static void sum_task(void *arg, int ith, int nth) {
    sum_t *s = arg;
    long a = s->n * ith / nth, b = s->n * (ith + 1) / nth, acc = 0;
    for (long i = a; i < b; i++) acc += i;
    s->partial[ith] = acc;
}

int main(void) {
    kv_error e;
    CHECK(kv_physical_cores() >= 1, "physical cores %d", kv_physical_cores());
    printf("physical cores: %d\n", kv_physical_cores());

    kv_pool *p = (kv_pool *)1;
    CHECK(kv_pool_create(0, &p, &e) == KV_ERR_ARG && p == NULL, "size 0 refused");
    CHECK(kv_pool_create(-3, &p, &e) == KV_ERR_ARG, "size -3 refused");
    CHECK(kv_pool_create(1 << 20, &p, &e) == KV_ERR_ARG, "huge size refused");
    kv_pool_destroy(NULL);
    CHECK(kv_pool_size(NULL) == 1, "NULL pool size 1");

    for (int n = 1; n <= 4; n++) {
        kv_pool *pool = NULL;
        kv_status st = kv_pool_create(n, &pool, &e);
        CHECK(st == KV_OK && pool, "create %d: %s", n, st ? e.msg : "");
        if (!pool) continue;
        CHECK(kv_pool_size(pool) == n, "size %d", n);
        const int jobs = 20000;
        int ok = 1;
        for (int r = 0; r < jobs && ok; r++) {
            job_t j;
            memset(&j, 0, sizeof j);
            j.expect_nth = n;
            kv_pool_run(pool, task, &j);
            for (int i = 0; i < n; i++)
                if (atomic_load(&j.hits[i]) != 1) ok = 0;
            if (atomic_load(&j.bad_nth) != 0) ok = 0;
            if (atomic_load(&j.work) != (long)n * (n + 1) / 2) ok = 0;
            if (!ok) printf("  job %d of pool %d wrong\n", r, n);
        }
        CHECK(ok, "pool %d: %d jobs, each index exactly once", n, jobs);

        sum_t s = {.n = 1000003};
        kv_pool_run(pool, sum_task, &s);
        long tot = 0;
        for (int i = 0; i < n; i++) tot += s.partial[i];
        CHECK(tot == s.n * (s.n - 1) / 2, "pool %d: split sum", n);

        /* Jobs separated by idle gaps long enough for workers to park. */
        int ok2 = 1;
        for (int r = 0; r < 5; r++) {
            struct timespec ts = {0, 5 * 1000 * 1000};
            nanosleep(&ts, NULL);
            job_t j;
            memset(&j, 0, sizeof j);
            j.expect_nth = n;
            kv_pool_run(pool, task, &j);
            for (int i = 0; i < n; i++)
                if (atomic_load(&j.hits[i]) != 1) ok2 = 0;
        }
        CHECK(ok2, "pool %d: jobs after parking", n);
        kv_pool_destroy(pool);
    }

    /* create / destroy cycles, some with no job at all */
    int ok = 1;
    for (int c = 0; c < 200; c++) {
        kv_pool *pool = NULL;
        int n = 1 + c % 4;
        if (kv_pool_create(n, &pool, &e) != KV_OK) { ok = 0; break; }
        if (c % 3) {
            job_t j;
            memset(&j, 0, sizeof j);
            j.expect_nth = n;
            kv_pool_run(pool, task, &j);
            for (int i = 0; i < n; i++)
                if (atomic_load(&j.hits[i]) != 1) ok = 0;
        }
        kv_pool_destroy(pool);
    }
    CHECK(ok, "200 create/destroy cycles");

    return kvt_finish();
}
