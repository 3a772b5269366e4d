/*
 * kvcache.c — contiguous K/V storage (see kvcache.h for the layout).
 */
#include "kvcache.h"

#include <stdlib.h>

#include "types.h"

struct kv_kvcache {
    int n_layer, n_head_kv, head_dim, head_dim_v, n_ctx;
    int ktype, vtype;
    size_t krow, vrow; /* bytes per stored row */
    uint8_t *k;        /* (n_layer, n_head_kv, n_ctx, krow bytes) */
    uint8_t *v;        /* (n_layer, n_head_kv, n_ctx, vrow bytes) */
};

/* ==== lifetime ========================================================== */

kv_status kv_kvcache_create(int n_layer, int n_head_kv, int head_dim, int head_dim_v, int n_ctx,
                            int ktype, int vtype, kv_kvcache **out, kv_error *e) {
    *out = NULL;
    if (n_layer <= 0 || n_head_kv <= 0 || head_dim <= 0 || head_dim_v <= 0 || n_ctx <= 0)
        return kv_fail(e, KV_ERR_ARG, "kv cache: bad shape (layers %d, heads %d, dims %d/%d, ctx %d)",
                       n_layer, n_head_kv, head_dim, head_dim_v, n_ctx);
    const int types[2] = {ktype, vtype}, dims[2] = {head_dim, head_dim_v};
    for (int i = 0; i < 2; i++) {
        if (types[i] != KV_TYPE_F32 && types[i] != KV_TYPE_F16 && types[i] != KV_TYPE_Q8_0) {
            const kv_type_traits *tr = kv_type_traits_get(types[i]);
            return kv_fail(e, KV_ERR_UNSUPPORTED, "kv cache: %s type %s not supported (F16, F32 or Q8_0)",
                           i ? "V" : "K", tr ? tr->name : "unknown");
        }
        if (types[i] == KV_TYPE_Q8_0 && dims[i] % 32 != 0)
            return kv_fail(e, KV_ERR_UNSUPPORTED,
                           "kv cache: Q8_0 needs a head size that is a multiple of 32 (%s head size %d)",
                           i ? "V" : "K", dims[i]);
    }
    size_t krow = kv_row_size(ktype, head_dim), vrow = kv_row_size(vtype, head_dim_v);
    uint64_t rows = (uint64_t)n_layer * (uint64_t)n_head_kv * (uint64_t)n_ctx;
    if (rows > (uint64_t)SIZE_MAX / (krow > vrow ? krow : vrow))
        return kv_fail(e, KV_ERR_NOMEM, "kv cache: %d tokens too large", n_ctx);
    kv_kvcache *c = calloc(1, sizeof *c);
    if (!c) return kv_fail(e, KV_ERR_NOMEM, "kv cache: out of memory");
    *c = (kv_kvcache){n_layer, n_head_kv, head_dim, head_dim_v, n_ctx, ktype, vtype, krow, vrow, NULL, NULL};
    c->k = calloc(rows, krow);
    c->v = calloc(rows, vrow);
    if (!c->k || !c->v) {
        kv_kvcache_free(c);
        return kv_fail(e, KV_ERR_NOMEM, "kv cache: out of memory for %d tokens (%llu bytes)", n_ctx,
                       (unsigned long long)(rows * (krow + vrow)));
    }
    *out = c;
    return KV_OK;
}

void kv_kvcache_free(kv_kvcache *c) {
    if (!c) return;
    free(c->k);
    free(c->v);
    free(c);
}

/* ==== queries ============================================================ */

int kv_kvcache_ktype(const kv_kvcache *c) { return c->ktype; }
int kv_kvcache_vtype(const kv_kvcache *c) { return c->vtype; }
int kv_kvcache_n_ctx(const kv_kvcache *c) { return c->n_ctx; }
int kv_kvcache_n_head_kv(const kv_kvcache *c) { return c->n_head_kv; }
int kv_kvcache_head_dim(const kv_kvcache *c, bool v) { return v ? c->head_dim_v : c->head_dim; }
size_t kv_kvcache_row_bytes(const kv_kvcache *c, bool v) { return v ? c->vrow : c->krow; }

uint64_t kv_kvcache_bytes(const kv_kvcache *c) {
    return (uint64_t)c->n_layer * c->n_head_kv * c->n_ctx * (c->krow + c->vrow);
}

/* ==== the accessor ======================================================= */

void *kv_kv_span_mut(kv_kvcache *c, int layer, int kv_head, int pos0, int *n_contig, bool v) {
    size_t row = v ? c->vrow : c->krow;
    uint8_t *base = v ? c->v : c->k;
    size_t idx = ((size_t)layer * c->n_head_kv + kv_head) * c->n_ctx + pos0;
    if (n_contig) *n_contig = c->n_ctx - pos0;
    return base + idx * row;
}

const void *kv_kv_span(const kv_kvcache *c, int layer, int kv_head, int pos0, int *n_contig, bool v) {
    return kv_kv_span_mut((kv_kvcache *)c, layer, kv_head, pos0, n_contig, v);
}
