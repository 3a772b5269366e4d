/* l_logits.c — the Logits userdata ("kvlua.Logits").
 *
 * Owns one block of scores produced by a forward pass: rows x n floats,
 * row-major, living inside a Lua full userdata (so Lua's GC owns it and
 * nothing here can leak on a longjmp). rows == 1 for s:prefill/s:decode,
 * rows == positions for prefill{logits="all"}.
 *
 * Besides the read-only API of the product contract (argmax, topk, get,
 * logprob, row, totable) it carries the in-place primitives the Lua
 * sampling chain (kvlua.sampling) is built from: clone, set, scale,
 * penalize, keep_top_k / keep_top_p / keep_min_p / keep_typical (llama.cpp
 * semantics, masking the rest to -inf), softmax_sample and has_nonfinite.
 * A masked entry (-inf) is "not a candidate"; every keep_* only considers
 * candidates. Each per-token pass over the vocabulary is O(n); orderings
 * use a partial selection (quickselect) and sort only the prefix needed.
 *
 * Ties are broken by the lower token id everywhere (topk, keep_*), so
 * results are deterministic. Token ids are 0-based GGUF ids.
 *
 * Errors: misuse (wrong type, id out of range, bad option) raises with
 * luaL_argerror; non-finite logits (NaN, +inf) in an operation that needs a
 * softmax return nil, "non-finite logits".
 */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <lauxlib.h>
#include <lua.h>

#include "l_logits.h"

/* ------------------------------------------------------------------------
 * The userdata
 * ------------------------------------------------------------------------ */

typedef struct {
    int n;          /* vocabulary size (columns) */
    int rows;       /* positions */
    float *data;    /* (rows, n), points just after lse[] */
    double lse[];   /* (rows, 2) cached max and log(sum(exp(x - max))) per
                       row; NAN = not computed */
} LLogits;

/* Largest element count we accept: keeps every size computation below in
   range (and far above any real vocabulary x positions). */
#define L_LOGITS_MAX_ELEMS ((size_t)1 << 34)

static LLogits *l_push_raw(lua_State *L, int n, int rows)
{
    if (n < 1 || rows < 1)
        luaL_error(L, "kvlua.Logits: bad size %d x %d", rows, n);
    size_t elems = (size_t)rows * (size_t)n;
    if (elems / (size_t)rows != (size_t)n || elems > L_LOGITS_MAX_ELEMS)
        luaL_error(L, "kvlua.Logits: size %d x %d too large", rows, n);
    size_t bytes = sizeof(LLogits) + 2 * (size_t)rows * sizeof(double) + elems * sizeof(float);
    LLogits *lg = (LLogits *)lua_newuserdatauv(L, bytes, 0);
    lg->n = n;
    lg->rows = rows;
    lg->data = (float *)(lg->lse + 2 * (size_t)rows);
    for (int r = 0; r < 2 * rows; r++)
        lg->lse[r] = NAN;
    memset(lg->data, 0, elems * sizeof(float));
    luaL_setmetatable(L, L_LOGITS_MT);
    return lg;
}

float *l_logits_push(lua_State *L, int n, int rows)
{
    return l_push_raw(L, n, rows)->data;
}

static LLogits *l_check(lua_State *L, int idx)
{
    return (LLogits *)luaL_checkudata(L, idx, L_LOGITS_MT);
}

float *l_logits_check(lua_State *L, int idx, int *n, int *rows)
{
    LLogits *lg = l_check(L, idx);
    if (n) *n = lg->n;
    if (rows) *rows = lg->rows;
    return lg->data;
}

/* Call after any write: the cached logsumexp no longer holds. */
static void l_invalidate(LLogits *lg)
{
    for (int r = 0; r < 2 * lg->rows; r++)
        lg->lse[r] = NAN;
}

float *l_logits_write(lua_State *L, int idx, int *n, int *rows)
{
    LLogits *lg = l_check(L, idx);
    l_invalidate(lg);
    if (n) *n = lg->n;
    if (rows) *rows = lg->rows;
    return lg->data;
}

/* ------------------------------------------------------------------------
 * Argument helpers
 * ------------------------------------------------------------------------ */

/* A 0-based token id at arg, in [0, n). Strings and fractions are misuse. */
static int l_checkid(lua_State *L, int arg, int n)
{
    if (lua_type(L, arg) != LUA_TNUMBER)
        luaL_typeerror(L, arg, "integer token id");
    int isint = 0;
    lua_Integer id = lua_tointegerx(L, arg, &isint);
    if (!isint)
        luaL_argerror(L, arg, "token id must be an integer");
    if (id < 0 || id >= n)
        luaL_argerror(L, arg, lua_pushfstring(L, "token id %I out of range [0, %d)", (LUAI_UACINT)id, n));
    return (int)id;
}

/* Optional 1-based row at arg; a single-row Logits needs none. */
static float *l_optrow(lua_State *L, LLogits *lg, int arg, int *row0)
{
    lua_Integer r = 1;
    if (!lua_isnoneornil(L, arg)) {
        if (lua_type(L, arg) != LUA_TNUMBER)
            luaL_typeerror(L, arg, "integer row");
        int isint = 0;
        r = lua_tointegerx(L, arg, &isint);
        if (!isint)
            luaL_argerror(L, arg, "row must be an integer");
    } else if (lg->rows != 1) {
        luaL_argerror(L, arg, lua_pushfstring(L, "row expected: this Logits has %d rows", lg->rows));
    }
    if (r < 1 || r > lg->rows)
        luaL_argerror(L, arg, lua_pushfstring(L, "row %I out of range [1, %d]", (LUAI_UACINT)r, lg->rows));
    if (row0) *row0 = (int)(r - 1);
    return lg->data + (size_t)(r - 1) * (size_t)lg->n;
}

/* In-place methods work on single-row Logits (one position's scores). */
static LLogits *l_check1(lua_State *L, int idx)
{
    LLogits *lg = l_check(L, idx);
    if (lg->rows != 1)
        luaL_argerror(L, idx, lua_pushfstring(L, "single-row Logits expected (this one has %d rows; use l:row(i))", lg->rows));
    return lg;
}

static double l_checkfinite(lua_State *L, int arg, const char *what)
{
    double v = luaL_checknumber(L, arg);
    if (!isfinite(v))
        luaL_argerror(L, arg, lua_pushfstring(L, "%s must be a finite number", what));
    return v;
}

static int l_optminkeep(lua_State *L, int arg)
{
    if (lua_isnoneornil(L, arg)) return 1;
    if (lua_type(L, arg) != LUA_TNUMBER)
        luaL_typeerror(L, arg, "integer min_keep");
    int isint = 0;
    lua_Integer k = lua_tointegerx(L, arg, &isint);
    if (!isint || k < 0)
        luaL_argerror(L, arg, "min_keep must be a non-negative integer");
    return k > INT_MAX ? INT_MAX : (int)k;
}

/* Scratch memory owned by the Lua stack (freed by the GC even on error). */
static void *l_scratch(lua_State *L, size_t count, size_t size)
{
    if (count == 0) count = 1;
    if (count > SIZE_MAX / size)
        luaL_error(L, "kvlua.Logits: scratch size overflow");
    return lua_newuserdatauv(L, count * size, 0);
}

/* ------------------------------------------------------------------------
 * Ordering: (key, id) pairs, ascending key, ties by lower id.
 * Descending logits use key = -logit (negation is exact).
 * ------------------------------------------------------------------------ */

typedef struct {
    float key;
    int id;
} LPair;

static inline int l_less(const LPair *a, const LPair *b)
{
    return a->key < b->key || (a->key == b->key && a->id < b->id);
}

static int l_pair_cmp(const void *pa, const void *pb)
{
    const LPair *a = (const LPair *)pa, *b = (const LPair *)pb;
    return l_less(a, b) ? -1 : (l_less(b, a) ? 1 : 0);
}

static inline void l_swap(LPair *a, LPair *b)
{
    LPair t = *a;
    *a = *b;
    *b = t;
}

/* Rearranges p[0..m) so that p[k] is the element of rank k, every element
   before it is smaller and every one after it larger (nth_element). Keys
   with ids are all distinct, so ties cannot degrade the partition. */
static void l_select(LPair *p, size_t m, size_t k)
{
    size_t lo = 0, hi = m; /* [lo, hi) holds rank k */
    while (hi - lo > 16) {
        size_t mid = lo + (hi - lo) / 2, last = hi - 1;
        /* median of three to p[mid] */
        if (l_less(&p[mid], &p[lo])) l_swap(&p[mid], &p[lo]);
        if (l_less(&p[last], &p[lo])) l_swap(&p[last], &p[lo]);
        if (l_less(&p[last], &p[mid])) l_swap(&p[last], &p[mid]);
        LPair pivot = p[mid];
        l_swap(&p[mid], &p[last]);
        size_t store = lo;
        for (size_t i = lo; i < last; i++)
            if (l_less(&p[i], &pivot))
                l_swap(&p[i], &p[store++]);
        l_swap(&p[store], &p[last]);
        if (store == k) return;
        if (k < store) hi = store;
        else lo = store + 1;
    }
    /* small range: insertion sort */
    for (size_t i = lo + 1; i < hi; i++) {
        LPair v = p[i];
        size_t j = i;
        while (j > lo && l_less(&v, &p[j - 1])) {
            p[j] = p[j - 1];
            j--;
        }
        p[j] = v;
    }
}

/* Given p[0..have) already the `have` smallest, sorted, make p[0..want)
   the `want` smallest, sorted (want <= m). */
static void l_sorted_prefix(LPair *p, size_t m, size_t have, size_t want)
{
    if (want > m) want = m;
    if (want <= have) return;
    if (want < m)
        l_select(p + have, m - have, want - have - 1);
    qsort(p + have, want - have, sizeof(LPair), l_pair_cmp);
}

/* The k smallest pairs of a stream, with a max-heap of k entries whose root
   is the worst kept: one comparison rejects most entries, so selecting a
   small k from a large vocabulary is one cheap pass with no n-sized
   scratch. */
#define L_HEAP_MAX_K 4096

static void l_heap_sift_down(LPair *h, size_t size, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, big = i;
        if (l < size && l_less(&h[big], &h[l])) big = l;
        if (r < size && l_less(&h[big], &h[r])) big = r;
        if (big == i) return;
        l_swap(&h[i], &h[big]);
        i = big;
    }
}

static void l_heap_offer(LPair *h, size_t *size, size_t k, LPair v)
{
    if (*size < k) {
        size_t i = (*size)++;
        h[i] = v;
        while (i > 0) { /* sift up */
            size_t parent = (i - 1) / 2;
            if (!l_less(&h[parent], &h[i])) break;
            l_swap(&h[parent], &h[i]);
            i = parent;
        }
    } else if (l_less(&v, &h[0])) {
        h[0] = v;
        l_heap_sift_down(h, *size, 0);
    }
}

/* Gathers candidates (x > -inf; NaN is never one) of row x[0..n) as
   (-x, id) pairs. Returns their count. */
static size_t l_gather_desc(const float *x, int n, LPair *p)
{
    size_t m = 0;
    for (int i = 0; i < n; i++)
        if (x[i] > -INFINITY) {
            p[m].key = -x[i];
            p[m].id = i;
            m++;
        }
    return m;
}

static int l_has_nonfinite(const float *x, int n)
{
    for (int i = 0; i < n; i++)
        if (isnan(x[i]) || x[i] == INFINITY) return 1;
    return 0;
}

/* Keeps the ids of p[0..keep) and masks every other entry of x to -inf. */
static void l_mask_except(float *x, int n, const LPair *p, size_t keep, lua_State *L)
{
    unsigned char *k = (unsigned char *)l_scratch(L, (size_t)n, 1);
    memset(k, 0, (size_t)n);
    for (size_t i = 0; i < keep; i++)
        k[p[i].id] = 1;
    for (int i = 0; i < n; i++)
        if (!k[i]) x[i] = -INFINITY;
    lua_pop(L, 1);
}

/* Softmax over the candidates of x: max and sum of exp(x - max), double. */
static double l_row_max(const float *x, int n)
{
    double mx = -INFINITY;
    for (int i = 0; i < n; i++)
        if (x[i] > mx) mx = x[i];
    return mx;
}

/* log softmax(x)[id] of row r, as (x - max) - log(sum(exp(x - max))) so
   large logits keep their precision; max and the log-sum are cached. NaN
   when the row holds NaN or +inf, -inf for a masked entry. */
static double l_row_logprob(LLogits *lg, int r, int id)
{
    const float *x = lg->data + (size_t)r * (size_t)lg->n;
    double *c = lg->lse + 2 * (size_t)r;
    if (isnan(c[0])) {
        int n = lg->n;
        if (l_has_nonfinite(x, n))
            return NAN; /* not cached: NAN means "compute" */
        double mx = l_row_max(x, n);
        double s = 0.0;
        if (mx > -INFINITY)
            for (int i = 0; i < n; i++)
                s += exp((double)x[i] - mx);
        c[0] = mx;
        c[1] = mx > -INFINITY ? log(s) : 0.0;
    }
    if (x[id] == -INFINITY) return -INFINITY;
    return ((double)x[id] - c[0]) - c[1];
}

/* ------------------------------------------------------------------------
 * Read-only methods
 * ------------------------------------------------------------------------ */

/* l:argmax([row]) -> id (the lowest id among equal maxima; NaN never wins) */
static int l_argmax(lua_State *L)
{
    LLogits *lg = l_check(L, 1);
    const float *x = l_optrow(L, lg, 2, NULL);
    int best = 0;
    for (int i = 1; i < lg->n; i++)
        if (x[i] > x[best] || (isnan(x[best]) && !isnan(x[i])))
            best = i;
    lua_pushinteger(L, best);
    return 1;
}

/* l:topk(k [, row]) -> ids, values (descending; ties: lower id first;
   NaN entries come last) */
static int l_topk(lua_State *L)
{
    LLogits *lg = l_check(L, 1);
    lua_Integer k = luaL_checkinteger(L, 2);
    const float *x = l_optrow(L, lg, 3, NULL);
    if (k < 0)
        luaL_argerror(L, 2, "k must be >= 0");
    if (k > lg->n) k = lg->n;
    int n = lg->n;
    size_t kk = (size_t)k;
    if (kk <= L_HEAP_MAX_K) {
        LPair *h = (LPair *)l_scratch(L, kk, sizeof(LPair));
        size_t size = 0;
        for (int i = 0; i < n; i++)
            if (!isnan(x[i])) {
                LPair v = {-x[i], i};
                l_heap_offer(h, &size, kk, v);
            }
        qsort(h, size, sizeof(LPair), l_pair_cmp);
        for (int i = 0; i < n && size < kk; i++) /* NaNs rank last */
            if (isnan(x[i])) {
                h[size].key = INFINITY;
                h[size].id = i;
                size++;
            }
        lua_createtable(L, (int)kk, 0);
        lua_createtable(L, (int)kk, 0);
        for (size_t i = 0; i < kk; i++) {
            lua_pushinteger(L, h[i].id);
            lua_rawseti(L, -3, (lua_Integer)i + 1);
            lua_pushnumber(L, x[h[i].id]);
            lua_rawseti(L, -2, (lua_Integer)i + 1);
        }
        return 2;
    }
    LPair *p = (LPair *)l_scratch(L, (size_t)n, sizeof(LPair));
    size_t m = 0; /* non-NaN entries first, keyed -x ... */
    for (int i = 0; i < n; i++)
        if (!isnan(x[i])) {
            p[m].key = -x[i];
            p[m].id = i;
            m++;
        }
    size_t w = m; /* ... then NaN entries, in id order, ranked last */
    for (int i = 0; i < n && w < (size_t)n; i++)
        if (isnan(x[i])) {
            p[w].key = INFINITY;
            p[w].id = i;
            w++;
        }
    l_sorted_prefix(p, m, 0, kk < m ? kk : m);
    lua_createtable(L, (int)kk, 0);
    lua_createtable(L, (int)kk, 0);
    for (size_t i = 0; i < kk; i++) {
        lua_pushinteger(L, p[i].id);
        lua_rawseti(L, -3, (lua_Integer)i + 1);
        lua_pushnumber(L, x[p[i].id]);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    return 2;
}

/* l:get(id [, row]) -> number */
static int l_get(lua_State *L)
{
    LLogits *lg = l_check(L, 1);
    int id = l_checkid(L, 2, lg->n);
    const float *x = l_optrow(L, lg, 3, NULL);
    lua_pushnumber(L, x[id]);
    return 1;
}

/* l:logprob(id [, row]) -> log softmax(x)[id] (NaN if non-finite logits) */
static int l_logprob(lua_State *L)
{
    LLogits *lg = l_check(L, 1);
    int id = l_checkid(L, 2, lg->n);
    int r = 0;
    l_optrow(L, lg, 3, &r);
    lua_pushnumber(L, l_row_logprob(lg, r, id));
    return 1;
}

/* l:row(i) -> new single-row Logits holding row i (1-based) */
static int l_row(lua_State *L)
{
    LLogits *lg = l_check(L, 1);
    luaL_checkinteger(L, 2);
    int r = 0;
    const float *x = l_optrow(L, lg, 2, &r);
    LLogits *out = l_push_raw(L, lg->n, 1);
    memcpy(out->data, x, (size_t)lg->n * sizeof(float));
    out->lse[0] = lg->lse[2 * r];
    out->lse[1] = lg->lse[2 * r + 1];
    return 1;
}

static void l_push_array(lua_State *L, const float *x, int n)
{
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_pushnumber(L, x[i]);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
}

/* l:totable() -> {x[id 0], x[id 1], ...} (element i holds id i-1); for a
   multi-row Logits an array of such rows. */
static int l_totable(lua_State *L)
{
    LLogits *lg = l_check(L, 1);
    if (lg->rows == 1) {
        l_push_array(L, lg->data, lg->n);
        return 1;
    }
    lua_createtable(L, lg->rows, 0);
    for (int r = 0; r < lg->rows; r++) {
        l_push_array(L, lg->data + (size_t)r * (size_t)lg->n, lg->n);
        lua_rawseti(L, -2, (lua_Integer)r + 1);
    }
    return 1;
}

/* l:has_nonfinite() -> true if any NaN or +inf (-inf masks are fine) */
static int l_has_nonfinite_m(lua_State *L)
{
    LLogits *lg = l_check(L, 1);
    size_t total = (size_t)lg->rows * (size_t)lg->n;
    int bad = 0;
    for (size_t i = 0; i < total && !bad; i++)
        bad = isnan(lg->data[i]) || lg->data[i] == INFINITY;
    lua_pushboolean(L, bad);
    return 1;
}

/* l:count() -> number of candidates (entries > -inf) of a single row */
static int l_count(lua_State *L)
{
    LLogits *lg = l_check(L, 1);
    const float *x = l_optrow(L, lg, 2, NULL);
    lua_Integer c = 0;
    for (int i = 0; i < lg->n; i++)
        if (x[i] > -INFINITY) c++;
    lua_pushinteger(L, c);
    return 1;
}

/* ------------------------------------------------------------------------
 * In-place methods (single row); each returns the Logits itself
 * ------------------------------------------------------------------------ */

/* l:clone() -> an independent copy */
static int l_clone(lua_State *L)
{
    LLogits *lg = l_check(L, 1);
    LLogits *out = l_push_raw(L, lg->n, lg->rows);
    memcpy(out->data, lg->data, (size_t)lg->rows * (size_t)lg->n * sizeof(float));
    memcpy(out->lse, lg->lse, 2 * (size_t)lg->rows * sizeof(double));
    return 1;
}

/* l:set(id, v) */
static int l_set(lua_State *L)
{
    LLogits *lg = l_check1(L, 1);
    int id = l_checkid(L, 2, lg->n);
    double v = luaL_checknumber(L, 3);
    lg->data[id] = (float)v;
    l_invalidate(lg);
    lua_settop(L, 1);
    return 1;
}

/* l:scale(f [, shift=0]): x = (x - shift) * f for every entry, computed in
   double (f > 0 and finite, shift finite; masks stay -inf). A result past
   the float range becomes +-inf: with shift = the max, only -inf (masked),
   so a tiny temperature reads as its limit, the argmax. */
static int l_scale(lua_State *L)
{
    LLogits *lg = l_check1(L, 1);
    double f = l_checkfinite(L, 2, "scale factor");
    if (!(f > 0))
        luaL_argerror(L, 2, "scale factor must be > 0");
    double shift = lua_isnoneornil(L, 3) ? 0.0 : l_checkfinite(L, 3, "shift");
    for (int i = 0; i < lg->n; i++) {
        if (!(lg->data[i] > -INFINITY)) continue; /* masked (or NaN) */
        double v = ((double)lg->data[i] - shift) * f;
        lg->data[i] = v < -FLT_MAX ? -INFINITY : v > FLT_MAX ? INFINITY : (float)v;
    }
    l_invalidate(lg);
    lua_settop(L, 1);
    return 1;
}

static int l_int_cmp(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* l:penalize(ids, repeat_penalty, freq, presence)
   For each distinct id with count c in ids (llama.cpp penalties sampler):
     x = x <= 0 ? x * rp : x / rp;  x -= c * freq + presence */
static int l_penalize(lua_State *L)
{
    LLogits *lg = l_check1(L, 1);
    luaL_checktype(L, 2, LUA_TTABLE);
    double rp = l_checkfinite(L, 3, "repeat penalty");
    double freq = lua_isnoneornil(L, 4) ? 0.0 : l_checkfinite(L, 4, "frequency penalty");
    double pres = lua_isnoneornil(L, 5) ? 0.0 : l_checkfinite(L, 5, "presence penalty");
    if (!(rp > 0))
        luaL_argerror(L, 3, "repeat penalty must be > 0");
    lua_Integer m = luaL_len(L, 2);
    if (m < 0 || m > INT_MAX)
        luaL_argerror(L, 2, "bad length");
    int *ids = (int *)l_scratch(L, (size_t)m, sizeof(int));
    int top = lua_gettop(L);
    for (lua_Integer i = 0; i < m; i++) {
        lua_rawgeti(L, 2, i + 1);
        int isint = 0;
        lua_Integer id = lua_tointegerx(L, -1, &isint);
        if (lua_type(L, -1) != LUA_TNUMBER || !isint)
            luaL_argerror(L, 2, lua_pushfstring(L, "element %I is not an integer token id", (LUAI_UACINT)(i + 1)));
        if (id < 0 || id >= lg->n)
            luaL_argerror(L, 2, lua_pushfstring(L, "element %I: token id %I out of range [0, %d)", (LUAI_UACINT)(i + 1), (LUAI_UACINT)id, lg->n));
        ids[i] = (int)id;
        lua_settop(L, top);
    }
    if (m > 0 && !(rp == 1.0 && freq == 0.0 && pres == 0.0)) {
        /* count by sorting the ids: m is small (last_n), no vocab-sized map */
        qsort(ids, (size_t)m, sizeof(int), l_int_cmp);
        float *x = lg->data;
        for (lua_Integer i = 0; i < m;) {
            lua_Integer j = i;
            while (j < m && ids[j] == ids[i]) j++;
            float c = (float)(j - i);
            float v = x[ids[i]];
            v = v <= 0 ? v * (float)rp : v / (float)rp;
            v -= c * (float)freq + (float)pres;
            x[ids[i]] = v;
            i = j;
        }
        l_invalidate(lg);
    }
    lua_settop(L, 1);
    return 1;
}

/* l:keep_top_k(k): keep the k best candidates (k <= 0: no-op) */
static int l_keep_top_k(lua_State *L)
{
    LLogits *lg = l_check1(L, 1);
    lua_Integer k = luaL_checkinteger(L, 2);
    if (k <= 0) {
        lua_settop(L, 1);
        return 1;
    }
    int n = lg->n;
    float *x = lg->data;
    if (k <= L_HEAP_MAX_K) {
        /* the k-th best candidate bounds what is kept */
        LPair *h = (LPair *)l_scratch(L, (size_t)k, sizeof(LPair));
        size_t size = 0;
        for (int i = 0; i < n; i++)
            if (x[i] > -INFINITY) {
                LPair v = {-x[i], i};
                l_heap_offer(h, &size, (size_t)k, v);
            }
        if (size == (size_t)k) {
            LPair worst = h[0];
            for (int i = 0; i < n; i++) {
                LPair v = {-x[i], i};
                if (!(x[i] > -INFINITY) || l_less(&worst, &v))
                    x[i] = -INFINITY;
            }
            l_invalidate(lg);
        }
        lua_settop(L, 1);
        return 1;
    }
    LPair *p = (LPair *)l_scratch(L, (size_t)n, sizeof(LPair));
    size_t m = l_gather_desc(x, n, p);
    if ((size_t)k < m) {
        l_select(p, m, (size_t)k - 1);
        l_mask_except(x, n, p, (size_t)k, L);
        l_invalidate(lg);
    }
    lua_settop(L, 1);
    return 1;
}

/* Softmax over the candidates of x: max (returned) and *sum of exp(x - max),
   both double, summed in id order. */
static double l_softmax_stats(const float *x, int n, double *sum)
{
    double mx = l_row_max(x, n), s = 0.0;
    if (mx > -INFINITY)
        for (int i = 0; i < n; i++)
            if (x[i] > -INFINITY) s += exp((double)x[i] - mx);
    *sum = s;
    return mx;
}

static size_t l_count_candidates(const float *x, int n)
{
    size_t m = 0;
    for (int i = 0; i < n; i++)
        if (x[i] > -INFINITY) m++;
    return m;
}

/* Grows the sorted prefix of p[0..m) in steps (256, then x4) while walking
   it; calls back per pair with its rank i. Returns the kept count: the
   first rank where `done` holds, plus one; m if it never does. */
typedef int (*l_walk_fn)(const LPair *e, size_t i, void *ud);
static size_t l_walk_sorted(LPair *p, size_t m, l_walk_fn step, void *ud)
{
    size_t have = 0, want = m < 256 ? m : 256;
    l_sorted_prefix(p, m, have, want);
    have = want;
    for (size_t i = 0; i < m; i++) {
        if (i == have) {
            want = have * 4 < m ? have * 4 : m;
            l_sorted_prefix(p, m, have, want);
            have = want;
        }
        if (step(&p[i], i, ud)) return i + 1;
    }
    return m;
}

typedef struct {
    const float *x;
    double mx, sum, p, cum, H;
    size_t min_keep;
} LWalk;

static int l_top_p_step(const LPair *e, size_t i, void *ud)
{
    LWalk *w = (LWalk *)ud;
    w->cum += exp((double)w->x[e->id] - w->mx) / w->sum;
    return w->cum >= w->p && i + 1 >= w->min_keep;
}

/* The start both p-filters share: reads (p [, min_keep]) and returns the
   number of Lua results when the call is already answered (p >= 1 or no
   finite candidate: the Logits itself; NaN/+Inf: nil, message), else 0. */
static int l_keep_p_start(lua_State *L, LLogits **lg, double *pp, int *min_keep, size_t *m)
{
    *lg = l_check1(L, 1);
    *pp = luaL_checknumber(L, 2);
    if (isnan(*pp))
        luaL_argerror(L, 2, "p must be a number");
    *min_keep = l_optminkeep(L, 3);
    if (*pp >= 1.0) {
        lua_settop(L, 1);
        return 1;
    }
    if (l_has_nonfinite((*lg)->data, (*lg)->n)) {
        lua_pushnil(L);
        lua_pushliteral(L, "non-finite logits");
        return 2;
    }
    *m = l_count_candidates((*lg)->data, (*lg)->n);
    if (*m == 0) {
        lua_settop(L, 1);
        return 1;
    }
    return 0;
}

/* l:keep_top_p(p [, min_keep=1]) -> l | nil, "non-finite logits"
   Smallest prefix (by descending probability) whose cumulative probability
   reaches p, with at least min_keep entries. p >= 1: no-op. */
static int l_keep_top_p(lua_State *L)
{
    LLogits *lg;
    double pp;
    int min_keep;
    size_t m;
    int done = l_keep_p_start(L, &lg, &pp, &min_keep, &m);
    if (done)
        return done;
    float *x = lg->data;
    int n = lg->n;
    LPair *p = (LPair *)l_scratch(L, m, sizeof(LPair));
    l_gather_desc(x, n, p);
    LWalk w = {x, 0, 0, pp, 0, 0, (size_t)min_keep};
    w.mx = l_softmax_stats(x, n, &w.sum);
    size_t last = l_walk_sorted(p, m, l_top_p_step, &w);
    if (last < m) {
        LPair bound = p[last - 1]; /* the worst kept, in (-x, id) order */
        for (int i = 0; i < n; i++) {
            LPair v = {-x[i], i};
            if (!(x[i] > -INFINITY) || l_less(&bound, &v))
                x[i] = -INFINITY;
        }
        l_invalidate(lg);
    }
    lua_settop(L, 1);
    return 1;
}

/* l:keep_min_p(p [, min_keep=1]) -> l
   Keeps candidates with x >= max + log(p) (prob >= p * max prob), at least
   max(min_keep, 1) of them (the best). p <= 0: no-op. */
static int l_keep_min_p(lua_State *L)
{
    LLogits *lg = l_check1(L, 1);
    double pp = luaL_checknumber(L, 2);
    if (isnan(pp))
        luaL_argerror(L, 2, "p must be a number");
    int min_keep = l_optminkeep(L, 3);
    int n = lg->n;
    float *x = lg->data;
    if (pp <= 0.0) {
        lua_settop(L, 1);
        return 1;
    }
    float mx = -INFINITY;
    size_t m = 0;
    for (int i = 0; i < n; i++)
        if (x[i] > -INFINITY) {
            m++;
            if (x[i] > mx) mx = x[i];
        }
    if (m == 0) {
        lua_settop(L, 1);
        return 1;
    }
    const float min_logit = mx + logf((float)pp); /* as llama.cpp: float */
    size_t above = 0;
    for (int i = 0; i < n; i++)
        if (x[i] > -INFINITY && x[i] >= min_logit) above++;
    size_t keep = above;
    if (keep < (size_t)min_keep) keep = (size_t)min_keep;
    if (keep < 1) keep = 1;
    if (keep > m) keep = m;
    if (keep == above) {
        for (int i = 0; i < n; i++)
            if (!(x[i] >= min_logit)) x[i] = -INFINITY;
    } else if (keep < m) {
        LPair *p = (LPair *)l_scratch(L, (size_t)n, sizeof(LPair));
        m = l_gather_desc(x, n, p);
        l_select(p, m, keep - 1);
        l_mask_except(x, n, p, keep, L);
    }
    l_invalidate(lg);
    lua_settop(L, 1);
    return 1;
}

/* Typical-sampling key of a candidate: |-log p - H|, as a float. */
static float l_typical_key(const LWalk *w, float xv)
{
    double q = exp((double)xv - w->mx) / w->sum;
    return q > 0 ? (float)fabs(-log(q) - w->H) : INFINITY;
}

static int l_typical_step(const LPair *e, size_t i, void *ud)
{
    LWalk *w = (LWalk *)ud;
    w->cum += exp((double)w->x[e->id] - w->mx) / w->sum;
    return w->cum > w->p && (w->min_keep == 0 || i + 1 >= w->min_keep);
}

/* l:keep_typical(p [, min_keep=1]) -> l | nil, "non-finite logits"
   Locally typical sampling: order candidates by |-log p_i - H| ascending,
   keep the prefix whose cumulative probability first exceeds p (at least
   min_keep). p >= 1: no-op. */
static int l_keep_typical(lua_State *L)
{
    LLogits *lg;
    double pp;
    int min_keep;
    size_t m;
    int done = l_keep_p_start(L, &lg, &pp, &min_keep, &m);
    if (done)
        return done;
    float *x = lg->data;
    int n = lg->n;
    LWalk w = {x, 0, 0, pp, 0, 0, (size_t)min_keep};
    w.mx = l_softmax_stats(x, n, &w.sum);
    for (int i = 0; i < n; i++) /* entropy */
        if (x[i] > -INFINITY) {
            double q = exp((double)x[i] - w.mx) / w.sum;
            if (q > 0) w.H -= q * log(q);
        }
    LPair *p = (LPair *)l_scratch(L, m, sizeof(LPair));
    size_t j = 0;
    for (int i = 0; i < n; i++)
        if (x[i] > -INFINITY) {
            p[j].key = l_typical_key(&w, x[i]);
            p[j].id = i;
            j++;
        }
    size_t last = l_walk_sorted(p, m, l_typical_step, &w);
    if (last < m) {
        LPair bound = p[last - 1]; /* the last kept, in (key, id) order */
        for (int i = 0; i < n; i++) {
            if (!(x[i] > -INFINITY)) continue;
            LPair v = {l_typical_key(&w, x[i]), i};
            if (l_less(&bound, &v)) x[i] = -INFINITY;
        }
        l_invalidate(lg);
    }
    lua_settop(L, 1);
    return 1;
}

/* l:softmax_sample(u) -> id | nil, message
   Inverse-CDF sample over the softmax of the candidates, walking ids in
   ascending order, for a uniform u in [0, 1). */
static int l_softmax_sample(lua_State *L)
{
    LLogits *lg = l_check1(L, 1);
    double u = luaL_checknumber(L, 2);
    if (!(u >= 0.0 && u < 1.0))
        luaL_argerror(L, 2, "u must be in [0, 1)");
    const float *x = lg->data;
    int n = lg->n;
    if (l_has_nonfinite(x, n)) {
        lua_pushnil(L);
        lua_pushliteral(L, "non-finite logits");
        return 2;
    }
    double mx = l_row_max(x, n);
    if (mx == -INFINITY) {
        lua_pushnil(L);
        lua_pushliteral(L, "no candidates (every logit is -inf)");
        return 2;
    }
    double s = 0.0;
    for (int i = 0; i < n; i++)
        if (x[i] > -INFINITY) s += exp((double)x[i] - mx);
    double target = u * s, cum = 0.0;
    int last = -1;
    for (int i = 0; i < n; i++) {
        if (!(x[i] > -INFINITY)) continue;
        double w = exp((double)x[i] - mx);
        if (w <= 0) continue;
        last = i;
        cum += w;
        if (cum > target) {
            lua_pushinteger(L, i);
            return 1;
        }
    }
    lua_pushinteger(L, last); /* rounding: u*s reached the total */
    return 1;
}

/* ------------------------------------------------------------------------
 * Metamethods and registration
 * ------------------------------------------------------------------------ */

static int l_tostring(lua_State *L)
{
    LLogits *lg = l_check(L, 1);
    lua_pushfstring(L, "kvlua.Logits(n=%d, rows=%d): %p", lg->n, lg->rows, (void *)lg);
    return 1;
}

static int l_len(lua_State *L)
{
    lua_pushinteger(L, l_check(L, 1)->n);
    return 1;
}

/* __index: fields n and rows, else the methods table (upvalue 1) */
static int l_index(lua_State *L)
{
    LLogits *lg = l_check(L, 1);
    const char *k = lua_tostring(L, 2);
    if (k && lua_type(L, 2) == LUA_TSTRING) {
        if (strcmp(k, "n") == 0) {
            lua_pushinteger(L, lg->n);
            return 1;
        }
        if (strcmp(k, "rows") == 0) {
            lua_pushinteger(L, lg->rows);
            return 1;
        }
    }
    lua_pushvalue(L, 2);
    lua_rawget(L, lua_upvalueindex(1));
    return 1;
}

static const luaL_Reg l_methods[] = {
    {"argmax", l_argmax},
    {"topk", l_topk},
    {"get", l_get},
    {"logprob", l_logprob},
    {"row", l_row},
    {"totable", l_totable},
    {"has_nonfinite", l_has_nonfinite_m},
    {"count", l_count},
    {"clone", l_clone},
    {"set", l_set},
    {"scale", l_scale},
    {"penalize", l_penalize},
    {"keep_top_k", l_keep_top_k},
    {"keep_top_p", l_keep_top_p},
    {"keep_min_p", l_keep_min_p},
    {"keep_typical", l_keep_typical},
    {"softmax_sample", l_softmax_sample},
    {NULL, NULL},
};

void l_logits_open(lua_State *L)
{
    if (luaL_newmetatable(L, L_LOGITS_MT)) {
        luaL_newlib(L, l_methods);
        lua_pushcclosure(L, l_index, 1);
        lua_setfield(L, -2, "__index");
        lua_pushcfunction(L, l_tostring);
        lua_setfield(L, -2, "__tostring");
        lua_pushcfunction(L, l_len);
        lua_setfield(L, -2, "__len");
        lua_pushliteral(L, "kvlua.Logits");
        lua_setfield(L, -2, "__name");
    }
    lua_pop(L, 1);
}

/* Reads the numbers of the array at idx into out[0..n) (n already checked) */
static void l_read_numbers(lua_State *L, int idx, float *out, int n, int arg, int row)
{
    for (int i = 0; i < n; i++) {
        lua_rawgeti(L, idx, (lua_Integer)i + 1);
        int isnum = 0;
        lua_Number v = lua_tonumberx(L, -1, &isnum);
        if (!isnum || lua_type(L, -1) != LUA_TNUMBER) {
            if (row > 0)
                luaL_argerror(L, arg, lua_pushfstring(L, "row %d, element %d is not a number", row, i + 1));
            luaL_argerror(L, arg, lua_pushfstring(L, "element %d is not a number", i + 1));
        }
        out[i] = (float)v;
        lua_pop(L, 1);
    }
}

int l_logits_new(lua_State *L)
{
    luaL_checktype(L, 1, LUA_TTABLE);
    lua_Integer len = (lua_Integer)lua_rawlen(L, 1);
    if (len < 1)
        luaL_argerror(L, 1, "non-empty array expected");
    if (len > INT_MAX)
        luaL_argerror(L, 1, "array too long");
    lua_rawgeti(L, 1, 1);
    int nested = lua_type(L, -1) == LUA_TTABLE;
    lua_pop(L, 1);
    if (!nested) {
        float *x = l_logits_push(L, (int)len, 1); /* at index 2 */
        l_read_numbers(L, 1, x, (int)len, 1, 0);
        return 1;
    }
    int rows = (int)len;
    lua_rawgeti(L, 1, 1);
    lua_Integer n = (lua_Integer)lua_rawlen(L, -1);
    lua_pop(L, 1);
    if (n < 1 || n > INT_MAX)
        luaL_argerror(L, 1, "rows must be non-empty arrays");
    float *x = l_logits_push(L, (int)n, rows);
    for (int r = 0; r < rows; r++) {
        lua_rawgeti(L, 1, (lua_Integer)r + 1);
        if (lua_type(L, -1) != LUA_TTABLE || (lua_Integer)lua_rawlen(L, -1) != n)
            luaL_argerror(L, 1, lua_pushfstring(L, "row %d is not an array of %d numbers", r + 1, (int)n));
        l_read_numbers(L, lua_gettop(L), x + (size_t)r * (size_t)n, (int)n, 1, r + 1);
        lua_pop(L, 1);
    }
    return 1;
}
