/*
 * session.c — sessions: one token sequence over a model, its page tables
 * into a cache, prefix reuse, forks, and evaluation in chunks.
 *
 * A session owns the scratch one forward pass needs (KV_CHUNK tokens at a
 * time), so evaluation allocates nothing but pages. kv_session_eval:
 *   1. validates (ids, context room);
 *   2. reuses: the longest run of cached pages the sequence continues with
 *      is attached instead of computed (kv_cache_lookup plans the same);
 *   3. repairs: pages the next position needs but the session no longer
 *      holds (dropped window pages after a rewind) are found by hash, or
 *      recomputed from the last position where everything is at hand;
 *   4. per chunk: makes the pages it writes writable (new pages, or copies
 *      of shared / sealed ones — the only place eviction and the user's
 *      policy run), runs the forward pass, checks for NaN/Inf, seals the
 *      pages that became full under their chain hash, and drops window
 *      pages no later token can see.
 * Any failure puts pos back where it was and releases the pages past it;
 * what the session held before is untouched (a full page it replaced is
 * still in the cache, and a later eval finds or recomputes what it needs).
 */
#include "model_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "types.h"

/* ==== open, fork, close ======================================================= */

kv_status kv_session_alloc(kv_model *m, int n_ctx, kv_cache *pool, kv_session **out, kv_error *e) {
    const kv_model_info *in = &m->info;
    kv_backend *be = &m->be;
    kv_status busy = kv_pool_busy(pool, NULL, "session", e); /* not from inside its policy */
    if (busy) return busy;
    kv_session *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(e, KV_ERR_NOMEM, "session: out of memory");
    s->m = m;
    s->n_ctx = n_ctx;
    kv_status st = kv_kvcache_create(pool, n_ctx, &s->kv, e);
    if (st) {
        free(s);
        return st;
    }
    const size_t C = KV_CHUNK;
    s->tokens = malloc((size_t)n_ctx * sizeof *s->tokens);
    s->chain = malloc((size_t)s->kv->n_lp * sizeof *s->chain);
    s->pos_buf = malloc(C * sizeof *s->pos_buf);
    s->x = be->alloc(be, C * in->n_embd);
    s->xb = be->alloc(be, C * in->n_embd);
    s->q = be->alloc(be, C * in->n_head * in->head_dim);
    s->k = be->alloc(be, C * in->n_head_kv * in->head_dim);
    s->v = be->alloc(be, C * in->n_head_kv * in->head_dim_v);
    s->att = be->alloc(be, C * in->n_head * in->head_dim_v);
    s->gate = be->alloc(be, C * in->n_ff);
    s->up = be->alloc(be, C * in->n_ff);
    /* attention scratch: the largest over chunk lengths (decode splits keys) */
    size_t aw = 0;
    kv_attn_params ap = {0, in->n_head, in->n_head_kv, in->head_dim, in->head_dim_v, 1.0f, 0, 0.0f};
    for (int64_t T = 1; T <= (int64_t)C; T++) {
        size_t a = be->attn_scratch(be, &ap, T);
        if (a > aw) aw = a;
    }
    s->awork = be->alloc(be, aw);
    /* matmul scratch: the largest over every weight at a full chunk */
    size_t ms = be->matmul_scratch(be, &m->output, C);
    for (int il = 0; il < in->n_layer; il++) {
        const kv_layer *L = &m->layers[il];
        const kv_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) {
            size_t a = be->matmul_scratch(be, ws[i], C);
            if (a > ms) ms = a;
        }
    }
    s->mm_scratch_size = ms;
    if (posix_memalign(&s->mm_scratch, 64, ms ? ms : 64) != 0) s->mm_scratch = NULL;
    if (!s->tokens || !s->chain || !s->pos_buf || !s->x || !s->xb || !s->q || !s->k || !s->v || !s->att ||
        !s->gate || !s->up || !s->awork || !s->mm_scratch) {
        kv_session_close(s);
        return kv_fail(e, KV_ERR_NOMEM, "session: out of memory for %d tokens", n_ctx);
    }
    *out = s;
    return KV_OK;
}

kv_status kv_session_open_p(kv_model *m, const kv_session_params *p, kv_session **out, kv_error *e) {
    if (!out) return kv_fail(e, KV_ERR_ARG, "session: out is NULL");
    *out = NULL;
    if (!m || !p) return kv_fail(e, KV_ERR_ARG, "session: model or params is NULL");
    if (!m->info.has_weights)
        return kv_fail(e, KV_ERR_ARG, "session: the model has no weights (vocabulary-only file)");
    if (p->n_ctx <= 0) return kv_fail(e, KV_ERR_ARG, "session: n_ctx must be positive (got %d)", p->n_ctx);
    kv_cache *pool = p->cache;
    kv_status st;
    if (pool) {
        if (pool->m != m) return kv_fail(e, KV_ERR_ARG, "session: the cache belongs to another model");
        return kv_session_alloc(m, p->n_ctx, pool, out, e);
    }
    kv_cache_params cp = {.page_tokens = 16, .ktype = p->ktype, .vtype = p->vtype, .ktypes = p->ktypes,
                          .vtypes = p->vtypes, .prefix = true};
    if ((st = kv_pool_open(m, &cp, p->n_ctx, &pool, e))) return st;
    st = kv_session_alloc(m, p->n_ctx, pool, out, e);
    kv_cache_close(pool); /* the session's view holds it now */
    return st;
}

kv_status kv_session_open_ex(kv_model *m, int n_ctx, int ktype, int vtype, kv_session **out, kv_error *e) {
    kv_session_params p = {.n_ctx = n_ctx, .ktype = ktype, .vtype = vtype};
    return kv_session_open_p(m, &p, out, e);
}

kv_status kv_session_open(kv_model *m, int n_ctx, kv_session **out, kv_error *e) {
    return kv_session_open_ex(m, n_ctx, KV_TYPE_F16, KV_TYPE_F16, out, e);
}

kv_status kv_session_fork(kv_session *s, kv_session **out, kv_error *e) {
    if (!out) return kv_fail(e, KV_ERR_ARG, "fork: out is NULL");
    *out = NULL;
    if (!s) return kv_fail(e, KV_ERR_ARG, "fork: session is NULL");
    kv_status busy = kv_pool_busy(s->kv->pool, s->kv, "fork", e);
    if (busy) return busy;
    kv_session *f;
    kv_status st = kv_session_alloc(s->m, s->n_ctx, s->kv->pool, &f, e);
    if (st) return st;
    kv_cache *c = s->kv->pool;
    f->pos = s->pos;
    memcpy(f->tokens, s->tokens, (size_t)s->pos * sizeof *s->tokens);
    memcpy(f->chain, s->chain, (size_t)s->n_chain * sizeof *s->chain);
    f->n_chain = s->n_chain;
    f->holes = s->holes;
    f->shifted = s->shifted;
    memcpy(f->win_lo, s->win_lo, sizeof f->win_lo);
    for (int g = 0; g < c->n_groups; g++)
        for (int i = 0; i < s->kv->n_lp; i++) {
            int32_t id = s->kv->tab[g][i];
            f->kv->tab[g][i] = id;
            if (id >= 0) kv_pool_ref(c, g, id);
        }
    *out = f;
    return KV_OK;
}

void kv_session_close(kv_session *s) {
    if (!s) return;
    kv_backend *be = &s->m->be;
    float *bufs[] = {s->x, s->xb, s->q, s->k, s->v, s->att, s->gate, s->up, s->awork};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) be->free(be, bufs[i]);
    free(s->mm_scratch);
    free(s->pos_buf);
    free(s->tokens);
    free(s->chain);
    kv_kvcache_free(s->kv);
    free(s);
}

/* ==== page-table bookkeeping ================================================== */

static kv_cache *pool_of(const kv_session *s) { return s->kv->pool; }

static void set_page(kv_session *s, int g, int lp, int32_t id) {
    kv_cache *c = pool_of(s);
    int32_t *slot = &s->kv->tab[g][lp];
    if (id >= 0) kv_pool_ref(c, g, id);
    if (*slot >= 0) kv_pool_unref(c, g, *slot);
    *slot = id;
}

/* Releases every page from the first one wholly at or past position P. */
static void trim_from(kv_session *s, int P) {
    kv_cache *c = pool_of(s);
    int first = (P + c->pt - 1) >> c->pt_log2;
    for (int g = 0; g < c->n_groups; g++)
        for (int lp = first; lp < s->kv->n_lp; lp++)
            if (s->kv->tab[g][lp] >= 0) set_page(s, g, lp, -1);
    if (s->n_chain > P / c->pt) s->n_chain = P / c->pt;
}

/* First logical page a query at position pos still reads in group g. */
static int first_needed(const kv_cache *c, int g, int pos) {
    int w = c->groups[g].window;
    if (w <= 0 || pos - w + 1 <= 0) return 0;
    return (pos - w + 1) >> c->pt_log2;
}

/* Window groups: release pages no query from pos on can see. */
static void drop_window_pages(kv_session *s) {
    kv_cache *c = pool_of(s);
    for (int g = 0; g < c->n_groups; g++) {
        if (c->groups[g].window <= 0) continue;
        int lo = first_needed(c, g, s->pos);
        for (int lp = s->win_lo[g]; lp < lo; lp++)
            if (s->kv->tab[g][lp] >= 0) set_page(s, g, lp, -1);
        if (lo > s->win_lo[g]) s->win_lo[g] = lo;
    }
}

/* Chain hashes of the full pages up to pos; with prefix reuse on, seals
 * them (switching to an already sealed twin when there is one). */
static void seal_full_pages(kv_session *s) {
    kv_cache *c = pool_of(s);
    if (!c->prefix || s->shifted) return;
    for (int lp = s->n_chain; (lp + 1) * c->pt <= s->pos; lp++) {
        const kv_hash *prev = lp ? &s->chain[lp - 1] : &c->h0;
        kv_chain_hash(prev, s->tokens + (size_t)lp * c->pt, c->pt, &s->chain[lp]);
        s->n_chain = lp + 1;
        for (int g = 0; g < c->n_groups; g++) {
            int32_t id = s->kv->tab[g][lp];
            if (id < 0 || c->groups[g].pages[id].state != KV_PAGE_OWNED) continue;
            int32_t sealed = kv_pool_seal(c, g, id, lp, s->chain, s->tokens);
            if (sealed != id) set_page(s, g, lp, sealed);
        }
    }
}

/* Makes the pages holding positions [pos, pos + T) writable: absent ones
 * are taken, shared or sealed ones copied. Room for all of them is made
 * first (eviction, the policy), so this either fully succeeds or changes
 * nothing. */
static kv_status prepare_pages(kv_session *s, int pos, int T, kv_error *e) {
    kv_cache *c = pool_of(s);
    const int a = pos >> c->pt_log2, b = (pos + T - 1) >> c->pt_log2;
    int need[KV_MAX_GROUPS] = {0};
    for (int g = 0; g < c->n_groups; g++)
        for (int lp = a; lp <= b; lp++) {
            int32_t id = s->kv->tab[g][lp];
            if (id < 0 || c->groups[g].pages[id].state == KV_PAGE_SEALED || c->groups[g].pages[id].ref > 1) need[g]++;
        }
    kv_status st = kv_pool_reserve(c, need, e);
    if (st) return st;
    for (int g = 0; g < c->n_groups; g++)
        for (int lp = a; lp <= b && need[g]; lp++) {
            int32_t id = s->kv->tab[g][lp], fresh;
            if (id >= 0 && c->groups[g].pages[id].state != KV_PAGE_SEALED && c->groups[g].pages[id].ref == 1) continue;
            if ((st = kv_pool_take(c, g, 1, &fresh, e))) return st; /* cannot fail after the reserve */
            if (id >= 0) kv_pool_copy(c, g, fresh, id);
            c->groups[g].pages[fresh].lp = lp;
            set_page(s, g, lp, fresh);
            kv_pool_unref(c, g, fresh); /* set_page took its own reference */
        }
    return KV_OK;
}

/* ==== prefix reuse ============================================================= */

/* A plan: the sequence seq[0..) continues the session's first P positions
 * (own: its page tables, NULL for an empty one); found[g][j - j0] are the
 * sealed pages of the sequence's full pages j >= j0. */
typedef struct {
    kv_cache *c;
    const kv_kvcache *own;
    const kv_hash *own_chain; /* chain of own's full pages (n_own_chain) */
    int n_own_chain;
    int j0, n_full;           /* first page looked up, full pages of seq from j0 */
    kv_hash *hash;            /* (n_full) chain hashes of pages j0.. */
    int32_t *found[KV_MAX_GROUPS]; /* (n_full) sealed page or -1 */
    int kfull;                /* pages from j0 present in every full-attention group */
} reuse_plan;

static void plan_free(reuse_plan *r) {
    free(r->hash);
    for (int g = 0; g < KV_MAX_GROUPS; g++) free(r->found[g]);
}

/* Hashes and looks up the full pages of seq[0..len) from page j0. */
static kv_status plan_lookup(reuse_plan *r, const int32_t *seq, int64_t len, const kv_hash *prev, kv_error *e) {
    kv_cache *c = r->c;
    r->n_full = (int)(len >> c->pt_log2) - r->j0;
    if (r->n_full < 0) r->n_full = 0;
    size_t n = (size_t)(r->n_full ? r->n_full : 1);
    r->hash = malloc(n * sizeof *r->hash);
    for (int g = 0; g < c->n_groups; g++) r->found[g] = malloc(n * sizeof(int32_t));
    if (!r->hash) return kv_fail(e, KV_ERR_NOMEM, "cache: out of memory");
    for (int g = 0; g < c->n_groups; g++)
        if (!r->found[g]) return kv_fail(e, KV_ERR_NOMEM, "cache: out of memory");
    r->kfull = -1;
    for (int j = 0; j < r->n_full; j++) {
        kv_chain_hash(j ? &r->hash[j - 1] : prev, seq + (size_t)(r->j0 + j) * c->pt, c->pt, &r->hash[j]);
        bool all = true;
        for (int g = 0; g < c->n_groups; g++) {
            r->found[g][j] = kv_pool_find(c, g, &r->hash[j]);
            if (c->groups[g].window <= 0 && r->found[g][j] < 0) all = false;
        }
        if (!all && r->kfull < 0) r->kfull = j;
    }
    if (r->kfull < 0) r->kfull = r->n_full;
    return KV_OK;
}

/* The page of group g for logical page lp under the plan, or -1. */
static int32_t plan_page(const reuse_plan *r, int g, int lp) {
    if (lp >= r->j0) return lp - r->j0 < r->n_full ? r->found[g][lp - r->j0] : -1;
    if (r->own && r->own->tab[g][lp] >= 0) return r->own->tab[g][lp];
    if (lp < r->n_own_chain) return kv_pool_find(r->c, g, &r->own_chain[lp]);
    return -1;
}

/* Can every window group resume at position E (pages of its last w - 1
 * positions at hand)? Full groups are covered by kfull. */
static bool plan_resumable(const reuse_plan *r, int64_t E) {
    const kv_cache *c = r->c;
    for (int g = 0; g < c->n_groups; g++) {
        if (c->groups[g].window <= 0) continue;
        for (int lp = first_needed(c, g, (int)E); E > 0 && lp <= (int)((E - 1) >> c->pt_log2); lp++)
            if (plan_page(r, g, lp) < 0) return false;
    }
    return true;
}

/* The largest end E in (P, max_end] reachable by the plan, or P. */
static int64_t plan_end(const reuse_plan *r, int64_t P, int64_t max_end, bool *window_blocked) {
    const int pt = r->c->pt;
    int64_t top = (int64_t)(r->j0 + r->kfull) * pt;
    if (top > max_end) top = max_end;
    *window_blocked = false;
    for (int64_t E = top; E > P;) {
        if (plan_resumable(r, E)) return E;
        *window_blocked = true;
        E = E % pt ? E - E % pt : E - pt; /* the page boundary below */
    }
    return P;
}

/* Attaches the planned pages for [P, E) (and the window pages E needs) to
 * the session; updates its chain. */
static void plan_attach(kv_session *s, const reuse_plan *r, int64_t E) {
    kv_cache *c = pool_of(s);
    const int last = (int)((E - 1) >> c->pt_log2);
    for (int g = 0; g < c->n_groups; g++) {
        int lo = c->groups[g].window > 0 ? first_needed(c, g, (int)E) : r->j0;
        for (int lp = lo; lp <= last; lp++) {
            int32_t id = plan_page(r, g, lp);
            if (id >= 0 && s->kv->tab[g][lp] != id) {
                set_page(s, g, lp, id);
                if (lp >= r->j0) c->groups[g].pages[id].hits++;
            }
        }
        if (c->groups[g].window > 0 && lo < s->win_lo[g]) s->win_lo[g] = lo;
    }
    int full = (int)(E >> c->pt_log2);
    for (int lp = r->j0; lp < full; lp++) s->chain[lp] = r->hash[lp - r->j0];
    if (full > s->n_chain) s->n_chain = full;
}

/* Prefill reuse: tokens[0..pos) ++ ids[0..n); moves pos past the cached
 * part (at most max_take of ids). Returns the tokens taken. */
static kv_status reuse(kv_session *s, const int32_t *ids, int n, int max_take, int *taken, kv_error *e) {
    kv_cache *c = pool_of(s);
    *taken = 0;
    const int P = s->pos;
    if (!c->prefix || s->shifted || max_take <= 0 || s->holes || P / c->pt > s->n_chain) return KV_OK;
    memcpy(s->tokens + P, ids, (size_t)n * sizeof *ids);
    reuse_plan r = {.c = c, .own = s->kv, .own_chain = s->chain, .n_own_chain = s->n_chain, .j0 = P >> c->pt_log2};
    const kv_hash *prev = r.j0 ? &s->chain[r.j0 - 1] : &c->h0;
    kv_status st = plan_lookup(&r, s->tokens, (int64_t)P + n, prev, e);
    if (st == KV_OK) {
        bool blocked;
        int64_t E = plan_end(&r, P, (int64_t)P + max_take, &blocked);
        int full_seq = (P + n) >> c->pt_log2, full_reused = (int)(E >> c->pt_log2);
        if (E > P) {
            plan_attach(s, &r, E);
            c->hits += (uint64_t)(((E - 1) >> c->pt_log2) - r.j0 + 1);
            c->reused_tokens += (uint64_t)(E - P);
            s->reused += (uint64_t)(E - P);
            s->pos = (int)E;
            *taken = (int)(E - P);
            drop_window_pages(s);
        }
        if (full_seq > full_reused) c->misses += (uint64_t)(full_seq - full_reused);
    }
    plan_free(&r);
    return st;
}

kv_status kv_cache_lookup(kv_cache *c, const int32_t *ids, size_t n, int64_t *cached, const char **reason,
                          kv_error *e) {
    *cached = 0;
    *reason = NULL;
    if (!c->prefix) {
        *reason = "prefix reuse is off";
        return KV_OK;
    }
    if (n > (size_t)INT32_MAX) return kv_fail(e, KV_ERR_ARG, "lookup: too many tokens");
    reuse_plan r = {.c = c};
    kv_status st = plan_lookup(&r, ids, (int64_t)n, &c->h0, e);
    if (st == KV_OK) {
        bool blocked;
        *cached = plan_end(&r, 0, (int64_t)n, &blocked);
        if (*cached < (int64_t)n) {
            if (blocked) {
                *reason = "window pages dropped";
            } else if (r.kfull < r.n_full) {
                /* the first full page not cached: why */
                const kv_hash *h = &r.hash[r.kfull];
                *reason = "never seen";
                for (int g = 0; g < c->n_groups; g++)
                    if (c->groups[g].window <= 0 && kv_pool_was_evicted(c, g, h)) *reason = "evicted";
                if (!strcmp(*reason, "never seen"))
                    for (kv_cache *o = *kv_model_caches(c->m); o; o = o->next_of_model) {
                        const size_t tb = 2 * (size_t)kv_model_info_get(c->m)->n_layer * sizeof(int);
                        if (o == c || o->pt != c->pt || !o->prefix || !memcmp(o->ktypes, c->ktypes, tb)) continue;
                        reuse_plan q = {.c = o};
                        kv_error e2;
                        if (plan_lookup(&q, ids, (int64_t)(r.kfull + 1) * c->pt, &o->h0, &e2) == KV_OK &&
                            q.kfull > r.kfull)
                            *reason = "other types";
                        plan_free(&q);
                    }
            } else {
                *reason = "partial page";
            }
        }
    }
    plan_free(&r);
    return st;
}

/* ==== repair ======================================================================= */

/* Are the pages a query at pos reads all held? Missing ones that are still
 * sealed in the cache (found by the session's chain) are attached. */
static bool repair_by_hash(kv_session *s) {
    kv_cache *c = pool_of(s);
    bool ok = true;
    if (s->pos == 0) return true;
    const int last = (s->pos - 1) >> c->pt_log2;
    for (int g = 0; g < c->n_groups; g++)
        for (int lp = first_needed(c, g, s->pos); lp <= last; lp++) {
            if (s->kv->tab[g][lp] >= 0) continue;
            int32_t id = lp < s->n_chain ? kv_pool_find(c, g, &s->chain[lp]) : -1;
            if (id >= 0) set_page(s, g, lp, id);
            else ok = false;
        }
    return ok;
}

static kv_status run_chunks(kv_session *s, const int32_t *ids, int n, int logits_mode, float *logits,
                            kv_error *e);

/* Makes the session able to continue at pos: attaches what the cache still
 * has, else recomputes from the last page boundary where everything is at
 * hand (tokens are kept, so nothing is lost). */
static kv_status repair(kv_session *s, kv_error *e) {
    if (!s->holes) return KV_OK;
    if (repair_by_hash(s)) {
        s->holes = false;
        return KV_OK;
    }
    kv_cache *c = pool_of(s);
    const int target = s->pos;
    reuse_plan r = {.c = c, .own = s->kv, .own_chain = s->chain, .n_own_chain = s->n_chain, .j0 = s->n_chain};
    int Q = 0;
    for (int q = (target >> c->pt_log2) * c->pt; q > 0; q -= c->pt) {
        bool ok = true;
        for (int g = 0; g < c->n_groups && ok; g++)
            for (int lp = first_needed(c, g, q); lp <= ((q - 1) >> c->pt_log2) && ok; lp++)
                ok = plan_page(&r, g, lp) >= 0;
        if (ok) {
            Q = q;
            break;
        }
    }
    /* resume at Q: its pages attached, everything after released, then recompute */
    trim_from(s, Q);
    for (int g = 0; g < c->n_groups; g++) {
        for (int lp = 0; lp < first_needed(c, g, Q); lp++)
            if (s->kv->tab[g][lp] >= 0 && c->groups[g].window > 0) set_page(s, g, lp, -1);
        for (int lp = first_needed(c, g, Q); Q > 0 && lp <= ((Q - 1) >> c->pt_log2); lp++)
            if (s->kv->tab[g][lp] < 0) set_page(s, g, lp, plan_page(&r, g, lp));
        if (c->groups[g].window > 0) s->win_lo[g] = first_needed(c, g, Q);
    }
    s->pos = Q;
    s->holes = false;
    kv_status st = run_chunks(s, s->tokens + Q, target - Q, KV_LOGITS_NONE, NULL, e);
    if (st) {
        s->pos = target; /* the tokens are still there: the next eval tries again */
        s->holes = true;
    }
    return st;
}

/* ==== evaluation ===================================================================== */

/* Forward passes over ids (written at pos on), chunk by chunk. */
static kv_status run_chunks(kv_session *s, const int32_t *ids, int n, int logits_mode, float *logits,
                            kv_error *e) {
    kv_backend *be = &s->m->be;
    const int n_vocab = s->m->info.n_vocab;
    if (ids != s->tokens + s->pos) memcpy(s->tokens + s->pos, ids, (size_t)n * sizeof *ids);
    for (int off = 0; off < n;) {
        int T = n - off > KV_CHUNK ? KV_CHUNK : n - off;
        bool last = off + T == n;
        int mode = logits_mode == KV_LOGITS_ALL ? KV_LOGITS_ALL
                   : (logits_mode == KV_LOGITS_LAST && last) ? KV_LOGITS_LAST : KV_LOGITS_NONE;
        float *out = logits_mode == KV_LOGITS_ALL ? logits + (size_t)off * n_vocab : logits;
        kv_status st = prepare_pages(s, s->pos, T, e);
        if (st) return st;
        bool finite = kv_forward(s, s->tokens + s->pos, T, mode, out);
        if (be->status && (st = be->status(be, e))) return st; /* a device error, kept by the backend */
        if (!finite)
            return kv_fail(e, KV_ERR_NUMERIC,
                           "eval: non-finite queries or keys for positions %d..%d (corrupted weights?)", s->pos,
                           s->pos + T - 1);
        int64_t nout = mode == KV_LOGITS_ALL ? (int64_t)T * n_vocab : mode == KV_LOGITS_LAST ? n_vocab : 0;
        /* the residual stream of every position, not only the rows whose
         * logits were asked for: a NaN in any of them is in the KV cache now */
        bool ok = be->all_finite(be, s->x, (int64_t)T * s->m->info.n_embd) && (!nout || be->all_finite(be, out, nout));
        if (be->status && (st = be->status(be, e))) return st;
        if (!ok)
            return kv_fail(e, KV_ERR_NUMERIC,
                           "eval: non-finite activations or logits for positions %d..%d (corrupted weights?)", s->pos,
                           s->pos + T - 1);
        s->pos += T;
        seal_full_pages(s);
        drop_window_pages(s);
        off += T;
    }
    return KV_OK;
}

kv_status kv_session_eval(kv_session *s, const int32_t *ids, size_t n, int logits_mode, float *logits,
                          kv_error *e) {
    if (!s) return kv_fail(e, KV_ERR_ARG, "eval: session is NULL");
    if (logits_mode != KV_LOGITS_NONE && logits_mode != KV_LOGITS_LAST && logits_mode != KV_LOGITS_ALL)
        return kv_fail(e, KV_ERR_ARG, "eval: bad logits mode %d", logits_mode);
    if (n == 0) {
        if (logits_mode != KV_LOGITS_NONE) return kv_fail(e, KV_ERR_ARG, "eval: no tokens to compute logits for");
        return KV_OK;
    }
    if (!ids) return kv_fail(e, KV_ERR_ARG, "eval: ids is NULL");
    if (logits_mode != KV_LOGITS_NONE && !logits) return kv_fail(e, KV_ERR_ARG, "eval: logits is NULL");
    if (n > (size_t)(s->n_ctx - s->pos))
        return kv_fail(e, KV_ERR_CONTEXT_FULL, "context full: %d tokens in session + %zu new > n_ctx %d", s->pos, n,
                       s->n_ctx);
    const int n_vocab = s->m->info.n_vocab;
    kv_status st;
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= n_vocab)
            return kv_fail(e, KV_ERR_ARG, "eval: token id %d at index %zu is out of range [0, %d)", (int)ids[i], i,
                           n_vocab);

    if ((st = kv_pool_busy(pool_of(s), s->kv, "eval", e))) return st;

    const int pos_before = s->pos;
    kv_cache *c = pool_of(s);
    const uint64_t hits = c->hits, misses = c->misses, reused_tokens = c->reused_tokens, reused = s->reused;
    s->kv->busy++; /* until it returns: an eviction policy it calls cannot change it */
    st = repair(s, e);
    int taken = 0;
    /* logits of every position need every position computed; the last
     * position's logits need at least that one */
    int max_take = logits_mode == KV_LOGITS_ALL ? 0 : logits_mode == KV_LOGITS_LAST ? (int)n - 1 : (int)n;
    if (st == KV_OK) st = reuse(s, ids, (int)n, max_take, &taken, e);
    if (st == KV_OK) st = run_chunks(s, ids + taken, (int)n - taken, logits_mode, logits, e);
    if (st != KV_OK) {
        s->pos = pos_before;
        trim_from(s, pos_before);
        s->holes = true; /* pages before pos_before may have been swapped or dropped */
        /* nothing was reused after all: the counters as they were */
        c->hits = hits, c->misses = misses, c->reused_tokens = reused_tokens, s->reused = reused;
    }
    s->kv->busy--;
    return st;
}

/* ==== context shift ============================================================== */

/* K row of layer il rotated by RoPE for a position delta (negative: back). */
static void rotate_k_row(const kv_layer *L, int type, int hd, uint8_t *row, const float *cs, float *tmp) {
    kv_dequantize_row(type, row, tmp, hd);
    if (kv_type_rotated(type)) kv_hadamard_rows(tmp, 1, hd); /* back to RoPE's coordinates (H H = I) */
    const int half = L->rope.n_rot / 2;
    for (int i = 0; i < half; i++) {
        const int a = L->rope.mode == KV_ROPE_NEOX ? i : 2 * i, b = L->rope.mode == KV_ROPE_NEOX ? i + half : 2 * i + 1;
        const float x = tmp[a], y = tmp[b];
        tmp[a] = x * cs[2 * i] - y * cs[2 * i + 1];
        tmp[b] = x * cs[2 * i + 1] + y * cs[2 * i];
    }
    if (kv_type_rotated(type)) kv_hadamard_rows(tmp, 1, hd);
    kv_quantize_row(type, tmp, row, hd);
}

/* cos/sin of the angle of each rotated pair for a position delta */
static void shift_table(const kv_rope_params *rp, int delta, float *cs) {
    const int half = rp->n_rot / 2;
    for (int i = 0; i < half; i++) {
        double th = (double)delta * rp->freq_scale * pow((double)rp->freq_base, -2.0 * i / rp->n_rot);
        if (rp->freq_factors) th /= rp->freq_factors[i];
        cs[2 * i] = (float)cos(th), cs[2 * i + 1] = (float)sin(th);
    }
}

static kv_status shift(kv_session *s, int keep, int drop, kv_error *e);

kv_status kv_session_shift(kv_session *s, int keep, int drop, kv_error *e) {
    if (!s) return kv_fail(e, KV_ERR_ARG, "shift: session is NULL");
    if (keep < 0 || drop <= 0 || (int64_t)keep + drop > s->pos)
        return kv_fail(e, KV_ERR_ARG, "shift: keep %d and drop %d do not fit in %d tokens", keep, drop, s->pos);
    kv_status st = kv_pool_busy(pool_of(s), s->kv, "shift", e);
    if (st) return st;
    s->kv->busy++; /* until it returns (see kv_pool_busy) */
    st = shift(s, keep, drop, e);
    s->kv->busy--;
    return st;
}

static kv_status shift(kv_session *s, int keep, int drop, kv_error *e) {
    kv_status st = repair(s, e);
    if (st) return st;
    kv_cache *c = pool_of(s);
    const kv_model *m = s->m;
    const int pt = c->pt, new_pos = s->pos - drop, hd = c->head_dim, hdv = c->head_dim_v;
    const int last = new_pos > 0 ? (new_pos - 1) >> c->pt_log2 : -1;
    /* fresh pages: every page holding a moved position */
    int need[KV_MAX_GROUPS] = {0};
    for (int g = 0; g < c->n_groups; g++)
        for (int lp = first_needed(c, g, new_pos); lp <= last; lp++)
            if ((lp + 1) * pt > keep) need[g]++;
    if ((st = kv_pool_reserve(c, need, e))) return st;
    float *tmp = malloc(sizeof(float) * (size_t)(hd > hdv ? hd : hdv)), *cs = malloc(sizeof(float) * (size_t)hd);
    int32_t *tab = malloc(sizeof(int32_t) * (size_t)s->kv->n_lp);
    if (!tmp || !cs || !tab) {
        free(tmp), free(cs), free(tab);
        return kv_fail(e, KV_ERR_NOMEM, "shift: out of memory");
    }
    bool missing = false;
    kv_backend *be = &s->m->be;
    /* a device backend: the rows to move come to the host slabs first */
    for (int g = 0; g < c->n_groups && be->page_sync && st == KV_OK; g++)
        for (int lp = 0; lp < s->kv->n_lp && st == KV_OK; lp++)
            if (s->kv->tab[g][lp] >= 0 && (lp + 1) * pt > keep) st = be->page_sync(be, c, g, s->kv->tab[g][lp], false, e);
    if (st) {
        free(tmp), free(cs), free(tab);
        return st;
    }
    for (int g = 0; g < c->n_groups; g++) {
        const kv_group *G = &c->groups[g];
        const int32_t *old = s->kv->tab[g];
        for (int lp = 0; lp < s->kv->n_lp; lp++) tab[lp] = -1;
        for (int lp = first_needed(c, g, new_pos); lp <= last; lp++) {
            if ((lp + 1) * pt <= keep) { /* nothing moves in this page */
                tab[lp] = old[lp];
                if (tab[lp] >= 0) kv_pool_ref(c, g, tab[lp]);
                else missing = true;
                continue;
            }
            int32_t id;
            kv_pool_take(c, g, 1, &id, e); /* reserved above */
            c->groups[g].pages[id].lp = lp;
            bool ok = true;
            for (int t = 0; t < pt && lp * pt + t < new_pos && ok; t++) {
                const int p1 = lp * pt + t, p0 = p1 < keep ? p1 : p1 + drop; /* new and old position */
                const int32_t src = old[p0 >> c->pt_log2];
                if (src < 0) {
                    ok = false;
                    break;
                }
                for (int li = 0; li < G->n_layers; li++) {
                    const int il = G->layer_ids[li];
                    if (p1 >= keep) shift_table(&m->layers[il].rope, -drop, cs);
                    for (int h = 0; h < c->n_kv; h++) {
                        uint8_t *dk = kv_pool_row(c, g, id, li, h, t, false), *dv = kv_pool_row(c, g, id, li, h, t, true);
                        memcpy(dk, kv_pool_row(c, g, src, li, h, p0 & (pt - 1), false), c->krows[il]);
                        memcpy(dv, kv_pool_row(c, g, src, li, h, p0 & (pt - 1), true), c->vrows[il]);
                        if (p1 >= keep) rotate_k_row(&m->layers[il], c->ktypes[il], hd, dk, cs, tmp);
                    }
                }
            }
            if (ok && be->page_sync && be->page_sync(be, c, g, id, true, e) != KV_OK) ok = false;
            if (ok) {
                tab[lp] = id;
            } else {
                kv_pool_unref(c, g, id);
                missing = true;
            }
        }
        for (int lp = 0; lp < s->kv->n_lp; lp++) {
            if (s->kv->tab[g][lp] >= 0) kv_pool_unref(c, g, s->kv->tab[g][lp]);
            s->kv->tab[g][lp] = tab[lp];
        }
        if (G->window > 0) s->win_lo[g] = first_needed(c, g, new_pos);
    }
    memmove(s->tokens + keep, s->tokens + keep + drop, sizeof(int32_t) * (size_t)(s->pos - keep - drop));
    s->pos = new_pos;
    s->shifted = true;
    if (s->n_chain > keep / pt) s->n_chain = keep / pt;
    s->holes = missing; /* what was already gone is recomputed by the next eval */
    free(tmp), free(cs), free(tab);
    return KV_OK;
}

/* ==== restored sessions ============================================================ */

/* A session whose tables and tokens were filled from a file: chain hashes
 * and seals of its full pages, window bookkeeping; the next eval checks
 * that the pages it needs are there. */
void kv_session_after_restore(kv_session *s) {
    kv_cache *c = pool_of(s);
    s->n_chain = 0;
    seal_full_pages(s);
    for (int g = 0; g < c->n_groups; g++) s->win_lo[g] = 0;
    drop_window_pages(s);
    s->holes = true;
}

/* ==== batched decode ================================================================= */

/* Up to KV_CHUNK sessions at once: all pages prepared first (all or
 * nothing), one forward pass, then each session moves on. */
static kv_status decode_group(kv_session *const *ss, const int32_t *ids, int B, float *logits, kv_error *e) {
    kv_model *m = ss[0]->m;
    kv_backend *be = &m->be;
    const int n_vocab = m->info.n_vocab;
    kv_status st = KV_OK;
    for (int b = 0; b < B && st == KV_OK; b++) {
        st = repair(ss[b], e);
        if (st == KV_OK) st = prepare_pages(ss[b], ss[b]->pos, 1, e);
    }
    if (st == KV_OK) {
        for (int b = 0; b < B; b++) ss[b]->tokens[ss[b]->pos] = ids[b];
        bool finite = kv_forward_batch(ss, ids, B, logits);
        bool ok = finite && be->all_finite(be, ss[0]->x, (int64_t)B * m->info.n_embd) &&
                  be->all_finite(be, logits, (int64_t)B * n_vocab);
        if (be->status && (st = be->status(be, e))) {
            /* a device error, kept by the backend */
        } else if (!finite)
            st = kv_fail(e, KV_ERR_NUMERIC, "decode_batch: non-finite queries or keys (corrupted weights?)");
        else if (!ok)
            st = kv_fail(e, KV_ERR_NUMERIC, "decode_batch: non-finite activations or logits (corrupted weights?)");
    }
    if (st != KV_OK) {
        for (int b = 0; b < B; b++) trim_from(ss[b], ss[b]->pos);
        return st;
    }
    for (int b = 0; b < B; b++) {
        ss[b]->pos++;
        seal_full_pages(ss[b]);
        drop_window_pages(ss[b]);
    }
    return KV_OK;
}

kv_status kv_decode_batch(kv_session *const *ss, const int32_t *ids, size_t n, float *logits, kv_error *e) {
    if (!ss || !ids || !logits || n == 0) return kv_fail(e, KV_ERR_ARG, "decode_batch: no sessions");
    const kv_model *m = ss[0] ? ss[0]->m : NULL;
    for (size_t i = 0; i < n; i++) {
        if (!ss[i]) return kv_fail(e, KV_ERR_ARG, "decode_batch: session %zu is NULL", i + 1);
        if (ss[i]->m != m) return kv_fail(e, KV_ERR_ARG, "decode_batch: session %zu belongs to another model", i + 1);
        for (size_t j = 0; j < i; j++)
            if (ss[j] == ss[i]) return kv_fail(e, KV_ERR_ARG, "decode_batch: session %zu appears twice", i + 1);
        if (ids[i] < 0 || ids[i] >= m->info.n_vocab)
            return kv_fail(e, KV_ERR_ARG, "decode_batch: token id %d (session %zu) is out of range [0, %d)",
                           (int)ids[i], i + 1, m->info.n_vocab);
        if (ss[i]->pos >= ss[i]->n_ctx)
            return kv_fail(e, KV_ERR_CONTEXT_FULL, "context full: session %zu holds %d tokens, n_ctx %d", i + 1,
                           ss[i]->pos, ss[i]->n_ctx);
        kv_status busy = kv_pool_busy(pool_of(ss[i]), ss[i]->kv, "decode_batch", e);
        if (busy) return busy;
    }
    /* every session busy until it returns: a policy one of them calls
     * cannot change any (see kv_pool_busy) */
    for (size_t i = 0; i < n; i++) ss[i]->kv->busy++;
    kv_status st = KV_OK;
    size_t off = 0;
    for (; off < n && st == KV_OK; off += KV_CHUNK) {
        int B = n - off > KV_CHUNK ? KV_CHUNK : (int)(n - off);
        st = decode_group(ss + off, ids + off, B, logits + off * (size_t)m->info.n_vocab, e);
    }
    for (size_t i = 0; i < n; i++) ss[i]->kv->busy--;
    if (st) /* groups before the failed one have moved: take their tokens back */
        for (size_t i = 0; i + KV_CHUNK < off; i++) kv_session_rewind(ss[i], 1);
    return st;
}

/* ==== batched prefill ================================================================ */

/* One forward pass over a group of sessions' next pieces: pages prepared
 * first (all or nothing), then each session moves on by its piece. ids:
 * the pieces one after another; want[0..nw): the rows whose logits go to
 * out (nw == T: all). */
static kv_status prefill_group(kv_session *const *gs, const int *rows, int G, const int32_t *ids, int T,
                               const int *want, int nw, float *out, kv_error *e) {
    kv_backend *be = &gs[0]->m->be;
    kv_status st = KV_OK;
    for (int b = 0; b < G && st == KV_OK; b++) st = prepare_pages(gs[b], gs[b]->pos, rows[b], e);
    if (st) return st;
    for (int b = 0, t = 0; b < G; t += rows[b], b++)
        memcpy(gs[b]->tokens + gs[b]->pos, ids + t, (size_t)rows[b] * sizeof *ids);
    bool finite = kv_forward_multi(gs, rows, G, ids, T, want, nw, out);
    if (be->status && (st = be->status(be, e))) return st; /* a device error, kept by the backend */
    if (!finite) return kv_fail(e, KV_ERR_NUMERIC, "prefill_batch: non-finite queries or keys (corrupted weights?)");
    bool ok = be->all_finite(be, gs[0]->x, (int64_t)T * gs[0]->m->info.n_embd) &&
              (!nw || be->all_finite(be, out, (int64_t)nw * gs[0]->m->info.n_vocab));
    if (be->status && (st = be->status(be, e))) return st;
    if (!ok) return kv_fail(e, KV_ERR_NUMERIC, "prefill_batch: non-finite activations or logits (corrupted weights?)");
    for (int b = 0; b < G; b++) {
        gs[b]->pos += rows[b];
        seal_full_pages(gs[b]);
        drop_window_pages(gs[b]);
    }
    return KV_OK;
}

/* After each session's repair and prefix reuse, the tokens left are cut
 * into groups of at most KV_CHUNK rows, taken in session order (a session
 * longer than the room left continues in the next group), so a session is
 * at most once in a group and its pieces go in order. */
static kv_status prefill_batch(kv_session *const *ss, const int32_t *const *ids, const size_t *n_ids, size_t n,
                               int mode, float *const *logits, int *cur, kv_error *e) {
    const int n_vocab = ss[0]->m->info.n_vocab;
    kv_status st = KV_OK;
    size_t left = 0; /* tokens to compute */
    for (size_t i = 0; i < n && st == KV_OK; i++) {
        int max_take = mode == KV_LOGITS_ALL ? 0 : mode == KV_LOGITS_LAST ? (int)n_ids[i] - 1 : (int)n_ids[i];
        st = repair(ss[i], e);
        if (st == KV_OK) st = reuse(ss[i], ids[i], (int)n_ids[i], max_take, &cur[i], e);
        left += n_ids[i] - (size_t)cur[i];
    }
    if (st) return st;
    const size_t out_rows = mode == KV_LOGITS_NONE ? 0 : left < KV_CHUNK ? left : KV_CHUNK;
    float *out = out_rows ? malloc(out_rows * (size_t)n_vocab * sizeof *out) : NULL;
    if (out_rows && !out) return kv_fail(e, KV_ERR_NOMEM, "prefill_batch: out of memory for logits");
    kv_session *gs[KV_CHUNK];
    int rows[KV_CHUNK], owner[KV_CHUNK], want[KV_CHUNK];
    int32_t gids[KV_CHUNK];
    size_t i = 0;
    while (st == KV_OK) {
        int G = 0, T = 0, nw = 0;
        for (; i < n && T < KV_CHUNK; i++) { /* fill the group */
            int k = (int)n_ids[i] - cur[i];
            if (k == 0) continue;
            if (k > KV_CHUNK - T) k = KV_CHUNK - T;
            memcpy(gids + T, ids[i] + cur[i], (size_t)k * sizeof *gids);
            if (mode == KV_LOGITS_LAST && cur[i] + k == (int)n_ids[i]) want[nw++] = T + k - 1;
            gs[G] = ss[i], rows[G] = k, owner[G] = (int)i, G++;
            T += k;
            if (cur[i] + k < (int)n_ids[i]) break; /* continues in the next group */
        }
        if (G == 0) break;
        if (mode == KV_LOGITS_ALL) nw = T;
        st = prefill_group(gs, rows, G, gids, T, want, nw, out, e);
        if (st) break;
        for (int b = 0, r = 0, w = 0; b < G; r += rows[b], b++) { /* the logits to their sessions */
            const int o = owner[b];
            if (mode == KV_LOGITS_ALL)
                memcpy(logits[o] + (size_t)cur[o] * n_vocab, out + (size_t)r * n_vocab,
                       (size_t)rows[b] * n_vocab * sizeof *out);
            else if (mode == KV_LOGITS_LAST && w < nw && want[w] == r + rows[b] - 1)
                memcpy(logits[o], out + (size_t)(w++) * n_vocab, (size_t)n_vocab * sizeof *out);
            cur[o] += rows[b];
        }
    }
    free(out);
    return st;
}

kv_status kv_prefill_batch(kv_session *const *ss, const int32_t *const *ids, const size_t *n_ids, size_t n,
                           int logits_mode, float *const *logits, kv_error *e) {
    if (!ss || !ids || !n_ids || n == 0) return kv_fail(e, KV_ERR_ARG, "prefill_batch: no sessions");
    if (logits_mode != KV_LOGITS_NONE && logits_mode != KV_LOGITS_LAST && logits_mode != KV_LOGITS_ALL)
        return kv_fail(e, KV_ERR_ARG, "prefill_batch: bad logits mode %d", logits_mode);
    if (logits_mode != KV_LOGITS_NONE && !logits) return kv_fail(e, KV_ERR_ARG, "prefill_batch: logits is NULL");
    const kv_model *m = ss[0] ? ss[0]->m : NULL;
    for (size_t i = 0; i < n; i++) {
        if (!ss[i]) return kv_fail(e, KV_ERR_ARG, "prefill_batch: session %zu is NULL", i + 1);
        if (ss[i]->m != m) return kv_fail(e, KV_ERR_ARG, "prefill_batch: session %zu belongs to another model", i + 1);
        for (size_t j = 0; j < i; j++)
            if (ss[j] == ss[i]) return kv_fail(e, KV_ERR_ARG, "prefill_batch: session %zu appears twice", i + 1);
        if (!ids[i] || n_ids[i] == 0) return kv_fail(e, KV_ERR_ARG, "prefill_batch: session %zu has no tokens", i + 1);
        if (logits_mode != KV_LOGITS_NONE && !logits[i])
            return kv_fail(e, KV_ERR_ARG, "prefill_batch: logits of session %zu is NULL", i + 1);
        for (size_t j = 0; j < n_ids[i]; j++)
            if (ids[i][j] < 0 || ids[i][j] >= m->info.n_vocab)
                return kv_fail(e, KV_ERR_ARG,
                               "prefill_batch: token id %d at index %zu (session %zu) is out of range [0, %d)",
                               (int)ids[i][j], j + 1, i + 1, m->info.n_vocab);
        if (n_ids[i] > (size_t)(ss[i]->n_ctx - ss[i]->pos))
            return kv_fail(e, KV_ERR_CONTEXT_FULL, "context full: session %zu holds %d tokens + %zu new > n_ctx %d",
                           i + 1, ss[i]->pos, n_ids[i], ss[i]->n_ctx);
        kv_status busy = kv_pool_busy(pool_of(ss[i]), ss[i]->kv, "prefill_batch", e);
        if (busy) return busy;
    }
    int *pos0 = malloc(2 * n * sizeof *pos0);
    uint64_t *was = malloc(4 * n * sizeof *was); /* each session's reused count, its cache's counters */
    if (!pos0 || !was) {
        free(pos0), free(was);
        return kv_fail(e, KV_ERR_NOMEM, "prefill_batch: out of memory");
    }
    int *cur = pos0 + n; /* tokens of ids[i] in session i so far */
    for (size_t i = 0; i < n; i++) {
        const kv_cache *c = pool_of(ss[i]);
        pos0[i] = ss[i]->pos, cur[i] = 0;
        was[4 * i] = ss[i]->reused, was[4 * i + 1] = c->hits, was[4 * i + 2] = c->misses;
        was[4 * i + 3] = c->reused_tokens;
    }
    /* every session busy until it returns: a policy one of them calls
     * cannot change any (see kv_pool_busy) */
    for (size_t i = 0; i < n; i++) ss[i]->kv->busy++;
    kv_status st = prefill_batch(ss, ids, n_ids, n, logits_mode, logits, cur, e);
    if (st) /* every session back where it was (see kv_session_eval) */
        for (size_t i = 0; i < n; i++) {
            ss[i]->pos = pos0[i];
            trim_from(ss[i], pos0[i]);
            ss[i]->holes = true;
            /* nothing was reused after all: the counters as they were (all taken before any changed) */
            kv_cache *c = pool_of(ss[i]);
            ss[i]->reused = was[4 * i], c->hits = was[4 * i + 1], c->misses = was[4 * i + 2];
            c->reused_tokens = was[4 * i + 3];
        }
    for (size_t i = 0; i < n; i++) ss[i]->kv->busy--;
    free(pos0);
    free(was);
    return st;
}

/* ==== queries ========================================================================== */

int kv_session_pos(const kv_session *s) { return s->pos; }
int kv_session_ctx(const kv_session *s) { return s->n_ctx; }
const int32_t *kv_session_tokens(const kv_session *s) { return s->tokens; }
kv_cache *kv_session_cache(const kv_session *s) { return s->kv->pool; }
uint64_t kv_session_reused_tokens(const kv_session *s) { return s->reused; }

void kv_session_rewind(kv_session *s, int n) {
    if (!s || n <= 0) return;
    if (s->kv->busy || pool_of(s)->in_policy) return; /* nothing changes under a policy (kv_pool_busy) */
    s->pos = n >= s->pos ? 0 : s->pos - n;
    trim_from(s, s->pos);
    s->holes = true;
}

uint64_t kv_session_kv_bytes(const kv_session *s) { return s ? kv_kvcache_bytes(s->kv) : 0; }
