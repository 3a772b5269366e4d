/*
 * check.h — the harness every C test shares: pass/fail counters, CHECK for
 * one condition, report() for a named case, and kvt_finish(), which prints
 * the closing line "N passed, N failed" and gives the exit status (kvt_skip
 * for a test that cannot run here).
 * Header-only: each test is a program of its own.
 */
#ifndef KV_TEST_CHECK_H
#define KV_TEST_CHECK_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>

static int n_pass, n_fail;

/* Counts one check; prints file:line and the message when it fails. */
#define CHECK(cond, ...)                                  \
    do {                                                  \
        if (cond) {                                       \
            n_pass++;                                     \
        } else {                                          \
            n_fail++;                                     \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);   \
            printf(__VA_ARGS__);                          \
            printf("\n");                                 \
        }                                                 \
    } while (0)

/* Counts one named case: "ok   name" or "FAIL name: message". */
static inline __attribute__((format(printf, 3, 4))) void report(bool ok, const char *name,
                                                                const char *fmt, ...) {
    if (ok) {
        n_pass++;
        printf("ok   %s\n", name);
        return;
    }
    n_fail++;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    printf("FAIL %s: %s\n", name, msg);
}

/* The closing line; the test's exit status. */
static inline int kvt_finish(void) {
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

/* A test that cannot run on this machine: says why and that it was
 * skipped; exit status 77, which CMakeLists.txt gives ctest as the tests'
 * SKIP_RETURN_CODE (so ctest and ./dev test count it skipped, not passed). */
#define KVT_SKIP_STATUS 77
static inline int kvt_skip(const char *why) {
    printf("skip: %s\n0 passed, 0 failed, 1 skipped\n", why);
    return KVT_SKIP_STATUS;
}

#endif
