/*
 * test_opencl.c — every OpenCL kernel (opencl/) against the engine's scalar
 * CPU path (KVLUA_SIMD=scalar is set before the engine starts):
 *
 *   - the device layer: program build, the binary cache (second open reads
 *     it; corrupt entries are rebuilt), build errors with their log, bad
 *     device index, buffers split over parts, more memory than the device
 *     has, a failed launch marking the context unusable, the prefill path
 *     choice kept on disk;
 *   - embedding / dequantization of every weight type: bit-identical to
 *     kv_dequantize_row;
 *   - matrix products (GEMV row and work-group flavours, the tiled prefill
 *     kernel, CLBlast) against float64 products of the dequantized rows,
 *     within the float rounding bound of each kernel's summation, and
 *     against kv_matmul within the bound of its 8-bit activations;
 *   - RMSNorm, RoPE, add, scale, soft cap, FFN activations against the CPU
 *     backend (backend_cpu.c);
 *   - K/V page writes: bytes as the CPU encodes rows; attention through a
 *     shuffled page table against a float64 softmax with the CPU's q
 *     rounding, and against the CPU backend on a contiguous cache.
 *
 * Shapes are odd on purpose: sizes that are not multiples of work-group
 * sizes, head sizes 64/128/256, contexts that are not page multiples, T = 1
 * and T > 1, sliding windows, GQA ratios 1/3/4. Skips (exit 77, "skip:")
 * when the machine has no OpenCL device.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "kvcache.h"
#include "kvcl.h"
#include "quant.h"

#include "check.h"

#ifndef KV_HAVE_OPENCL
int main(void) { return kvt_skip("built without OpenCL"); }
#else

#include "kvcl_internal.h" /* the failed-launch test drives a kernel directly, the memory test sets a reported size */
#include "kvcl_ops.h"

/* ==== helpers ================================================================== */

static uint64_t g_rng = 0x2545F4914F6CDD1Dull;
static uint32_t rnd(void) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 16);
}
static float frand(void) { return (float)rnd() / 4294967296.0f * 2.0f - 1.0f; } /* [-1, 1) */
static int irand(int n) { return (int)(rnd() % (uint32_t)n); }

static void *xmalloc(size_t n) {
    void *p = calloc(1, n ? n : 1);
    if (!p) {
        printf("out of memory\n");
        exit(2);
    }
    return p;
}

static const char *tname(int t) { return kv_type_traits_get(t)->name; }

static const int k_wtypes[] = {KV_TYPE_F32,  KV_TYPE_F16,  KV_TYPE_BF16, KV_TYPE_Q4_0, KV_TYPE_Q4_1, KV_TYPE_Q5_0,
                               KV_TYPE_Q5_1, KV_TYPE_Q8_0, KV_TYPE_Q4_K, KV_TYPE_Q5_K, KV_TYPE_Q6_K};
#define N_WTYPES (int)(sizeof k_wtypes / sizeof k_wtypes[0])

static kv_error g_err;
static kvcl_ctx *g_c;       /* the context most tests use */
static kv_backend g_cpu;    /* the CPU reference (scalar kernels) */
static kv_pool *g_pool;

/* a device buffer holding bytes (NULL: uninitialized) */
static kvcl_buf *dev_buf(kvcl_ctx *c, const void *bytes, size_t n) {
    kvcl_buf *b = NULL;
    if (kvcl_buf_create(c, n, 1, &b, &g_err) != KV_OK || (bytes && kvcl_write(c, b, 0, bytes, n, &g_err) != KV_OK)) {
        printf("device buffer of %zu bytes: %s\n", n, g_err.msg);
        exit(2);
    }
    return b;
}

static kvcl_buf *dev_floats(kvcl_ctx *c, const float *x, size_t n) { return dev_buf(c, x, n * sizeof(float)); }

/* reads n floats at element offset off */
static void get_floats(kvcl_ctx *c, kvcl_buf *b, size_t off, float *out, size_t n) {
    if (kvcl_read(c, b, off * sizeof(float), out, n * sizeof(float), &g_err) != KV_OK) {
        printf("read: %s\n", g_err.msg);
        exit(2);
    }
}

/* rows x cols random values of a type (quantized from floats in [-1, 1)
 * scaled per row), the bytes in *bytes, dequantized in *deq */
static void random_weight(int type, int64_t rows, int64_t cols, uint8_t **bytes, float **deq) {
    const size_t rb = kv_row_size(type, cols);
    float *f = xmalloc(sizeof(float) * cols);
    *bytes = xmalloc(rb * rows);
    *deq = xmalloc(sizeof(float) * rows * cols);
    for (int64_t r = 0; r < rows; r++) {
        const float s = 0.5f + (float)irand(100) / 50.0f;
        for (int64_t i = 0; i < cols; i++) f[i] = frand() * s;
        kv_quantize_row(type, f, *bytes + r * rb, cols);
        kv_dequantize_row(type, *bytes + r * rb, *deq + r * cols, cols);
    }
    free(f);
}

static kvcl_ctx *open_ctx(const kvcl_options *o) {
    kvcl_ctx *c = NULL;
    if (kvcl_open(o, &c, &g_err) != KV_OK) {
        printf("kvcl_open: %s\n", g_err.msg);
        exit(2);
    }
    return c;
}

/* ==== device layer ================================================================ */

static char g_cache[256]; /* a fresh cache directory */

static int cache_files(char names[][512], int max) {
    int n = 0;
    char cmd[400];
    snprintf(cmd, sizeof cmd, "ls %s/*.bin 2>/dev/null", g_cache);
    FILE *p = popen(cmd, "r");
    while (p && n < max && fgets(names[n], 512, p)) names[n][strcspn(names[n], "\n")] = 0, n++;
    if (p) pclose(p);
    return n;
}

static void test_program_cache(void) {
    kvcl_options o = {.cache_dir = g_cache};
    kvcl_ctx *c = open_ctx(&o);
    report(!kvcl_ctx_from_cache(c), "first open builds from source", "from cache");
    kvcl_close(c);
    c = open_ctx(&o);
    report(kvcl_ctx_from_cache(c), "second open loads the cached binary (no build)", "rebuilt");
    kvcl_close(c);

    char files[4][512];
    int n = cache_files(files, 4);
    report(n == 1, "one cache file", "%d files", n);
    if (n != 1) return;
    /* corrupt the payload, then truncate it: each time rebuilt, then cached again */
    FILE *f = fopen(files[0], "r+b");
    fseek(f, 200, SEEK_SET);
    int ch = fgetc(f);
    fseek(f, 200, SEEK_SET);
    fputc(ch ^ 0x5A, f);
    fclose(f);
    c = open_ctx(&o);
    report(!kvcl_ctx_from_cache(c), "corrupt cache entry: rebuilt from source", "used the corrupt binary");
    kvcl_close(c);
    c = open_ctx(&o);
    report(kvcl_ctx_from_cache(c), "rebuilt entry cached again", "rebuilt");
    kvcl_close(c);
    if (truncate(files[0], 50) != 0) printf("truncate failed\n");
    c = open_ctx(&o);
    report(!kvcl_ctx_from_cache(c), "truncated cache entry: rebuilt from source", "used it");
    kvcl_close(c);

    /* other build options are another key */
    o.portable = true;
    c = open_ctx(&o);
    report(!kvcl_ctx_from_cache(c), "other build options: another cache entry", "shared the entry");
    kvcl_close(c);
}

static void test_open_errors(void) {
    printf("     (a driver may print the build error of the next case itself)\n");
    kvcl_ctx *c = (kvcl_ctx *)1;
    kvcl_options o = {.cache_dir = "", .extra_source = "kernel void broken(global float *x) { x[0] = undeclared; }"};
    kv_status st = kvcl_open(&o, &c, &g_err);
    report(st == KV_ERR_DEVICE && !c && strstr(g_err.msg, "build failed") && strstr(g_err.msg, "undeclared"),
           "build error: KV_ERR_DEVICE with the build log", "status %d: %s", st, g_err.msg);
    /* a compiler that refuses the kernels with vpdpbusd: built again without it */
    o = (kvcl_options){.cache_dir = "", .extra_source = "#ifdef KVCL_VNNI\n#error no vpdpbusd here\n#endif\n"};
    st = kvcl_open(&o, &c, &g_err);
    report(st == KV_OK && c && !kvcl_ctx_vnni(c),
           "a build that fails with vpdpbusd: the kernels without it", "status %d: %s", st, st ? g_err.msg : "");
    if (st == KV_OK) kvcl_close(c);
    o = (kvcl_options){.device = 99};
    st = kvcl_open(&o, &c, &g_err);
    report(st == KV_ERR_ARG && !c && strstr(g_err.msg, "no OpenCL device 99"), "device index out of range",
           "status %d: %s", st, g_err.msg);
}

/* a kernel source's text from its first directive on: comments and blank
 * space before it skipped */
static const char *first_directive(const char *t) {
    for (;;) {
        while (*t == ' ' || *t == '\n' || *t == '\t' || *t == '\r') t++;
        if (t[0] == '/' && t[1] == '*') {
            const char *end = strstr(t + 2, "*/");
            if (!end) return t;
            t = end + 2;
        } else if (t[0] == '/' && t[1] == '/') {
            t += strcspn(t, "\n");
        } else {
            return t;
        }
    }
}

/* Contraction off in every kernel source: its first directive, never turned
 * on again. Kernels that must agree in bits (rope and rope_qk, GEMV and the
 * tiled prefill, attention and attention_row) may not depend on whether a
 * compiler contracts a * b + c at each place it inlines a helper; where an
 * fma is wanted the kernels write fma(). And the compiler honours it: with
 * a = b = 1 + 2^-12 and c = -(1 + 2^-11), a * b + c is 0 unfused and 2^-24
 * fused (the options' extra source comes after the last file, under its
 * pragma). */
static void test_contraction_off(void) {
    for (int i = 0; i < kvcl_kernel_count; i++) {
        const kvcl_source *f = &kvcl_kernel_sources[i];
        const char *pragma = "#pragma OPENCL FP_CONTRACT OFF";
        const bool first = strncmp(first_directive(f->text), pragma, strlen(pragma)) == 0;
        const bool on = strstr(f->text, "FP_CONTRACT ON") || strstr(f->text, "FP_CONTRACT DEFAULT");
        char name[160];
        snprintf(name, sizeof name, "%s: FP_CONTRACT OFF at the top, never on", f->name);
        report(first && !on, name, "first directive the pragma: %d, turned on: %d", first, on);
    }
    kvcl_options o = {.cache_dir = "",
                      .extra_source = "kernel void contract_probe(global float *o, float a, float b, float c) {\n"
                                      "    o[0] = a * b + c;\n}\n"};
    kvcl_ctx *c = open_ctx(&o);
    kvcl_buf *b = dev_buf(c, NULL, sizeof(float));
    cl_mem m = NULL;
    const float a = 1.0f + 0x1p-12f, x = -(1.0f + 0x1p-11f);
    float got = -1.0f;
    cl_int err = CL_SUCCESS;
    cl_kernel k = clCreateKernel(c->prog, "contract_probe", &err);
    if (err == CL_SUCCESS && kvcl_buf_single(b, "probe", &m, &g_err) == KV_OK) {
        size_t g = 1;
        clSetKernelArg(k, 0, sizeof m, &m), clSetKernelArg(k, 1, sizeof a, &a), clSetKernelArg(k, 2, sizeof a, &a);
        clSetKernelArg(k, 3, sizeof x, &x);
        err = clEnqueueNDRangeKernel(c->q, k, 1, NULL, &g, NULL, 0, NULL, NULL);
        if (err == CL_SUCCESS) get_floats(c, b, 0, &got, 1);
    }
    if (k) clReleaseKernel(k);
    report(err == CL_SUCCESS && got == 0.0f, "a * b + c after the kernels: not contracted", "error %d, %a (fused: 0x1p-24)",
           (int)err, got);
    kvcl_buf_free(b);
    kvcl_close(c);
}

static void test_failed_launch(void) {
    kvcl_options o = {.cache_dir = g_cache};
    kvcl_ctx *c = open_ctx(&o);
    kvcl_buf *b = dev_buf(c, NULL, 1024);
    /* a kernel launched without its arguments: the driver refuses it */
    kvcl_launch L = kvcl_launch_begin(c, c->add);
    size_t g = 64, l = 64;
    kv_status st = kvcl_launch_run(&L, 1, &g, &l, "add", &g_err);
    char first[KV_ERROR_MAX];
    snprintf(first, sizeof first, "%s", g_err.msg);
    report(st != KV_OK && strstr(first, "unusable"), "failed launch: error with a message", "%d: %s", st, first);
    st = kvcl_scale(c, kvcl_at(b, 0), 16, 2.0f, &g_err);
    report(st != KV_OK && strcmp(g_err.msg, first) == 0, "later ops return the first failure", "%d: %s", st,
           g_err.msg);
    st = kvcl_finish(c, &g_err);
    report(st != KV_OK && strcmp(g_err.msg, first) == 0, "and so does a wait", "%d", st);
    kvcl_buf_free(b);
    kvcl_close(c);
    report(true, "closing a failed context", " ");
}

/* More than the device holds: refused up front (drivers that allocate
 * lazily would fail at first use, or overcommit), the context still works.
 * The sizes hold for any memory the device reports: the large buffer is
 * the first whole number of 4096-byte units past it (PoCL on one machine
 * reported a size that is not whole units, and memory + 4096 was refused
 * as "not whole units" before its size was looked at). */
static void test_out_of_memory(kvcl_ctx *c, const char *label) {
    const uint64_t mem = kvcl_ctx_device(c)->memory;
    kvcl_buf *big = (kvcl_buf *)1, *half = NULL;
    char name[160];
    kv_status st = kvcl_buf_create(c, (size_t)((mem / 4096 + 1) * 4096), 4096, &big, &g_err);
    snprintf(name, sizeof name, "buffer larger than the device%s: KV_ERR_NOMEM", label);
    report(st == KV_ERR_NOMEM && !big && strstr(g_err.msg, "exceed"), name, "%d: %s", st, g_err.msg);
    st = kvcl_buf_create(c, (size_t)(mem / 2 + 4096), 1, &half, &g_err);
    kvcl_buf *other = NULL;
    kv_status st2 = st == KV_OK ? kvcl_buf_create(c, (size_t)(mem / 2 + 4096), 1, &other, &g_err) : st;
    snprintf(name, sizeof name, "two halves and a bit%s: the second refused", label);
    report(st == KV_OK && st2 == KV_ERR_NOMEM && !other, name, "%d %d: %s", st, st2, g_err.msg);
    kvcl_buf_free(half);
    float one = 1.0f, back = 0.0f;
    kvcl_buf *b = dev_floats(c, &one, 1);
    st = kvcl_scale(c, kvcl_at(b, 0), 1, 3.0f, &g_err);
    if (st == KV_OK) get_floats(c, b, 0, &back, 1);
    snprintf(name, sizeof name, "the context works after refusals%s", label);
    report(st == KV_OK && back == 3.0f, name, "%d %g", st, back);
    kvcl_buf_free(b);
}

/* test_out_of_memory on a context whose device reports memory that is not
 * whole 4096-byte units (and less than it has: the refusals are real) */
static void test_out_of_memory_odd(void) {
    kvcl_options o = {.cache_dir = g_cache};
    kvcl_ctx *c = open_ctx(&o);
    c->info.memory = c->info.memory / 4096 * 4096 - 1000;
    test_out_of_memory(c, " (reported memory 4096 k - 1000)");
    kvcl_close(c);
}

/* The prefill path measured once, then read back from the cache directory
 * (which path wins is the device's business: not asserted). */
static void test_prefill_choice(void) {
    kvcl_options o = {.cache_dir = g_cache};
    kvcl_ctx *c = open_ctx(&o);
    bool measured = false, again = true;
    double g[2];
    kv_status st = kvcl_prefill_choose(c, KV_TYPE_Q8_0, 256, 256, 16, &measured, g, &g_err);
    const int first = kvcl_prefill_path(c);
    report(st == KV_OK && measured && g[0] > 0 && (g[1] > 0) == kvcl_have_clblast(),
           "prefill choice: both paths timed the first time", "%d: %s", st, st ? g_err.msg : "");
    printf("     (tiled %.1f, clblast %.1f GFLOP/s: %s)\n", g[0], g[1], first == KVCL_MM_TILED ? "tiled" : "clblast");
    kvcl_close(c);
    c = open_ctx(&o);
    st = kvcl_prefill_choose(c, KV_TYPE_Q8_0, 256, 256, 16, &again, g, &g_err);
    report(st == KV_OK && !again && kvcl_prefill_path(c) == first, "prefill choice: read back, not timed again",
           "%d measured %d", st, again);
    kvcl_close(c);
}

/* ==== embedding / dequantization ===================================================== */

/* rows ids of a (rows, cols) table of every type, bit for bit */
/* rows ids[0 .. n) of w looked up on the device (kvcl_embed, into a view
 * at offset 5) against the same rows of deq: how many differ in their
 * bits; *st the lookup's status */
static int embed_rows_differ(kvcl_ctx *c, const kvcl_weight *w, const int32_t *ids, int n, const float *deq,
                             kv_status *st) {
    const int64_t cols = w->cols;
    kvcl_buf *ib = dev_buf(c, ids, sizeof(int32_t) * n), *out = dev_buf(c, NULL, sizeof(float) * (n * cols + 5));
    float *got = xmalloc(sizeof(float) * n * cols);
    *st = kvcl_embed(c, w, ib, n, kvcl_at(out, 5), &g_err);
    if (*st == KV_OK) get_floats(c, out, 5, got, n * cols);
    int bad = 0;
    for (int t = 0; *st == KV_OK && t < n; t++) bad += memcmp(got + t * cols, deq + ids[t] * cols, sizeof(float) * cols) != 0;
    kvcl_buf_free(ib), kvcl_buf_free(out);
    free(got);
    return bad;
}

static void test_embed_on(kvcl_ctx *c, const char *label) {
    for (int wi = 0; wi < N_WTYPES; wi++) {
        const int type = k_wtypes[wi];
        const int blk = kv_type_traits_get(type)->blck;
        /* the output (T, cols) must fit one part of the split context */
        const int max_blocks = kvcl_ctx_device(c)->max_alloc < (64 << 10) ? 1024 / blk : 2304 / blk;
        const int64_t cols = blk == 1 ? 67 + irand(200) : blk * (1 + irand(max_blocks)), rows = 50 + irand(300), T = 7;
        uint8_t *bytes;
        float *deq;
        random_weight(type, rows, cols, &bytes, &deq);
        kvcl_weight w;
        kv_status st = kvcl_weight_upload(c, type, rows, cols, bytes, &w, &g_err);
        int32_t ids[7] = {0, (int32_t)rows - 1, 3, 3, irand(rows), irand(rows), irand(rows)};
        const int bad = st == KV_OK ? embed_rows_differ(c, &w, ids, T, deq, &st) : 0;
        char name[160];
        snprintf(name, sizeof name, "embed %s %s (%lld x %lld, %d parts): bit-identical to kv_dequantize_row", label,
                 tname(type), (long long)rows, (long long)cols, w.buf ? kvcl_buf_parts(w.buf) : 0);
        report(st == KV_OK && bad == 0, name, "%s; %d rows differ", st ? g_err.msg : "", bad);
        kvcl_weight_free(&w);
        free(bytes), free(deq);
    }
}

/* ==== matrix products ============================================================== */

#define U_F32 (FLT_EPSILON / 2) /* unit roundoff of float */

/* y(T, rows) = x W^T (+ bias) in float64, and mag = sum |w x| (+ |bias|):
 * the scale of each output's rounding error */
static void ref_matmul(const float *W, int64_t rows, int64_t cols, const float *x, int64_t T, const float *bias,
                       double *y, double *mag) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < rows; r++) {
            double s = bias ? bias[r] : 0.0, m = bias ? fabs(bias[r]) : 0.0;
            for (int64_t i = 0; i < cols; i++) {
                s += (double)W[r * cols + i] * x[t * cols + i];
                m += fabs((double)W[r * cols + i] * x[t * cols + i]);
            }
            y[t * rows + r] = s, mag[t * rows + r] = m;
        }
}

/* Rounding bound of a path, as a multiple of mag: gamma(n) = n u for the
 * longest chain of additions an output goes through. Our kernels: 16 lane
 * sums of cols / 16 products, a 16-lane sum (4), the float tail (< 32),
 * the bias (1), and for the work-group GEMV a 64-item tree (6); the weights
 * are exact (dequantized as kv_dequantize_row). CLBlast's order is its own:
 * the bound of any order, cols + 1 additions. */
static double path_gamma(int path, int64_t cols) {
    const double n = path == KVCL_MM_CLBLAST ? (double)cols + 1 : (double)cols / 16 + 4 + 32 + 1 + 6;
    return n * U_F32;
}

static const char *path_name(const kvcl_ctx *c, int path) {
    if (path == KVCL_MM_GEMV) return c->gemv == KVCL_GEMV_GROUP ? "gemv-group" : "gemv-row";
    return path == KVCL_MM_TILED ? "tiled" : "clblast";
}

typedef struct {
    int path, type;
    int64_t rows, cols, T;
    bool bias;
    int64_t pad; /* ldy = rows + pad, and view offsets */
} mm_case;

/* whether c computes this product with integer dot products (matmul_i8.cl) */
static bool int_case(const kvcl_ctx *c, const mm_case *k) {
    return kvcl_ctx_int_dot(c) && k->path != KVCL_MM_CLBLAST &&
           (k->type == KV_TYPE_Q4_0 || k->type == KV_TYPE_Q4_1 || k->type == KV_TYPE_Q5_0 || k->type == KV_TYPE_Q5_1 ||
            k->type == KV_TYPE_Q8_0 || k->type == KV_TYPE_Q4_K || k->type == KV_TYPE_Q5_K);
}

/* Block b (32 elements) of a weight row taken apart as the integer
 * kernels see it: the quants q (unsigned for the 4/5-bit formats), the
 * scale d and the coefficient off of the block's sum of x (Q4_0 -8 d,
 * Q5_0 -16 d, Q4_1 / Q5_1 m, Q4_K / Q5_K -dmin m: sub-block b % 8 of
 * super-block b / 8, d sc and dmin m as float products) */
static void i8_block(int type, const uint8_t *row, int64_t b, double *d, double *off, int q[32]) {
    uint16_t h;
    if (type == KV_TYPE_Q4_K || type == KV_TYPE_Q5_K) {
        const bool five = type == KV_TYPE_Q5_K;
        const uint8_t *sb = row + (b / 8) * (five ? 176 : 144), *s = sb + 4, *qs = sb + (five ? 48 : 16);
        const int j = (int)(b % 8);
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        memcpy(&h, sb, 2);
        *d = (float)(kv_f16_to_f32(h) * (float)sc);
        memcpy(&h, sb + 2, 2);
        *off = -(double)(float)(kv_f16_to_f32(h) * (float)mn);
        for (int i = 0; i < 32; i++)
            q[i] = ((qs[32 * (j / 2) + i] >> 4 * (j % 2)) & 15) | (five ? ((sb[16 + i] >> j) & 1) << 4 : 0);
        return;
    }
    const size_t bb = kv_type_traits_get(type)->type_size;
    const uint8_t *blk = row + b * bb;
    memcpy(&h, blk, 2);
    *d = kv_f16_to_f32(h);
    const bool q5 = type == KV_TYPE_Q5_0 || type == KV_TYPE_Q5_1, min = type == KV_TYPE_Q4_1 || type == KV_TYPE_Q5_1;
    *off = type == KV_TYPE_Q4_0 ? -8.0 * *d : type == KV_TYPE_Q5_0 ? -16.0 * *d : 0.0;
    if (min) memcpy(&h, blk + 2, 2), *off = kv_f16_to_f32(h);
    const uint8_t *nib = blk + bb - 16; /* the nibbles end the block, after Q5's 32 fifth bits */
    uint32_t qh = 0;
    if (q5) memcpy(&qh, nib - 4, 4);
    for (int i = 0; i < 32; i++) {
        q[i] = type == KV_TYPE_Q8_0 ? (int8_t)blk[2 + i] : i < 16 ? nib[i] & 15 : nib[i - 16] >> 4;
        if (q5) q[i] |= (int)((qh >> i) & 1) << 4;
    }
}

/* The integer path's exact result in float64 (and its magnitude): x
 * quantized as quant_x does it (per 32: d = amax / 127, q = rint(x / d)
 * through 1 / d, d rounded to f16), each weight block taken apart into d,
 * quants and offset (Q4_0: -8 d, Q5_0: -16 d) or min (Q4_1, Q5_1); y = sum over blocks of
 * d dx sum(qw qx) + (offset or min) dx sum(qx). The device's float steps
 * (the scale products, the fma chains over groups of 8 blocks, the lane and
 * correction sums) stay within gamma(cols / 32 + 16) of mag. */
static void ref_matmul_i8(int type, const uint8_t *bytes, int64_t rows, int64_t cols, const float *x, int64_t T,
                          const float *bias, double *y, double *mag) {
    const size_t rb = kv_row_size(type, cols);
    const int64_t nb = cols / 32;
    int *qx = xmalloc(sizeof(int) * cols);
    double *dx = xmalloc(sizeof(double) * nb);
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * cols;
        for (int64_t b = 0; b < nb; b++) {
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xt[32 * b + i]));
            const float d = amax / 127, id = d != 0.0f ? 1.0f / d : 0.0f;
            for (int i = 0; i < 32; i++) qx[32 * b + i] = (int)rintf(xt[32 * b + i] * id);
            dx[b] = kv_f16_to_f32(kv_f32_to_f16(d));
        }
        for (int64_t r = 0; r < rows; r++) {
            double s = bias ? bias[r] : 0.0, m = bias ? fabs(bias[r]) : 0.0;
            for (int64_t b = 0; b < nb; b++) {
                double dw, off;
                int qw[32];
                i8_block(type, bytes + r * rb, b, &dw, &off, qw);
                double dot = 0.0, adot = 0.0, sq = 0.0;
                for (int i = 0; i < 32; i++) {
                    dot += (double)qw[i] * qx[32 * b + i], adot += fabs((double)qw[i] * qx[32 * b + i]);
                    sq += qx[32 * b + i];
                }
                s += dw * dx[b] * dot + off * dx[b] * sq;
                m += fabs(dw * dx[b]) * adot + fabs(off * dx[b] * sq);
            }
            y[t * rows + r] = s, mag[t * rows + r] = m;
        }
    }
    free(qx), free(dx);
}

/* one product on the device against the float64 reference; returns the
 * device output (T, rows) (caller frees) for further comparison */
static float *check_matmul(kvcl_ctx *c, const char *label, const mm_case *k, const uint8_t *bytes, const float *deq,
                           const float *x, const float *bias) {
    const int64_t rows = k->rows, cols = k->cols, T = k->T, ldy = rows + k->pad;
    kvcl_weight w;
    kv_status st = kvcl_weight_upload(c, k->type, rows, cols, bytes, &w, &g_err);
    float *xpad = xmalloc(sizeof(float) * (T * cols + k->pad));
    memcpy(xpad + k->pad, x, sizeof(float) * T * cols);
    kvcl_buf *xb = dev_floats(c, xpad, T * cols + k->pad), *yb = dev_buf(c, NULL, sizeof(float) * (T * ldy + k->pad));
    kvcl_buf *bb = k->bias ? dev_floats(c, bias, rows) : NULL;
    if (st == KV_OK)
        st = kvcl_matmul_with(c, k->path, &w, bb, kvcl_at(xb, k->pad), T, kvcl_at(yb, k->pad), ldy, &g_err);
    float *yd = xmalloc(sizeof(float) * T * ldy), *got = xmalloc(sizeof(float) * T * rows);
    double *ref = xmalloc(sizeof(double) * T * rows), *mag = xmalloc(sizeof(double) * T * rows);
    if (st == KV_OK) get_floats(c, yb, k->pad, yd, (T - 1) * ldy + rows);
    for (int64_t t = 0; t < T; t++) memcpy(got + t * rows, yd + t * ldy, sizeof(float) * rows);
    const bool i8 = int_case(c, k);
    if (i8) ref_matmul_i8(k->type, bytes, rows, cols, x, T, k->bias ? bias : NULL, ref, mag);
    else ref_matmul(deq, rows, cols, x, T, k->bias ? bias : NULL, ref, mag);
    const double g = i8 ? ((double)cols / 32 + 16) * U_F32 : path_gamma(k->path, cols);
    int bad = 0;
    double worst = 0; /* largest error / bound */
    for (int64_t i = 0; i < T * rows; i++) {
        const double err = fabs(got[i] - ref[i]), bound = g * mag[i] + 1e-30;
        if (!(err <= bound)) bad++;
        if (err / bound > worst) worst = err / bound;
    }
    char name[200];
    snprintf(name, sizeof name, "matmul %s %s%s %s (%lld x %lld, T %lld%s%s, %d parts): within %.1e |w||x|", label,
             path_name(c, k->path), i8 ? " int8" : "", tname(k->type), (long long)rows, (long long)cols,
             (long long)T, k->bias ? ", bias" : "", k->pad ? ", strided" : "", w.buf ? kvcl_buf_parts(w.buf) : 0, g);
    report(st == KV_OK && bad == 0, name, "%s; %d outputs outside, worst %.2f x the bound", st ? g_err.msg : "", bad,
           worst);
    kvcl_weight_free(&w);
    kvcl_buf_free(xb), kvcl_buf_free(yb), kvcl_buf_free(bb);
    free(xpad), free(yd), free(ref), free(mag);
    return got;
}

/* |y_cpu - y_exact| for kv_matmul: its activations are quantized to 8 bits
 * per block (Q8_0 / Q8_1 of 32 for the 32-element weight formats, Q8_K of
 * 256 for the K-quants): each x moves by at most 0.6 d (half a step d =
 * amax / 127, plus the step rounded to f16: 127 d 2^-11), so an output by
 * sum over blocks of 0.6 d_b sum |w| over the block. Q8_1's block sum
 * (times Q4_1/Q5_1's min) is rounded to f16 too: |m| sum |x| 2^-11 more.
 * Plus the float rounding of its dot products (gamma(cols)). */
static void cpu_bound(int type, const uint8_t *wrow, const float *w, int64_t cols, const float *x, double *out) {
    const int vt = kv_vec_dot_type(type);
    const int qb = vt == KV_TYPE_Q8_K ? 256 : 32;
    const size_t bb = kv_type_traits_get(type)->type_size;
    double s = 0.0, mag = 0.0;
    for (int64_t b0 = 0; b0 < cols; b0 += qb) {
        double amax = 0.0, sw = 0.0, sx = 0.0;
        for (int64_t i = b0; i < b0 + qb && i < cols; i++) {
            amax = fmax(amax, fabs(x[i]));
            sw += fabs(w[i]), sx += fabs(x[i]);
            mag += fabs((double)w[i] * x[i]);
        }
        if (vt != KV_TYPE_F32) s += 0.6 * amax / 127 * sw;
        if (vt == KV_TYPE_Q8_1) { /* min of the weight block: f16 at byte 2 */
            uint16_t m;
            memcpy(&m, wrow + (b0 / 32) * bb + 2, 2);
            s += fabs(kv_f16_to_f32(m)) * sx * ldexp(1.0, -11);
        }
    }
    *out = s + (double)(cols + 2) * U_F32 * mag * 1.01;
}

/* The device product against kv_matmul (scalar): the difference stays
 * within their two bounds. i8: the device quantized x per 32 (the integer
 * kernels); where kv_matmul quantizes per 256 (the K-quants' Q8_K) the
 * device's own rounding of x (0.6 d per block of 32, as in cpu_bound)
 * adds to the bound. */
static void check_against_cpu(const mm_case *k, bool i8, const uint8_t *bytes, const float *deq, const float *x,
                              const float *got) {
    const int64_t rows = k->rows, cols = k->cols, T = k->T;
    const size_t rb = kv_row_size(k->type, cols);
    float *yc = xmalloc(sizeof(float) * T * rows);
    void *scratch = xmalloc(kv_matmul_scratch_size(k->type, cols, T));
    kv_matmul(NULL, k->type, bytes, rows, cols, x, T, yc, rows, scratch);
    int bad = 0;
    double worst = 0, maxdiff = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < rows; r++) {
            double bc, mag = 0;
            cpu_bound(k->type, bytes + r * rb, deq + r * cols, cols, x + t * cols, &bc);
            for (int64_t i = 0; i < cols; i++) mag += fabs((double)deq[r * cols + i] * x[t * cols + i]);
            for (int64_t b0 = 0; i8 && kv_vec_dot_type(k->type) == KV_TYPE_Q8_K && b0 < cols; b0 += 32) {
                double amax = 0.0, sw = 0.0;
                for (int64_t i = b0; i < b0 + 32; i++) amax = fmax(amax, fabs(x[t * cols + i])), sw += fabs(deq[r * cols + i]);
                bc += 0.6 * amax / 127 * sw;
            }
            const double bound = bc + path_gamma(k->path, cols) * mag + 1e-30;
            const double d = fabs((double)got[t * rows + r] - yc[t * rows + r]);
            bad += !(d <= bound);
            worst = fmax(worst, d / bound);
            maxdiff = fmax(maxdiff, d / (mag + 1e-30));
        }
    char name[200];
    snprintf(name, sizeof name, "matmul %s vs kv_matmul (8-bit activations): within its bound (max diff %.1e |w||x|)",
             tname(k->type), maxdiff);
    report(bad == 0, name, "%d outside, worst %.2f x the bound", bad, worst);
    free(yc), free(scratch);
}

static void test_matmul_on(kvcl_ctx *c, const char *label, const int *paths, int n_paths, bool vs_cpu) {
    static const int64_t Ts[] = {1, 3, 2, 9, 17, 33};
    for (int wi = 0; wi < N_WTYPES; wi++) {
        const int type = k_wtypes[wi], blk = kv_type_traits_get(type)->blck;
        for (int pi = 0; pi < n_paths; pi++) {
            const int path = paths[pi];
            if (path == KVCL_MM_CLBLAST && !kvcl_have_clblast()) continue;
            mm_case k = {path, type, 1 + irand(300), blk == 1 ? 1 + irand(400) : blk * (1 + irand(2048 / blk)),
                         path == KVCL_MM_GEMV ? Ts[irand(2)] : Ts[2 + irand(4)], irand(2), irand(2) * 5};
            if (kvcl_ctx_device(c)->max_alloc < (1 << 20)) k.cols = blk * (1 + irand(1024 / blk)), k.T = 2;
            uint8_t *bytes;
            float *deq, *x = xmalloc(sizeof(float) * k.T * k.cols), *bias = xmalloc(sizeof(float) * k.rows);
            random_weight(type, k.rows, k.cols, &bytes, &deq);
            for (int64_t i = 0; i < k.T * k.cols; i++) x[i] = frand();
            for (int64_t i = 0; i < k.rows; i++) bias[i] = frand();
            if (vs_cpu && pi == 0) k.bias = false; /* kv_matmul has no bias */
            float *got = check_matmul(c, label, &k, bytes, deq, x, bias);
            if (vs_cpu && pi == 0) check_against_cpu(&k, int_case(c, &k), bytes, deq, x, got);
            free(bytes), free(deq), free(x), free(bias), free(got);
        }
    }
}

/* ==== elementwise ops against the CPU backend ======================================== */

/* |got - ref| <= rel * |ref| + abs everywhere: count of those outside */
static int count_outside(const float *got, const float *ref, int64_t n, double rel, double abs_tol) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad += !(fabs((double)got[i] - ref[i]) <= rel * fabs(ref[i]) + abs_tol);
    return bad;
}

static int count_exact(const float *got, const float *ref, int64_t n) {
    int same = 0;
    for (int64_t i = 0; i < n; i++) same += memcmp(&got[i], &ref[i], 4) == 0;
    return same;
}

/* floats of n that differ (bits) between buffer a at element offset ao and b at bo */
static int device_differ(kvcl_ctx *c, kvcl_buf *a, size_t ao, kvcl_buf *b, size_t bo, int64_t n) {
    float *x = xmalloc(sizeof(float) * n), *y = xmalloc(sizeof(float) * n);
    get_floats(c, a, ao, x, n), get_floats(c, b, bo, y, n);
    const int d = (int)n - count_exact(x, y, n);
    free(x), free(y);
    return d;
}

/* whether the first bytes of buffers a and b differ */
static bool bytes_differ(kvcl_ctx *c, kvcl_buf *a, kvcl_buf *b, size_t bytes) {
    uint8_t *x = xmalloc(bytes), *y = xmalloc(bytes);
    const bool d = kvcl_read(c, a, 0, x, bytes, &g_err) != KV_OK || kvcl_read(c, b, 0, y, bytes, &g_err) != KV_OK ||
                   memcmp(x, y, bytes) != 0;
    free(x), free(y);
    return d;
}

/* b's first n floats written again from the host: the same values, and no
 * records a kernel left for them (a product then quantizes them itself) */
static kv_status rewrite_from_host(kvcl_ctx *c, kvcl_buf *b, int64_t n) {
    float *x = xmalloc(sizeof(float) * n);
    get_floats(c, b, 0, x, n);
    const kv_status st = kvcl_write(c, b, 0, x, sizeof(float) * n, &g_err);
    free(x);
    return st;
}

/* A token gets the same bits from the decode GEMV (T = 1) as from the tiled
 * prefill kernel among other tokens (the engine's batch invariance: a
 * decode_batch row equals that session's own decode; a prefix reused from
 * pages equals a cold prefill). Rows of 16 blocks and more take the GEMV's
 * vectorized-scales path, odd block counts its tail. */
/* x (T tokens, at xb) times w by the tiled prefill at once and by the
 * decode GEMV token by token: *differ outputs whose bits differ */
static kv_status tiled_vs_gemv(kvcl_ctx *c, const kvcl_weight *w, kvcl_buf *xb, int64_t T, int *differ) {
    const int64_t rows = w->rows, cols = w->cols;
    kvcl_buf *yt = dev_buf(c, NULL, sizeof(float) * T * rows), *yg = dev_buf(c, NULL, sizeof(float) * T * rows);
    kv_status st = kvcl_matmul_with(c, KVCL_MM_TILED, w, NULL, kvcl_at(xb, 0), T, kvcl_at(yt, 0), rows, &g_err);
    for (int64_t t = 0; st == KV_OK && t < T; t++)
        st = kvcl_matmul_with(c, KVCL_MM_GEMV, w, NULL, kvcl_at(xb, t * cols), 1, kvcl_at(yg, t * rows), rows, &g_err);
    *differ = st == KV_OK ? device_differ(c, yt, 0, yg, 0, T * rows) : -1;
    kvcl_buf_free(yt), kvcl_buf_free(yg);
    return st;
}

static void test_gemv_tiled_same(kvcl_ctx *c) {
    for (int wi = 0; wi < N_WTYPES; wi++) {
        const int type = k_wtypes[wi], blk = kv_type_traits_get(type)->blck;
        const int64_t rows = 37, T = 11, cols = blk == 1 ? 1000 + 3 : blk * (blk == 256 ? 3 : 37);
        uint8_t *bytes;
        float *deq, *x = xmalloc(sizeof(float) * T * cols);
        random_weight(type, rows, cols, &bytes, &deq);
        for (int64_t i = 0; i < T * cols; i++) x[i] = frand();
        kvcl_weight w;
        kv_status st = kvcl_weight_upload(c, type, rows, cols, bytes, &w, &g_err);
        kvcl_buf *xb = dev_floats(c, x, T * cols);
        int differ = -1;
        if (st == KV_OK) st = tiled_vs_gemv(c, &w, xb, T, &differ);
        char name[160];
        snprintf(name, sizeof name, "matmul %s (%lld x %lld): decode GEMV == tiled prefill, bit for bit", tname(type),
                 (long long)rows, (long long)cols);
        report(st == KV_OK && differ == 0, name, "%s; %d of %lld outputs differ", st ? g_err.msg : "", differ,
               (long long)(T * rows));
        kvcl_weight_free(&w);
        kvcl_buf_free(xb);
        free(bytes), free(deq), free(x);
    }
}

/* Where the integer kernels run, their weights are packed in groups of 8
 * blocks, the last group of a row shorter (nb % 8 blocks), a K-quant
 * super-block a group: rows of 1 .. 17 blocks (K-quants: 8 and 16), each
 * group size and tail, through the GEMV (against the float64
 * product and kv_matmul's 8-bit activations), the tiled prefill (the
 * GEMV's bits) and the embedding lookup (kv_dequantize_row's bits). */
static void test_packed_rows(kvcl_ctx *c, const char *label) {
    static const int types[] = {KV_TYPE_Q4_0, KV_TYPE_Q4_1, KV_TYPE_Q5_0, KV_TYPE_Q5_1,
                                KV_TYPE_Q8_0, KV_TYPE_Q4_K, KV_TYPE_Q5_K};
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (int nb = 1; nb <= 17; nb++) {
            const int type = types[ti];
            if (kv_type_traits_get(type)->blck == 256 && nb % 8) continue; /* K-quant rows: whole super-blocks */
            const int64_t rows = 5 + irand(60), cols = 32 * nb, T = 9;
            uint8_t *bytes;
            float *deq, *x = xmalloc(sizeof(float) * T * cols);
            random_weight(type, rows, cols, &bytes, &deq);
            for (int64_t i = 0; i < T * cols; i++) x[i] = frand();
            mm_case k = {KVCL_MM_GEMV, type, rows, cols, 1, false, 0};
            float *got = check_matmul(c, label, &k, bytes, deq, x, NULL);
            check_against_cpu(&k, int_case(c, &k), bytes, deq, x, got);
            free(got);

            kvcl_weight w;
            kv_status st = kvcl_weight_upload(c, type, rows, cols, bytes, &w, &g_err);
            kvcl_buf *xb = dev_floats(c, x, T * cols);
            int differ = -1;
            if (st == KV_OK) st = tiled_vs_gemv(c, &w, xb, T, &differ);
            const int32_t ids[3] = {(int32_t)rows - 1, 0, irand(rows)};
            const int bad = st == KV_OK ? embed_rows_differ(c, &w, ids, 3, deq, &st) : 0;
            char name[200];
            snprintf(name, sizeof name, "%s%srows of %d blocks, %s (%lld rows, %s): tiled == GEMV bits, embed == kv_dequantize_row",
                     label, label[0] ? ": " : "", nb, tname(type), (long long)rows, w.packed ? "packed" : "as stored");
            report(st == KV_OK && differ == 0 && bad == 0 && w.packed == kvcl_ctx_int_dot(c), name, "%s; %d outputs differ, %d embedded rows differ",
                   st ? g_err.msg : "", differ, bad);
            kvcl_weight_free(&w);
            kvcl_buf_free(xb);
            free(bytes), free(deq), free(x);
        }
}

/* kvcl_matmul_n (one launch for q, k, v or gate, up at T = 1) gives each
 * output the bits of its own kvcl_matmul, with biases, for weights of one
 * type (the fused launch) and of mixed types (one product each). */
static void test_matmul_n(kvcl_ctx *c) {
    static const int64_t rows[3] = {70, 23, 23};
    const int64_t cols = 32 * 19;
    const int sets[][3] = {{KV_TYPE_Q4_1, KV_TYPE_Q4_1, KV_TYPE_Q4_1}, {KV_TYPE_Q8_0, KV_TYPE_Q8_0, KV_TYPE_Q8_0},
                           {KV_TYPE_Q5_0, KV_TYPE_Q5_0, KV_TYPE_Q8_0}, {KV_TYPE_F16, KV_TYPE_F16, KV_TYPE_F16}};
    for (size_t si = 0; si < sizeof sets / sizeof sets[0]; si++)
        for (int n = 2; n <= 3; n++) {
            kvcl_weight w[3] = {{0}};
            const kvcl_weight *wp[3];
            kvcl_buf *bias[3] = {NULL, NULL, NULL}, *yn[3] = {NULL, NULL, NULL}, *y1[3] = {NULL, NULL, NULL};
            kvcl_view yv[3];
            float *x = xmalloc(sizeof(float) * cols);
            for (int64_t i = 0; i < cols; i++) x[i] = frand();
            kvcl_buf *xb = dev_floats(c, x, cols);
            kv_status st = KV_OK;
            for (int i = 0; i < n; i++) {
                uint8_t *bytes;
                float *deq, *bv = xmalloc(sizeof(float) * rows[i]);
                random_weight(sets[si][i], rows[i], cols, &bytes, &deq);
                for (int64_t r = 0; r < rows[i]; r++) bv[r] = frand();
                if (st == KV_OK) st = kvcl_weight_upload(c, sets[si][i], rows[i], cols, bytes, &w[i], &g_err);
                bias[i] = i == 1 ? NULL : dev_floats(c, bv, rows[i]);
                yn[i] = dev_buf(c, NULL, sizeof(float) * rows[i]), y1[i] = dev_buf(c, NULL, sizeof(float) * rows[i]);
                wp[i] = &w[i], yv[i] = kvcl_at(yn[i], 0);
                free(bytes), free(deq), free(bv);
            }
            if (st == KV_OK) st = kvcl_matmul_n(c, n, wp, bias, kvcl_at(xb, 0), 1, yv, &g_err);
            for (int i = 0; st == KV_OK && i < n; i++)
                st = kvcl_matmul(c, &w[i], bias[i], kvcl_at(xb, 0), 1, kvcl_at(y1[i], 0), rows[i], &g_err);
            int differ = 0;
            for (int i = 0; st == KV_OK && i < n; i++) {
                float *a = xmalloc(sizeof(float) * rows[i]), *b = xmalloc(sizeof(float) * rows[i]);
                get_floats(c, yn[i], 0, a, rows[i]);
                get_floats(c, y1[i], 0, b, rows[i]);
                differ += (int)rows[i] - count_exact(a, b, rows[i]);
                free(a), free(b);
            }
            char name[160];
            snprintf(name, sizeof name, "matmul_n of %d (%s, %s, %s): each output the bits of its own matmul", n,
                     tname(sets[si][0]), tname(sets[si][1]), n > 2 ? tname(sets[si][2]) : "-");
            report(st == KV_OK && differ == 0, name, "%s; %d outputs differ", st ? g_err.msg : "", differ);
            for (int i = 0; i < n; i++) {
                kvcl_weight_free(&w[i]);
                kvcl_buf_free(bias[i]), kvcl_buf_free(yn[i]), kvcl_buf_free(y1[i]);
            }
            kvcl_buf_free(xb);
            free(x);
        }
}

/* RMSNorm: the device sums the squares in double (or with a compensated
 * float sum on the portable path) in another order than the CPU's
 * sequential double sum, so the float mean may differ in its last bit:
 * a few ulps. */
static void test_rmsnorm(kvcl_ctx *c, const char *label, double ulps) {
    static const int64_t shapes[][2] = {{1, 2048}, {5, 67}, {3, 1}, {130, 576}, {2, 4096 + 3}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t T = shapes[si][0], n = shapes[si][1];
        float *x = xmalloc(sizeof(float) * T * n), *w = xmalloc(sizeof(float) * n);
        float *ref = xmalloc(sizeof(float) * T * n), *got = xmalloc(sizeof(float) * T * n);
        for (int64_t i = 0; i < T * n; i++) x[i] = frand() * (1 + (i % 7));
        for (int64_t i = 0; i < n; i++) w[i] = frand() + 1.0f;
        for (int with_w = 0; with_w < 2; with_w++) {
            g_cpu.rmsnorm(&g_cpu, ref, x, with_w ? w : NULL, T, n, 1e-6f);
            kvcl_buf *xb = dev_floats(c, x, T * n), *wb = dev_floats(c, w, n);
            /* in place on even shapes, into another buffer on odd ones */
            kvcl_buf *yb = si % 2 ? dev_buf(c, NULL, sizeof(float) * T * n) : xb;
            kv_status st = kvcl_rmsnorm(c, kvcl_at(yb, 0), kvcl_at(xb, 0), with_w ? wb : NULL, T, n, 1e-6f, &g_err);
            if (st == KV_OK) get_floats(c, yb, 0, got, T * n);
            const int bad = count_outside(got, ref, T * n, ulps * FLT_EPSILON, 0);
            char name[160];
            snprintf(name, sizeof name, "rmsnorm%s (%lld, %lld)%s: within %g ulps of the CPU (%d of %lld identical)",
                     label, (long long)T, (long long)n, with_w ? " * w" : "", ulps, count_exact(got, ref, T * n),
                     (long long)(T * n));
            report(st == KV_OK && bad == 0, name, "%s; %d outside", st ? g_err.msg : "", bad);
            if (yb != xb) kvcl_buf_free(yb);
            kvcl_buf_free(xb), kvcl_buf_free(wb);
        }
        free(x), free(w), free(ref), free(got);
    }
}

/* RoPE: the angles are the same floats (same multiplications, correctly
 * rounded division); cos and sin may differ by the device's 4 ulps
 * (OpenCL's bound) against the C library's: each output within
 * 8 eps (|a| + |b|) of its pair (a, b). */
/* kvcl_add_rmsnorm: the bits of kvcl_add then kvcl_rmsnorm, x and the
 * output (into the addend's buffer, as the forward pass does, or apart) */
static void test_add_rmsnorm(kvcl_ctx *c) {
    static const int64_t shapes[][2] = {{1, 576}, {7, 2048}, {3, 67}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t T = shapes[si][0], n = shapes[si][1];
        float *x = xmalloc(sizeof(float) * T * n), *a = xmalloc(sizeof(float) * T * n), *w = xmalloc(sizeof(float) * n);
        for (int64_t i = 0; i < T * n; i++) x[i] = frand() * 3, a[i] = frand();
        for (int64_t i = 0; i < n; i++) w[i] = frand() + 1.0f;
        float *x1 = xmalloc(sizeof(float) * T * n), *y1 = xmalloc(sizeof(float) * T * n);
        float *x2 = xmalloc(sizeof(float) * T * n), *y2 = xmalloc(sizeof(float) * T * n);
        for (int into_a = 0; into_a < 2; into_a++) {
            kvcl_buf *xs = dev_floats(c, x, T * n), *as = dev_floats(c, a, T * n), *wb = dev_floats(c, w, n);
            kvcl_buf *xf = dev_floats(c, x, T * n), *af = dev_floats(c, a, T * n);
            kvcl_buf *ys = into_a ? as : dev_buf(c, NULL, sizeof(float) * T * n);
            kvcl_buf *yf = into_a ? af : dev_buf(c, NULL, sizeof(float) * T * n);
            kv_status st = kvcl_add(c, kvcl_at(xs, 0), kvcl_at(as, 0), T * n, &g_err);
            if (st == KV_OK) st = kvcl_rmsnorm(c, kvcl_at(ys, 0), kvcl_at(xs, 0), wb, T, n, 1e-6f, &g_err);
            if (st == KV_OK)
                st = kvcl_add_rmsnorm(c, kvcl_at(xf, 0), kvcl_at(af, 0), kvcl_at(yf, 0), wb, T, n, 1e-6f, &g_err);
            int differ = 0;
            if (st == KV_OK) {
                get_floats(c, xs, 0, x1, T * n), get_floats(c, ys, 0, y1, T * n);
                get_floats(c, xf, 0, x2, T * n), get_floats(c, yf, 0, y2, T * n);
                differ = (int)(2 * T * n) - count_exact(x1, x2, T * n) - count_exact(y1, y2, T * n);
            }
            char name[160];
            snprintf(name, sizeof name, "add_rmsnorm (%lld, %lld)%s: the bits of add, then rmsnorm", (long long)T,
                     (long long)n, into_a ? ", output over the addend" : "");
            report(st == KV_OK && differ == 0, name, "%s; %d values differ", st ? g_err.msg : "", differ);
            if (!into_a) kvcl_buf_free(ys), kvcl_buf_free(yf);
            kvcl_buf_free(xs), kvcl_buf_free(as), kvcl_buf_free(xf), kvcl_buf_free(af), kvcl_buf_free(wb);
        }
        free(x), free(a), free(w), free(x1), free(y1), free(x2), free(y2);
    }
}

static void test_rope(kvcl_ctx *c) {
    static const int hds[] = {64, 128, 256};
    for (int ci = 0; ci < 8; ci++) {
        const int hd = hds[ci % 3], n_head = 1 + irand(9), T = ci < 2 ? 1 : 1 + irand(40);
        float factors[128];
        for (int i = 0; i < 128; i++) factors[i] = 1.0f + (float)irand(8);
        kv_rope_params rp = {ci % 2 ? KV_ROPE_NEOX : KV_ROPE_NORM, ci % 4 == 3 ? hd / 2 : hd,
                             ci % 3 == 0 ? 500000.0f : 10000.0f, ci == 5 ? 0.25f : 1.0f, ci % 4 == 2 ? factors : NULL};
        const int64_t n = (int64_t)T * n_head * hd;
        int32_t *pos = xmalloc(sizeof(int32_t) * T);
        float *x = xmalloc(sizeof(float) * n), *ref = xmalloc(sizeof(float) * n), *got = xmalloc(sizeof(float) * n);
        for (int t = 0; t < T; t++) pos[t] = irand(8192);
        for (int64_t i = 0; i < n; i++) x[i] = ref[i] = frand();
        g_cpu.rope(&g_cpu, ref, T, n_head, hd, pos, &rp);
        kvcl_buf *xb = dev_floats(c, x, n), *pb = dev_buf(c, pos, sizeof(int32_t) * T);
        kvcl_buf *fb = dev_floats(c, factors, 128);
        kv_status st = kvcl_rope(c, kvcl_at(xb, 0), T, n_head, hd, pb, &rp, rp.freq_factors ? fb : NULL, &g_err);
        if (st == KV_OK) get_floats(c, xb, 0, got, n);
        int bad = 0;
        const int half = rp.n_rot / 2;
        for (int64_t r = 0; r < (int64_t)T * n_head; r++)
            for (int i = 0; i < hd; i++) {
                /* the pair element i belongs to (dims past n_rot are untouched: their own pair) */
                int a = i, b = i;
                if (i < rp.n_rot) {
                    if (rp.mode == KV_ROPE_NEOX) a = i % half, b = a + half;
                    else a = i & ~1, b = a + 1;
                }
                const double tol = 8 * FLT_EPSILON * (fabs(x[r * hd + a]) + fabs(x[r * hd + b]));
                bad += !(fabs((double)got[r * hd + i] - ref[r * hd + i]) <= tol);
            }
        char name[200];
        snprintf(name, sizeof name, "rope %s hd %d n_rot %d heads %d T %d%s%s: within 8 eps of the CPU (%d of %lld identical)",
                 rp.mode == KV_ROPE_NEOX ? "neox" : "norm", hd, rp.n_rot, n_head, T, rp.freq_factors ? ", factors" : "",
                 rp.freq_scale != 1.0f ? ", scaled" : "", count_exact(got, ref, n), (long long)n);
        report(st == KV_OK && bad == 0, name, "%s; %d outside", st ? g_err.msg : "", bad);
        kvcl_buf_free(xb), kvcl_buf_free(pb), kvcl_buf_free(fb);
        free(pos), free(x), free(ref), free(got);
    }
}

/* rope_qk: the bits of rope on q, rope on k and scale on q (the device's
 * own kernels), and the finiteness flag: set by a NaN or an infinity
 * anywhere in q or k (unrotated dimensions too), not otherwise. Frequency
 * factors and a frequency scale in some cases (the angle's division). */
static void test_rope_qk(kvcl_ctx *c) {
    float factors[64];
    for (int i = 0; i < 64; i++) factors[i] = 1.0f + (float)(i * 13 % 40) / 7.0f; /* not from rnd(): the later shapes stay */
    kvcl_buf *fb = dev_floats(c, factors, 64);
    for (int ci = 0; ci < 8; ci++) {
        const int hd = ci % 2 ? 128 : 64, n_head = 2 + irand(7), n_kv = 1 + irand(3), T = ci < 3 ? 1 : 1 + irand(20);
        kv_rope_params rp = {ci % 2 ? KV_ROPE_NEOX : KV_ROPE_NORM, ci % 4 == 3 ? hd / 2 : hd, 10000.0f,
                             ci % 3 == 2 ? 0.25f : 1.0f, ci % 4 == 2 ? factors : NULL};
        kvcl_buf *ff = rp.freq_factors ? fb : NULL;
        const float q_scale = ci % 3 == 1 ? 0.0625f : 1.0f;
        const int64_t nq = (int64_t)T * n_head * hd, nk = (int64_t)T * n_kv * hd;
        int32_t *pos = xmalloc(sizeof(int32_t) * T);
        float *q = xmalloc(sizeof(float) * nq), *k = xmalloc(sizeof(float) * nk);
        for (int t = 0; t < T; t++) pos[t] = irand(8192);
        for (int64_t i = 0; i < nq; i++) q[i] = frand();
        for (int64_t i = 0; i < nk; i++) k[i] = frand();
        const int bad_at = ci >= 5 ? (ci == 5 ? 0 : ci == 6 ? 1 : 2) : -1; /* NaN in q, inf in k, NaN past n_rot */
        if (bad_at == 0) q[irand((int)nq)] = NAN;
        if (bad_at == 1) k[irand((int)nk)] = INFINITY;
        if (bad_at == 2) k[hd - 1] = NAN, rp.n_rot = hd / 2;
        kvcl_buf *pb = dev_buf(c, pos, sizeof(int32_t) * T);
        kvcl_buf *qa = dev_floats(c, q, nq), *ka = dev_floats(c, k, nk), *qb = dev_floats(c, q, nq), *kb = dev_floats(c, k, nk);
        kv_status st = kvcl_rope(c, kvcl_at(qa, 0), T, n_head, hd, pb, &rp, ff, &g_err);
        if (st == KV_OK) st = kvcl_rope(c, kvcl_at(ka, 0), T, n_kv, hd, pb, &rp, ff, &g_err);
        if (st == KV_OK && q_scale != 1.0f) st = kvcl_scale(c, kvcl_at(qa, 0), nq, q_scale, &g_err);
        bool fin = false;
        if (st == KV_OK) st = kvcl_finite_reset(c, &g_err);
        if (st == KV_OK)
            st = kvcl_rope_qk(c, kvcl_at(qb, 0), kvcl_at(kb, 0), T, n_head, n_kv, hd, pb, &rp, ff, q_scale, &g_err);
        if (st == KV_OK) st = kvcl_finite_read(c, &fin, &g_err);
        float *a = xmalloc(sizeof(float) * nq), *b = xmalloc(sizeof(float) * nq);
        int differ = 0;
        if (st == KV_OK) {
            get_floats(c, qa, 0, a, nq), get_floats(c, qb, 0, b, nq);
            for (int64_t i = 0; i < nq; i++) differ += memcmp(&a[i], &b[i], 4) != 0 && !(isnan(a[i]) && isnan(b[i]));
            get_floats(c, ka, 0, a, nk), get_floats(c, kb, 0, b, nk);
            for (int64_t i = 0; i < nk; i++) differ += memcmp(&a[i], &b[i], 4) != 0 && !(isnan(a[i]) && isnan(b[i]));
        }
        char name[200];
        snprintf(name, sizeof name, "rope_qk %s hd %d n_rot %d heads %d/%d T %d%s%s%s%s: the bits of rope, rope, scale; flag %s",
                 rp.mode == KV_ROPE_NEOX ? "neox" : "norm", hd, rp.n_rot, n_head, n_kv, T,
                 rp.freq_factors ? ", factors" : "", rp.freq_scale != 1.0f ? ", freq scaled" : "",
                 q_scale != 1.0f ? ", q scaled" : "", bad_at >= 0 ? ", a non-finite value" : "",
                 bad_at >= 0 ? "down" : "up");
        report(st == KV_OK && differ == 0 && fin == (bad_at < 0), name, "%s; %d values differ, finite %d",
               st ? g_err.msg : "", differ, (int)fin);
        kvcl_buf_free(pb), kvcl_buf_free(qa), kvcl_buf_free(ka), kvcl_buf_free(qb), kvcl_buf_free(kb);
        free(pos), free(q), free(k), free(a), free(b);
    }
    kvcl_buf_free(fb);
}

/* add and scale: one float operation, bit-identical. Soft cap (tanh: 5
 * ulps in OpenCL) and SiLU (exp: 3 ulps, then a division and a product):
 * within 8 eps relative. GELU: the CPU rounds input and result to f16, so
 * does the device; a tanh differing in its last bits can move the result
 * by one f16 step (2^-10 relative), and for gate << 0, where 1 + tanh(.)
 * cancels, by 0.5 |gate| 5 ulp(1) |up| <= 1.1e-5 absolute (|gate| < 12,
 * |up| < 3 here). */
static void test_pointwise(kvcl_ctx *c) {
    static const int64_t sizes[] = {1, 63, 1000, 65 * 1024 + 7};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        const int64_t n = sizes[si];
        float *a = xmalloc(sizeof(float) * n), *b = xmalloc(sizeof(float) * n);
        float *ref = xmalloc(sizeof(float) * n), *got = xmalloc(sizeof(float) * n);
        for (int64_t i = 0; i < n; i++) a[i] = frand() * 12.0f, b[i] = frand() * 3.0f;
        kvcl_buf *ab = dev_buf(c, NULL, sizeof(float) * (n + 2)), *bb = dev_floats(c, b, n); /* a at offset 2 */
        struct {
            const char *name;
            double rel, abs;
            int op; /* 0 add, 1 scale, 2 softcap, 3 silu, 4 gelu */
        } ops[] = {{"add", 0, 1e-37, 0}, {"scale", 0, 1e-37, 1}, {"softcap", 8 * FLT_EPSILON, 1e-37, 2},
                   {"silu", 8 * FLT_EPSILON, 1e-37, 3}, {"gelu", 1.0 / 1024, 1.1e-5, 4}};
        for (size_t oi = 0; oi < sizeof ops / sizeof ops[0]; oi++) {
            memcpy(ref, a, sizeof(float) * n);
            kvcl_write(c, ab, 2 * sizeof(float), a, sizeof(float) * n, &g_err);
            kvcl_view av = kvcl_at(ab, 2), bv = kvcl_at(bb, 0);
            kv_status st = KV_OK;
            switch (ops[oi].op) {
            case 0: g_cpu.add(&g_cpu, ref, b, n), st = kvcl_add(c, av, bv, n, &g_err); break;
            case 1: g_cpu.scale(&g_cpu, ref, n, 0.37f), st = kvcl_scale(c, av, n, 0.37f, &g_err); break;
            case 2: g_cpu.softcap(&g_cpu, ref, n, 5.0f), st = kvcl_softcap(c, av, n, 5.0f, &g_err); break;
            case 3:
                g_cpu.ffn_act(&g_cpu, ref, b, 1, n, KV_ACT_SILU), st = kvcl_ffn_act(c, av, bv, 1, n, KV_ACT_SILU, &g_err);
                break;
            case 4:
                g_cpu.ffn_act(&g_cpu, ref, b, 1, n, KV_ACT_GELU_TANH);
                st = kvcl_ffn_act(c, av, bv, 1, n, KV_ACT_GELU_TANH, &g_err);
                break;
            }
            if (st == KV_OK) get_floats(c, ab, 2, got, n);
            const int bad = count_outside(got, ref, n, ops[oi].rel, ops[oi].abs);
            char name[160];
            snprintf(name, sizeof name, "%s n %lld: within %.1e relative + %.1e of the CPU (%d of %lld identical)",
                     ops[oi].name, (long long)n, ops[oi].rel, ops[oi].abs, count_exact(got, ref, n), (long long)n);
            report(st == KV_OK && bad == 0, name, "%s; %d outside", st ? g_err.msg : "", bad);
        }
        kvcl_buf_free(ab), kvcl_buf_free(bb);
        free(a), free(b), free(ref), free(got);
    }
}

/* The rotation of quantized K/V rows: the CPU's butterflies, in the same
 * order, on rows of head sizes 32 .. 256 and one of 80 (blocks of 16). */
static void test_hadamard(kvcl_ctx *c) {
    static const int64_t shapes[][2] = {{7, 64}, {33, 128}, {3, 256}, {17, 32}, {5, 80}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t rows = shapes[si][0], n = shapes[si][1];
        float *x = xmalloc(sizeof(float) * rows * n), *got = xmalloc(sizeof(float) * rows * n);
        for (int64_t i = 0; i < rows * n; i++) x[i] = frand() * 4.0f;
        kvcl_buf *xb = dev_buf(c, NULL, sizeof(float) * (rows * n + 3)); /* rows at offset 3 */
        kvcl_write(c, xb, 3 * sizeof(float), x, sizeof(float) * rows * n, &g_err);
        kv_status st = kvcl_hadamard(c, kvcl_at(xb, 3), rows, n, &g_err);
        if (st == KV_OK) get_floats(c, xb, 3, got, rows * n);
        kv_hadamard_rows(x, rows, n);
        const int bad = count_outside(got, x, rows * n, 4 * FLT_EPSILON, 1e-30);
        char name[160];
        snprintf(name, sizeof name, "hadamard %lld x %lld: as the CPU (%d of %lld identical)", (long long)rows,
                 (long long)n, count_exact(got, x, rows * n), (long long)(rows * n));
        report(st == KV_OK && bad == 0, name, "%s; %d outside", st ? g_err.msg : "", bad);
        kvcl_buf_free(xb);
        free(x), free(got);
    }
}

static void test_all_finite(kvcl_ctx *c) {
    const int64_t n = 4099;
    float *x = xmalloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) x[i] = frand() * 1e30f;
    const float bad_values[] = {NAN, INFINITY, -INFINITY};
    kvcl_buf *b = dev_floats(c, x, n);
    bool ok = false;
    kv_status st = kvcl_all_finite(c, kvcl_at(b, 0), n, &ok, &g_err);
    report(st == KV_OK && ok, "all_finite: finite values", "%d %d", st, ok);
    for (int k = 0; k < 3; k++) {
        const int64_t at = k == 0 ? n - 1 : irand((int)n);
        kvcl_write(c, b, at * sizeof(float), &bad_values[k], sizeof(float), &g_err);
        st = kvcl_all_finite(c, kvcl_at(b, 0), n, &ok, &g_err);
        report(st == KV_OK && !ok, k == 0 ? "all_finite: NaN at the end" : k == 1 ? "all_finite: +inf" : "all_finite: -inf",
               "%d %d", st, ok);
        kvcl_write(c, b, at * sizeof(float), &x[at], sizeof(float), &g_err);
    }
    kvcl_buf_free(b);
    free(x);
}

/* ==== K/V pages and attention ======================================================== */

/* a layer's pages on the device: page ids shuffled, buffers pre-filled with
 * 0xAB so rows nobody wrote are recognizable */
typedef struct {
    kvcl_pages pg;
    int32_t *tab;   /* (max_pages) */
    size_t kbytes, vbytes;
} test_pages;

static void pages_make(kvcl_ctx *c, test_pages *tp, int n_ctx, int pt, int n_kv, int hd, int hdv, int kt, int vt) {
    const int used = (n_ctx + pt - 1) / pt, max_pages = used + 3;
    tp->tab = xmalloc(sizeof(int32_t) * max_pages);
    for (int i = 0; i < max_pages; i++) tp->tab[i] = i;
    for (int i = max_pages - 1; i > 0; i--) { /* shuffle */
        int j = irand(i + 1), t = tp->tab[i];
        tp->tab[i] = tp->tab[j], tp->tab[j] = t;
    }
    tp->kbytes = (size_t)n_kv * max_pages * pt * kvcl_kv_row_bytes(kt, hd);
    tp->vbytes = (size_t)n_kv * max_pages * pt * kvcl_kv_row_bytes(vt, hdv);
    uint8_t *fill = xmalloc(tp->kbytes > tp->vbytes ? tp->kbytes : tp->vbytes);
    memset(fill, 0xAB, tp->kbytes > tp->vbytes ? tp->kbytes : tp->vbytes);
    tp->pg = (kvcl_pages){dev_buf(c, fill, tp->kbytes), dev_buf(c, fill, tp->vbytes),
                          dev_buf(c, tp->tab, sizeof(int32_t) * max_pages), pt, max_pages, kt, vt, n_kv, hd, hdv};
    free(fill);
}

static void pages_free(test_pages *tp) {
    kvcl_buf_free(tp->pg.k), kvcl_buf_free(tp->pg.v), kvcl_buf_free(tp->pg.tab);
    free(tp->tab);
}

/* one row as the CPU cache stores it */
static void encode_row(int type, const float *x, int n, uint8_t *out) {
    if (type == KV_TYPE_F16)
        for (int i = 0; i < n; i++) {
            uint16_t h = kv_f32_to_f16(x[i]);
            memcpy(out + 2 * i, &h, 2);
        }
    else if (type == KV_TYPE_Q8_0 || type == KV_TYPE_Q4_0)
        kv_quantize_row(type, x, out, n);
    else
        memcpy(out, x, sizeof(float) * n);
}

/* k (n_ctx, n_kv, hd) and v stored through kvcl_kv_store in chunks of
 * random sizes (crossing page ends); then every row of the buffers checked:
 * the encoded rows where the table puts them, 0xAB elsewhere */
static void store_and_check(kvcl_ctx *c, test_pages *tp, int n_ctx, const float *k, const float *v, const char *name) {
    const kvcl_pages *pg = &tp->pg;
    const int n_kv = pg->n_head_kv, hd = pg->head_dim, hdv = pg->head_dim_v;
    kvcl_buf *kb = dev_floats(c, k, (size_t)n_ctx * n_kv * hd), *vb = dev_floats(c, v, (size_t)n_ctx * n_kv * hdv);
    kv_status st = KV_OK;
    for (int p = 0; p < n_ctx && st == KV_OK;) {
        int n = 1 + irand(40);
        if (n > n_ctx - p) n = n_ctx - p;
        st = kvcl_kv_store(c, pg, p, n, kvcl_at(kb, (size_t)p * n_kv * hd), kvcl_at(vb, (size_t)p * n_kv * hdv), &g_err);
        p += n;
    }
    uint8_t *K = xmalloc(tp->kbytes), *V = xmalloc(tp->vbytes), *row = xmalloc(4 * 256);
    if (st == KV_OK) st = kvcl_read(c, pg->k, 0, K, tp->kbytes, &g_err);
    if (st == KV_OK) st = kvcl_read(c, pg->v, 0, V, tp->vbytes, &g_err);
    const size_t kr = kvcl_kv_row_bytes(pg->ktype, hd), vr = kvcl_kv_row_bytes(pg->vtype, hdv);
    int bad = 0, untouched_bad = 0;
    char *written = xmalloc((size_t)n_kv * pg->max_pages * pg->pt);
    for (int h = 0; h < n_kv; h++)
        for (int p = 0; p < n_ctx; p++) {
            const size_t r = ((size_t)h * pg->max_pages + tp->tab[p / pg->pt]) * pg->pt + p % pg->pt;
            written[r] = 1;
            encode_row(pg->ktype, k + ((size_t)p * n_kv + h) * hd, hd, row);
            bad += memcmp(K + r * kr, row, kr) != 0;
            encode_row(pg->vtype, v + ((size_t)p * n_kv + h) * hdv, hdv, row);
            bad += memcmp(V + r * vr, row, vr) != 0;
        }
    for (size_t r = 0; r < (size_t)n_kv * pg->max_pages * pg->pt; r++) {
        if (written[r]) continue;
        for (size_t i = 0; i < kr; i++) untouched_bad += K[r * kr + i] != 0xAB;
        for (size_t i = 0; i < vr; i++) untouched_bad += V[r * vr + i] != 0xAB;
    }
    report(st == KV_OK && bad == 0 && untouched_bad == 0, name, "%s; %d rows differ, %d bytes written elsewhere",
           st ? g_err.msg : "", bad, untouched_bad);
    kvcl_buf_free(kb), kvcl_buf_free(vb);
    free(K), free(V), free(row), free(written);
}

/* values as stored: rounded through the row type */
static void stored_values(int type, const float *x, int n, float *out) {
    uint8_t row[4 * 256];
    encode_row(type, x, n, row);
    if (type == KV_TYPE_F16)
        for (int i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, row + 2 * i, 2);
            out[i] = kv_f16_to_f32(h);
        }
    else
        kv_dequantize_row(type, row, out, n);
}

typedef struct {
    int n_kv, G, hd, hdv, kt, vt, pos0, T, window, pt;
    float softcap;
} att_case;

/* Float64 attention with the engine's numerics (q rounded to f16 for F16
 * keys, K/V as stored), and a first-order bound on the device's float
 * error per output: scores carry gamma(hd) sum |q k| (times the scale;
 * the soft cap's slope is below 1) plus 8 eps |z| for the scale, cap and
 * exp; a logit error dz moves each probability by 2 dz relative; the
 * accumulation over n keys and their tile rescalings adds gamma(3 n + 64).
 * out and tol: (T, n_head, hdv). */
static void ref_attention(const att_case *a, const float *q, const float *Ks, const float *Vs, double *out,
                          double *tol) {
    const int n_head = a->n_kv * a->G, hd = a->hd, hdv = a->hdv;
    const double scale = 1.0 / sqrt((double)hd) * 1.3, u = U_F32;
    double *z = xmalloc(sizeof(double) * (a->pos0 + a->T)), *qr = xmalloc(sizeof(double) * hd);
    for (int t = 0; t < a->T; t++)
        for (int j = 0; j < n_head; j++) {
            const int g = j / a->G, qpos = a->pos0 + t;
            const int lo = a->window > 0 && qpos - a->window + 1 > 0 ? qpos - a->window + 1 : 0;
            const float *qs = q + ((size_t)t * n_head + j) * hd;
            for (int i = 0; i < hd; i++) qr[i] = a->kt == KV_TYPE_F16 ? kv_f16_to_f32(kv_f32_to_f16(qs[i])) : qs[i];
            double M = -INFINITY, dz = 0;
            for (int p = lo; p <= qpos; p++) {
                const float *kp = Ks + ((size_t)p * a->n_kv + g) * hd;
                double s = 0, mag = 0;
                for (int i = 0; i < hd; i++) s += qr[i] * kp[i], mag += fabs(qr[i] * kp[i]);
                z[p] = a->softcap > 0 ? a->softcap * tanh(s * scale / a->softcap) : s * scale;
                dz = fmax(dz, scale * (hd + 2) * u * mag + 8 * FLT_EPSILON * fabs(z[p]));
                M = fmax(M, z[p]);
            }
            double L = 0;
            for (int p = lo; p <= qpos; p++) L += exp(z[p] - M);
            const int n = qpos - lo + 1;
            for (int i = 0; i < hdv; i++) {
                double o = 0, w = 0;
                for (int p = lo; p <= qpos; p++) {
                    const double pr = exp(z[p] - M) / L, vv = Vs[((size_t)p * a->n_kv + g) * hdv + i];
                    o += pr * vv, w += pr * fabs(vv);
                }
                out[((size_t)t * n_head + j) * hdv + i] = o;
                tol[((size_t)t * n_head + j) * hdv + i] = (2 * dz + (3.0 * n + 64) * u) * w + 1e-30;
            }
        }
    free(z), free(qr);
}

static int g_att_seq;

/* attention of case a on c (its own pages holding k, v of every position
 * up to pos0 + T): out (T, n_head, hdv); false on an error */
static bool attention_on(kvcl_ctx *c, const att_case *a, const float *q, const float *k, const float *v, float *out) {
    const int n_head = a->n_kv * a->G, n_ctx = a->pos0 + a->T;
    const size_t no = (size_t)a->T * n_head * a->hdv;
    test_pages tp;
    pages_make(c, &tp, n_ctx, a->pt, a->n_kv, a->hd, a->hdv, a->kt, a->vt);
    kvcl_buf *kb = dev_floats(c, k, (size_t)n_ctx * a->n_kv * a->hd);
    kvcl_buf *vb = dev_floats(c, v, (size_t)n_ctx * a->n_kv * a->hdv);
    kv_status st = kvcl_kv_store(c, &tp.pg, 0, n_ctx, kvcl_at(kb, 0), kvcl_at(vb, 0), &g_err);
    kv_attn_params ap = {0, n_head, a->n_kv, a->hd, a->hdv, (float)(1.0 / sqrt((double)a->hd) * 1.3), a->window,
                         a->softcap};
    kvcl_buf *qb = dev_floats(c, q, (size_t)a->T * n_head * a->hd), *ob = dev_buf(c, NULL, sizeof(float) * no);
    if (st == KV_OK) st = kvcl_attention(c, &tp.pg, &ap, kvcl_at(qb, 0), a->T, a->pos0, kvcl_at(ob, 0), &g_err);
    if (st == KV_OK) get_floats(c, ob, 0, out, no);
    pages_free(&tp);
    kvcl_buf_free(kb), kvcl_buf_free(vb), kvcl_buf_free(qb), kvcl_buf_free(ob);
    return st == KV_OK;
}

static void test_attention_case(kvcl_ctx *c, kvcl_ctx *cg, const att_case *a) {
    const int n_head = a->n_kv * a->G, n_ctx = a->pos0 + a->T, hd = a->hd, hdv = a->hdv;
    const size_t nk = (size_t)n_ctx * a->n_kv * hd, nv = (size_t)n_ctx * a->n_kv * hdv;
    const size_t nq = (size_t)a->T * n_head * hd, no = (size_t)a->T * n_head * hdv;
    float *k = xmalloc(sizeof(float) * nk), *v = xmalloc(sizeof(float) * nv), *q = xmalloc(sizeof(float) * nq);
    for (size_t i = 0; i < nk; i++) k[i] = frand() * 2;
    for (size_t i = 0; i < nv; i++) v[i] = frand();
    for (size_t i = 0; i < nq; i++) q[i] = frand() * 2;
    char label[200];
    snprintf(label, sizeof label, "kv %d x G %d, hd %d/%d, %s/%s, pos0 %d T %d, window %d, cap %g, pages of %d", a->n_kv,
             a->G, hd, hdv, tname(a->kt), tname(a->vt), a->pos0, a->T, a->window, a->softcap, a->pt);

    test_pages tp;
    pages_make(c, &tp, n_ctx, a->pt, a->n_kv, hd, hdv, a->kt, a->vt);
    char name[300];
    snprintf(name, sizeof name, "kv_store %s: rows as the CPU encodes them, where the table puts them", label);
    store_and_check(c, &tp, n_ctx, k, v, name);

    /* device */
    kv_attn_params ap = {0, n_head, a->n_kv, hd, hdv, (float)(1.0 / sqrt((double)hd) * 1.3), a->window, a->softcap};
    kvcl_buf *qb = dev_floats(c, q, nq), *ob = dev_buf(c, NULL, sizeof(float) * (no + 1));
    float *got = xmalloc(sizeof(float) * no), *again = xmalloc(sizeof(float) * no);
    kv_status st = kvcl_attention(c, &tp.pg, &ap, kvcl_at(qb, 0), a->T, a->pos0, kvcl_at(ob, 1), &g_err);
    if (st == KV_OK) get_floats(c, ob, 1, got, no);
    if (st == KV_OK) st = kvcl_attention(c, &tp.pg, &ap, kvcl_at(qb, 0), a->T, a->pos0, kvcl_at(ob, 1), &g_err);
    if (st == KV_OK) get_floats(c, ob, 1, again, no);

    /* float64 reference on the stored values */
    float *Ks = xmalloc(sizeof(float) * nk), *Vs = xmalloc(sizeof(float) * nv);
    for (size_t r = 0; r < nk / hd; r++) stored_values(a->kt, k + r * hd, hd, Ks + r * hd);
    for (size_t r = 0; r < nv / hdv; r++) stored_values(a->vt, v + r * hdv, hdv, Vs + r * hdv);
    double *ref = xmalloc(sizeof(double) * no), *tol = xmalloc(sizeof(double) * no);
    ref_attention(a, q, Ks, Vs, ref, tol);
    int bad = 0;
    double worst = 0;
    for (size_t i = 0; i < no; i++) {
        const double err = fabs(got[i] - ref[i]);
        bad += !(err <= tol[i]);
        worst = fmax(worst, err / tol[i]);
    }
    snprintf(name, sizeof name, "attention %s: within the float64 bound (worst %.2f of it)", label, worst);
    report(st == KV_OK && bad == 0, name, "%s; %d outside", st ? g_err.msg : "", bad);
    snprintf(name, sizeof name, "attention %s: the same bits when run again", label);
    report(st == KV_OK && memcmp(got, again, sizeof(float) * no) == 0, name, "differs");

    /* one token: the work-group kernel (another context's) gives the bits a
     * CPU driver's one-row kernel gave. More tokens, no window: the last
     * one alone gives its row's bits (tiles start at key 0 either way) */
    float *one = xmalloc(sizeof(float) * n_head * hdv);
    const float *want = got + (size_t)(a->T - 1) * n_head * hdv;
    if (a->T == 1 && cg) {
        const bool ok = attention_on(cg, a, q, k, v, one);
        snprintf(name, sizeof name, "attention %s: the work-group kernel's bits", label);
        report(st == KV_OK && ok && memcmp(one, want, sizeof(float) * n_head * hdv) == 0, name, "differ");
    } else if (a->T > 1 && a->window == 0) {
        att_case last = *a;
        last.pos0 = a->pos0 + a->T - 1, last.T = 1;
        const bool ok = attention_on(c, &last, q + (size_t)(a->T - 1) * n_head * hd, k, v, one);
        snprintf(name, sizeof name, "attention %s: the last token alone gets its row's bits", label);
        report(st == KV_OK && ok && memcmp(one, want, sizeof(float) * n_head * hdv) == 0, name, "differ");
    }
    free(one);

    /* the CPU backend on pages of its own holding the same rows: within both bounds */
    kv_kvcache *kc = NULL;
    bad = -1;
    if (kv_kvcache_create_bare(1, a->n_kv, hd, hdv, n_ctx, a->kt, a->vt, a->pt, &kc, &g_err) == KV_OK) {
        float *cpu = xmalloc(sizeof(float) * no);
        float *work = xmalloc(sizeof(float) * g_cpu.attn_scratch(&g_cpu, &ap, a->T));
        g_cpu.kv_store(&g_cpu, kc, 0, 0, n_ctx, k, v);
        g_cpu.attention(&g_cpu, kc, &ap, q, a->T, a->pos0, cpu, work);
        bad = 0;
        for (size_t i = 0; i < no; i++) bad += !(fabs((double)got[i] - cpu[i]) <= 2 * tol[i]);
        free(cpu), free(work);
        kv_kvcache_free(kc);
    }
    snprintf(name, sizeof name, "attention %s: within twice the bound of the CPU backend", label);
    report(st == KV_OK && bad == 0, name, "%d outside", bad);

    pages_free(&tp);
    kvcl_buf_free(qb), kvcl_buf_free(ob);
    free(k), free(v), free(q), free(got), free(again), free(Ks), free(Vs), free(ref), free(tol);
    g_att_seq++;
}

static void test_attention(kvcl_ctx *c) {
    const int F16 = KV_TYPE_F16, F32 = KV_TYPE_F32, Q8 = KV_TYPE_Q8_0, Q4 = KV_TYPE_Q4_0;
    const att_case cases[] = {
        /* n_kv G  hd  hdv  kt   vt   pos0  T  window pt cap */
        {2, 4, 64, 64, F16, F16, 699, 1, 0, 16, 0},     /* decode, keys split in slices of 256 */
        {3, 3, 128, 128, Q8, Q8, 299, 1, 100, 64, 0},   /* GQA 3, window, Q8_0 pages */
        {2, 1, 256, 256, F32, F16, 12, 33, 0, 16, 30},  /* prefill, head 256, soft cap */
        {16, 1, 64, 64, F16, F16, 5, 80, 17, 32, 0},    /* many groups: no split */
        {2, 3, 128, 128, Q8, F16, 250, 7, 0, 64, 0},    /* short prefill after a long context: split */
        {1, 4, 128, 64, F16, Q8, 0, 1, 0, 16, 0},       /* the first token; V smaller than K */
        {1, 4, 256, 256, F16, F16, 2048, 1, 512, 128, 0}, /* gemma's local layers at depth */
        {4, 4, 64, 64, F16, F16, 37, 50, 0, 16, 0},     /* GQA 4 prefill */
        {2, 1, 128, 128, F32, F32, 3, 1, 2, 16, 50},    /* tiny window */
        {3, 3, 64, 64, Q4, Q4, 299, 1, 100, 64, 0},     /* Q4_0 pages, decode, window */
        {2, 3, 128, 64, Q4, Q8, 250, 7, 0, 32, 0},      /* Q4_0 K, Q8_0 V, short prefill after a context */
    };
    kvcl_options grp = {.cache_dir = g_cache, .gemv = KVCL_GEMV_GROUP};
    kvcl_ctx *cg = open_ctx(&grp);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) test_attention_case(c, cg, &cases[i]);
    kvcl_close(cg);
}

/* ==== records written with a product's input ========================================= */

/* rmsnorm, ffn_act and attention write the integer kernels' records of
 * their output (kvcl_xq_target) where the device has those kernels, and
 * the product that reads the output takes them instead of quantizing it:
 * the same bits as the same input written from the host. An op between
 * them (scale here) makes them stale: the product quantizes the new values. */
static void test_records(kvcl_ctx *c, const char *label) {
    const int T_of[] = {1, 5};
    for (int producer = 0; producer < 3; producer++)
        for (int ti = 0; ti < 2; ti++)
            for (int between = 0; between < 2; between++) {
                static const char *names[] = {"rmsnorm", "ffn_act", "attention"};
                const int T = T_of[ti], n_kv = 2, G = 2, hd = 64, pos0 = 20;
                const int64_t cols = producer == 0 ? 96 : producer == 1 ? 160 : n_kv * G * hd, rows = 45;
                const size_t off = 3, n = (size_t)T * cols;
                uint8_t *wbytes[2];
                float *deq[2];
                kvcl_weight w[2];
                kv_status st = KV_OK;
                for (int i = 0; i < 2; i++) {
                    random_weight(KV_TYPE_Q4_1, rows, cols, &wbytes[i], &deq[i]);
                    if (st == KV_OK) st = kvcl_weight_upload(c, KV_TYPE_Q4_1, rows, cols, wbytes[i], &w[i], &g_err);
                }
                float *a = xmalloc(sizeof(float) * n), *b = xmalloc(sizeof(float) * n), *y = xmalloc(sizeof(float) * n);
                for (size_t i = 0; i < n; i++) a[i] = frand() * 3, b[i] = frand();
                kvcl_buf *yb = dev_buf(c, NULL, sizeof(float) * (n + off)), *ab = dev_floats(c, a, n);
                kvcl_buf *bb = dev_floats(c, b, n), *wb = dev_floats(c, b, (size_t)cols);
                test_pages tp = {0};
                kvcl_buf *kb = NULL, *vb = NULL;
                if (producer == 0) {
                    if (st == KV_OK) st = kvcl_rmsnorm(c, kvcl_at(yb, off), kvcl_at(ab, 0), wb, T, cols, 1e-6f, &g_err);
                } else if (producer == 1) {
                    if (st == KV_OK) st = kvcl_write(c, yb, off * sizeof(float), a, n * sizeof(float), &g_err);
                    if (st == KV_OK) st = kvcl_ffn_act(c, kvcl_at(yb, off), kvcl_at(bb, 0), T, cols, KV_ACT_SILU, &g_err);
                } else { /* q: a (T, n_kv G, hd); keys and values: random */
                    const int n_ctx = pos0 + T;
                    float *kv = xmalloc(sizeof(float) * n_ctx * n_kv * hd);
                    for (int i = 0; i < n_ctx * n_kv * hd; i++) kv[i] = frand();
                    kb = dev_floats(c, kv, (size_t)n_ctx * n_kv * hd);
                    for (int i = 0; i < n_ctx * n_kv * hd; i++) kv[i] = frand();
                    vb = dev_floats(c, kv, (size_t)n_ctx * n_kv * hd);
                    free(kv);
                    pages_make(c, &tp, n_ctx, 16, n_kv, hd, hd, KV_TYPE_F16, KV_TYPE_F16);
                    kv_attn_params ap = {0, n_kv * G, n_kv, hd, hd, 0.125f, 0, 0.0f};
                    if (st == KV_OK) st = kvcl_kv_store(c, &tp.pg, 0, n_ctx, kvcl_at(kb, 0), kvcl_at(vb, 0), &g_err);
                    if (st == KV_OK) st = kvcl_attention(c, &tp.pg, &ap, kvcl_at(ab, 0), T, pos0, kvcl_at(yb, off), &g_err);
                }
                const bool wrote = c->xq.rec != NULL;
                if (between && st == KV_OK) st = kvcl_scale(c, kvcl_at(yb, off), (int64_t)n, 0.5f, &g_err);
                /* the product of the kernel's output, and of the same values from the host */
                float *got = xmalloc(sizeof(float) * 2 * T * rows), *want = xmalloc(sizeof(float) * 2 * T * rows);
                kvcl_buf *ob = dev_buf(c, NULL, sizeof(float) * 2 * T * rows), *yh = dev_buf(c, NULL, sizeof(float) * n);
                const kvcl_weight *wp[2] = {&w[0], &w[1]};
                kvcl_buf *bias[2] = {NULL, NULL};
                const kvcl_view yv[2] = {kvcl_at(ob, 0), kvcl_at(ob, (size_t)T * rows)};
                for (int pass = 0; pass < 2 && st == KV_OK; pass++) {
                    if (pass == 1) {
                        get_floats(c, yb, off, y, n);
                        st = kvcl_write(c, yh, 0, y, n * sizeof(float), &g_err);
                    }
                    const kvcl_view x = pass ? kvcl_at(yh, 0) : kvcl_at(yb, off);
                    /* T = 1: the fused GEMV of both weights; else one product each */
                    if (st == KV_OK) st = kvcl_matmul_n(c, 2, wp, bias, x, T, yv, &g_err);
                    if (st == KV_OK) get_floats(c, ob, 0, pass ? want : got, 2 * (size_t)T * rows);
                }
                char name[200];
                snprintf(name, sizeof name, "records from %s (%sT %d%s): the product's bits from host-written input",
                         names[producer], label, T, between ? ", then scaled: stale" : "");
                report(st == KV_OK && memcmp(got, want, sizeof(float) * 2 * T * rows) == 0, name, "%s; differ",
                       st ? g_err.msg : "");
                if (kvcl_ctx_int_dot(c) && !between) {
                    snprintf(name, sizeof name, "records from %s (%sT %d): written by the kernel", names[producer], label, T);
                    report(wrote, name, "none");
                }
                if (producer == 2) pages_free(&tp), kvcl_buf_free(kb), kvcl_buf_free(vb);
                for (int i = 0; i < 2; i++) kvcl_weight_free(&w[i]), free(wbytes[i]), free(deq[i]);
                kvcl_buf_free(yb), kvcl_buf_free(ab), kvcl_buf_free(bb), kvcl_buf_free(wb), kvcl_buf_free(ob);
                kvcl_buf_free(yh);
                free(a), free(b), free(y), free(got), free(want);
            }
}

/* kvcl_matmul_add_rmsnorm: the bits of kvcl_matmul then kvcl_add_rmsnorm
 * (one launch for a token where the device has the integer kernels: the
 * last work-group norms), launched several times in a row (its count of
 * finished groups must start at 0 every time), and the records it leaves
 * for the next product */
static void test_matmul_add_rmsnorm(kvcl_ctx *c, const char *label) {
    static const struct {
        int type, T;
        int64_t cols, n;
        bool weight;
    } cases[] = {
        {KV_TYPE_Q4_1, 1, 576, 576, true},  {KV_TYPE_Q4_0, 1, 1536, 576, true}, {KV_TYPE_Q8_0, 1, 256, 80, false},
        {KV_TYPE_Q5_1, 1, 64, 2080, true},  {KV_TYPE_Q4_1, 3, 576, 576, true},  {KV_TYPE_F16, 1, 96, 160, true},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int type = cases[ci].type, T = cases[ci].T;
        const int64_t cols = cases[ci].cols, n = cases[ci].n;
        uint8_t *wbytes, *nbytes;
        float *deq, *ndeq;
        random_weight(type, n, cols, &wbytes, &deq);
        random_weight(KV_TYPE_Q8_0, 40, n % 32 ? 32 : n, &nbytes, &ndeq); /* a product of the normed rows */
        kvcl_weight w, next;
        kv_status st = kvcl_weight_upload(c, type, n, cols, wbytes, &w, &g_err);
        const bool have_next = n % 32 == 0;
        if (st == KV_OK && have_next) st = kvcl_weight_upload(c, KV_TYPE_Q8_0, 40, n, nbytes, &next, &g_err);
        float *x = xmalloc(sizeof(float) * T * cols), *r = xmalloc(sizeof(float) * T * n), *nw = xmalloc(sizeof(float) * n);
        for (int64_t i = 0; i < T * cols; i++) x[i] = frand();
        for (int64_t i = 0; i < T * n; i++) r[i] = frand() * 2;
        for (int64_t i = 0; i < n; i++) nw[i] = frand() + 1.0f;
        kvcl_buf *xb = dev_floats(c, x, T * cols), *nb = cases[ci].weight ? dev_floats(c, nw, n) : NULL;
        kvcl_buf *r1 = dev_floats(c, r, T * n), *r2 = dev_floats(c, r, T * n);
        kvcl_buf *y1 = dev_buf(c, NULL, sizeof(float) * (T * n + 2)), *y2 = dev_buf(c, NULL, sizeof(float) * T * n);
        kvcl_buf *p1 = dev_buf(c, NULL, sizeof(float) * T * 40), *p2 = dev_buf(c, NULL, sizeof(float) * T * 40);
        int differ = 0, rounds = 0;
        for (int round = 0; round < 3 && st == KV_OK; round++, rounds++) { /* r accumulates: 3 different inputs */
            st = kvcl_matmul_add_rmsnorm(c, &w, kvcl_at(xb, 0), T, kvcl_at(r1, 0), kvcl_at(y1, 2), nb, 1e-5f, &g_err);
            if (st == KV_OK && have_next) st = kvcl_matmul(c, &next, NULL, kvcl_at(y1, 2), T, kvcl_at(p1, 0), 40, &g_err);
            if (st == KV_OK) st = kvcl_matmul(c, &w, NULL, kvcl_at(xb, 0), T, kvcl_at(y2, 0), n, &g_err);
            if (st == KV_OK)
                st = kvcl_add_rmsnorm(c, kvcl_at(r2, 0), kvcl_at(y2, 0), kvcl_at(y2, 0), nb, T, n, 1e-5f, &g_err);
            if (st == KV_OK && have_next) { /* y2 from the host: the product quantizes it */
                st = rewrite_from_host(c, y2, T * n);
                if (st == KV_OK) st = kvcl_matmul(c, &next, NULL, kvcl_at(y2, 0), T, kvcl_at(p2, 0), 40, &g_err);
            }
            if (st != KV_OK) break;
            differ += device_differ(c, y1, 2, y2, 0, T * n) + device_differ(c, r1, 0, r2, 0, T * n);
            if (have_next) differ += device_differ(c, p1, 0, p2, 0, T * 40);
        }
        char name[200];
        snprintf(name, sizeof name, "matmul_add_rmsnorm %s%s (%lld x %lld, T %d%s): the bits of matmul, add_rmsnorm%s",
                 label, tname(type), (long long)n, (long long)cols, T, cases[ci].weight ? "" : ", no weight",
                 have_next ? " and the next product" : "");
        report(st == KV_OK && rounds == 3 && differ == 0, name, "%s; %d values differ", st ? g_err.msg : "", differ);
        kvcl_weight_free(&w);
        if (have_next) kvcl_weight_free(&next);
        kvcl_buf_free(xb), kvcl_buf_free(nb), kvcl_buf_free(r1), kvcl_buf_free(r2), kvcl_buf_free(y1);
        kvcl_buf_free(y2), kvcl_buf_free(p1), kvcl_buf_free(p2);
        free(wbytes), free(nbytes), free(deq), free(ndeq), free(x), free(r), free(nw);
    }
}

/* kvcl_matmul_act: the bits of kvcl_matmul_n (gate, up) then kvcl_ffn_act
 * (one launch for a token on an integer-kernel device), and the records
 * it leaves for the down product */
static void test_matmul_act(kvcl_ctx *c, const char *label) {
    static const struct {
        int type, T, act;
        int64_t cols, n;
    } cases[] = {
        {KV_TYPE_Q4_1, 1, KV_ACT_SILU, 576, 1536},     {KV_TYPE_Q8_0, 1, KV_ACT_GELU_TANH, 640, 2048},
        {KV_TYPE_Q4_0, 1, KV_ACT_SILU, 96, 72},        {KV_TYPE_Q5_0, 3, KV_ACT_GELU_TANH, 256, 320},
        {KV_TYPE_F16, 1, KV_ACT_SILU, 64, 96},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int type = cases[ci].type, T = cases[ci].T, act = cases[ci].act;
        const int64_t cols = cases[ci].cols, n = cases[ci].n;
        uint8_t *gb, *ub, *db;
        float *gd, *ud, *dd;
        random_weight(type, n, cols, &gb, &gd);
        random_weight(type, n, cols, &ub, &ud);
        random_weight(KV_TYPE_Q4_1, 24, n % 32 ? 32 : n, &db, &dd); /* the down product */
        kvcl_weight wg, wu, wd;
        kv_status st = kvcl_weight_upload(c, type, n, cols, gb, &wg, &g_err);
        if (st == KV_OK) st = kvcl_weight_upload(c, type, n, cols, ub, &wu, &g_err);
        const bool have_down = n % 32 == 0;
        if (st == KV_OK && have_down) st = kvcl_weight_upload(c, KV_TYPE_Q4_1, 24, n, db, &wd, &g_err);
        float *x = xmalloc(sizeof(float) * T * cols);
        for (int64_t i = 0; i < T * cols; i++) x[i] = frand() * 2;
        kvcl_buf *xb = dev_floats(c, x, T * cols), *g1 = dev_buf(c, NULL, sizeof(float) * (T * n + 1));
        kvcl_buf *u1 = dev_buf(c, NULL, sizeof(float) * T * n), *g2 = dev_buf(c, NULL, sizeof(float) * T * n);
        kvcl_buf *u2 = dev_buf(c, NULL, sizeof(float) * T * n);
        kvcl_buf *d1 = dev_buf(c, NULL, sizeof(float) * T * 24), *d2 = dev_buf(c, NULL, sizeof(float) * T * 24);
        if (st == KV_OK) st = kvcl_matmul_act(c, &wg, &wu, kvcl_at(xb, 0), T, kvcl_at(g1, 1), kvcl_at(u1, 0), act, &g_err);
        if (st == KV_OK && have_down) st = kvcl_matmul(c, &wd, NULL, kvcl_at(g1, 1), T, kvcl_at(d1, 0), 24, &g_err);
        const kvcl_weight *w2[2] = {&wg, &wu};
        kvcl_buf *bias[2] = {NULL, NULL};
        const kvcl_view y2[2] = {kvcl_at(g2, 0), kvcl_at(u2, 0)};
        if (st == KV_OK) st = kvcl_matmul_n(c, 2, w2, bias, kvcl_at(xb, 0), T, y2, &g_err);
        if (st == KV_OK) st = kvcl_ffn_act(c, kvcl_at(g2, 0), kvcl_at(u2, 0), T, n, act, &g_err);
        if (st == KV_OK && have_down) { /* g2 from the host: the down product quantizes it */
            st = rewrite_from_host(c, g2, T * n);
            if (st == KV_OK) st = kvcl_matmul(c, &wd, NULL, kvcl_at(g2, 0), T, kvcl_at(d2, 0), 24, &g_err);
        }
        int differ = 0;
        if (st == KV_OK) {
            differ += device_differ(c, g1, 1, g2, 0, T * n);
            if (have_down) differ += device_differ(c, d1, 0, d2, 0, T * 24);
        }
        char name[200];
        snprintf(name, sizeof name, "matmul_act %s%s %s (%lld x %lld, T %d): the bits of matmul_n, ffn_act%s", label,
                 tname(type), act == KV_ACT_SILU ? "silu" : "gelu", (long long)n, (long long)cols, T,
                 have_down ? " and the down product" : "");
        report(st == KV_OK && differ == 0, name, "%s; %d values differ", st ? g_err.msg : "", differ);
        kvcl_weight_free(&wg), kvcl_weight_free(&wu);
        if (have_down) kvcl_weight_free(&wd);
        kvcl_buf_free(xb), kvcl_buf_free(g1), kvcl_buf_free(u1), kvcl_buf_free(g2), kvcl_buf_free(u2);
        kvcl_buf_free(d1), kvcl_buf_free(d2);
        free(gb), free(ub), free(db), free(gd), free(ud), free(dd), free(x);
    }
}

/* kvcl_rope_qk_store: the q and k of kvcl_rope_qk and the page bytes of
 * kvcl_kv_store after it, in one launch (F16 and F32 pages); quantized
 * pages: KV_ERR_UNSUPPORTED */
static void test_rope_qk_store(kvcl_ctx *c) {
    for (int ci = 0; ci < 6; ci++) {
        const int hd = ci % 3 == 2 ? 256 : ci % 2 ? 128 : 64, hdv = ci == 4 ? hd / 2 : ci == 5 ? 2 * hd : hd;
        const int n_head = 2 + irand(7), n_kv = 1 + irand(3), T = ci < 2 ? 1 : 1 + irand(20), pos0 = irand(200);
        const int kt = ci % 2 ? KV_TYPE_F32 : KV_TYPE_F16, vt = ci == 3 ? KV_TYPE_F32 : KV_TYPE_F16;
        kv_rope_params rp = {ci % 2 ? KV_ROPE_NEOX : KV_ROPE_NORM, ci == 3 ? hd / 2 : hd, 10000.0f, 1.0f, NULL};
        const float q_scale = ci % 3 == 1 ? 0.0625f : 1.0f;
        const int64_t nq = (int64_t)T * n_head * hd, nk = (int64_t)T * n_kv * hd, nv = (int64_t)T * n_kv * hdv;
        int32_t *pos = xmalloc(sizeof(int32_t) * T);
        float *q = xmalloc(sizeof(float) * nq), *k = xmalloc(sizeof(float) * nk), *v = xmalloc(sizeof(float) * nv);
        for (int t = 0; t < T; t++) pos[t] = pos0 + t;
        for (int64_t i = 0; i < nq; i++) q[i] = frand();
        for (int64_t i = 0; i < nk; i++) k[i] = frand();
        for (int64_t i = 0; i < nv; i++) v[i] = frand();
        test_pages pa, pb;
        pages_make(c, &pa, pos0 + T, 16, n_kv, hd, hdv, kt, vt);
        pages_make(c, &pb, pos0 + T, 16, n_kv, hd, hdv, kt, vt);
        kvcl_write(c, pb.pg.tab, 0, pa.tab, sizeof(int32_t) * pa.pg.max_pages, &g_err); /* the same table */
        kvcl_buf *posb = dev_buf(c, pos, sizeof(int32_t) * T), *vb = dev_floats(c, v, nv);
        kvcl_buf *qa = dev_floats(c, q, nq), *ka = dev_floats(c, k, nk), *qb = dev_floats(c, q, nq), *kb = dev_floats(c, k, nk);
        kv_status st = kvcl_rope_qk(c, kvcl_at(qa, 0), kvcl_at(ka, 0), T, n_head, n_kv, hd, posb, &rp, NULL, q_scale, &g_err);
        if (st == KV_OK) st = kvcl_kv_store(c, &pa.pg, pos0, T, kvcl_at(ka, 0), kvcl_at(vb, 0), &g_err);
        if (st == KV_OK)
            st = kvcl_rope_qk_store(c, kvcl_at(qb, 0), kvcl_at(kb, 0), kvcl_at(vb, 0), T, n_head, n_kv, hd, posb, &rp,
                                    NULL, q_scale, &pb.pg, pos0, &g_err);
        int differ = 0;
        if (st == KV_OK)
            differ = device_differ(c, qa, 0, qb, 0, nq) + device_differ(c, ka, 0, kb, 0, nk) +
                     bytes_differ(c, pa.pg.k, pb.pg.k, pa.kbytes) + bytes_differ(c, pa.pg.v, pb.pg.v, pa.vbytes);
        char name[200];
        snprintf(name, sizeof name, "rope_qk_store %s hd %d/%d %s/%s heads %d/%d T %d at %d: the bits of rope_qk, then kv_store",
                 rp.mode == KV_ROPE_NEOX ? "neox" : "norm", hd, hdv, tname(kt), tname(vt), n_head, n_kv, T, pos0);
        report(st == KV_OK && differ == 0, name, "%s; %d differ", st ? g_err.msg : "", differ);
        pages_free(&pa), pages_free(&pb);
        kvcl_buf_free(posb), kvcl_buf_free(vb), kvcl_buf_free(qa), kvcl_buf_free(ka), kvcl_buf_free(qb), kvcl_buf_free(kb);
        free(pos), free(q), free(k), free(v);
    }
    /* quantized pages: refused before anything is queued */
    test_pages pq;
    pages_make(c, &pq, 8, 16, 1, 64, 64, KV_TYPE_Q8_0, KV_TYPE_F16);
    float z[64] = {0};
    int32_t p0 = 0;
    kvcl_buf *pb = dev_buf(c, &p0, sizeof p0), *zb = dev_floats(c, z, 64), *zq = dev_floats(c, z, 64);
    kvcl_buf *zv = dev_floats(c, z, 64);
    kv_rope_params rp = {KV_ROPE_NORM, 64, 10000.0f, 1.0f, NULL};
    kv_status st = kvcl_rope_qk_store(c, kvcl_at(zq, 0), kvcl_at(zb, 0), kvcl_at(zv, 0), 1, 1, 1, 64, pb, &rp, NULL, 1.0f,
                                      &pq.pg, 0, &g_err);
    report(st == KV_ERR_UNSUPPORTED && kvcl_ctx_status(c, &g_err) == KV_OK, "rope_qk_store on Q8_0 pages: refused, the context still usable",
           "status %d", (int)st);
    pages_free(&pq);
    kvcl_buf_free(pb), kvcl_buf_free(zb), kvcl_buf_free(zq), kvcl_buf_free(zv);
}

/* ==== main ======================================================================= */

/* ==== a row's bits whatever T it comes with ========================================== */

/* The engine's exactness (a prefill split anywhere, a prefix reused from
 * pages, tokens decoded one at a time: the same bits) needs every op to
 * give a row the bits it gets among any other rows. Attention: T query
 * rows at once against the same rows in chunks (a work-group per key
 * segment or one work-group for all keys, the ROW context's attention_row
 * and the work-group kernel for single tokens); with windows that start
 * inside a tile, head sizes whose tiles do not divide a segment (80: 51
 * keys), and more query rows than a segment. */
static void test_attention_rows(kvcl_ctx *c) {
    kvcl_options grp = {.cache_dir = g_cache, .gemv = KVCL_GEMV_GROUP};
    kvcl_ctx *cg = open_ctx(&grp);
    const int F16 = KV_TYPE_F16, F32 = KV_TYPE_F32, Q8 = KV_TYPE_Q8_0;
    const att_case cases[] = {
        /* n_kv G  hd  hdv  kt   vt   pos0  T   window pt cap */
        {16, 1, 64, 64, F16, F16, 200, 128, 0, 16, 0},  /* 128 rows: one work-group; chunks: one per segment */
        {3, 3, 64, 64, F16, F16, 172, 128, 0, 16, 0},   /* SmolLM2's heads */
        {3, 3, 64, 64, Q8, Q8, 300, 100, 77, 16, 0},    /* a window that starts inside a tile */
        {8, 2, 256, 256, F16, F16, 250, 80, 300, 32, 0}, /* head 256: tiles of 16 keys */
        {16, 1, 80, 80, F32, F32, 260, 100, 0, 16, 0},  /* head 80: tiles of 51 keys */
        {16, 1, 64, 64, F16, F16, 0, 300, 0, 16, 20},   /* keys from 0, soft cap */
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const att_case *a = &cases[ci];
        const int n_head = a->n_kv * a->G, n_ctx = a->pos0 + a->T;
        const size_t nk = (size_t)n_ctx * a->n_kv * a->hd, nv = (size_t)n_ctx * a->n_kv * a->hdv;
        const size_t qrow = (size_t)n_head * a->hd, orow = (size_t)n_head * a->hdv;
        float *k = xmalloc(sizeof(float) * nk), *v = xmalloc(sizeof(float) * nv), *q = xmalloc(sizeof(float) * a->T * qrow);
        float *all = xmalloc(sizeof(float) * a->T * orow), *part = xmalloc(sizeof(float) * a->T * orow);
        for (size_t i = 0; i < nk; i++) k[i] = frand() * 2;
        for (size_t i = 0; i < nv; i++) v[i] = frand();
        for (size_t i = 0; i < a->T * qrow; i++) q[i] = frand() * 2;
        bool ok = attention_on(c, a, q, k, v, all);
        /* chunks [t0, t1): each cut list in turn, then single rows on both contexts */
        const int cuts[][4] = {{1, 0}, {44, 0}, {a->T / 2, a->T - 1}, {13, 64}, {a->T - 1, 0}};
        int differ = 0, runs = 0;
        for (size_t li = 0; ok && li < sizeof cuts / sizeof cuts[0]; li++) {
            int t0 = 0;
            for (int j = 0; ok && j <= 2; j++) {
                const int t1 = j < 2 && cuts[li][j] > t0 && cuts[li][j] < a->T ? cuts[li][j] : a->T;
                att_case sub = *a;
                sub.pos0 = a->pos0 + t0, sub.T = t1 - t0;
                ok = attention_on(c, &sub, q + t0 * qrow, k, v, part + t0 * orow);
                runs++;
                if ((t0 = t1) == a->T) break;
            }
            differ += ok ? (int)(a->T * orow) - count_exact(all, part, (int64_t)(a->T * orow)) : 0;
        }
        const int rows[] = {0, 1, a->T / 2, a->T - 1};
        for (int ri = 0; ok && ri < 4; ri++)
            for (int ctx = 0; ok && ctx < 2; ctx++) {
                att_case one = *a;
                one.pos0 = a->pos0 + rows[ri], one.T = 1;
                ok = attention_on(ctx ? cg : c, &one, q + rows[ri] * qrow, k, v, part);
                differ += ok ? (int)orow - count_exact(all + rows[ri] * orow, part, (int64_t)orow) : 0;
                runs++;
            }
        char name[240];
        snprintf(name, sizeof name,
                 "attention kv %d x G %d, hd %d, %s, %d rows at %d, window %d: the same bits in chunks and alone (%d runs)",
                 a->n_kv, a->G, a->hd, tname(a->kt), a->T, a->pos0, a->window, runs);
        report(ok && differ == 0, name, "%s; %d values differ", ok ? "" : g_err.msg, differ);
        free(k), free(v), free(q), free(all), free(part);
    }
    kvcl_close(cg);
}

/* The fused decode launches read their input's records and write their
 * output's; where both have one width (n_ff = n_embd, or attention's width
 * = n_embd) they must not be one buffer: matmul_act's groups write the
 * gate's records while others still read the input's. A token through
 * matmul_add_rmsnorm, matmul_act and the down product alone gets the bits
 * it gets among three (the tiled prefill, no fused launch). */
static void test_fused_rows(kvcl_ctx *c, const char *label) {
    const int type = KV_TYPE_Q8_0, T = 3;
    const int64_t n = 256;
    uint8_t *wb[4];
    float *wd[4];
    kvcl_weight w[4]; /* wo, gate, up, down: all n x n */
    kv_status st = KV_OK;
    for (int i = 0; i < 4; i++) {
        random_weight(type, n, n, &wb[i], &wd[i]);
        if (st == KV_OK) st = kvcl_weight_upload(c, type, n, n, wb[i], &w[i], &g_err);
    }
    float *x = xmalloc(sizeof(float) * T * n), *r = xmalloc(sizeof(float) * T * n), *nw = xmalloc(sizeof(float) * n);
    for (int64_t i = 0; i < T * n; i++) x[i] = frand(), r[i] = frand() * 2;
    for (int64_t i = 0; i < n; i++) nw[i] = frand() + 1.0f;
    kvcl_buf *nb = dev_floats(c, nw, n), *xb = dev_floats(c, x, T * n), *out[2] = {NULL, NULL};
    for (int pass = 0; pass < 2; pass++) { /* all T rows at once, then each row alone */
        kvcl_buf *rb = dev_floats(c, r, T * n), *yb = dev_buf(c, NULL, sizeof(float) * T * n);
        kvcl_buf *gb = dev_buf(c, NULL, sizeof(float) * T * n), *ub = dev_buf(c, NULL, sizeof(float) * T * n);
        out[pass] = dev_buf(c, NULL, sizeof(float) * T * n);
        for (int t0 = 0, tn = pass ? 1 : T; st == KV_OK && t0 < T; t0 += tn) {
            st = kvcl_matmul_add_rmsnorm(c, &w[0], kvcl_at(xb, t0 * n), tn, kvcl_at(rb, t0 * n), kvcl_at(yb, t0 * n), nb,
                                         1e-5f, &g_err);
            if (st == KV_OK)
                st = kvcl_matmul_act(c, &w[1], &w[2], kvcl_at(yb, t0 * n), tn, kvcl_at(gb, t0 * n), kvcl_at(ub, t0 * n),
                                     KV_ACT_SILU, &g_err);
            if (st == KV_OK)
                st = kvcl_matmul(c, &w[3], NULL, kvcl_at(gb, t0 * n), tn, kvcl_at(out[pass], t0 * n), n, &g_err);
        }
        kvcl_buf_free(rb), kvcl_buf_free(yb), kvcl_buf_free(gb), kvcl_buf_free(ub);
    }
    const int differ = st == KV_OK ? device_differ(c, out[0], 0, out[1], 0, T * n) : -1;
    char name[200];
    snprintf(name, sizeof name, "%smatmul_add_rmsnorm, matmul_act, down (%s, n_ff = n_embd = %lld): a token alone gets "
             "its bits among %d", label, tname(type), (long long)n, T);
    report(st == KV_OK && differ == 0, name, "%s; %d values differ", st ? g_err.msg : "", differ);
    for (int i = 0; i < 4; i++) kvcl_weight_free(&w[i]), free(wb[i]), free(wd[i]);
    kvcl_buf_free(nb), kvcl_buf_free(xb), kvcl_buf_free(out[0]), kvcl_buf_free(out[1]);
    free(x), free(r), free(nw);
}

int main(void) {
    setenv("KVLUA_SIMD", "scalar", 1); /* the reference: the engine's portable path */
    kvcl_device_info info;
    if (kvcl_devices(&info, 1) == 0) return kvt_skip("no OpenCL device");
    printf("device: %s (%s, %s)\n", info.name, info.platform, info.type);
    snprintf(g_cache, sizeof g_cache, "/tmp/kvcl-test-XXXXXX");
    if (!mkdtemp(g_cache)) return kvt_skip("no temporary directory");
    if (kv_pool_create(1, &g_pool, &g_err) != KV_OK || kv_backend_cpu_init(&g_cpu, g_pool, &g_err) != KV_OK) {
        printf("cpu backend: %s\n", g_err.msg);
        return 2;
    }

    test_program_cache();
    test_open_errors();
    test_failed_launch();
    test_contraction_off();
    test_prefill_choice();

    kvcl_options o = {.cache_dir = g_cache};
    g_c = open_ctx(&o);
    printf("     (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K products: %s)\n",
           kvcl_ctx_vnni(g_c) ? "integer kernels, vpdpbusd" : kvcl_ctx_int_dot(g_c) ? "integer kernels" : "float kernels");
    /* weights split into parts of at most 32 KiB */
    kvcl_options small = {.cache_dir = g_cache, .max_alloc = 32 << 10};
    kvcl_ctx *split = open_ctx(&small);

    test_out_of_memory(g_c, "");
    test_out_of_memory_odd();
    test_embed_on(g_c, "");
    test_embed_on(split, "split");

    const int all_paths[] = {KVCL_MM_GEMV, KVCL_MM_TILED, KVCL_MM_CLBLAST};
    test_matmul_on(g_c, "", all_paths, 3, true);
    test_matmul_on(split, "split", all_paths, 3, false);
    test_gemv_tiled_same(g_c);
    test_packed_rows(g_c, "");
    test_matmul_n(g_c);
    test_matmul_n(split);
    kvcl_options nov = {.cache_dir = g_cache, .no_vnni = true};
    kvcl_ctx *cv = open_ctx(&nov); /* the integer kernels' pmaddubsw sums where the CPU has vpdpbusd */
    report(!kvcl_ctx_vnni(cv), "no_vnni: the integer kernels without vpdpbusd", "it has them");
    test_packed_rows(cv, "no vpdpbusd");
    test_matmul_on(cv, "no vpdpbusd", all_paths, 2, true);
    test_matmul_n(cv);
    kvcl_close(cv);
    kvcl_options grp = {.cache_dir = g_cache, .gemv = KVCL_GEMV_GROUP};
    kvcl_ctx *cg = open_ctx(&grp);
    test_matmul_on(cg, "", all_paths, 1, false);
    test_matmul_add_rmsnorm(cg, "gemv-group ");
    test_matmul_act(cg, "gemv-group ");
    kvcl_close(cg);

    test_rmsnorm(g_c, "", 4);
    kvcl_options port = {.cache_dir = g_cache, .portable = true};
    kvcl_ctx *cp = open_ctx(&port);
    test_rmsnorm(cp, " (no fp64)", 8);
    /* the float kernels of the types the integer path takes elsewhere */
    report(!kvcl_ctx_int_dot(cp), "portable build: no integer kernels", "it has them");
    test_matmul_on(cp, "portable", all_paths, 2, true);
    test_gemv_tiled_same(cp);
    test_matmul_n(cp);
    kvcl_close(cp);
    test_add_rmsnorm(g_c);
    test_rope(g_c);
    test_rope_qk(g_c);
    test_rope_qk_store(g_c);
    test_pointwise(g_c);
    test_all_finite(g_c);
    test_hadamard(g_c);
    test_attention(g_c);
    test_attention_rows(g_c);
    test_fused_rows(g_c, "");
    test_records(g_c, "");
    test_records(split, "split, ");
    test_matmul_add_rmsnorm(g_c, "");
    test_matmul_add_rmsnorm(split, "split ");
    test_matmul_act(g_c, "");
    test_matmul_act(split, "split ");
    kvcl_options nod = {.cache_dir = g_cache, .no_fp64 = true};
    kvcl_ctx *cn = open_ctx(&nod); /* rmsnorm's float sums, with the integer kernels where they exist */
    test_rmsnorm(cn, " (no fp64, integer kernels)", 8);
    test_matmul_add_rmsnorm(cn, "no fp64 ");
    kvcl_close(cn);

    kvcl_close(split);
    kvcl_close(g_c);
    kv_backend_cpu_free(&g_cpu);
    kv_pool_destroy(g_pool);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_cache);
    if (system(cmd) != 0) printf("could not remove %s\n", g_cache);
    return kvt_finish();
}
#endif
