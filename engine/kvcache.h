/*
 * kvcache.h — a session's view of its K/V: page tables into a page pool
 * (kvpool.h), and the single accessor that attention reads K/V through.
 *
 * Positions are grouped in pages of pt tokens; each layer group (full
 * attention, or one sliding-window size) has its own page table
 * tab[g][pos / pt] -> page id. Inside a page, a (layer, head) holds pt
 * consecutive rows of kv_kvcache_row_bytes: K rows of head_dim values and
 * V rows of head_dim_v values, stored as F16 (default), F32 or Q8_0 (blocks
 * of 32 int8 with an f16 scale, 8.5 bits per value). Pages taken in order
 * from a fresh pool are adjacent in memory, and kv_kv_span reports such a
 * run as one span, so a session reads its K/V linearly as before.
 */
#ifndef KV_KVCACHE_H
#define KV_KVCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_error.h"

typedef struct kv_kvcache kv_kvcache;
typedef struct kv_cache kv_cache;

/* Empty page tables for n_ctx positions over pool (which the view
 * retains); kv_kvcache_free releases every page it references. */
kv_status kv_kvcache_create(kv_cache *pool, int n_ctx, kv_kvcache **out, kv_error *e);
void kv_kvcache_free(kv_kvcache *c); /* NULL is fine */
/* Tables over a pool of their own for layers of this shape (all full
 * attention, no model), with every page of n_ctx positions present: for
 * kernel tests. */
kv_status kv_kvcache_create_bare(int n_layer, int n_kv, int head_dim, int head_dim_v, int n_ctx, int ktype,
                                 int vtype, int page_tokens, kv_kvcache **out, kv_error *e);

/* K and V storage types of a layer (they may differ per layer). */
int kv_kvcache_ktype(const kv_kvcache *c, int layer);
int kv_kvcache_vtype(const kv_kvcache *c, int layer);
int kv_kvcache_n_ctx(const kv_kvcache *c);
int kv_kvcache_n_head_kv(const kv_kvcache *c);
int kv_kvcache_head_dim(const kv_kvcache *c, bool v); /* K (v false) or V head size */
/* Bytes of the pages the view references. */
uint64_t kv_kvcache_bytes(const kv_kvcache *c);
/* Bytes of one stored K (or V) row of a layer. */
size_t kv_kvcache_row_bytes(const kv_kvcache *c, int layer, bool v);

/* THE accessor: a pointer to the K (v = false) or V (v = true) row of
 * position pos0 for (layer, kv_head), and in *n_contig how many positions
 * from pos0 on are stored contiguously after it (rows of
 * kv_kvcache_row_bytes each): up to the end of the run of adjacent pages.
 * Callers loop until they have their range. The page of pos0 must be
 * present (attention reads only positions the session holds). */
const void *kv_kv_span(const kv_kvcache *c, int layer, int kv_head, int pos0, int *n_contig, bool v);
/* Writable twin of kv_kv_span, for storing new rows (the session made the
 * page writable before the forward pass). */
void *kv_kv_span_mut(kv_kvcache *c, int layer, int kv_head, int pos0, int *n_contig, bool v);

#endif
