/*
 * l_grammar.c — the Lua side of engine/grammar.c: kvlua.grammar and the
 * "kvlua.Grammar" / "kvlua.GrammarState" userdata.
 *
 *   local g, err = kvlua.grammar(gbnf [, {root = "root"}])  -- nil, "line 3, column 7: ..."
 *   local st = g:state(model)        -- the start of a sentence, for model's vocabulary
 *   local left = st:mask(logits)     -- refused tokens -> -inf; tokens left
 *   st:accept(id)                    -- true | nil, err (st unchanged)
 *   st:allows(id), st:accept_text(s), st:can_end(), st:can_continue(), st:clone(),
 *   st:allowed(), st:stats()
 *
 * Sharing: the vocabulary's trie is built once per model (a weak table in
 * the registry, keyed by the Model userdata) and the matcher (the lazily
 * built automaton and its mask cache) once per grammar and model (a weak
 * table in the Grammar's user value), so every state of a grammar on one
 * model shares its tables. The engine objects are reference counted in C:
 * a state keeps its matcher alive whatever order the collector runs
 * finalizers in. A state only needs the model while g:state builds it
 * (the model must be open then).
 *
 * Objects are born closed and opened once their engine object exists;
 * close() and __gc are one idempotent function. Misuse (a closed object,
 * a wrong argument, a token id out of range) raises; a bad grammar text
 * and a refused token return nil, message.
 */
#include <math.h>
#include <string.h>

#include <lauxlib.h>
#include <lua.h>

#include "grammar.h"
#include "kvlua.h"
#include "l_cache.h" /* l_model_peek */
#include "l_logits.h"

#define L_GRAMMAR "kvlua.Grammar"
#define L_GSTATE "kvlua.GrammarState"
#define L_GVOCAB "kvlua.GrammarVocab"
#define L_GMATCHER "kvlua.GrammarMatcher"
#define L_GVOCABS "kvlua.grammar.vocabs" /* registry: Model -> GrammarVocab (weak keys) */

typedef struct {
    kv_grammar *g;
} l_grammar;

typedef struct {
    kv_grammar_vocab *gv;
} l_gvocab;

typedef struct {
    kv_grammar_matcher *m;
} l_gmatcher;

typedef struct {
    kv_grammar_matcher *m; /* one reference, NULL once closed */
    kv_grammar_state st;
} l_gstate;

/* ==== finalizers (idempotent, never raise) ================================ */

static int l_grammar_gc(lua_State *L) {
    l_grammar *lg = luaL_checkudata(L, 1, L_GRAMMAR);
    kv_grammar_free(lg->g);
    lg->g = NULL;
    return 0;
}

static int l_gvocab_gc(lua_State *L) {
    l_gvocab *v = luaL_checkudata(L, 1, L_GVOCAB);
    kv_grammar_vocab_free(v->gv);
    v->gv = NULL;
    return 0;
}

static int l_gmatcher_gc(lua_State *L) {
    l_gmatcher *lm = luaL_checkudata(L, 1, L_GMATCHER);
    kv_grammar_matcher_free(lm->m);
    lm->m = NULL;
    return 0;
}

static int l_gstate_gc(lua_State *L) {
    l_gstate *ls = luaL_checkudata(L, 1, L_GSTATE);
    kv_grammar_matcher_free(ls->m);
    ls->m = NULL;
    return 0;
}

/* ==== kvlua.grammar ========================================================= */

static l_grammar *l_grammar_check(lua_State *L, int idx) {
    l_grammar *lg = luaL_checkudata(L, idx, L_GRAMMAR);
    if (!lg->g) luaL_error(L, "attempt to use a closed grammar");
    return lg;
}

/* kvlua.grammar(text [, {root =}]) --> Grammar | nil, message */
static int l_grammar_new(lua_State *L) {
    size_t len;
    const char *text = luaL_checklstring(L, 1, &len);
    const char *root = "root";
    if (!lua_isnoneornil(L, 2)) {
        luaL_checktype(L, 2, LUA_TTABLE);
        int t = lua_getfield(L, 2, "root");
        if (t != LUA_TNIL) {
            if (t != LUA_TSTRING) luaL_error(L, "kvlua.grammar: option 'root' must be a string");
            root = lua_tostring(L, -1);
        }
    }
    l_grammar *lg = lua_newuserdatauv(L, sizeof *lg, 1); /* born closed */
    lg->g = NULL;
    luaL_setmetatable(L, L_GRAMMAR);
    lua_newtable(L); /* Model -> GrammarMatcher, weak keys */
    lua_newtable(L);
    lua_pushliteral(L, "k");
    lua_setfield(L, -2, "__mode");
    lua_setmetatable(L, -2);
    lua_setiuservalue(L, -2, 1);
    kv_error e;
    if (kv_grammar_compile(text, len, root, &lg->g, &e) != KV_OK) {
        lua_pushnil(L);
        lua_pushstring(L, e.msg);
        return 2;
    }
    return 1;
}

/* The GrammarVocab of the model at idx (built on first use), pushed. */
static kv_grammar_vocab *l_vocab_for(lua_State *L, int idx, kv_model *m) {
    idx = lua_absindex(L, idx);
    if (luaL_getsubtable(L, LUA_REGISTRYINDEX, L_GVOCABS) == 0) {
        lua_newtable(L);
        lua_pushliteral(L, "k");
        lua_setfield(L, -2, "__mode");
        lua_setmetatable(L, -2);
    }
    lua_pushvalue(L, idx);
    if (lua_rawget(L, -2) == LUA_TUSERDATA) {
        lua_remove(L, -2);
        return ((l_gvocab *)lua_touserdata(L, -1))->gv;
    }
    lua_pop(L, 1);
    const kv_vocab *v = kv_model_vocab(m);
    if (!v) luaL_error(L, "grammar: the model has no tokenizer");
    l_gvocab *lv = lua_newuserdatauv(L, sizeof *lv, 0);
    lv->gv = NULL;
    luaL_setmetatable(L, L_GVOCAB);
    kv_error e;
    if (kv_grammar_vocab_build(v, &lv->gv, &e) != KV_OK) luaL_error(L, "%s", e.msg); /* out of memory */
    lua_pushvalue(L, idx);
    lua_pushvalue(L, -2);
    lua_rawset(L, -4);
    lua_remove(L, -2);
    return lv->gv;
}

static l_gstate *l_gstate_push(lua_State *L) {
    l_gstate *ls = lua_newuserdatauv(L, sizeof *ls, 0);
    memset(ls, 0, sizeof *ls);
    luaL_setmetatable(L, L_GSTATE);
    return ls;
}

/* g:state(model) --> GrammarState at the start of a sentence | nil, message */
static int l_grammar_state(lua_State *L) {
    l_grammar *lg = l_grammar_check(L, 1);
    kv_model *model = l_model_peek(L, 2); /* raises unless an open Model */
    lua_settop(L, 2);
    lua_getiuservalue(L, 1, 1); /* 3: matchers */
    lua_pushvalue(L, 2);
    kv_grammar_matcher *m;
    if (lua_rawget(L, 3) == LUA_TUSERDATA) {
        m = ((l_gmatcher *)lua_touserdata(L, -1))->m;
    } else {
        lua_pop(L, 1);
        kv_grammar_vocab *gv = l_vocab_for(L, 2, model); /* 4 */
        l_gmatcher *lm = lua_newuserdatauv(L, sizeof *lm, 1);
        lm->m = NULL;
        luaL_setmetatable(L, L_GMATCHER);
        lua_pushvalue(L, 4);
        lua_setiuservalue(L, -2, 1); /* not needed by C (refcounts), kept for memory accounting */
        kv_error e;
        if (kv_grammar_matcher_new(lg->g, gv, &lm->m, &e) != KV_OK) luaL_error(L, "%s", e.msg);
        lua_pushvalue(L, 2);
        lua_pushvalue(L, -2);
        lua_rawset(L, 3);
        m = lm->m;
    }
    l_gstate *ls = l_gstate_push(L);
    kv_error e;
    kv_grammar_state st;
    if (kv_grammar_start(m, &st, &e) != KV_OK) {
        lua_pushnil(L);
        lua_pushstring(L, e.msg);
        return 2;
    }
    ls->m = kv_grammar_matcher_retain(m);
    ls->st = st;
    return 1;
}

/* g:rules() --> the compiled rules as GBNF text (helper rules included) */
static int l_grammar_rules(lua_State *L) {
    l_grammar *lg = l_grammar_check(L, 1);
    size_t n = kv_grammar_print(lg->g, NULL, 0);
    luaL_Buffer b;
    char *p = luaL_buffinitsize(L, &b, n + 1);
    kv_grammar_print(lg->g, p, n + 1);
    luaL_pushresultsize(&b, n);
    return 1;
}

static int l_grammar_tostring(lua_State *L) {
    l_grammar *lg = luaL_checkudata(L, 1, L_GRAMMAR);
    if (!lg->g) lua_pushliteral(L, "kvlua.Grammar (closed)");
    else lua_pushfstring(L, "kvlua.Grammar (%d rules)", kv_grammar_n_rules(lg->g));
    return 1;
}

/* ==== states ================================================================ */

static l_gstate *l_gstate_check(lua_State *L, int idx) {
    l_gstate *ls = luaL_checkudata(L, idx, L_GSTATE);
    if (!ls->m) luaL_error(L, "attempt to use a closed grammar state");
    return ls;
}

static int32_t l_check_token(lua_State *L, int idx) {
    lua_Integer id = luaL_checkinteger(L, idx);
    if (id < 0 || id > INT32_MAX) luaL_argerror(L, idx, "token id out of range");
    return (int32_t)id;
}

/* st:mask(logits) --> tokens left: every token the grammar refuses here
 * becomes -inf (ids past the vocabulary too); the count is of the tokens
 * both allowed and not already -inf. Second value: tokens the grammar
 * allows. */
static int l_gstate_mask(lua_State *L) {
    l_gstate *ls = l_gstate_check(L, 1);
    int n, rows;
    l_logits_check(L, 2, &n, &rows);
    if (rows != 1) luaL_argerror(L, 2, "single-row Logits expected");
    const uint32_t *bits;
    int32_t allowed = 0;
    kv_error e;
    if (kv_grammar_mask(ls->m, &ls->st, &bits, &allowed, &e) != KV_OK) {
        lua_pushnil(L);
        lua_pushstring(L, e.msg);
        return 2;
    }
    float *x = l_logits_write(L, 2, NULL, NULL);
    int32_t nv = kv_grammar_vocab_n(kv_grammar_matcher_vocab(ls->m));
    int lim = n < nv ? n : nv;
    lua_Integer left = 0;
    int i = 0;
    for (; i + 32 <= lim; i += 32) {
        uint32_t w = bits[i >> 5];
        if (w == 0xFFFFFFFFu) {
            for (int k = 0; k < 32; k++) left += x[i + k] != -INFINITY;
        } else {
            for (int k = 0; k < 32; k++) {
                if ((w >> k) & 1) left += x[i + k] != -INFINITY;
                else x[i + k] = -INFINITY;
            }
        }
    }
    for (; i < lim; i++) {
        if ((bits[i >> 5] >> (i & 31)) & 1) left += x[i] != -INFINITY;
        else x[i] = -INFINITY;
    }
    for (; i < n; i++) x[i] = -INFINITY;
    lua_pushinteger(L, left);
    lua_pushinteger(L, allowed);
    return 2;
}

/* st:allowed() --> array of the token ids allowed next (ascending) */
static int l_gstate_allowed(lua_State *L) {
    l_gstate *ls = l_gstate_check(L, 1);
    const uint32_t *bits;
    int32_t cnt = 0;
    kv_error e;
    if (kv_grammar_mask(ls->m, &ls->st, &bits, &cnt, &e) != KV_OK) {
        lua_pushnil(L);
        lua_pushstring(L, e.msg);
        return 2;
    }
    int32_t nv = kv_grammar_vocab_n(kv_grammar_matcher_vocab(ls->m));
    lua_createtable(L, cnt, 0);
    lua_Integer k = 0;
    for (int32_t i = 0; i < nv; i++) {
        if (!((bits[i >> 5] >> (i & 31)) & 1)) continue;
        lua_pushinteger(L, i);
        lua_rawseti(L, -2, ++k);
    }
    return 1;
}

/* st:accept(id) --> true | nil, message (the state is unchanged) */
static int l_gstate_accept(lua_State *L) {
    l_gstate *ls = l_gstate_check(L, 1);
    int32_t id = l_check_token(L, 2);
    if (id >= kv_grammar_vocab_n(kv_grammar_matcher_vocab(ls->m))) luaL_argerror(L, 2, "token id out of range");
    kv_error e;
    if (kv_grammar_accept_token(ls->m, &ls->st, id, &e) != KV_OK) {
        lua_pushnil(L);
        lua_pushstring(L, e.msg);
        return 2;
    }
    lua_pushboolean(L, 1);
    return 1;
}

/* st:allows(id) --> whether the grammar takes token id next (the state
 * does not move): a greedy pick checked before any mask is computed */
static int l_gstate_allows(lua_State *L) {
    l_gstate *ls = l_gstate_check(L, 1);
    int32_t id = l_check_token(L, 2);
    kv_grammar_state t = ls->st;
    kv_error e;
    lua_pushboolean(L, id < kv_grammar_vocab_n(kv_grammar_matcher_vocab(ls->m)) &&
                           kv_grammar_accept_token(ls->m, &t, id, &e) == KV_OK);
    return 1;
}

/* st:accept_text(s) --> true | nil, message (bytes as if generated) */
static int l_gstate_accept_text(lua_State *L) {
    l_gstate *ls = l_gstate_check(L, 1);
    size_t n;
    const char *s = luaL_checklstring(L, 2, &n);
    kv_error e;
    if (kv_grammar_accept_bytes(ls->m, &ls->st, s, n, &e) != KV_OK) {
        lua_pushnil(L);
        lua_pushstring(L, e.msg);
        return 2;
    }
    lua_pushboolean(L, 1);
    return 1;
}

static int l_gstate_can_end(lua_State *L) {
    l_gstate *ls = l_gstate_check(L, 1);
    lua_pushboolean(L, kv_grammar_can_end(ls->m, &ls->st));
    return 1;
}

static int l_gstate_can_continue(lua_State *L) {
    l_gstate *ls = l_gstate_check(L, 1);
    lua_pushboolean(L, kv_grammar_can_continue(ls->m, &ls->st));
    return 1;
}

static int l_gstate_clone(lua_State *L) {
    l_gstate *ls = l_gstate_check(L, 1);
    l_gstate *c = l_gstate_push(L);
    c->m = kv_grammar_matcher_retain(ls->m);
    c->st = ls->st;
    return 1;
}

/* st:stats() --> {masks =, mask_hits =, nodes =, sets =, states =} of the matcher */
static int l_gstate_stats(lua_State *L) {
    l_gstate *ls = l_gstate_check(L, 1);
    kv_grammar_stats s;
    kv_grammar_matcher_stats(ls->m, &s);
    lua_createtable(L, 0, 5);
    lua_pushinteger(L, (lua_Integer)s.masks), lua_setfield(L, -2, "masks");
    lua_pushinteger(L, (lua_Integer)s.mask_hits), lua_setfield(L, -2, "mask_hits");
    lua_pushinteger(L, (lua_Integer)s.nodes), lua_setfield(L, -2, "nodes");
    lua_pushinteger(L, (lua_Integer)s.sets), lua_setfield(L, -2, "sets");
    lua_pushinteger(L, (lua_Integer)s.states), lua_setfield(L, -2, "states");
    return 1;
}

static int l_gstate_tostring(lua_State *L) {
    l_gstate *ls = luaL_checkudata(L, 1, L_GSTATE);
    if (!ls->m) lua_pushliteral(L, "kvlua.GrammarState (closed)");
    else lua_pushfstring(L, "kvlua.GrammarState (%s)", kv_grammar_can_end(ls->m, &ls->st) ? "can end" : "open");
    return 1;
}

/* ==== registration ========================================================== */

static void l_class(lua_State *L, const char *name, const luaL_Reg *methods, lua_CFunction gc,
                    lua_CFunction tostring) {
    luaL_newmetatable(L, name);
    if (methods) {
        lua_newtable(L);
        luaL_setfuncs(L, methods, 0);
        lua_setfield(L, -2, "__index");
    }
    lua_pushcfunction(L, gc), lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, gc), lua_setfield(L, -2, "__close");
    if (tostring) lua_pushcfunction(L, tostring), lua_setfield(L, -2, "__tostring");
    lua_pop(L, 1);
}

/* Registers the classes and sets kvlua.grammar on the module table at the
 * top of the stack. */
void l_grammar_open(lua_State *L) {
    static const luaL_Reg grammar_methods[] = {
        {"state", l_grammar_state},
        {"rules", l_grammar_rules},
        {"close", l_grammar_gc},
        {NULL, NULL},
    };
    static const luaL_Reg state_methods[] = {
        {"mask", l_gstate_mask},
        {"allowed", l_gstate_allowed},
        {"accept", l_gstate_accept},
        {"allows", l_gstate_allows},
        {"accept_text", l_gstate_accept_text},
        {"can_end", l_gstate_can_end},
        {"can_continue", l_gstate_can_continue},
        {"clone", l_gstate_clone},
        {"stats", l_gstate_stats},
        {"close", l_gstate_gc},
        {NULL, NULL},
    };
    l_class(L, L_GRAMMAR, grammar_methods, l_grammar_gc, l_grammar_tostring);
    l_class(L, L_GSTATE, state_methods, l_gstate_gc, l_gstate_tostring);
    l_class(L, L_GVOCAB, NULL, l_gvocab_gc, NULL);
    l_class(L, L_GMATCHER, NULL, l_gmatcher_gc, NULL);
    lua_pushcfunction(L, l_grammar_new);
    lua_setfield(L, -2, "grammar");
}
