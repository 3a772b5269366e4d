/*
 * model_internal.h — what model.c (loader, sessions) and forward.c (the
 * transformer graph) share: the loaded model's hyperparameters and weight
 * views, and a session's state and scratch. Not part of the public API.
 */
#ifndef KV_MODEL_INTERNAL_H
#define KV_MODEL_INTERNAL_H

#include "backend.h"
#include "kvcache.h"
#include "kvlua.h"
#include "kvpool.h"

typedef enum { KV_ARCH_LLAMA, KV_ARCH_QWEN2, KV_ARCH_GEMMA3 } kv_arch;

/* Longest chunk of tokens one forward pass handles (prefill is split). */
#define KV_CHUNK 128

typedef struct {
    const float *attn_norm;      /* (n_embd) */
    kv_weight wq, wk, wv, wo;    /* (n_head*hd, n_embd) (n_kv*hd, n_embd) (n_kv*hdv, n_embd) (n_embd, n_head*hdv) */
    const float *bq, *bk, *bv;   /* qwen2 biases (n_head*hd) (n_kv*hd) (n_kv*hdv), or NULL */
    const float *q_norm, *k_norm; /* gemma3 QK-norm (hd), or NULL */
    const float *post_attn_norm; /* gemma3 (n_embd), or NULL */
    const float *ffn_norm;       /* (n_embd) */
    kv_weight w_gate, w_up, w_down; /* (n_ff, n_embd) (n_ff, n_embd) (n_embd, n_ff) */
    const float *post_ffw_norm;  /* gemma3 (n_embd), or NULL */
    int window;                  /* sliding window of this layer, 0: full attention */
    kv_rope_params rope;         /* per layer: gemma3 local layers use base 10000 */
} kv_layer;

struct kv_model {
    kv_model_info info;
    kv_gguf *g;
    kv_vocab *vocab;
    kv_pool *pool;
    kv_backend be;
    bool be_ready;

    kv_arch arch;
    float eps;          /* RMSNorm epsilon */
    float q_scale;      /* applied to Q after RoPE (gemma3), else 1 */
    float kq_scale;     /* applied to q.k inside attention (1/sqrt(head_dim) for llama/qwen2) */
    float final_softcap; /* 0: none */
    float embd_scale;   /* 1, or sqrt(n_embd) for gemma3 */
    int act;            /* KV_ACT_SILU / KV_ACT_GELU_TANH */

    kv_weight tok_embd;      /* (n_vocab, n_embd) */
    const float *output_norm; /* (n_embd) */
    kv_weight output;        /* (n_vocab, n_embd); token_embd when tied */
    kv_layer *layers;        /* (n_layer) */
    float *f32_arena;        /* norm weights, biases and rope factors converted to float */

    kv_cache *caches;        /* open caches of this model (private pools too) */
    bool fp_done;            /* fingerprint computed */
    uint8_t fp[32];          /* BLAKE2b tree hash of the whole file */
    double fp_seconds;       /* what computing it cost */
};

struct kv_session {
    kv_model *m;
    int n_ctx, pos;
    int32_t *tokens;   /* (n_ctx) ids held */
    kv_kvcache *kv;    /* page tables into the session's cache */
    kv_hash *chain;    /* (n_lp) chain hash of each full page held */
    int n_chain;       /* chain[0 .. n_chain) are valid (n_chain <= pos / pt) */
    bool holes;        /* pages the next eval needs may be missing (after rewind, failure) */
    bool shifted;      /* its K/V were moved by a context shift: its pages are never sealed
                          or matched against the prefix index (they are not a cold prefill's) */
    int32_t win_lo[KV_MAX_GROUPS]; /* window groups: pages below this were dropped */
    uint64_t reused;   /* tokens taken from the cache */

    /* scratch, allocated once (KV_CHUNK tokens) */
    float *x;     /* (KV_CHUNK, n_embd) residual stream */
    float *xb;    /* (KV_CHUNK, n_embd) normed input / projection out */
    float *q;     /* (KV_CHUNK, n_head * head_dim) */
    float *k;     /* (KV_CHUNK, n_head_kv * head_dim) */
    float *v;     /* (KV_CHUNK, n_head_kv * head_dim_v) */
    float *att;   /* (KV_CHUNK, n_head * head_dim_v) attention output */
    float *gate;  /* (KV_CHUNK, n_ff) */
    float *up;    /* (KV_CHUNK, n_ff) */
    float *awork; /* attention scratch (backend-sized) */
    int32_t *pos_buf;  /* (KV_CHUNK) positions of the chunk */
    void *mm_scratch;  /* matmul activation quantization */
    size_t mm_scratch_size;
};

/* Runs the transformer over T <= KV_CHUNK tokens ids at positions
 * s->pos .. s->pos+T-1 (their K/V are written to the cache). Writes logits
 * for the last token (mode KV_LOGITS_LAST: logits (n_vocab)) or for every
 * token (KV_LOGITS_ALL: logits (T, n_vocab)), or none. Does not move
 * s->pos. Returns false (and stops) when a layer's queries or keys are not
 * finite: attention would otherwise mask NaN scores into finite output. */
bool kv_forward(kv_session *s, const int32_t *ids, int T, int logits_mode, float *logits);
/* One forward pass over the next token of each of B <= KV_CHUNK sessions of
 * one model (weights read once; attention per session through its pages),
 * in seqs[0]'s scratch. logits: (B, n_vocab). Does not move any pos. */
/* session.c, for kvfile.c: a session over pool with empty tables, and the
 * bookkeeping after its tables and tokens were filled from a file. */
kv_status kv_session_alloc(kv_model *m, int n_ctx, kv_cache *pool, kv_session **out, kv_error *e);
void kv_session_after_restore(kv_session *s);
bool kv_forward_batch(kv_session *const *seqs, const int32_t *ids, int B, float *logits);
/* One forward pass over rows[b] tokens of each session seqs[b] (n_seqs
 * distinct sessions of one model, T = the sum of rows <= KV_CHUNK; ids: the
 * sessions' tokens one after another, each at its positions from pos on),
 * in seqs[0]'s scratch. logits: (nw, n_vocab) for the rows want[0..nw)
 * (ascending), or every row when nw == T. Every row is the same bits
 * kv_forward gives it alone. Does not move any pos. */
bool kv_forward_multi(kv_session *const *seqs, const int *rows, int n_seqs, const int32_t *ids, int T,
                      const int *want, int nw, float *logits);

#endif
