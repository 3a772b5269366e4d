/*
 * model.c — opening a GGUF model for inference, and sessions over it.
 *
 * kv_model_open reads the hyperparameters of a llama / qwen2 / gemma3 file
 * from its metadata (typed getters: a known key with the wrong type fails,
 * naming the key), finds and shape-checks every tensor (a missing one or a
 * wrong shape is KV_ERR_FORMAT naming it; an unsupported tensor type is
 * KV_ERR_UNSUPPORTED naming it), converts the small vectors (norm weights,
 * biases, rope factors) to float and keeps the matrices memory-mapped in
 * their GGUF formats. It also loads the vocabulary and creates the thread
 * pool and the CPU backend.
 *
 * Also the model's fingerprint (what cache pages are named after) and its
 * list of caches. Sessions live in session.c.
 */
#include "model_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sodium.h>

#include "kvcl.h"
#include "quant.h"
#include "types.h"

/* ==== metadata helpers ===================================================== */

typedef struct {
    const kv_gguf *g;
    char arch[32];
    kv_error *e;
} loader;

/* "{arch}.suffix" */
static const char *akey(loader *L, const char *suffix, char *buf, size_t cap) {
    snprintf(buf, cap, "%s.%s", L->arch, suffix);
    return buf;
}

static kv_status get_u32(loader *L, const char *suffix, uint32_t *out, bool required) {
    char k[128];
    return kv_gguf_get_u32(L->g, akey(L, suffix, k, sizeof k), out, required, L->e);
}

static kv_status get_f32(loader *L, const char *suffix, float *out, bool required) {
    char k[128];
    return kv_gguf_get_f32(L->g, akey(L, suffix, k, sizeof k), out, required, L->e);
}

/* ==== tensors ================================================================ */

/* Finds a tensor with the given shape (ne1 = 0: a 1-D tensor). */
static kv_status find_tensor(loader *L, const char *name, int64_t ne0, int64_t ne1, bool required,
                             const kv_gguf_tensor **out) {
    *out = NULL;
    const kv_gguf_tensor *t = kv_gguf_tensor_find(L->g, name);
    if (!t) {
        if (required) return kv_fail(L->e, KV_ERR_FORMAT, "missing tensor '%s'", name);
        return KV_OK;
    }
    int64_t want1 = ne1 ? ne1 : 1;
    if (t->ne[0] != ne0 || t->ne[1] != want1 || t->ne[2] != 1 || t->ne[3] != 1) {
        if (ne1)
            return kv_fail(L->e, KV_ERR_FORMAT,
                           "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld]", name,
                           (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                           (long long)t->ne[3], (long long)ne0, (long long)ne1);
        return kv_fail(L->e, KV_ERR_FORMAT,
                       "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld]", name,
                       (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                       (long long)t->ne[3], (long long)ne0);
    }
    const kv_type_traits *tr = kv_type_traits_get(t->type);
    if (!tr || !tr->supported)
        return kv_fail(L->e, KV_ERR_UNSUPPORTED, "tensor '%s' has type %s, which is not supported",
                       name, tr ? tr->name : "(unknown)");
    if (kv_row_size(t->type, t->ne[0]) == 0)
        return kv_fail(L->e, KV_ERR_FORMAT, "tensor '%s': row of %lld is not a multiple of the %s block",
                       name, (long long)t->ne[0], tr->name);
    if (!t->data || t->nbytes < kv_row_size(t->type, t->ne[0]) * (uint64_t)want1)
        return kv_fail(L->e, KV_ERR_FORMAT, "tensor '%s': data is truncated", name);
    *out = t;
    return KV_OK;
}

static kv_status load_matrix(loader *L, const char *name, int64_t cols, int64_t rows, bool required,
                             kv_weight *w) {
    const kv_gguf_tensor *t;
    memset(w, 0, sizeof *w);
    kv_status st = find_tensor(L, name, cols, rows, required, &t);
    if (st || !t) return st;
    *w = (kv_weight){t->data, t->type, rows, cols};
    return KV_OK;
}

/* A 1-D tensor converted to float into the arena. */
static kv_status load_vector(loader *L, const char *name, int64_t n, bool required, float **arena,
                             const float **out) {
    const kv_gguf_tensor *t;
    *out = NULL;
    kv_status st = find_tensor(L, name, n, 0, required, &t);
    if (st || !t) return st;
    kv_dequantize_row(t->type, t->data, *arena, n);
    *out = *arena;
    *arena += n;
    return KV_OK;
}

static const char *lname(char *buf, size_t cap, int il, const char *what) {
    snprintf(buf, cap, "blk.%d.%s", il, what);
    return buf;
}

/* ==== hyperparameters ======================================================== */

typedef struct {
    uint32_t n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, head_dim_v, n_ctx_train, n_rot;
    uint32_t window, swa_pattern, vocab_size;
    float eps, freq_base, freq_scale;
} hparams;

static kv_status read_hparams(loader *L, kv_arch arch, hparams *h) {
    kv_status st;
    memset(h, 0, sizeof *h);
    if ((st = get_u32(L, "block_count", &h->n_layer, true))) return st;
    if ((st = get_u32(L, "embedding_length", &h->n_embd, true))) return st;
    if ((st = get_u32(L, "feed_forward_length", &h->n_ff, true))) return st;
    if ((st = get_u32(L, "attention.head_count", &h->n_head, true))) return st;
    if ((st = get_u32(L, "context_length", &h->n_ctx_train, true))) return st;
    if (h->n_ctx_train == 0)
        return kv_fail(L->e, KV_ERR_FORMAT, "%s.context_length is 0 (the model's context must be positive)",
                       L->arch);
    if (h->n_layer == 0 || h->n_layer > 4096 || h->n_embd == 0 || h->n_embd > (1u << 20) ||
        h->n_ff == 0 || h->n_ff > (1u << 22) || h->n_head == 0 || h->n_head > 4096)
        return kv_fail(L->e, KV_ERR_FORMAT,
                       "%s: implausible shape (block_count %u, embedding_length %u, "
                       "feed_forward_length %u, head_count %u)",
                       L->arch, h->n_layer, h->n_embd, h->n_ff, h->n_head);
    h->n_head_kv = h->n_head;
    if ((st = get_u32(L, "attention.head_count_kv", &h->n_head_kv, false))) return st;
    if (h->n_head_kv == 0 || h->n_head % h->n_head_kv != 0)
        return kv_fail(L->e, KV_ERR_FORMAT, "%s.attention.head_count_kv %u does not divide head_count %u",
                       L->arch, h->n_head_kv, h->n_head);
    h->head_dim = h->n_embd / h->n_head;
    if ((st = get_u32(L, "attention.key_length", &h->head_dim, false))) return st;
    h->head_dim_v = h->head_dim;
    if ((st = get_u32(L, "attention.value_length", &h->head_dim_v, false))) return st;
    if (h->head_dim == 0 || h->head_dim > 4096 || h->head_dim_v == 0 || h->head_dim_v > 4096)
        return kv_fail(L->e, KV_ERR_FORMAT, "%s: implausible head size %u/%u", L->arch, h->head_dim,
                       h->head_dim_v);
    if ((st = get_f32(L, "attention.layer_norm_rms_epsilon", &h->eps, true))) return st;
    if (!(h->eps >= 0.0f && h->eps < 1.0f))
        return kv_fail(L->e, KV_ERR_FORMAT, "%s.attention.layer_norm_rms_epsilon %g is out of range",
                       L->arch, h->eps);
    h->freq_base = 10000.0f;
    if ((st = get_f32(L, "rope.freq_base", &h->freq_base, false))) return st;
    if (!(h->freq_base > 0.0f && isfinite(h->freq_base)))
        return kv_fail(L->e, KV_ERR_FORMAT, "%s.rope.freq_base %g is out of range", L->arch, h->freq_base);
    h->n_rot = h->head_dim;
    if ((st = get_u32(L, "rope.dimension_count", &h->n_rot, false))) return st;
    if (h->n_rot == 0 || h->n_rot > h->head_dim || h->n_rot % 2 || h->n_rot > 1024)
        return kv_fail(L->e, KV_ERR_FORMAT, "%s.rope.dimension_count %u is invalid for head size %u",
                       L->arch, h->n_rot, h->head_dim);

    /* rope scaling: none or linear */
    h->freq_scale = 1.0f;
    char k[128];
    kv_gguf_str stype = {0};
    if ((st = kv_gguf_get_str(L->g, akey(L, "rope.scaling.type", k, sizeof k), &stype, false, L->e)))
        return st;
    float factor = 0.0f;
    if ((st = get_f32(L, "rope.scaling.factor", &factor, false))) return st;
    if (factor == 0.0f && (st = get_f32(L, "rope.scale_linear", &factor, false))) return st;
    if (stype.ptr && !kv_gguf_str_eq(stype, "none") && !kv_gguf_str_eq(stype, "linear"))
        return kv_fail(L->e, KV_ERR_UNSUPPORTED, "%s.rope.scaling.type '%.*s' is not supported (none, linear)",
                       L->arch, (int)(stype.len > 32 ? 32 : stype.len), stype.ptr);
    if (stype.ptr && kv_gguf_str_eq(stype, "none")) factor = 0.0f;
    if (factor != 0.0f) {
        if (!(factor > 0.0f && isfinite(factor)))
            return kv_fail(L->e, KV_ERR_FORMAT, "%s.rope.scaling.factor %g is out of range", L->arch, factor);
        h->freq_scale = 1.0f / factor;
    }

    if ((st = get_u32(L, "attention.sliding_window", &h->window, arch == KV_ARCH_GEMMA3))) return st;
    h->swa_pattern = arch == KV_ARCH_GEMMA3 ? 6 : 1;
    if ((st = get_u32(L, "attention.sliding_window_pattern", &h->swa_pattern, false))) return st;
    if (h->swa_pattern == 0)
        return kv_fail(L->e, KV_ERR_FORMAT, "%s.attention.sliding_window_pattern is 0", L->arch);
    if ((st = get_u32(L, "vocab_size", &h->vocab_size, false))) return st;
    return KV_OK;
}

/* ==== open / close ============================================================ */

static kv_status load_weights(kv_model *m, loader *L, const hparams *h) {
    kv_status st;
    const int64_t n_embd = h->n_embd, n_ff = h->n_ff, hd = h->head_dim, hdv = h->head_dim_v;
    const int64_t nq = (int64_t)h->n_head * hd, nk = (int64_t)h->n_head_kv * hd,
                  nv = (int64_t)h->n_head_kv * hdv, no = (int64_t)h->n_head * hdv;
    char nm[96];

    /* token embedding decides the vocabulary size */
    const kv_gguf_tensor *te = kv_gguf_tensor_find(L->g, "token_embd.weight");
    if (!te) return kv_fail(L->e, KV_ERR_FORMAT, "missing tensor 'token_embd.weight'");
    int64_t n_vocab = te->ne[1];
    if (n_vocab <= 0 || n_vocab > (1 << 24))
        return kv_fail(L->e, KV_ERR_FORMAT, "tensor 'token_embd.weight' has implausible vocabulary %lld",
                       (long long)n_vocab);
    if (h->vocab_size && h->vocab_size != n_vocab)
        return kv_fail(L->e, KV_ERR_FORMAT, "%s.vocab_size %u differs from token_embd.weight rows %lld",
                       L->arch, h->vocab_size, (long long)n_vocab);
    if ((st = load_matrix(L, "token_embd.weight", n_embd, n_vocab, true, &m->tok_embd))) return st;
    m->info.n_vocab = (int)n_vocab;

    /* arena of float vectors: per layer at most 4 norms of n_embd, 2 of hd,
     * biases nq + nk + nv; plus the output norm and rope factors */
    size_t per_layer = 4 * (size_t)n_embd + 2 * (size_t)hd + (size_t)(nq + nk + nv);
    size_t total = per_layer * h->n_layer + (size_t)n_embd + h->n_rot / 2 + 16;
    m->f32_arena = malloc(total * sizeof(float));
    m->layers = calloc(h->n_layer, sizeof *m->layers);
    if (!m->f32_arena || !m->layers) return kv_fail(L->e, KV_ERR_NOMEM, "out of memory loading weights");
    float *arena = m->f32_arena;

    if ((st = load_vector(L, "output_norm.weight", n_embd, true, &arena, &m->output_norm))) return st;
    if ((st = load_matrix(L, "output.weight", n_embd, n_vocab, false, &m->output))) return st;
    if (!m->output.data) m->output = m->tok_embd; /* tied embeddings */

    const float *rope_factors = NULL;
    if (m->arch == KV_ARCH_LLAMA &&
        (st = load_vector(L, "rope_freqs.weight", h->n_rot / 2, false, &arena, &rope_factors)))
        return st;

    const bool gemma = m->arch == KV_ARCH_GEMMA3, qwen = m->arch == KV_ARCH_QWEN2;
    for (uint32_t il = 0; il < h->n_layer; il++) {
        kv_layer *ly = &m->layers[il];
        if ((st = load_vector(L, lname(nm, sizeof nm, il, "attn_norm.weight"), n_embd, true, &arena, &ly->attn_norm))) return st;
        if ((st = load_matrix(L, lname(nm, sizeof nm, il, "attn_q.weight"), n_embd, nq, true, &ly->wq))) return st;
        if ((st = load_matrix(L, lname(nm, sizeof nm, il, "attn_k.weight"), n_embd, nk, true, &ly->wk))) return st;
        if ((st = load_matrix(L, lname(nm, sizeof nm, il, "attn_v.weight"), n_embd, nv, true, &ly->wv))) return st;
        if ((st = load_matrix(L, lname(nm, sizeof nm, il, "attn_output.weight"), no, n_embd, true, &ly->wo))) return st;
        if ((st = load_vector(L, lname(nm, sizeof nm, il, "attn_q.bias"), nq, qwen, &arena, &ly->bq))) return st;
        if ((st = load_vector(L, lname(nm, sizeof nm, il, "attn_k.bias"), nk, qwen, &arena, &ly->bk))) return st;
        if ((st = load_vector(L, lname(nm, sizeof nm, il, "attn_v.bias"), nv, qwen, &arena, &ly->bv))) return st;
        if (gemma) {
            if ((st = load_vector(L, lname(nm, sizeof nm, il, "attn_q_norm.weight"), hd, true, &arena, &ly->q_norm))) return st;
            if ((st = load_vector(L, lname(nm, sizeof nm, il, "attn_k_norm.weight"), hd, true, &arena, &ly->k_norm))) return st;
            if ((st = load_vector(L, lname(nm, sizeof nm, il, "post_attention_norm.weight"), n_embd, true, &arena, &ly->post_attn_norm))) return st;
            if ((st = load_vector(L, lname(nm, sizeof nm, il, "post_ffw_norm.weight"), n_embd, true, &arena, &ly->post_ffw_norm))) return st;
        }
        if ((st = load_vector(L, lname(nm, sizeof nm, il, "ffn_norm.weight"), n_embd, true, &arena, &ly->ffn_norm))) return st;
        if ((st = load_matrix(L, lname(nm, sizeof nm, il, "ffn_gate.weight"), n_embd, n_ff, true, &ly->w_gate))) return st;
        if ((st = load_matrix(L, lname(nm, sizeof nm, il, "ffn_up.weight"), n_embd, n_ff, true, &ly->w_up))) return st;
        if ((st = load_matrix(L, lname(nm, sizeof nm, il, "ffn_down.weight"), n_ff, n_embd, true, &ly->w_down))) return st;

        /* attention span and rope of this layer */
        ly->rope = (kv_rope_params){
            .mode = m->arch == KV_ARCH_LLAMA ? KV_ROPE_NORM : KV_ROPE_NEOX,
            .n_rot = (int)h->n_rot,
            .freq_base = h->freq_base,
            .freq_scale = h->freq_scale,
            .freq_factors = rope_factors,
        };
        if (gemma) {
            /* pattern p: layers il % p < p - 1 are local (sliding window),
             * every p-th is global; local layers use base 10000, scale 1 */
            bool swa = h->swa_pattern > 1 && il % h->swa_pattern < h->swa_pattern - 1;
            ly->window = swa ? (int)h->window : 0;
            if (swa) {
                ly->rope.freq_base = 10000.0f;
                ly->rope.freq_scale = 1.0f;
            }
        } else {
            ly->window = (int)h->window; /* mistral-style: every layer */
        }
    }
    return KV_OK;
}

/* The CPU backend is in place; p may ask for an OpenCL device instead. */
static kv_status choose_backend(kv_model *m, const kv_model_params *p, kv_error *e) {
    int want = p ? p->backend : KV_BACKEND_CPU, dev = p ? p->device : 0;
    kvcl_device_info devs[16];
    int n = kvcl_devices(devs, 16);
    if (want == KV_BACKEND_AUTO) {
        want = KV_BACKEND_CPU;
        for (int i = 0; i < n && i < 16; i++)
            if (strcmp(devs[i].type, "gpu") == 0) {
                want = KV_BACKEND_OPENCL, dev = i;
                break;
            }
    }
    if (want != KV_BACKEND_OPENCL) return KV_OK;
    if (n == 0) return kv_fail(e, KV_ERR_DEVICE, "no OpenCL device");
    if (dev < 0 || dev >= n) return kv_fail(e, KV_ERR_ARG, "no OpenCL device %d (there are %d)", dev, n);
#ifdef KV_HAVE_OPENCL
    kv_backend cl;
    kv_status st = kv_backend_cl_init(&cl, m, dev, e);
    if (st) return st;
    m->be.close(&m->be); /* the OpenCL backend keeps a CPU one of its own for host buffers */
    m->be = cl;
    snprintf(m->info.backend, sizeof m->info.backend, "opencl");
    snprintf(m->info.device, sizeof m->info.device, "%s", dev < 16 ? devs[dev].name : "?");
    m->info.device_index = dev;
    return KV_OK;
#else
    return kv_fail(e, KV_ERR_DEVICE, "no OpenCL device");
#endif
}

kv_status kv_model_open(const char *path, const kv_model_params *p, kv_model **out, kv_error *e) {
    if (!out) return kv_fail(e, KV_ERR_ARG, "model: out is NULL");
    *out = NULL;
    if (!path) return kv_fail(e, KV_ERR_ARG, "model: path is NULL");
    kv_model *m = calloc(1, sizeof *m);
    if (!m) return kv_fail(e, KV_ERR_NOMEM, "model: out of memory");
    kv_status st = kv_gguf_open(path, &m->g, e);
    if (st) goto fail;
    loader L = {.g = m->g, .e = e};

    /* general.* */
    kv_gguf_str s = {0};
    if ((st = kv_gguf_get_str(m->g, "general.architecture", &s, m->g->n_tensors > 0, e))) goto fail;
    snprintf(L.arch, sizeof L.arch, "%.*s", (int)(s.len > 31 ? 31 : s.len), s.ptr ? s.ptr : "");
    memcpy(m->info.arch, L.arch, sizeof m->info.arch);
    s = (kv_gguf_str){0};
    if ((st = kv_gguf_get_str(m->g, "general.name", &s, false, e))) goto fail;
    snprintf(m->info.name, sizeof m->info.name, "%.*s", (int)(s.len > 127 ? 127 : s.len), s.ptr ? s.ptr : "");
    uint32_t ft = 0;
    m->info.file_type = -1;
    if (kv_gguf_get(m->g, "general.file_type")) {
        if ((st = kv_gguf_get_u32(m->g, "general.file_type", &ft, false, e))) goto fail;
        m->info.file_type = (int)ft;
    }
    for (uint64_t i = 0; i < m->g->n_tensors; i++) {
        const kv_gguf_tensor *t = &m->g->tensors[i];
        m->info.n_params += (uint64_t)(t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]);
        m->info.size_bytes += t->nbytes;
    }
    m->info.has_weights = m->g->n_tensors > 0;

    /* vocabulary */
    if (kv_gguf_get(m->g, "tokenizer.ggml.model")) {
        if ((st = kv_vocab_load(m->g, &m->vocab, e))) goto fail;
    }

    snprintf(m->info.backend, sizeof m->info.backend, "cpu");
    snprintf(m->info.device, sizeof m->info.device, "cpu");
    m->info.device_index = -1;
    if (!m->info.has_weights) { /* vocabulary-only file */
        if (m->vocab) m->info.n_vocab = kv_vocab_n(m->vocab);
        *out = m;
        return KV_OK;
    }

    /* architecture */
    if (strcmp(L.arch, "llama") == 0) m->arch = KV_ARCH_LLAMA;
    else if (strcmp(L.arch, "qwen2") == 0) m->arch = KV_ARCH_QWEN2;
    else if (strcmp(L.arch, "gemma3") == 0) m->arch = KV_ARCH_GEMMA3;
    else {
        st = kv_fail(e, KV_ERR_UNSUPPORTED, "unsupported architecture '%s' (supported: llama, qwen2, gemma3)",
                     L.arch);
        goto fail;
    }
    hparams h;
    if ((st = read_hparams(&L, m->arch, &h))) goto fail;
    kv_model_info *in = &m->info;
    in->n_layer = (int)h.n_layer;
    in->n_embd = (int)h.n_embd;
    in->n_head = (int)h.n_head;
    in->n_head_kv = (int)h.n_head_kv;
    in->head_dim = (int)h.head_dim;
    in->head_dim_v = (int)h.head_dim_v;
    in->n_ff = (int)h.n_ff;
    in->n_ctx_train = (int)(h.n_ctx_train > INT32_MAX ? INT32_MAX : h.n_ctx_train);
    in->sliding_window = (int)h.window;
    m->eps = h.eps;
    if ((st = load_weights(m, &L, &h))) goto fail;

    m->embd_scale = 1.0f;
    m->q_scale = 1.0f;
    m->kq_scale = 1.0f / sqrtf((float)h.head_dim);
    m->act = KV_ACT_SILU;
    if (m->arch == KV_ARCH_GEMMA3) {
        m->embd_scale = sqrtf((float)h.n_embd);
        m->act = KV_ACT_GELU_TANH;
        /* gemma 3 27B (62 layers) scales by n_embd / n_head, the others by head size */
        m->q_scale = h.n_layer == 62 ? 1.0f / sqrtf((float)(h.n_embd / h.n_head))
                                     : 1.0f / sqrtf((float)h.head_dim);
        m->kq_scale = 1.0f;
    }
    /* every row of token_embd is a token id the model can produce: the
     * vocabulary must name each one (llama.cpp requires the same shape) */
    if (m->vocab && kv_vocab_n(m->vocab) != in->n_vocab) {
        st = kv_fail(e, KV_ERR_FORMAT, "vocabulary has %d tokens but token_embd.weight has %d rows",
                     kv_vocab_n(m->vocab), in->n_vocab);
        goto fail;
    }

    /* threads and backend */
    if (p && p->threads > KV_MAX_THREADS) {
        st = kv_fail(e, KV_ERR_ARG, "model: %d threads asked, at most %d", p->threads, KV_MAX_THREADS);
        goto fail;
    }
    int threads = p && p->threads > 0 ? p->threads : kv_physical_cores();
    if (threads > KV_MAX_THREADS) threads = KV_MAX_THREADS;
    in->threads = threads;
    if ((st = kv_pool_create(threads, &m->pool, e))) goto fail;
    if ((st = kv_backend_cpu_init(&m->be, m->pool, e))) goto fail;
    m->be_ready = true;
    if ((st = choose_backend(m, p, e))) goto fail;
    *out = m;
    return KV_OK;
fail:
    kv_model_close(m);
    return st;
}

void kv_model_close(kv_model *m) {
    if (!m) return;
    if (m->be_ready) m->be.close(&m->be);
    kv_pool_destroy(m->pool);
    if (m->vocab) kv_vocab_free(m->vocab);
    kv_gguf_close(m->g);
    free(m->layers);
    free(m->f32_arena);
    free(m);
}

const kv_model_info *kv_model_info_get(const kv_model *m) { return &m->info; }
const kv_gguf *kv_model_gguf(const kv_model *m) { return m->g; }
const kv_vocab *kv_model_vocab(const kv_model *m) { return m->vocab; }

/* Pages of pt positions a session holds once it holds n_ctx positions:
 * every page for full-attention layers; for a window layer of w, the pages
 * overlapping the last w - 1 positions (what the next token reads) — the
 * page with position n_ctx - w + 1 to the page with n_ctx - 1. */
static uint64_t layer_pages(int64_t n_ctx, int64_t w, int pt) {
    int64_t last = (n_ctx - 1) / pt, first = 0;
    if (w > 0 && n_ctx - w + 1 > 0) first = (n_ctx - w + 1) / pt;
    return (uint64_t)(last - first + 1);
}

uint64_t kv_model_kv_bytes_paged(const kv_model *m, int64_t n_ctx, int ktype, int vtype, int pt) {
    if (!m || !m->layers) return 0;
    int *t = malloc(2 * sizeof(int) * (size_t)m->info.n_layer);
    if (!t) return 0;
    for (int il = 0; il < m->info.n_layer; il++) t[il] = ktype, t[m->info.n_layer + il] = vtype;
    uint64_t b = kv_model_kv_bytes_layers(m, n_ctx, t, t + m->info.n_layer, pt);
    free(t);
    return b;
}

uint64_t kv_model_kv_bytes_layers(const kv_model *m, int64_t n_ctx, const int *ktypes, const int *vtypes, int pt) {
    if (!m || !m->layers || n_ctx <= 0 || pt <= 0) return 0;
    const kv_model_info *in = &m->info;
    uint64_t total = 0;
    for (int il = 0; il < in->n_layer; il++) {
        uint64_t row = kv_row_size(ktypes[il], in->head_dim) + kv_row_size(vtypes[il], in->head_dim_v);
        uint64_t pages = layer_pages(n_ctx, m->layers[il].window, pt);
        if (pages > UINT64_MAX / (uint64_t)pt / (uint64_t)in->n_head_kv) return UINT64_MAX; /* saturate */
        uint64_t rows = pages * (uint64_t)pt * (uint64_t)in->n_head_kv;
        if (row && rows > (UINT64_MAX - total) / row) return UINT64_MAX;
        total += rows * row;
    }
    return total;
}

uint64_t kv_model_kv_bytes(const kv_model *m, int64_t n_ctx, int ktype, int vtype) {
    return kv_model_kv_bytes_paged(m, n_ctx, ktype, vtype, 16);
}

kv_status kv_model_check_file(const kv_model *m, kv_error *e) {
    if (!m) return kv_fail(e, KV_ERR_ARG, "model is NULL");
    return kv_gguf_check_file(m->g, e);
}

int kv_model_layer_window(const kv_model *m, int il) { return m->layers[il].window; }
kv_cache **kv_model_caches(kv_model *m) { return &m->caches; }

/* ==== fingerprint ================================================================ */

/* BLAKE2b over the whole file in leaves of 16 MiB (hashed by the pool's
 * threads), then over the leaf hashes and the size: a tree of fixed shape,
 * so the result does not depend on the thread count. */
#define FP_LEAF ((size_t)16 << 20)

typedef struct {
    const uint8_t *base;
    size_t size, n_leaves;
    uint8_t *leaves; /* (n_leaves, 32) */
} fp_job;

static void fp_worker(void *arg, int ith, int nth) {
    fp_job *j = arg;
    for (size_t i = (size_t)ith; i < j->n_leaves; i += (size_t)nth) {
        size_t off = i * FP_LEAF, len = j->size - off < FP_LEAF ? j->size - off : FP_LEAF;
        crypto_generichash(j->leaves + 32 * i, 32, j->base + off, len, NULL, 0);
    }
}

kv_status kv_model_fingerprint(kv_model *m, uint8_t out[32], double *seconds, kv_error *e) {
    if (!m->fp_done) {
        if (sodium_init() < 0) return kv_fail(e, KV_ERR_IO, "fingerprint: libsodium failed to initialize");
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        fp_job j = {m->g->base, m->g->size, (m->g->size + FP_LEAF - 1) / FP_LEAF, NULL};
        if (j.n_leaves == 0) j.n_leaves = 1;
        j.leaves = malloc(j.n_leaves * 32);
        if (!j.leaves) return kv_fail(e, KV_ERR_NOMEM, "fingerprint: out of memory");
        kv_pool_run(m->pool, fp_worker, &j);
        crypto_generichash_state st;
        crypto_generichash_init(&st, NULL, 0, 32);
        uint64_t size = m->g->size;
        crypto_generichash_update(&st, (const uint8_t *)&size, sizeof size);
        crypto_generichash_update(&st, j.leaves, j.n_leaves * 32);
        crypto_generichash_final(&st, m->fp, 32);
        free(j.leaves);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        m->fp_seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
        m->fp_done = true;
    }
    if (out) memcpy(out, m->fp, 32);
    if (seconds) *seconds = m->fp_seconds;
    return KV_OK;
}
