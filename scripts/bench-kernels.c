/*
 * bench-kernels.c — microbenchmark of kv_matmul on SmolLM2-135M,
 * Llama-3.2-1B and Gemma-3-270M matrix shapes: decode (T=1, weight GB/s)
 * and prefill (T=64/128/512, GFLOP/s). Not a test: it prints figures.
 *
 *   cmake --build build --target bench-kernels
 *   build/bench-kernels [type=Q4_0] [threads=physical cores] [seconds per case=0.3]
 *
 * Decode cycles through enough copies of each matrix (>= 128 MiB) that the
 * weights come from memory, as in a real forward pass; KVLUA_SIMD=scalar
 * measures the portable path; BENCH_HOT=1 reuses one copy (cache-hot),
 * BENCH_COLD=1 cycles through the copies at every T (weights from memory).
 * BENCH_T=1,64 picks the token counts, BENCH_MODEL=gemma3 the shapes of
 * one model, BENCH_ROWS=640 those with that many rows. Matrices over 64M
 * weights (Gemma 3's 262144 x 640 output) are
 * timed at T <= 32 only (decode and batched decode). On CPUs with
 * AVX512-VNNI it first times the int8 dot-product instruction the kernels
 * use (vpdpbusd, 256- and 512-bit, one core): the ceiling of the
 * compute-bound cases (prefill, and batched decode: BENCH_T=1,8).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "quant.h"
#include "threadpool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* BENCH_CPUTIME=1: process CPU time instead of wall time (a busy shared
 * machine; meaningful with 1 thread, where nothing spins). */
static clockid_t g_clock = CLOCK_MONOTONIC;

static double now(void) {
    struct timespec t;
    clock_gettime(g_clock, &t);
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

static int type_by_name(const char *s) {
    for (int t = 0; t < KV_TYPE_COUNT; t++) {
        const kv_type_traits *tr = kv_type_traits_get(t);
        if (tr && strcmp(tr->name, s) == 0) return t;
    }
    return -1;
}

int main(int argc, char **argv) {
    int wt = type_by_name(argc > 1 ? argv[1] : "Q4_0");
    int nth = argc > 2 ? atoi(argv[2]) : kv_physical_cores();
    double secs = argc > 3 ? atof(argv[3]) : 0.3;
    if (getenv("BENCH_CPUTIME")) g_clock = CLOCK_PROCESS_CPUTIME_ID;
    if (wt < 0 || kv_vec_dot_type(wt) < 0) {
        fprintf(stderr, "unsupported type %s\n", argv[1]);
        return 1;
    }
    kv_pool *pool;
    kv_error e;
    if (kv_pool_create(nth, &pool, &e) != KV_OK) {
        fprintf(stderr, "%s\n", e.msg);
        return 1;
    }
    static const struct { const char *model; int64_t rows, K; } shapes[] = {
        {"smollm2", 576, 576},   {"smollm2", 192, 576},   {"smollm2", 1536, 576},
        {"smollm2", 576, 1536},  {"smollm2", 49152, 576}, {"llama1b", 2048, 2048},
        {"llama1b", 512, 2048},  {"llama1b", 8192, 2048}, {"llama1b", 2048, 8192},
        {"gemma3", 1024, 640},   {"gemma3", 2048, 640},   {"gemma3", 640, 1024},
        {"gemma3", 640, 2048},   {"gemma3", 262144, 640},
    };
    int Ts[8] = {1, 64, 128, 512}, nT = 4;
    if (getenv("BENCH_T")) {
        nT = 0;
        for (char *p = getenv("BENCH_T"); *p && nT < 8; p += strspn(p, ","))
            Ts[nT++] = (int)strtol(p, &p, 10);
    }
    const char *only = getenv("BENCH_MODEL"), *only_rows = getenv("BENCH_ROWS");
    printf("type %s, %d threads, simd %s\n", kv_type_traits_get(wt)->name, nth, kv_simd_name());
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512vnni")) vnni_peak(secs);
#endif
    printf("%-8s %6s %6s %5s %10s %9s %10s\n", "model", "rows", "K", "T", "us/call", "GB/s", "GFLOP/s");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t rows = shapes[s].rows, K = shapes[s].K;
        if (K % kv_type_traits_get(wt)->blck || (only && strcmp(only, shapes[s].model) != 0) ||
            (only_rows && atol(only_rows) != rows))
            continue;
        size_t wbytes = kv_row_size(wt, K) * (size_t)rows;
        int ncopies = (int)((128u << 20) / wbytes) + 1;
        uint8_t *W = malloc(wbytes * ncopies);
        float *src = malloc((size_t)K * 4);
        if (!W || !src) return 1;
        srand(1);
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t k = 0; k < K; k++) src[k] = (float)rand() / RAND_MAX - 0.5f;
            kv_quantize_row(wt, src, W + r * kv_row_size(wt, K), K);
        }
        for (int c = 1; c < ncopies; c++) memcpy(W + c * wbytes, W, wbytes);
        for (int ti = 0; ti < nT; ti++) {
            int64_t T = Ts[ti];
            if (T < 1 || (T > 32 && rows * K > (1 << 26))) continue;
            float *x = malloc((size_t)(T * K) * 4), *y = malloc((size_t)(T * rows) * 4);
            void *scratch = malloc(kv_matmul_scratch_size(wt, K, T));
            for (int64_t i = 0; i < T * K; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
            int copies = ((T == 1 || getenv("BENCH_COLD")) && !getenv("BENCH_HOT")) ? ncopies : 1;
            kv_matmul(pool, wt, W, rows, K, x, T, y, rows, scratch); /* warm up */
            long n = 0;
            double t0 = now(), t1;
            do {
                kv_matmul(pool, wt, W + (n % copies) * wbytes, rows, K, x, T, y, rows, scratch);
                n++;
                t1 = now();
            } while (t1 - t0 < secs);
            double per = (t1 - t0) / n;
            printf("%-8s %6ld %6ld %5ld %10.1f %9.2f %10.2f\n", shapes[s].model, (long)rows, (long)K,
                   (long)T, per * 1e6, wbytes / per / 1e9, 2.0 * rows * K * T / per / 1e9);
            fflush(stdout);
            free(x), free(y), free(scratch);
        }
        free(W), free(src);
    }
    kv_pool_destroy(pool);
    return 0;
}
