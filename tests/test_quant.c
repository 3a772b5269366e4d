/*
 * test_quant.c — the block formats and CPU kernels against references:
 *   - f16 conversion, exhaustive over all 65536 halves (independent formula)
 *   - dequantization bit for bit against gguf-python (tests/fixtures)
 *   - quantize -> dequantize round-trip error bounds for every type
 *   - activation quantizers of the fast path == the scalar reference, byte for byte
 *   - the scalar dot == float dot of the dequantized rows; the fast dot == scalar dot
 *   - kv_matmul == naive float product for many shapes, 1 and 2 threads
 *   - kv_matmul is batch invariant: a token's row of y has the same bits
 *     whatever else is in the batch (T = 1 decode or a tile of the prefill,
 *     any position in it) and whatever the thread count
 *   - kv_matmul_n (several weights of one x, mixed dot types) == kv_matmul each
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "quant_impl.h"

#include "check.h"

/* ---- helpers ---------------------------------------------------------------- */

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 16);
}
static float frand(void) { return (float)rnd() / 4294967296.0f * 2.0f - 1.0f; } /* [-1, 1) */
static float nrand(void) { /* roughly normal */
    float s = 0;
    for (int i = 0; i < 4; i++) s += frand();
    return s * 0.866f;
}

static float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t f_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { printf("out of memory\n"); exit(2); }
    return p;
}

static const int k_wtypes[] = {KV_TYPE_F32, KV_TYPE_F16, KV_TYPE_BF16, KV_TYPE_Q4_0,
                               KV_TYPE_Q4_1, KV_TYPE_Q5_0, KV_TYPE_Q5_1, KV_TYPE_Q8_0,
                               KV_TYPE_Q4_K, KV_TYPE_Q5_K, KV_TYPE_Q6_K};
#define N_WTYPES (int)(sizeof k_wtypes / sizeof k_wtypes[0])

static const char *tname(int t) { return kv_type_traits_get(t)->name; }
static int blck(int t) { return kv_type_traits_get(t)->blck; }

/* ---- f16 ------------------------------------------------------------------------ */

static double f16_formula(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return s ? -v : v;
}

static void test_f16(void) {
    int bad = 0, bad_rt = 0, bad_mid = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kv_f16_to_f32((uint16_t)h);
        int e = (h >> 10) & 31;
        if (e == 31) {
            if ((h & 1023) == 0) { if (!(isinf(f) && (signbit(f) != 0) == (h >> 15))) bad++; }
            else if (!isnan(f)) bad++;
            continue;
        }
        if ((double)f != f16_formula((uint16_t)h) || (signbit(f) != 0) != (int)(h >> 15)) bad++;
        if (kv_f32_to_f16(f) != h) bad_rt++;
        /* the midpoint to the next half up (in magnitude) rounds to the even one */
        if ((h & 0x7FFF) < 0x7BFF) {
            double a = f16_formula((uint16_t)h), b = f16_formula((uint16_t)(h + 1));
            float mid = (float)((a + b) / 2); /* exact in float */
            uint16_t want = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
            if (kv_f32_to_f16(mid) != want) bad_mid++;
            /* just above / below the midpoint */
            float up = nextafterf(mid, (h >> 15) ? -INFINITY : INFINITY);
            float dn = nextafterf(mid, (h >> 15) ? INFINITY : -INFINITY);
            if (kv_f32_to_f16(up) != (uint16_t)(h + 1) || kv_f32_to_f16(dn) != h) bad_mid++;
        }
    }
    CHECK(bad == 0, "f16->f32 mismatches: %d", bad);
    CHECK(bad_rt == 0, "f16 round trip mismatches: %d", bad_rt);
    CHECK(bad_mid == 0, "f32->f16 rounding mismatches: %d", bad_mid);
    CHECK(kv_f32_to_f16(65520.0f) == 0x7C00 && kv_f32_to_f16(65519.99f) == 0x7BFF, "overflow edge");
    CHECK(kv_f32_to_f16(1e30f) == 0x7C00 && kv_f32_to_f16(-INFINITY) == 0xFC00, "inf");
    CHECK((kv_f32_to_f16(NAN) & 0x7C00) == 0x7C00 && (kv_f32_to_f16(NAN) & 0x3FF), "nan");
    CHECK(kv_f32_to_f16(bits_f(0x33000000)) == 0 && kv_f32_to_f16(bits_f(0x33000001)) == 1,
          "smallest subnormal rounding");
    /* row helpers agree with the scalar ones */
    uint16_t hs[1000];
    float fs[1000], back[1000];
    for (int i = 0; i < 1000; i++) fs[i] = nrand() * 100;
    kv_f32_to_f16_row(fs, hs, 1000);
    kv_f16_to_f32_row(hs, back, 1000);
    int okrow = 1;
    for (int i = 0; i < 1000; i++)
        if (hs[i] != kv_f32_to_f16(fs[i]) || f_bits(back[i]) != f_bits(kv_f16_to_f32(hs[i]))) okrow = 0;
    CHECK(okrow, "f16 row conversions");
    /* the row versions (F16C where available) over all halves and midpoints */
    static uint16_t all[65536], back16[65536];
    static float allf[65536], mid[65536];
    for (uint32_t h = 0; h < 65536; h++) all[h] = (uint16_t)h;
    kv_f16_to_f32_row(all, allf, 65536);
    int badrow = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float r = kv_f16_to_f32((uint16_t)h);
        if (isnan(r) ? !isnan(allf[h]) : f_bits(r) != f_bits(allf[h])) badrow++;
        mid[h] = (h & 0x7FFF) < 0x7BFF ? (float)((f16_formula((uint16_t)h) + f16_formula((uint16_t)(h + 1))) / 2)
                                       : r;
    }
    CHECK(badrow == 0, "f16->f32 row: %d mismatches", badrow);
    badrow = 0;
    for (int pass = 0; pass < 2; pass++) {
        const float *src = pass ? mid : allf;
        kv_f32_to_f16_row(src, back16, 65536);
        for (uint32_t h = 0; h < 65536; h++) {
            if (isnan(src[h])) continue;
            if (back16[h] != kv_f32_to_f16(src[h])) badrow++;
        }
    }
    CHECK(badrow == 0, "f32->f16 row: %d mismatches", badrow);
    CHECK(kv_bf16_to_f32(0x3F80) == 1.0f && kv_bf16_to_f32(0xC000) == -2.0f, "bf16");
}

/* ---- dequantize vs gguf-python ------------------------------------------------------- */

static void test_fixture(void) {
    const char *path = "tests/fixtures/quant_dequant.bin";
    FILE *f = fopen(path, "rb");
    char alt[1024];
    if (!f) { /* not run from the repo root: next to this source file */
        const char *slash = strrchr(__FILE__, '/');
        int dl = slash ? (int)(slash - __FILE__) : 0;
        snprintf(alt, sizeof alt, "%.*s/fixtures/quant_dequant.bin", dl, __FILE__);
        if (slash && (f = fopen(alt, "rb")) != NULL) path = alt;
    }
    CHECK(f != NULL, "open %s (run from the repo root)", path);
    if (!f) return;
    int ntypes = 0;
    uint32_t hdr[3];
    while (fread(hdr, 4, 3, f) == 3) {
        int type = (int)hdr[0];
        uint32_t n = hdr[1], nbytes = hdr[2];
        CHECK(kv_row_size(type, n) == nbytes, "fixture %d sizes", type);
        if (kv_row_size(type, n) != nbytes || n > (1u << 20)) break;
        uint8_t *raw = xmalloc(nbytes);
        float *want = xmalloc(n * 4), *got = xmalloc(n * 4);
        if (fread(raw, 1, nbytes, f) != nbytes || fread(want, 4, n, f) != n) {
            CHECK(0, "fixture truncated");
            free(raw), free(want), free(got);
            break;
        }
        kv_dequantize_row(type, raw, got, n);
        int bad = 0;
        for (uint32_t i = 0; i < n; i++)
            if (f_bits(got[i]) != f_bits(want[i])) {
                if (bad < 3) printf("  %s[%u]: got %.9g want %.9g\n", tname(type), i, got[i], want[i]);
                bad++;
            }
        CHECK(bad == 0, "dequantize %s bit-exact vs gguf-python: %d of %u differ", tname(type), bad, n);
        ntypes++;
        free(raw), free(want), free(got);
    }
    fclose(f);
    CHECK(ntypes >= 10, "fixture types: %d", ntypes);
}

/* ---- round trips ------------------------------------------------------------------------- */

static void test_roundtrip(void) {
    static const struct { int type; double rel; } cases[] = {
        {KV_TYPE_F32, 0},        {KV_TYPE_F16, 5e-4},    {KV_TYPE_BF16, 4e-3},
        {KV_TYPE_Q4_0, 0.12},    {KV_TYPE_Q4_1, 0.10},   {KV_TYPE_Q5_0, 0.06},
        {KV_TYPE_Q5_1, 0.05},    {KV_TYPE_Q8_0, 0.006},  {KV_TYPE_Q8_1, 0.006},
        {KV_TYPE_Q8_K, 0.01},   {KV_TYPE_Q4_K, 0.12},   {KV_TYPE_Q5_K, 0.06},
        {KV_TYPE_Q6_K, 0.03},
    };
    const int n = 4096;
    float *x = xmalloc(n * 4), *y = xmalloc(n * 4);
    uint8_t *q = xmalloc(kv_row_size(KV_TYPE_F32, n));
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int t = cases[c].type;
        for (int i = 0; i < n; i++) x[i] = nrand() * (i % 512 < 256 ? 1.0f : 0.01f);
        /* a block of zeros and a constant block must survive */
        for (int i = 0; i < 256; i++) x[i] = 0;
        for (int i = 256; i < 512; i++) x[i] = 0.25f;
        int rc = kv_quantize_row(t, x, q, n);
        CHECK(rc == 0, "quantize %s", tname(t));
        kv_dequantize_row(t, q, y, n);
        double err = 0, ref = 0, zero_err = 0;
        int finite = 1;
        for (int i = 512; i < n; i++) {
            err += (double)(x[i] - y[i]) * (x[i] - y[i]);
            ref += (double)x[i] * x[i];
        }
        for (int i = 0; i < n; i++) finite &= isfinite(y[i]) != 0;
        for (int i = 0; i < 256; i++) zero_err += fabs(y[i]);
        double rel = sqrt(err / ref);
        CHECK(finite && rel <= cases[c].rel, "round trip %s: rms rel err %.5f > %.5f", tname(t), rel,
              cases[c].rel);
        CHECK(zero_err == 0, "round trip %s: zero block gives %g", tname(t), zero_err);
        double cerr = 0;
        for (int i = 256; i < 512; i++) cerr = fmax(cerr, fabs(y[i] - 0.25));
        CHECK(cerr <= 0.25 * cases[c].rel + 1e-3, "round trip %s: constant block err %g", tname(t), cerr);
    }
    CHECK(kv_quantize_row(KV_TYPE_Q2_K, x, q, 256) == -1, "Q2_K not writable");
    CHECK(kv_quantize_row(KV_TYPE_Q4_0, x, q, 33) == -1, "n not a multiple of the block");
    CHECK(kv_quantize_row(99, x, q, 32) == -1, "unknown type");
    free(x), free(y), free(q);
}

/* ---- activation quantizers: fast == reference ---------------------------------------------- */

static void test_act_quant(void) {
    const kv_kernels *k = kv_kernels_get();
    static const int at[] = {KV_TYPE_Q8_0, KV_TYPE_Q8_1, KV_TYPE_Q8_K};
    const int n = 256 * 9;
    float *x = xmalloc(n * 4);
    uint8_t *a = xmalloc(kv_row_size(KV_TYPE_F32, n)), *b = xmalloc(kv_row_size(KV_TYPE_F32, n));
    for (int rep = 0; rep < 20; rep++) {
        for (int i = 0; i < n; i++) x[i] = nrand() * (rep % 3 == 0 ? 1e-3f : 3.0f);
        if (rep % 2) /* exact ties of x * id and equal |max| of both signs */
            for (int i = 0; i < n; i += 32) {
                x[i] = 127, x[i + 1] = 0.5f, x[i + 2] = -1.5f, x[i + 3] = -127, x[i + 4] = 2.5f;
            }
        if (rep == 4) memset(x, 0, 256 * 4);
        for (size_t j = 0; j < 3; j++) {
            int t = at[j];
            size_t rs = kv_row_size(t, n);
            memset(a, 0, rs), memset(b, 0, rs);
            kv_quantize_row(t, x, a, n);
            k->quant[t](x, b, n);
            CHECK(memcmp(a, b, rs) == 0, "fast %s quantizer == reference (rep %d)", tname(t), rep);
        }
    }
    free(x), free(a), free(b);
}

/* ---- dot products ------------------------------------------------------------------------------- */

/* Sum |w_i x_i| and the float dot of the dequantized rows, in double. */
static void deq_dot(int wt, int64_t n, const void *w, const void *xq, double *dot, double *mag) {
    int vt = kv_vec_dot_type(wt);
    float *a = xmalloc(n * 4), *b = xmalloc(n * 4);
    kv_dequantize_row(wt, w, a, n);
    kv_dequantize_row(vt, xq, b, n);
    double d = 0, m = 0;
    for (int64_t i = 0; i < n; i++) d += (double)a[i] * b[i], m += fabs((double)a[i] * b[i]);
    *dot = d, *mag = m;
    free(a), free(b);
}

/* The Q8_1 sum term is stored as f16: allow its rounding. */
static double ref_tol(int wt) {
    int vt = kv_vec_dot_type(wt);
    return vt == KV_TYPE_Q8_1 ? 2e-3 : vt == KV_TYPE_F32 ? 1e-4 : 1e-5;
}

static void test_dot(void) {
    static const int mult[] = {1, 2, 3, 5, 7, 16, 33};
    printf("simd: %s\n", kv_simd_name());
    for (int ti = 0; ti < N_WTYPES; ti++) {
        int wt = k_wtypes[ti], vt = kv_vec_dot_type(wt);
        int bad_ref = 0, bad_fast = 0, cases = 0;
        int bk = blck(wt) == 1 ? (vt == KV_TYPE_F32 ? 1 : 32) : blck(wt);
        if (bk == 1) bk = 8;
        for (size_t mi = 0; mi < sizeof mult / sizeof mult[0]; mi++)
            for (int rep = 0; rep < 6; rep++) {
                int64_t n = (int64_t)bk * mult[mi];
                if (blck(wt) == 1) n += rep % 3; /* odd lengths for the float types */
                if (vt == KV_TYPE_Q8_K && n % 256) continue;
                if ((vt == KV_TYPE_Q8_0 || vt == KV_TYPE_Q8_1) && n % 32) continue;
                float *w = xmalloc(n * 4), *x = xmalloc(n * 4);
                for (int64_t i = 0; i < n; i++) w[i] = nrand(), x[i] = nrand() * (rep + 1);
                uint8_t *wq = xmalloc(kv_row_size(wt, n) + 1), *xq = xmalloc(kv_row_size(vt, n) + 1);
                kv_quantize_row(wt, w, wq, n);
                kv_quantize_row(vt, x, xq, n);
                float r = 0, s = 0;
                kv_vec_dot_ref(wt, n, &r, wq, xq);
                kv_vec_dot(wt, n, &s, wq, xq);
                double d, mag;
                deq_dot(wt, n, wq, xq, &d, &mag);
                if (fabs(r - d) > ref_tol(wt) * mag + 1e-30) {
                    if (bad_ref < 3) printf("  %s n=%ld ref %.7g deq %.7g mag %g\n", tname(wt), (long)n, r, d, mag);
                    bad_ref++;
                }
                if (fabs(s - r) > 1e-4 * mag + 1e-30) {
                    if (bad_fast < 3) printf("  %s n=%ld fast %.7g ref %.7g mag %g\n", tname(wt), (long)n, s, r, mag);
                    bad_fast++;
                }
                cases++;
                free(w), free(x), free(wq), free(xq);
            }
        CHECK(bad_ref == 0, "%s scalar dot vs dequantized float dot: %d of %d", tname(wt), bad_ref, cases);
        CHECK(bad_fast == 0, "%s %s dot vs scalar dot: %d of %d", tname(wt), kv_simd_name(), bad_fast, cases);
    }
}

/* ---- matmul --------------------------------------------------------------------------------------- */

static void test_matmul(void) {
    static const int Ts[] = {1, 2, 3, 5, 8, 64, 130};
    static const int Rs[] = {1, 3, 17, 577};
    kv_pool *pools[2] = {NULL, NULL};
    kv_error e;
    for (int p = 0; p < 2; p++)
        if (kv_pool_create(p + 1, &pools[p], &e) != KV_OK) { CHECK(0, "pool: %s", e.msg); return; }
    for (int ti = 0; ti < N_WTYPES; ti++) {
        int wt = k_wtypes[ti], vt = kv_vec_dot_type(wt);
        int bad = 0, cases = 0;
        for (int ki = 0; ki < 2; ki++)
        for (size_t ri = 0; ri < sizeof Rs / sizeof Rs[0]; ri++) {
            /* short rows, and rows as long as the real models' (many blocks) */
            int64_t K = blck(wt) == 256 ? (ki ? 2048 : 512) : (ki ? 576 : 96);
            size_t wrs = kv_row_size(wt, K), xrs = kv_row_size(vt, K);
            int rows = Rs[ri];
            if (ki && rows > 17) continue;
            float *wf = xmalloc((size_t)rows * K * 4), *wd = xmalloc((size_t)rows * K * 4);
            uint8_t *W = xmalloc(wrs * rows);
            for (int64_t i = 0; i < rows * K; i++) wf[i] = nrand() * (1 + (i / K) % 3);
            for (int r = 0; r < rows; r++) {
                kv_quantize_row(wt, wf + r * K, W + r * wrs, K);
                kv_dequantize_row(wt, W + r * wrs, wd + r * K, K);
            }
            for (size_t tj = 0; tj < sizeof Ts / sizeof Ts[0]; tj++) {
                int T = Ts[tj];
                int64_t ldy = rows + 3;
                float *x = xmalloc((size_t)T * K * 4), *xd = xmalloc((size_t)T * K * 4);
                uint8_t *xq = xmalloc(xrs);
                for (int64_t i = 0; i < T * K; i++) x[i] = nrand() * 2;
                for (int t = 0; t < T; t++) {
                    kv_quantize_row(vt, x + t * K, xq, K);
                    kv_dequantize_row(vt, xq, xd + t * K, K);
                }
                double *yref = xmalloc((size_t)T * rows * 8), *mag = xmalloc((size_t)T * rows * 8);
                for (int t = 0; t < T; t++)
                    for (int r = 0; r < rows; r++) {
                        double s = 0, m = 0;
                        for (int64_t k = 0; k < K; k++) {
                            double v = (double)wd[r * K + k] * xd[t * K + k];
                            s += v, m += fabs(v);
                        }
                        yref[t * rows + r] = s, mag[t * rows + r] = m;
                    }
                size_t ss = kv_matmul_scratch_size(wt, K, T);
                uint8_t *scratch = xmalloc(ss);
                float *y = xmalloc((size_t)T * ldy * 4);
                for (int p = 0; p < 2; p++) {
                    for (int64_t i = 0; i < T * ldy; i++) y[i] = NAN;
                    kv_matmul(pools[p], wt, W, rows, K, x, T, y, ldy, scratch);
                    int b = 0;
                    for (int t = 0; t < T; t++) {
                        for (int r = 0; r < rows; r++) {
                            double ref = yref[t * rows + r], got = y[t * ldy + r];
                            if (!(fabs(got - ref) <= ref_tol(wt) * 2 * mag[t * rows + r] + 1e-6)) {
                                if (b < 2) printf("  %s rows=%d T=%d nth=%d y[%d][%d]=%.7g want %.7g\n",
                                                  tname(wt), rows, T, p + 1, t, r, got, ref);
                                b++;
                            }
                        }
                        for (int64_t r = rows; r < ldy; r++)
                            if (!isnan(y[t * ldy + r])) b++; /* padding untouched */
                    }
                    bad += b != 0;
                    cases++;
                }
                free(x), free(xd), free(xq), free(yref), free(mag), free(scratch), free(y);
            }
            free(wf), free(wd), free(W);
        }
        CHECK(bad == 0, "kv_matmul %s vs naive float product: %d of %d shapes wrong", tname(wt), bad, cases);
    }
    kv_pool_destroy(pools[0]);
    kv_pool_destroy(pools[1]);
}

/* ---- batch invariance ------------------------------------------------------------------------------ */

/* y (T, ldy) for tokens x[t0 .. t0 + T) of xs (.., K), on pool p. */
static void mm_tokens(kv_pool *p, int wt, const uint8_t *W, int rows, int64_t K, const float *xs,
                      int t0, int T, float *y, int64_t ldy) {
    uint8_t *scratch = xmalloc(kv_matmul_scratch_size(wt, K, T));
    kv_matmul(p, wt, W, rows, K, xs + (int64_t)t0 * K, T, y, ldy, scratch);
    free(scratch);
}

/* Rows [0, rows) of y (T, lda) against the same tokens in ref (.., ldr) from
 * token off: how many (t, r) differ in any bit. */
static int rows_differ(const float *y, int64_t lda, const float *ref, int64_t ldr, int off, int T,
                       int rows) {
    int bad = 0;
    for (int t = 0; t < T; t++)
        if (memcmp(y + t * lda, ref + (int64_t)(off + t) * ldr, (size_t)rows * 4) != 0) bad++;
    return bad;
}

static void test_batch_invariance(void) {
    /* odd row counts (tails of every row tile), K of the real models */
    static const int Rs[] = {61, 7, 130, 1};
    static const int K32[] = {576, 2048, 640, 1152, 96};
    static const int K256[] = {2048, 512, 768, 1536};
    static const int Kf[] = {576, 640, 67, 1152};
    /* sub-batches: (first token, count), inside a batch of NT tokens */
    static const int subs[][2] = {{3, 5}, {0, 8}, {1, 16}, {5, 17}, {9, 1}, {0, 4}, {2, 3}, {7, 31}};
    const int NT = 128;
    kv_pool *pools[2] = {NULL, NULL};
    kv_error e;
    for (int p = 0; p < 2; p++)
        if (kv_pool_create(p + 1, &pools[p], &e) != KV_OK) { CHECK(0, "pool: %s", e.msg); return; }
    for (int ti = 0; ti < N_WTYPES; ti++) {
        int wt = k_wtypes[ti];
        const int *Ks = blck(wt) == 256 ? K256 : blck(wt) == 32 ? K32 : Kf;
        int bad_tok = 0, bad_sub = 0, bad_thr = 0;
        for (int si = 0; si < 4; si++) {
            int64_t K = Ks[si];
            int rows = Rs[si];
            size_t wrs = kv_row_size(wt, K);
            float *wf = xmalloc((size_t)rows * K * 4), *x = xmalloc((size_t)NT * K * 4);
            uint8_t *W = xmalloc(wrs * rows);
            for (int64_t i = 0; i < rows * K; i++) wf[i] = nrand() * (1 + (i / K) % 3);
            for (int r = 0; r < rows; r++) kv_quantize_row(wt, wf + r * K, W + r * wrs, K);
            for (int64_t i = 0; i < NT * K; i++) x[i] = nrand() * (1 + (i / K) % 5);
            int64_t ldy = rows + 5;
            float *full = xmalloc((size_t)NT * ldy * 4), *full1 = xmalloc((size_t)NT * ldy * 4);
            float *y = xmalloc((size_t)NT * ldy * 4);
            mm_tokens(pools[1], wt, W, rows, K, x, 0, NT, full, ldy);
            mm_tokens(pools[0], wt, W, rows, K, x, 0, NT, full1, ldy);
            bad_thr += rows_differ(full1, ldy, full, ldy, 0, NT, rows);
            /* every token alone (decode), 1 and 2 threads */
            for (int t = 0; t < NT; t++)
                for (int p = 0; p < 2; p++) {
                    mm_tokens(pools[p], wt, W, rows, K, x, t, 1, y, rows);
                    bad_tok += rows_differ(y, rows, full, ldy, t, 1, rows);
                }
            for (size_t k = 0; k < sizeof subs / sizeof subs[0]; k++)
                for (int p = 0; p < 2; p++) {
                    mm_tokens(pools[p], wt, W, rows, K, x, subs[k][0], subs[k][1], y, ldy);
                    bad_sub += rows_differ(y, ldy, full, ldy, subs[k][0], subs[k][1], rows);
                }
            free(wf), free(x), free(W), free(full), free(full1), free(y);
        }
        CHECK(bad_tok == 0, "kv_matmul %s (%s): %d decoded token rows differ from the batch of %d",
              tname(wt), kv_simd_name(), bad_tok, NT);
        CHECK(bad_sub == 0, "kv_matmul %s (%s): %d token rows of sub-batches differ from the batch",
              tname(wt), kv_simd_name(), bad_sub);
        CHECK(bad_thr == 0, "kv_matmul %s (%s): %d token rows differ between 1 and 2 threads",
              tname(wt), kv_simd_name(), bad_thr);
    }
    kv_pool_destroy(pools[0]);
    kv_pool_destroy(pools[1]);
}

/* kv_matmul_n: several weights of the same x, mixing dot types (Q8_1 for
 * Q4_1, Q8_0, Q8_K for Q4_K), gives each output the bits kv_matmul gives it. */
static void test_matmul_n(void) {
    static const int wts[] = {KV_TYPE_Q4_1, KV_TYPE_Q8_0, KV_TYPE_Q4_K, KV_TYPE_Q4_0};
    static const int rows[] = {61, 16, 130, 7};
    static const int Ts[] = {1, 3, 8, 17};
    const int64_t K = 512;
    kv_pool *pools[2] = {NULL, NULL};
    kv_error e;
    for (int p = 0; p < 2; p++)
        if (kv_pool_create(p + 1, &pools[p], &e) != KV_OK) { CHECK(0, "pool: %s", e.msg); return; }
    uint8_t *W[4];
    for (int i = 0; i < 4; i++) {
        size_t wrs = kv_row_size(wts[i], K);
        float *wf = xmalloc((size_t)rows[i] * K * 4);
        W[i] = xmalloc(wrs * rows[i]);
        for (int64_t k = 0; k < rows[i] * K; k++) wf[k] = nrand();
        for (int r = 0; r < rows[i]; r++) kv_quantize_row(wts[i], wf + r * K, W[i] + r * wrs, K);
        free(wf);
    }
    int bad = 0;
    for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
        const int T = Ts[ti];
        float *x = xmalloc((size_t)T * K * 4);
        for (int64_t k = 0; k < T * K; k++) x[k] = nrand();
        size_t ss = 0;
        for (int i = 0; i < 4; i++)
            if (kv_matmul_scratch_size(wts[i], K, T) > ss) ss = kv_matmul_scratch_size(wts[i], K, T);
        uint8_t *scratch = xmalloc(ss);
        for (int p = 0; p < 2; p++) {
            float *y[4], *ref[4];
            kv_mm_out outs[4];
            for (int i = 0; i < 4; i++) {
                y[i] = xmalloc((size_t)T * rows[i] * 4), ref[i] = xmalloc((size_t)T * rows[i] * 4);
                kv_matmul(pools[p], wts[i], W[i], rows[i], K, x, T, ref[i], rows[i], scratch);
                outs[i] = (kv_mm_out){.wtype = wts[i], .W = W[i], .rows = rows[i], .y = y[i], .ldy = rows[i]};
            }
            kv_matmul_n(pools[p], 4, outs, K, x, T, scratch);
            for (int i = 0; i < 4; i++) {
                bad += memcmp(y[i], ref[i], (size_t)T * rows[i] * 4) != 0;
                free(y[i]), free(ref[i]);
            }
        }
        free(x), free(scratch);
    }
    CHECK(bad == 0, "kv_matmul_n (%s): %d outputs differ from kv_matmul's", kv_simd_name(), bad);
    for (int i = 0; i < 4; i++) free(W[i]);
    kv_pool_destroy(pools[0]);
    kv_pool_destroy(pools[1]);
}

/* The rotation of quantized K/V rows: blocks of the largest power of two
 * dividing n (<= 256), orthonormal, its own inverse; a unit vector becomes
 * 1/sqrt(block) over its block. */
static void test_hadamard(void) {
    CHECK(kv_hadamard_block(64) == 64 && kv_hadamard_block(96) == 32 && kv_hadamard_block(80) == 16 &&
              kv_hadamard_block(512) == 256 && kv_hadamard_block(33) == 1,
          "hadamard block sizes");
    const int ns[] = {32, 64, 80, 96, 128, 256, 512};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        const int n = ns[k], hb = kv_hadamard_block(n);
        float x[2 * 512], y[2 * 512];
        uint32_t st = 7u + (uint32_t)n;
        double nx = 0, ny = 0;
        for (int i = 0; i < 2 * n; i++) {
            st = st * 1664525u + 1013904223u;
            x[i] = y[i] = (float)((st >> 8) & 0xFFFF) / 65536.0f - 0.5f;
            nx += (double)x[i] * x[i];
        }
        kv_hadamard_rows(y, 2, n);
        for (int i = 0; i < 2 * n; i++) ny += (double)y[i] * y[i];
        CHECK(fabs(nx - ny) < 1e-4 * nx, "hadamard %d keeps the norm: %g vs %g", n, nx, ny);
        /* row 1 is rotated on its own: the same as rotating it alone */
        float r1[512];
        memcpy(r1, x + n, sizeof(float) * (size_t)n);
        kv_hadamard_rows(r1, 1, n);
        CHECK(memcmp(r1, y + n, sizeof(float) * (size_t)n) == 0, "hadamard %d: rows independent", n);
        kv_hadamard_rows(y, 2, n);
        float worst = 0;
        for (int i = 0; i < 2 * n; i++) worst = fmaxf(worst, fabsf(y[i] - x[i]));
        CHECK(worst < 1e-6f, "hadamard %d twice: off by %g", n, (double)worst);
        float e[512] = {0};
        e[0] = 1; /* the first column of H: 1/sqrt(hb) over the first block */
        kv_hadamard_rows(e, 1, n);
        bool ok = true;
        for (int i = 0; i < n; i++)
            if (fabsf(e[i] - (i < hb ? 1.0f / sqrtf((float)hb) : 0.0f)) > 1e-7f) ok = false;
        CHECK(ok, "hadamard %d of a unit vector", n);
    }
}

int main(void) {
    test_f16();
    test_fixture();
    test_roundtrip();
    test_act_quant();
    test_dot();
    test_matmul();
    test_batch_invariance();
    test_matmul_n();
    test_hadamard();
    return kvt_finish();
}
