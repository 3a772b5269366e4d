/*
 * forward.c — the transformer graph for llama / qwen2 / gemma3, written
 * against the backend interface (backend.h): no raw loops over tensors here.
 *
 * Per layer, for a chunk of T tokens (x: the residual stream (T, n_embd)):
 *   h    = rmsnorm(x) * attn_norm
 *   q,k,v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv)
 *   [gemma3] q, k = rmsnorm per head * q_norm / k_norm
 *   q, k = rope(q, k)          (NORM for llama, NEOX for qwen2 / gemma3)
 *   [quantized K/V pages] q, k (and v) = x H: Hadamard rotation (quant.h)
 *   cache[pos..] = k, v
 *   a    = attention(q * q_scale, cache)   (causal, optional sliding window)
 *   [quantized V pages] a = a H
 *   o    = a Wo^T   [gemma3] o = rmsnorm(o) * post_attention_norm
 *   x   += o
 *   h    = rmsnorm(x) * ffn_norm
 *   f    = (act(h Wg^T) * h Wu^T) Wd^T   (SiLU, or tanh-GELU for gemma3)
 *   [gemma3] f = rmsnorm(f) * post_ffw_norm
 *   x   += f
 * then logits = (rmsnorm(x) * output_norm) Wout^T [* softcap], only for the
 * rows whose logits are wanted.
 */
#include "model_internal.h"

#include <string.h>

#include "quant.h"

/* ==== one layer ============================================================ */

/* rope on q and k, q *= q_scale; false when either holds a non-finite value */
static bool rope_qk(kv_backend *be, float *q, float *k, int T, int n_head, int n_kv, int hd, const int32_t *pos,
                    const kv_rope_params *rp, float q_scale) {
    if (be->rope_qk) return be->rope_qk(be, q, k, T, n_head, n_kv, hd, pos, rp, q_scale);
    be->rope(be, q, T, n_head, hd, pos, rp);
    be->rope(be, k, T, n_kv, hd, pos, rp);
    if (q_scale != 1.0f) be->scale(be, q, (int64_t)T * n_head * hd, q_scale);
    return be->all_finite(be, q, (int64_t)T * n_head * hd) && be->all_finite(be, k, (int64_t)T * n_kv * hd);
}

/* y[i] = x w[i]^T (+ bias[i]) for n weights of the same input: one call
 * where the backend has matmul_n. */
static void matmuls(kv_backend *be, int n, const kv_weight *const *w, const float *const *bias, const float *x,
                    int64_t T, float *const *y, void *scratch) {
    if (be->matmul_n) {
        be->matmul_n(be, n, w, bias, x, T, y, scratch);
        return;
    }
    for (int i = 0; i < n; i++) be->matmul(be, w[i], bias[i], x, T, y[i], w[i]->rows, scratch);
}

/* x(T, n) += a, then y = rmsnorm(x) * w: one call where the backend fuses
 * them (a launch less on a device) */
static void add_norm(kv_backend *be, float *x, const float *a, float *y, const float *w, int64_t T, int64_t n,
                     float eps) {
    if (be->add_rmsnorm) {
        be->add_rmsnorm(be, x, a, y, w, T, n, eps);
        return;
    }
    be->add(be, x, a, T * n);
    be->rmsnorm(be, y, x, w, T, n, eps);
}

/* xb(T, n_embd) = xin w^T [post: then rmsnorm(xb) * post], then with norm
 * x += xb and xb = rmsnorm(x) * norm (one call where the backend fuses
 * the product with the add and the norm); norm NULL: xb is left for the
 * caller to add */
static void project_add_norm(kv_session *s, const kv_weight *w, const float *xin, int T, const float *post,
                             const float *norm) {
    kv_model *m = s->m;
    kv_backend *be = &m->be;
    const int n_embd = m->info.n_embd;
    if (!post && norm && be->matmul_add_rmsnorm) {
        be->matmul_add_rmsnorm(be, w, xin, T, s->x, s->xb, norm, m->eps, s->mm_scratch);
        return;
    }
    be->matmul(be, w, NULL, xin, T, s->xb, n_embd, s->mm_scratch); /* (T, n_embd) */
    if (post) be->rmsnorm(be, s->xb, s->xb, post, T, n_embd, m->eps);
    if (norm) add_norm(be, s->x, s->xb, s->xb, norm, T, n_embd, m->eps);
}

/* s owns the scratch; the T rows are rows[b] consecutive tokens of each
 * session seqs[b] in turn (at its positions from seqs[b]->pos on), T the
 * sum of rows[0..n_seqs).
 * Layer 0 starts from x; every later one from xb, the normed input the
 * layer before left there. A layer ends with x += its feed-forward output
 * and xb = rmsnorm(x) * next_norm (the next layer's attention norm, or the
 * output norm); next_norm NULL: the output stays in xb, for forward_rows
 * to add. */
static bool forward_layer(kv_session *s, kv_session *const *seqs, const int *rows, int n_seqs, int il, int T,
                          const float *next_norm) {
    kv_model *m = s->m;
    kv_backend *be = &m->be;
    const kv_model_info *in = &m->info;
    const kv_layer *L = &m->layers[il];
    const int n_embd = in->n_embd, n_head = in->n_head, n_kv = in->n_head_kv;
    const int hd = in->head_dim, hdv = in->head_dim_v;

    /* ---- attention ---- */
    if (il == 0) be->rmsnorm(be, s->xb, s->x, L->attn_norm, T, n_embd, m->eps); /* (T, n_embd) */
    /* q (T, n_head*hd), k (T, n_kv*hd), v (T, n_kv*hdv) */
    matmuls(be, 3, (const kv_weight *[]){&L->wq, &L->wk, &L->wv}, (const float *[]){L->bq, L->bk, L->bv}, s->xb, T,
            (float *[]){s->q, s->k, s->v}, s->mm_scratch);
    if (L->q_norm) be->rmsnorm(be, s->q, s->q, L->q_norm, (int64_t)T * n_head, hd, m->eps);
    if (L->k_norm) be->rmsnorm(be, s->k, s->k, L->k_norm, (int64_t)T * n_kv, hd, m->eps);
    /* one session's pages of float rows: rope and the store in one call where the backend has it */
    const bool store_rope = n_seqs == 1 && be->rope_qk_store && !kv_type_rotated(kv_kvcache_ktype(seqs[0]->kv, il)) &&
                            !kv_type_rotated(kv_kvcache_vtype(seqs[0]->kv, il));
    if (store_rope ? !be->rope_qk_store(be, s->q, s->k, s->v, T, n_head, n_kv, hd, s->pos_buf, &L->rope, m->q_scale,
                                        seqs[0]->kv, il, seqs[0]->pos)
                   : !rope_qk(be, s->q, s->k, T, n_head, n_kv, hd, s->pos_buf, &L->rope, m->q_scale))
        return false; /* a NaN score would be masked, not propagated */
    kv_attn_params ap = {
        .layer = il, .n_head = n_head, .n_head_kv = n_kv, .head_dim = hd, .head_dim_v = hdv,
        .scale = m->kq_scale, .window = L->window, .softcap = 0.0f,
    };
    /* one row of each session: one attention dispatch for all where the backend has it */
    const bool batched = n_seqs > 1 && n_seqs == T && be->attention_batch;
    kv_kvcache *batch_kv[KV_CHUNK]; /* a batch's sessions' pages (n_seqs <= KV_CHUNK) */
    for (int b = 0, t0 = 0; b < n_seqs; t0 += rows[b], b++) {
        kv_session *q = seqs[b];
        const int nt = rows[b]; /* the rows of session b: t0 .. t0 + nt - 1 */
        float *qb = s->q + (size_t)t0 * n_head * hd, *kb = s->k + (size_t)t0 * n_kv * hd;
        float *vb = s->v + (size_t)t0 * n_kv * hdv, *ob = s->att + (size_t)t0 * n_head * hdv;
        if (kv_type_rotated(kv_kvcache_ktype(q->kv, il))) { /* quantized pages hold rotated rows (quant.h) */
            be->hadamard(be, qb, (int64_t)nt * n_head, hd);
            be->hadamard(be, kb, (int64_t)nt * n_kv, hd);
        }
        const bool rot_v = kv_type_rotated(kv_kvcache_vtype(q->kv, il));
        if (rot_v) be->hadamard(be, vb, (int64_t)nt * n_kv, hdv);
        if (!store_rope) be->kv_store(be, q->kv, il, q->pos, nt, kb, vb);
        if (batched) {
            batch_kv[b] = q->kv; /* positions: pos_buf */
            continue;
        }
        be->attention(be, q->kv, &ap, qb, nt, q->pos, ob, s->awork); /* (nt, n_head*hdv) */
        if (rot_v) be->hadamard(be, ob, (int64_t)nt * n_head, hdv);
    }
    if (batched) { /* one dispatch for every session's row */
        be->attention_batch(be, batch_kv, s->pos_buf, n_seqs, &ap, s->q, s->att, s->awork);
        for (int b = 0; b < n_seqs; b++)
            if (kv_type_rotated(kv_kvcache_vtype(seqs[b]->kv, il)))
                be->hadamard(be, s->att + (size_t)b * n_head * hdv, n_head, hdv);
    }

    /* x += the attention output, xb = the feed-forward's input */
    project_add_norm(s, &L->wo, s->att, T, L->post_attn_norm, L->ffn_norm);

    /* ---- feed-forward ---- */
    const int n_ff = in->n_ff;
    if (be->matmul_act) { /* gate = act(xb Wg^T) * xb Wu^T (T, n_ff) */
        be->matmul_act(be, &L->w_gate, &L->w_up, s->xb, T, s->gate, s->up, m->act, s->mm_scratch);
    } else {
        matmuls(be, 2, (const kv_weight *[]){&L->w_gate, &L->w_up}, (const float *[]){NULL, NULL}, s->xb, T,
                (float *[]){s->gate, s->up}, s->mm_scratch); /* (T, n_ff) each */
        be->ffn_act(be, s->gate, s->up, T, n_ff, m->act);
    }
    project_add_norm(s, &L->w_down, s->gate, T, L->post_ffw_norm, next_norm);
    return true;
}

/* ==== the whole pass ======================================================= */

/* The rows of forward_layer; logits (nw, n_vocab) for the rows want[0..nw)
 * (ascending), every row when nw == T (want not read). */
static bool forward_rows(kv_session *s, kv_session *const *seqs, const int *rows, int n_seqs, const int32_t *ids,
                         int T, const int *want, int nw, float *logits) {
    kv_model *m = s->m;
    kv_backend *be = &m->be;
    const int n_embd = m->info.n_embd, n_vocab = m->info.n_vocab;

    for (int b = 0, t = 0; b < n_seqs; b++)
        for (int j = 0; j < rows[b]; j++) s->pos_buf[t++] = seqs[b]->pos + j;
    be->embed(be, &m->tok_embd, ids, T, s->x); /* (T, n_embd) */
    if (m->embd_scale != 1.0f) be->scale(be, s->x, (int64_t)T * n_embd, m->embd_scale);

    /* With every row wanted, the last layer ends with the output norm; else
     * its output (xb) goes into every row of x (checked for finiteness
     * after), then the norm of each wanted row into xb's first nw rows */
    const bool all = nw == T;
    const int nr = nw;
    const int n_layer = m->info.n_layer;
    for (int il = 0; il < n_layer; il++) {
        const float *next = il + 1 < n_layer ? m->layers[il + 1].attn_norm : all ? m->output_norm : NULL;
        if (!forward_layer(s, seqs, rows, n_seqs, il, T, next)) return false;
    }
    if (n_layer == 0 || !all) { /* else xb holds the output norm's rows */
        if (n_layer > 0) be->add(be, s->x, s->xb, (int64_t)T * n_embd);
        if (nr == 0) return true;
        for (int j = 0; j < nr; j++) { /* (1, n_embd) each: a row's norm is the same alone */
            const float *xr = s->x + (size_t)(all ? j : want[j]) * n_embd;
            be->rmsnorm(be, s->xb + (size_t)j * n_embd, xr, m->output_norm, 1, n_embd, m->eps);
        }
    }
    be->matmul(be, &m->output, NULL, s->xb, nr, logits, n_vocab, s->mm_scratch); /* (nr, n_vocab) */
    if (m->final_softcap > 0.0f) be->softcap(be, logits, (int64_t)nr * n_vocab, m->final_softcap);
    return true;
}

bool kv_forward(kv_session *s, const int32_t *ids, int T, int logits_mode, float *logits) {
    const int last = T - 1;
    const int nw = logits_mode == KV_LOGITS_ALL ? T : logits_mode == KV_LOGITS_LAST ? 1 : 0;
    return forward_rows(s, &s, &T, 1, ids, T, &last, nw, logits);
}

bool kv_forward_batch(kv_session *const *seqs, const int32_t *ids, int B, float *logits) {
    int ones[KV_CHUNK];
    for (int b = 0; b < B; b++) ones[b] = 1;
    return forward_rows(seqs[0], seqs, ones, B, ids, B, NULL, B, logits);
}

bool kv_forward_multi(kv_session *const *seqs, const int *rows, int n_seqs, const int32_t *ids, int T,
                      const int *want, int nw, float *logits) {
    return forward_rows(seqs[0], seqs, rows, n_seqs, ids, T, want, nw, logits);
}
