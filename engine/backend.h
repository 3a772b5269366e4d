/*
 * backend.h — the compute backend interface the transformer graph runs on.
 *
 * forward.c describes *what* to compute (norms, projections, RoPE,
 * attention, residuals) and calls only the function pointers below; *how* it
 * is computed (CPU loops and kv_matmul, or OpenCL kernels later) lives in a
 * backend (backend_cpu.c). Every op works on activation buffers the backend
 * allocated (kv_backend.alloc), so a device backend may keep them resident;
 * the CPU backend hands out plain host floats.
 *
 * Conventions: activations are row-major (T, n) float: T tokens, n features,
 * row stride n unless a stride argument says otherwise. Weights are
 * kv_weight (a GGUF tensor: rows of `cols` elements of `type`). Small
 * per-feature vectors (norm weights, biases) are float arrays owned by the
 * model. K/V live in a kv_kvcache (kvcache.h) and attention reads them only
 * through kv_kv_span.
 */
#ifndef KV_BACKEND_H
#define KV_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_error.h"
#include "kvcache.h"
#include "threadpool.h"

/* One weight matrix as stored in the GGUF: rows x cols, type `type`, rows
 * contiguous (kv_row_size(type, cols) bytes each). */
typedef struct {
    const void *data; /* NULL: absent (optional tensor) */
    int type;         /* ggml type id */
    int64_t rows;     /* ne[1] (output features) */
    int64_t cols;     /* ne[0] (input features) */
} kv_weight;

/* RoPE flavours: NORM rotates interleaved pairs (x[2i], x[2i+1]) (llama);
 * NEOX rotates halves (x[i], x[i + n_rot/2]) (qwen2, gemma3). */
enum { KV_ROPE_NORM = 0, KV_ROPE_NEOX = 2 };

typedef struct {
    int mode;                 /* KV_ROPE_NORM / KV_ROPE_NEOX */
    int n_rot;                /* rotated dims per head (<= head_dim, even) */
    float freq_base;          /* theta_i = pos * freq_scale * base^(-2i/n_rot) / factor_i */
    float freq_scale;         /* 1 / linear scaling factor */
    const float *freq_factors; /* (n_rot/2) per-pair divisors (llama 3 rope_freqs), or NULL */
} kv_rope_params;

/* Feed-forward gate activations: out = act(gate) * up. */
enum { KV_ACT_SILU = 0, KV_ACT_GELU_TANH = 1 };

typedef struct {
    int layer;       /* which layer of the cache */
    int n_head;      /* query heads */
    int n_head_kv;   /* K/V heads; n_head % n_head_kv == 0 (GQA groups) */
    int head_dim;    /* K and Q head size */
    int head_dim_v;  /* V head size */
    float scale;     /* applied to q.k (1 when the caller pre-scaled Q) */
    int window;      /* sliding window: key p visible to query t iff t - p < window; 0: none */
    float softcap;   /* attention logit soft cap (0: none) */
} kv_attn_params;

typedef struct kv_backend kv_backend;
typedef struct kv_model kv_model;

struct kv_backend {
    const char *name;
    void *ctx; /* backend state (the CPU backend keeps its thread pool here) */

    /* Activation buffers of n floats (zeroed). NULL on out of memory. */
    float *(*alloc)(kv_backend *b, size_t n);
    void (*free)(kv_backend *b, float *p);
    /* Bytes of scratch matmul needs for a weight and T tokens. */
    size_t (*matmul_scratch)(kv_backend *b, const kv_weight *w, int64_t T);

    /* y(T, w.rows) [row stride ldy] = x(T, w.cols) . w^T (+ bias(w.rows) if non-NULL). */
    void (*matmul)(kv_backend *b, const kv_weight *w, const float *bias, const float *x, int64_t T,
                   float *y, int64_t ldy, void *scratch);
    /* Optional: n matmuls of the same x (n <= KV_MATMUL_N_MAX; the q, k, v
     * projections, gate and up), y[i] (T, w[i].rows) with row stride
     * w[i].rows, bias[i] or NULL; the same results as n calls of matmul.
     * NULL: forward.c calls matmul n times. */
    void (*matmul_n)(kv_backend *b, int n, const kv_weight *const *w, const float *const *bias, const float *x,
                     int64_t T, float *const *y, void *scratch);
    /* y(T, n) = x / rms(x) * w for each row of n (w NULL: no weight); in place ok. */
    void (*rmsnorm)(kv_backend *b, float *y, const float *x, const float *w, int64_t T, int64_t n,
                    float eps);
    /* Optional: x(T, n) += a, then y = rmsnorm(x) * w (y may be a, not x);
     * the values add and rmsnorm give. NULL: forward.c calls those two. */
    void (*add_rmsnorm)(kv_backend *b, float *x, const float *a, float *y, const float *w, int64_t T, int64_t n,
                        float eps);
    /* Optional: g(T, wg.rows) = x . wg^T, u = x . wu^T, then g = act(g) * u
     * (the feed-forward's gate and up); the values matmul_n (or matmul)
     * and ffn_act give. NULL: forward.c calls those. */
    void (*matmul_act)(kv_backend *b, const kv_weight *wg, const kv_weight *wu, const float *x, int64_t T, float *g,
                       float *u, int act, void *scratch);
    /* Optional: y(T, w.rows) = x . w^T, then r(T, w.rows) += y and
     * y = rmsnorm(r) * nw (a residual add and the next norm after a
     * product); the values matmul then add_rmsnorm give. NULL: forward.c
     * calls those. */
    void (*matmul_add_rmsnorm)(kv_backend *b, const kv_weight *w, const float *x, int64_t T, float *r, float *y,
                               const float *nw, float eps, void *scratch);
    /* x(T, n_head, head_dim) rotated in place; pos(T) positions. */
    void (*rope)(kv_backend *b, float *x, int64_t T, int n_head, int head_dim, const int32_t *pos,
                 const kv_rope_params *rp);
    /* Optional: rope of a layer's q (T, n_head) and k (T, n_kv) heads, then
     * q *= q_scale, and false when a value of either is not finite (a
     * backend that answers at the end of the pass, status, may return true
     * here); the values rope, rope and scale give. NULL: forward.c calls
     * those and all_finite. */
    bool (*rope_qk)(kv_backend *b, float *q, float *k, int64_t T, int n_head, int n_kv, int head_dim,
                    const int32_t *pos, const kv_rope_params *rp, float q_scale);
    /* Optional: rope_qk, then kv_store of k and v(T, n_kv, head_dim_v) into
     * the cache at pos0 .. pos0 + T - 1 (one session's rows); the values
     * and the answer of those two. NULL: forward.c calls them. */
    bool (*rope_qk_store)(kv_backend *b, float *q, float *k, const float *v, int64_t T, int n_head, int n_kv,
                          int head_dim, const int32_t *pos, const kv_rope_params *rp, float q_scale, kv_kvcache *c,
                          int layer, int pos0);
    /* y(n) += x(n). */
    void (*add)(kv_backend *b, float *y, const float *x, int64_t n);
    /* x(n) *= s. */
    void (*scale)(kv_backend *b, float *x, int64_t n, float s);
    /* x(rows, n) = x H in place: kv_hadamard_rows (quant.h), the rotation of
     * Q, K, V and the attention output for quantized K/V pages. */
    void (*hadamard)(kv_backend *b, float *x, int64_t rows, int64_t n);
    /* gate(T, n) = act(gate) * up(T, n). */
    void (*ffn_act)(kv_backend *b, float *gate, const float *up, int64_t T, int64_t n, int act);
    /* x(n) = cap * tanh(x / cap). */
    void (*softcap)(kv_backend *b, float *x, int64_t n, float cap);
    /* out(T, emb.cols) = rows ids(T) of the embedding table. */
    void (*embed)(kv_backend *b, const kv_weight *emb, const int32_t *ids, int64_t T, float *out);
    /* Writes k(T, n_head_kv, head_dim) and v(T, n_head_kv, head_dim_v) into
     * the cache at positions pos0 .. pos0+T-1 of a layer. */
    void (*kv_store)(kv_backend *b, kv_kvcache *c, int layer, int pos0, int64_t T, const float *k,
                     const float *v);
    /* out(T, n_head, head_dim_v) = softmax(q k^T * scale, causal + window) v,
     * q(T, n_head, head_dim) for positions pos0 .. pos0+T-1, keys 0 .. pos0+T-1
     * read through kv_kv_span. work: attn_scratch(T) floats. */
    void (*attention)(kv_backend *b, const kv_kvcache *c, const kv_attn_params *ap, const float *q,
                      int64_t T, int pos0, float *out, float *work);
    /* One query row for each of n sessions: row i (q + i * n_head * head_dim)
     * at position pos[i] against kvs[i]'s pages into out row i, each as
     * attention() computes it alone, bit for bit (batched decode). NULL: the
     * caller runs attention() per session. work: attn_scratch(1) floats. */
    void (*attention_batch)(kv_backend *b, kv_kvcache *const *kvs, const int32_t *pos, int n,
                            const kv_attn_params *ap, const float *q, float *out, float *work);
    size_t (*attn_scratch)(kv_backend *b, const kv_attn_params *ap, int64_t T);
    /* True when every value of x(n) is finite. */
    bool (*all_finite)(kv_backend *b, const float *x, int64_t n);

    /* ---- device backends only (NULL for the CPU) ----
     * A device backend's alloc hands out reserved host address ranges that
     * stand for device buffers (never dereferenced), so forward.c's pointer
     * arithmetic names offsets inside them; pointers outside those ranges
     * (the caller's logits) are host memory. */
    /* The first error of a queued op (sticky: the model is unusable after
     * it), else KV_ERR_NUMERIC when a finiteness check queued since the last
     * call failed: a device backend's all_finite on its own buffers queues
     * the check and returns true, and callers ask status after the pass. */
    kv_status (*status)(kv_backend *b, kv_error *e);
    /* K/V pages in device memory, same row layout as the pool's slabs but
     * one buffer per layer for every page of a group: group g of cache c
     * now has n_pages pages (contents of the existing ones kept). */
    kv_status (*pages_grow)(kv_backend *b, kv_cache *c, int g, int32_t n_pages, kv_error *e);
    /* Copies page src into page dst (both of group g). */
    void (*pages_copy)(kv_backend *b, kv_cache *c, int g, int32_t dst, int32_t src);
    /* Copies every row of page id (group g) between the device and the
     * pool's host slab (kv_pool_row), for session files. Waits. */
    kv_status (*page_sync)(kv_backend *b, kv_cache *c, int g, int32_t id, bool to_device, kv_error *e);
    void (*close)(kv_backend *b);
};

/* The CPU backend over a thread pool (not owned). */
kv_status kv_backend_cpu_init(kv_backend *b, kv_pool *pool, kv_error *e);
void kv_backend_cpu_free(kv_backend *b);

/* The OpenCL backend on device `device` (kvcl_devices order) for a loaded
 * model: uploads its weights and norm vectors (opencl/kvcl_backend.c; only
 * in builds with OpenCL). */
kv_status kv_backend_cl_init(kv_backend *b, kv_model *m, int device, kv_error *e);

#endif
