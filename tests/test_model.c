/*
 * test_model.c — the model loader and the forward pass on tiny random-weight
 * models, against an independent naive float implementation in this file.
 *
 * Each case writes a GGUF (tests/support/gguf_writer.h) with random weights
 * for a llama (GQA 4:2, tied and untied output, sliding window, rope
 * factors), qwen2 (QKV biases) or gemma3 (QK-norm, post norms, GeGLU,
 * interleaved sliding-window layers) shape, keeps the dequantized weights,
 * and compares the engine's logits with ref_forward(): straightforward
 * double-precision loops over the same weights. Then: prefill vs decode vs
 * logits="all", rewind, context full, bad ids, NaN weights, threads 1 vs 2,
 * every weight type, the loader's error messages, a file truncated after
 * loading, and cache files (save, restore into another cache, reuse).
 *
 * Prints one line per check and "N passed, N failed"; exits 1 on failure.
 */
#include "gguf_writer.h"
#include "kvlua.h"
#include "model_internal.h"
#include "quant.h"
#include "types.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

/* ==== random numbers ========================================================= */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static float frand(void) { /* uniform [-1, 1) */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

/* ==== model configurations ==================================================== */

typedef struct {
    const char *arch; /* "llama", "qwen2", "gemma3" */
    int n_layer, n_embd, n_head, n_kv, head_dim, n_ff, n_vocab;
    int wtype;        /* type of the big matrices */
    bool tied;        /* no output.weight */
    bool rope_freqs;  /* llama: rope_freqs.weight */
    float rope_scale; /* linear rope scaling factor (0: none) */
    int window;       /* attention.sliding_window (0: absent) */
    int swa_pattern;  /* gemma3 sliding_window_pattern key (0: absent, default 6) */
    float freq_base;
    /* malformations for the loader tests */
    const char *drop_tensor;  /* leave this tensor out */
    const char *bad_shape;    /* give this tensor a wrong row count */
    bool block_count_as_str;  /* {arch}.block_count written as a string */
    int odd_tensor_type;      /* blk.0.ffn_up.weight stored as this type (0: wtype) */
    bool nan_weights;         /* output_norm full of NaN */
} cfg;

/* Dequantized weights, as the engine sees them. Matrices are (rows, cols). */
typedef struct {
    float *tok_embd, *output, *output_norm, *rope_freqs;
    struct {
        float *attn_norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *q_norm, *k_norm, *post_attn_norm;
        float *ffn_norm, *wg, *wu, *wd, *post_ffw_norm;
    } l[4];
} weights;

static void weights_free(weights *w) {
    free(w->tok_embd);
    if (w->output != w->tok_embd) free(w->output);
    free(w->output_norm);
    free(w->rope_freqs);
    for (int i = 0; i < 4; i++) {
        float **p = (float **)&w->l[i];
        for (size_t k = 0; k < sizeof w->l[i] / sizeof(float *); k++) free(p[k]);
    }
    memset(w, 0, sizeof *w);
}

static bool is_gemma(const cfg *c) { return strcmp(c->arch, "gemma3") == 0; }
static bool is_qwen(const cfg *c) { return strcmp(c->arch, "qwen2") == 0; }

/* Adds a tensor of random values (rows x cols, 1-D when rows == 0) stored as
 * type; returns the dequantized floats (rows*cols). */
static float *add_tensor(gw *w, const cfg *c, const char *name, int64_t cols, int64_t rows, int type,
                         float scale, float offset) {
    int64_t nr = rows ? rows : 1;
    if (c->bad_shape && strcmp(c->bad_shape, name) == 0) nr += 1;
    float *f = malloc(sizeof(float) * cols * nr);
    for (int64_t i = 0; i < cols * nr; i++) f[i] = offset + scale * frand();
    size_t rs = kv_row_size(type, cols);
    uint8_t *q = malloc(rs * nr);
    for (int64_t r = 0; r < nr; r++) {
        if (kv_quantize_row(type, f + r * cols, q + r * rs, cols) != 0) memset(q + r * rs, 0, rs);
        kv_dequantize_row(type, q + r * rs, f + r * cols, cols);
    }
    if (!(c->drop_tensor && strcmp(c->drop_tensor, name) == 0)) {
        int64_t ne[2] = {cols, nr};
        gw_tensor(w, name, rows ? 2 : 1, ne, type, q);
    }
    free(q);
    return f;
}

static char tmpdir[256];

/* Writes the model file; returns its path (static buffer) and fills wt. */
static const char *write_model(const cfg *c, weights *wt, const char *fname) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s.gguf", tmpdir, fname);
    memset(wt, 0, sizeof *wt);
    gw *w = gw_new(3);
    char k[128];
#define AK(s) (snprintf(k, sizeof k, "%s.%s", c->arch, s), k)
    gw_kv_str(w, "general.architecture", c->arch);
    gw_kv_str(w, "general.name", "tiny test model");
    if (c->block_count_as_str)
        gw_kv_str(w, AK("block_count"), "2");
    else
        gw_kv_u32(w, AK("block_count"), c->n_layer);
    gw_kv_u32(w, AK("context_length"), 4096);
    gw_kv_u32(w, AK("embedding_length"), c->n_embd);
    gw_kv_u32(w, AK("feed_forward_length"), c->n_ff);
    gw_kv_u32(w, AK("attention.head_count"), c->n_head);
    gw_kv_u32(w, AK("attention.head_count_kv"), c->n_kv);
    if (c->head_dim != c->n_embd / c->n_head) {
        gw_kv_u32(w, AK("attention.key_length"), c->head_dim);
        gw_kv_u32(w, AK("attention.value_length"), c->head_dim);
    }
    gw_kv_f32(w, AK("attention.layer_norm_rms_epsilon"), 1e-5f);
    gw_kv_f32(w, AK("rope.freq_base"), c->freq_base > 0 ? c->freq_base : 10000.0f);
    if (c->rope_scale > 0) {
        gw_kv_str(w, AK("rope.scaling.type"), "linear");
        gw_kv_f32(w, AK("rope.scaling.factor"), c->rope_scale);
    }
    if (c->window) gw_kv_u32(w, AK("attention.sliding_window"), c->window);
    if (c->swa_pattern) gw_kv_u32(w, AK("attention.sliding_window_pattern"), c->swa_pattern);

    const int E = c->n_embd, hd = c->head_dim, nq = c->n_head * hd, nk = c->n_kv * hd, F = c->n_ff;
    const int wt_ = c->wtype;
    const float ws = 1.0f / sqrtf((float)E), wsf = 1.0f / sqrtf((float)F), wso = 1.0f / sqrtf((float)nq);
    const float nsc = is_gemma(c) ? 0.3f : 0.1f; /* norm weights around 1 */
    wt->tok_embd = add_tensor(w, c, "token_embd.weight", E, c->n_vocab, wt_, is_gemma(c) ? 0.1f : 1.0f, 0);
    wt->output_norm = add_tensor(w, c, "output_norm.weight", E, 0, KV_TYPE_F32, nsc, 1.0f);
    if (c->tied)
        wt->output = wt->tok_embd;
    else
        wt->output = add_tensor(w, c, "output.weight", E, c->n_vocab, wt_, ws, 0);
    if (c->rope_freqs) wt->rope_freqs = add_tensor(w, c, "rope_freqs.weight", hd / 2, 0, KV_TYPE_F32, 1.5f, 2.6f);
    char nm[96];
#define LN(s) (snprintf(nm, sizeof nm, "blk.%d.%s", il, s), nm)
    for (int il = 0; il < c->n_layer; il++) {
        int ffn_up_type = c->odd_tensor_type && il == 0 ? c->odd_tensor_type : wt_;
        wt->l[il].attn_norm = add_tensor(w, c, LN("attn_norm.weight"), E, 0, KV_TYPE_F32, nsc, 1.0f);
        wt->l[il].wq = add_tensor(w, c, LN("attn_q.weight"), E, nq, wt_, ws, 0);
        wt->l[il].wk = add_tensor(w, c, LN("attn_k.weight"), E, nk, wt_, ws, 0);
        wt->l[il].wv = add_tensor(w, c, LN("attn_v.weight"), E, nk, wt_, ws, 0);
        wt->l[il].wo = add_tensor(w, c, LN("attn_output.weight"), nq, E, wt_, wso, 0);
        if (is_qwen(c)) {
            wt->l[il].bq = add_tensor(w, c, LN("attn_q.bias"), nq, 0, KV_TYPE_F32, 0.5f, 0);
            wt->l[il].bk = add_tensor(w, c, LN("attn_k.bias"), nk, 0, KV_TYPE_F32, 0.5f, 0);
            wt->l[il].bv = add_tensor(w, c, LN("attn_v.bias"), nk, 0, KV_TYPE_F32, 0.5f, 0);
        }
        if (is_gemma(c)) {
            wt->l[il].q_norm = add_tensor(w, c, LN("attn_q_norm.weight"), hd, 0, KV_TYPE_F32, nsc, 1.0f);
            wt->l[il].k_norm = add_tensor(w, c, LN("attn_k_norm.weight"), hd, 0, KV_TYPE_F32, nsc, 1.0f);
            wt->l[il].post_attn_norm = add_tensor(w, c, LN("post_attention_norm.weight"), E, 0, KV_TYPE_F32, nsc, 1.0f);
            wt->l[il].post_ffw_norm = add_tensor(w, c, LN("post_ffw_norm.weight"), E, 0, KV_TYPE_F32, nsc, 1.0f);
        }
        wt->l[il].ffn_norm = add_tensor(w, c, LN("ffn_norm.weight"), E, 0, KV_TYPE_F32, nsc, 1.0f);
        wt->l[il].wg = add_tensor(w, c, LN("ffn_gate.weight"), E, F, wt_, ws, 0);
        wt->l[il].wu = add_tensor(w, c, LN("ffn_up.weight"), E, F, ffn_up_type, ws, 0);
        wt->l[il].wd = add_tensor(w, c, LN("ffn_down.weight"), F, E, wt_, wsf, 0);
    }
#undef LN
#undef AK
    uint8_t *buf;
    size_t len;
    if (gw_finish(w, &buf, &len) != 0) {
        gw_free(w);
        return NULL;
    }
    gw_free(w);
    if (c->nan_weights) {
        /* poison output_norm.weight inside the image: find its data via the reader */
        kv_gguf *g;
        kv_error e;
        if (kv_gguf_parse(buf, len, &g, &e) == KV_OK) {
            const kv_gguf_tensor *t = kv_gguf_tensor_find(g, "output_norm.weight");
            float nanv = NAN;
            if (t)
                for (int i = 0; i < E; i++) memcpy((uint8_t *)t->data + 4 * i, &nanv, 4);
            kv_gguf_close(g);
        }
    }
    int rc = gw_write_file(path, buf, len);
    free(buf);
    return rc == 0 ? path : NULL;
}

/* ==== the naive reference ======================================================= */

static void ref_rmsnorm(double *y, const double *x, const float *w, int n, double eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    double sc = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * sc * (w ? w[i] : 1.0);
}

/* y(rows) = W(rows, cols) x(cols) (+ b) */
static void ref_matvec(double *y, const float *W, const float *b, const double *x, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        double s = b ? b[r] : 0.0;
        for (int k = 0; k < cols; k++) s += (double)W[(size_t)r * cols + k] * x[k];
        y[r] = s;
    }
}

static void ref_rope(double *v, int hd, int pos, double base, double scale, const float *factors, bool neox) {
    int half = hd / 2;
    for (int i = 0; i < half; i++) {
        double th = pos * pow(base, -2.0 * i / hd) * scale;
        if (factors) th /= factors[i];
        int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        double x0 = v[a], x1 = v[b];
        v[a] = x0 * cos(th) - x1 * sin(th);
        v[b] = x0 * sin(th) + x1 * cos(th);
    }
}

/* logits(N, n_vocab) for the token sequence ids(N). */
/* A K/V head vector through a Q8_0 cache row and back: per block of 32,
 * d = amax / 127 stored as f16, q = round(x / d) (ggml's reference
 * quantizer). */
static void ref_q8_0_round(double *v, int n) {
    for (int b = 0; b < n; b += 32) {
        float amax = 0;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf((float)v[b + i]));
        float d = amax / 127, id = d != 0 ? 1.0f / d : 0.0f;
        double dh = kv_f16_to_f32(kv_f32_to_f16(d));
        for (int i = 0; i < 32; i++) v[b + i] = roundf((float)v[b + i] * id) * dh;
    }
}

/* The same through a Q4_0 row: d = (the value of largest magnitude) / -8 as
 * f16, q = min(15, trunc(x / d + 8.5)), value (q - 8) d (ggml's reference). */
static void ref_q4_0_round(double *v, int n) {
    for (int b = 0; b < n; b += 32) {
        float amax = 0, mx = 0;
        for (int i = 0; i < 32; i++)
            if (fabsf((float)v[b + i]) > amax) amax = fabsf((float)v[b + i]), mx = (float)v[b + i];
        float d = mx / -8, id = d != 0 ? 1.0f / d : 0.0f;
        double dh = kv_f16_to_f32(kv_f32_to_f16(d));
        for (int i = 0; i < 32; i++) {
            int q = (int)((float)v[b + i] * id + 8.5f);
            v[b + i] = ((q > 15 ? 15 : q) - 8) * dh;
        }
    }
}

/* v = v H in blocks of kv_hadamard_block(n) (orthonormal, its own inverse):
 * a quantized cache stores rows rotated this way (engine/quant.h). */
static void ref_hadamard(double *v, int n) {
    const int hb = kv_hadamard_block(n);
    for (int b0 = 0; b0 < n; b0 += hb) {
        double *x = v + b0;
        for (int len = 1; len < hb; len *= 2)
            for (int i = 0; i < hb; i += 2 * len)
                for (int j = i; j < i + len; j++) {
                    const double a = x[j], c = x[j + len];
                    x[j] = a + c, x[j + len] = a - c;
                }
        for (int j = 0; j < hb; j++) x[j] /= sqrt((double)hb);
    }
}

/* A K/V row through a quantized cache: rotated, rounded, rotated back. */
static void ref_kv_round(double *v, int n, int type) {
    ref_hadamard(v, n);
    (type == KV_TYPE_Q4_0 ? ref_q4_0_round : ref_q8_0_round)(v, n);
    ref_hadamard(v, n);
}

/* kv_q8: K and V go through a quantized cache of that type (KV_TYPE_Q8_0 or
 * KV_TYPE_Q4_0; 0: exact). */
static void ref_forward(const cfg *c, const weights *w, const int32_t *ids, int N, float *logits, int kv_q8) {
    const int E = c->n_embd, H = c->n_head, KH = c->n_kv, hd = c->head_dim, F = c->n_ff, V = c->n_vocab;
    const bool gemma = is_gemma(c), neox = gemma || is_qwen(c);
    const double eps = 1e-5;
    double *x = calloc((size_t)N * E, sizeof(double));     /* (N, E) */
    double *K = calloc((size_t)N * KH * hd, sizeof(double)); /* (N, KH, hd) one layer */
    double *Vv = calloc((size_t)N * KH * hd, sizeof(double));
    double *Q = calloc((size_t)N * H * hd, sizeof(double));
    double *h = malloc(sizeof(double) * (E > F ? E : F) * 4), *att = malloc(sizeof(double) * H * hd);
    double *g = malloc(sizeof(double) * F), *u = malloc(sizeof(double) * F), *o = malloc(sizeof(double) * (E > F ? E : F));
    double *sc = malloc(sizeof(double) * N);
    for (int t = 0; t < N; t++)
        for (int i = 0; i < E; i++) x[(size_t)t * E + i] = w->tok_embd[(size_t)ids[t] * E + i] * (gemma ? sqrt((double)E) : 1.0);
    int pattern = c->swa_pattern ? c->swa_pattern : 6;
    for (int il = 0; il < c->n_layer; il++) {
        bool local = gemma ? (il % pattern < pattern - 1) : c->window > 0;
        int window = local ? c->window : 0;
        double base = gemma && local ? 10000.0 : (c->freq_base > 0 ? c->freq_base : 10000.0);
        double rscale = (gemma && local) || c->rope_scale <= 0 ? 1.0 : 1.0 / c->rope_scale;
        for (int t = 0; t < N; t++) {
            ref_rmsnorm(h, x + (size_t)t * E, w->l[il].attn_norm, E, eps);
            ref_matvec(Q + (size_t)t * H * hd, w->l[il].wq, w->l[il].bq, h, H * hd, E);
            ref_matvec(K + (size_t)t * KH * hd, w->l[il].wk, w->l[il].bk, h, KH * hd, E);
            ref_matvec(Vv + (size_t)t * KH * hd, w->l[il].wv, w->l[il].bv, h, KH * hd, E);
            for (int hh = 0; hh < H; hh++) {
                double *q = Q + ((size_t)t * H + hh) * hd;
                if (gemma) ref_rmsnorm(q, q, w->l[il].q_norm, hd, eps);
                ref_rope(q, hd, t, base, rscale, w->rope_freqs, neox);
            }
            for (int hh = 0; hh < KH; hh++) {
                double *k = K + ((size_t)t * KH + hh) * hd;
                if (gemma) ref_rmsnorm(k, k, w->l[il].k_norm, hd, eps);
                ref_rope(k, hd, t, base, rscale, w->rope_freqs, neox);
                if (kv_q8) {
                    ref_kv_round(k, hd, kv_q8);
                    ref_kv_round(Vv + ((size_t)t * KH + hh) * hd, hd, kv_q8);
                }
            }
        }
        for (int t = 0; t < N; t++) {
            for (int hh = 0; hh < H; hh++) {
                const double *q = Q + ((size_t)t * H + hh) * hd;
                int kh = hh / (H / KH);
                double mx = -1e300, sum = 0;
                for (int j = 0; j <= t; j++) {
                    if (window && t - j >= window) { sc[j] = -1e300; continue; }
                    double s = 0;
                    for (int i = 0; i < hd; i++) s += q[i] * K[((size_t)j * KH + kh) * hd + i];
                    s *= 1.0 / sqrt((double)hd);
                    sc[j] = s;
                    if (s > mx) mx = s;
                }
                for (int j = 0; j <= t; j++) {
                    sc[j] = sc[j] <= -1e299 ? 0.0 : exp(sc[j] - mx);
                    sum += sc[j];
                }
                for (int i = 0; i < hd; i++) {
                    double a = 0;
                    for (int j = 0; j <= t; j++) a += sc[j] * Vv[((size_t)j * KH + kh) * hd + i];
                    att[hh * hd + i] = a / sum;
                }
            }
            double *xt = x + (size_t)t * E;
            ref_matvec(o, w->l[il].wo, NULL, att, E, H * hd);
            if (gemma) ref_rmsnorm(o, o, w->l[il].post_attn_norm, E, eps);
            for (int i = 0; i < E; i++) xt[i] += o[i];
            ref_rmsnorm(h, xt, w->l[il].ffn_norm, E, eps);
            ref_matvec(g, w->l[il].wg, NULL, h, F, E);
            ref_matvec(u, w->l[il].wu, NULL, h, F, E);
            for (int i = 0; i < F; i++) {
                double a = g[i];
                double act = gemma ? 0.5 * a * (1 + tanh(sqrt(2 / M_PI) * (a + 0.044715 * a * a * a)))
                                   : a / (1 + exp(-a));
                g[i] = act * u[i];
            }
            ref_matvec(o, w->l[il].wd, NULL, g, E, F);
            if (gemma) ref_rmsnorm(o, o, w->l[il].post_ffw_norm, E, eps);
            for (int i = 0; i < E; i++) xt[i] += o[i];
        }
    }
    double *lg = malloc(sizeof(double) * V);
    for (int t = 0; t < N; t++) {
        ref_rmsnorm(h, x + (size_t)t * E, w->output_norm, E, eps);
        ref_matvec(lg, w->output, NULL, h, V, E);
        for (int i = 0; i < V; i++) logits[(size_t)t * V + i] = (float)lg[i];
    }
    free(lg);
    free(x), free(K), free(Vv), free(Q), free(h), free(att), free(g), free(u), free(o), free(sc);
}

/* ==== comparison helpers =========================================================== */

/* max |a - b| / max(1, max |b|) over n values */
static double rel_err(const float *a, const float *b, size_t n) {
    double mx = 1.0, d = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (fabs(b[i]) > mx) mx = fabs(b[i]);
        double di = fabs((double)a[i] - b[i]);
        if (!(di <= d)) d = di; /* NaN propagates */
    }
    return d / mx;
}

static void make_ids(int32_t *ids, int n, int n_vocab) {
    for (int i = 0; i < n; i++) ids[i] = (int32_t)((frand() * 0.5f + 0.5f) * (n_vocab - 1));
}

static kv_model *open_model(const char *path, int threads, kv_error *e) {
    kv_model_params p = {.threads = threads};
    kv_model *m = NULL;
    if (kv_model_open(path, &p, &m, e) != KV_OK) return NULL;
    return m;
}

/* ==== forward-pass checks ==================================================== */

/* The main battery for one configuration: engine (prefill all, prefill last,
 * decode steps) vs the reference, with F16 and F32 KV. */
static void check_forward(const char *name, cfg c, int N, double tol) {
    char label[160];
    weights w;
    const char *path = write_model(&c, &w, name);
    if (!path) {
        report(false, name, "could not write the model");
        return;
    }
    kv_error e = {{0}};
    kv_model *m = open_model(path, 2, &e);
    snprintf(label, sizeof label, "%s: open", name);
    report(m != NULL, label, "%s", e.msg);
    if (!m) {
        weights_free(&w);
        return;
    }
    const int V = c.n_vocab;
    int32_t *ids = malloc(sizeof(int32_t) * N);
    make_ids(ids, N, V);
    float *ref = malloc(sizeof(float) * N * V), *all = malloc(sizeof(float) * N * V);
    float *last = malloc(sizeof(float) * V), *step = malloc(sizeof(float) * N * V);
    ref_forward(&c, &w, ids, N, ref, 0);
    float *ref_q8 = NULL, *ref_q4 = NULL;
    if (c.head_dim % 32 == 0) {
        ref_q8 = malloc(sizeof(float) * N * V);
        ref_forward(&c, &w, ids, N, ref_q8, KV_TYPE_Q8_0);
        ref_q4 = malloc(sizeof(float) * N * V);
        ref_forward(&c, &w, ids, N, ref_q4, KV_TYPE_Q4_0);
    }

    for (int kvt = 0; kvt < 4; kvt++) {
        const int types[4] = {KV_TYPE_F16, KV_TYPE_F32, KV_TYPE_Q8_0, KV_TYPE_Q4_0};
        const char *names[4] = {"f16 kv", "f32 kv", "q8_0 kv", "q4_0 kv"};
        /* Q8_0: against a reference whose K/V go through Q8_0 too (in
         * doubles, so a few values land on the other side of a rounding
         * step: a looser bound) */
        /* Q4_0: a value on the other side of a rounding step moves by 1/8 of
         * its block's largest magnitude, 16 times a Q8_0 step; the check that
         * the engine is nearer its reference than the exact pass keeps it honest */
        const double tols[4] = {tol, tol / 4, tol * 2.5, tol * 20};
        const bool quant = types[kvt] == KV_TYPE_Q8_0 || types[kvt] == KV_TYPE_Q4_0;
        int ktype = types[kvt];
        const char *kn = names[kvt];
        double t = tols[kvt];
        kv_session *s = NULL;
        kv_status so = kv_session_open_ex(m, N + 4, ktype, ktype, &s, &e);
        if (quant && c.head_dim % 32 != 0) {
            snprintf(label, sizeof label, "%s: %s refused for head size %d", name, kn, c.head_dim);
            report(so == KV_ERR_UNSUPPORTED && strstr(e.msg, "multiple of 32"), label, "status %d (%s)", so, e.msg);
            kv_session_close(s);
            continue;
        }
        if (so != KV_OK) {
            snprintf(label, sizeof label, "%s: session (%s)", name, kn);
            report(false, label, "%s", e.msg);
            continue;
        }
        /* prefill, all rows */
        const float *want = ktype == KV_TYPE_Q8_0 ? ref_q8 : ktype == KV_TYPE_Q4_0 ? ref_q4 : ref;
        kv_status st = kv_session_eval(s, ids, N, KV_LOGITS_ALL, all, &e);
        double err = st ? 1e9 : rel_err(all, want, (size_t)N * V);
        snprintf(label, sizeof label, "%s: prefill %d, all logits vs reference (%s)", name, N, kn);
        report(st == KV_OK && err <= t, label, "status %d (%s), rel err %.3g > %.3g", st, e.msg, err, t);
        if (quant) { /* and nearer it than the exact forward pass */
            double exact = st ? 1e9 : rel_err(all, ref, (size_t)N * V);
            snprintf(label, sizeof label, "%s: %s nearer its reference than the exact one", name, kn);
            report(err < exact, label, "%.3g vs %.3g", err, exact);
        }
        /* prefill, last row */
        kv_session_rewind(s, N);
        st = kv_session_eval(s, ids, N, KV_LOGITS_LAST, last, &e);
        err = st ? 1e9 : rel_err(last, all + (size_t)(N - 1) * V, V);
        snprintf(label, sizeof label, "%s: prefill last row == all's last row (%s)", name, kn);
        report(st == KV_OK && err <= 1e-6 && kv_session_pos(s) == N, label, "status %d, err %.3g, pos %d", st,
               err, kv_session_pos(s));
        /* N decode steps */
        kv_session_rewind(s, N + 100);
        bool ok = kv_session_pos(s) == 0;
        for (int i = 0; i < N && ok; i++)
            ok = kv_session_eval(s, ids + i, 1, KV_LOGITS_LAST, step + (size_t)i * V, &e) == KV_OK;
        err = ok ? rel_err(step, want, (size_t)N * V) : 1e9;
        snprintf(label, sizeof label, "%s: %d decode steps vs reference (%s)", name, N, kn);
        report(ok && err <= t, label, "%s rel err %.3g > %.3g", ok ? "" : e.msg, err, t);
        err = ok ? rel_err(step, all, (size_t)N * V) : 1e9;
        snprintf(label, sizeof label, "%s: decode steps vs prefill rows (%s)", name, kn);
        report(ok && err <= t, label, "rel err %.3g", err);
        /* rewind half and re-evaluate */
        int half = N / 2;
        kv_session_rewind(s, N - half);
        st = kv_session_eval(s, ids + half, N - half, KV_LOGITS_ALL, all, &e);
        err = st ? 1e9 : rel_err(all, step + (size_t)half * V, (size_t)(N - half) * V);
        snprintf(label, sizeof label, "%s: rewind %d and re-eval == decode (%s)", name, N - half, kn);
        /* Q8_0 K: decode of small groups takes int8 dot products with the query
         * quantized too (VNNI), prefill blocks float ones: a little further apart */
        report(st == KV_OK && err <= (quant ? 2e-3 : 5e-4), label, "status %d, err %.3g", st, err);
        const int32_t *toks = kv_session_tokens(s);
        ok = kv_session_pos(s) == N && memcmp(toks, ids, sizeof(int32_t) * N) == 0;
        snprintf(label, sizeof label, "%s: session tokens (%s)", name, kn);
        report(ok, label, "pos %d", kv_session_pos(s));
        kv_session_close(s);
    }
    kv_model_close(m);
    if (ref_q8 && N >= 8) { /* the Q8_0 cache is a real change, which the check above sees */
        snprintf(label, sizeof label, "%s: the q8_0 reference differs from the exact one", name);
        double d = rel_err(ref_q8, ref, (size_t)N * V);
        report(d > tol / 4, label, "rel diff %.3g", d);
    }
    free(ids), free(ref), free(ref_q8), free(ref_q4), free(all), free(last), free(step);
    weights_free(&w);
}

static cfg base_llama(void) {
    return (cfg){.arch = "llama", .n_layer = 2, .n_embd = 64, .n_head = 4, .n_kv = 2, .head_dim = 16,
                 .n_ff = 96, .n_vocab = 77, .wtype = KV_TYPE_F32};
}

static cfg base_gemma(void) {
    return (cfg){.arch = "gemma3", .n_layer = 3, .n_embd = 64, .n_head = 4, .n_kv = 1, .head_dim = 32,
                 .n_ff = 96, .n_vocab = 70, .wtype = KV_TYPE_F32, .tied = true, .window = 5,
                 .swa_pattern = 3, .freq_base = 1e6f};
}

/* ==== session behaviour ===================================================== */

static void check_sessions(void) {
    cfg c = base_llama();
    weights w;
    const char *path = write_model(&c, &w, "sess");
    kv_error e = {{0}};
    kv_model *m = path ? open_model(path, 2, &e) : NULL;
    report(m != NULL, "session model opens", "%s", e.msg);
    if (!m) {
        weights_free(&w);
        return;
    }
    const int V = c.n_vocab;
    int32_t ids[12];
    make_ids(ids, 12, V);
    float *ref = malloc(sizeof(float) * 12 * V), *lg = malloc(sizeof(float) * 12 * V);
    ref_forward(&c, &w, ids, 12, ref, false);

    kv_session *s = NULL;
    kv_status st = kv_session_open(m, 8, &s, &e);
    report(st == KV_OK && kv_session_ctx(s) == 8 && kv_session_pos(s) == 0, "session open ctx 8", "%s", e.msg);
    if (st) goto out;
    st = kv_session_eval(s, ids, 6, KV_LOGITS_LAST, lg, &e);
    report(st == KV_OK && kv_session_pos(s) == 6, "eval 6 tokens", "%s", e.msg);
    st = kv_session_eval(s, ids + 6, 3, KV_LOGITS_LAST, lg, &e);
    report(st == KV_ERR_CONTEXT_FULL && kv_session_pos(s) == 6 &&
               strstr(e.msg, "context full: 6 tokens in session + 3 new > n_ctx 8"),
           "context full leaves pos, names the numbers", "status %d pos %d msg '%s'", st, kv_session_pos(s), e.msg);
    int32_t bad[2] = {ids[6], V};
    st = kv_session_eval(s, bad, 2, KV_LOGITS_LAST, lg, &e);
    report(st == KV_ERR_ARG && kv_session_pos(s) == 6 && strstr(e.msg, "out of range"),
           "id out of range is an argument error, pos unchanged", "status %d pos %d msg '%s'", st,
           kv_session_pos(s), e.msg);
    bad[1] = -1;
    st = kv_session_eval(s, bad, 2, KV_LOGITS_LAST, lg, &e);
    report(st == KV_ERR_ARG && kv_session_pos(s) == 6, "negative id rejected", "status %d", st);
    st = kv_session_eval(s, ids + 6, 2, KV_LOGITS_ALL, lg, &e);
    double err = st ? 1e9 : rel_err(lg, ref + 6 * V, 2 * (size_t)V);
    report(st == KV_OK && kv_session_pos(s) == 8 && err < 2e-3, "after the failures, eval continues correctly",
           "status %d err %.3g", st, err);
    st = kv_session_eval(s, ids, 1, KV_LOGITS_NONE, NULL, &e);
    report(st == KV_ERR_CONTEXT_FULL, "full session refuses one more", "status %d", st);
    /* 8 positions held: one page of 16 (layers 2, KV heads 2, head 16, f16, K and V) */
    report(kv_session_kv_bytes(s) == (uint64_t)2 * 2 * 16 * (16 * 2) * 2, "session kv bytes (f16)", "%llu",
           (unsigned long long)kv_session_kv_bytes(s));
    report(kv_model_kv_bytes(m, 8, KV_TYPE_F16, KV_TYPE_F16) == kv_session_kv_bytes(s),
           "model kv bytes == session kv bytes", "%llu", (unsigned long long)kv_model_kv_bytes(m, 8, 1, 1));
    kv_session_rewind(s, 100);
    report(kv_session_pos(s) == 0, "rewind past the start empties", "pos %d", kv_session_pos(s));
    st = kv_session_eval(s, ids, 0, KV_LOGITS_NONE, NULL, &e);
    report(st == KV_OK && kv_session_pos(s) == 0, "eval of 0 tokens is a no-op", "status %d", st);
    kv_session_close(s);
    s = NULL;
    st = kv_session_open(m, 0, &s, &e);
    report(st == KV_ERR_ARG && !s, "n_ctx 0 rejected", "status %d", st);
    const kv_model_info *in = kv_model_info_get(m);
    report(in->n_layer == 2 && in->n_embd == 64 && in->n_head == 4 && in->n_head_kv == 2 && in->head_dim == 16 &&
               in->n_ff == 96 && in->n_vocab == V && in->threads == 2 && in->has_weights &&
               strcmp(in->arch, "llama") == 0 && strcmp(in->name, "tiny test model") == 0 &&
               kv_model_vocab(m) == NULL && kv_model_gguf(m) != NULL,
           "model info", "layers %d embd %d vocab %d", in->n_layer, in->n_embd, in->n_vocab);
out:
    free(ref), free(lg);
    kv_model_close(m);
    weights_free(&w);

    /* a long prompt crosses several chunks */
    c = base_llama();
    c.n_layer = 1;
    path = write_model(&c, &w, "long");
    m = path ? open_model(path, 2, &e) : NULL;
    if (m) {
        const int N = KV_CHUNK * 2 + 37;
        int32_t *lid = malloc(sizeof(int32_t) * N);
        make_ids(lid, N, c.n_vocab);
        float *r = malloc(sizeof(float) * N * c.n_vocab), *a = malloc(sizeof(float) * N * c.n_vocab);
        ref_forward(&c, &w, lid, N, r, false);
        s = NULL;
        st = kv_session_open(m, N, &s, &e);
        if (!st) st = kv_session_eval(s, lid, N, KV_LOGITS_ALL, a, &e);
        err = st ? 1e9 : rel_err(a, r, (size_t)N * c.n_vocab);
        report(st == KV_OK && err < 3e-3, "prefill of 3 chunks (all logits) vs reference", "status %d (%s) err %.3g",
               st, e.msg, err);
        kv_session_rewind(s, N);
        if (!st) st = kv_session_eval(s, lid, N, KV_LOGITS_LAST, a, &e);
        err = st ? 1e9 : rel_err(a, r + (size_t)(N - 1) * c.n_vocab, c.n_vocab);
        report(st == KV_OK && err < 3e-3, "prefill of 3 chunks (last logits) vs reference", "err %.3g", err);
        kv_session_close(s);
        kv_model_close(m);
        free(lid), free(r), free(a);
    } else {
        report(false, "long model opens", "%s", e.msg);
    }
    weights_free(&w);
}

/* Threads 1 vs 2 give the same logits (decode with key splitting too). */
static void check_threads(void) {
    cfg c = base_gemma();
    weights w;
    const char *path = write_model(&c, &w, "threads");
    kv_error e = {{0}};
    kv_model *m1 = path ? open_model(path, 1, &e) : NULL, *m2 = path ? open_model(path, 2, &e) : NULL;
    if (!m1 || !m2) {
        report(false, "threads: models open", "%s", e.msg);
    } else {
        const int N = 40, V = c.n_vocab;
        int32_t ids[40];
        make_ids(ids, N, V);
        float *a = malloc(sizeof(float) * N * V), *b = malloc(sizeof(float) * N * V);
        kv_session *s1 = NULL, *s2 = NULL;
        kv_session_open(m1, N, &s1, &e);
        kv_session_open(m2, N, &s2, &e);
        bool ok = s1 && s2 && kv_session_eval(s1, ids, N - 8, KV_LOGITS_ALL, a, &e) == KV_OK &&
                  kv_session_eval(s2, ids, N - 8, KV_LOGITS_ALL, b, &e) == KV_OK;
        for (int i = N - 8; i < N && ok; i++)
            ok = kv_session_eval(s1, ids + i, 1, KV_LOGITS_LAST, a + (size_t)i * V, &e) == KV_OK &&
                 kv_session_eval(s2, ids + i, 1, KV_LOGITS_LAST, b + (size_t)i * V, &e) == KV_OK;
        double err = ok ? rel_err(a, b, (size_t)N * V) : 1e9;
        report(ok && err <= 1e-5, "threads 1 vs 2 (prefill + decode)", "%s err %.3g", e.msg, err);
        kv_session_close(s1);
        kv_session_close(s2);
        free(a), free(b);
    }
    kv_model_close(m1);
    kv_model_close(m2);
    weights_free(&w);
}

/* Every weight type runs and stays near the reference (activations are
 * quantized to 8 bits for the quantized types, so the bound is loose). */
static void check_types(void) {
    static const int types[] = {KV_TYPE_F16, KV_TYPE_BF16, KV_TYPE_Q8_0, KV_TYPE_Q4_0, KV_TYPE_Q4_1,
                                KV_TYPE_Q5_0, KV_TYPE_Q5_1, KV_TYPE_Q4_K, KV_TYPE_Q5_K, KV_TYPE_Q6_K};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        cfg c = base_llama();
        c.wtype = types[i];
        c.n_embd = 256;
        c.n_ff = 256;
        c.head_dim = 64;
        c.n_layer = 1;
        if (types[i] == KV_TYPE_Q4_K || types[i] == KV_TYPE_Q5_K || types[i] == KV_TYPE_Q6_K) {
            c.head_dim = 64; /* n_head * hd = 256 keeps attn_output's rows a multiple of 256 */
        }
        weights w;
        char name[64];
        snprintf(name, sizeof name, "type_%s", kv_type_traits_get(types[i])->name);
        const char *path = write_model(&c, &w, name);
        kv_error e = {{0}};
        kv_model *m = path ? open_model(path, 2, &e) : NULL;
        char label[128];
        snprintf(label, sizeof label, "weights %s: forward near reference", kv_type_traits_get(types[i])->name);
        if (!m) {
            report(false, label, "open: %s", e.msg);
            weights_free(&w);
            continue;
        }
        const int N = 6, V = c.n_vocab;
        int32_t ids[6];
        make_ids(ids, N, V);
        float *r = malloc(sizeof(float) * N * V), *a = malloc(sizeof(float) * N * V);
        ref_forward(&c, &w, ids, N, r, false);
        kv_session *s = NULL;
        kv_status st = kv_session_open(m, N, &s, &e);
        if (!st) st = kv_session_eval(s, ids, N, KV_LOGITS_ALL, a, &e);
        double err = st ? 1e9 : rel_err(a, r, (size_t)N * V);
        double tol = (types[i] == KV_TYPE_F16 || types[i] == KV_TYPE_BF16) ? 2e-3 : 5e-2;
        report(st == KV_OK && err <= tol, label, "status %d (%s) err %.3g > %.3g", st, e.msg, err, tol);
        kv_session_close(s);
        kv_model_close(m);
        free(r), free(a);
        weights_free(&w);
    }
}

/* ==== loader errors =============================================================== */

static void expect_open_fail(const char *label, cfg c, kv_status want, const char *frag) {
    weights w;
    const char *path = write_model(&c, &w, "bad");
    kv_error e = {{0}};
    kv_model *m = NULL;
    kv_status st = path ? kv_model_open(path, NULL, &m, &e) : KV_ERR_IO;
    report(st == want && m == NULL && strstr(e.msg, frag) != NULL, label, "status %d, message '%s' (want '%s')",
           st, e.msg, frag);
    kv_model_close(m);
    weights_free(&w);
}

static void check_loader_errors(void) {
    cfg c = base_llama();
    c.block_count_as_str = true;
    expect_open_fail("wrong-typed key fails naming it", c, KV_ERR_FORMAT, "llama.block_count");
    c = base_llama();
    c.drop_tensor = "blk.1.ffn_up.weight";
    expect_open_fail("missing tensor fails naming it", c, KV_ERR_FORMAT, "blk.1.ffn_up.weight");
    c = base_llama();
    c.drop_tensor = "token_embd.weight";
    expect_open_fail("missing token_embd fails naming it", c, KV_ERR_FORMAT, "token_embd.weight");
    c = base_llama();
    c.bad_shape = "blk.0.attn_k.weight";
    expect_open_fail("wrong tensor shape fails naming it", c, KV_ERR_FORMAT, "blk.0.attn_k.weight");
    c = base_llama();
    c.arch = "gpt2";
    expect_open_fail("unsupported architecture named", c, KV_ERR_UNSUPPORTED, "gpt2");
    c = base_llama();
    c.n_embd = 256;
    c.head_dim = 64;
    c.odd_tensor_type = KV_TYPE_Q2_K;
    expect_open_fail("unsupported tensor type named", c, KV_ERR_UNSUPPORTED, "blk.0.ffn_up.weight");
    c = base_llama();
    c.arch = "qwen2";
    c.drop_tensor = "blk.0.attn_v.bias";
    expect_open_fail("qwen2 without a bias fails naming it", c, KV_ERR_FORMAT, "blk.0.attn_v.bias");
    c = base_gemma();
    c.drop_tensor = "blk.2.attn_k_norm.weight";
    expect_open_fail("gemma3 without k norm fails naming it", c, KV_ERR_FORMAT, "blk.2.attn_k_norm.weight");
}

/* ==== the file on disk, limits ========================================================= */

static void check_file_and_limits(void) {
    cfg c = base_llama();
    weights w;
    const char *path = write_model(&c, &w, "file");
    kv_error e = {{0}};
    kv_model_params p = {.threads = KV_MAX_THREADS + 1};
    kv_model *m = NULL;
    kv_status st = path ? kv_model_open(path, &p, &m, &e) : KV_ERR_IO;
    report(st == KV_ERR_ARG && m == NULL && strstr(e.msg, "at most 256"), "threads beyond KV_MAX_THREADS refused",
           "status %d, '%s'", st, e.msg);
    m = path ? open_model(path, 1, &e) : NULL;
    report(m != NULL, "file model opens", "%s", e.msg);
    if (m) {
        uint64_t b = kv_model_kv_bytes(m, INT64_MAX, KV_TYPE_F32, KV_TYPE_F32);
        report(b == UINT64_MAX, "kv_bytes saturates instead of wrapping", "%llu", (unsigned long long)b);
        report(kv_model_check_file(m, &e) == KV_OK, "the model file is intact", "%s", e.msg);
        st = truncate(path, 100) == 0 ? kv_model_check_file(m, &e) : KV_OK;
        report(st == KV_ERR_IO && strstr(e.msg, "100 now"), "a model file truncated after load is noticed", "%s",
               e.msg);
        kv_model_close(m);
    }
    weights_free(&w);
}

/* ==== main =============================================================== */

/* ==== the paged cache ======================================================== */

/* Logits of the last position after ids[0..n) on a fresh private session
 * split at k (prefill [0, k) without logits, then [k, n)); k = 0: one call. */
static kv_status last_logits_split(kv_model *m, const int32_t *ids, int n, int k, int kt, float *out, kv_error *e) {
    kv_session *s = NULL;
    kv_status st = kv_session_open_ex(m, n + 8, kt, kt, &s, e);
    if (!st && k > 0) st = kv_session_eval(s, ids, (size_t)k, KV_LOGITS_NONE, NULL, e);
    if (!st) st = kv_session_eval(s, ids + k, (size_t)(n - k), KV_LOGITS_LAST, out, e);
    kv_session_close(s);
    return st;
}

/* Bit-exact reuse: a cold prefill, a prefill of the same ids reusing another
 * session's pages, the ids split at every page offset, and decoded one at a
 * time then reused all give the same bits. */
static void check_exact(const char *name, cfg c, int N, int kt) {
    char label[200];
    weights w;
    const char *path = write_model(&c, &w, name);
    kv_error e = {{0}};
    kv_model *m = path ? open_model(path, 2, &e) : NULL;
    if (!m) {
        report(false, name, "open: %s", e.msg);
        weights_free(&w);
        return;
    }
    const int V = c.n_vocab;
    int32_t *ids = malloc(sizeof(int32_t) * N);
    make_ids(ids, N, V);
    float *cold = malloc(sizeof(float) * V), *got = malloc(sizeof(float) * V), *all = malloc(sizeof(float) * V * N);
    kv_status st = last_logits_split(m, ids, N, 0, kt, cold, &e);
    snprintf(label, sizeof label, "%s: cold prefill", name);
    report(st == KV_OK, label, "%s", e.msg);

    /* split at every position of the first pages, then every page offset */
    int bad = -1;
    for (int k = 1; k < N && bad < 0; k += k < 40 ? 1 : 16)
        if (last_logits_split(m, ids, N, k, kt, got, &e) != KV_OK || memcmp(got, cold, sizeof(float) * V)) bad = k;
    snprintf(label, sizeof label, "%s: prefill split anywhere == cold, bit for bit", name);
    report(bad < 0, label, "differs when split at %d", bad);

    /* a shared cache: the second session reuses the first one's pages */
    kv_cache_params cp = {.pages = 64, .page_tokens = 16, .ktype = kt, .vtype = kt, .prefix = true};
    kv_cache *cache = NULL;
    st = kv_cache_open(m, &cp, &cache, &e);
    kv_session_params sp = {.n_ctx = N + 8, .cache = cache};
    kv_session *a = NULL, *b = NULL, *d = NULL;
    if (!st) st = kv_session_open_p(m, &sp, &a, &e);
    if (!st) st = kv_session_eval(a, ids, N, KV_LOGITS_LAST, got, &e);
    if (!st) st = kv_session_open_p(m, &sp, &b, &e);
    if (!st) st = kv_session_eval(b, ids, N, KV_LOGITS_LAST, got, &e);
    snprintf(label, sizeof label, "%s: reused prefix == cold, bit for bit (%llu tokens reused)", name,
             b ? (unsigned long long)kv_session_reused_tokens(b) : 0ull);
    report(st == KV_OK && b && kv_session_reused_tokens(b) >= (uint64_t)((N - 1) / 16 * 16) &&
               !memcmp(got, cold, sizeof(float) * V),
           label, "status %d %s", st, e.msg);

    /* decode one at a time from 10 tokens on, then reuse those pages */
    kv_session_close(a);
    kv_session_close(b);
    kv_cache_clear(cache);
    if (!st) st = kv_session_open_p(m, &sp, &d, &e);
    if (!st) st = kv_session_eval(d, ids, 10, KV_LOGITS_NONE, NULL, &e);
    for (int i = 10; i < N && !st; i++) st = kv_session_eval(d, ids + i, 1, KV_LOGITS_LAST, got, &e);
    snprintf(label, sizeof label, "%s: decoded one at a time == cold prefill, bit for bit", name);
    report(st == KV_OK && !memcmp(got, cold, sizeof(float) * V), label, "status %d %s", st, e.msg);
    kv_session_close(d);
    b = NULL;
    if (!st) st = kv_session_open_p(m, &sp, &b, &e);
    if (!st) st = kv_session_eval(b, ids, N, KV_LOGITS_LAST, got, &e);
    snprintf(label, sizeof label, "%s: pages written by decode, reused == cold, bit for bit", name);
    report(st == KV_OK && kv_session_reused_tokens(b) > 0 && !memcmp(got, cold, sizeof(float) * V), label,
           "status %d %s", st, e.msg);
    /* every position's logits: prefill all == the decode steps */
    kv_session_close(b);
    b = NULL;
    if (!st) st = kv_session_open_ex(m, N + 8, kt, kt, &b, &e);
    if (!st) st = kv_session_eval(b, ids, N, KV_LOGITS_ALL, all, &e);
    kv_session_close(b);
    bad = -1;
    b = NULL;
    if (!st) st = kv_session_open_ex(m, N + 8, kt, kt, &b, &e);
    for (int i = 0; i < N && !st && bad < 0; i++) {
        st = kv_session_eval(b, ids + i, 1, KV_LOGITS_LAST, got, &e);
        if (!st && memcmp(got, all + (size_t)i * V, sizeof(float) * V)) bad = i;
    }
    snprintf(label, sizeof label, "%s: logits of every position, prefill == decode, bit for bit", name);
    report(st == KV_OK && bad < 0, label, "status %d, first difference at %d", st, bad);
    kv_session_close(b);
    kv_cache_close(cache);
    kv_model_close(m);
    free(ids), free(cold), free(got), free(all);
    weights_free(&w);
}

/* Pages as tokens arrive, forks share, copy-on-write, eviction, pins,
 * policies, window pages bounded, lookup reasons. */
static void check_pool(void) {
    char label[200];
    cfg c = base_llama();
    c.wtype = KV_TYPE_Q8_0;
    c.n_embd = 64, c.head_dim = 32, c.n_head = 2, c.n_kv = 1;
    weights w;
    const char *path = write_model(&c, &w, "pool");
    kv_error e = {{0}};
    kv_model *m = path ? open_model(path, 2, &e) : NULL;
    if (!m) {
        report(false, "pool: open", "%s", e.msg);
        weights_free(&w);
        return;
    }
    int32_t ids[1100];
    make_ids(ids, 1100, c.n_vocab);
    float *lg = malloc(sizeof(float) * c.n_vocab);

    /* a private pool takes pages as tokens arrive */
    kv_session *s = NULL;
    kv_session_open(m, 4096, &s, &e);
    kv_session_eval(s, ids, 100, KV_LOGITS_NONE, NULL, &e);
    kv_cache_stats st;
    kv_cache_get_stats(kv_session_cache(s), &st);
    report(st.used == 7, "ctx 4096 session holding 100 tokens holds 7 pages", "used %lld", (long long)st.used);
    report(kv_session_kv_bytes(s) == kv_model_kv_bytes(m, 100, KV_TYPE_F16, KV_TYPE_F16),
           "session bytes == model kv_bytes for its length", "%llu vs %llu", (unsigned long long)kv_session_kv_bytes(s),
           (unsigned long long)kv_model_kv_bytes(m, 100, KV_TYPE_F16, KV_TYPE_F16));
    kv_session_close(s);

    /* a private pool for a long context takes its pages' state a slab at a time as they are used */
    s = NULL;
    kv_status lst = kv_session_open(m, 1 << 24, &s, &e);
    if (lst == KV_OK) lst = kv_session_eval(s, ids, 100, KV_LOGITS_NONE, NULL, &e);
    if (lst == KV_OK) kv_cache_get_stats(kv_session_cache(s), &st);
    report(lst == KV_OK && st.used == 7 && st.pages <= 65536,
           "ctx 2^24 session (2^20 pages of 16): pages with storage <= one slab of 65536", "%s; used %lld, pages %lld",
           lst ? e.msg : "", (long long)st.used, (long long)st.pages);
    kv_session_close(s);

    /* forks: 64 forks of a 1,000-token session */
    kv_cache_params cp = {.pages = 400, .page_tokens = 16, .ktype = KV_TYPE_F16, .vtype = KV_TYPE_F16, .prefix = true};
    kv_cache *cache = NULL;
    kv_cache_open(m, &cp, &cache, &e);
    kv_session_params sp = {.n_ctx = 2048, .cache = cache};
    kv_session_open_p(m, &sp, &s, &e);
    kv_session_eval(s, ids, 1000, KV_LOGITS_LAST, lg, &e);
    kv_cache_get_stats(cache, &st);
    const int64_t base = st.used;
    kv_session *forks[64];
    bool ok = true;
    for (int i = 0; i < 64; i++) ok = ok && kv_session_fork(s, &forks[i], &e) == KV_OK;
    kv_cache_get_stats(cache, &st);
    report(ok && st.used == base, "64 forks of a 1000-token session hold no new pages", "used %lld vs %lld",
           (long long)st.used, (long long)base);
    for (int i = 0; i < 64 && ok; i++)
        for (int k = 0; k < 16 && ok; k++) ok = kv_session_eval(forks[i], ids + 1000 + (i + k) % 50, 1, KV_LOGITS_LAST, lg, &e) == KV_OK;
    kv_cache_get_stats(cache, &st);
    snprintf(label, sizeof label, "after 16 decode steps each, at most 2 pages more per fork (%lld more)",
             (long long)(st.used - base));
    report(ok && st.used - base <= 2 * 64, label, "%s", e.msg);
    /* a fork's logits equal its parent's for the same continuation */
    kv_session *f1 = NULL, *f2 = NULL;
    kv_session_fork(s, &f1, &e);
    kv_session_fork(s, &f2, &e);
    float *l2 = malloc(sizeof(float) * c.n_vocab);
    kv_session_eval(f1, ids + 1040, 5, KV_LOGITS_LAST, lg, &e);
    kv_session_eval(f2, ids + 1040, 5, KV_LOGITS_LAST, l2, &e);
    report(!memcmp(lg, l2, sizeof(float) * c.n_vocab), "two forks continued alike give the same bits", "%s", "");
    kv_session_eval(s, ids + 1040, 5, KV_LOGITS_LAST, l2, &e);
    report(!memcmp(lg, l2, sizeof(float) * c.n_vocab), "the parent continued alike gives the same bits", "%s", "");
    kv_session_close(f1), kv_session_close(f2);
    for (int i = 0; i < 64; i++) kv_session_close(forks[i]);
    kv_session_close(s);
    kv_cache_close(cache);

    /* a small cache: eviction (LRU), cache full with numbers, pins */
    kv_cache_params small = {.pages = 10, .page_tokens = 16, .ktype = KV_TYPE_F16, .vtype = KV_TYPE_F16, .prefix = true};
    kv_cache_open(m, &small, &cache, &e);
    kv_session_params sp2 = {.n_ctx = 512, .cache = cache};
    kv_session_open_p(m, &sp2, &s, &e);
    kv_status r = kv_session_eval(s, ids, 200, KV_LOGITS_LAST, lg, &e);
    report(r == KV_ERR_CACHE_FULL && strstr(e.msg, "cache full") && kv_session_pos(s) == 0,
           "prefill past the capacity: cache full, pos unchanged", "status %d (%s)", r, e.msg);
    r = kv_session_eval(s, ids, 64, KV_LOGITS_LAST, lg, &e);
    report(r == KV_OK && kv_session_pos(s) == 64, "the session stays usable", "status %d (%s)", r, e.msg);
    kv_session_close(s); /* its 4 pages stay cached */
    int64_t cached = 0;
    const char *why = NULL;
    kv_cache_lookup(cache, ids, 64, &cached, &why, &e);
    report(cached == 64 && !why, "lookup: a closed session's pages are cached", "%lld %s", (long long)cached, why ? why : "");
    kv_cache_pin(cache, ids, 32, true, &e);
    int32_t other[160];
    make_ids(other, 160, c.n_vocab);
    kv_session_open_p(m, &sp2, &s, &e);
    /* 8 cached pages (the failed prefill's 8 full pages, 2 of them pinned),
     * 2 free: 8 new pages evict the 6 unpinned ones */
    r = kv_session_eval(s, other, 128, KV_LOGITS_LAST, lg, &e);
    kv_cache_get_stats(cache, &st);
    report(r == KV_OK && st.evictions == 6 && st.pinned == 2 && st.used == 8, "LRU evicts unpinned pages only",
           "status %d evictions %llu pinned %lld used %lld", r, (unsigned long long)st.evictions, (long long)st.pinned,
           (long long)st.used);
    kv_session_close(s);
    kv_cache_lookup(cache, ids, 64, &cached, &why, &e);
    report(cached == 32 && why && !strcmp(why, "evicted"), "lookup: pinned part cached, the rest evicted",
           "%lld %s", (long long)cached, why ? why : "(null)");
    int32_t fresh[48];
    make_ids(fresh, 48, c.n_vocab);
    fresh[0] = (fresh[0] + 1) % c.n_vocab;
    kv_cache_lookup(cache, fresh, 48, &cached, &why, &e);
    report(cached == 0 && why && !strcmp(why, "never seen"), "lookup: never seen", "%s", why ? why : "(null)");
    kv_cache_lookup(cache, ids, 40, &cached, &why, &e);
    report(cached == 32 && why && !strcmp(why, "partial page"), "lookup: a partial tail", "%lld %s", (long long)cached,
           why ? why : "");
    r = kv_cache_pin(cache, ids, 16 * 20, true, &e);
    report(r != KV_OK, "pin more than the cache holds fails", "status %d", r);
    kv_cache_close(cache);

    /* other types */
    kv_cache_params q8 = cp;
    q8.ktype = q8.vtype = KV_TYPE_Q8_0;
    kv_cache *cq = NULL, *cf = NULL;
    kv_cache_open(m, &q8, &cq, &e);
    kv_cache_open(m, &cp, &cf, &e);
    kv_session_params sq = {.n_ctx = 256, .cache = cq};
    kv_session_open_p(m, &sq, &s, &e);
    kv_session_eval(s, ids, 64, KV_LOGITS_NONE, NULL, &e);
    kv_cache_lookup(cf, ids, 64, &cached, &why, &e);
    report(cached == 0 && why && !strcmp(why, "other types"), "lookup: cached with other types", "%s", why ? why : "(null)");
    kv_session_close(s);
    kv_cache_close(cq), kv_cache_close(cf);
    free(lg), free(l2);
    kv_model_close(m);
    weights_free(&w);

    /* sliding window: window layers keep only their window */
    cfg g = base_gemma();
    g.window = 32;
    g.swa_pattern = 3;
    path = write_model(&g, &w, "pool_gemma");
    m = path ? open_model(path, 2, &e) : NULL;
    if (m) {
        int32_t *gi = malloc(sizeof(int32_t) * 1000);
        make_ids(gi, 1000, g.n_vocab);
        kv_session_open(m, 1024, &s, &e);
        r = kv_session_eval(s, gi, 1000, KV_LOGITS_NONE, NULL, &e);
        uint64_t want = kv_model_kv_bytes(m, 1000, KV_TYPE_F16, KV_TYPE_F16);
        report(r == KV_OK && kv_session_kv_bytes(s) == want, "window layers hold their window only (== model kv_bytes)",
               "%llu vs %llu", (unsigned long long)kv_session_kv_bytes(s), (unsigned long long)want);
        kv_session_close(s);
        free(gi);
        kv_model_close(m);
    }
    weights_free(&w);
}

/* ==== cache files ============================================================ */

/* Token nodes of c still held (none may outlive the pages that need them). */
static int live_tnodes(const kv_cache *c) {
    int n = 0;
    for (int32_t i = 0; i < c->n_tnodes; i++) n += c->tnodes[i].refs >= 0;
    return n;
}

static void check_cache_files(void) {
    cfg g = base_gemma(); /* a window group and a global group */
    g.window = 12;
    weights w;
    const char *path = write_model(&g, &w, "cachefile");
    kv_error e = {{0}};
    kv_model *m = path ? open_model(path, 2, &e) : NULL;
    if (!m) {
        report(false, "cache files: open", "%s", e.msg);
        weights_free(&w);
        return;
    }
    char cpath[600], spath[600];
    snprintf(cpath, sizeof cpath, "%s/c.kvc", tmpdir);
    snprintf(spath, sizeof spath, "%s/s.kv", tmpdir);
    int32_t ids[41];
    make_ids(ids, 41, g.n_vocab);
    const size_t nv = (size_t)g.n_vocab;
    float *cold = malloc(sizeof(float) * nv), *warm = malloc(sizeof(float) * nv);
    kv_session *s = NULL;
    kv_session_open(m, 64, &s, &e);
    kv_session_eval(s, ids, 41, KV_LOGITS_LAST, cold, &e);
    kv_session_save(s, spath, NULL, &e);
    kv_session_close(s);

    kv_cache_params cp = {.pages = 64, .page_tokens = 4, .ktype = KV_TYPE_F16, .vtype = KV_TYPE_F16, .prefix = true};
    kv_cache *a = NULL, *b = NULL;
    kv_cache_open(m, &cp, &a, &e);
    kv_session_params sp = {.n_ctx = 64, .cache = a};
    kv_session_open_p(m, &sp, &s, &e);
    kv_session_eval(s, ids, 40, KV_LOGITS_NONE, NULL, &e);
    kv_session_close(s);
    kv_cache_stats st;
    kv_cache_get_stats(a, &st);
    int64_t written = -1;
    kv_status r = kv_cache_save(a, cpath, NULL, NULL, NULL, 0, &written, &e);
    report(r == KV_OK && written == 20 && st.cached == 20, "cache file: every sealed page of both groups (10 + 10)",
           "status %d, %lld written, %lld cached: %s", r, (long long)written, (long long)st.cached, e.msg);
    const int32_t *pre[2] = {ids, ids};
    const size_t lens[2] = {13, 30};
    r = kv_cache_save(a, cpath, NULL, pre, lens, 2, &written, &e);
    report(r == KV_OK && written == 14, "cache file: two prefixes sharing 3 pages write 7 pages of each group once",
           "status %d, %lld written: %s", r, (long long)written, e.msg);
    r = kv_cache_save(a, cpath, NULL, NULL, NULL, 0, &written, &e); /* every page again */

    kv_cache_open(m, &cp, &b, &e);
    int64_t added = -1;
    r = kv_cache_restore(b, cpath, NULL, &added, &e);
    kv_cache_get_stats(b, &st);
    report(r == KV_OK && added == 20 && st.cached == 20 && st.used == 0, "cache file: restored as 20 cached pages",
           "status %d, added %lld, cached %lld: %s", r, (long long)added, (long long)st.cached, e.msg);
    sp.cache = b;
    kv_session_open_p(m, &sp, &s, &e);
    r = kv_session_eval(s, ids, 41, KV_LOGITS_LAST, warm, &e);
    report(r == KV_OK && kv_session_reused_tokens(s) == 40 && memcmp(cold, warm, sizeof(float) * nv) == 0,
           "cache file: the restored pages are reused (window pages too), the same bits as a cold prefill",
           "status %d, reused %llu", r, (unsigned long long)kv_session_reused_tokens(s));
    kv_session_close(s);

    kv_session *none = NULL;
    r = kv_session_restore(m, cpath, NULL, NULL, 0, &none, &e);
    report(r != KV_OK && !none && strstr(e.msg, "a cache file, not a session file"),
           "a cache file restored as a session: refused, named", "%s", e.msg);
    r = kv_cache_restore(b, spath, NULL, &added, &e);
    report(r != KV_OK && added == 0 && strstr(e.msg, "a session file, not a cache file"),
           "a session file restored into a cache: refused, named", "%s", e.msg);
    report(kv_file_kind(cpath) == KV_FILE_CACHE && kv_file_kind(spath) == KV_FILE_SESSION &&
               kv_file_kind(path) == KV_FILE_NONE,
           "kv_file_kind tells the kinds apart", "%d %d %d", kv_file_kind(cpath), kv_file_kind(spath),
           kv_file_kind(path));

    /* the token nodes go with the last page that needs them */
    report(live_tnodes(a) == 10 && live_tnodes(b) == 10, "one token node per chain page, shared by the groups",
           "%d and %d", live_tnodes(a), live_tnodes(b));
    kv_cache_clear(a);
    kv_cache_clear(b);
    report(live_tnodes(a) == 0 && live_tnodes(b) == 0, "no token node outlives the pages after a clear",
           "%d and %d", live_tnodes(a), live_tnodes(b));
    kv_cache_close(a);
    kv_cache_close(b);
    free(cold);
    free(warm);
    kv_model_close(m);
    weights_free(&w);
}

/* The backend's GELU (Gemma 3's FFN): the tanh GELU of x rounded to f16,
 * looked up in a table of f16 values, times up; x <= -10 gives 0, x >= 10
 * gives x. Every f16 input and 100000 random ones, bit for bit, whichever
 * path (AVX2 + F16C or scalar) this run's SIMD level takes. */
static float ref_gelu_tanh(float x) {
    const float k0 = 0.79788456080286535587989211986876f, k1 = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(k0 * x * (1.0f + k1 * x * x)));
}

static void check_gelu(void) {
    kv_pool *pool = NULL;
    kv_backend be;
    kv_error e;
    if (kv_pool_create(2, &pool, &e) != KV_OK || kv_backend_cpu_init(&be, pool, &e) != KV_OK) {
        report(false, "gelu: cpu backend", "%s", e.msg);
        return;
    }
    const int n = 65536 + 100000;
    float *g = malloc(sizeof(float) * n), *u = malloc(sizeof(float) * n), *want = malloc(sizeof(float) * n);
    uint32_t st = 3;
    for (int i = 0; i < n; i++) {
        st = st * 1664525u + 1013904223u;
        g[i] = i < 65536 ? kv_f16_to_f32((uint16_t)i) : ((float)(st >> 8) / 16777216.0f - 0.5f) * 30.0f;
        st = st * 1664525u + 1013904223u;
        u[i] = (float)(st >> 8) / 16777216.0f + 0.5f;
        const float x = g[i];
        const float y = x <= -10.0f ? 0.0f
                        : x >= 10.0f ? x
                                     : kv_f16_to_f32(kv_f32_to_f16(ref_gelu_tanh(kv_f16_to_f32(kv_f32_to_f16(x)))));
        want[i] = y * u[i];
    }
    be.ffn_act(&be, g, u, 1, n, KV_ACT_GELU_TANH);
    int bad = 0;
    for (int i = 0; i < n; i++)
        if (!(isnan(want[i]) && isnan(g[i])) && memcmp(&want[i], &g[i], sizeof(float)) != 0) bad++;
    report(bad == 0, "gelu: the f16 table's values, bit for bit (all f16 inputs, 100000 others)", "%d differ", bad);
    free(g), free(u), free(want);
    kv_backend_cpu_free(&be);
    kv_pool_destroy(pool);
}

int main(void) {
    const char *td = getenv("TMPDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/kvlua_test_model_XXXXXX", td && *td ? td : "/tmp");
    if (!mkdtemp(tmpdir)) {
        printf("cannot create a temporary directory\n0 passed, 1 failed\n");
        return 1;
    }

    check_gelu();
    cfg c = base_llama();
    check_forward("llama gqa 4:2 untied", c, 9, 2e-3);
    c = base_llama();
    c.tied = true;
    c.n_kv = 1; /* MQA */
    check_forward("llama tied mqa", c, 7, 2e-3);
    c = base_llama();
    c.rope_freqs = true;
    c.rope_scale = 4.0f;
    c.freq_base = 500000.0f;
    check_forward("llama rope_freqs + linear scaling", c, 8, 2e-3);
    c = base_llama();
    c.window = 3;
    check_forward("llama sliding window 3", c, 10, 2e-3);
    c = base_llama();
    c.n_head = 6; /* groups of 3 query heads, head size 32 (Q8_0 cache too) */
    c.n_kv = 2;
    c.head_dim = 32;
    check_forward("llama gqa 6:2 head 32", c, 11, 2e-3);
    c = base_llama();
    c.n_kv = 1; /* groups of 4 query heads, head size 64 (Q8_0 K through int8 dots on VNNI) */
    c.head_dim = 64;
    check_forward("llama mqa 4:1 head 64", c, 21, 2e-3);
    c = base_llama();
    c.arch = "qwen2";
    c.tied = true;
    check_forward("qwen2 biases", c, 9, 2e-3);
    c = base_gemma();
    check_forward("gemma3 window 5 pattern 3", c, 14, 2e-3);
    c = base_gemma();
    c.swa_pattern = 0; /* default 6: all three layers local */
    c.n_kv = 2;
    check_forward("gemma3 default pattern gqa", c, 9, 2e-3);

    c = base_gemma();
    c.window = 50;
    c.n_layer = 2;
    c.swa_pattern = 2;
    check_forward("gemma3 window 50 across prefill chunks", c, KV_CHUNK + 42, 3e-3);

    check_sessions();
    check_threads();
    check_types();
    check_loader_errors();
    check_file_and_limits();
    check_pool();
    check_cache_files();
    {
        cfg x = base_llama();
        x.wtype = KV_TYPE_Q4_0;
        x.n_embd = 64, x.head_dim = 32, x.n_head = 4, x.n_kv = 2;
        check_exact("exact llama q4_0", x, 150, KV_TYPE_F16);
        check_exact("exact llama q4_0, q8_0 kv", x, 150, KV_TYPE_Q8_0);
        check_exact("exact llama q4_0, q4_0 kv", x, 150, KV_TYPE_Q4_0);
        cfg gx = base_gemma();
        gx.wtype = KV_TYPE_Q8_0;
        gx.window = 40;
        check_exact("exact gemma3 window 40", gx, 300, KV_TYPE_F16);
    }

    cfg nanc = base_llama();
    nanc.nan_weights = true;
    {
        weights w;
        const char *path = write_model(&nanc, &w, "nan");
        kv_error e = {{0}};
        kv_model *m = path ? open_model(path, 1, &e) : NULL;
        kv_session *s = NULL;
        if (m) kv_session_open(m, 16, &s, &e);
        float *lg = malloc(sizeof(float) * nanc.n_vocab);
        int32_t ids[3] = {1, 2, 3};
        kv_status st = s ? kv_session_eval(s, ids, 3, KV_LOGITS_LAST, lg, &e) : KV_ERR_IO;
        report(st == KV_ERR_NUMERIC && kv_session_pos(s) == 0, "NaN logits: numeric error, pos unchanged",
               "status %d (%s)", st, e.msg);
        free(lg);
        kv_session_close(s);
        kv_model_close(m);
        weights_free(&w);
    }

    /* clean up the temporary files */
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) printf("note: could not remove %s\n", tmpdir);

    return kvt_finish();
}
