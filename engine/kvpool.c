/*
 * kvpool.c — the KV page pool: storage in slabs, page reference counts,
 * copy-on-write copies, sealing full pages under their chain hash, the
 * prefix index, pins, LRU eviction (or the user's policy), and the public
 * kv_cache_* functions (stats, lookup, pin, clear). Layout and states are
 * described in kvpool.h.
 *
 * Capacity: a shared cache has a byte budget over all its groups (pages =
 * N means N pages of every group); each group reserves address space for
 * the whole budget (mmap without reservation, committed as pages are
 * written), so any mix of groups fits. A private pool (a session opened
 * without a cache) has no budget: it first evicts its own cached pages
 * once it holds what its context needs, and grows by a slab when nothing
 * is evictable (forks of it share it).
 */
#include "kvpool.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "model_internal.h"
#include "types.h"

/* ==== the 64-bit hash map ================================================== */

static uint64_t hkey(const kv_hash *h) {
    uint64_t k;
    memcpy(&k, h->b, 8);
    return k < 2 ? k + 2 : k;
}

static void hmap_free(kv_hmap *m) {
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

static bool hmap_grow(kv_hmap *m) {
    size_t cap = m->cap ? m->cap * 2 : 64;
    if (m->n * 4 < m->cap) cap = m->cap; /* mostly tombstones: rehash in place */
    uint64_t *keys = calloc(cap, sizeof *keys);
    int32_t *vals = malloc(cap * sizeof *vals);
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return false;
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (m->keys[i] < 2) continue;
        size_t j = m->keys[i] & (cap - 1);
        while (keys[j]) j = (j + 1) & (cap - 1);
        keys[j] = m->keys[i];
        vals[j] = m->vals[i];
    }
    free(m->keys);
    free(m->vals);
    m->keys = keys;
    m->vals = vals;
    m->cap = cap;
    m->used = m->n;
    return true;
}

static int32_t *hmap_get(const kv_hmap *m, uint64_t k) {
    if (!m->cap) return NULL;
    for (size_t j = k & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
        if (m->keys[j] == k) return &m->vals[j];
        if (m->keys[j] == 0) return NULL;
    }
}

static bool hmap_put(kv_hmap *m, uint64_t k, int32_t v) {
    int32_t *p = hmap_get(m, k);
    if (p) {
        *p = v;
        return true;
    }
    if ((m->used + 1) * 4 > m->cap * 3 && !hmap_grow(m)) return false;
    size_t j = k & (m->cap - 1);
    while (m->keys[j] >= 2) j = (j + 1) & (m->cap - 1);
    if (m->keys[j] == 0) m->used++;
    m->keys[j] = k;
    m->vals[j] = v;
    m->n++;
    return true;
}

static void hmap_del(kv_hmap *m, uint64_t k) {
    int32_t *p = hmap_get(m, k);
    if (!p) return;
    m->keys[p - m->vals] = 1;
    m->n--;
}

/* ==== chain hashes ========================================================== */

void kv_chain_hash(const kv_hash *prev, const int32_t *ids, int n, kv_hash *out) {
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, KV_HASH_BYTES);
    crypto_generichash_update(&st, prev->b, KV_HASH_BYTES);
    uint8_t buf[4 * 64];
    for (int i = 0; i < n;) {
        int k = 0;
        for (; k < 64 && i < n; k++, i++) {
            uint32_t v = (uint32_t)ids[i];
            buf[4 * k] = (uint8_t)v, buf[4 * k + 1] = (uint8_t)(v >> 8);
            buf[4 * k + 2] = (uint8_t)(v >> 16), buf[4 * k + 3] = (uint8_t)(v >> 24);
        }
        crypto_generichash_update(&st, buf, (size_t)k * 4);
    }
    crypto_generichash_final(&st, out->b, KV_HASH_BYTES);
}

/* ==== lists ================================================================== */

static void lru_unlink(kv_group *G, int32_t id) {
    kv_page *p = &G->pages[id];
    if (p->lru_prev >= 0) G->pages[p->lru_prev].lru_next = p->lru_next;
    else G->lru_head = p->lru_next;
    if (p->lru_next >= 0) G->pages[p->lru_next].lru_prev = p->lru_prev;
    else G->lru_tail = p->lru_prev;
    p->lru_prev = p->lru_next = -1;
    G->n_cached--;
}

static void lru_push(kv_group *G, int32_t id) { /* newest at the tail */
    kv_page *p = &G->pages[id];
    p->lru_next = -1;
    p->lru_prev = G->lru_tail;
    if (G->lru_tail >= 0) G->pages[G->lru_tail].lru_next = id;
    else G->lru_head = id;
    G->lru_tail = id;
    G->n_cached++;
}

static void free_push(kv_group *G, int32_t id) {
    kv_page *p = &G->pages[id];
    memset(p, 0, sizeof *p);
    p->state = KV_PAGE_FREE;
    p->lru_prev = -1;
    p->lru_next = G->free_head;
    G->free_head = id;
    G->n_free++;
}

static int32_t free_pop(kv_group *G) {
    int32_t id = G->free_head;
    if (id < 0) return -1;
    G->free_head = G->pages[id].lru_next;
    G->pages[id].lru_next = -1;
    G->n_free--;
    return id;
}

/* ==== storage ================================================================ */

static void *map_bytes(size_t n) {
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static size_t slab_bytes(const kv_group *G) { return (size_t)G->slab_pages * G->page_bytes; }

/* One more slab of S pages, on the free list (lowest ids first). */
static bool group_grow(kv_group *G) {
    if (G->n_pages > G->max_pages - G->slab_pages && G->max_pages != INT32_MAX) return false;
    if ((int64_t)G->n_pages + G->slab_pages > INT32_MAX / 2) return false;
    if (G->n_slabs == G->cap_slabs) {
        int cap = G->cap_slabs ? G->cap_slabs * 2 : 4;
        uint8_t **s = realloc(G->slabs, (size_t)cap * sizeof *s);
        if (!s) return false;
        G->slabs = s;
        G->cap_slabs = cap;
    }
    kv_page *pages = realloc(G->pages, (size_t)(G->n_pages + G->slab_pages) * sizeof *pages);
    if (!pages) return false;
    G->pages = pages;
    uint8_t *slab = map_bytes(slab_bytes(G));
    if (!slab) return false;
    G->slabs[G->n_slabs++] = slab;
    int32_t first = G->n_pages;
    G->n_pages += G->slab_pages;
    for (int32_t id = G->n_pages - 1; id >= first; id--) free_push(G, id);
    return true;
}

/* A device backend's pages, or NULL: the host slabs are the storage. */
static kv_backend *device_pages(const kv_cache *c) {
    kv_backend *be = c->m ? &c->m->be : NULL;
    return be && be->pages_grow ? be : NULL;
}

/* One more slab, and the device's pages to match. */
static kv_status pool_grow(kv_cache *c, int g, const char *what, kv_error *e) {
    kv_group *G = &c->groups[g];
    if (!group_grow(G))
        return kv_fail(e, KV_ERR_NOMEM, "%s: out of memory for %lld pages of %zu bytes", what,
                       (long long)G->slab_pages, G->page_bytes);
    kv_backend *be = device_pages(c);
    return be ? be->pages_grow(be, c, g, G->n_pages, e) : KV_OK;
}

uint8_t *kv_pool_row(const kv_cache *c, int g, int32_t id, int li, int head, int t, bool v) {
    const kv_group *G = &c->groups[g];
    const int32_t S = G->slab_pages, slot = id % S;
    const size_t row = kv_pool_row_bytes(c, G->layer_ids[li], v);
    return G->slabs[id / S] + (v ? G->voff : G->koff)[li] +
           (((size_t)head * S + (size_t)slot) * c->pt + (size_t)t) * row;
}

int32_t kv_pool_slab_room(const kv_cache *c, int g, int32_t id) {
    const int32_t S = c->groups[g].slab_pages;
    return S - id % S;
}

void kv_pool_copy(kv_cache *c, int g, int32_t dst, int32_t src) {
    const kv_group *G = &c->groups[g];
    kv_backend *be = device_pages(c);
    if (be) {
        be->pages_copy(be, c, g, dst, src);
        return;
    }
    for (int li = 0; li < G->n_layers; li++)
        for (int h = 0; h < c->n_kv; h++) {
            memcpy(kv_pool_row(c, g, dst, li, h, 0, false), kv_pool_row(c, g, src, li, h, 0, false),
                   (size_t)c->pt * c->krows[G->layer_ids[li]]);
            memcpy(kv_pool_row(c, g, dst, li, h, 0, true), kv_pool_row(c, g, src, li, h, 0, true),
                   (size_t)c->pt * c->vrows[G->layer_ids[li]]);
        }
}

/* ==== opening and closing ===================================================== */

static void group_free(kv_group *G) {
    for (int i = 0; i < G->n_slabs; i++) munmap(G->slabs[i], slab_bytes(G));
    free(G->slabs);
    free(G->pages);
    free(G->koff);
    free(G->voff);
    free(G->layer_ids);
    hmap_free(&G->index);
    hmap_free(&G->evicted);
}

static void pool_free(kv_cache *c) {
    if (c->m) {
        kv_cache **pp = kv_model_caches(c->m);
        while (*pp && *pp != c) pp = &(*pp)->next_of_model;
        if (*pp) *pp = c->next_of_model;
    }
    if (c->dev) c->dev_free(c->dev);
    for (int g = 0; g < c->n_groups; g++) group_free(&c->groups[g]);
    hmap_free(&c->pins);
    hmap_free(&c->tnode_index);
    free(c->tnodes);
    free(c->tnode_ids);
    free(c->layer_group);
    free(c->layer_index);
    free(c->ktypes);
    free(c->krows);
    free(c);
}

void kv_cache_retain(kv_cache *c) { c->refs++; }

void kv_cache_close(kv_cache *c) {
    if (c && --c->refs == 0) pool_free(c);
}

static bool type_ok(int t) { return t == KV_TYPE_F16 || t == KV_TYPE_F32 || t == KV_TYPE_Q8_0 || t == KV_TYPE_Q4_0; }

/* Pages a session of n_ctx positions holds at most in group G (a window
 * group: the window plus one prefill chunk, page-aligned on both ends). */
#define KV_PRIVATE_SLAB 65536 /* pages a slab of a session's private pool at most (4.5 MiB of page state) */

static int64_t group_need(const kv_cache *c, const kv_group *G, int64_t n_ctx) {
    int64_t all = (n_ctx + c->pt - 1) / c->pt;
    if (G->window <= 0) return all;
    int64_t w = (G->window + KV_CHUNK + c->pt - 1) / c->pt + 1;
    return w < all ? w : all;
}

/* The pool for layers of the given shape; m (NULL for a bare pool, as the
 * kernel tests use) names the pages' model and is told about the cache. */
static kv_status pool_open_shape(kv_model *m, const kv_pool_shape *in, const kv_cache_params *p, int private_ctx,
                                 kv_cache **out, kv_error *e) {
    *out = NULL;
    const int pt = p->page_tokens ? p->page_tokens : 16;
    if (pt <= 0 || (pt & (pt - 1)) || pt > 65536)
        return kv_fail(e, KV_ERR_ARG, "cache: page_tokens must be a power of two in [1, 65536] (got %d)", pt);
    const int dims[2] = {in->head_dim, in->head_dim_v};
    for (int il = 0; il < in->n_layer; il++) {
        const int types[2] = {p->ktypes ? p->ktypes[il] : p->ktype, p->vtypes ? p->vtypes[il] : p->vtype};
        for (int i = 0; i < 2; i++) {
            if (!type_ok(types[i])) {
                const kv_type_traits *tr = kv_type_traits_get(types[i]);
                return kv_fail(e, KV_ERR_UNSUPPORTED,
                               "kv cache: %s type %s (layer %d) not supported (F16, F32, Q8_0 or Q4_0)", i ? "V" : "K",
                               tr ? tr->name : "unknown", il);
            }
            if ((types[i] == KV_TYPE_Q8_0 || types[i] == KV_TYPE_Q4_0) && dims[i] % 32 != 0)
                return kv_fail(e, KV_ERR_UNSUPPORTED,
                               "kv cache: %s needs a head size that is a multiple of 32 (%s head size %d)",
                               types[i] == KV_TYPE_Q8_0 ? "Q8_0" : "Q4_0", i ? "V" : "K", dims[i]);
        }
    }
    if (sodium_init() < 0) return kv_fail(e, KV_ERR_IO, "cache: libsodium failed to initialize");
    kv_cache *c = calloc(1, sizeof *c);
    if (!c) return kv_fail(e, KV_ERR_NOMEM, "cache: out of memory");
    c->m = m;
    c->tnode_free = -1;
    c->n_layer = in->n_layer;
    c->refs = 1;
    c->is_private = private_ctx > 0;
    c->prefix = p->prefix;
    c->pt = pt;
    while ((1 << c->pt_log2) < pt) c->pt_log2++;
    c->n_kv = in->n_kv, c->head_dim = in->head_dim, c->head_dim_v = in->head_dim_v;
    const size_t L = (size_t)in->n_layer;
    c->layer_group = calloc(L, sizeof(int));
    c->layer_index = calloc(L, sizeof(int));
    c->ktypes = malloc(2 * L * sizeof(int));
    c->krows = malloc(2 * L * sizeof(size_t));
    kv_status st = KV_OK;
    if (!c->layer_group || !c->layer_index || !c->ktypes || !c->krows) {
        st = kv_fail(e, KV_ERR_NOMEM, "cache: out of memory");
        goto fail;
    }
    c->vtypes = c->ktypes + L, c->vrows = c->krows + L;
    for (size_t il = 0; il < L; il++) {
        c->ktypes[il] = p->ktypes ? p->ktypes[il] : p->ktype;
        c->vtypes[il] = p->vtypes ? p->vtypes[il] : p->vtype;
        c->krows[il] = kv_row_size(c->ktypes[il], in->head_dim);
        c->vrows[il] = kv_row_size(c->vtypes[il], in->head_dim_v);
        c->mixed |= c->ktypes[il] != c->ktypes[0] || c->vtypes[il] != c->vtypes[0];
    }
    /* layer groups: one per distinct attention span, in order of first use */
    for (int il = 0; il < in->n_layer; il++) {
        int w = in->windows ? in->windows[il] : 0, g = 0;
        while (g < c->n_groups && c->groups[g].window != w) g++;
        if (g == c->n_groups) {
            if (g == KV_MAX_GROUPS) {
                st = kv_fail(e, KV_ERR_UNSUPPORTED, "cache: more than %d distinct attention windows", KV_MAX_GROUPS);
                goto fail;
            }
            c->groups[g].window = w;
            c->n_groups++;
        }
        c->layer_group[il] = g;
        c->layer_index[il] = c->groups[g].n_layers++;
    }
    uint64_t sum_page = 0;
    for (int g = 0; g < c->n_groups; g++) {
        kv_group *G = &c->groups[g];
        G->layer_ids = malloc((size_t)G->n_layers * sizeof(int));
        if (!G->layer_ids) {
            st = kv_fail(e, KV_ERR_NOMEM, "cache: out of memory");
            goto fail;
        }
        G->page_bytes = 0;
        for (int il = 0; il < in->n_layer; il++)
            if (c->layer_group[il] == g) {
                G->layer_ids[c->layer_index[il]] = il;
                G->page_bytes += (size_t)c->n_kv * pt * (c->krows[il] + c->vrows[il]);
            }
        sum_page += G->page_bytes;
        G->free_head = G->lru_head = G->lru_tail = -1;
    }
    /* capacity */
    if (c->is_private) {
        for (int g = 0; g < c->n_groups; g++) {
            kv_group *G = &c->groups[g];
            G->max_pages = INT32_MAX;
            int64_t need = group_need(c, G, private_ctx);
            if (need > INT32_MAX / 4) {
                st = kv_fail(e, KV_ERR_NOMEM, "session: %d tokens too large", private_ctx);
                goto fail;
            }
            /* a long context's pages come a slab at a time as they are reserved: a context (or a
             * session file) that claims millions of tokens does not allocate their pages' state
             * up front */
            G->slab_pages = (int32_t)(need < KV_PRIVATE_SLAB ? need : KV_PRIVATE_SLAB);
        }
    } else {
        uint64_t B = p->bytes;
        if (p->pages > 0) {
            if ((uint64_t)p->pages > UINT64_MAX / sum_page) {
                st = kv_fail(e, KV_ERR_ARG, "cache: %lld pages is too many", (long long)p->pages);
                goto fail;
            }
            B = (uint64_t)p->pages * sum_page;
        }
        if (B < sum_page) {
            st = kv_fail(e, KV_ERR_ARG,
                         "cache: capacity of %llu bytes is below one page of every layer group (%llu bytes)",
                         (unsigned long long)B, (unsigned long long)sum_page);
            goto fail;
        }
        c->capacity_bytes = B;
        for (int g = 0; g < c->n_groups; g++) {
            kv_group *G = &c->groups[g];
            uint64_t n = B / G->page_bytes;
            if (n > INT32_MAX / 4 || n * G->page_bytes > ((uint64_t)1 << 46)) {
                st = kv_fail(e, KV_ERR_ARG, "cache: capacity of %llu bytes is too large", (unsigned long long)B);
                goto fail;
            }
            G->max_pages = G->slab_pages = (int32_t)n;
        }
    }
    for (int g = 0; g < c->n_groups; g++) {
        kv_group *G = &c->groups[g];
        G->koff = malloc((size_t)G->n_layers * sizeof(size_t));
        G->voff = malloc((size_t)G->n_layers * sizeof(size_t));
        if (!G->koff || !G->voff) {
            st = kv_fail(e, KV_ERR_NOMEM, "cache: out of memory");
            goto fail;
        }
        size_t off = 0;
        for (int li = 0; li < G->n_layers; li++) {
            const int il = G->layer_ids[li];
            G->koff[li] = off;
            G->voff[li] = off + (size_t)c->n_kv * G->slab_pages * pt * c->krows[il];
            off = G->voff[li] + (size_t)c->n_kv * G->slab_pages * pt * c->vrows[il];
        }
        if ((st = pool_grow(c, g, "cache", e))) goto fail;
    }
    /* h_0: the model file, the storage types and the page size */
    uint8_t fp[32] = {0};
    double secs;
    if (m && (st = kv_model_fingerprint(m, fp, &secs, e))) goto fail;
    {
        crypto_generichash_state hs;
        crypto_generichash_init(&hs, NULL, 0, KV_HASH_BYTES);
        const char tag[] = "kvlua kv pages v1";
        crypto_generichash_update(&hs, (const uint8_t *)tag, sizeof tag);
        crypto_generichash_update(&hs, fp, sizeof fp);
        int32_t pt32 = c->pt;
        crypto_generichash_update(&hs, (const uint8_t *)&pt32, sizeof pt32);
        crypto_generichash_update(&hs, (const uint8_t *)c->ktypes, 2 * L * sizeof(int)); /* every layer's K, V types */
        crypto_generichash_final(&hs, c->h0.b, KV_HASH_BYTES);
    }
    if (m) {
        kv_cache **head = kv_model_caches(m);
        c->next_of_model = *head;
        *head = c;
    }
    *out = c;
    return KV_OK;
fail:
    if (c->dev) c->dev_free(c->dev);
    for (int g = 0; g < c->n_groups; g++) group_free(&c->groups[g]);
    free(c->layer_group);
    free(c->layer_index);
    free(c->ktypes);
    free(c->krows);
    free(c);
    return st;
}

kv_status kv_pool_open(kv_model *m, const kv_cache_params *p, int private_ctx, kv_cache **out, kv_error *e) {
    *out = NULL;
    const kv_model_info *in = kv_model_info_get(m);
    if (!in->has_weights) return kv_fail(e, KV_ERR_ARG, "cache: the model has no weights (vocabulary-only file)");
    int *windows = malloc((size_t)in->n_layer * sizeof(int));
    if (!windows) return kv_fail(e, KV_ERR_NOMEM, "cache: out of memory");
    for (int il = 0; il < in->n_layer; il++) windows[il] = kv_model_layer_window(m, il);
    kv_pool_shape sh = {in->n_layer, in->n_head_kv, in->head_dim, in->head_dim_v, windows};
    kv_status st = pool_open_shape(m, &sh, p, private_ctx, out, e);
    free(windows);
    return st;
}

kv_status kv_pool_open_bare(const kv_pool_shape *sh, const kv_cache_params *p, int private_ctx, kv_cache **out,
                            kv_error *e) {
    if (!sh || sh->n_layer <= 0 || sh->n_kv <= 0 || sh->head_dim <= 0 || sh->head_dim_v <= 0 || private_ctx <= 0)
        return kv_fail(e, KV_ERR_ARG, "cache: bad shape");
    return pool_open_shape(NULL, sh, p, private_ctx, out, e);
}

kv_status kv_cache_open(kv_model *m, const kv_cache_params *p, kv_cache **out, kv_error *e) {
    if (!out) return kv_fail(e, KV_ERR_ARG, "cache: out is NULL");
    *out = NULL;
    if (!m || !p) return kv_fail(e, KV_ERR_ARG, "cache: model or params is NULL");
    if (p->bytes == 0 && p->pages <= 0)
        return kv_fail(e, KV_ERR_ARG, "cache: give a capacity (bytes or pages)");
    return kv_pool_open(m, p, 0, out, e);
}

/* ==== references, eviction, taking pages ======================================= */

void kv_pool_ref(kv_cache *c, int g, int32_t id) {
    kv_group *G = &c->groups[g];
    kv_page *p = &G->pages[id];
    if (p->ref++ == 0) {
        if (p->state == KV_PAGE_SEALED) lru_unlink(G, id);
        G->n_used++;
    }
    p->last_use = ++c->tick;
}

static void evict(kv_cache *c, int g, int32_t id) {
    kv_group *G = &c->groups[g];
    kv_page *p = &G->pages[id];
    uint64_t k = hkey(&p->hash);
    hmap_del(&G->index, k);
    if (G->evicted.n > 65536) hmap_free(&G->evicted); /* a bounded record */
    hmap_put(&G->evicted, k, 1);
    lru_unlink(G, id);
    int32_t tn = p->tnode;
    free_push(G, id);
    if (tn >= 0) {
        c->tnodes[tn].refs--;
        kv_pool_tnode_trim(c, tn);
    }
    c->evictions++;
}

void kv_pool_unref(kv_cache *c, int g, int32_t id) {
    kv_group *G = &c->groups[g];
    kv_page *p = &G->pages[id];
    p->last_use = ++c->tick;
    if (--p->ref > 0) return;
    G->n_used--;
    if (p->state == KV_PAGE_SEALED) lru_push(G, id);
    else free_push(G, id);
}

/* Pages group g can still take without evicting. */
static int64_t group_room(const kv_cache *c, int g) {
    const kv_group *G = &c->groups[g];
    int64_t room = G->n_free;
    if (c->is_private) return room;
    /* the byte budget is shared by the groups */
    uint64_t held = 0;
    for (int h = 0; h < c->n_groups; h++)
        held += (uint64_t)(c->groups[h].n_used + c->groups[h].n_cached) * c->groups[h].page_bytes;
    int64_t by_budget = held >= c->capacity_bytes ? 0 : (int64_t)((c->capacity_bytes - held) / G->page_bytes);
    return room < by_budget ? room : by_budget;
}

/* Evicts at least `need` cached pages of group g, through the policy if one
 * is set (checked), else oldest first. */
static kv_status make_room(kv_cache *c, int g, int need, kv_error *e) {
    kv_group *G = &c->groups[g];
    int n = 0;
    for (int32_t id = G->lru_head; id >= 0; id = G->pages[id].lru_next)
        if (!G->pages[id].pinned) n++;
    if (n < need)
        goto full;
    if (!c->policy) {
        for (int32_t id = G->lru_head; id >= 0 && need > 0;) {
            int32_t next = G->pages[id].lru_next;
            if (!G->pages[id].pinned) evict(c, g, id), need--;
            id = next;
        }
        return KV_OK;
    }
    kv_evict_candidate *cands = malloc((size_t)n * sizeof *cands);
    int32_t *chosen = malloc((size_t)n * sizeof *chosen);
    if (!cands || !chosen) {
        free(cands);
        free(chosen);
        return kv_fail(e, KV_ERR_NOMEM, "cache: out of memory");
    }
    int k = 0;
    for (int32_t id = G->lru_head; id >= 0; id = G->pages[id].lru_next) {
        const kv_page *p = &G->pages[id];
        if (p->pinned) continue;
        cands[k++] = (kv_evict_candidate){id, g, ((int64_t)p->lp + 1) * c->pt, p->hits, p->last_use, G->page_bytes};
    }
    int n_chosen = 0;
    c->in_policy++; /* the pool takes, pins and evicts nothing until it returns */
    kv_status st = c->policy(c->policy_ud, cands, n, need, chosen, &n_chosen, e);
    c->in_policy--;
    if (st == KV_OK && (n_chosen < 0 || n_chosen > n))
        st = kv_fail(e, KV_ERR_ARG, "cache policy: returned %d pages of %d candidates", n_chosen, n);
    if (st == KV_OK) {
        /* every id a candidate, once, and still one now: the policy's code
         * may have released pages (a session closed meanwhile), never taken */
        for (int i = 0; i < n_chosen && st == KV_OK; i++) {
            int32_t id = chosen[i];
            bool ok = false;
            for (int j = 0; j < n && !ok; j++) ok = cands[j].id == id;
            ok = ok && id >= 0 && id < G->n_pages && G->pages[id].state == KV_PAGE_SEALED &&
                 G->pages[id].ref == 0 && !G->pages[id].pinned;
            for (int j = 0; ok && j < i; j++) ok = chosen[j] != id;
            if (!ok) st = kv_fail(e, KV_ERR_ARG, "cache policy: returned page %d, which is not a candidate (or twice)", (int)id);
        }
        if (st == KV_OK && n_chosen < need) {
            st = kv_fail(e, KV_ERR_CACHE_FULL, "cache full: the policy evicted %d of the %d pages needed (%d candidates)",
                         n_chosen, need, n);
        }
        if (st == KV_OK)
            for (int i = 0; i < n_chosen; i++) evict(c, g, chosen[i]);
    }
    free(cands);
    free(chosen);
    return st;
full:;
    int64_t pinned = 0;
    for (int32_t id = G->lru_head; id >= 0; id = G->pages[id].lru_next) pinned += G->pages[id].pinned;
    return kv_fail(e, KV_ERR_CACHE_FULL,
                   "cache full: %d more pages needed, %lld free, %d evictable; %d pages in use by sessions, "
                   "%lld pinned (capacity %llu bytes, %zu bytes a page)",
                   need - n, (long long)group_room(c, g), n, (int)G->n_used, (long long)pinned,
                   (unsigned long long)c->capacity_bytes, G->page_bytes);
}

static int evictable(const kv_cache *c, int g) {
    int n = 0;
    for (int32_t id = c->groups[g].lru_head; id >= 0; id = c->groups[g].pages[id].lru_next) n += !c->groups[g].pages[id].pinned;
    return n;
}

kv_status kv_pool_busy(const kv_cache *c, const struct kv_kvcache *kv, const char *what, kv_error *e) {
    if (c && c->in_policy) return kv_fail(e, KV_ERR_ARG, "%s: cache busy: its eviction policy is running", what);
    if (kv && kv->busy)
        return kv_fail(e, KV_ERR_ARG, "%s: session busy: an evaluation of it is waiting on an eviction policy", what);
    return KV_OK;
}

kv_status kv_pool_reserve(kv_cache *c, const int need[KV_MAX_GROUPS], kv_error *e) {
    kv_status busy = kv_pool_busy(c, NULL, "cache", e);
    if (busy) return busy;
    for (int g = 0; g < c->n_groups; g++) {
        if (need[g] <= 0) continue;
        kv_group *G = &c->groups[g];
        int64_t room = group_room(c, g);
        if (room >= need[g]) continue;
        if (c->is_private) {
            /* evict own cached pages past what the context needs, else grow */
            int ev = need[g] - (int)room;
            if (ev <= evictable(c, g) && make_room(c, g, ev, e) == KV_OK) continue;
            while (group_room(c, g) < need[g]) {
                kv_status st = pool_grow(c, g, "session", e);
                if (st) return st;
            }
            continue;
        }
        /* the group's own cached pages first (they free a slot and budget),
         * then other groups' (budget), each through the policy */
        int own = evictable(c, g), want = need[g] - (int)room;
        kv_status st = KV_OK;
        if (own > 0) st = make_room(c, g, want < own ? want : own, e);
        for (int h = 0; st == KV_OK && group_room(c, g) < need[g] && h < c->n_groups; h++) {
            if (h == g || evictable(c, h) == 0) continue;
            uint64_t deficit = (uint64_t)(need[g] - group_room(c, g)) * G->page_bytes;
            uint64_t k = (deficit + c->groups[h].page_bytes - 1) / c->groups[h].page_bytes;
            int avail = evictable(c, h);
            st = make_room(c, h, k < (uint64_t)avail ? (int)k : avail, e);
        }
        if (st) return st;
        if (group_room(c, g) < need[g]) return make_room(c, g, need[g] - (int)group_room(c, g) + evictable(c, g), e);
    }
    return KV_OK;
}

/* A free page of group g (there is one), OWNED by one reference. */
static int32_t take_one(kv_cache *c, kv_group *G) {
    int32_t id = free_pop(G);
    kv_page *p = &G->pages[id];
    p->state = KV_PAGE_OWNED;
    p->ref = 1;
    p->lp = -1;
    p->tnode = -1;
    p->lru_prev = p->lru_next = -1;
    p->last_use = ++c->tick;
    G->n_used++;
    return id;
}

kv_status kv_pool_take(kv_cache *c, int g, int n, int32_t *ids, kv_error *e) {
    int need[KV_MAX_GROUPS] = {0};
    need[g] = n;
    kv_status st = kv_pool_reserve(c, need, e);
    if (st) return st;
    for (int i = 0; i < n; i++) ids[i] = take_one(c, &c->groups[g]);
    return KV_OK;
}

kv_status kv_pool_take_free(kv_cache *c, int g, int32_t *id, kv_error *e) {
    kv_group *G = &c->groups[g];
    kv_status busy = kv_pool_busy(c, NULL, "cache", e);
    if (busy) return busy;
    if (group_room(c, g) < 1)
        return kv_fail(e, KV_ERR_CACHE_FULL, "cache full: no free page left in layer group %d (%d in use by sessions, "
                       "%d cached; capacity %llu bytes)", g, (int)G->n_used, (int)G->n_cached,
                       (unsigned long long)c->capacity_bytes);
    *id = take_one(c, G);
    return KV_OK;
}

int32_t kv_pool_find(const kv_cache *c, int g, const kv_hash *h) {
    const kv_group *G = &c->groups[g];
    const int32_t *v = hmap_get(&G->index, hkey(h));
    if (!v || memcmp(G->pages[*v].hash.b, h->b, KV_HASH_BYTES) != 0) return -1;
    return *v;
}

bool kv_pool_was_evicted(const kv_cache *c, int g, const kv_hash *h) {
    return hmap_get(&c->groups[g].evicted, hkey(h)) != NULL;
}

int32_t kv_pool_seal_node(kv_cache *c, int g, int32_t id, int32_t lp, const kv_hash *h, int32_t tnode) {
    kv_group *G = &c->groups[g];
    int32_t have = kv_pool_find(c, g, h);
    if (have >= 0) return have;
    if (hmap_get(&G->index, hkey(h))) return id; /* 64-bit key collision: keep it private */
    if (!hmap_put(&G->index, hkey(h), id)) return id; /* out of memory: stays unsealed */
    kv_page *p = &G->pages[id];
    p->state = KV_PAGE_SEALED;
    p->lp = lp;
    p->hash = *h;
    p->pinned = hmap_get(&c->pins, hkey(h)) != NULL;
    p->tnode = tnode;
    if (tnode >= 0) c->tnodes[tnode].refs++;
    hmap_del(&G->evicted, hkey(h));
    return id;
}

int32_t kv_pool_seal(kv_cache *c, int g, int32_t id, int32_t lp, const kv_hash *chain, const int32_t *tokens) {
    const kv_hash *h = &chain[lp];
    int32_t have = kv_pool_find(c, g, h);
    if (have >= 0) return have;
    /* the token node: below the deepest node the chain already has */
    int j = lp;
    int32_t n = -1;
    while (j >= 0 && (n = kv_pool_tnode_find(c, &chain[j])) < 0) j--;
    for (j++; j <= lp; j++) {
        int32_t k = kv_pool_tnode_add(c, &chain[j], n, tokens + (size_t)j * c->pt, j);
        if (k < 0) {
            kv_pool_tnode_trim(c, n);
            n = -1;
            break;
        }
        n = k;
    }
    int32_t r = kv_pool_seal_node(c, g, id, lp, h, n);
    if (n >= 0) kv_pool_tnode_trim(c, n); /* not sealed after all: the new nodes go */
    return r;
}

/* ==== token nodes ================================================================ */

int32_t kv_pool_tnode_find(const kv_cache *c, const kv_hash *h) {
    const int32_t *v = hmap_get(&c->tnode_index, hkey(h));
    if (!v || memcmp(c->tnodes[*v].hash.b, h->b, KV_HASH_BYTES) != 0) return -1;
    return *v;
}

int32_t kv_pool_tnode_add(kv_cache *c, const kv_hash *h, int32_t parent, const int32_t *ids, int32_t depth) {
    if ((parent < 0) != (depth == 0) || hmap_get(&c->tnode_index, hkey(h))) return -1;
    int32_t n = c->tnode_free;
    if (n < 0) {
        if (c->n_tnodes == c->cap_tnodes) {
            if (c->cap_tnodes > INT32_MAX / 4) return -1;
            int32_t cap = c->cap_tnodes ? c->cap_tnodes * 2 : 64;
            kv_tnode *t = realloc(c->tnodes, (size_t)cap * sizeof *t);
            if (!t) return -1;
            c->tnodes = t;
            int32_t *ti = realloc(c->tnode_ids, (size_t)cap * (size_t)c->pt * sizeof *ti);
            if (!ti) return -1;
            c->tnode_ids = ti;
            c->cap_tnodes = cap;
        }
        n = c->n_tnodes;
        if (!hmap_put(&c->tnode_index, hkey(h), n)) return -1;
        c->n_tnodes++;
    } else {
        if (!hmap_put(&c->tnode_index, hkey(h), n)) return -1;
        c->tnode_free = c->tnodes[n].parent;
    }
    c->tnodes[n] = (kv_tnode){*h, parent, 0, depth};
    memcpy(c->tnode_ids + (size_t)n * c->pt, ids, (size_t)c->pt * sizeof *ids);
    if (parent >= 0) c->tnodes[parent].refs++;
    return n;
}

void kv_pool_tnode_trim(kv_cache *c, int32_t n) {
    while (n >= 0 && c->tnodes[n].refs == 0) {
        int32_t parent = c->tnodes[n].parent;
        hmap_del(&c->tnode_index, hkey(&c->tnodes[n].hash));
        c->tnodes[n].refs = -1;
        c->tnodes[n].parent = c->tnode_free;
        c->tnode_free = n;
        if (parent >= 0) c->tnodes[parent].refs--;
        n = parent;
    }
}

/* ==== public queries ============================================================= */

void kv_cache_get_stats(const kv_cache *c, kv_cache_stats *st) {
    memset(st, 0, sizeof *st);
    for (int g = 0; g < c->n_groups; g++) {
        const kv_group *G = &c->groups[g];
        int64_t cap = c->is_private ? G->n_pages : (int64_t)(c->capacity_bytes / G->page_bytes);
        st->pages += cap;
        st->used += G->n_used;
        st->cached += G->n_cached;
        for (int32_t id = G->lru_head; id >= 0; id = G->pages[id].lru_next) st->pinned += G->pages[id].pinned;
        st->bytes += (uint64_t)(G->n_used + G->n_cached) * G->page_bytes;
    }
    st->free = st->pages - st->used - st->cached;
    if (st->free < 0) st->free = 0;
    st->hits = c->hits;
    st->misses = c->misses;
    st->reused_tokens = c->reused_tokens;
    st->evictions = c->evictions;
    st->capacity_bytes = c->capacity_bytes;
}

int kv_cache_page_tokens(const kv_cache *c) { return c->pt; }
int kv_cache_n_groups(const kv_cache *c) { return c->n_groups; }
int kv_cache_group_window(const kv_cache *c, int g) { return g >= 0 && g < c->n_groups ? c->groups[g].window : 0; }
void kv_cache_types(const kv_cache *c, int il, int *kt, int *vt) {
    if (il < 0 || il >= c->n_layer) il = 0;
    *kt = c->ktypes[il], *vt = c->vtypes[il];
}

uint64_t kv_cache_bytes_per_token(const kv_cache *c) {
    uint64_t b = 0;
    for (int il = 0; il < c->n_layer; il++) b += (uint64_t)c->n_kv * (c->krows[il] + c->vrows[il]);
    return b;
}
const kv_model *kv_cache_model(const kv_cache *c) { return c->m; }

void kv_cache_set_policy(kv_cache *c, kv_evict_fn fn, void *ud) {
    c->policy = fn;
    c->policy_ud = ud;
}

int64_t kv_cache_clear(kv_cache *c) {
    int64_t n = 0;
    if (c->in_policy) return 0; /* evicts nothing under the policy (kv_pool_busy) */
    for (int g = 0; g < c->n_groups; g++) {
        kv_group *G = &c->groups[g];
        for (int32_t id = G->lru_head; id >= 0;) {
            int32_t next = G->pages[id].lru_next;
            if (!G->pages[id].pinned) evict(c, g, id), n++;
            id = next;
        }
    }
    return n;
}

kv_status kv_cache_pin(kv_cache *c, const int32_t *ids, size_t n, bool pin, kv_error *e) {
    kv_status busy = kv_pool_busy(c, NULL, pin ? "pin" : "unpin", e);
    if (busy) return busy;
    if (!c->prefix) return kv_fail(e, KV_ERR_ARG, "cache: pin needs a cache with prefix = true");
    const size_t np = n / (size_t)c->pt;
    if (pin) {
        /* every group must be able to hold the pinned pages, with room to spare for one page */
        for (int g = 0; g < c->n_groups; g++) {
            const kv_group *G = &c->groups[g];
            int64_t cap = c->is_private ? INT64_MAX : (int64_t)(c->capacity_bytes / G->page_bytes);
            int64_t pinned_now = (int64_t)c->pins.n;
            if ((int64_t)np + pinned_now >= cap)
                return kv_fail(e, KV_ERR_CACHE_FULL,
                               "cache: cannot pin %zu pages (%lld already pinned) in a cache of %lld pages",
                               np, (long long)pinned_now, (long long)cap);
        }
    }
    kv_hash h = c->h0;
    for (size_t i = 0; i < np; i++) {
        kv_chain_hash(&h, ids + i * (size_t)c->pt, c->pt, &h);
        uint64_t k = hkey(&h);
        int32_t *cnt = hmap_get(&c->pins, k);
        if (pin) {
            if (cnt) (*cnt)++;
            else if (!hmap_put(&c->pins, k, 1)) {
                kv_cache_pin(c, ids, i * (size_t)c->pt, false, NULL); /* the pages before, as they were */
                return kv_fail(e, KV_ERR_NOMEM, "cache: out of memory");
            }
        } else if (cnt && --*cnt == 0) {
            hmap_del(&c->pins, k);
        }
        bool now = hmap_get(&c->pins, k) != NULL;
        for (int g = 0; g < c->n_groups; g++) {
            int32_t id = kv_pool_find(c, g, &h);
            if (id >= 0) c->groups[g].pages[id].pinned = now;
        }
    }
    return KV_OK;
}
