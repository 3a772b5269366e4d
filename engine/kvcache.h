/*
 * kvcache.h — K/V storage for one session, and the single accessor that
 * attention reads it through.
 *
 * Layout (contiguous now; a page table can replace it later without
 * touching attention, because attention only ever calls kv_kv_span):
 *   K of layer l, head h:  (n_ctx, head_dim)   rows of kv_row_size(ktype, head_dim) bytes
 *   V of layer l, head h:  (n_ctx, head_dim_v) rows of kv_row_size(vtype, head_dim_v) bytes
 * i.e. per layer (n_head_kv, n_ctx, head_dim): all positions of one head are
 * contiguous, so a query head group streams its K and V rows linearly.
 * K and V types: F16 (default), F32, or Q8_0 (blocks of 32 int8 with an f16
 * scale, 8.5 bits per value; head sizes multiple of 32).
 */
#ifndef KV_KVCACHE_H
#define KV_KVCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_error.h"

typedef struct kv_kvcache kv_kvcache;

kv_status kv_kvcache_create(int n_layer, int n_head_kv, int head_dim, int head_dim_v, int n_ctx,
                            int ktype, int vtype, kv_kvcache **out, kv_error *e);
void kv_kvcache_free(kv_kvcache *c); /* NULL is fine */

int kv_kvcache_ktype(const kv_kvcache *c);
int kv_kvcache_vtype(const kv_kvcache *c);
int kv_kvcache_n_ctx(const kv_kvcache *c);
int kv_kvcache_n_head_kv(const kv_kvcache *c);
int kv_kvcache_head_dim(const kv_kvcache *c, bool v); /* K (v false) or V head size */
uint64_t kv_kvcache_bytes(const kv_kvcache *c);
/* Bytes of one stored K (or V) row. */
size_t kv_kvcache_row_bytes(const kv_kvcache *c, bool v);

/* THE accessor: a pointer to the K (v = false) or V (v = true) row of
 * position pos0 for (layer, kv_head), and in *n_contig how many positions
 * from pos0 on are stored contiguously after it (rows of
 * kv_kvcache_row_bytes each). Contiguous buffer: the rest of the context;
 * pages: up to the page end. Callers loop until they have their range. */
const void *kv_kv_span(const kv_kvcache *c, int layer, int kv_head, int pos0, int *n_contig, bool v);
/* Writable twin of kv_kv_span, for storing new rows. */
void *kv_kv_span_mut(kv_kvcache *c, int layer, int kv_head, int pos0, int *n_contig, bool v);

#endif
