/*
 * backend_cpu.c — the CPU implementation of backend.h.
 *
 * Projections go to kv_matmul (quant.h), which quantizes activations and
 * threads over the pool. Attention is here: one task per (query token, KV
 * head group [, slice of keys]), so all query heads sharing a KV head read
 * each K/V row once; keys are processed in chunks with an online softmax
 * (running max and sum per head), and for decode (few query rows) the key
 * range is split over the threads and the partial softmaxes merged. K/V
 * rows are read only through kv_kv_span. The f16 K.q dot product, the V
 * accumulation and exp have AVX2/FMA/F16C versions picked at run time, with
 * portable fallbacks (KVLUA_SIMD=scalar forces those).
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
#endif

typedef struct {
    kv_pool *pool;
    int nth;
    bool avx2; /* AVX2 + FMA + F16C usable */
    uint16_t *gelu_f16; /* (65536) gelu of every f16 value, as f16 (what llama.cpp's CPU path uses) */
    /* rope cache: cos/sin of the last (params, positions) seen, reused for
     * q and k and across layers sharing the same params */
    float *rope_cs;     /* (rope_cap, n_rot/2, 2) */
    int rope_cap;       /* tokens the cache holds */
    kv_rope_params rope_rp;
    int rope_T;
    int32_t *rope_pos;  /* (rope_cap) */
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

static size_t cpu_matmul_scratch(kv_backend *b, const kv_weight *w, int64_t T) {
    return kv_matmul_scratch_size(w->type, w->cols, T);
}

static void cpu_matmul(kv_backend *b, const kv_weight *w, const float *bias, const float *x,
                       int64_t T, float *y, int64_t ldy, void *scratch) {
    cpu_ctx *c = b->ctx;
    kv_matmul(c->pool, w->type, w->data, w->rows, w->cols, x, T, y, ldy, scratch);
    if (bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t r = 0; r < w->rows; r++) y[t * ldy + r] += bias[r];
}

static void cpu_rmsnorm(kv_backend *b, float *y, const float *x, const float *w, int64_t T,
                        int64_t n, float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * n; /* (n) */
        float *yr = y + t * n;       /* (n) */
        double ss = 0.0;
        for (int64_t i = 0; i < n; i++) ss += (double)(xr[i] * xr[i]);
        const float mean = (float)(ss / (double)n);
        const float sc = 1.0f / sqrtf(mean + eps);
        if (w)
            for (int64_t i = 0; i < n; i++) yr[i] = xr[i] * sc * w[i];
        else
            for (int64_t i = 0; i < n; i++) yr[i] = xr[i] * sc;
    }
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

static void cpu_add(kv_backend *b, float *y, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

static void cpu_scale(kv_backend *b, float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

static float gelu_tanh(float x) {
    const float k0 = 0.79788456080286535587989211986876f, k1 = 0.044715f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + tanhf(k0 * x * (1.0f + k1 * x * x)));
}

#ifdef KV_X86
static void silu_mul_avx2(float *gate, const float *up, int64_t n);
#endif

/* gate = act(gate) * up. GELU goes through a table of f16 inputs, as
 * llama.cpp's CPU GELU does (input rounded to f16, result stored as f16). */
static void cpu_ffn_act(kv_backend *b, float *gate, const float *up, int64_t n, int act) {
    const cpu_ctx *c = b->ctx;
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

static void store_row(int type, void *dst, const float *src, int n) {
    if (type == KV_TYPE_F16)
        kv_f32_to_f16_row(src, dst, n);
    else
        memcpy(dst, src, (size_t)n * sizeof(float));
}

static void cpu_kv_store(kv_backend *b, kv_kvcache *c, int layer, int pos0, int64_t T,
                         const float *k, const float *v) {
    (void)b;
    int kt = kv_kvcache_ktype(c), vt = kv_kvcache_vtype(c);
    const int hd = kv_kvcache_head_dim(c, false), hdv = kv_kvcache_head_dim(c, true);
    const int n_kv = kv_kvcache_n_head_kv(c);
    for (int h = 0; h < n_kv; h++) {
        for (int64_t t = 0; t < T; t++) {
            int n;
            uint8_t *kd = kv_kv_span_mut(c, layer, h, pos0 + (int)t, &n, false);
            uint8_t *vd = kv_kv_span_mut(c, layer, h, pos0 + (int)t, &n, true);
            store_row(kt, kd, k + (t * n_kv + h) * hd, hd);
            store_row(vt, vd, v + (t * n_kv + h) * hdv, hdv);
        }
    }
}

static bool cpu_all_finite(kv_backend *b, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}

/* ==== attention kernels ======================================================
 * dot_k: q(n) . K row (n, f16 or f32); axpy_v: acc(n) += p * V row. */

static float dot_k_scalar(const void *krow, int ktype, const float *q, int n) {
    float s = 0.0f;
    if (ktype == KV_TYPE_F16) {
        const uint16_t *k = krow;
        for (int i = 0; i < n; i++) s += kv_f16_to_f32(k[i]) * q[i];
    } else {
        const float *k = krow;
        for (int i = 0; i < n; i++) s += k[i] * q[i];
    }
    return s;
}

static void axpy_v_scalar(float *acc, const void *vrow, int vtype, float p, int n) {
    if (vtype == KV_TYPE_F16) {
        const uint16_t *v = vrow;
        for (int i = 0; i < n; i++) acc[i] += p * kv_f16_to_f32(v[i]);
    } else {
        const float *v = vrow;
        for (int i = 0; i < n; i++) acc[i] += p * v[i];
    }
}

#ifdef KV_X86
#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))

KV_AVX2 static inline float hsum256(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* n % 8 == 0 */
KV_AVX2 static float dot_k_avx2(const void *krow, int ktype, const float *q, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    if (ktype == KV_TYPE_F16) {
        const uint16_t *k = krow;
        for (; i + 16 <= n; i += 16) {
            __m256 k0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + i)));
            __m256 k1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + i + 8)));
            s0 = _mm256_fmadd_ps(k0, _mm256_loadu_ps(q + i), s0);
            s1 = _mm256_fmadd_ps(k1, _mm256_loadu_ps(q + i + 8), s1);
        }
        for (; i < n; i += 8)
            s0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + i))),
                                 _mm256_loadu_ps(q + i), s0);
    } else {
        const float *k = krow;
        for (; i < n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(k + i), _mm256_loadu_ps(q + i), s0);
    }
    return hsum256(_mm256_add_ps(s0, s1));
}

KV_AVX2 static void axpy_v_avx2(float *acc, const void *vrow, int vtype, float p, int n) {
    __m256 pp = _mm256_set1_ps(p);
    if (vtype == KV_TYPE_F16) {
        const uint16_t *v = vrow;
        for (int i = 0; i < n; i += 8) {
            __m256 vv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + i)));
            _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pp, vv, _mm256_loadu_ps(acc + i)));
        }
    } else {
        const float *v = vrow;
        for (int i = 0; i < n; i += 8)
            _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
    }
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

/* x[i] = exp(x[i] - mx), returns the sum. */
KV_AVX2 static float exp_sub_sum_avx2(float *x, int n, float mx) {
    __m256 m = _mm256_set1_ps(mx), s = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
        _mm256_storeu_ps(x + i, v);
        s = _mm256_add_ps(s, v);
    }
    float t = hsum256(s);
    for (; i < n; i++) {
        x[i] = expf(x[i] - mx);
        t += x[i];
    }
    return t;
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
    for (; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}
#endif

static float exp_sub_sum_scalar(float *x, int n, float mx) {
    float t = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - mx);
        t += x[i];
    }
    return t;
}

/* ==== attention =============================================================== */

#define ATT_CHUNK 64 /* keys per softmax chunk */

typedef struct {
    const cpu_ctx *c;
    const kv_kvcache *kv;
    const kv_attn_params *ap;
    const float *q; /* (T, n_head, head_dim) */
    int64_t T;
    int pos0;
    float *out;     /* (T, n_head, head_dim_v) */
    float *work;
    int n_split;    /* key slices per (token, group) */
    size_t per_thread; /* floats of private scratch per thread */
    float *partial; /* (n_split, T, n_head, head_dim_v + 2): acc, max, sum */
} att_job;

/* Floats of per-thread scratch: qf (G, hd), acc (G, hdv), s (G, ATT_CHUNK), m, l (G). */
static size_t att_thread_floats(const kv_attn_params *ap) {
    size_t G = (size_t)(ap->n_head / ap->n_head_kv);
    size_t n = G * ap->head_dim + G * ap->head_dim_v + G * ATT_CHUNK + 2 * G;
    return (n + 15) & ~(size_t)15;
}

/* Key slices per (token, KV head): few query rows (decode) split the keys
 * so every thread has work. Independent of the thread count, so results do
 * not change with it. */
#define ATT_SPLIT 4
static int att_split(const cpu_ctx *c, const kv_attn_params *ap, int64_t T) {
    (void)c;
    return T * ap->n_head_kv >= 8 ? 1 : ATT_SPLIT;
}

static size_t cpu_attn_scratch(kv_backend *b, const kv_attn_params *ap, int64_t T) {
    const cpu_ctx *c = b->ctx;
    size_t n = (size_t)c->nth * att_thread_floats(ap);
    int ns = att_split(c, ap, T);
    if (ns > 1) n += (size_t)ns * T * ap->n_head * (ap->head_dim_v + 2);
    return n;
}

/* One task: query token t, KV head g, keys [k0, k1]. */
static void att_task(const att_job *J, float *priv, int64_t t, int g, int k0, int k1, int sp) {
    const kv_attn_params *ap = J->ap;
    const int G = ap->n_head / ap->n_head_kv, hd = ap->head_dim, hdv = ap->head_dim_v;
    const int kt = kv_kvcache_ktype(J->kv), vt = kv_kvcache_vtype(J->kv);
    const size_t kr = kv_kvcache_row_bytes(J->kv, false), vr = kv_kvcache_row_bytes(J->kv, true);
    float *qf = priv;              /* (G, hd) queries, rounded like the K type */
    float *acc = qf + G * hd;      /* (G, hdv) */
    float *s = acc + G * hdv;      /* (G, ATT_CHUNK) scores, then probabilities */
    float *mx = s + G * ATT_CHUNK; /* (G) running max */
    float *sum = mx + G;           /* (G) running sum */
#ifdef KV_X86
    const bool simd = J->c->avx2 && hd % 8 == 0 && hdv % 8 == 0;
#else
    const bool simd = false;
#endif
    for (int h = 0; h < G; h++) {
        const float *qs = J->q + (t * ap->n_head + g * G + h) * (int64_t)hd;
        for (int i = 0; i < hd; i++)
            qf[h * hd + i] = kt == KV_TYPE_F16 ? kv_f16_to_f32(kv_f32_to_f16(qs[i])) : qs[i];
        mx[h] = -INFINITY;
        sum[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * G * hdv);

    for (int p = k0; p <= k1;) {
        int nk, nv;
        const uint8_t *K = kv_kv_span(J->kv, ap->layer, g, p, &nk, false); /* (nk, hd) */
        const uint8_t *V = kv_kv_span(J->kv, ap->layer, g, p, &nv, true);  /* (nv, hdv) */
        int n = k1 + 1 - p;
        if (n > ATT_CHUNK) n = ATT_CHUNK;
        if (n > nk) n = nk;
        if (n > nv) n = nv;
        /* scores */
        for (int j = 0; j < n; j++) {
            const void *kj = K + (size_t)j * kr;
            for (int h = 0; h < G; h++) {
#ifdef KV_X86
                float d = simd ? dot_k_avx2(kj, kt, qf + h * hd, hd) : dot_k_scalar(kj, kt, qf + h * hd, hd);
#else
                float d = dot_k_scalar(kj, kt, qf + h * hd, hd);
#endif
                d *= ap->scale;
                if (ap->softcap > 0.0f) d = ap->softcap * tanhf(d / ap->softcap);
                s[h * ATT_CHUNK + j] = d;
            }
        }
        /* online softmax update */
        for (int h = 0; h < G; h++) {
            float *sh = s + h * ATT_CHUNK, cm = mx[h];
            for (int j = 0; j < n; j++) cm = sh[j] > cm ? sh[j] : cm;
            float corr = mx[h] == -INFINITY ? 0.0f : expf(mx[h] - cm);
            mx[h] = cm;
#ifdef KV_X86
            float cs = simd ? exp_sub_sum_avx2(sh, n, cm) : exp_sub_sum_scalar(sh, n, cm);
#else
            float cs = exp_sub_sum_scalar(sh, n, cm);
#endif
            sum[h] = sum[h] * corr + cs;
            if (corr != 1.0f)
                for (int i = 0; i < hdv; i++) acc[h * hdv + i] *= corr;
        }
        /* V accumulation */
        for (int j = 0; j < n; j++) {
            const void *vj = V + (size_t)j * vr;
            for (int h = 0; h < G; h++) {
#ifdef KV_X86
                if (simd)
                    axpy_v_avx2(acc + h * hdv, vj, vt, s[h * ATT_CHUNK + j], hdv);
                else
#endif
                    axpy_v_scalar(acc + h * hdv, vj, vt, s[h * ATT_CHUNK + j], hdv);
            }
        }
        p += n;
    }

    for (int h = 0; h < G; h++) {
        const int head = g * G + h;
        if (J->n_split == 1) {
            float *o = J->out + (t * ap->n_head + head) * (int64_t)hdv;
            float inv = sum[h] > 0.0f ? 1.0f / sum[h] : 0.0f;
            for (int i = 0; i < hdv; i++) o[i] = acc[h * hdv + i] * inv;
        } else {
            float *o = J->partial + (((size_t)sp * J->T + t) * ap->n_head + head) * (hdv + 2);
            memcpy(o, acc + h * hdv, sizeof(float) * hdv);
            o[hdv] = mx[h];
            o[hdv + 1] = sum[h];
        }
    }
}

static void att_worker(void *arg, int ith, int nth) {
    const att_job *J = arg;
    const kv_attn_params *ap = J->ap;
    float *priv = J->work + (size_t)ith * J->per_thread;
    const int64_t n_tasks = J->T * ap->n_head_kv * J->n_split;
    for (int64_t task = ith; task < n_tasks; task += nth) {
        int sp = (int)(task % J->n_split);
        int64_t rest = task / J->n_split;
        int g = (int)(rest % ap->n_head_kv);
        int64_t t = rest / ap->n_head_kv;
        int qpos = J->pos0 + (int)t;
        int lo = 0;
        if (ap->window > 0 && qpos - ap->window + 1 > 0) lo = qpos - ap->window + 1;
        int nkeys = qpos - lo + 1;
        int per = (nkeys + J->n_split - 1) / J->n_split;
        int k0 = lo + sp * per, k1 = k0 + per - 1;
        if (k1 > qpos) k1 = qpos;
        att_task(J, priv, t, g, k0, k1, sp); /* empty slice (k0 > k1): sum 0 */
    }
}

static void cpu_attention(kv_backend *b, const kv_kvcache *kv, const kv_attn_params *ap,
                          const float *q, int64_t T, int pos0, float *out, float *work) {
    const cpu_ctx *c = b->ctx;
    att_job J = {c, kv, ap, q, T, pos0, out, work, att_split(c, ap, T), att_thread_floats(ap), NULL};
    J.partial = work + (size_t)c->nth * J.per_thread;
    kv_pool_run(c->pool, att_worker, &J);
    if (J.n_split == 1) return;
    /* merge the key slices: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M) */
    const int hdv = ap->head_dim_v;
    for (int64_t t = 0; t < T; t++) {
        for (int h = 0; h < ap->n_head; h++) {
            float M = -INFINITY, L = 0.0f;
            float *o = out + (t * ap->n_head + h) * (int64_t)hdv;
            for (int sp = 0; sp < J.n_split; sp++) {
                const float *pr = J.partial + (((size_t)sp * T + t) * ap->n_head + h) * (hdv + 2);
                if (pr[hdv + 1] > 0.0f && pr[hdv] > M) M = pr[hdv];
            }
            memset(o, 0, sizeof(float) * hdv);
            for (int sp = 0; sp < J.n_split; sp++) {
                const float *pr = J.partial + (((size_t)sp * T + t) * ap->n_head + h) * (hdv + 2);
                if (!(pr[hdv + 1] > 0.0f)) continue;
                float w = expf(pr[hdv] - M);
                L += pr[hdv + 1] * w;
                for (int i = 0; i < hdv; i++) o[i] += pr[i] * w;
            }
            float inv = L > 0.0f ? 1.0f / L : 0.0f;
            for (int i = 0; i < hdv; i++) o[i] *= inv;
        }
    }
}

/* ==== init ================================================================== */

kv_status kv_backend_cpu_init(kv_backend *b, kv_pool *pool, kv_error *e) {
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!c) return kv_fail(e, KV_ERR_NOMEM, "cpu backend: out of memory");
    c->pool = pool;
    c->nth = kv_pool_size(pool);
#ifdef KV_X86
    const char *env = getenv("KVLUA_SIMD");
    c->avx2 = !(env && strcmp(env, "scalar") == 0) && __builtin_cpu_supports("avx2") &&
              __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
    c->gelu_f16 = malloc(sizeof(uint16_t) * 65536);
    if (c->gelu_f16)
        for (int i = 0; i < 65536; i++) c->gelu_f16[i] = kv_f32_to_f16(gelu_tanh(kv_f16_to_f32((uint16_t)i)));
    *b = (kv_backend){
        .name = "cpu",
        .ctx = c,
        .alloc = cpu_alloc,
        .free = cpu_free,
        .matmul_scratch = cpu_matmul_scratch,
        .matmul = cpu_matmul,
        .rmsnorm = cpu_rmsnorm,
        .rope = cpu_rope,
        .add = cpu_add,
        .scale = cpu_scale,
        .ffn_act = cpu_ffn_act,
        .softcap = cpu_softcap,
        .embed = cpu_embed,
        .kv_store = cpu_kv_store,
        .attention = cpu_attention,
        .attn_scratch = cpu_attn_scratch,
        .all_finite = cpu_all_finite,
    };
    return KV_OK;
}

void kv_backend_cpu_free(kv_backend *b) {
    if (!b || !b->ctx) return;
    cpu_ctx *c = b->ctx;
    free(c->gelu_f16);
    free(c->rope_cs);
    free(c->rope_pos);
    free(b->ctx);
    b->ctx = NULL;
}
