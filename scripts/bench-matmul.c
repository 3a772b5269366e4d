/*
 * bench-matmul.c — what batching can buy on this CPU: kv_matmul's
 * multiply-accumulates per second at T = 1 .. 32 tokens per call (decode is
 * T = 1; a batched decode of N sessions is T = N; prefill is T >= 16), next
 * to the CPU's own ceiling for the int8 dot-product instruction the kernels
 * use (vpdpbusd, 256- and 512-bit, timed in a loop of independent
 * accumulators), in one run. Not a test: it prints figures.
 *
 *   cmake --build build --target bench-matmul
 *   build/bench-matmul [threads=physical cores] [seconds per case=0.4] [types=Q4_1,Q8_0]
 *
 * Shapes: SmolLM2-135M's FFN (1536 x 576) and Gemma 3's output matrix
 * (262144 x 640, ~180 MB in Q8_0: read from memory at every call). With T
 * tokens a call reads the weights once, so tokens/s can grow with T until
 * the kernel is compute bound; the ratio "T tok/s over T = 1 tok/s" is the
 * most a batched decode of T sessions gains over one session in the
 * matrix products.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "quant.h"
#include "threadpool.h"
#include "types.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

#if defined(__x86_64__)
/* vpdpbusd throughput of one core: 8 independent accumulators */
__attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni"))) static void vnni_peak(double secs) {
    __m256i a[8];
    __m512i z[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_set1_epi32(i), z[i] = _mm512_set1_epi32(i);
    __m256i x = _mm256_set1_epi8(3), w = _mm256_set1_epi8(5);
    __m512i X = _mm512_set1_epi8(3), W = _mm512_set1_epi8(5);
    long n = 0;
    double t0 = now(), t;
    do {
        for (int k = 0; k < 1000; k++) {
            for (int i = 0; i < 8; i++) a[i] = _mm256_dpbusd_epi32(a[i], x, w);
            __asm__ volatile("" : "+x"(x), "+x"(w));
        }
        n += 1000;
    } while ((t = now() - t0) < secs);
    const double ymm = (double)n * 8 * 32 / t;
    n = 0, t0 = now();
    do {
        for (int k = 0; k < 1000; k++) {
            for (int i = 0; i < 8; i++) z[i] = _mm512_dpbusd_epi32(z[i], X, W);
            __asm__ volatile("" : "+v"(X), "+v"(W));
        }
        n += 1000;
    } while ((t = now() - t0) < secs);
    const double zmm = (double)n * 8 * 64 / t;
    int sink = 0;
    for (int i = 0; i < 8; i++) sink += _mm256_extract_epi32(a[i], 0) + _mm_cvtsi128_si32(_mm512_castsi512_si128(z[i]));
    printf("vpdpbusd ceiling, one core: 256-bit %.1f GMAC/s, 512-bit %.1f GMAC/s (%d)\n", ymm * 1e-9, zmm * 1e-9,
           sink & 1);
}
#endif

static int type_of(const char *name) {
    static const struct { const char *n; int t; } k[] = {{"Q4_0", KV_TYPE_Q4_0}, {"Q4_1", KV_TYPE_Q4_1},
                                                        {"Q5_0", KV_TYPE_Q5_0}, {"Q8_0", KV_TYPE_Q8_0},
                                                        {"Q4_K", KV_TYPE_Q4_K}, {"Q6_K", KV_TYPE_Q6_K}};
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
        if (strcmp(k[i].n, name) == 0) return k[i].t;
    return -1;
}

static void bench(kv_pool *pool, const char *tname, int type, int64_t rows, int64_t K, double secs) {
    const size_t rs = kv_row_size(type, K);
    uint8_t *W = malloc(rs * (size_t)rows);
    float *tmp = malloc(sizeof(float) * (size_t)K);
    float *x = malloc(sizeof(float) * (size_t)K * 32), *y = malloc(sizeof(float) * (size_t)rows * 32);
    void *scratch = malloc(kv_matmul_scratch_size(type, K, 32) + 64);
    if (!W || !tmp || !x || !y || !scratch) {
        printf("%s %lld x %lld: out of memory\n", tname, (long long)rows, (long long)K);
        free(W), free(tmp), free(x), free(y), free(scratch);
        return;
    }
    uint32_t s = 12345;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t k = 0; k < K; k++) s = s * 1664525u + 1013904223u, tmp[k] = (float)(s >> 8) / 16777216.0f - 0.5f;
        kv_quantize_row(type, tmp, W + (size_t)r * rs, K);
    }
    for (int64_t i = 0; i < K * 32; i++) s = s * 1664525u + 1013904223u, x[i] = (float)(s >> 8) / 16777216.0f - 0.5f;
    printf("%s %lld x %lld (%.1f MB)\n", tname, (long long)rows, (long long)K, (double)rs * rows / 1e6);
    double base = 0;
    const int Ts[] = {1, 2, 4, 8, 16, 32};
    for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++) {
        const int T = Ts[i];
        kv_matmul(pool, type, W, rows, K, x, T, y, rows, scratch); /* warm */
        int reps = 0;
        double t0 = now(), t;
        do kv_matmul(pool, type, W, rows, K, x, T, y, rows, scratch), reps++;
        while ((t = now() - t0) < secs);
        const double per = t / reps, tps = T / per;
        if (T == 1) base = tps;
        printf("  T %2d: %9.1f us/call  %8.1f tok/s  %6.1f GMAC/s  %5.1f GB/s of weights  %5.2fx T=1's tok/s\n", T,
               per * 1e6, tps, (double)rows * K * T / per * 1e-9, (double)rs * rows / per * 1e-9, tps / base);
    }
    free(W), free(tmp), free(x), free(y), free(scratch);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 0;
    double secs = argc > 2 ? atof(argv[2]) : 0.4;
    char types[256] = "Q4_1,Q8_0";
    if (argc > 3) snprintf(types, sizeof types, "%s", argv[3]);
    if (threads <= 0) threads = kv_physical_cores();
    kv_pool *pool = NULL;
    kv_error e;
    if (kv_pool_create(threads, &pool, &e) != KV_OK) {
        fprintf(stderr, "bench-matmul: %s\n", e.msg);
        return 1;
    }
    printf("kv_matmul (%s kernels), %d threads\n", kv_simd_name(), threads);
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512vnni")) vnni_peak(secs);
#endif
    for (char *tok = strtok(types, ","); tok; tok = strtok(NULL, ",")) {
        const int t = type_of(tok);
        if (t < 0) {
            fprintf(stderr, "bench-matmul: unknown type %s\n", tok);
            continue;
        }
        bench(pool, tok, t, 1536, 576, secs);
        bench(pool, tok, t, 262144, 640, secs);
    }
    kv_pool_destroy(pool);
    return 0;
}
