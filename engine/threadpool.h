/*
 * threadpool.h — a persistent pool of worker threads for the hot path.
 *
 * Threads are created once (with the model) and parked between jobs; a job
 * is one function run by every thread with its index. The calling thread
 * takes part as ith = 0, so a pool of 1 runs everything inline.
 */
#ifndef KV_THREADPOOL_H
#define KV_THREADPOOL_H

#include "kv_error.h"

typedef struct kv_pool kv_pool;

typedef void (*kv_task_fn)(void *arg, int ith, int nth);

kv_status kv_pool_create(int n_threads, kv_pool **out, kv_error *e);
void kv_pool_destroy(kv_pool *p); /* NULL is fine */
int kv_pool_size(const kv_pool *p);

/* Runs fn(arg, ith, nth) for ith in [0, nth) and returns when all are done.
 * Not reentrant: one job at a time per pool. */
void kv_pool_run(kv_pool *p, kv_task_fn fn, void *arg);

/* Number of physical cores (fallback: logical CPUs), at least 1. */
int kv_physical_cores(void);

#endif
