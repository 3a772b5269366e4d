/*
 * kvcache.c — page tables and kv_kv_span (see kvcache.h; pages in kvpool.h).
 */
#include "kvcache.h"

#include <stdlib.h>

#include "kvpool.h"

/* ==== lifetime ========================================================== */

kv_status kv_kvcache_create(kv_cache *pool, int n_ctx, kv_kvcache **out, kv_error *e) {
    *out = NULL;
    if (n_ctx <= 0) return kv_fail(e, KV_ERR_ARG, "kv cache: n_ctx must be positive (got %d)", n_ctx);
    kv_kvcache *c = calloc(1, sizeof *c);
    if (!c) return kv_fail(e, KV_ERR_NOMEM, "kv cache: out of memory");
    c->pool = pool;
    c->n_ctx = n_ctx;
    c->n_lp = (int)(((int64_t)n_ctx + pool->pt - 1) / pool->pt);
    for (int g = 0; g < pool->n_groups; g++) {
        c->tab[g] = malloc((size_t)c->n_lp * sizeof(int32_t));
        if (!c->tab[g]) {
            kv_kvcache_free(c);
            return kv_fail(e, KV_ERR_NOMEM, "kv cache: out of memory for %d tokens", n_ctx);
        }
        for (int i = 0; i < c->n_lp; i++) c->tab[g][i] = -1;
    }
    kv_cache_retain(pool);
    *out = c;
    return KV_OK;
}

kv_status kv_kvcache_create_bare(int n_layer, int n_kv, int head_dim, int head_dim_v, int n_ctx, int ktype,
                                 int vtype, int page_tokens, kv_kvcache **out, kv_error *e) {
    *out = NULL;
    kv_pool_shape sh = {n_layer, n_kv, head_dim, head_dim_v, NULL};
    kv_cache_params p = {.page_tokens = page_tokens, .ktype = ktype, .vtype = vtype};
    kv_cache *pool;
    kv_status st = kv_pool_open_bare(&sh, &p, n_ctx, &pool, e);
    if (st) return st;
    st = kv_kvcache_create(pool, n_ctx, out, e);
    kv_cache_close(pool); /* the view holds it */
    for (int i = 0; st == KV_OK && i < (*out)->n_lp; i++) {
        int32_t id;
        st = kv_pool_take(pool, 0, 1, &id, e);
        if (st == KV_OK) (*out)->tab[0][i] = id;
    }
    if (st) {
        kv_kvcache_free(*out);
        *out = NULL;
    }
    return st;
}

void kv_kvcache_free(kv_kvcache *c) {
    if (!c) return;
    bool retained = true;
    for (int g = 0; g < c->pool->n_groups; g++) {
        if (!c->tab[g]) {
            retained = false; /* failed creation: never retained the pool */
            continue;
        }
        for (int i = 0; i < c->n_lp; i++)
            if (c->tab[g][i] >= 0) kv_pool_unref(c->pool, g, c->tab[g][i]);
        free(c->tab[g]);
    }
    if (c->dev) c->dev_free(c->dev);
    if (retained) kv_cache_close(c->pool);
    free(c);
}

/* ==== queries ============================================================ */

int kv_kvcache_ktype(const kv_kvcache *c, int layer) { return c->pool->ktypes[layer]; }
int kv_kvcache_vtype(const kv_kvcache *c, int layer) { return c->pool->vtypes[layer]; }
int kv_kvcache_n_ctx(const kv_kvcache *c) { return c->n_ctx; }
int kv_kvcache_n_head_kv(const kv_kvcache *c) { return c->pool->n_kv; }
int kv_kvcache_head_dim(const kv_kvcache *c, bool v) { return v ? c->pool->head_dim_v : c->pool->head_dim; }
size_t kv_kvcache_row_bytes(const kv_kvcache *c, int layer, bool v) { return kv_pool_row_bytes(c->pool, layer, v); }

uint64_t kv_kvcache_bytes(const kv_kvcache *c) {
    uint64_t b = 0;
    for (int g = 0; g < c->pool->n_groups; g++)
        for (int i = 0; i < c->n_lp; i++)
            if (c->tab[g][i] >= 0) b += c->pool->groups[g].page_bytes;
    return b;
}

/* ==== the accessor ======================================================= */

/* Longest run reported at once: long enough for linear streaming, short
 * enough that the scan stays cheap. */
#define SPAN_MAX_PAGES 8

void *kv_kv_span_mut(kv_kvcache *c, int layer, int kv_head, int pos0, int *n_contig, bool v) {
    const kv_cache *p = c->pool;
    const int g = p->layer_group[layer];
    const int lp = pos0 >> p->pt_log2, t = pos0 & (p->pt - 1);
    const int32_t *tab = c->tab[g];
    const int32_t id = tab[lp];
    if (n_contig) {
        int32_t room = kv_pool_slab_room(p, g, id), run = 1;
        while (run < room && run < SPAN_MAX_PAGES && lp + run < c->n_lp && tab[lp + run] == id + run) run++;
        *n_contig = run * p->pt - t;
    }
    return kv_pool_row(p, g, id, p->layer_index[layer], kv_head, t, v);
}

const void *kv_kv_span(const kv_kvcache *c, int layer, int kv_head, int pos0, int *n_contig, bool v) {
    return kv_kv_span_mut((kv_kvcache *)c, layer, kv_head, pos0, n_contig, v);
}
