/*
 * l_cache.c — the Cache userdata: kvlua.cache(model, opts) and its methods.
 *
 *   local c = kvlua.cache(model, { pages = 512 | bytes = 64 << 20, page_tokens = 16,
 *                                  ktype = "f16", vtype = "f16", prefix = true,
 *                                  policy = function(candidates, need) ... end })
 *   local s = model:session{ ctx = 4096, cache = c }
 *   c:stats()  c:lookup(ids)  c:pin(ids)  c:unpin(ids)  c:clear()  c:close()
 *   c:save(path, { key =, prefixes = })  (a cache file; kvlua.restore(model, path, { cache = c2 }) reads it)
 *
 * Lifetimes (as for sessions and models): a Cache keeps its Model alive
 * (user value 1, and the model's engine object counts it as a user); a
 * session drawing from a Cache keeps the Cache alive. c:close() drops the
 * owner's reference: sessions still using the pool keep it (and its
 * policy) working; new sessions cannot use a closed Cache. Methods mark
 * the Cache busy (user value 2 is its guard), so a close from a finalizer
 * in the middle of one takes effect when it returns.
 *
 * The policy contract. When a session needs pages and the cache has no free
 * page left (before the forward pass of a chunk, never during it), the
 * policy is called as policy(candidates, need) on the thread of the
 * evaluation. candidates is an array, oldest use first, of the cached pages
 * of one layer group that no session uses and that are not pinned:
 *   { id =, group =, window =, tokens =, hits =, last_use =, bytes =, pinned = false }
 * (tokens: length of the prefix the page ends; last_use: a tick that grows
 * with every page event; window: the attention window of the page's layer
 * group, 0 for full attention). need is how many pages are wanted. The
 * policy returns an array of candidates (the tables, or their ids) to
 * evict, in order. Returning fewer than need makes the evaluation return
 * nil, "cache full: ..."; an error inside the policy, or an answer naming
 * anything that is not a candidate (or one twice), raises in the caller
 * with the policy's message. Either way nothing is evicted, the session is
 * as before the call, and the cache stays usable. While the policy runs,
 * evaluating, forking or changing pins of sessions of this cache raises.
 */
#include "l_cache.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "lauxlib.h"
#include "types.h"

/* ==== helpers ================================================================ */

/* A type name at the top of the stack (raises for anything else). */
static int l_type_name(lua_State *L, const char *field) {
    size_t len = 0;
    const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, &len) : NULL;
    if (!s) luaL_error(L, "option '%s': a type must be a string (f16, f32, q8_0, q4_0)", field);
    if (strlen(s) != len) luaL_error(L, "option '%s' contains a NUL byte", field);
    int t = !strcmp(s, "f16") ? KV_TYPE_F16 : !strcmp(s, "f32") ? KV_TYPE_F32 : !strcmp(s, "q8_0") ? KV_TYPE_Q8_0
          : !strcmp(s, "q4_0") ? KV_TYPE_Q4_0 : -1;
    if (t < 0) luaL_error(L, "unknown KV cache type \"%s\" (f16, f32, q8_0, q4_0)", s);
    return t;
}

int l_kv_types(lua_State *L, int opts, const char *field, int n_layer, int *out) {
    for (int i = 0; i < n_layer; i++) out[i] = KV_TYPE_F16;
    if (lua_isnoneornil(L, opts)) return 0;
    int t = lua_getfield(L, opts, field);
    if (t == LUA_TNIL) {
        lua_pop(L, 1);
        return 0;
    }
    if (t != LUA_TTABLE) {
        int ty = l_type_name(L, field);
        for (int i = 0; i < n_layer; i++) out[i] = ty;
        lua_pop(L, 1);
        return 1;
    }
    /* { default = T, [i] = T_i } or { T, [i] = T_i }: i are 0-based layers */
    int tab = lua_gettop(L);
    bool named = lua_getfield(L, tab, "default") != LUA_TNIL;
    if (!named) {
        lua_pop(L, 1);
        lua_rawgeti(L, tab, 1);
    }
    if (lua_isnil(L, -1)) luaL_error(L, "option '%s': a per-layer table needs a default (its first item, or default =)", field);
    int def = l_type_name(L, field);
    lua_pop(L, 1);
    for (int i = 0; i < n_layer; i++) out[i] = def;
    lua_pushnil(L);
    while (lua_next(L, tab)) {
        if (lua_type(L, -2) == LUA_TSTRING && !strcmp(lua_tostring(L, -2), "default")) {
            lua_pop(L, 1);
            continue;
        }
        if (!lua_isinteger(L, -2)) luaL_error(L, "option '%s': keys are 0-based layer indices", field);
        lua_Integer il = lua_tointeger(L, -2);
        if (!named && il == 1) { /* the default itself */
            lua_pop(L, 1);
            continue;
        }
        if (il < 0 || il >= n_layer) luaL_error(L, "option '%s': layer %I out of range [0, %d)", field, il, n_layer);
        out[il] = l_type_name(L, field);
        lua_pop(L, 1);
    }
    lua_pop(L, 1);
    return 1;
}

/* Pushes the types of the cache's layers: a name when all are the same,
 * else a table { default = name, [i] = name } (0-based layers). */
static void l_push_types(lua_State *L, const kv_cache *c, bool v) {
    const int n = kv_model_info_get(kv_cache_model(c))->n_layer;
    int t0, kt, vt;
    kv_cache_types(c, 0, &kt, &vt);
    t0 = v ? vt : kt;
    bool same = true;
    for (int i = 1; i < n && same; i++) {
        kv_cache_types(c, i, &kt, &vt);
        same = (v ? vt : kt) == t0;
    }
    static const char *names[] = {"f32", "f16"};
    #define TNAME(t) ((t) == KV_TYPE_Q8_0 ? "q8_0" : (t) == KV_TYPE_Q4_0 ? "q4_0" : names[(t) == KV_TYPE_F16])
    if (same) {
        lua_pushstring(L, TNAME(t0));
        return;
    }
    lua_createtable(L, n, 1);
    lua_pushstring(L, TNAME(t0));
    lua_setfield(L, -2, "default");
    for (int i = 0; i < n; i++) {
        kv_cache_types(c, i, &kt, &vt);
        lua_pushstring(L, TNAME(v ? vt : kt));
        lua_rawseti(L, -2, i);
    }
    #undef TNAME
}

static lua_Integer l_int_field(lua_State *L, int opts, const char *field, lua_Integer def, lua_Integer lo,
                               lua_Integer hi) {
    if (lua_getfield(L, opts, field) == LUA_TNIL) {
        lua_pop(L, 1);
        return def;
    }
    int ok = 0;
    lua_Integer v = lua_tointegerx(L, -1, &ok);
    if (!ok) luaL_error(L, "option '%s' must be an integer", field);
    if (v < lo || v > hi) luaL_error(L, "option '%s' out of range: %I (%I .. %I)", field, v, lo, hi);
    lua_pop(L, 1);
    return v;
}

/* Token ids of a Lua array, checked against the vocabulary of the cache's
 * model as the session methods check them, in a userdata left on the stack. */
static int32_t *l_ids(lua_State *L, const l_cache *lc, int idx, size_t *n) {
    *n = l_ids_len(L, idx);
    return l_check_ids(L, idx, *n, kv_model_info_get(kv_cache_model(lc->c))->n_vocab);
}

#define L_CACHE_GUARD 2

static l_cache *l_cache_any(lua_State *L, int idx) { return luaL_checkudata(L, idx, L_CACHE); }

l_cache *l_cache_check(lua_State *L, int idx) {
    l_cache *lc = l_cache_any(L, idx);
    if (lc->o.closed || !lc->c) luaL_error(L, "attempt to use a closed cache");
    return lc;
}

/* The start of every method: self an open Cache, busy until it returns. */
static l_cache *l_cache_enter(lua_State *L) {
    l_cache *lc = l_cache_check(L, 1);
    l_busy(L, &lc->o, L_CACHE_GUARD);
    return lc;
}

/* Drops the owner's reference once closed and idle (sessions keep the pool). */
static void l_cache_release(l_obj *o) {
    l_cache *lc = (l_cache *)o;
    if (!o->closed || o->busy || !lc->c) return;
    kv_cache *c = lc->c;
    lc->c = NULL;
    kv_cache_close(c);
}

/* Before a method that changes the cache: not while its policy (or any
 * policy of the model: the evaluation that called it may draw from this
 * cache too) is running. */
static void l_not_in_policy(lua_State *L, const l_cache *lc, const char *what) {
    if (lc && lc->in_policy) luaL_error(L, "%s: cache busy: its eviction policy is running", what);
    if (lc) l_model_not_in_policy(L, lc->owner, what);
}

/* ==== the policy bridge ======================================================= */

typedef struct {
    l_cache *lc;
    const kv_evict_candidate *cands;
    int n, need;
    int32_t *chosen;
    int n_chosen;
} policy_call;

/* Runs protected: builds the candidates, calls the policy, reads the answer. */
static int l_policy_protected(lua_State *L) {
    policy_call *pc = lua_touserdata(L, 1);
    lua_rawgeti(L, LUA_REGISTRYINDEX, pc->lc->policy_ref);
    lua_createtable(L, pc->n, 0);
    for (int i = 0; i < pc->n; i++) {
        const kv_evict_candidate *k = &pc->cands[i];
        lua_createtable(L, 0, 8);
        lua_pushinteger(L, k->id), lua_setfield(L, -2, "id");
        lua_pushinteger(L, k->group), lua_setfield(L, -2, "group");
        lua_pushinteger(L, kv_cache_group_window(pc->lc->eng, k->group)), lua_setfield(L, -2, "window");
        lua_pushinteger(L, k->tokens), lua_setfield(L, -2, "tokens");
        lua_pushinteger(L, k->hits), lua_setfield(L, -2, "hits");
        lua_pushinteger(L, (lua_Integer)k->last_use), lua_setfield(L, -2, "last_use");
        lua_pushinteger(L, (lua_Integer)k->bytes), lua_setfield(L, -2, "bytes");
        lua_pushboolean(L, 0), lua_setfield(L, -2, "pinned");
        lua_rawseti(L, -2, i + 1);
    }
    lua_pushinteger(L, pc->need);
    lua_call(L, 2, 1);
    if (lua_type(L, -1) != LUA_TTABLE)
        return luaL_error(L, "cache policy must return an array of candidates (got %s)", luaL_typename(L, -1));
    lua_Integer m = luaL_len(L, -1);
    if (m < 0 || m > pc->n)
        return luaL_error(L, "cache policy returned %I pages to evict, but there are %d candidates", m, pc->n);
    for (lua_Integer i = 1; i <= m; i++) {
        if (lua_geti(L, -1, i) == LUA_TTABLE) {
            lua_getfield(L, -1, "id");
            lua_remove(L, -2);
        }
        int ok = 0;
        lua_Integer id = lua_tointegerx(L, -1, &ok);
        lua_pop(L, 1);
        bool cand = false, twice = false;
        for (int k = 0; ok && k < pc->n && !cand; k++) cand = pc->cands[k].id == id;
        for (lua_Integer k = 1; cand && k < i && !twice; k++) twice = pc->chosen[k - 1] == id;
        if (!cand || twice)
            return luaL_error(L, "cache policy: entry %I is not a candidate%s", i, twice ? " (named twice)" : "");
        pc->chosen[i - 1] = (int32_t)id;
    }
    pc->n_chosen = (int)m;
    return 0;
}

static kv_status l_policy_cb(void *ud, const kv_evict_candidate *cands, int n, int need, int32_t *chosen,
                             int *n_chosen, kv_error *e) {
    l_cache *lc = ud;
    lua_State *L = lc->L;
    *n_chosen = 0;
    if (!L || lc->policy_ref == LUA_NOREF)
        return kv_fail(e, KV_ERR_ARG, "cache policy: called outside an evaluation");
    if (!lua_checkstack(L, 8)) return kv_fail(e, KV_ERR_NOMEM, "cache policy: out of Lua stack");
    policy_call pc = {lc, cands, n, need, chosen, 0};
    int top = lua_gettop(L);
    lua_pushcfunction(L, l_policy_protected);
    lua_pushlightuserdata(L, &pc);
    lc->in_policy = 1;
    l_model_policy(lc->owner, 1);
    int rc = lua_pcall(L, 1, 0, 0); /* a yield inside is an error: the C caller cannot be resumed */
    l_model_policy(lc->owner, -1);
    lc->in_policy = 0;
    if (rc != LUA_OK) {
        const char *msg = lua_tostring(L, -1);
        snprintf(lc->policy_err, sizeof lc->policy_err, "cache policy failed: %s", msg ? msg : "(error object)");
        lc->policy_failed = 1;
        lua_settop(L, top);
        return kv_fail(e, KV_ERR_ARG, "%s", lc->policy_err);
    }
    lua_settop(L, top);
    *n_chosen = pc.n_chosen;
    return KV_OK;
}

void l_cache_before_eval(lua_State *L, l_cache *lc) {
    if (!lc) return;
    l_not_in_policy(L, lc, "evaluation");
    lc->L = L;
    lc->policy_failed = 0;
}

void l_cache_after_eval(lua_State *L, l_cache *lc) {
    if (!lc) return;
    lc->L = NULL;
    if (lc->policy_failed) {
        lc->policy_failed = 0;
        luaL_error(L, "%s", lc->policy_err);
    }
}

/* ==== kvlua.cache ============================================================= */

int l_cache_new(lua_State *L) {
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_settop(L, 2);
    int has_bytes = lua_getfield(L, 2, "bytes") != LUA_TNIL, has_pages = lua_getfield(L, 2, "pages") != LUA_TNIL;
    lua_pop(L, 2);
    if (has_bytes == has_pages) luaL_error(L, "kvlua.cache: give exactly one of 'bytes' and 'pages'");
    kv_cache_params p = {0};
    p.bytes = (uint64_t)l_int_field(L, 2, "bytes", 0, 0, (lua_Integer)1 << 50);
    p.pages = l_int_field(L, 2, "pages", 0, 0, (lua_Integer)1 << 30);
    lua_Integer pt = l_int_field(L, 2, "page_tokens", 16, 0, 1 << 16);
    if (pt <= 0 || (pt & (pt - 1))) luaL_error(L, "option 'page_tokens' must be a power of two (got %I)", pt);
    p.page_tokens = (int)pt;
    const int n_layer = kv_model_info_get(l_model_peek(L, 1))->n_layer;
    int *types = lua_newuserdatauv(L, 2 * sizeof(int) * (size_t)n_layer, 0);
    l_kv_types(L, 2, "ktype", n_layer, types);
    l_kv_types(L, 2, "vtype", n_layer, types + n_layer);
    p.ktypes = types, p.vtypes = types + n_layer;
    p.prefix = true;
    if (lua_getfield(L, 2, "prefix") != LUA_TNIL) {
        if (!lua_isboolean(L, -1)) luaL_error(L, "option 'prefix' must be a boolean");
        p.prefix = lua_toboolean(L, -1);
    }
    lua_pop(L, 1);
    int pol = lua_getfield(L, 2, "policy");
    if (pol != LUA_TNIL && pol != LUA_TFUNCTION) luaL_error(L, "option 'policy' must be a function");
    lua_pop(L, 1);

    l_cache *lc = lua_newuserdatauv(L, sizeof *lc, 2); /* born closed; user values: 1 the model, 2 the guard */
    memset(lc, 0, sizeof *lc);
    lc->o.closed = 1;
    lc->o.release = l_cache_release;
    lc->policy_ref = LUA_NOREF;
    luaL_setmetatable(L, L_CACHE);
    int ud = lua_gettop(L);
    l_guard_new(L, &lc->o, ud, L_CACHE_GUARD);
    kv_model *m = l_model_hold(L, 1, &lc->owner); /* raises for a closed model */
    lua_pushvalue(L, 1);
    lua_setiuservalue(L, ud, 1);
    kv_error e = {{0}};
    kv_cache *c = NULL;
    if (kv_cache_open(m, &p, &c, &e) != KV_OK) {
        lua_pushnil(L);
        lua_pushstring(L, e.msg);
        return 2; /* the userdata, closed, is collected later and releases the model */
    }
    lc->c = lc->eng = c;
    lc->o.closed = 0;
    if (pol == LUA_TFUNCTION) {
        lua_getfield(L, 2, "policy");
        lc->policy_ref = luaL_ref(L, LUA_REGISTRYINDEX);
        kv_cache_set_policy(c, l_policy_cb, lc);
    }
    lua_settop(L, ud);
    return 1;
}

/* ==== methods ================================================================= */

static void l_set_int(lua_State *L, const char *k, lua_Integer v) {
    lua_pushinteger(L, v);
    lua_setfield(L, -2, k);
}

static int l_cache_stats(lua_State *L) {
    l_cache *lc = l_cache_enter(L);
    kv_cache_stats st;
    kv_cache_get_stats(lc->c, &st);
    lua_createtable(L, 0, 12);
    l_set_int(L, "pages", st.pages);
    l_set_int(L, "used", st.used);
    l_set_int(L, "cached", st.cached);
    l_set_int(L, "pinned", st.pinned);
    l_set_int(L, "free", st.free);
    l_set_int(L, "hits", (lua_Integer)st.hits);
    l_set_int(L, "misses", (lua_Integer)st.misses);
    l_set_int(L, "reused_tokens", (lua_Integer)st.reused_tokens);
    l_set_int(L, "evictions", (lua_Integer)st.evictions);
    l_set_int(L, "bytes", (lua_Integer)st.bytes);
    l_set_int(L, "capacity_bytes", (lua_Integer)st.capacity_bytes);
    l_set_int(L, "page_tokens", kv_cache_page_tokens(lc->c));
    l_set_int(L, "bytes_per_token", (lua_Integer)kv_cache_bytes_per_token(lc->c));
    return 1;
}

static int l_cache_lookup(lua_State *L) {
    l_cache *lc = l_cache_enter(L);
    size_t n;
    const int32_t *ids = l_ids(L, lc, 2, &n);
    int64_t cached = 0;
    const char *why = NULL;
    kv_error e = {{0}};
    if (kv_cache_lookup(lc->c, ids, n, &cached, &why, &e) != KV_OK) {
        lua_pushnil(L);
        lua_pushstring(L, e.msg);
        return 2;
    }
    lua_createtable(L, 0, 3);
    l_set_int(L, "cached", cached);
    l_set_int(L, "tokens", (lua_Integer)n);
    if (why) {
        lua_pushstring(L, why);
        lua_setfield(L, -2, "reason");
    }
    return 1;
}

static int l_cache_pin_common(lua_State *L, bool pin) {
    l_cache *lc = l_cache_enter(L);
    l_not_in_policy(L, lc, pin ? "pin" : "unpin");
    size_t n;
    const int32_t *ids = l_ids(L, lc, 2, &n);
    kv_error e = {{0}};
    kv_status st = kv_cache_pin(lc->c, ids, n, pin, &e);
    if (st == KV_ERR_ARG) return luaL_error(L, "%s", e.msg);
    if (st != KV_OK) {
        lua_pushnil(L);
        lua_pushstring(L, e.msg);
        return 2;
    }
    lua_pushboolean(L, 1);
    return 1;
}

static int l_cache_pin(lua_State *L) { return l_cache_pin_common(L, true); }
static int l_cache_unpin(lua_State *L) { return l_cache_pin_common(L, false); }

static int l_cache_clear(lua_State *L) {
    l_cache *lc = l_cache_enter(L);
    l_not_in_policy(L, lc, "clear");
    lua_pushinteger(L, (lua_Integer)kv_cache_clear(lc->c));
    return 1;
}

/* c:save(path, { key = 32-byte string, prefixes = { {ids...}, ... } }) --> true, pages_written | nil, err:
 * a cache file of the sealed pages the prefixes reach (every sealed page
 * without prefixes); kvlua.restore(model, path, { cache = c2 }) reads it. */
static int l_cache_save(lua_State *L) {
    l_cache *lc = l_cache_enter(L);
    l_not_in_policy(L, lc, "save");
    size_t plen;
    const char *path = luaL_checklstring(L, 2, &plen);
    if (strlen(path) != plen) luaL_argerror(L, 2, "contains a NUL byte");
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    const uint8_t *key = NULL;
    if (!lua_isnoneornil(L, 3) && lua_getfield(L, 3, "key") != LUA_TNIL) {
        size_t n = 0;
        const char *k = lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, &n) : NULL;
        if (!k || n != 32) luaL_error(L, "option 'key' must be a string of 32 bytes");
        key = (const uint8_t *)k; /* stays on the stack */
    }
    const int32_t **prefixes = NULL;
    size_t *lens = NULL;
    lua_Integer np = 0;
    if (!lua_isnoneornil(L, 3) && lua_getfield(L, 3, "prefixes") != LUA_TNIL) {
        int pi = lua_gettop(L);
        if (!lua_istable(L, pi)) luaL_error(L, "option 'prefixes' must be an array of token id arrays");
        np = luaL_len(L, pi);
        if (np < 0 || np > (1 << 24)) luaL_error(L, "option 'prefixes': bad length");
        const lua_Integer n_vocab = kv_model_info_get(kv_cache_model(lc->c))->n_vocab;
        prefixes = lua_newuserdatauv(L, sizeof *prefixes * (size_t)(np ? np : 1), 0);
        lens = lua_newuserdatauv(L, sizeof *lens * (size_t)(np ? np : 1), 0);
        lua_createtable(L, (int)np, 0); /* pi + 3: holds each prefix's ids */
        for (lua_Integer i = 1; i <= np; i++) {
            if (lua_geti(L, pi, i) != LUA_TTABLE) luaL_error(L, "option 'prefixes': item %I is not an array of token ids", i);
            int ti = lua_gettop(L);
            lua_Integer len = luaL_len(L, ti);
            if (len < 0 || len > (1 << 30)) luaL_error(L, "option 'prefixes': item %I has a bad length", i);
            int32_t *ids = lua_newuserdatauv(L, sizeof(int32_t) * (size_t)(len ? len : 1), 0);
            for (lua_Integer j = 1; j <= len; j++) {
                int ok = 0;
                lua_geti(L, ti, j);
                lua_Integer v = lua_tointegerx(L, -1, &ok);
                lua_pop(L, 1);
                if (!ok) luaL_error(L, "option 'prefixes': item %I, index %I is not an integer token id", i, j);
                if (v < 0 || v >= n_vocab)
                    luaL_error(L, "option 'prefixes': item %I, index %I: token id %I out of range [0, %I)", i, j, v,
                               n_vocab);
                ids[j - 1] = (int32_t)v;
            }
            prefixes[i - 1] = ids, lens[i - 1] = (size_t)len;
            lua_rawseti(L, pi + 3, i); /* the holder keeps the ids alive */
            lua_pop(L, 1);
        }
    }
    kv_error e = {{0}};
    int64_t written = 0;
    if (kv_cache_save(lc->c, path, key, prefixes, lens, (size_t)np, &written, &e) != KV_OK) {
        lua_pushnil(L);
        lua_pushstring(L, e.msg);
        return 2;
    }
    lua_pushboolean(L, 1);
    lua_pushinteger(L, (lua_Integer)written);
    return 2;
}

/* close / __close: drops the owner's reference (sessions keep the pool). */
static int l_cache_close(lua_State *L) {
    l_obj_close(&l_cache_any(L, 1)->o);
    return 0;
}

/* __gc: nothing references the Cache any more (no session either). */
static int l_cache_gc(lua_State *L) {
    l_cache *lc = l_cache_any(L, 1);
    l_obj_finalize(&lc->o);
    if (lc->policy_ref != LUA_NOREF) {
        luaL_unref(L, LUA_REGISTRYINDEX, lc->policy_ref);
        lc->policy_ref = LUA_NOREF;
    }
    if (lc->owner) {
        void *o = lc->owner;
        lc->owner = NULL;
        l_model_unhold(o);
    }
    return 0;
}

static int l_cache_tostring(lua_State *L) {
    l_cache *lc = l_cache_any(L, 1);
    if (lc->o.closed || !lc->c) {
        lua_pushstring(L, "kvlua.Cache (closed)");
        return 1;
    }
    l_busy(L, &lc->o, L_CACHE_GUARD);
    kv_cache_stats st;
    kv_cache_get_stats(lc->c, &st);
    lua_pushfstring(L, "kvlua.Cache (%I pages: %I used, %I cached)", (lua_Integer)st.pages, (lua_Integer)st.used,
                    (lua_Integer)st.cached);
    return 1;
}

static int l_cache_index(lua_State *L) {
    l_cache *lc = l_cache_any(L, 1);
    const char *k = lua_tostring(L, 2);
    if (k && lc->c && !lc->o.closed && (!strcmp(k, "page_tokens") || !strcmp(k, "ktype") || !strcmp(k, "vtype"))) {
        l_busy(L, &lc->o, L_CACHE_GUARD);
        if (k[0] == 'p') {
            lua_pushinteger(L, kv_cache_page_tokens(lc->c));
        } else {
            l_push_types(L, lc->c, k[0] == 'v');
        }
        return 1;
    }
    if (k && !strcmp(k, "model")) {
        lua_getiuservalue(L, 1, 1);
        return 1;
    }
    lua_getmetatable(L, 1);
    lua_getfield(L, -1, "__methods");
    lua_pushvalue(L, 2);
    lua_rawget(L, -2);
    return 1;
}

static const luaL_Reg l_cache_methods[] = {
    {"stats", l_cache_stats}, {"lookup", l_cache_lookup}, {"pin", l_cache_pin}, {"unpin", l_cache_unpin},
    {"clear", l_cache_clear}, {"save", l_cache_save},     {"close", l_cache_close},
    {NULL, NULL},
};

void l_cache_open(lua_State *L) {
    l_new_class(L, L_CACHE, l_cache_methods, l_cache_index, l_cache_close, l_cache_gc, l_cache_tostring);
}
