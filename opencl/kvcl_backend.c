/*
 * kvcl_backend.c — the OpenCL backend: engine/backend.h implemented with
 * the ops of kvcl_ops.h, so sessions, caches, forks and decode_batch run on
 * a device unchanged.
 *
 *   weights      every matrix and norm vector of the model is uploaded at
 *                load; ops find them again by their host address (sorted
 *                tables, binary search).
 *   activations  alloc reserves a range of host address space (PROT_NONE,
 *                never touched) and a device buffer of the same size; a
 *                pointer inside the range names that buffer at the same
 *                offset, so forward.c's arithmetic (s->q + b * n) works.
 *                Pointers outside every range are host memory: the logits.
 *   host data    token ids and positions are uploaded once per pass (the
 *                positions only when they changed); the output matmul into
 *                host logits is the one readback (the wait) of a pass, with
 *                the all_finite checks.
 *   K/V pages    per cache, layer group and layer one K and one V buffer
 *                holding every page of the group: head h, page p, token t
 *                is row ((h * P + p) * pt + t), P the group's pages (the
 *                pool's layout with one slab). A pool that grows moves its
 *                rows into larger buffers. Each page table is uploaded at
 *                the first layer of its group in every pass.
 *
 * Errors: the first failing op is kept (status hook) and every later op is
 * skipped; the session reports it, and the model stays unusable (the
 * context is marked failed too). Session files go through the pool's host
 * slabs (page_sync copies a page's rows there and back).
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kvcl_internal.h"
#include "kvcl_ops.h"
#include "model_internal.h"

/* ==== state ===================================================================== */

typedef struct {
    uintptr_t base; /* reserved host range standing for buf */
    size_t bytes;
    kvcl_buf *buf;
} cl_act;

typedef struct {
    const void *host; /* the GGUF bytes (kv_weight.data) */
    kvcl_weight w;
} cl_wmap;

typedef struct {
    const float *host; /* a norm weight, bias or rope factor array of the model */
    kvcl_buf *buf;
} cl_vmap;

typedef struct {
    kvcl_ctx *c;
    kv_backend cpu; /* host fallbacks (softcap, all_finite on logits) */
    cl_act *acts;
    int n_acts, cap_acts;
    cl_wmap *ws; /* sorted by host */
    int n_ws;
    cl_vmap *vs; /* sorted by host */
    int n_vs;
    kvcl_buf *ids, *pos;      /* (KV_CHUNK) int32 */
    int32_t pos_shadow[KV_CHUNK];
    int pos_n;                /* positions in pos (0: none yet) */
    kvcl_buf *out;            /* device rows of a matmul into host memory */
    bool checks;              /* finiteness checks queued since the last status */
    kv_status st;             /* first error (sticky) */
    kv_error err;
} cl_state;

/* per cache: K and V buffers of every layer of each group */
typedef struct {
    cl_state *S;
    int32_t P[KV_MAX_GROUPS];  /* pages per head in the buffers */
    kvcl_buf **k[KV_MAX_GROUPS], **v[KV_MAX_GROUPS]; /* (n_layers of the group) */
    int n_layers[KV_MAX_GROUPS];
} cl_pool;

/* per session view: its page tables on the device */
typedef struct {
    kvcl_buf *tab[KV_MAX_GROUPS];
} cl_tabs;

static const char *type_name(int type) {
    const kv_type_traits *t = kv_type_traits_get(type);
    return t ? t->name : "?";
}

static bool failed(cl_state *S) { return S->st != KV_OK; }

/* Keeps the first error. */
static void keep(cl_state *S, kv_status st, const kv_error *e) {
    if (st == KV_OK || S->st != KV_OK) return;
    S->st = st;
    S->err = *e;
}

static void keep_msg(cl_state *S, const char *msg) {
    kv_error e;
    kv_status st = kv_fail(&e, KV_ERR_DEVICE, "opencl backend: %s", msg);
    keep(S, st, &e);
}

/* ==== lookups =================================================================== */

static bool act_of(cl_state *S, const float *p, kvcl_view *v) {
    uintptr_t a = (uintptr_t)p;
    for (int i = 0; i < S->n_acts; i++) {
        const cl_act *A = &S->acts[i];
        if (a >= A->base && a < A->base + A->bytes) {
            *v = kvcl_at(A->buf, (a - A->base) / sizeof(float));
            return true;
        }
    }
    return false;
}

/* The device view of an activation pointer; false (error kept) for host memory. */
static bool dev_view(cl_state *S, const float *p, kvcl_view *v) {
    if (act_of(S, p, v)) return true;
    keep_msg(S, "an activation pointer outside the backend's buffers");
    return false;
}

static int cmp_w(const void *a, const void *b) {
    uintptr_t x = (uintptr_t)((const cl_wmap *)a)->host, y = (uintptr_t)((const cl_wmap *)b)->host;
    return x < y ? -1 : x > y;
}

static int cmp_v(const void *a, const void *b) {
    uintptr_t x = (uintptr_t)((const cl_vmap *)a)->host, y = (uintptr_t)((const cl_vmap *)b)->host;
    return x < y ? -1 : x > y;
}

static const kvcl_weight *weight_of(cl_state *S, const kv_weight *w) {
    cl_wmap key = {.host = w->data};
    const cl_wmap *f = bsearch(&key, S->ws, (size_t)S->n_ws, sizeof *S->ws, cmp_w);
    if (!f) keep_msg(S, "a weight that was not uploaded");
    return f ? &f->w : NULL;
}

/* The device copy of a model vector (NULL in, NULL out). */
static kvcl_buf *vec_of(cl_state *S, const float *p, bool *ok) {
    if (!p) return NULL;
    cl_vmap key = {.host = p};
    const cl_vmap *f = bsearch(&key, S->vs, (size_t)S->n_vs, sizeof *S->vs, cmp_v);
    if (!f) {
        keep_msg(S, "a norm or bias vector that was not uploaded");
        *ok = false;
        return NULL;
    }
    return f->buf;
}

/* ==== activations =============================================================== */

static float *cl_alloc(kv_backend *b, size_t n) {
    cl_state *S = b->ctx;
    size_t bytes = (n ? n : 1) * sizeof(float);
    if (S->n_acts == S->cap_acts) {
        int cap = S->cap_acts ? S->cap_acts * 2 : 16;
        cl_act *a = realloc(S->acts, (size_t)cap * sizeof *a);
        if (!a) return NULL;
        S->acts = a;
        S->cap_acts = cap;
    }
    void *r = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) return NULL;
    kvcl_buf *buf = NULL;
    kv_error e;
    float *zero = calloc(n ? n : 1, sizeof(float));
    if (!zero || kvcl_buf_create(S->c, bytes, 1, &buf, &e) || kvcl_write(S->c, buf, 0, zero, bytes, &e)) {
        free(zero);
        kvcl_buf_free(buf);
        munmap(r, bytes);
        return NULL;
    }
    free(zero);
    S->acts[S->n_acts++] = (cl_act){(uintptr_t)r, bytes, buf};
    return r;
}

static void cl_free(kv_backend *b, float *p) {
    cl_state *S = b->ctx;
    for (int i = 0; i < S->n_acts; i++)
        if (S->acts[i].base == (uintptr_t)p) {
            kvcl_buf_free(S->acts[i].buf);
            munmap(p, S->acts[i].bytes);
            S->acts[i] = S->acts[--S->n_acts];
            return;
        }
}

static size_t cl_zero_scratch(kv_backend *b, const kv_weight *w, int64_t T) {
    (void)b, (void)w, (void)T;
    return 0;
}

static size_t cl_attn_scratch(kv_backend *b, const kv_attn_params *ap, int64_t T) {
    (void)b, (void)ap, (void)T;
    return 0;
}

/* ==== ops ======================================================================= */

/* A matmul into host memory (the logits): computed into S->out, read back. */
static void matmul_to_host(cl_state *S, const kvcl_weight *W, kvcl_buf *bias, kvcl_view x, int64_t T, float *y,
                           int64_t ldy) {
    kv_error e;
    size_t bytes = (size_t)T * (size_t)ldy * sizeof(float);
    if (!S->out || kvcl_buf_bytes(S->out) < bytes) {
        kvcl_buf_free(S->out);
        S->out = NULL;
        kv_status st = kvcl_buf_create(S->c, bytes, 1, &S->out, &e);
        if (st) {
            keep(S, st, &e);
            return;
        }
    }
    kv_status st = kvcl_matmul(S->c, W, bias, x, T, kvcl_at(S->out, 0), ldy, &e);
    size_t n = ((size_t)(T - 1) * (size_t)ldy + (size_t)W->rows) * sizeof(float);
    if (!st) st = kvcl_read(S->c, S->out, 0, y, n, &e);
    keep(S, st, &e);
}

static void cl_matmul(kv_backend *b, const kv_weight *w, const float *bias, const float *x, int64_t T, float *y,
                      int64_t ldy, void *scratch) {
    (void)scratch;
    cl_state *S = b->ctx;
    kvcl_view xv, yv;
    bool ok = true;
    if (failed(S) || !dev_view(S, x, &xv)) return;
    const kvcl_weight *W = weight_of(S, w);
    kvcl_buf *bb = vec_of(S, bias, &ok);
    if (!W || !ok) return;
    if (!act_of(S, y, &yv)) {
        matmul_to_host(S, W, bb, xv, T, y, ldy);
        return;
    }
    kv_error e;
    kv_status st = kvcl_matmul(S->c, W, bb, xv, T, yv, ldy, &e);
    keep(S, st, &e);
}

static void cl_matmul_n(kv_backend *b, int n, const kv_weight *const *w, const float *const *bias, const float *x,
                        int64_t T, float *const *y, void *scratch) {
    cl_state *S = b->ctx;
    const kvcl_weight *W[3];
    kvcl_buf *bb[3];
    kvcl_view xv, yv[3];
    bool ok = n >= 1 && n <= 3;
    if (failed(S) || !dev_view(S, x, &xv)) return;
    for (int i = 0; ok && i < n; i++) {
        W[i] = weight_of(S, w[i]);
        bb[i] = vec_of(S, bias[i], &ok);
        ok = ok && W[i] && act_of(S, y[i], &yv[i]);
    }
    if (!ok) { /* a host output, or what cl_matmul reports */
        for (int i = 0; i < n; i++) cl_matmul(b, w[i], bias[i], x, T, y[i], w[i]->rows, scratch);
        return;
    }
    kv_error e;
    kv_status st = kvcl_matmul_n(S->c, n, W, bb, xv, T, yv, &e);
    keep(S, st, &e);
}

static void cl_rmsnorm(kv_backend *b, float *y, const float *x, const float *w, int64_t T, int64_t n, float eps) {
    cl_state *S = b->ctx;
    kvcl_view yv, xv;
    bool ok = true;
    if (failed(S) || !dev_view(S, y, &yv) || !dev_view(S, x, &xv)) return;
    kvcl_buf *wb = vec_of(S, w, &ok);
    if (!ok) return;
    kv_error e;
    kv_status st = kvcl_rmsnorm(S->c, yv, xv, wb, T, n, eps, &e);
    keep(S, st, &e);
}

static void cl_add_rmsnorm(kv_backend *b, float *x, const float *a, float *y, const float *w, int64_t T, int64_t n,
                           float eps) {
    cl_state *S = b->ctx;
    kvcl_view xv, av, yv;
    bool ok = true;
    if (failed(S) || !dev_view(S, x, &xv) || !dev_view(S, a, &av) || !dev_view(S, y, &yv)) return;
    kvcl_buf *wb = vec_of(S, w, &ok);
    if (!ok) return;
    kv_error e;
    kv_status st = kvcl_add_rmsnorm(S->c, xv, av, yv, wb, T, n, eps, &e);
    keep(S, st, &e);
}

static void cl_matmul_act(kv_backend *b, const kv_weight *wg, const kv_weight *wu, const float *x, int64_t T,
                          float *g, float *u, int act, void *scratch) {
    cl_state *S = b->ctx;
    kvcl_view xv, gv, uv;
    if (failed(S) || !dev_view(S, x, &xv) || !dev_view(S, g, &gv) || !dev_view(S, u, &uv)) return;
    const kvcl_weight *WG = weight_of(S, wg), *WU = weight_of(S, wu);
    if (!WG || !WU) return;
    (void)scratch;
    kv_error e;
    kv_status st = kvcl_matmul_act(S->c, WG, WU, xv, T, gv, uv, act, &e);
    keep(S, st, &e);
}

static void cl_matmul_add_rmsnorm(kv_backend *b, const kv_weight *w, const float *x, int64_t T, float *r, float *y,
                                  const float *nw, float eps, void *scratch) {
    cl_state *S = b->ctx;
    kvcl_view xv, rv, yv;
    bool ok = true;
    if (failed(S) || !dev_view(S, x, &xv) || !dev_view(S, r, &rv) || !dev_view(S, y, &yv)) return;
    const kvcl_weight *W = weight_of(S, w);
    kvcl_buf *nb = vec_of(S, nw, &ok);
    if (!W || !ok) return;
    (void)scratch;
    kv_error e;
    kv_status st = kvcl_matmul_add_rmsnorm(S->c, W, xv, T, rv, yv, nb, eps, &e);
    keep(S, st, &e);
}

/* uploads the positions when they changed */
static kv_status upload_pos(cl_state *S, const int32_t *pos, int64_t T, kv_error *e) {
    if (S->pos_n == T && !memcmp(S->pos_shadow, pos, (size_t)T * sizeof *pos)) return KV_OK;
    kv_status st = kvcl_write(S->c, S->pos, 0, pos, (size_t)T * sizeof *pos, e);
    memcpy(S->pos_shadow, pos, (size_t)T * sizeof *pos);
    S->pos_n = st ? 0 : (int)T;
    return st;
}

static void cl_rope(kv_backend *b, float *x, int64_t T, int n_head, int head_dim, const int32_t *pos,
                    const kv_rope_params *rp) {
    cl_state *S = b->ctx;
    kvcl_view xv;
    bool ok = true;
    if (failed(S) || !dev_view(S, x, &xv)) return;
    kvcl_buf *ff = vec_of(S, rp->freq_factors, &ok);
    if (!ok) return;
    kv_error e;
    kv_status st = KV_OK;
    if (T > KV_CHUNK) {
        keep_msg(S, "rope over more tokens than a chunk");
        return;
    }
    st = upload_pos(S, pos, T, &e);
    if (!st) st = kvcl_rope(S->c, xv, T, n_head, head_dim, S->pos, rp, ff, &e);
    keep(S, st, &e);
}

/* what both RoPE ops do first: the factors' buffer, the positions
 * uploaded, the finiteness flag reset once a pass; false when an error
 * was kept (the session reports it) */
static bool rope_begin(cl_state *S, const kv_rope_params *rp, const int32_t *pos, int64_t T, kvcl_buf **ff) {
    bool ok = true;
    *ff = vec_of(S, rp->freq_factors, &ok);
    if (!ok) return false;
    if (T > KV_CHUNK) {
        keep_msg(S, "rope over more tokens than a chunk");
        return false;
    }
    kv_error e;
    kv_status st = upload_pos(S, pos, T, &e);
    if (!st && !S->checks) st = kvcl_finite_reset(S->c, &e);
    S->checks = true;
    keep(S, st, &e);
    return st == KV_OK;
}

static bool cl_rope_qk(kv_backend *b, float *q, float *k, int64_t T, int n_head, int n_kv, int head_dim,
                       const int32_t *pos, const kv_rope_params *rp, float q_scale) {
    cl_state *S = b->ctx;
    kvcl_view qv, kv;
    if (failed(S) || !dev_view(S, q, &qv) || !dev_view(S, k, &kv)) return true; /* the session reports the kept error */
    kvcl_buf *ff;
    if (!rope_begin(S, rp, pos, T, &ff)) return true;
    kv_error e;
    kv_status st = kvcl_rope_qk(S->c, qv, kv, T, n_head, n_kv, head_dim, S->pos, rp, ff, q_scale, &e);
    keep(S, st, &e);
    return true; /* answered by status at the end of the pass */
}

static bool layer_pages(cl_state *S, kv_kvcache *kv, int layer, kvcl_pages *pg);

static bool cl_rope_qk_store(kv_backend *b, float *q, float *k, const float *v, int64_t T, int n_head, int n_kv,
                             int head_dim, const int32_t *pos, const kv_rope_params *rp, float q_scale,
                             kv_kvcache *c, int layer, int pos0) {
    cl_state *S = b->ctx;
    kvcl_view qv, kv, vv;
    kvcl_pages pg;
    kvcl_buf *ff;
    if (failed(S) || !dev_view(S, q, &qv) || !dev_view(S, k, &kv) || !dev_view(S, v, &vv)) return true;
    if (!layer_pages(S, c, layer, &pg) || !rope_begin(S, rp, pos, T, &ff)) return true; /* the session reports it */
    kv_error e;
    kv_status st = kvcl_rope_qk_store(S->c, qv, kv, vv, T, n_head, n_kv, head_dim, S->pos, rp, ff, q_scale, &pg, pos0, &e);
    if (st == KV_ERR_UNSUPPORTED) { /* quantized rows (refused, nothing queued): rope, then kv_store's encoders */
        st = kvcl_rope_qk(S->c, qv, kv, T, n_head, n_kv, head_dim, S->pos, rp, ff, q_scale, &e);
        if (!st) st = kvcl_kv_store(S->c, &pg, pos0, T, kv, vv, &e);
    }
    keep(S, st, &e);
    return true; /* answered by status at the end of the pass */
}

static void cl_add(kv_backend *b, float *y, const float *x, int64_t n) {
    cl_state *S = b->ctx;
    kvcl_view yv, xv;
    if (failed(S) || !dev_view(S, y, &yv) || !dev_view(S, x, &xv)) return;
    kv_error e;
    kv_status st = kvcl_add(S->c, yv, xv, n, &e);
    keep(S, st, &e);
}

static void cl_scale(kv_backend *b, float *x, int64_t n, float s) {
    cl_state *S = b->ctx;
    kvcl_view xv;
    if (failed(S) || !dev_view(S, x, &xv)) return;
    kv_error e;
    kv_status st = kvcl_scale(S->c, xv, n, s, &e);
    keep(S, st, &e);
}

static void cl_hadamard(kv_backend *b, float *x, int64_t rows, int64_t n) {
    cl_state *S = b->ctx;
    kvcl_view xv;
    if (failed(S) || !dev_view(S, x, &xv)) return;
    kv_error e;
    kv_status st = kvcl_hadamard(S->c, xv, rows, n, &e);
    keep(S, st, &e);
}

static void cl_ffn_act(kv_backend *b, float *gate, const float *up, int64_t T, int64_t n, int act) {
    cl_state *S = b->ctx;
    kvcl_view gv, uv;
    if (failed(S) || !dev_view(S, gate, &gv) || !dev_view(S, up, &uv)) return;
    kv_error e;
    kv_status st = kvcl_ffn_act(S->c, gv, uv, T, n, act, &e);
    keep(S, st, &e);
}

static void cl_softcap(kv_backend *b, float *x, int64_t n, float cap) {
    cl_state *S = b->ctx;
    kvcl_view xv;
    if (!act_of(S, x, &xv)) { /* logits on the host */
        S->cpu.softcap(&S->cpu, x, n, cap);
        return;
    }
    if (failed(S)) return;
    kv_error e;
    kv_status st = kvcl_softcap(S->c, xv, n, cap, &e);
    keep(S, st, &e);
}

static void cl_embed(kv_backend *b, const kv_weight *emb, const int32_t *ids, int64_t T, float *out) {
    cl_state *S = b->ctx;
    kvcl_view ov;
    if (failed(S) || !dev_view(S, out, &ov)) return;
    const kvcl_weight *W = weight_of(S, emb);
    if (!W) return;
    if (T > KV_CHUNK) {
        keep_msg(S, "embedding more tokens than a chunk");
        return;
    }
    kv_error e;
    kv_status st = kvcl_write(S->c, S->ids, 0, ids, (size_t)T * sizeof *ids, &e);
    if (!st) st = kvcl_embed(S->c, W, S->ids, T, ov, &e);
    keep(S, st, &e);
}

/* Device buffers: the check is queued and answered by the next status
 * (one wait for every check of a pass); true until then. */
static bool cl_all_finite(kv_backend *b, const float *x, int64_t n) {
    cl_state *S = b->ctx;
    kvcl_view xv;
    if (!act_of(S, x, &xv)) return S->cpu.all_finite(&S->cpu, x, n);
    if (failed(S)) return true; /* the session reports the kept error */
    kv_error e;
    kv_status st = S->checks ? KV_OK : kvcl_finite_reset(S->c, &e);
    if (!st) st = kvcl_finite_check(S->c, xv, n, &e);
    S->checks = true;
    keep(S, st, &e);
    return true;
}

/* The kept device error (sticky), else the answer of the queued
 * finiteness checks (KV_ERR_NUMERIC once; the model stays usable). */
static kv_status cl_status(kv_backend *b, kv_error *e) {
    cl_state *S = b->ctx;
    if (!S->st && S->checks) {
        bool ok = true;
        kv_error ke;
        kv_status st = kvcl_finite_read(S->c, &ok, &ke);
        S->checks = false;
        keep(S, st, &ke);
        if (!st && !ok)
            return kv_fail(e, KV_ERR_NUMERIC, "eval: non-finite queries, keys, activations or logits on OpenCL "
                                              "(corrupted weights?)");
    }
    if (S->st && e) *e = S->err;
    return S->st;
}

/* ==== K/V pages ================================================================= */

static void pool_dev_free(void *p) {
    cl_pool *D = p;
    for (int g = 0; g < KV_MAX_GROUPS; g++) {
        for (int li = 0; li < D->n_layers[g]; li++) {
            if (D->k[g]) kvcl_buf_free(D->k[g][li]);
            if (D->v[g]) kvcl_buf_free(D->v[g][li]);
        }
        free(D->k[g]);
        free(D->v[g]);
    }
    free(D);
}

/* A layer's K (or V) rows for P pages per head, the first P0 pages of each
 * head copied from old (NULL: none). */
static kv_status rows_grow(cl_state *S, kvcl_buf **slot, int n_kv, int pt, size_t row, int32_t P0, int32_t P,
                           kv_error *e) {
    kvcl_buf *nb;
    size_t bytes = (size_t)n_kv * (size_t)P * (size_t)pt * row;
    kv_status st = kvcl_buf_create(S->c, bytes, bytes, &nb, e); /* one part: the kernels index it whole */
    if (st) return st;
    size_t head_old = (size_t)P0 * pt * row, head_new = (size_t)P * pt * row;
    for (int h = 0; st == KV_OK && *slot && h < n_kv; h++)
        st = kvcl_copy(S->c, nb, h * head_new, *slot, h * head_old, head_old, e);
    if (st) {
        kvcl_buf_free(nb);
        return st;
    }
    kvcl_buf_free(*slot); /* released once the queued copies are done */
    *slot = nb;
    return KV_OK;
}

static kv_status cl_pages_grow(kv_backend *b, kv_cache *c, int g, int32_t n_pages, kv_error *e) {
    cl_state *S = b->ctx;
    if (kvcl_ctx_status(S->c, e)) return KV_ERR_DEVICE;
    const kv_group *G = &c->groups[g];
    for (int li = 0; li < G->n_layers; li++) {
        int il = G->layer_ids[li];
        if (!kvcl_kv_row_bytes(c->ktypes[il], c->head_dim) || !kvcl_kv_row_bytes(c->vtypes[il], c->head_dim_v))
            return kv_fail(e, KV_ERR_UNSUPPORTED,
                           "opencl backend: K/V pages of %s/%s with head sizes %d/%d (layer %d) are not supported "
                           "on OpenCL (f16 and f32 need head sizes that are multiples of 16, q8_0 and q4_0 of 32)",
                           type_name(c->ktypes[il]), type_name(c->vtypes[il]), c->head_dim, c->head_dim_v, il);
    }
    cl_pool *D = c->dev;
    if (!D) {
        if (!(D = calloc(1, sizeof *D))) return kv_fail(e, KV_ERR_NOMEM, "out of memory");
        D->S = S;
        c->dev = D;
        c->dev_free = pool_dev_free;
    }
    if (!D->k[g]) {
        D->k[g] = calloc((size_t)G->n_layers, sizeof *D->k[g]);
        D->v[g] = calloc((size_t)G->n_layers, sizeof *D->v[g]);
        if (!D->k[g] || !D->v[g]) return kv_fail(e, KV_ERR_NOMEM, "out of memory");
        D->n_layers[g] = G->n_layers;
    }
    for (int li = 0; li < G->n_layers; li++) {
        int il = G->layer_ids[li];
        kv_status st = rows_grow(S, &D->k[g][li], c->n_kv, c->pt, c->krows[il], D->P[g], n_pages, e);
        if (!st) st = rows_grow(S, &D->v[g][li], c->n_kv, c->pt, c->vrows[il], D->P[g], n_pages, e);
        if (st) return st; /* the layers grown so far are larger: harmless */
    }
    D->P[g] = n_pages;
    return KV_OK;
}

static void cl_pages_copy(kv_backend *b, kv_cache *c, int g, int32_t dst, int32_t src) {
    cl_state *S = b->ctx;
    cl_pool *D = c->dev;
    const kv_group *G = &c->groups[g];
    kv_error e;
    kv_status st = KV_OK;
    for (int li = 0; st == KV_OK && li < G->n_layers; li++) {
        int il = G->layer_ids[li];
        for (int h = 0; st == KV_OK && h < c->n_kv; h++) {
            size_t kr = (size_t)c->pt * c->krows[il], vr = (size_t)c->pt * c->vrows[il];
            size_t ps = (size_t)h * D->P[g];
            st = kvcl_copy(S->c, D->k[g][li], (ps + dst) * kr, D->k[g][li], (ps + src) * kr, kr, &e);
            if (!st) st = kvcl_copy(S->c, D->v[g][li], (ps + dst) * vr, D->v[g][li], (ps + src) * vr, vr, &e);
        }
    }
    keep(S, st, &e);
}

static kv_status cl_page_sync(kv_backend *b, kv_cache *c, int g, int32_t id, bool to_device, kv_error *e) {
    cl_state *S = b->ctx;
    cl_pool *D = c->dev;
    const kv_group *G = &c->groups[g];
    if (!D || !D->k[g] || id < 0 || id >= D->P[g])
        return kv_fail(e, KV_ERR_DEVICE, "opencl backend: page %d of group %d is not on the device", id, g);
    kv_status st = KV_OK;
    for (int li = 0; st == KV_OK && li < G->n_layers; li++)
        for (int h = 0; st == KV_OK && h < c->n_kv; h++)
            for (int v = 0; st == KV_OK && v < 2; v++) {
                const size_t n = (size_t)c->pt * (v ? c->vrows : c->krows)[G->layer_ids[li]];
                const size_t off = ((size_t)h * D->P[g] + (size_t)id) * n;
                kvcl_buf *buf = (v ? D->v : D->k)[g][li];
                uint8_t *host = kv_pool_row(c, g, id, li, h, 0, v);
                st = to_device ? kvcl_write(S->c, buf, off, host, n, e) : kvcl_read(S->c, buf, off, host, n, e);
            }
    return st;
}

static void tabs_free(void *p) {
    cl_tabs *T = p;
    for (int g = 0; g < KV_MAX_GROUPS; g++) kvcl_buf_free(T->tab[g]);
    free(T);
}

/* The pages of one layer for a session's view; its table is uploaded at the
 * first layer of its group (every pass goes through it before the others). */
static bool layer_pages(cl_state *S, kv_kvcache *kv, int layer, kvcl_pages *pg) {
    kv_cache *c = kv->pool;
    const int g = c->layer_group[layer], li = c->layer_index[layer];
    cl_pool *D = c->dev;
    if (!D || !D->k[g]) {
        keep_msg(S, "a cache without device pages");
        return false;
    }
    kv_error e;
    kv_status st = KV_OK;
    if (!kv->dev) {
        if (!(kv->dev = calloc(1, sizeof(cl_tabs)))) {
            keep_msg(S, "out of memory");
            return false;
        }
        kv->dev_free = tabs_free;
    }
    cl_tabs *T = kv->dev;
    if (!T->tab[g]) st = kvcl_buf_create(S->c, (size_t)kv->n_lp * sizeof(int32_t), 1, &T->tab[g], &e);
    if (!st && c->groups[g].layer_ids[0] == layer)
        st = kvcl_write(S->c, T->tab[g], 0, kv->tab[g], (size_t)kv->n_lp * sizeof(int32_t), &e);
    if (st) {
        keep(S, st, &e);
        return false;
    }
    *pg = (kvcl_pages){
        .k = D->k[g][li], .v = D->v[g][li], .tab = T->tab[g], .pt = c->pt, .max_pages = D->P[g],
        .ktype = c->ktypes[layer], .vtype = c->vtypes[layer],
        .n_head_kv = c->n_kv, .head_dim = c->head_dim, .head_dim_v = c->head_dim_v,
    };
    return true;
}

static void cl_kv_store(kv_backend *b, kv_kvcache *kv, int layer, int pos0, int64_t T, const float *k,
                        const float *v) {
    cl_state *S = b->ctx;
    kvcl_view kvw, vvw;
    kvcl_pages pg;
    if (failed(S) || !dev_view(S, k, &kvw) || !dev_view(S, v, &vvw) || !layer_pages(S, kv, layer, &pg)) return;
    kv_error e;
    kv_status st = kvcl_kv_store(S->c, &pg, pos0, T, kvw, vvw, &e);
    keep(S, st, &e);
}

static void cl_attention(kv_backend *b, const kv_kvcache *kv, const kv_attn_params *ap, const float *q, int64_t T,
                         int pos0, float *out, float *work) {
    (void)work;
    cl_state *S = b->ctx;
    kvcl_view qv, ov;
    kvcl_pages pg;
    if (failed(S) || !dev_view(S, q, &qv) || !dev_view(S, out, &ov) ||
        !layer_pages(S, (kv_kvcache *)kv, ap->layer, &pg))
        return;
    kv_error e;
    kv_status st = kvcl_attention(S->c, &pg, ap, qv, T, pos0, ov, &e);
    keep(S, st, &e);
}

/* ==== lifetime ================================================================== */

static void cl_close(kv_backend *b) {
    cl_state *S = b->ctx;
    if (!S) return;
    for (int i = 0; i < S->n_acts; i++) {
        kvcl_buf_free(S->acts[i].buf);
        munmap((void *)S->acts[i].base, S->acts[i].bytes);
    }
    free(S->acts);
    for (int i = 0; i < S->n_ws; i++) kvcl_weight_free(&S->ws[i].w);
    free(S->ws);
    for (int i = 0; i < S->n_vs; i++) kvcl_buf_free(S->vs[i].buf);
    free(S->vs);
    kvcl_buf_free(S->ids);
    kvcl_buf_free(S->pos);
    kvcl_buf_free(S->out);
    if (S->cpu.close) S->cpu.close(&S->cpu);
    kvcl_close(S->c);
    free(S);
    b->ctx = NULL;
}

static kv_status upload_weight(cl_state *S, const kv_weight *w, const char *what, kv_error *e) {
    if (!w->data) return KV_OK;
    for (int i = 0; i < S->n_ws; i++)
        if (S->ws[i].host == w->data) return KV_OK; /* tied output */
    if (!kvcl_type_supported(w->type))
        return kv_fail(e, KV_ERR_UNSUPPORTED, "opencl backend: %s weights of type %s are not supported on OpenCL",
                       what, type_name(w->type));
    cl_wmap *m = &S->ws[S->n_ws];
    m->host = w->data;
    kv_status st = kvcl_weight_upload(S->c, w->type, w->rows, w->cols, w->data, &m->w, e);
    if (st == KV_OK) S->n_ws++;
    return st;
}

static kv_status upload_vec(cl_state *S, const float *p, size_t n, kv_error *e) {
    if (!p) return KV_OK;
    for (int i = 0; i < S->n_vs; i++)
        if (S->vs[i].host == p) return KV_OK; /* shared (rope factors) */
    cl_vmap *m = &S->vs[S->n_vs];
    m->host = p;
    kv_status st = kvcl_buf_create(S->c, n * sizeof(float), 1, &m->buf, e);
    if (!st) st = kvcl_write(S->c, m->buf, 0, p, n * sizeof(float), e);
    if (st) {
        kvcl_buf_free(m->buf);
        return st;
    }
    S->n_vs++;
    return KV_OK;
}

static kv_status upload_model(cl_state *S, kv_model *m, kv_error *e) {
    const kv_model_info *in = &m->info;
    const int L = in->n_layer;
    S->ws = calloc((size_t)L * 7 + 2, sizeof *S->ws);
    S->vs = calloc((size_t)L * 10 + 1, sizeof *S->vs);
    if (!S->ws || !S->vs) return kv_fail(e, KV_ERR_NOMEM, "out of memory");
    kv_status st = upload_weight(S, &m->tok_embd, "token_embd", e);
    if (!st) st = upload_weight(S, &m->output, "output", e);
    if (!st) st = upload_vec(S, m->output_norm, (size_t)in->n_embd, e);
    const size_t E = (size_t)in->n_embd, nq = (size_t)in->n_head * in->head_dim;
    const size_t nk = (size_t)in->n_head_kv * in->head_dim, nv = (size_t)in->n_head_kv * in->head_dim_v;
    for (int il = 0; st == KV_OK && il < L; il++) {
        const kv_layer *ly = &m->layers[il];
        const kv_weight *ws[] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->w_gate, &ly->w_up, &ly->w_down};
        for (size_t i = 0; st == KV_OK && i < sizeof ws / sizeof *ws; i++) st = upload_weight(S, ws[i], "layer", e);
        const float *vp[] = {ly->attn_norm, ly->bq, ly->bk, ly->bv, ly->q_norm, ly->k_norm, ly->post_attn_norm,
                             ly->ffn_norm, ly->post_ffw_norm, ly->rope.freq_factors};
        const size_t vn[] = {E, nq, nk, nv, (size_t)in->head_dim, (size_t)in->head_dim, E, E, E,
                             (size_t)ly->rope.n_rot / 2};
        for (size_t i = 0; st == KV_OK && i < sizeof vp / sizeof *vp; i++) st = upload_vec(S, vp[i], vn[i], e);
    }
    if (st) return st;
    qsort(S->ws, (size_t)S->n_ws, sizeof *S->ws, cmp_w);
    qsort(S->vs, (size_t)S->n_vs, sizeof *S->vs, cmp_v);
    return KV_OK;
}

/* The prefill GEMM: the tiled kernels, which give a token the decode
 * GEMV's bits, so a row's logits do not depend on the split of a prefill
 * or on decoding (the engine's exactness). KVLUA_CL_PREFILL=clblast takes
 * CLBlast's SGEMM instead (faster on some GPUs; its sums are in another
 * order than the GEMV's, so that promise holds only within rounding);
 * build/bench-opencl measures both. */
static void choose_prefill(cl_state *S) {
    const char *force = getenv("KVLUA_CL_PREFILL");
    S->c->prefill = force && strcmp(force, "clblast") == 0 && kvcl_have_clblast() ? KVCL_MM_CLBLAST : KVCL_MM_TILED;
}

kv_status kv_backend_cl_init(kv_backend *b, kv_model *m, int device, kv_error *e) {
    memset(b, 0, sizeof *b);
    cl_state *S = calloc(1, sizeof *S);
    if (!S) return kv_fail(e, KV_ERR_NOMEM, "out of memory");
    *b = (kv_backend){
        .name = "opencl", .ctx = S,
        .alloc = cl_alloc, .free = cl_free, .matmul_scratch = cl_zero_scratch, .matmul = cl_matmul,
        .matmul_n = cl_matmul_n, .rope_qk = cl_rope_qk, .rope_qk_store = cl_rope_qk_store,
        .rmsnorm = cl_rmsnorm, .add_rmsnorm = cl_add_rmsnorm, .matmul_add_rmsnorm = cl_matmul_add_rmsnorm,
        .matmul_act = cl_matmul_act, .rope = cl_rope, .add = cl_add, .scale = cl_scale, .hadamard = cl_hadamard, .ffn_act = cl_ffn_act,
        .softcap = cl_softcap, .embed = cl_embed, .kv_store = cl_kv_store, .attention = cl_attention,
        .attn_scratch = cl_attn_scratch, .all_finite = cl_all_finite, .status = cl_status,
        .pages_grow = cl_pages_grow, .pages_copy = cl_pages_copy, .page_sync = cl_page_sync, .close = cl_close,
    };
    kvcl_options o = {.device = device};
    kv_status st = kv_backend_cpu_init(&S->cpu, m->pool, e);
    if (!st) st = kvcl_open(&o, &S->c, e);
    if (!st) st = upload_model(S, m, e);
    if (!st) st = kvcl_buf_create(S->c, KV_CHUNK * sizeof(int32_t), 1, &S->ids, e);
    if (!st) st = kvcl_buf_create(S->c, KV_CHUNK * sizeof(int32_t), 1, &S->pos, e);
    if (!st) choose_prefill(S);
    if (!st) st = kvcl_finish(S->c, e);
    if (st) {
        cl_close(b);
        memset(b, 0, sizeof *b);
    }
    return st;
}
