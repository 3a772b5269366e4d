/*
 * kvcl_attention.c — host side of the K/V pages (kvstore.cl) and attention
 * (attention.cl): argument checks, the work-group shape, and the key split.
 *
 * Work-groups hold tb query tokens x G query heads of one KV head (G =
 * n_head / n_head_kv), about 16 rows, so each K/V tile loaded serves them
 * all. Every row reduces its keys in segments of ATT_SEG positions merged
 * in position order (attention.cl), so its bits depend on its position
 * alone: not on the chunk it came in, the rows beside it, or whether the
 * segments ran in one work-group or in several. When there are few groups
 * (decode, short prefill chunks) each segment is a work-group of its own,
 * and attention_merge merges them. A decode on a CPU driver (gemv ROW)
 * takes attention_row instead: an item per query head and segment, the
 * same operations without local memory or barriers.
 */
#include "kvcl_internal.h"
#include "kvcl_ops.h"

#define ATT_TILE 4096      /* = ATT_TILE in attention.cl: floats per K (or V) tile */
#define ATT_HD_MAX 256     /* = ATT_HD_MAX */
#define ATT_ROWS 16        /* rows per work-group aimed at */
#define ATT_SEG 256        /* = ATT_SEG in attention.cl: keys per segment */
#define ATT_MIN_GROUPS 64  /* fewer (token block, KV head) groups than this: a work-group per segment */

size_t kvcl_kv_row_bytes(int type, int n) {
    if (n <= 0 || n % 16) return 0; /* kvstore.cl moves rows 16 values at a time */
    if (type == KV_TYPE_F32) return (size_t)n * 4;
    if (type == KV_TYPE_F16) return (size_t)n * 2;
    if (type == KV_TYPE_Q8_0 && n % 32 == 0) return (size_t)n / 32 * 34;
    if (type == KV_TYPE_Q4_0 && n % 32 == 0) return (size_t)n / 32 * 18;
    return 0;
}

kv_status kvcl_pages_check(const kvcl_pages *pg, int64_t end, const char *what, kv_error *e) {
    if (pg->pt <= 0 || (pg->pt & (pg->pt - 1)) || pg->max_pages <= 0)
        return kv_fail(e, KV_ERR_ARG, "%s: pages of %d tokens, %d pages", what, pg->pt, pg->max_pages);
    const size_t kr = kvcl_kv_row_bytes(pg->ktype, pg->head_dim), vr = kvcl_kv_row_bytes(pg->vtype, pg->head_dim_v);
    if (!kr || !vr || pg->n_head_kv <= 0)
        return kv_fail(e, KV_ERR_ARG, "%s: K/V types %d/%d with head sizes %d/%d", what, pg->ktype, pg->vtype,
                       pg->head_dim, pg->head_dim_v);
    const size_t rows = (size_t)pg->n_head_kv * pg->max_pages * pg->pt;
    if (!pg->k || !pg->v || !pg->tab || pg->k->n_parts != 1 || pg->v->n_parts != 1 || pg->k->bytes < rows * kr ||
        pg->v->bytes < rows * vr)
        return kv_fail(e, KV_ERR_ARG, "%s: K/V buffers do not hold %zu rows in one part", what, rows);
    if (end > (int64_t)pg->tab->bytes / 4 * pg->pt)
        return kv_fail(e, KV_ERR_ARG, "%s: position %lld past the page table", what, (long long)end - 1);
    return KV_OK;
}

static int log2i(int v) {
    int l = 0;
    while ((1 << l) < v) l++;
    return l;
}

void kvcl_page_args(kvcl_launch *L, const kvcl_pages *pg) {
    kvcl_arg_mem(L, pg->tab->parts[0]), kvcl_arg_int(L, log2i(pg->pt)), kvcl_arg_int(L, pg->max_pages);
}

kv_status kvcl_kv_store(kvcl_ctx *c, const kvcl_pages *pg, int pos0, int64_t T, kvcl_view k, kvcl_view v,
                        kv_error *e) {
    cl_mem km, vm;
    if (T <= 0 || pos0 < 0) return kv_fail(e, KV_ERR_ARG, "kv_store: %lld tokens at %d", (long long)T, pos0);
    if (kvcl_pages_check(pg, pos0 + T, "kv_store", e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(k, (size_t)T * pg->n_head_kv * pg->head_dim, "kv_store k", &km, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(v, (size_t)T * pg->n_head_kv * pg->head_dim_v, "kv_store v", &vm, e) != KV_OK) return KV_ERR_ARG;
    kvcl_launch L = kvcl_launch_begin(c, c->kv_store);
    kvcl_arg_mem(&L, pg->k->parts[0]), kvcl_arg_mem(&L, pg->v->parts[0]);
    kvcl_page_args(&L, pg);
    kvcl_arg_int(&L, pg->ktype), kvcl_arg_int(&L, pg->vtype);
    kvcl_arg_int(&L, (int)kvcl_kv_row_bytes(pg->ktype, pg->head_dim));
    kvcl_arg_int(&L, (int)kvcl_kv_row_bytes(pg->vtype, pg->head_dim_v));
    kvcl_arg_mem(&L, km), kvcl_arg_ulong(&L, k.off), kvcl_arg_mem(&L, vm), kvcl_arg_ulong(&L, v.off);
    kvcl_arg_int(&L, pos0), kvcl_arg_int(&L, pg->n_head_kv), kvcl_arg_int(&L, pg->head_dim);
    kvcl_arg_int(&L, pg->head_dim_v);
    size_t g[2] = {kvcl_round_up((size_t)pg->n_head_kv, 16), (size_t)T}, l[2] = {16, 1};
    return kvcl_launch_run(&L, 2, g, l, "kv_store", e);
}

/* ---- attention ---- */

typedef struct {
    int G, tb, R;    /* heads per group, tokens per work-group, rows (items) per work-group */
    int bk;          /* keys per tile */
    int64_t blocks;  /* work-groups along the tokens */
    int n_split;     /* work-groups along the keys: 1, or one per segment */
} att_shape;

static kv_status att_shape_for(const kvcl_ctx *c, const kv_attn_params *ap, int64_t T, int pos0, att_shape *s,
                               kv_error *e) {
    size_t max_wg = 0;
    clGetKernelWorkGroupInfo(c->attention, c->dev, CL_KERNEL_WORK_GROUP_SIZE, sizeof max_wg, &max_wg, NULL);
    s->G = ap->n_head / ap->n_head_kv;
    if ((size_t)s->G > max_wg)
        return kv_fail(e, KV_ERR_UNSUPPORTED, "attention: %d query heads per KV head, the device runs %zu per group",
                       s->G, max_wg);
    s->tb = s->G >= ATT_ROWS ? 1 : ATT_ROWS / s->G;
    while ((size_t)(s->tb * s->G) > max_wg) s->tb--;
    if (s->tb > T) s->tb = (int)T;
    s->R = s->tb * s->G;
    const int hmax = ap->head_dim > ap->head_dim_v ? ap->head_dim : ap->head_dim_v;
    s->bk = ATT_TILE / hmax < 64 ? ATT_TILE / hmax : 64;
    s->blocks = (T + s->tb - 1) / s->tb;
    const int64_t keys = pos0 + T;
    const bool split = s->blocks * ap->n_head_kv < ATT_MIN_GROUPS && keys > ATT_SEG;
    s->n_split = split ? (int)((keys + ATT_SEG - 1) / ATT_SEG) : 1;
    return KV_OK;
}

static kv_status merge(kvcl_ctx *c, cl_mem part, const att_shape *s, int64_t rows, int hdv, cl_mem out,
                       size_t ooff, kv_error *e) {
    kvcl_launch L = kvcl_launch_begin(c, c->attention_merge);
    kvcl_arg_mem(&L, part), kvcl_arg_int(&L, s->n_split), kvcl_arg_int(&L, (int)rows), kvcl_arg_int(&L, hdv);
    kvcl_arg_mem(&L, out), kvcl_arg_ulong(&L, ooff);
    size_t g[2] = {kvcl_round_up((size_t)hdv, 16), (size_t)rows}, l[2] = {16, 1};
    return kvcl_launch_run(&L, 2, g, l, "attention merge", e);
}

kv_status kvcl_attention(kvcl_ctx *c, const kvcl_pages *pg, const kv_attn_params *ap, kvcl_view q, int64_t T,
                         int pos0, kvcl_view out, kv_error *e) {
    cl_mem qm, om, part = NULL;
    if (T <= 0 || pos0 < 0 || ap->n_head_kv != pg->n_head_kv || ap->n_head <= 0 || ap->n_head % ap->n_head_kv ||
        ap->head_dim != pg->head_dim || ap->head_dim_v != pg->head_dim_v || ap->window < 0)
        return kv_fail(e, KV_ERR_ARG, "attention: parameters do not match the pages");
    if (ap->head_dim > ATT_HD_MAX || ap->head_dim_v > ATT_HD_MAX)
        return kv_fail(e, KV_ERR_UNSUPPORTED, "attention: head sizes %d/%d (at most %d)", ap->head_dim,
                       ap->head_dim_v, ATT_HD_MAX);
    if (kvcl_pages_check(pg, pos0 + T, "attention", e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(q, (size_t)T * ap->n_head * ap->head_dim, "attention q", &qm, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(out, (size_t)T * ap->n_head * ap->head_dim_v, "attention out", &om, e) != KV_OK)
        return KV_ERR_ARG;
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    att_shape s = {0};
    if (att_shape_for(c, ap, T, pos0, &s, e) != KV_OK) return KV_ERR_UNSUPPORTED;
    const int64_t rows = T * ap->n_head;
    if (s.n_split > 1) {
        kv_status st = kvcl_scratch(c, sizeof(float) * (size_t)s.n_split * rows * (ap->head_dim_v + 2), &part, e);
        if (st != KV_OK) return st;
    }
    /* one split: the output's records for the product that reads it (whole blocks a head) */
    int nbx = 0;
    const int64_t cols = (int64_t)ap->n_head * ap->head_dim_v;
    cl_mem rec = s.n_split == 1 && ap->head_dim_v % 32 == 0 ? kvcl_xq_target(c, cols, T, NULL, &nbx) : NULL;
    /* decode on a CPU driver: attention_row, an item per (query head, segment) */
    const bool row = T == 1 && c->gemv == KVCL_GEMV_ROW;
    kvcl_launch L = kvcl_launch_begin(c, row ? c->attention_row : c->attention);
    kvcl_arg_mem(&L, qm), kvcl_arg_ulong(&L, q.off);
    kvcl_arg_mem(&L, pg->k->parts[0]), kvcl_arg_mem(&L, pg->v->parts[0]);
    kvcl_page_args(&L, pg);
    kvcl_arg_int(&L, pg->ktype), kvcl_arg_int(&L, pg->vtype);
    kvcl_arg_int(&L, (int)kvcl_kv_row_bytes(pg->ktype, pg->head_dim));
    kvcl_arg_int(&L, (int)kvcl_kv_row_bytes(pg->vtype, pg->head_dim_v));
    kvcl_arg_int(&L, (int)T), kvcl_arg_int(&L, pos0), kvcl_arg_int(&L, ap->n_head), kvcl_arg_int(&L, ap->n_head_kv);
    kvcl_arg_int(&L, ap->head_dim), kvcl_arg_int(&L, ap->head_dim_v), kvcl_arg_float(&L, ap->scale);
    kvcl_arg_int(&L, ap->window), kvcl_arg_float(&L, ap->softcap);
    kvcl_arg_int(&L, s.tb), kvcl_arg_int(&L, s.bk), kvcl_arg_int(&L, s.n_split);
    kvcl_arg_mem(&L, s.n_split == 1 ? om : NULL), kvcl_arg_ulong(&L, out.off), kvcl_arg_mem(&L, part);
    kvcl_arg_mem(&L, rec), kvcl_arg_int(&L, nbx);
    size_t g[3] = {(size_t)(s.blocks * s.R), (size_t)ap->n_head_kv, (size_t)s.n_split}, l[3] = {(size_t)s.R, 1, 1};
    if (row) g[0] = (size_t)ap->n_head, g[1] = (size_t)s.n_split, g[2] = 1, l[0] = 1;
    if (kvcl_launch_run(&L, 3, g, l, "attention", e) != KV_OK) return c->failed;
    if (rec) kvcl_xq_set(c, om, out.off, cols, T, rec);
    return s.n_split > 1 ? merge(c, part, &s, rows, ap->head_dim_v, om, out.off, e) : KV_OK;
}
