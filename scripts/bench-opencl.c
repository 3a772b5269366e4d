/*
 * bench-opencl.c — the OpenCL matrix products next to the CPU engine's, in
 * one run: decode GEMV (T = 1, weight GB/s) per weight type, and prefill
 * (T = 128, GFLOP/s) with the tiled kernel and with CLBlast, on the
 * Llama-3.2-1B FFN shape (8192 x 2048) and SmolLM2-135M's (1536 x 576).
 * Not a test: it prints figures.
 *
 *   cmake --build build --target bench-opencl
 *   build/bench-opencl [device=0] [seconds per case=0.5] [types=Q4_0,Q8_0,...]
 *
 * Decode cycles through enough copies of the matrix (>= 128 MiB) that the
 * weights come from memory, as in a forward pass; the launches of one
 * sweep are queued and waited for once. The CPU figures use kv_matmul on
 * all physical cores (KVLUA_SIMD picks its kernels).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvcl_ops.h"
#include "quant.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static kv_error g_err;

static void die(const char *what) {
    fprintf(stderr, "%s: %s\n", what, g_err.msg);
    exit(1);
}

static int type_by_name(const char *s) {
    for (int t = 0; t < KV_TYPE_COUNT; t++) {
        const kv_type_traits *tr = kv_type_traits_get(t);
        if (tr && strcmp(tr->name, s) == 0) return t;
    }
    return -1;
}

/* copies of a random (rows, cols) weight, each on the device and on the host */
typedef struct {
    int n;
    kvcl_weight *dev;
    uint8_t **host;
    size_t bytes; /* of one copy */
} copies;

static copies make_copies(kvcl_ctx *c, int type, int64_t rows, int64_t cols, size_t min_total) {
    copies w = {0};
    w.bytes = kv_row_size(type, cols) * (size_t)rows;
    w.n = min_total > w.bytes ? (int)((min_total + w.bytes - 1) / w.bytes) : 1;
    w.dev = calloc(w.n, sizeof *w.dev);
    w.host = calloc(w.n, sizeof *w.host);
    float *f = malloc(sizeof(float) * cols);
    uint32_t s = 1;
    for (int i = 0; i < w.n; i++) {
        w.host[i] = malloc(w.bytes);
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t k = 0; k < cols; k++) f[k] = (float)((s = s * 1664525u + 1013904223u) >> 8) / (1 << 24) - 0.5f;
            kv_quantize_row(type, f, w.host[i] + r * kv_row_size(type, cols), cols);
        }
        if (kvcl_weight_upload(c, type, rows, cols, w.host[i], &w.dev[i], &g_err) != KV_OK) die("upload");
    }
    free(f);
    return w;
}

static void free_copies(copies *w) {
    for (int i = 0; i < w->n; i++) kvcl_weight_free(&w->dev[i]), free(w->host[i]);
    free(w->dev), free(w->host);
}

/* seconds per product: sweeps over the copies (queued, one wait per sweep) */
static void sweep_device(kvcl_ctx *c, int path, const copies *w, kvcl_buf *x, kvcl_buf *y, int64_t T) {
    for (int i = 0; i < w->n; i++)
        if (kvcl_matmul_with(c, path, &w->dev[i], NULL, kvcl_at(x, 0), T, kvcl_at(y, 0), w->dev[i].rows, &g_err))
            die("matmul");
    if (kvcl_finish(c, &g_err) != KV_OK) die("finish");
}

/* seconds per product: a sweep to warm up, then sweeps for secs */
static double time_device(kvcl_ctx *c, int path, const copies *w, kvcl_buf *x, kvcl_buf *y, int64_t T, double secs) {
    sweep_device(c, path, w, x, y, T);
    int runs = 0;
    const double t0 = now();
    do {
        sweep_device(c, path, w, x, y, T);
        runs += w->n;
    } while (now() - t0 < secs);
    return (now() - t0) / runs;
}

static double time_cpu(kv_pool *pool, const copies *w, int type, int64_t rows, int64_t cols, const float *x, float *y,
                       int64_t T, void *scratch, double secs) {
    int runs = 0;
    double t0 = 0;
    for (int sweep = 0; sweep < 2 || now() - t0 < secs; sweep++) {
        if (sweep == 1) t0 = now(), runs = 0; /* the first sweep warms up */
        for (int i = 0; i < w->n; i++, runs++) kv_matmul(pool, type, w->host[i], rows, cols, x, T, y, rows, scratch);
    }
    return (now() - t0) / runs;
}

static void bench_shape(kvcl_ctx *c, kv_pool *pool, int type, int64_t rows, int64_t cols, double secs) {
    const int64_t TP = 128;
    float *xs = malloc(sizeof(float) * TP * cols), *ys = malloc(sizeof(float) * TP * rows);
    for (int64_t i = 0; i < TP * cols; i++) xs[i] = (float)(i % 13) * 0.05f - 0.3f;
    void *scratch = malloc(kv_matmul_scratch_size(type, cols, TP));
    kvcl_buf *x, *y;
    if (kvcl_buf_create(c, sizeof(float) * TP * cols, 1, &x, &g_err) ||
        kvcl_buf_create(c, sizeof(float) * TP * rows, 1, &y, &g_err) ||
        kvcl_write(c, x, 0, xs, sizeof(float) * TP * cols, &g_err))
        die("buffers");

    copies w = make_copies(c, type, rows, cols, (size_t)128 << 20);
    const double gb = (double)w.bytes * 1e-9, gf = 2.0 * rows * cols * TP * 1e-9;
    const double t_gemv = time_device(c, KVCL_MM_GEMV, &w, x, y, 1, secs);
    const double t_cpu1 = time_cpu(pool, &w, type, rows, cols, xs, ys, 1, scratch, secs);
    free_copies(&w);

    copies one = make_copies(c, type, rows, cols, 0); /* prefill reuses one copy */
    const double t_tiled = time_device(c, KVCL_MM_TILED, &one, x, y, TP, secs);
    double t_blas = 0, first_blas = 0;
    if (kvcl_have_clblast()) {
        const double t0 = now();
        if (kvcl_matmul_with(c, KVCL_MM_CLBLAST, &one.dev[0], NULL, kvcl_at(x, 0), TP, kvcl_at(y, 0), rows, &g_err) ||
            kvcl_finish(c, &g_err))
            die("clblast");
        first_blas = now() - t0;
        t_blas = time_device(c, KVCL_MM_CLBLAST, &one, x, y, TP, secs);
    }
    const double t_cpup = time_cpu(pool, &one, type, rows, cols, xs, ys, TP, scratch, secs);
    free_copies(&one);

    printf("%-5s %5lld x %-5lld | gemv %6.1f GB/s (cpu %6.1f, ratio %.2f) | prefill T=%lld: tiled %6.1f, clblast %6.1f "
           "(first call %.2f s), cpu %6.1f GFLOP/s\n",
           kv_type_traits_get(type)->name, (long long)rows, (long long)cols, gb / t_gemv, gb / t_cpu1, t_cpu1 / t_gemv,
           (long long)TP, gf / t_tiled, t_blas > 0 ? gf / t_blas : 0.0, first_blas, gf / t_cpup);
    fflush(stdout);
    kvcl_buf_free(x), kvcl_buf_free(y);
    free(xs), free(ys), free(scratch);
}

/* microseconds a launch of a one-item kernel costs: queued back to back
 * (one wait for all), and with a wait after each */
static void bench_launch(kvcl_ctx *c) {
    kvcl_buf *b;
    if (kvcl_buf_create(c, sizeof(float), 1, &b, &g_err) || kvcl_write(c, b, 0, &(float){1.0f}, sizeof(float), &g_err))
        die("buffer");
    const int n = 2000;
    double t[2];
    for (int wait = 0; wait < 2; wait++) {
        if (kvcl_scale(c, kvcl_at(b, 0), 1, 1.0f, &g_err) || kvcl_finish(c, &g_err)) die("launch");
        const double t0 = now();
        for (int i = 0; i < n; i++)
            if (kvcl_scale(c, kvcl_at(b, 0), 1, 1.0f, &g_err) || (wait && kvcl_finish(c, &g_err))) die("launch");
        if (kvcl_finish(c, &g_err)) die("finish");
        t[wait] = (now() - t0) / n * 1e6;
    }
    printf("launch: %.1f us queued, %.1f us with a wait after each\n", t[0], t[1]);
    kvcl_buf_free(b);
}

int main(int argc, char **argv) {
    const int device = argc > 1 ? atoi(argv[1]) : 0;
    const double secs = argc > 2 ? atof(argv[2]) : 0.5;
    char types[256];
    snprintf(types, sizeof types, "%s", argc > 3 ? argv[3] : "F16,BF16,Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K");

    kvcl_options o = {.device = device};
    kvcl_ctx *c;
    if (kvcl_open(&o, &c, &g_err) != KV_OK) die("kvcl_open");
    kv_pool *pool;
    if (kv_pool_create(kv_physical_cores(), &pool, &g_err) != KV_OK) die("pool");
    const kvcl_device_info *d = kvcl_ctx_device(c);
    printf("device %d: %s (%s), %s; CPU engine: %s on %d threads\n", device, d->name, d->platform,
           kvcl_ctx_vnni(c) ? "integer kernels with vpdpbusd" : kvcl_ctx_int_dot(c) ? "integer kernels" : "float kernels",
           kv_simd_name(), kv_pool_size(pool));
    bench_launch(c);

    static const int64_t shapes[][2] = {{8192, 2048}, {1536, 576}}; /* Llama-3.2-1B FFN up, SmolLM2-135M FFN up */
    for (int s = 0; s < 2; s++) {
        printf("-- %s\n", s == 0 ? "Llama-3.2-1B (8192 x 2048)" : "SmolLM2-135M (1536 x 576)");
        char list[256];
        snprintf(list, sizeof list, "%s", types);
        for (char *name = strtok(list, ","); name; name = strtok(NULL, ",")) {
            const int t = type_by_name(name);
            if (t < 0 || !kvcl_type_supported(t)) {
                printf("%s: not a supported type\n", name);
                continue;
            }
            if (shapes[s][1] % kv_type_traits_get(t)->blck) continue; /* K-quants need 256 | cols */
            bench_shape(c, pool, t, shapes[s][0], shapes[s][1], secs);
        }
    }
    bool measured;
    double g[2];
    if (kvcl_prefill_choose(c, KV_TYPE_Q8_0, 8192, 2048, 128, &measured, g, &g_err) != KV_OK) die("prefill choice");
    printf("prefill choice on this device (Q8_0 8192 x 2048, T=128): %s%s\n",
           kvcl_prefill_path(c) == KVCL_MM_TILED ? "tiled" : "clblast", measured ? "" : " (read from the cache)");
    kv_pool_destroy(pool);
    kvcl_close(c);
    return 0;
}
