/*
 * backend_cpu.c — the CPU implementation of backend.h.
 *
 * Projections go to kv_matmul (quant.h), which quantizes activations and
 * threads over the pool. Elementwise ops (norms, RoPE, residuals, FFN
 * activation, KV store) split their rows over the pool when a prefill chunk
 * makes it worth it. Numerics follow llama.cpp's CPU path where it is cheap
 * to: RoPE angles by repeated float multiplication, RMS sums in double,
 * GELU through a table of f16 inputs, Q rounded to the K type before q.k.
 *
 * Attention: one task per (block of query tokens, KV head [, slice of
 * keys]); its rows are (token, query head of that KV group), about 16, so
 * each K/V row read from the cache serves all of them. Keys go by chunks of
 * 64: scores (8 keys at a time through a transposed K block when there are
 * 4+ rows), an online softmax (running max and sum per row), then P.V with
 * the rows' accumulators held in registers. For decode (few rows) the key
 * range is split into ATT_SPLIT slices whose partial softmaxes are merged,
 * independently of the thread count. K/V rows are read only through
 * kv_kv_span. Kernels have AVX2/FMA/F16C versions picked at run time and
 * portable fallbacks (KVLUA_SIMD=scalar forces those); on CPUs with
 * AVX-512 (F/VL/BW) decode of groups of at most 4 query heads runs 512-bit
 * kernels: scores of 8 keys reduced together, P.V with 64 outputs per row
 * in registers, K/V prefetched ATT_PF keys ahead (KVLUA_SIMD=avx2 keeps
 * the AVX2 ones).
 */
#include "backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "types.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KV_X86 1
#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KV_AVX2_DECL KV_AVX2
/* AVX-512 (F, VL, BW): 512-bit decode attention and 32 vector registers */
#define KV_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx2,fma,f16c")))
#define KV_VNNI512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,avx2,fma,f16c")))
#endif

typedef struct {
    kv_pool *pool;
    int nth;
    bool avx2; /* AVX2 + FMA + F16C usable */
    bool avx512; /* and AVX-512 F/VL/BW (decode attention) */
    bool vnni;   /* and AVX512-VNNI (Q8_0 K scores in int8) */
    uint16_t *gelu_f16; /* (65536) gelu of every f16 value, as f16 (what llama.cpp's CPU path uses) */
    /* rope cache: cos/sin of the last (params, positions) seen, reused for
     * q and k and across layers sharing the same params */
    float *rope_cs;     /* (rope_cap, n_rot/2, 2) */
    int rope_cap;       /* tokens the cache holds */
    kv_rope_params rope_rp;
    int rope_T;
    int32_t *rope_pos;  /* (rope_cap) */
    float *att_partial; /* split decode: segment states (grows with depth) */
    size_t att_partial_cap;
} cpu_ctx;

/* ==== buffers and simple ops =============================================== */

static float *cpu_alloc(kv_backend *b, size_t n) {
    void *p = NULL;
    if (n == 0) n = 1;
    if (n > SIZE_MAX / sizeof(float) - 64) return NULL;
    if (posix_memalign(&p, 64, n * sizeof(float)) != 0) return NULL;
    memset(p, 0, n * sizeof(float));
    return p;
}

static void cpu_free(kv_backend *b, float *p) { free(p); }

/* ---- parallel for: [0, n) split over the pool when there is enough work ---- */

typedef void (*range_fn)(void *arg, int64_t i0, int64_t i1);

typedef struct {
    range_fn fn;
    void *arg;
    int64_t n;
} par_job;

static void par_worker(void *arg, int ith, int nth) {
    const par_job *j = arg;
    int64_t i0 = j->n * ith / nth, i1 = j->n * (ith + 1) / nth;
    if (i0 < i1) j->fn(j->arg, i0, i1);
}

/* min_chunk: the least items worth a thread */
static void par_for(const cpu_ctx *c, int64_t n, int64_t min_chunk, range_fn fn, void *arg) {
    if (c->nth <= 1 || n < 2 * min_chunk) {
        fn(arg, 0, n);
        return;
    }
    par_job j = {fn, arg, n};
    kv_pool_run(c->pool, par_worker, &j);
}

static size_t cpu_matmul_scratch(kv_backend *b, const kv_weight *w, int64_t T) {
    return kv_matmul_scratch_size(w->type, w->cols, T);
}

static void add_bias(const float *bias, int64_t rows, int64_t T, float *y, int64_t ldy) {
    if (bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t r = 0; r < rows; r++) y[t * ldy + r] += bias[r];
}

static void cpu_matmul(kv_backend *b, const kv_weight *w, const float *bias, const float *x,
                       int64_t T, float *y, int64_t ldy, void *scratch) {
    cpu_ctx *c = b->ctx;
    kv_matmul(c->pool, w->type, w->data, w->rows, w->cols, x, T, y, ldy, scratch);
    add_bias(bias, w->rows, T, y, ldy);
}

static void cpu_matmul_n(kv_backend *b, int n, const kv_weight *const *w, const float *const *bias, const float *x,
                         int64_t T, float *const *y, void *scratch) {
    cpu_ctx *c = b->ctx;
    kv_mm_out outs[KV_MATMUL_N_MAX] = {0};
    if (n > KV_MATMUL_N_MAX) n = KV_MATMUL_N_MAX;
    for (int i = 0; i < n; i++)
        outs[i] = (kv_mm_out){.wtype = w[i]->type, .W = w[i]->data, .rows = w[i]->rows, .y = y[i], .ldy = w[i]->rows};
    kv_matmul_n(c->pool, n, outs, w[0]->cols, x, T, scratch);
    for (int i = 0; i < n; i++) add_bias(bias[i], w[i]->rows, T, y[i], w[i]->rows);
}

typedef struct {
    float *y;
    const float *x, *w;
    int64_t n;
    float eps;
} rms_args;

static void rms_rows(void *arg, int64_t t0, int64_t t1) {
    const rms_args *a = arg;
    const int64_t n = a->n;
    double ss[4];
    for (int64_t t = t0; t < t1; t++) {
        const float *xr = a->x + t * n; /* (n) */
        float *yr = a->y + t * n;       /* (n) */
        if ((t - t0) % 4 == 0) {
            /* float products summed in double in order, like ggml: four
             * rows' chains at once (each alone waits on its adds) */
            const int64_t nr = t1 - t < 4 ? t1 - t : 4;
            ss[0] = ss[1] = ss[2] = ss[3] = 0.0;
            if (nr == 4)
                for (int64_t i = 0; i < n; i++)
#pragma GCC unroll 4
                    for (int r = 0; r < 4; r++) ss[r] += (double)(xr[r * n + i] * xr[r * n + i]);
            else
                for (int r = 0; r < nr; r++)
                    for (int64_t i = 0; i < n; i++) ss[r] += (double)(xr[r * n + i] * xr[r * n + i]);
        }
        const float mean = (float)(ss[(t - t0) % 4] / (double)n);
        const float sc = 1.0f / sqrtf(mean + a->eps);
        if (a->w)
            for (int64_t i = 0; i < n; i++) yr[i] = xr[i] * sc * a->w[i];
        else
            for (int64_t i = 0; i < n; i++) yr[i] = xr[i] * sc;
    }
}

static void cpu_rmsnorm(kv_backend *b, float *y, const float *x, const float *w, int64_t T,
                        int64_t n, float eps) {
    rms_args a = {y, x, w, n, eps};
    par_for(b->ctx, T, 4096 / n + 1, rms_rows, &a);
}

/* cos/sin for T positions: angles theta_i = p * base^(-2i/n_rot), computed
 * like ggml (float, by repeated multiplication), then / factor_i and
 * * freq_scale. Table (T, half, 2). */
static void rope_table(float *cs, const kv_rope_params *rp, const int32_t *pos, int64_t T) {
    const int half = rp->n_rot / 2;
    const float theta_scale = powf(rp->freq_base, -2.0f / (float)rp->n_rot);
    for (int64_t t = 0; t < T; t++) {
        float theta = (float)pos[t];
        float *c = cs + t * half * 2;
        for (int i = 0; i < half; i++) {
            const float ff = rp->freq_factors ? rp->freq_factors[i] : 1.0f;
            const float th = rp->freq_scale * (theta / ff);
            c[2 * i] = cosf(th);
            c[2 * i + 1] = sinf(th);
            theta *= theta_scale;
        }
    }
}

typedef struct {
    float *x;
    const float *cs;
    int n_head, head_dim, half, mode;
} rope_args;

/* tokens [t0, t1) with their rows of the cos/sin table */
static void rope_rows(void *arg, int64_t t0, int64_t t1) {
    const rope_args *a = arg;
    const int half = a->half;
    for (int64_t t = t0; t < t1; t++) {
        const float *cs = a->cs + t * half * 2;
        for (int h = 0; h < a->n_head; h++) {
            float *v = a->x + (t * a->n_head + h) * (int64_t)a->head_dim; /* (head_dim) */
            if (a->mode == KV_ROPE_NEOX) {
                for (int i = 0; i < half; i++) {
                    float p = v[i], d = v[i + half];
                    v[i] = p * cs[2 * i] - d * cs[2 * i + 1];
                    v[i + half] = p * cs[2 * i + 1] + d * cs[2 * i];
                }
            } else {
                for (int i = 0; i < half; i++) {
                    float p = v[2 * i], d = v[2 * i + 1];
                    v[2 * i] = p * cs[2 * i] - d * cs[2 * i + 1];
                    v[2 * i + 1] = p * cs[2 * i + 1] + d * cs[2 * i];
                }
            }
        }
    }
}

static void cpu_rope(kv_backend *b, float *x, int64_t T, int n_head, int head_dim,
                     const int32_t *pos, const kv_rope_params *rp) {
    cpu_ctx *c = b->ctx;
    const int half = rp->n_rot / 2;
    float local[2 * 512]; /* fallback table for one token when the cache cannot grow */
    const float *cs = NULL;
    bool cached = c->rope_cs && T <= c->rope_cap && c->rope_T == T &&
                  memcmp(&c->rope_rp, rp, sizeof *rp) == 0 &&
                  memcmp(c->rope_pos, pos, sizeof(int32_t) * T) == 0;
    if (!cached) {
        if (T > c->rope_cap || half * 2 > 1024) {
            free(c->rope_cs);
            free(c->rope_pos);
            int cap = T < 256 ? 256 : (int)T;
            c->rope_cs = malloc(sizeof(float) * (size_t)cap * 512 * 2);
            c->rope_pos = malloc(sizeof(int32_t) * cap);
            c->rope_cap = c->rope_cs && c->rope_pos ? cap : 0;
        }
        if (c->rope_cap >= T && half <= 512) {
            rope_table(c->rope_cs, rp, pos, T);
            c->rope_rp = *rp;
            c->rope_T = (int)T;
            memcpy(c->rope_pos, pos, sizeof(int32_t) * T);
            cached = true;
        } else {
            c->rope_T = -1;
        }
    }
    if (cached && T > 1) {
        rope_args a = {x, c->rope_cs, n_head, head_dim, half, rp->mode};
        par_for(c, T, 8, rope_rows, &a);
        return;
    }
    for (int64_t t = 0; t < T; t++) {
        if (cached) {
            cs = c->rope_cs + t * half * 2;
        } else {
            if (half > 512) return;
            rope_table(local, rp, pos + t, 1);
            cs = local;
        }
        for (int h = 0; h < n_head; h++) {
            float *v = x + (t * n_head + h) * (int64_t)head_dim; /* (head_dim) */
            if (rp->mode == KV_ROPE_NEOX) {
                for (int i = 0; i < half; i++) {
                    float a = v[i], d = v[i + half];
                    v[i] = a * cs[2 * i] - d * cs[2 * i + 1];
                    v[i + half] = a * cs[2 * i + 1] + d * cs[2 * i];
                }
            } else {
                for (int i = 0; i < half; i++) {
                    float a = v[2 * i], d = v[2 * i + 1];
                    v[2 * i] = a * cs[2 * i] - d * cs[2 * i + 1];
                    v[2 * i + 1] = a * cs[2 * i + 1] + d * cs[2 * i];
                }
            }
        }
    }
}

typedef struct {
    float *y;
    const float *x;
} add_args;

static void add_range(void *arg, int64_t i0, int64_t i1) {
    const add_args *a = arg;
    for (int64_t i = i0; i < i1; i++) a->y[i] += a->x[i];
}

static void cpu_add(kv_backend *b, float *y, const float *x, int64_t n) {
    add_args a = {y, x};
    par_for(b->ctx, n, 16384, add_range, &a);
}

static void cpu_scale(kv_backend *b, float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

typedef struct {
    float *x;
    int64_t n;
} hadamard_args;

static void hadamard_range(void *arg, int64_t r0, int64_t r1) {
    const hadamard_args *a = arg;
    kv_hadamard_rows(a->x + r0 * a->n, r1 - r0, a->n);
}

static void cpu_hadamard(kv_backend *b, float *x, int64_t rows, int64_t n) {
    hadamard_args a = {x, n};
    par_for(b->ctx, rows, 16384 / n + 1, hadamard_range, &a);
}

static float gelu_tanh(float x) {
    const float k0 = 0.79788456080286535587989211986876f, k1 = 0.044715f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + tanhf(k0 * x * (1.0f + k1 * x * x)));
}

#ifdef KV_X86
static void silu_mul_avx2(float *gate, const float *up, int64_t n);
static void gelu_mul_avx2(const uint16_t *table, float *gate, const float *up, int64_t n);
#endif

/* gate = act(gate) * up. GELU goes through a table of f16 inputs, as
 * llama.cpp's CPU GELU does (input rounded to f16, result stored as f16). */
static void ffn_act_serial(const cpu_ctx *c, float *gate, const float *up, int64_t n, int act);

typedef struct {
    const cpu_ctx *c;
    float *gate;
    const float *up;
    int act;
} act_args;

static void act_range(void *arg, int64_t i0, int64_t i1) {
    const act_args *a = arg;
    ffn_act_serial(a->c, a->gate + i0, a->up + i0, i1 - i0, a->act);
}

static void cpu_ffn_act(kv_backend *b, float *gate, const float *up, int64_t T, int64_t n, int act) {
    act_args a = {b->ctx, gate, up, act};
    par_for(b->ctx, T * n, 8192, act_range, &a);
}

static void ffn_act_serial(const cpu_ctx *c, float *gate, const float *up, int64_t n, int act) {
#ifdef KV_X86
    if (act == KV_ACT_GELU_TANH && c->avx2 && c->gelu_f16) {
        gelu_mul_avx2(c->gelu_f16, gate, up, n);
        return;
    }
#endif
    if (act == KV_ACT_GELU_TANH) {
        for (int64_t i = 0; i < n; i++) {
            float g = gate[i], y;
            if (g <= -10.0f)
                y = 0.0f;
            else if (g >= 10.0f)
                y = g;
            else if (c->gelu_f16)
                y = kv_f16_to_f32(c->gelu_f16[kv_f32_to_f16(g)]);
            else
                y = gelu_tanh(g);
            gate[i] = y * up[i];
        }
        return;
    }
#ifdef KV_X86
    if (c->avx2) {
        silu_mul_avx2(gate, up, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

static void cpu_softcap(kv_backend *b, float *x, int64_t n, float cap) {
    for (int64_t i = 0; i < n; i++) x[i] = cap * tanhf(x[i] / cap);
}

static void cpu_embed(kv_backend *b, const kv_weight *emb, const int32_t *ids, int64_t T, float *out) {
    size_t row = kv_row_size(emb->type, emb->cols);
    for (int64_t t = 0; t < T; t++)
        kv_dequantize_row(emb->type, (const uint8_t *)emb->data + (size_t)ids[t] * row,
                          out + t * emb->cols, emb->cols);
}

#ifdef KV_X86
KV_AVX2_DECL static void f32_to_f16_avx2(uint16_t *dst, const float *src, int n);
#endif

static void store_row(const cpu_ctx *c, int type, void *dst, const float *src, int n) {
    if (type == KV_TYPE_F16) {
#ifdef KV_X86
        if (c->avx2 && n % 8 == 0) {
            f32_to_f16_avx2(dst, src, n);
            return;
        }
#endif
        kv_f32_to_f16_row(src, dst, n);
    } else if (type == KV_TYPE_Q8_0 || type == KV_TYPE_Q4_0) {
        kv_quantize_row(type, src, dst, n);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

typedef struct {
    const cpu_ctx *c;
    kv_kvcache *kv;
    int layer, pos0;
    const float *k, *v;
} store_args;

static void store_range(void *arg, int64_t t0, int64_t t1) {
    const store_args *a = arg;
    kv_kvcache *c = a->kv;
    const int kt = kv_kvcache_ktype(c, a->layer), vt = kv_kvcache_vtype(c, a->layer);
    const int hd = kv_kvcache_head_dim(c, false), hdv = kv_kvcache_head_dim(c, true);
    const int n_kv = kv_kvcache_n_head_kv(c);
    for (int h = 0; h < n_kv; h++) {
        for (int64_t t = t0; t < t1; t++) {
            int n;
            uint8_t *kd = kv_kv_span_mut(c, a->layer, h, a->pos0 + (int)t, &n, false);
            uint8_t *vd = kv_kv_span_mut(c, a->layer, h, a->pos0 + (int)t, &n, true);
            store_row(a->c, kt, kd, a->k + (t * n_kv + h) * hd, hd);
            store_row(a->c, vt, vd, a->v + (t * n_kv + h) * hdv, hdv);
        }
    }
}

/* k (T, n_kv, hd) and v (T, n_kv, hdv) into the cache rows of pos0.. */
static void cpu_kv_store(kv_backend *b, kv_kvcache *c, int layer, int pos0, int64_t T,
                         const float *k, const float *v) {
    store_args a = {b->ctx, c, layer, pos0, k, v};
    par_for(b->ctx, T, 16, store_range, &a);
}

/* A NaN or an infinity has every exponent bit set: blocks of 1024 values
 * are OR-reduced without branches (the compiler vectorizes the loop). */
static bool cpu_all_finite(kv_backend *b, const float *x, int64_t n) {
    (void)b;
    for (int64_t i0 = 0; i0 < n; i0 += 1024) {
        const int64_t m = n - i0 < 1024 ? n - i0 : 1024;
        uint32_t bad = 0;
        for (int64_t i = 0; i < m; i++) {
            uint32_t w;
            memcpy(&w, x + i0 + i, 4);
            bad |= (w & 0x7F800000u) == 0x7F800000u;
        }
        if (bad) return false;
    }
    return true;
}

/* ==== attention kernels ======================================================
 * K/V rows are F16, F32 or Q8_0 (32 int8 with an f16 scale per block).
 * axpy_v: acc(n) += p * V row. */

static void axpy_v_scalar(float *acc, const void *vrow, int vtype, float p, int n) {
    if (vtype == KV_TYPE_F16) {
        const uint16_t *v = vrow;
        for (int i = 0; i < n; i++) acc[i] += p * kv_f16_to_f32(v[i]);
    } else if (vtype == KV_TYPE_Q4_0) { /* 32 values: f16 scale, 16 bytes of nibbles (low: 0-15, high: 16-31) */
        const uint8_t *b = vrow;
        for (int i0 = 0; i0 < n; i0 += 32, b += 18) {
            uint16_t dh;
            memcpy(&dh, b, 2);
            const float pd = p * kv_f16_to_f32(dh);
            for (int i = 0; i < 16; i++) {
                acc[i0 + i] += pd * (float)((b[2 + i] & 0x0F) - 8);
                acc[i0 + 16 + i] += pd * (float)((b[2 + i] >> 4) - 8);
            }
        }
    } else if (vtype == KV_TYPE_Q8_0) {
        const uint8_t *b = vrow;
        for (int i0 = 0; i0 < n; i0 += 32, b += 34) {
            uint16_t dh;
            memcpy(&dh, b, 2);
            const float pd = p * kv_f16_to_f32(dh);
            for (int i = 0; i < 32; i++) acc[i0 + i] += pd * (float)(int8_t)b[2 + i];
        }
    } else {
        const float *v = vrow;
        for (int i = 0; i < n; i++) acc[i] += p * v[i];
    }
}

#ifdef KV_X86

KV_AVX2 static inline float hsum256(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* 8 floats of a K/V row from element i (i % 8 == 0); Q8_0 rows are
 * dequantized (d * q). */
KV_AVX2 static inline __m256 kv_load8(const uint8_t *row, int t, int i) {
    if (t == KV_TYPE_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    if (t == KV_TYPE_F32) return _mm256_loadu_ps((const float *)row + i);
    if (t == KV_TYPE_Q4_0) { /* values j..j+7 of a block: low nibbles of bytes j.., or high ones of j-16.. */
        const uint8_t *b = row + (size_t)(i >> 5) * 18;
        const int j = i & 31;
        uint16_t dh;
        memcpy(&dh, b, 2);
        __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + (j & 15)));
        q = j < 16 ? _mm_and_si128(q, _mm_set1_epi8(0x0F)) : _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F));
        __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q), _mm256_set1_epi32(8));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(_cvtsh_ss(dh)));
    }
    const uint8_t *b = row + (size_t)(i >> 5) * 34;
    uint16_t dh;
    memcpy(&dh, b, 2);
    __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + (i & 31))));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(_cvtsh_ss(dh)));
}

/* exp(x) for 8 lanes, x <= 0 here (scores minus their max); ~2 ulp. */
KV_AVX2 static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* x[i] = exp(sc * (x[i] - mx)), returns the sum. */
KV_AVX2 static float exp_sub_sum_avx2(float *x, int n, float mx, float sc) {
    __m256 m = _mm256_set1_ps(mx), vs = _mm256_set1_ps(sc), s = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = exp256(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m), vs));
        _mm256_storeu_ps(x + i, v);
        s = _mm256_add_ps(s, v);
    }
    float t = hsum256(s);
    for (; i < n; i++) {
        x[i] = expf(sc * (x[i] - mx));
        t += x[i];
    }
    return t;
}

KV_AVX2 static float max_avx2(const float *x, int n) {
    int i = 0;
    float m = x[0];
    if (n >= 8) {
        __m256 v = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
        __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        a = _mm_max_ps(a, _mm_movehl_ps(a, a));
        a = _mm_max_ss(a, _mm_movehdup_ps(a));
        m = _mm_cvtss_f32(a);
    }
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* n % 8 == 0 */
KV_AVX2 static void f32_to_f16_avx2(uint16_t *dst, const float *src, int n) {
    for (int i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}

/* y(n) = x rounded to f16 and back; n % 8 == 0 */
KV_AVX2 static void round_f16_avx2(float *y, const float *x, int n) {
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
}

/* gate = silu(gate) * up */
KV_AVX2 static void silu_mul_avx2(float *gate, const float *up, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(87.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 ng = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), lo), hi);
        __m256 e = exp256(ng);
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    if (i < n) { /* the tail through the same vector code, so an element's
                  * result does not depend on where a range ends */
        float g8[8] = {0}, u8[8] = {0};
        memcpy(g8, gate + i, sizeof(float) * (size_t)(n - i));
        memcpy(u8, up + i, sizeof(float) * (size_t)(n - i));
        silu_mul_avx2(g8, u8, 8);
        memcpy(gate + i, g8, sizeof(float) * (size_t)(n - i));
    }
}

/* The GELU table lookup of ffn_act_serial, 8 at a time: the same f16
 * rounding (F16C), table entries and selects. The table has one entry of
 * padding: the 32-bit gather at index 65535 reads it. */
KV_AVX2 static void gelu_mul_avx2(const uint16_t *table, float *gate, const float *up, int64_t n) {
    const __m256 lo = _mm256_set1_ps(-10.0f), hi = _mm256_set1_ps(10.0f);
    const __m256i low16 = _mm256_set1_epi32(0xFFFF);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256i h = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(g, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i e = _mm256_and_si256(_mm256_i32gather_epi32((const int *)table, h, 2), low16);
        const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(e, e), 0x08); /* 8 halves, low lane */
        __m256 y = _mm256_cvtph_ps(_mm256_castsi256_si128(p16));
        y = _mm256_blendv_ps(y, g, _mm256_cmp_ps(g, hi, _CMP_GE_OQ));
        y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(g, lo, _CMP_LE_OQ));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(y, _mm256_loadu_ps(up + i)));
    }
    if (i < n) { /* the tail through the same vector code */
        float g8[8] = {0}, u8[8] = {0};
        memcpy(g8, gate + i, sizeof(float) * (size_t)(n - i));
        memcpy(u8, up + i, sizeof(float) * (size_t)(n - i));
        gelu_mul_avx2(table, g8, u8, 8);
        memcpy(gate + i, g8, sizeof(float) * (size_t)(n - i));
    }
}
#endif

static float exp_sub_sum_scalar(float *x, int n, float mx, float sc) {
    float t = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(sc * (x[i] - mx));
        t += x[i];
    }
    return t;
}

/* ==== attention =============================================================== */

#define ATT_CHUNK 64 /* keys per softmax chunk */
#ifndef ATT_PF
#define ATT_PF 512   /* software prefetch distance of the decode kernels, in keys */
#endif
#ifndef ATT_HINT
#define ATT_HINT _MM_HINT_T1 /* into L2: L1 has too few miss buffers for the distance */
#endif

/* Query tokens per task: the rows of a task are (token, head of the group),
 * about 16 of them, so each K/V row read serves several queries. */
static int att_tokens_per_task(const kv_attn_params *ap) {
    int G = ap->n_head / ap->n_head_kv;
    return G >= 16 ? 1 : 16 / G;
}

/* The reduction order of a query row is fixed by key positions alone, so a
 * row's output does not depend on the rows computed beside it, the chunk
 * it came in, the split, or the thread count (what makes reused, forked
 * and decoded-then-reused K/V give bit-identical results):
 *   - keys go in chunks [64c, 64c + 64) of absolute positions (softmax
 *     steps), read span by span through kv_kv_span;
 *   - chunks form segments [256s, 256s + 256), each reduced from a fresh
 *     state into (max, sum, acc), and segments are merged in position
 *     order by att_merge, whether one task runs them all (prefill) or each
 *     segment is a task of its own (decode: they run in parallel, and the
 *     merge runs after);
 *   - rows go through the kernels in groups of at most 4, and every kernel
 *     computes a (row, key) score and a (row, key) P.V step the same way
 *     whatever the group or the position of the key in its chunk. */
#define ATT_SEG 256

typedef struct {
    const cpu_ctx *c;
    const kv_kvcache *kv;
    const kv_attn_params *ap;
    const float *q; /* (T, n_head, head_dim) */
    int64_t T;
    int pos0;
    float *out;     /* (T, n_head, head_dim_v) */
    float *work;
    int tb;         /* query tokens per task */
    bool split;     /* one task per segment, partial states merged afterwards */
    int seg0, n_seg; /* segments of the union key range (split) */
    size_t per_thread; /* floats of private scratch per thread */
    float *partial; /* split: (n_seg, T, n_head, head_dim_v + 2): acc, max, sum */
} att_job;

/* Floats of per-thread scratch for R rows: qf (R, hd), acc and tot
 * (R, hdv), s (R, ATT_CHUNK), m, l, M, L, lo, hi (R each), kf (hd, 8),
 * and the int8 queries of Q8_0 K (R * hd bytes + 2 R hd/32 floats). */
static size_t att_thread_floats(const kv_attn_params *ap) {
    size_t R = (size_t)(ap->n_head / ap->n_head_kv) * att_tokens_per_task(ap);
    size_t hd = (size_t)ap->head_dim;
    size_t n = R * hd + 2 * R * ap->head_dim_v + R * ATT_CHUNK + 6 * R + 8 * hd + R * hd / 4 + 2 * R * (hd / 32 + 1);
    return (n + 15) & ~(size_t)15;
}

/* Decode (few query rows) splits the keys into segments so every thread has
 * work; the arithmetic is the same either way. */
static bool att_split(const kv_attn_params *ap, int64_t T) {
    int64_t blocks = (T + att_tokens_per_task(ap) - 1) / att_tokens_per_task(ap);
    return blocks * ap->n_head_kv < 8;
}

static size_t cpu_attn_scratch(kv_backend *b, const kv_attn_params *ap, int64_t T) {
    const cpu_ctx *c = b->ctx;
    return (size_t)c->nth * att_thread_floats(ap); /* split partials live in the backend (they grow with depth) */
}

/* ---- chunk kernels: scores S(R, n) = Qf(R, hd) . K(n, hd)^T and
 * ACC(R, hdv) += P(R, n) . V(n, hdv) ---- */

static void att_scores_scalar(float *s, const float *qf, int R, int hd, const uint8_t *K, size_t kr,
                              int kt, int n, float *kf) {
    for (int j = 0; j < n; j++) {
        const void *kj = K + (size_t)j * kr;
        if (kt == KV_TYPE_F16) {
            for (int i = 0; i < hd; i++) kf[i] = kv_f16_to_f32(((const uint16_t *)kj)[i]);
        } else if (kt == KV_TYPE_Q8_0 || kt == KV_TYPE_Q4_0) {
            kv_dequantize_row(kt, kj, kf, hd);
        } else {
            memcpy(kf, kj, sizeof(float) * hd);
        }
        for (int r = 0; r < R; r++) {
            float d = 0.0f;
            for (int i = 0; i < hd; i++) d += kf[i] * qf[r * hd + i];
            s[r * ATT_CHUNK + j] = d;
        }
    }
}

static void att_pv_scalar(float *acc, const float *p, int R, int hdv, const uint8_t *V, size_t vr,
                          int vt, int n) {
    for (int j = 0; j < n; j++)
        for (int r = 0; r < R; r++) axpy_v_scalar(acc + r * hdv, V + (size_t)j * vr, vt, p[r * ATT_CHUNK + j], hdv);
}

#ifdef KV_X86
/* P.V for at most 3 rows (decode of a small GQA group): the keys are the
 * outer loop and each row's probability is broadcast once per key, with
 * 32 output floats per row in registers. hdv % 32 == 0. */
KV_AVX2 static void att_pv3_avx2(float *acc, const float *p, int R, int hdv, const uint8_t *V, size_t vr,
                                 int vt, int n) {
    for (int d = 0; d < hdv; d += 32) {
        __m256 a[3][4];
#pragma GCC unroll 3
        for (int r = 0; r < 3; r++)
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                a[r][k] = r < R ? _mm256_loadu_ps(acc + r * hdv + d + 8 * k) : _mm256_setzero_ps();
        for (int j = 0; j < n; j++) {
            const uint8_t *vj = V + (size_t)j * vr;
            __m256 pb[3];
#pragma GCC unroll 3
            for (int r = 0; r < 3; r++) pb[r] = _mm256_broadcast_ss(p + (size_t)(r < R ? r : 0) * ATT_CHUNK + j);
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                __m256 v = kv_load8(vj, vt, d + 8 * k);
#pragma GCC unroll 3
                for (int r = 0; r < 3; r++)
                    if (r < R) a[r][k] = _mm256_fmadd_ps(pb[r], v, a[r][k]);
            }
        }
#pragma GCC unroll 3
        for (int r = 0; r < 3; r++)
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                if (r < R) _mm256_storeu_ps(acc + r * hdv + d + 8 * k, a[r][k]);
    }
}

/* hd % 8 == 0 */
KV_AVX2 static void att_scores_avx2(float *s, const float *qf, int R, int hd, const uint8_t *K,
                                    size_t kr, int kt, int n, float *kf) {
    /* one key at a time, every row alike (a row's scores must not depend
     * on how many rows are computed beside it) */
    for (int j = 0; j < n; j++) {
        const void *kj = K + (size_t)j * kr;
        const float *k = kj;
        /* the next chunk's rows: keep several memory reads in flight */
        for (size_t o = 0; o < kr; o += 64) _mm_prefetch((const char *)kj + (size_t)ATT_CHUNK * kr + o, _MM_HINT_T0);
        if (kt != KV_TYPE_F32) {
            for (int i = 0; i < hd; i += 8) _mm256_storeu_ps(kf + i, kv_load8(kj, kt, i));
            k = kf;
        }
        for (int r = 0; r < R; r++) {
            const float *q = qf + r * hd;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            int i = 0;
            for (; i + 16 <= hd; i += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(k + i), _mm256_loadu_ps(q + i), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(k + i + 8), _mm256_loadu_ps(q + i + 8), a1);
            }
            for (; i < hd; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(k + i), _mm256_loadu_ps(q + i), a0);
            s[r * ATT_CHUNK + j] = hsum256(_mm256_add_ps(a0, a1));
        }
    }
}

/* hdv % 8 == 0; rows in groups of 8 held in registers over the keys */
KV_AVX2 static void att_pv_avx2(float *acc, const float *p, int R, int hdv, const uint8_t *V, size_t vr,
                                int vt, int n) {
    for (int j = 0; j < n; j++) /* the next chunk's V rows */
        for (size_t o = 0; o < vr; o += 64) _mm_prefetch((const char *)V + (size_t)(ATT_CHUNK + j) * vr + o, _MM_HINT_T0);
    if (R <= 3 && hdv % 32 == 0) {
        att_pv3_avx2(acc, p, R, hdv, V, vr, vt, n);
        return;
    }
    for (int r0 = 0; r0 < R; r0 += 8) {
        const int rn = R - r0 < 8 ? R - r0 : 8;
        for (int d = 0; d < hdv; d += 8) {
            __m256 a[8];
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++)
                a[r] = r < rn ? _mm256_loadu_ps(acc + (r0 + r) * hdv + d) : _mm256_setzero_ps();
            for (int j = 0; j < n; j++) {
                const uint8_t *vj = V + (size_t)j * vr;
                __m256 v = kv_load8(vj, vt, d);
                const float *pj = p + (size_t)r0 * ATT_CHUNK + j;
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++)
                    if (r < rn) a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(pj + r * ATT_CHUNK), v, a[r]);
            }
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++)
                if (r < rn) _mm256_storeu_ps(acc + (r0 + r) * hdv + d, a[r]);
        }
    }
}
#endif

#ifdef KV_X86
/* ---- AVX-512 decode kernels: at most 4 rows (a small GQA group), F16,
 * F32 or Q8_0 K/V, head sizes multiple of 16 ---- */

/* 16 floats of a K/V row from element i (i % 16 == 0; Q8_0 dequantized) */
KV_AVX512 static inline __m512 row16(const uint8_t *row, int t, int i) {
    if (t == KV_TYPE_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
    if (t == KV_TYPE_F32) return _mm512_loadu_ps((const float *)row + i);
    if (t == KV_TYPE_Q4_0) { /* values 0-15 of a block: low nibbles; 16-31: high nibbles */
        const uint8_t *b = row + (size_t)(i >> 5) * 18;
        uint16_t dh;
        memcpy(&dh, b, 2);
        __m128i q = _mm_loadu_si128((const __m128i *)(b + 2));
        q = (i & 31) ? _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F)) : _mm_and_si128(q, _mm_set1_epi8(0x0F));
        __m512i v = _mm512_sub_epi32(_mm512_cvtepu8_epi32(q), _mm512_set1_epi32(8));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(_cvtsh_ss(dh)));
    }
    const uint8_t *b = row + (size_t)(i >> 5) * 34; /* Q8_0 */
    uint16_t dh;
    memcpy(&dh, b, 2);
    __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + (i & 31))));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(_cvtsh_ss(dh)));
}

/* [sum(a[0]) .. sum(a[7])] */
KV_AVX512 static inline __m256 reduce8x8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* One sum with reduce8x8's tree: ((h0 + h1) + (h2 + h3)) + ((h4 + h5) + (h6 + h7)) */
KV_AVX512 static inline float reduce1(__m256 h) {
    _Alignas(32) float v[8];
    _mm256_store_ps(v, h);
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* 512 -> 256 bits: the two halves added */
KV_AVX512 static inline __m256 fold512(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* Scores of R rows (constant) for NK keys (8, or 4) at a time: each key's
 * products are summed along the head in one 512-bit accumulator per
 * (row, key), and the NK keys' accumulators are reduced together (no
 * per-key horizontal sum). */
KV_AVX512 static inline __attribute__((always_inline)) void
scores_rk(float *s, const float *qf, const int R, const int NK, int hd, const uint8_t *K, size_t kr, int kt, int n) {
    int j = 0;
    for (; j + NK <= n; j += NK) {
        const uint8_t *Kj = K + (size_t)j * kr;
        /* the K rows ATT_PF keys ahead (the cache is usually not in L2) */
        for (size_t o = 0; o < (size_t)NK * kr; o += 64) _mm_prefetch((const char *)Kj + ATT_PF * kr + o, ATT_HINT);
        __m512 a[4][8];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 8
            for (int k = 0; k < NK; k++) a[r][k] = _mm512_setzero_ps();
        for (int i = 0; i < hd; i += 16) {
            __m512 q[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) q[r] = _mm512_loadu_ps(qf + (size_t)r * hd + i);
#pragma GCC unroll 8
            for (int k = 0; k < NK; k++) {
                __m512 kv = row16(Kj + (size_t)k * kr, kt, i);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) a[r][k] = _mm512_fmadd_ps(kv, q[r], a[r][k]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m256 h[8];
#pragma GCC unroll 8
            for (int k = 0; k < NK; k++) h[k] = fold512(a[r][k]);
            if (NK == 8) {
                _mm256_storeu_ps(s + (size_t)r * ATT_CHUNK + j, reduce8x8(h));
            } else {
                __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
                _mm_storeu_ps(s + (size_t)r * ATT_CHUNK + j,
                              _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
            }
        }
    }
    for (; j < n; j++) { /* one key: the same products and the same reduction tree */
        const uint8_t *kj = K + (size_t)j * kr;
        for (int r = 0; r < R; r++) {
            __m512 a = _mm512_setzero_ps();
            for (int i = 0; i < hd; i += 16) a = _mm512_fmadd_ps(row16(kj, kt, i), _mm512_loadu_ps(qf + (size_t)r * hd + i), a);
            s[(size_t)r * ATT_CHUNK + j] = reduce1(fold512(a));
        }
    }
}

/* ---- Q8_0 K against int8 queries (AVX512-VNNI), decode of R <= 4 rows ----
 * Each query row is quantized like a Q8_0 block row (q8, with scale dq and
 * quant sum qsum per block of 32; what llama.cpp does for a Q8_0 K cache).
 * Per 64 dims (two blocks) one vpdpbusd per (row, key) multiplies the key's
 * quants, biased to unsigned (k + 128), with the row's: sum (k + 128) q =
 * sum k q + 128 qsum. The int32 lanes of 8 keys are reduced together to
 * (key, block) sums, then scaled by dk * dq in floats. */
KV_VNNI512 static inline __m512i q8_key64(const uint8_t *row, int c) {
    const uint8_t *b = row + (size_t)c * 68; /* blocks 2c, 2c + 1: 34 bytes each */
    __m512i k = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                                   _mm256_loadu_si256((const __m256i *)(b + 36)), 1);
    return _mm512_xor_si512(k, _mm512_set1_epi8((char)0x80));
}

/* The same for Q4_0 K: blocks 2c, 2c + 1 (18 bytes each) as unsigned
 * quants u = q + 8 in 0..15, values in order (low nibbles are values 0-15
 * of a block, high nibbles 16-31): sum u q = sum (u - 8) q + 8 qsum. */
KV_VNNI512 static inline __m512i q4_key64(const uint8_t *row, int c) {
    const uint8_t *b = row + (size_t)c * 36;
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i x0 = _mm_loadu_si128((const __m128i *)(b + 2)), x1 = _mm_loadu_si128((const __m128i *)(b + 20));
    const __m256i y0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x0, 4), m), _mm_and_si128(x0, m));
    const __m256i y1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x1, 4), m), _mm_and_si128(x1, m));
    return _mm512_inserti64x4(_mm512_castsi256_si512(y0), y1, 1);
}

/* sum (u - 8) b[i] over one Q4_0 block's 32 quants */
__attribute__((noinline)) static int32_t dot_q4_32(const uint8_t *qs, const int8_t *b) {
    int32_t s = 0;
    for (int i = 0; i < 16; i++) s += ((qs[i] & 0x0F) - 8) * (int32_t)b[i] + ((qs[i] >> 4) - 8) * (int32_t)b[i + 16];
    return s;
}

/* 8 vectors of 16 int32 (one per key: lanes 0-7 block 0, 8-15 block 1) ->
 * [keys 0-3 block 0 | keys 0-3 block 1 | keys 4-7 block 0 | keys 4-7 block 1] */
KV_VNNI512 static inline __m512i reduce_keys8(const __m512i a[8]) {
    __m512i h[4];
    for (int i = 0; i < 4; i++)
        h[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    __m512i r0 = _mm512_add_epi32(_mm512_unpacklo_epi64(h[0], h[1]), _mm512_unpackhi_epi64(h[0], h[1]));
    __m512i r1 = _mm512_add_epi32(_mm512_unpacklo_epi64(h[2], h[3]), _mm512_unpackhi_epi64(h[2], h[3]));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(r0, r1, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(r0, r1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* sum a[i] b[i] over 32 int8. Kept out of the VNNI-target functions: GCC 12
 * vectorizes this signed x signed loop there into vpdpbusd, which treats one
 * side as unsigned (wrong sums for negative quants). */
static int32_t dot_i8_32(const int8_t *a, const int8_t *b) {
    int32_t s = 0;
    for (int i = 0; i < 32; i++) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

/* q8 (R, hd) quants, dq / qsum (R, hd/32); hd % 64 == 0; R constant */
KV_VNNI512 static inline __attribute__((always_inline)) void
scores_q8_r(float *s, const int8_t *q8, const float *dq, const int32_t *qsum, const int R, int hd, const uint8_t *K,
            size_t kr, int n, const int KT) {
    const int nc = hd / 64, nb = hd / 32;
    /* K blocks: Q8_0 (34 bytes, quants biased by 128) or Q4_0 (18, by 8) */
    const int bs = KT == KV_TYPE_Q4_0 ? 18 : 34, bias = KT == KV_TYPE_Q4_0 ? 8 : 128;
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const uint8_t *Kj = K + (size_t)j * kr;
        for (size_t o = 0; o < 8 * kr; o += 64) _mm_prefetch((const char *)Kj + ATT_PF * kr + o, ATT_HINT);
        __m512 S[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int c = 0; c < nc; c++) {
            __m512i kz[8];
            _Alignas(64) float dk[16];
            for (int k = 0; k < 8; k++) {
                const uint8_t *row = Kj + (size_t)k * kr, *b = row + (size_t)c * 2 * bs;
                uint16_t h0, h1;
                memcpy(&h0, b, 2);
                memcpy(&h1, b + bs, 2);
                dk[(k / 4) * 8 + k % 4] = _cvtsh_ss(h0);
                dk[(k / 4) * 8 + 4 + k % 4] = _cvtsh_ss(h1);
                kz[k] = KT == KV_TYPE_Q4_0 ? q4_key64(row, c) : q8_key64(row, c);
            }
            const __m512 dkv = _mm512_load_ps(dk);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m512i qz = _mm512_loadu_si512((const void *)(q8 + (size_t)r * hd + 64 * c));
                __m512i a[8];
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) a[k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), kz[k], qz);
                /* [b0 x4 | b1 x4 | b0 x4 | b1 x4] of this row's two blocks */
                const float d0 = dq[r * nb + 2 * c], d1 = dq[r * nb + 2 * c + 1];
                const int32_t c0 = bias * qsum[r * nb + 2 * c], c1 = bias * qsum[r * nb + 2 * c + 1];
                const __m512 dqv = _mm512_setr_ps(d0, d0, d0, d0, d1, d1, d1, d1, d0, d0, d0, d0, d1, d1, d1, d1);
                const __m512i cv = _mm512_setr_epi32(c0, c0, c0, c0, c1, c1, c1, c1, c0, c0, c0, c0, c1, c1, c1, c1);
                __m512i t = _mm512_sub_epi32(reduce_keys8(a), cv);
                S[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dkv, dqv), S[r]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m512 t = _mm512_add_ps(S[r], _mm512_shuffle_f32x4(S[r], S[r], _MM_SHUFFLE(2, 3, 0, 1)));
            _mm_storeu_ps(s + (size_t)r * ATT_CHUNK + j, _mm512_castps512_ps128(t));
            _mm_storeu_ps(s + (size_t)r * ATT_CHUNK + j + 4, _mm512_extractf32x4_ps(t, 2));
        }
    }
    for (; j < n; j++) { /* the same sums, one key at a time: even and odd blocks apart, added last */
        const uint8_t *row = K + (size_t)j * kr;
        for (int r = 0; r < R; r++) {
            float acc[2] = {0.0f, 0.0f};
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = row + (size_t)b * bs;
                uint16_t h;
                memcpy(&h, blk, 2);
                int32_t is = KT == KV_TYPE_Q4_0 ? dot_q4_32(blk + 2, q8 + (size_t)r * hd + 32 * b)
                                                : dot_i8_32((const int8_t *)blk + 2, q8 + (size_t)r * hd + 32 * b);
                acc[b & 1] = __builtin_fmaf((float)is, _cvtsh_ss(h) * dq[r * nb + b], acc[b & 1]);
            }
            s[(size_t)r * ATT_CHUNK + j] = acc[0] + acc[1];
        }
    }
}

KV_VNNI512 static void att_scores_q8_vnni(float *s, const int8_t *q8, const float *dq, const int32_t *qsum, int R,
                                          int hd, const uint8_t *K, size_t kr, int kt, int n) {
#define SCORES_Q8(KT)                                                  \
    switch (R) {                                                       \
    case 1: scores_q8_r(s, q8, dq, qsum, 1, hd, K, kr, n, KT); break;  \
    case 2: scores_q8_r(s, q8, dq, qsum, 2, hd, K, kr, n, KT); break;  \
    case 3: scores_q8_r(s, q8, dq, qsum, 3, hd, K, kr, n, KT); break;  \
    default: scores_q8_r(s, q8, dq, qsum, 4, hd, K, kr, n, KT); break; \
    }
    if (kt == KV_TYPE_Q4_0) {
        SCORES_Q8(KV_TYPE_Q4_0)
    } else {
        SCORES_Q8(KV_TYPE_Q8_0)
    }
#undef SCORES_Q8
}

/* Scores for R <= 4 rows (decode of a small GQA group). */
KV_AVX512 static void att_scores_r4_avx512(float *s, const float *qf, int R, int hd, const uint8_t *K, size_t kr,
                                           int kt, int n) {
    /* R and the K type as constants in each instantiation */
#define SCORES_RK(KT)                                                \
    switch (R) {                                                     \
    case 1: scores_rk(s, qf, 1, 8, hd, K, kr, KT, n); break;         \
    case 2: scores_rk(s, qf, 2, 8, hd, K, kr, KT, n); break;         \
    case 3: scores_rk(s, qf, 3, 8, hd, K, kr, KT, n); break;         \
    default: scores_rk(s, qf, 4, 4, hd, K, kr, KT, n); break;        \
    }
    if (kt == KV_TYPE_F16) {
        SCORES_RK(KV_TYPE_F16)
    } else if (kt == KV_TYPE_Q8_0) {
        SCORES_RK(KV_TYPE_Q8_0)
    } else if (kt == KV_TYPE_Q4_0) {
        SCORES_RK(KV_TYPE_Q4_0)
    } else {
        SCORES_RK(KV_TYPE_F32)
    }
#undef SCORES_RK
}

/* ACC(R, hdv) += P(R, n) . V(n, hdv) for R <= 4: keys outer, 64 output
 * floats per row held in registers, each row's probability broadcast once
 * per key. R and NV (16-float vectors per row and pass) are constants in
 * each instantiation. */
KV_AVX512 static inline __attribute__((always_inline)) void
pv_r4_tile(float *acc, const float *p, const int R, const int NV, int hdv, int d, const uint8_t *V, size_t vr,
           int vt, int n) {
    __m512 a[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int k = 0; k < NV; k++) a[r][k] = _mm512_loadu_ps(acc + (size_t)r * hdv + d + 16 * k);
    for (int j = 0; j < n; j++) {
        const uint8_t *vj = V + (size_t)j * vr;
        if (d == 0)
            for (size_t o = 0; o < vr; o += 64) _mm_prefetch((const char *)vj + ATT_PF * vr + o, ATT_HINT);
        __m512 pb[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) pb[r] = _mm512_set1_ps(p[(size_t)r * ATT_CHUNK + j]);
#pragma GCC unroll 4
        for (int k = 0; k < NV; k++) {
            __m512 v = row16(vj, vt, d + 16 * k);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) a[r][k] = _mm512_fmadd_ps(pb[r], v, a[r][k]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int k = 0; k < NV; k++) _mm512_storeu_ps(acc + (size_t)r * hdv + d + 16 * k, a[r][k]);
}

#define PV_R4_CASE(RR, VT)                                                                   \
    case RR:                                                                                 \
        for (d = 0; d + 64 <= hdv; d += 64) pv_r4_tile(acc, p, RR, 4, hdv, d, V, vr, VT, n); \
        for (; d < hdv; d += 16) pv_r4_tile(acc, p, RR, 1, hdv, d, V, vr, VT, n);            \
        break;

KV_AVX512 static void att_pv_r4_avx512(float *acc, const float *p, int R, int hdv, const uint8_t *V, size_t vr,
                                       int vt, int n) {
    int d;
    /* R and the V type as constants in each instantiation */
#define PV_R4_TYPE(VT)                 \
    {                                  \
        const int vt_c = VT;           \
        switch (R) {                   \
            PV_R4_CASE(1, vt_c)        \
            PV_R4_CASE(2, vt_c)        \
            PV_R4_CASE(3, vt_c)        \
            PV_R4_CASE(4, vt_c)        \
        }                              \
    }
    if (vt == KV_TYPE_F16)
        PV_R4_TYPE(KV_TYPE_F16)
    else if (vt == KV_TYPE_Q8_0)
        PV_R4_TYPE(KV_TYPE_Q8_0)
    else if (vt == KV_TYPE_Q4_0)
        PV_R4_TYPE(KV_TYPE_Q4_0)
    else
        PV_R4_TYPE(KV_TYPE_F32)
#undef PV_R4_TYPE
}
#endif

/* ---- one task: query tokens t0 .. t0+tn-1 with all heads of KV head g ----
 * Row r = (token tl, head h) = tl * G + h. */

typedef struct {
    int R, hd, hdv, kt, vt;
    size_t kr, vr;
    bool simd, wide, q8k;
    float *qf;    /* (R, hd) queries, rounded like the K type */
    float *acc;   /* (R, hdv) segment accumulators */
    float *tot;   /* (R, hdv) merged accumulators */
    float *s;     /* (R, ATT_CHUNK) scores, then probabilities */
    float *m, *l; /* (R) segment max (score units) and sum */
    float *M, *L; /* (R) merged max (exp units) and sum */
    int32_t *lo, *hi; /* (R) visible keys of each row */
    float *kf;    /* (hd, 8) K rows in f32 (scalar / AVX2 kernels) */
    int8_t *q8;   /* (R, hd) int8 queries (Q8_0 K, VNNI) */
    float *dq;    /* (R, hd/32) their scales */
    int32_t *qsum; /* (R, hd/32) their block sums */
} att_rows;

static void att_rows_init(const att_job *J, float *priv, int64_t t0, int tn, int g, att_rows *A) {
    const kv_attn_params *ap = J->ap;
    const int G = ap->n_head / ap->n_head_kv;
    A->R = tn * G, A->hd = ap->head_dim, A->hdv = ap->head_dim_v;
    A->kt = kv_kvcache_ktype(J->kv, ap->layer), A->vt = kv_kvcache_vtype(J->kv, ap->layer);
    A->kr = kv_kvcache_row_bytes(J->kv, ap->layer, false), A->vr = kv_kvcache_row_bytes(J->kv, ap->layer, true);
    const int R = A->R, hd = A->hd;
    A->qf = priv;
    A->acc = A->qf + (size_t)R * hd;
    A->tot = A->acc + (size_t)R * A->hdv;
    A->s = A->tot + (size_t)R * A->hdv;
    A->m = A->s + (size_t)R * ATT_CHUNK;
    A->l = A->m + R, A->M = A->l + R, A->L = A->M + R;
    A->lo = (int32_t *)(A->L + R), A->hi = A->lo + R;
    A->kf = (float *)(A->hi + R);
    A->q8 = (int8_t *)(A->kf + 8 * (size_t)hd);
    A->dq = (float *)(A->q8 + (size_t)R * hd);
    A->qsum = (int32_t *)(A->dq + (size_t)R * (hd / 32 + 1));
#ifdef KV_X86
    A->simd = J->c->avx2 && hd % 8 == 0 && A->hdv % 8 == 0;
    A->wide = J->c->avx512 && hd % 16 == 0 && A->hdv % 16 == 0; /* AVX-512 kernels, rows in groups of 4 */
    A->q8k = A->wide && J->c->vnni && (A->kt == KV_TYPE_Q8_0 || A->kt == KV_TYPE_Q4_0) && hd % 64 == 0;
#else
    A->simd = A->wide = A->q8k = false;
#endif
    for (int tl = 0; tl < tn; tl++) {
        const int qpos = J->pos0 + (int)(t0 + tl);
        const int lo = ap->window > 0 && qpos - ap->window + 1 > 0 ? qpos - ap->window + 1 : 0;
        for (int h = 0; h < G; h++) {
            const int r = tl * G + h;
            const float *qs = J->q + ((t0 + tl) * ap->n_head + g * G + h) * (int64_t)hd;
            float *qr = A->qf + (size_t)r * hd;
#ifdef KV_X86
            if (A->simd && A->kt == KV_TYPE_F16)
                round_f16_avx2(qr, qs, hd);
            else
#endif
                for (int i = 0; i < hd; i++) qr[i] = A->kt == KV_TYPE_F16 ? kv_f16_to_f32(kv_f32_to_f16(qs[i])) : qs[i];
            A->lo[r] = lo, A->hi[r] = qpos;
            A->M[r] = -INFINITY, A->L[r] = 0.0f;
            if (A->q8k) /* the query as Q8_0 blocks (what llama.cpp does for a Q8_0 / Q4_0 K cache) */
                for (int b = 0; b < hd / 32; b++) {
                    uint8_t blk[34];
                    kv_quantize_row(KV_TYPE_Q8_0, qr + 32 * b, blk, 32);
                    uint16_t hh;
                    memcpy(&hh, blk, 2);
                    A->dq[r * (hd / 32) + b] = kv_f16_to_f32(hh);
                    int32_t sq = 0;
                    for (int i = 0; i < 32; i++) sq += (int8_t)blk[2 + i];
                    A->qsum[r * (hd / 32) + b] = sq;
                    memcpy(A->q8 + (size_t)r * hd + 32 * b, blk + 2, 32);
                }
        }
    }
    memset(A->tot, 0, sizeof(float) * (size_t)R * A->hdv);
}

/* Scores of every row for keys p0 .. p0+n-1 (one span) into s[:, off..). */
static void att_scores_span(const att_rows *A, int off, const uint8_t *K, int n) {
    for (int r0 = 0; r0 < A->R; r0 += 4) {
        const int q = A->R - r0 < 4 ? A->R - r0 : 4;
        float *s = A->s + (size_t)r0 * ATT_CHUNK + off;
#ifdef KV_X86
        if (A->q8k) {
            const int nb = A->hd / 32;
            att_scores_q8_vnni(s, A->q8 + (size_t)r0 * A->hd, A->dq + r0 * nb, A->qsum + r0 * nb, q, A->hd, K, A->kr,
                               A->kt, n);
            continue;
        }
        if (A->wide) {
            att_scores_r4_avx512(s, A->qf + (size_t)r0 * A->hd, q, A->hd, K, A->kr, A->kt, n);
            continue;
        }
        if (A->simd) {
            att_scores_avx2(s, A->qf + (size_t)r0 * A->hd, q, A->hd, K, A->kr, A->kt, n, A->kf);
            continue;
        }
#endif
        att_scores_scalar(s, A->qf + (size_t)r0 * A->hd, q, A->hd, K, A->kr, A->kt, n, A->kf);
    }
}

/* acc += P[:, off..off+n) . V (one span) */
static void att_pv_span(const att_rows *A, int off, const uint8_t *V, int n) {
    for (int r0 = 0; r0 < A->R; r0 += 4) {
        const int q = A->R - r0 < 4 ? A->R - r0 : 4;
        float *acc = A->acc + (size_t)r0 * A->hdv;
        const float *p = A->s + (size_t)r0 * ATT_CHUNK + off;
#ifdef KV_X86
        if (A->wide) {
            att_pv_r4_avx512(acc, p, q, A->hdv, V, A->vr, A->vt, n);
            continue;
        }
        if (A->simd) {
            att_pv_avx2(acc, p, q, A->hdv, V, A->vr, A->vt, n);
            continue;
        }
#endif
        att_pv_scalar(acc, p, q, A->hdv, V, A->vr, A->vt, n);
    }
}

/* Softcap, mask and online-softmax update of every row for the chunk of
 * keys p0 .. p0+n-1 (scores in s[:, 0..n)). */
static void att_softmax_chunk(const att_rows *A, const kv_attn_params *ap, int p0, int n) {
    for (int r = 0; r < A->R; r++) {
        float *sr = A->s + (size_t)r * ATT_CHUNK;
        float sc = ap->scale;
        if (ap->softcap > 0.0f) {
            for (int j = 0; j < n; j++) sr[j] = ap->softcap * tanhf(sr[j] * sc / ap->softcap);
            sc = 1.0f;
        }
        int jlo = A->lo[r] > p0 ? A->lo[r] - p0 : 0, jhi = A->hi[r] < p0 + n - 1 ? A->hi[r] - p0 : n - 1;
        if (jlo > jhi) { /* nothing visible: probabilities 0, state unchanged */
            memset(sr, 0, sizeof(float) * n);
            continue;
        }
        for (int j = 0; j < jlo; j++) sr[j] = 0.0f;
        for (int j = jhi + 1; j < n; j++) sr[j] = 0.0f;
        float cm;
#ifdef KV_X86
        if (A->simd)
            cm = max_avx2(sr + jlo, jhi - jlo + 1);
        else
#endif
        {
            cm = sr[jlo];
            for (int j = jlo + 1; j <= jhi; j++) cm = sr[j] > cm ? sr[j] : cm;
        }
        if (A->m[r] > cm) cm = A->m[r];
        /* probabilities exp(sc (s - max)): sc > 0, so the max commutes */
        const float corr = A->m[r] == -INFINITY ? 0.0f : expf(sc * (A->m[r] - cm));
        A->m[r] = cm;
#ifdef KV_X86
        float cs = A->simd ? exp_sub_sum_avx2(sr + jlo, jhi - jlo + 1, cm, sc) : exp_sub_sum_scalar(sr + jlo, jhi - jlo + 1, cm, sc);
#else
        float cs = exp_sub_sum_scalar(sr + jlo, jhi - jlo + 1, cm, sc);
#endif
        A->l[r] = A->l[r] * corr + cs;
        if (corr != 1.0f)
            for (int i = 0; i < A->hdv; i++) A->acc[(size_t)r * A->hdv + i] *= corr;
    }
}

/* Merges a segment's (m, l, a) (m in exp units) into the running (M, L,
 * tot). Out of line, in the default target: every caller rounds the same. */
__attribute__((noinline)) static void att_merge(float *M, float *L, float *tot, float m, float l, const float *a,
                                                int hdv) {
    if (!(l > 0.0f)) return;
    if (!(*L > 0.0f)) {
        *M = m, *L = l;
        memcpy(tot, a, sizeof(float) * hdv);
        return;
    }
    const float Mn = *M > m ? *M : m, c1 = expf(*M - Mn), c2 = expf(m - Mn);
    *L = *L * c1 + l * c2;
    for (int i = 0; i < hdv; i++) tot[i] = tot[i] * c1 + a[i] * c2;
    *M = Mn;
}

__attribute__((noinline)) static void att_finish(float *o, const float *tot, float L, int hdv) {
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int i = 0; i < hdv; i++) o[i] = tot[i] * inv;
}

/* Reduces segment sg (keys [k0, k1] of it) for every row into (m, l, acc). */
static void att_segment(const att_job *J, const att_rows *A, int g, int k0, int k1) {
    const kv_attn_params *ap = J->ap;
    for (int r = 0; r < A->R; r++) A->m[r] = -INFINITY, A->l[r] = 0.0f;
    memset(A->acc, 0, sizeof(float) * (size_t)A->R * A->hdv);
#ifdef KV_X86
    /* the segment's K and V rows, page by page, into L2: pages are not
     * contiguous, so the kernels' prefetch (ATT_PF keys ahead in a span)
     * does not reach the next ones, and a decode task is over before the
     * hardware prefetchers find them */
    for (int p = k0; p <= k1;) {
        int n;
        const uint8_t *K = kv_kv_span(J->kv, ap->layer, g, p, &n, false);
        const uint8_t *V = kv_kv_span(J->kv, ap->layer, g, p, NULL, true);
        if (n > k1 - p + 1) n = k1 - p + 1;
        for (size_t o = 0; o < (size_t)n * A->kr; o += 64) _mm_prefetch((const char *)K + o, _MM_HINT_T1);
        for (size_t o = 0; o < (size_t)n * A->vr; o += 64) _mm_prefetch((const char *)V + o, _MM_HINT_T1);
        p += n;
    }
#endif
    for (int p0 = k0; p0 <= k1;) {
        const int cend = (p0 / ATT_CHUNK + 1) * ATT_CHUNK - 1; /* chunk ends at a multiple of 64 */
        const int n = (cend < k1 ? cend : k1) - p0 + 1;
        for (int off = 0; off < n;) { /* scores, span by span */
            int nk;
            const uint8_t *K = kv_kv_span(J->kv, ap->layer, g, p0 + off, &nk, false); /* (nk, hd) */
            if (nk > n - off) nk = n - off;
            att_scores_span(A, off, K, nk);
            off += nk;
        }
        att_softmax_chunk(A, ap, p0, n);
        for (int off = 0; off < n;) { /* P.V, span by span */
            int nv;
            const uint8_t *V = kv_kv_span(J->kv, ap->layer, g, p0 + off, &nv, true); /* (nv, hdv) */
            if (nv > n - off) nv = n - off;
            att_pv_span(A, off, V, nv);
            off += nv;
        }
        p0 += n;
    }
}

/* seg < 0: every segment, merged here, rows finished; else only segment
 * seg, its state written to the partials. */
static void att_task(const att_job *J, float *priv, int64_t t0, int tn, int g, int seg) {
    const kv_attn_params *ap = J->ap;
    const int G = ap->n_head / ap->n_head_kv;
    att_rows A;
    att_rows_init(J, priv, t0, tn, g, &A);
    int kmin = INT32_MAX, kmax = -1;
    for (int r = 0; r < A.R; r++) {
        if (A.lo[r] < kmin) kmin = A.lo[r];
        if (A.hi[r] > kmax) kmax = A.hi[r];
    }
    const int s_first = seg >= 0 ? seg : kmin / ATT_SEG, s_last = seg >= 0 ? seg : kmax / ATT_SEG;
    for (int sg = s_first; sg <= s_last; sg++) {
        int k0 = sg * ATT_SEG, k1 = k0 + ATT_SEG - 1;
        if (k0 < kmin) k0 = kmin;
        if (k1 > kmax) k1 = kmax;
        if (k0 > k1) { /* this task's rows see nothing of the segment */
            for (int r = 0; r < A.R; r++) A.l[r] = 0.0f, A.m[r] = -INFINITY;
            memset(A.acc, 0, sizeof(float) * (size_t)A.R * A.hdv);
        } else {
            att_segment(J, &A, g, k0, k1);
        }
        const float units = ap->softcap > 0.0f ? 1.0f : ap->scale; /* max in exp units */
        for (int tl = 0; tl < tn; tl++)
            for (int h = 0; h < G; h++) {
                const int r = tl * G + h, head = g * G + h;
                const float m = A.m[r] * units, *a = A.acc + (size_t)r * A.hdv;
                if (seg < 0) {
                    att_merge(&A.M[r], &A.L[r], A.tot + (size_t)r * A.hdv, m, A.l[r], a, A.hdv);
                } else {
                    float *o = J->partial + (((size_t)(sg - J->seg0) * J->T + t0 + tl) * ap->n_head + head) * (A.hdv + 2);
                    memcpy(o, a, sizeof(float) * A.hdv);
                    o[A.hdv] = m;
                    o[A.hdv + 1] = A.l[r];
                }
            }
    }
    if (seg >= 0) return;
    for (int tl = 0; tl < tn; tl++)
        for (int h = 0; h < G; h++) {
            const int r = tl * G + h, head = g * G + h;
            att_finish(J->out + ((t0 + tl) * ap->n_head + head) * (int64_t)A.hdv, A.tot + (size_t)r * A.hdv, A.L[r],
                       A.hdv);
        }
}

static void att_worker(void *arg, int ith, int nth) {
    const att_job *J = arg;
    const kv_attn_params *ap = J->ap;
    float *priv = J->work + (size_t)ith * J->per_thread;
    const int64_t n_blocks = (J->T + J->tb - 1) / J->tb;
    const int64_t per = J->split ? J->n_seg : 1;
    const int64_t n_tasks = n_blocks * ap->n_head_kv * per;
    /* Split: each thread takes a contiguous run of tasks, so it streams
     * consecutive segments of a head. Otherwise round robin, later blocks
     * (longer key ranges) first. Either way a task's result does not
     * depend on the thread that runs it. */
    const int64_t first = J->split ? n_tasks * ith / nth : ith, last = J->split ? n_tasks * (ith + 1) / nth : n_tasks;
    for (int64_t task = first; task < last; task += J->split ? 1 : nth) {
        const int64_t sp = task % per, rest = task / per;
        const int g = (int)(rest % ap->n_head_kv);
        const int64_t blk = n_blocks - 1 - rest / ap->n_head_kv;
        const int64_t t0 = blk * J->tb;
        const int tn = (int)(J->T - t0 < J->tb ? J->T - t0 : J->tb);
        att_task(J, priv, t0, tn, g, J->split ? J->seg0 + (int)sp : -1);
    }
}

static void cpu_attention(kv_backend *b, const kv_kvcache *kv, const kv_attn_params *ap,
                          const float *q, int64_t T, int pos0, float *out, float *work) {
    cpu_ctx *c = b->ctx;
    att_job J = {c, kv, ap, q, T, pos0, out, work, att_tokens_per_task(ap), att_split(ap, T), 0, 0,
                 att_thread_floats(ap), NULL};
    const int hdv = ap->head_dim_v;
    if (J.split) {
        const int kmin = ap->window > 0 && pos0 - ap->window + 1 > 0 ? pos0 - ap->window + 1 : 0;
        const int kmax = pos0 + (int)T - 1;
        J.seg0 = kmin / ATT_SEG;
        J.n_seg = kmax / ATT_SEG - J.seg0 + 1;
        size_t need = (size_t)J.n_seg * T * ap->n_head * (hdv + 2);
        if (need > c->att_partial_cap) {
            float *p = realloc(c->att_partial, need * sizeof(float));
            if (p) c->att_partial = p, c->att_partial_cap = need;
            else J.split = false; /* out of memory: one task per head (the same result) */
        }
        J.partial = c->att_partial;
    }
    kv_pool_run(c->pool, att_worker, &J);
    if (!J.split) return;
    /* merge the segments in position order */
    for (int64_t t = 0; t < T; t++)
        for (int h = 0; h < ap->n_head; h++) {
            float M = -INFINITY, L = 0.0f;
            float *o = out + (t * ap->n_head + h) * (int64_t)hdv;
            memset(o, 0, sizeof(float) * hdv);
            for (int sp = 0; sp < J.n_seg; sp++) {
                const float *pr = J.partial + (((size_t)sp * T + t) * ap->n_head + h) * (hdv + 2);
                att_merge(&M, &L, o, pr[hdv], pr[hdv + 1], pr, hdv);
            }
            att_finish(o, o, L, hdv);
        }
}

/* One query row for each of n sessions in one pool dispatch (a batched
 * decode): the tasks are (session, KV head) pairs, each a whole att_task
 * (segments merged there, in position order), so every row gets the bits
 * cpu_attention gives it alone. ATT_BATCH sessions per dispatch. */
#define ATT_BATCH 32

typedef struct {
    att_job jobs[ATT_BATCH];
    int n, n_kv;
} att_batch;

static void att_batch_worker(void *arg, int ith, int nth) {
    const att_batch *B = arg;
    float *priv = B->jobs[0].work + (size_t)ith * B->jobs[0].per_thread;
    for (int task = ith; task < B->n * B->n_kv; task += nth)
        att_task(&B->jobs[task / B->n_kv], priv, 0, 1, task % B->n_kv, -1);
}

static void cpu_attention_batch(kv_backend *b, kv_kvcache *const *kvs, const int32_t *pos, int n,
                                const kv_attn_params *ap, const float *q, float *out, float *work) {
    cpu_ctx *c = b->ctx;
    const size_t qs = (size_t)ap->n_head * ap->head_dim, os = (size_t)ap->n_head * ap->head_dim_v;
    att_batch B;
    for (int s0 = 0; s0 < n; s0 += ATT_BATCH) {
        B.n = n - s0 < ATT_BATCH ? n - s0 : ATT_BATCH, B.n_kv = ap->n_head_kv;
        for (int i = 0; i < B.n; i++)
            B.jobs[i] = (att_job){c, kvs[s0 + i], ap, q + (s0 + i) * qs, 1, pos[s0 + i], out + (s0 + i) * os, work,
                                  1, false, 0, 0, att_thread_floats(ap), NULL};
        kv_pool_run(c->pool, att_batch_worker, &B);
    }
}

/* ==== init ================================================================== */

kv_status kv_backend_cpu_init(kv_backend *b, kv_pool *pool, kv_error *e) {
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!c) return kv_fail(e, KV_ERR_NOMEM, "cpu backend: out of memory");
    c->pool = pool;
    c->nth = kv_pool_size(pool);
#ifdef KV_X86
    /* the kernels' run-time choice (CPUID, KVLUA_SIMD=scalar) decides for
     * the attention and element-wise paths too */
    c->avx2 = strcmp(kv_simd_name(), "scalar") != 0;
    /* KVLUA_SIMD=avx2 keeps the AVX2 paths (tests cover both) */
    c->avx512 = c->avx2 && strcmp(kv_simd_name(), "avx2") != 0 && __builtin_cpu_supports("avx512f") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
    c->vnni = c->avx512 && __builtin_cpu_supports("avx512vnni");
#endif
    c->gelu_f16 = malloc(sizeof(uint16_t) * (65536 + 1)); /* + padding for the 32-bit gathers */
    if (c->gelu_f16)
        for (int i = 0; i <= 65536; i++)
            c->gelu_f16[i] = i < 65536 ? kv_f32_to_f16(gelu_tanh(kv_f16_to_f32((uint16_t)i))) : 0;
    *b = (kv_backend){
        .name = "cpu",
        .ctx = c,
        .alloc = cpu_alloc,
        .free = cpu_free,
        .matmul_scratch = cpu_matmul_scratch,
        .matmul = cpu_matmul,
        .matmul_n = cpu_matmul_n,
        .rmsnorm = cpu_rmsnorm,
        .rope = cpu_rope,
        .add = cpu_add,
        .scale = cpu_scale,
        .hadamard = cpu_hadamard,
        .ffn_act = cpu_ffn_act,
        .softcap = cpu_softcap,
        .embed = cpu_embed,
        .kv_store = cpu_kv_store,
        .attention = cpu_attention,
        .attention_batch = cpu_attention_batch,
        .attn_scratch = cpu_attn_scratch,
        .all_finite = cpu_all_finite,
        .close = kv_backend_cpu_free,
    };
    return KV_OK;
}

void kv_backend_cpu_free(kv_backend *b) {
    if (!b || !b->ctx) return;
    cpu_ctx *c = b->ctx;
    free(c->gelu_f16);
    free(c->rope_cs);
    free(c->rope_pos);
    free(c->att_partial);
    free(b->ctx);
    b->ctx = NULL;
}
