/*
 * kvcl_ops.c — host side of the elementwise ops (elementwise.cl) and the
 * embedding lookup: argument checks, then one queued launch each.
 */
#include <math.h>

#include "kvcl_internal.h"
#include "kvcl_ops.h"
#include "quant.h"

#define GROUP 64    /* work-group size of the one-item-per-element kernels (and ffn_act's ACT_GROUP) */
#define RMS_GROUP 64 /* = RMS_GROUP in elementwise.cl */

/* one item per element of n, in groups of GROUP */
static kv_status run_1d(kvcl_launch *L, int64_t n, const char *what, kv_error *e) {
    size_t g = kvcl_round_up((size_t)n, GROUP), l = GROUP;
    return kvcl_launch_run(L, 1, &g, &l, what, e);
}

/* rmsnorm of x into y, after x += a when a is given */
static kv_status rmsnorm_run(kvcl_ctx *c, kvcl_view y, kvcl_view x, const kvcl_view *a, kvcl_buf *w, int64_t T,
                             int64_t n, float eps, kv_error *e) {
    cl_mem ym, xm, am = NULL, wm = NULL;
    if (T <= 0 || n <= 0 || n > INT32_MAX) return kv_fail(e, KV_ERR_ARG, "rmsnorm: bad shape (%lld, %lld)", (long long)T, (long long)n);
    if (kvcl_view_mem(y, (size_t)(T * n), "rmsnorm", &ym, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(x, (size_t)(T * n), "rmsnorm", &xm, e) != KV_OK) return KV_ERR_ARG;
    if (a && kvcl_view_mem(*a, (size_t)(T * n), "rmsnorm addend", &am, e) != KV_OK) return KV_ERR_ARG;
    if (w && kvcl_view_mem(kvcl_at(w, 0), (size_t)n, "rmsnorm weight", &wm, e) != KV_OK) return KV_ERR_ARG;
    int nbx = 0;
    cl_mem rec = kvcl_xq_target(c, n, T, NULL, &nbx); /* y's records for the product that reads it */
    kvcl_launch L = kvcl_launch_begin(c, c->rmsnorm);
    kvcl_arg_mem(&L, ym), kvcl_arg_ulong(&L, y.off);
    kvcl_arg_mem(&L, xm), kvcl_arg_ulong(&L, x.off);
    kvcl_arg_mem(&L, am), kvcl_arg_ulong(&L, a ? a->off : 0);
    kvcl_arg_mem(&L, wm), kvcl_arg_int(&L, (int)n), kvcl_arg_float(&L, eps);
    kvcl_arg_mem(&L, rec), kvcl_arg_int(&L, nbx);
    size_t g = (size_t)T * RMS_GROUP, l = RMS_GROUP;
    kv_status st = kvcl_launch_run(&L, 1, &g, &l, "rmsnorm", e);
    if (st == KV_OK && rec) kvcl_xq_set(c, ym, y.off, n, T, rec);
    return st;
}

kv_status kvcl_rmsnorm(kvcl_ctx *c, kvcl_view y, kvcl_view x, kvcl_buf *w, int64_t T, int64_t n, float eps,
                       kv_error *e) {
    return rmsnorm_run(c, y, x, NULL, w, T, n, eps, e);
}

kv_status kvcl_add_rmsnorm(kvcl_ctx *c, kvcl_view x, kvcl_view a, kvcl_view y, kvcl_buf *w, int64_t T, int64_t n,
                           float eps, kv_error *e) {
    return rmsnorm_run(c, y, x, &a, w, T, n, eps, e);
}

/* What both RoPE launches check and pass: the rotation's shape and mode
 * for T tokens of head_dim, the positions and factors as buffers, and the
 * CPU's table ratio base^(-2/n_rot), raised by repeated multiplication. */
static kv_status rope_args(int64_t T, int heads, int head_dim, const kv_rope_params *rp, kvcl_buf *pos,
                           kvcl_buf *factors, cl_mem *pm, cl_mem *fm, float *theta_scale, kv_error *e) {
    if (T <= 0 || heads <= 0 || rp->n_rot <= 0 || rp->n_rot % 2 || rp->n_rot > head_dim)
        return kv_fail(e, KV_ERR_ARG, "rope: bad shape (T %lld, heads %d, head_dim %d, n_rot %d)", (long long)T,
                       heads, head_dim, rp->n_rot);
    if (rp->mode != KV_ROPE_NORM && rp->mode != KV_ROPE_NEOX) return kv_fail(e, KV_ERR_ARG, "rope: mode %d", rp->mode);
    if (kvcl_view_mem(kvcl_at(pos, 0), (size_t)T, "rope positions", pm, e) != KV_OK) return KV_ERR_ARG;
    *fm = NULL;
    if (factors && kvcl_view_mem(kvcl_at(factors, 0), (size_t)rp->n_rot / 2, "rope factors", fm, e) != KV_OK)
        return KV_ERR_ARG;
    *theta_scale = powf(rp->freq_base, -2.0f / (float)rp->n_rot);
    return KV_OK;
}

kv_status kvcl_rope(kvcl_ctx *c, kvcl_view x, int64_t T, int n_head, int head_dim, kvcl_buf *pos,
                    const kv_rope_params *rp, kvcl_buf *factors, kv_error *e) {
    cl_mem xm, pm, fm;
    float theta_scale;
    if (rope_args(T, n_head, head_dim, rp, pos, factors, &pm, &fm, &theta_scale, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(x, (size_t)T * n_head * head_dim, "rope", &xm, e) != KV_OK) return KV_ERR_ARG;
    kvcl_launch L = kvcl_launch_begin(c, c->rope);
    kvcl_arg_mem(&L, xm), kvcl_arg_ulong(&L, x.off), kvcl_arg_mem(&L, pm);
    kvcl_arg_int(&L, n_head), kvcl_arg_int(&L, head_dim), kvcl_arg_int(&L, rp->n_rot);
    kvcl_arg_int(&L, rp->mode == KV_ROPE_NEOX), kvcl_arg_float(&L, theta_scale);
    kvcl_arg_float(&L, rp->freq_scale), kvcl_arg_mem(&L, fm);
    size_t g[2] = {kvcl_round_up((size_t)rp->n_rot / 2, 16), (size_t)T}, l[2] = {16, 1};
    return kvcl_launch_run(&L, 2, g, l, "rope", e);
}

/* rope_qk, and with pg the rows into the pages */
static kv_status rope_qk_run(kvcl_ctx *c, kvcl_view q, kvcl_view k, const kvcl_view *v, int64_t T, int n_head,
                             int n_kv, int head_dim, kvcl_buf *pos, const kv_rope_params *rp, kvcl_buf *factors,
                             float q_scale, const kvcl_pages *pg, int pos0, kv_error *e) {
    cl_mem qm, km, vm = NULL, pm, fm;
    float theta_scale;
    if (n_kv <= 0 || head_dim % 2) /* items take pairs of the unrotated elements too */
        return kv_fail(e, KV_ERR_ARG, "rope: %d key heads, head_dim %d", n_kv, head_dim);
    if (rope_args(T, n_head, head_dim, rp, pos, factors, &pm, &fm, &theta_scale, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(q, (size_t)T * n_head * head_dim, "rope q", &qm, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(k, (size_t)T * n_kv * head_dim, "rope k", &km, e) != KV_OK) return KV_ERR_ARG;
    if (pg) {
        if ((pg->ktype != KV_TYPE_F16 && pg->ktype != KV_TYPE_F32) || (pg->vtype != KV_TYPE_F16 && pg->vtype != KV_TYPE_F32))
            return kv_fail(e, KV_ERR_UNSUPPORTED, "rope_qk_store: pages of F16 or F32 only");
        if (pos0 < 0 || pg->n_head_kv != n_kv || pg->head_dim != head_dim)
            return kv_fail(e, KV_ERR_ARG, "rope_qk_store: the pages do not match (position %d)", pos0);
        if (kvcl_pages_check(pg, pos0 + T, "rope_qk_store", e) != KV_OK) return KV_ERR_ARG;
        if (kvcl_view_mem(*v, (size_t)T * n_kv * pg->head_dim_v, "rope_qk_store v", &vm, e) != KV_OK) return KV_ERR_ARG;
    }
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    kvcl_launch L = kvcl_launch_begin(c, c->rope_qk);
    kvcl_arg_mem(&L, qm), kvcl_arg_ulong(&L, q.off), kvcl_arg_mem(&L, km), kvcl_arg_ulong(&L, k.off);
    kvcl_arg_mem(&L, pm), kvcl_arg_int(&L, n_head), kvcl_arg_int(&L, n_kv), kvcl_arg_int(&L, head_dim);
    kvcl_arg_int(&L, rp->n_rot), kvcl_arg_int(&L, rp->mode == KV_ROPE_NEOX), kvcl_arg_float(&L, theta_scale);
    kvcl_arg_float(&L, rp->freq_scale), kvcl_arg_mem(&L, fm), kvcl_arg_float(&L, q_scale);
    kvcl_arg_mem(&L, c->flag);
    if (pg) {
        kvcl_arg_mem(&L, pg->k->parts[0]), kvcl_arg_mem(&L, pg->v->parts[0]);
        kvcl_page_args(&L, pg);
        kvcl_arg_int(&L, pg->ktype), kvcl_arg_int(&L, pg->vtype);
        kvcl_arg_int(&L, (int)kvcl_kv_row_bytes(pg->ktype, pg->head_dim));
        kvcl_arg_int(&L, (int)kvcl_kv_row_bytes(pg->vtype, pg->head_dim_v));
        kvcl_arg_mem(&L, vm), kvcl_arg_ulong(&L, v->off), kvcl_arg_int(&L, pg->head_dim_v), kvcl_arg_int(&L, pos0);
    } else {
        kvcl_arg_mem(&L, NULL), kvcl_arg_mem(&L, NULL), kvcl_arg_mem(&L, NULL), kvcl_arg_int(&L, 0);
        kvcl_arg_int(&L, 0), kvcl_arg_int(&L, 0), kvcl_arg_int(&L, 0), kvcl_arg_int(&L, 0), kvcl_arg_int(&L, 0);
        kvcl_arg_mem(&L, NULL), kvcl_arg_ulong(&L, 0), kvcl_arg_int(&L, 0), kvcl_arg_int(&L, 0);
    }
    size_t g[2] = {kvcl_round_up((size_t)head_dim / 2, 16), (size_t)T}, l[2] = {16, 1};
    return kvcl_launch_run(&L, 2, g, l, "rope", e);
}

kv_status kvcl_rope_qk(kvcl_ctx *c, kvcl_view q, kvcl_view k, int64_t T, int n_head, int n_kv, int head_dim,
                       kvcl_buf *pos, const kv_rope_params *rp, kvcl_buf *factors, float q_scale, kv_error *e) {
    return rope_qk_run(c, q, k, NULL, T, n_head, n_kv, head_dim, pos, rp, factors, q_scale, NULL, 0, e);
}

kv_status kvcl_rope_qk_store(kvcl_ctx *c, kvcl_view q, kvcl_view k, kvcl_view v, int64_t T, int n_head, int n_kv,
                             int head_dim, kvcl_buf *pos, const kv_rope_params *rp, kvcl_buf *factors, float q_scale,
                             const kvcl_pages *pg, int pos0, kv_error *e) {
    return rope_qk_run(c, q, k, &v, T, n_head, n_kv, head_dim, pos, rp, factors, q_scale, pg, pos0, e);
}

kv_status kvcl_add(kvcl_ctx *c, kvcl_view y, kvcl_view x, int64_t n, kv_error *e) {
    cl_mem ym, xm;
    if (kvcl_view_mem(y, (size_t)n, "add", &ym, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(x, (size_t)n, "add", &xm, e) != KV_OK) return KV_ERR_ARG;
    kvcl_launch L = kvcl_launch_begin(c, c->add);
    kvcl_arg_mem(&L, ym), kvcl_arg_ulong(&L, y.off), kvcl_arg_mem(&L, xm), kvcl_arg_ulong(&L, x.off);
    kvcl_arg_long(&L, n);
    return run_1d(&L, n, "add", e);
}

kv_status kvcl_scale(kvcl_ctx *c, kvcl_view x, int64_t n, float s, kv_error *e) {
    cl_mem xm;
    if (kvcl_view_mem(x, (size_t)n, "scale", &xm, e) != KV_OK) return KV_ERR_ARG;
    kvcl_launch L = kvcl_launch_begin(c, c->scale);
    kvcl_arg_mem(&L, xm), kvcl_arg_ulong(&L, x.off), kvcl_arg_long(&L, n), kvcl_arg_float(&L, s);
    return run_1d(&L, n, "scale", e);
}

kv_status kvcl_hadamard(kvcl_ctx *c, kvcl_view x, int64_t rows, int64_t n, kv_error *e) {
    cl_mem xm;
    const int hb = kv_hadamard_block(n);
    if (rows <= 0 || n <= 0 || n > INT32_MAX)
        return kv_fail(e, KV_ERR_ARG, "hadamard: bad shape (%lld, %lld)", (long long)rows, (long long)n);
    if (hb < 2) return KV_OK;
    if (kvcl_view_mem(x, (size_t)(rows * n), "hadamard", &xm, e) != KV_OK) return KV_ERR_ARG;
    kvcl_launch L = kvcl_launch_begin(c, c->hadamard);
    kvcl_arg_mem(&L, xm), kvcl_arg_ulong(&L, x.off), kvcl_arg_long(&L, rows);
    kvcl_arg_int(&L, (int)n), kvcl_arg_int(&L, hb), kvcl_arg_float(&L, (float)(1.0 / sqrt((double)hb)));
    size_t g[2] = {(size_t)(n / hb), kvcl_round_up((size_t)rows, 16)}, l[2] = {1, 16};
    return kvcl_launch_run(&L, 2, g, l, "hadamard", e);
}

kv_status kvcl_softcap(kvcl_ctx *c, kvcl_view x, int64_t n, float cap, kv_error *e) {
    cl_mem xm;
    if (!(cap > 0.0f)) return kv_fail(e, KV_ERR_ARG, "softcap: cap %g", (double)cap);
    if (kvcl_view_mem(x, (size_t)n, "softcap", &xm, e) != KV_OK) return KV_ERR_ARG;
    kvcl_launch L = kvcl_launch_begin(c, c->softcap);
    kvcl_arg_mem(&L, xm), kvcl_arg_ulong(&L, x.off), kvcl_arg_long(&L, n), kvcl_arg_float(&L, cap);
    return run_1d(&L, n, "softcap", e);
}

kv_status kvcl_ffn_act(kvcl_ctx *c, kvcl_view gate, kvcl_view up, int64_t T, int64_t cols, int act, kv_error *e) {
    cl_mem gm, um;
    if (act != KV_ACT_SILU && act != KV_ACT_GELU_TANH) return kv_fail(e, KV_ERR_ARG, "ffn_act: activation %d", act);
    if (T <= 0 || cols <= 0 || T > INT64_MAX / cols)
        return kv_fail(e, KV_ERR_ARG, "ffn_act: bad shape (%lld, %lld)", (long long)T, (long long)cols);
    const int64_t n = T * cols;
    if (kvcl_view_mem(gate, (size_t)n, "ffn_act", &gm, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(up, (size_t)n, "ffn_act", &um, e) != KV_OK) return KV_ERR_ARG;
    int nbx = 0;
    cl_mem rec = kvcl_xq_target(c, cols, T, NULL, &nbx); /* the output's records for the product that reads it */
    kvcl_launch L = kvcl_launch_begin(c, c->ffn_act);
    kvcl_arg_mem(&L, gm), kvcl_arg_ulong(&L, gate.off), kvcl_arg_mem(&L, um), kvcl_arg_ulong(&L, up.off);
    kvcl_arg_long(&L, n), kvcl_arg_int(&L, act);
    kvcl_arg_mem(&L, rec), kvcl_arg_int(&L, rec ? (int)cols : 0), kvcl_arg_int(&L, nbx);
    kv_status st = run_1d(&L, (n + 15) / 16, "ffn_act", e); /* 16 elements an item */
    if (st == KV_OK && rec) kvcl_xq_set(c, gm, gate.off, cols, T, rec);
    return st;
}

kv_status kvcl_finite_reset(kvcl_ctx *c, kv_error *e) {
    static const cl_int one = 1; /* static: the write is not waited for */
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    cl_int err = clEnqueueWriteBuffer(c->q, c->flag, CL_FALSE, 0, sizeof one, &one, 0, NULL, NULL);
    return err == CL_SUCCESS ? KV_OK : kvcl_mark_failed(c, e, err, "all_finite");
}

kv_status kvcl_finite_check(kvcl_ctx *c, kvcl_view x, int64_t n, kv_error *e) {
    cl_mem xm;
    if (kvcl_view_mem(x, (size_t)n, "all_finite", &xm, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    kvcl_launch L = kvcl_launch_begin(c, c->all_finite);
    kvcl_arg_mem(&L, xm), kvcl_arg_ulong(&L, x.off), kvcl_arg_long(&L, n), kvcl_arg_mem(&L, c->flag);
    return run_1d(&L, n, "all_finite", e) != KV_OK ? c->failed : KV_OK;
}

kv_status kvcl_finite_read(kvcl_ctx *c, bool *ok, kv_error *e) {
    cl_int flag = 0;
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    cl_int err = clEnqueueReadBuffer(c->q, c->flag, CL_TRUE, 0, sizeof flag, &flag, 0, NULL, NULL);
    if (err != CL_SUCCESS) return kvcl_mark_failed(c, e, err, "all_finite");
    *ok = flag != 0;
    return KV_OK;
}

kv_status kvcl_all_finite(kvcl_ctx *c, kvcl_view x, int64_t n, bool *ok, kv_error *e) {
    kv_status st = kvcl_finite_reset(c, e);
    if (!st) st = kvcl_finite_check(c, x, n, e);
    if (!st) st = kvcl_finite_read(c, ok, e);
    return st;
}

kv_status kvcl_embed(kvcl_ctx *c, const kvcl_weight *emb, kvcl_buf *ids, int64_t T, kvcl_view out, kv_error *e) {
    cl_mem om, im;
    if (!emb->buf || !kvcl_type_supported(emb->type)) return kv_fail(e, KV_ERR_ARG, "embed: no table of a supported type");
    if (T <= 0) return kv_fail(e, KV_ERR_ARG, "embed: %lld tokens", (long long)T);
    if (kvcl_view_mem(out, (size_t)T * emb->cols, "embed", &om, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(kvcl_at(ids, 0), (size_t)T, "embed ids", &im, e) != KV_OK) return KV_ERR_ARG;
    const kvcl_buf *b = emb->buf;
    const int64_t part_rows = (int64_t)(b->part_bytes / emb->row_bytes);
    /* every part looks at every id and writes the rows it holds */
    for (int p = 0; p < b->n_parts; p++) {
        const int64_t row0 = p * part_rows;
        const int64_t rows = p + 1 < b->n_parts ? part_rows : emb->rows - row0;
        kvcl_launch L = kvcl_launch_begin(c, c->mm[emb->type].deq);
        kvcl_arg_mem(&L, b->parts[p]), kvcl_arg_ulong(&L, emb->row_bytes);
        kvcl_arg_int(&L, (int)rows), kvcl_arg_int(&L, (int)emb->cols);
        kvcl_arg_mem(&L, im), kvcl_arg_int(&L, (int)row0), kvcl_arg_int(&L, 0);
        kvcl_arg_mem(&L, om), kvcl_arg_ulong(&L, out.off), kvcl_arg_int(&L, (int)emb->cols);
        kvcl_arg_int(&L, emb->packed);
        size_t g[2] = {kvcl_round_up(kvcl_deq_items(emb->type, emb->cols), 16), (size_t)T}, l[2] = {16, 1};
        if (kvcl_launch_run(&L, 2, g, l, "embed", e) != KV_OK) return c->failed;
    }
    return KV_OK;
}
