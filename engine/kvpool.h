/*
 * kvpool.h — the KV page pool and its prefix index (internal to the engine;
 * the public face is kv_cache in kvlua.h).
 *
 * A cache holds pages. A page is K and V of `pt` consecutive positions for
 * every layer of one LAYER GROUP (layers that share an attention span: the
 * full-attention layers form one group, each sliding-window size another),
 * all KV heads. Page ids are per group. Storage of a group is a list of
 * slabs of S pages each; inside a slab, layer li of the group, head h,
 * page slot i, token t is the row
 *     K: slab + koff[li] + ((h * S + i) * pt + t) * krow
 *     V: slab + voff[li] + ((h * S + i) * pt + t) * vrow
 * so pages taken in order are contiguous per (layer, head): a session that
 * fills a fresh pool reads its K/V as one linear run, as the contiguous
 * cache did (kv_kv_span reports runs of consecutive page ids).
 *
 * Page states: FREE (on the free list), OWNED (referenced, not yet full or
 * not hashed: writable by its single owner), SEALED (full and registered in
 * the prefix index under its chain hash: immutable, shareable). A SEALED
 * page with no references is "cached": evictable unless pinned. Writing into
 * a page that is SEALED or referenced twice copies it first (copy-on-write).
 *
 * Chain hashes: h_0 = BLAKE2b(model fingerprint, K/V types, pt), and
 * h_i = BLAKE2b(h_{i-1} || token ids of page i as int32 LE). A page is found
 * again by the hash of the whole prefix it ends.
 *
 * Token nodes: the cache keeps the token ids behind the hashes of its
 * sealed pages, one node per chain hash (shared by the groups): the page's
 * ids and the node of the page before it. A node lives while a sealed page
 * has its hash or a node names it as parent, so every sealed page's whole
 * prefix can be spelled out again (cache files, kvfile.c).
 */
#ifndef KV_KVPOOL_H
#define KV_KVPOOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_error.h"
#include "kvlua.h"

#define KV_MAX_GROUPS 4
#define KV_HASH_BYTES 32

typedef struct { uint8_t b[KV_HASH_BYTES]; } kv_hash;

enum { KV_PAGE_FREE = 0, KV_PAGE_OWNED = 1, KV_PAGE_SEALED = 2 };

typedef struct {
    int32_t ref;        /* page-table entries (sessions) referencing it */
    uint8_t state;      /* KV_PAGE_* */
    bool pinned;        /* its hash is pinned: never evicted */
    int32_t lp;         /* logical page index (position / pt) it holds */
    uint32_t hits;      /* times reused from the index */
    uint64_t last_use;  /* cache tick of the last attach or release */
    int32_t lru_prev, lru_next; /* cached (SEALED, ref 0) pages, oldest first */
    kv_hash hash;       /* chain hash when SEALED */
    int32_t tnode;      /* SEALED: its token node, or -1 (none could be kept) */
} kv_page;

typedef struct {
    kv_hash hash;       /* the chain hash of the page it spells */
    int32_t parent;     /* the node of the page before, -1 for page 0; free list link when free */
    int32_t refs;       /* sealed pages with this hash + child nodes; -1: free */
    int32_t depth;      /* logical page index */
} kv_tnode;

/* 64-bit key -> int32 value, open addressing (the prefix index, pins,
 * the record of evicted hashes). */
typedef struct {
    uint64_t *keys; /* 0: empty, 1: tombstone (real keys are forced >= 2) */
    int32_t *vals;
    size_t cap, n, used;
} kv_hmap;

typedef struct {
    int window;         /* 0: full attention */
    int n_layers;       /* layers in the group */
    int *layer_ids;     /* (n_layers) the model's index of each */
    size_t page_bytes;  /* K+V of one page, all layers of the group */
    size_t *koff, *voff; /* (n_layers) byte offsets inside a slab */
    int32_t slab_pages; /* S */
    int32_t max_pages;  /* capacity (INT32_MAX: grows on demand) */
    int32_t n_pages;    /* pages with storage (slabs * S) */
    uint8_t **slabs;
    int32_t n_slabs, cap_slabs;
    kv_page *pages;     /* (n_pages) */
    int32_t free_head;  /* free list through lru_next */
    int32_t n_free;
    int32_t n_used;     /* referenced pages */
    int32_t n_cached;   /* sealed, unreferenced */
    int32_t lru_head, lru_tail;
    kv_hmap index;      /* hash -> page id (SEALED pages) */
    kv_hmap evicted;    /* hashes evicted (bounded record, for lookup reasons) */
} kv_group;

struct kv_cache {
    kv_model *m;         /* NULL: a bare pool (kernel tests) */
    int n_layer;
    int refs;            /* owner + sessions */
    bool is_private;     /* a session's own pool: grows, never reports full */
    bool prefix;         /* hash full pages, reuse them */
    int pt, pt_log2;
    int n_kv, head_dim, head_dim_v;
    int *ktypes, *vtypes;  /* (n_layer) K and V storage type of each layer */
    size_t *krows, *vrows; /* (n_layer) bytes of one K / V row */
    bool mixed;            /* the layers do not all have the same types */
    int n_groups;
    kv_group groups[KV_MAX_GROUPS];
    int *layer_group, *layer_index; /* (n_layer) */
    uint64_t capacity_bytes; /* 0 for private pools (unbounded) */
    uint64_t tick;
    kv_hash h0;
    kv_hmap pins;        /* hash -> pin count */
    kv_tnode *tnodes;    /* token nodes (cap_tnodes), their ids in tnode_ids (pt each) */
    int32_t *tnode_ids;
    int32_t n_tnodes, cap_tnodes, tnode_free;
    kv_hmap tnode_index; /* hash -> node */
    kv_evict_fn policy;
    void *policy_ud;
    int in_policy;       /* the policy is running: the pool takes, pins and evicts nothing
                            (kv_pool_busy); only releases (a session closed meanwhile) */
    kv_cache *next_of_model; /* the model's list of caches (lookup "other types") */
    /* counters */
    uint64_t hits, misses, reused_tokens, evictions;
    /* a device backend's copy of the pages (backend.h pages_grow), or NULL */
    void *dev;
    void (*dev_free)(void *dev);
};

/* ---- page tables (a session's view, kvcache.c) ---- */
struct kv_kvcache {
    kv_cache *pool;
    int n_ctx, n_lp;    /* positions, logical pages */
    int32_t *tab[KV_MAX_GROUPS]; /* (n_lp) page id per logical page, -1: none */
    int busy;           /* an evaluation through these tables is in progress (it may be
                           waiting on an eviction policy): nothing may change them */
    /* a device backend's copy of the tables, or NULL */
    void *dev;
    void (*dev_free)(void *dev);
};

/* ---- pool ---- */
kv_status kv_pool_open(kv_model *m, const kv_cache_params *p, int private_ctx, kv_cache **out,
                       kv_error *e);
/* A private pool for layers of a given shape and no model (no fingerprint:
 * for kernel tests that need pages without a model file). */
typedef struct {
    int n_layer, n_kv, head_dim, head_dim_v;
    const int *windows; /* (n_layer) attention window per layer, or NULL: all full */
} kv_pool_shape;
kv_status kv_pool_open_bare(const kv_pool_shape *sh, const kv_cache_params *p, int private_ctx, kv_cache **out,
                            kv_error *e);
void kv_cache_retain(kv_cache *c);

/* Re-entry: an eviction policy is user code called in the middle of an
 * evaluation. While it runs, nothing it does may change the evaluation that
 * asked: the pool refuses to take, evict or pin pages, and the sessions of
 * the evaluation (tables marked busy) refuse every change. Returns KV_OK,
 * or KV_ERR_ARG naming what is busy (what: the operation, for the message);
 * kv may be NULL. */
kv_status kv_pool_busy(const kv_cache *c, const struct kv_kvcache *kv, const char *what, kv_error *e);

/* Takes n new OWNED pages of group g (referenced once), evicting cached
 * pages (through the policy if any) when the pool is full. All or nothing. */
kv_status kv_pool_take(kv_cache *c, int g, int n, int32_t *ids, kv_error *e);
/* Makes room for need[g] more pages in each group (evicting as needed)
 * without taking them: a later kv_pool_take of that many cannot fail. */
kv_status kv_pool_reserve(kv_cache *c, const int need[KV_MAX_GROUPS], kv_error *e);
void kv_pool_ref(kv_cache *c, int g, int32_t id);
void kv_pool_unref(kv_cache *c, int g, int32_t id);
/* Bytes of one K (v false) or V row of the model's layer il. */
static inline size_t kv_pool_row_bytes(const kv_cache *c, int il, bool v) { return v ? c->vrows[il] : c->krows[il]; }
/* Copies the K/V rows of page src into page dst (both of group g). */
void kv_pool_copy(kv_cache *c, int g, int32_t dst, int32_t src);
/* Seals an OWNED full page under hash chain[lp] (logical page lp; chain
 * and tokens: the hashes of pages 0..lp and their ids, for its token node).
 * If a page with that hash is already sealed, returns that page's id (the
 * caller switches to it) and leaves id as it was; else returns id. */
int32_t kv_pool_seal(kv_cache *c, int g, int32_t id, int32_t lp, const kv_hash *chain, const int32_t *tokens);
/* The same with the token node given (-1: none; kv_pool_tnode_add). */
int32_t kv_pool_seal_node(kv_cache *c, int g, int32_t id, int32_t lp, const kv_hash *h, int32_t tnode);
/* Token nodes: the node of hash h, or -1; a new node (no references yet:
 * seal a page with it, or kv_pool_tnode_trim it) for hash h, page ids
 * `ids` (pt of them) after node parent (-1 exactly when depth is 0), or -1
 * (no memory, or a 64-bit key collision); trim frees node n and then its
 * ancestors while nothing refers to them. */
int32_t kv_pool_tnode_find(const kv_cache *c, const kv_hash *h);
int32_t kv_pool_tnode_add(kv_cache *c, const kv_hash *h, int32_t parent, const int32_t *ids, int32_t depth);
void kv_pool_tnode_trim(kv_cache *c, int32_t n);
static inline const int32_t *kv_pool_tnode_ids(const kv_cache *c, int32_t n) {
    return c->tnode_ids + (size_t)n * (size_t)c->pt;
}
/* Takes one OWNED page of group g only if there is room without evicting
 * (else "cache full"). */
kv_status kv_pool_take_free(kv_cache *c, int g, int32_t *id, kv_error *e);
/* The sealed page of group g for hash h, or -1. */
int32_t kv_pool_find(const kv_cache *c, int g, const kv_hash *h);
bool kv_pool_was_evicted(const kv_cache *c, int g, const kv_hash *h);
uint8_t *kv_pool_row(const kv_cache *c, int g, int32_t id, int li, int head, int t, bool v);
/* Consecutive slots after page id inside its slab (id itself counts). */
int32_t kv_pool_slab_room(const kv_cache *c, int g, int32_t id);

/* Chain hash step: out = H(prev || ids[0..pt)). */
void kv_chain_hash(const kv_hash *prev, const int32_t *ids, int n, kv_hash *out);

/* ---- model side (model.c) ---- */
/* The model file's fingerprint (BLAKE2b of all its bytes), computed once. */
kv_status kv_model_fingerprint(kv_model *m, uint8_t out[32], double *seconds, kv_error *e);
/* Attention span of layer il (0: full). */
int kv_model_layer_window(const kv_model *m, int il);
kv_cache **kv_model_caches(kv_model *m); /* head of the model's cache list */

#endif
