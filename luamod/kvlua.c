/*
 * kvlua.c — the Lua 5.4 binding: module table, Model and Session objects.
 *
 * Owns: kvlua.load / devices / version / logits / utf8_complete, the
 * "kvlua.Model" and "kvlua.Session" userdata, and the glue that times
 * prefill and decode (TTFT, inter-token latencies). Logits live in
 * l_logits.c; sampling, chat templates and s:generate are Lua modules
 * under luamod/kvlua/.
 *
 * Error rule (shared/API.md): misuse (wrong argument type, closed object,
 * token id out of range) raises; a failure of the world (missing or corrupt
 * file, context full, NaN logits) returns nil, message.
 *
 * Lifetimes: objects are born closed and opened once the engine object
 * exists, so a Lua error mid-way leaves nothing half-built. A session keeps
 * its model's userdata alive (user value 1), and the model's engine object
 * is freed only when it is closed and no open session uses it, whichever
 * of model:close(), __gc and session closing happens last. A Cache
 * (l_cache.c) counts as such a user too; a session drawing from a Cache
 * keeps it alive (user value 4).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lauxlib.h"
#include "lua.h"
#include "lualib.h"

#include "kvcl.h"
#include "kvlua.h"
#include "l_cache.h"
#include "l_logits.h"
#include "types.h"

#define L_MODEL "kvlua.Model"
#define L_SESSION "kvlua.Session"

/* ==== helpers ============================================================ */

static double l_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Optional field of an options table (index opts; absent or nil => default). */
static int l_opt_field(lua_State *L, int opts, const char *k) {
    if (lua_isnoneornil(L, opts)) {
        lua_pushnil(L);
        return LUA_TNIL;
    }
    return lua_getfield(L, opts, k);
}

static lua_Integer l_opt_int(lua_State *L, int opts, const char *k, lua_Integer def) {
    int t = l_opt_field(L, opts, k);
    lua_Integer v = def;
    if (t != LUA_TNIL) {
        int ok = 0;
        v = lua_tointegerx(L, -1, &ok);
        if (!ok) luaL_error(L, "option '%s' must be an integer", k);
    }
    lua_pop(L, 1);
    return v;
}

static int l_opt_bool(lua_State *L, int opts, const char *k, int def) {
    int t = l_opt_field(L, opts, k);
    int v = def;
    if (t != LUA_TNIL) {
        if (t != LUA_TBOOLEAN) luaL_error(L, "option '%s' must be a boolean", k);
        v = lua_toboolean(L, -1);
    }
    lua_pop(L, 1);
    return v;
}

static const char *l_opt_str(lua_State *L, int opts, const char *k, const char *def) {
    int t = l_opt_field(L, opts, k);
    const char *v = def;
    if (t != LUA_TNIL) {
        if (t != LUA_TSTRING) luaL_error(L, "option '%s' must be a string", k);
        v = lua_tostring(L, -1); /* still referenced by the options table */
    }
    lua_pop(L, 1);
    return v;
}

static int l_fail(lua_State *L, const char *msg) {
    lua_pushnil(L);
    lua_pushstring(L, msg);
    return 2;
}

/* Reads an array of token ids at idx into a buffer owned by Lua (a
 * userdata pushed on the stack, so nothing leaks if anything raises).
 * Raises on a non-integer or out-of-range id (n_vocab < 0: no range check). */
static int32_t *l_check_ids(lua_State *L, int idx, int32_t n_vocab, size_t *n_out) {
    luaL_checktype(L, idx, LUA_TTABLE);
    lua_Integer n = luaL_len(L, idx);
    if (n < 0 || (lua_Unsigned)n > (1u << 30)) luaL_argerror(L, idx, "bad length");
    int32_t *ids = lua_newuserdatauv(L, sizeof(int32_t) * (size_t)(n ? n : 1), 0);
    for (lua_Integer i = 1; i <= n; i++) {
        lua_geti(L, idx, i);
        int ok = 0;
        lua_Integer v = lua_tointegerx(L, -1, &ok);
        lua_pop(L, 1);
        if (!ok) luaL_error(L, "token id at index %d is not an integer", (int)i);
        if (v < 0 || (n_vocab >= 0 && v >= n_vocab))
            luaL_error(L, "token id %d at index %d out of range [0, %d)", (int)v, (int)i, (int)n_vocab);
        ids[i - 1] = (int32_t)v;
    }
    *n_out = (size_t)n;
    return ids;
}

static void l_push_ids(lua_State *L, const int32_t *ids, size_t n) {
    lua_createtable(L, (int)n, 0);
    for (size_t i = 0; i < n; i++) {
        lua_pushinteger(L, ids[i]);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
}

/* ==== GGUF values as Lua values ========================================== */

static void l_push_gguf_value(lua_State *L, const kv_gguf_value *v, int depth);

static void l_push_gguf_array(lua_State *L, const kv_gguf_value *v, int depth) {
    uint64_t n = v->v.arr.n;
    luaL_checkstack(L, 4, "gguf array");
    lua_createtable(L, n > 1 << 20 ? 1 << 20 : (int)n, 0);
    for (uint64_t i = 0; i < n; i++) {
        switch (v->v.arr.type) {
        case KV_GGUF_STRING:
            lua_pushlstring(L, v->v.arr.strs[i].ptr, (size_t)v->v.arr.strs[i].len);
            break;
        case KV_GGUF_ARRAY:
            if (depth > 16) lua_pushnil(L);
            else l_push_gguf_value(L, &v->v.arr.items[i], depth + 1);
            break;
        case KV_GGUF_BOOL: lua_pushboolean(L, kv_gguf_arr_int(v, i) != 0); break;
        case KV_GGUF_F32:
        case KV_GGUF_F64: lua_pushnumber(L, kv_gguf_arr_num(v, i)); break;
        case KV_GGUF_U64: {
            uint64_t u = (uint64_t)kv_gguf_arr_int(v, i);
            if (u > (uint64_t)LUA_MAXINTEGER) lua_pushnumber(L, (lua_Number)u);
            else lua_pushinteger(L, (lua_Integer)u);
            break;
        }
        default: lua_pushinteger(L, (lua_Integer)kv_gguf_arr_int(v, i)); break;
        }
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
}

static void l_push_gguf_value(lua_State *L, const kv_gguf_value *v, int depth) {
    switch (v->type) {
    case KV_GGUF_U8: case KV_GGUF_U16: case KV_GGUF_U32: case KV_GGUF_U64:
        if (v->v.u > (uint64_t)LUA_MAXINTEGER) lua_pushnumber(L, (lua_Number)v->v.u);
        else lua_pushinteger(L, (lua_Integer)v->v.u);
        break;
    case KV_GGUF_I8: case KV_GGUF_I16: case KV_GGUF_I32: case KV_GGUF_I64:
        lua_pushinteger(L, (lua_Integer)v->v.i);
        break;
    case KV_GGUF_F32: case KV_GGUF_F64: lua_pushnumber(L, v->v.f); break;
    case KV_GGUF_BOOL: lua_pushboolean(L, v->v.b); break;
    case KV_GGUF_STRING: lua_pushlstring(L, v->v.s.ptr, (size_t)v->v.s.len); break;
    case KV_GGUF_ARRAY: l_push_gguf_array(L, v, depth); break;
    default: lua_pushnil(L); break;
    }
}

/* ==== Model ================================================================ */

typedef struct {
    kv_model *m;  /* NULL until opened, and once freed */
    int closed;   /* the user closed it (or __gc ran) */
    int sessions; /* open sessions using m */
} l_model;

static void l_model_release(l_model *lm) {
    if (lm->m && lm->closed && lm->sessions == 0) {
        kv_model_close(lm->m);
        lm->m = NULL;
    }
}

static l_model *l_model_check(lua_State *L, int idx) {
    l_model *lm = luaL_checkudata(L, idx, L_MODEL);
    if (lm->closed || !lm->m) luaL_error(L, "attempt to use a closed model");
    return lm;
}

kv_model *l_model_peek(lua_State *L, int idx) { return l_model_check(L, idx)->m; }

kv_model *l_model_hold(lua_State *L, int idx, void **owner) {
    l_model *lm = l_model_check(L, idx);
    lm->sessions++;
    *owner = lm;
    return lm->m;
}

void l_model_unhold(void *owner) {
    l_model *lm = owner;
    lm->sessions--;
    l_model_release(lm);
}

static const kv_vocab *l_model_vocab(lua_State *L, l_model *lm) {
    const kv_vocab *v = kv_model_vocab(lm->m);
    if (!v) luaL_error(L, "model has no tokenizer (no tokenizer.ggml.model in the file)");
    return v;
}

static int l_load(lua_State *L) {
    const char *path = luaL_checkstring(L, 1);
    if (!lua_isnoneornil(L, 2)) luaL_checktype(L, 2, LUA_TTABLE);
    const char *backend = l_opt_str(L, 2, "backend", "auto");
    lua_Integer threads = l_opt_int(L, 2, "threads", 0);
    lua_Integer device = l_opt_int(L, 2, "device", 0);
    int be = strcmp(backend, "cpu") == 0      ? KV_BACKEND_CPU
             : strcmp(backend, "opencl") == 0 ? KV_BACKEND_OPENCL
             : strcmp(backend, "auto") == 0   ? KV_BACKEND_AUTO
                                              : -1;
    if (be < 0) luaL_error(L, "option 'backend' must be \"auto\", \"cpu\" or \"opencl\" (got \"%s\")", backend);
    if (threads < 0 || threads > 1024) luaL_error(L, "option 'threads' out of range: %d", (int)threads);
    if (device < 0 || device > 1024) luaL_error(L, "option 'device' out of range: %d", (int)device);

    l_model *lm = lua_newuserdatauv(L, sizeof *lm, 2); /* born closed */
    lm->m = NULL;
    lm->closed = 1;
    lm->sessions = 0;
    luaL_setmetatable(L, L_MODEL);

    kv_model_params p = {.threads = (int)threads, .backend = be, .device = (int)device};
    kv_error e = {{0}};
    kv_model *m = NULL;
    if (kv_model_open(path, &p, &m, &e) != KV_OK) return l_fail(L, e.msg);
    lm->m = m;
    lm->closed = 0;
    return 1;
}

static void l_push_info(lua_State *L, l_model *lm) {
    const kv_model_info *in = kv_model_info_get(lm->m);
    lua_createtable(L, 0, 20);
#define SETI(k, v) (lua_pushinteger(L, (lua_Integer)(v)), lua_setfield(L, -2, k))
    lua_pushstring(L, in->arch), lua_setfield(L, -2, "arch");
    lua_pushstring(L, in->name), lua_setfield(L, -2, "name");
    SETI("n_layer", in->n_layer);
    SETI("n_embd", in->n_embd);
    SETI("n_head", in->n_head);
    SETI("n_head_kv", in->n_head_kv);
    SETI("head_dim", in->head_dim);
    SETI("head_dim_v", in->head_dim_v);
    SETI("n_ff", in->n_ff);
    SETI("n_ctx_train", in->n_ctx_train);
    SETI("n_vocab", in->n_vocab);
    if (in->sliding_window > 0) SETI("sliding_window", in->sliding_window);
    if (in->file_type >= 0) SETI("file_type", in->file_type);
    SETI("n_params", in->n_params);
    SETI("size_bytes", in->size_bytes);
    SETI("threads", in->threads);
    lua_pushboolean(L, in->has_weights), lua_setfield(L, -2, "has_weights");
    lua_pushstring(L, in->backend), lua_setfield(L, -2, "backend");
    lua_pushstring(L, in->device), lua_setfield(L, -2, "device");
    if (in->device_index >= 0) SETI("device_index", in->device_index);
#undef SETI
}

static void l_push_vocab(lua_State *L, l_model *lm) {
    const kv_vocab *v = kv_model_vocab(lm->m);
    if (!v) {
        lua_pushnil(L);
        return;
    }
    const kv_vocab_special *sp = kv_vocab_specials(v);
    lua_createtable(L, 0, 14);
    lua_pushinteger(L, kv_vocab_n(v)), lua_setfield(L, -2, "n");
    lua_pushstring(L, kv_vocab_model_name(v)), lua_setfield(L, -2, "model");
    lua_pushstring(L, kv_vocab_pre_name(v)), lua_setfield(L, -2, "pre");
    struct { const char *k; int32_t id; } ids[] = {
        {"bos", sp->bos}, {"eos", sp->eos}, {"eot", sp->eot}, {"eom", sp->eom}, {"unk", sp->unk},
        {"pad", sp->pad}, {"sep", sp->sep}, {"nl", sp->nl}, {"mask", sp->mask},
    };
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
        if (ids[i].id < 0) continue;
        lua_pushinteger(L, ids[i].id);
        lua_setfield(L, -2, ids[i].k);
    }
    lua_pushboolean(L, sp->add_bos), lua_setfield(L, -2, "add_bos");
    lua_pushboolean(L, sp->add_eos), lua_setfield(L, -2, "add_eos");
    lua_pushboolean(L, sp->add_space_prefix), lua_setfield(L, -2, "add_space_prefix");
}

static int l_model_meta(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    const char *key = luaL_checkstring(L, 2);
    const kv_gguf_value *v = kv_gguf_get(kv_model_gguf(lm->m), key);
    if (!v) {
        lua_pushnil(L);
        return 1;
    }
    l_push_gguf_value(L, v, 0);
    return 1;
}

/* model:meta_keys() -> array of every metadata key, in file order. */
static int l_model_meta_keys(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    const kv_gguf *g = kv_model_gguf(lm->m);
    lua_createtable(L, (int)g->n_kv, 0);
    for (uint64_t i = 0; i < g->n_kv; i++) {
        lua_pushlstring(L, g->kv[i].key.ptr, (size_t)g->kv[i].key.len);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    return 1;
}

static int l_model_tensors(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    const kv_gguf *g = kv_model_gguf(lm->m);
    lua_createtable(L, (int)g->n_tensors, 0);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const kv_gguf_tensor *t = &g->tensors[i];
        lua_createtable(L, 0, 5);
        lua_pushlstring(L, t->name.ptr, (size_t)t->name.len), lua_setfield(L, -2, "name");
        const kv_type_traits *tr = kv_type_traits_get(t->type);
        lua_pushstring(L, tr ? tr->name : "?"), lua_setfield(L, -2, "type");
        lua_createtable(L, t->n_dims, 0);
        for (int d = 0; d < t->n_dims; d++) {
            lua_pushinteger(L, t->ne[d]);
            lua_rawseti(L, -2, d + 1);
        }
        lua_setfield(L, -2, "shape");
        lua_pushinteger(L, (lua_Integer)t->nbytes), lua_setfield(L, -2, "bytes");
        lua_pushinteger(L, (lua_Integer)t->offset), lua_setfield(L, -2, "offset");
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    return 1;
}

static int l_model_tokenize(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    size_t len;
    const char *text = luaL_checklstring(L, 2, &len);
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    int add_special = l_opt_bool(L, 3, "add_special", 1);
    int parse_special = l_opt_bool(L, 3, "parse_special", 0);
    const kv_vocab *v = l_model_vocab(L, lm);
    int32_t *ids = NULL;
    size_t n = 0;
    kv_error e = {{0}};
    if (kv_tokenize(v, text, len, add_special, parse_special, &ids, &n, &e) != KV_OK) {
        free(ids);
        return l_fail(L, e.msg);
    }
    /* lua_createtable may raise: hand the ids to Lua before freeing */
    int32_t *copy = lua_newuserdatauv(L, n * sizeof(int32_t) + 1, 0);
    if (n) memcpy(copy, ids, n * sizeof(int32_t));
    free(ids);
    l_push_ids(L, copy, n);
    return 1;
}

static int l_model_detokenize(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    const kv_vocab *v = l_model_vocab(L, lm);
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    int remove_special = l_opt_bool(L, 3, "remove_special", 0);
    int unparse_special = l_opt_bool(L, 3, "unparse_special", 0);
    size_t n;
    int32_t *ids = l_check_ids(L, 2, kv_vocab_n(v), &n);
    char *out = NULL;
    size_t len = 0;
    kv_error e = {{0}};
    kv_status st = kv_detokenize(v, ids, n, remove_special, unparse_special, &out, &len, &e);
    if (st != KV_OK) {
        free(out);
        return l_fail(L, e.msg);
    }
    /* lua_pushlstring may raise: hand the bytes to Lua before freeing */
    char *copy = lua_newuserdatauv(L, len + 1, 0);
    memcpy(copy, out ? out : "", len);
    free(out);
    lua_pushlstring(L, copy, len);
    return 1;
}

static int32_t l_check_id(lua_State *L, int idx, const kv_vocab *v) {
    lua_Integer id = luaL_checkinteger(L, idx);
    if (id < 0 || id >= kv_vocab_n(v))
        luaL_error(L, "token id %d out of range [0, %d)", (int)id, (int)kv_vocab_n(v));
    return (int32_t)id;
}

static int l_model_piece(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    const kv_vocab *v = l_model_vocab(L, lm);
    int32_t id = l_check_id(L, 2, v);
    int special = lua_isnoneornil(L, 3) ? 1 : lua_toboolean(L, 3);
    char small[256];
    size_t need = kv_token_piece(v, id, special, small, sizeof small);
    if (need <= sizeof small) {
        lua_pushlstring(L, small, need);
        return 1;
    }
    luaL_Buffer b;
    char *p = luaL_buffinitsize(L, &b, need);
    kv_token_piece(v, id, special, p, need);
    luaL_pushresultsize(&b, need);
    return 1;
}

/* model:token_text(id) -> raw stored text; model:token_attr(id) -> bits */
static int l_model_token_text(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    const kv_vocab *v = l_model_vocab(L, lm);
    size_t len = 0;
    const char *s = kv_vocab_text(v, l_check_id(L, 2, v), &len);
    lua_pushlstring(L, s ? s : "", s ? len : 0);
    return 1;
}

static int l_model_is_eog(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    const kv_vocab *v = l_model_vocab(L, lm);
    lua_pushboolean(L, kv_vocab_is_eog(v, l_check_id(L, 2, v)));
    return 1;
}

static int l_model_kv_bytes(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    if (!lua_isnoneornil(L, 2)) luaL_checktype(L, 2, LUA_TTABLE);
    lua_Integer ctx = l_opt_int(L, 2, "ctx", kv_model_info_get(lm->m)->n_ctx_train);
    lua_Integer batch = l_opt_int(L, 2, "batch", 1);
    lua_Integer pt = l_opt_int(L, 2, "page_tokens", 16);
    const int n_layer = kv_model_info_get(lm->m)->n_layer;
    int *types = lua_newuserdatauv(L, 2 * sizeof(int) * (size_t)(n_layer ? n_layer : 1), 0);
    l_kv_types(L, 2, "ktype", n_layer, types);
    l_kv_types(L, 2, "vtype", n_layer, types + n_layer);
    if (ctx < 0 || batch < 0) luaL_error(L, "ctx and batch must be >= 0");
    if (pt <= 0 || pt > 65536 || (pt & (pt - 1))) luaL_error(L, "option 'page_tokens' must be a power of two");
    /* pages are rounded: what sessions of ctx positions hold */
    uint64_t b = kv_model_kv_bytes_layers(lm->m, ctx, types, types + n_layer, (int)pt);
    if (b == UINT64_MAX || (batch && b > (uint64_t)INT64_MAX / (uint64_t)batch))
        luaL_error(L, "kv_bytes: more than 2^63 bytes");
    lua_pushinteger(L, (lua_Integer)(b * (uint64_t)batch));
    return 1;
}

/* model:fingerprint() --> hex BLAKE2b of the file, seconds it took (once) */
static int l_model_fingerprint(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    uint8_t fp[32];
    double secs = 0;
    kv_error e = {{0}};
    if (!kv_model_info_get(lm->m)->has_weights) return l_fail(L, "model has no weights (vocabulary-only file)");
    if (kv_model_fingerprint(lm->m, fp, &secs, &e) != KV_OK) return l_fail(L, e.msg);
    char hex[65];
    for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", fp[i]);
    lua_pushstring(L, hex);
    lua_pushnumber(L, secs);
    return 2;
}

static int l_model_gc(lua_State *L) {
    l_model *lm = luaL_checkudata(L, 1, L_MODEL);
    lm->closed = 1;
    l_model_release(lm);
    return 0;
}

static int l_model_tostring(lua_State *L) {
    l_model *lm = luaL_checkudata(L, 1, L_MODEL);
    if (lm->closed || !lm->m) lua_pushstring(L, "kvlua.Model (closed)");
    else lua_pushfstring(L, "kvlua.Model (%s, %s)", kv_model_info_get(lm->m)->arch,
                         kv_model_info_get(lm->m)->name);
    return 1;
}

static int l_session_new(lua_State *L);

static const luaL_Reg l_model_methods[] = {
    {"meta", l_model_meta},
    {"meta_keys", l_model_meta_keys},
    {"tensors", l_model_tensors},
    {"tokenize", l_model_tokenize},
    {"detokenize", l_model_detokenize},
    {"piece", l_model_piece},
    {"token_text", l_model_token_text},
    {"is_eog", l_model_is_eog},
    {"kv_bytes", l_model_kv_bytes},
    {"fingerprint", l_model_fingerprint},
    {"session", l_session_new},
    {"close", l_model_gc},
    {NULL, NULL},
};

/* model.info / model.vocab are built once and cached in user values 1, 2. */
static int l_model_index(lua_State *L) {
    l_model *lm = luaL_checkudata(L, 1, L_MODEL);
    const char *k = lua_tostring(L, 2);
    if (k && (!strcmp(k, "info") || !strcmp(k, "vocab"))) {
        if (lm->closed || !lm->m) luaL_error(L, "attempt to use a closed model");
        int slot = k[0] == 'i' ? 1 : 2;
        if (lua_getiuservalue(L, 1, slot) == LUA_TNIL) {
            lua_pop(L, 1);
            if (slot == 1) l_push_info(L, lm);
            else l_push_vocab(L, lm);
            lua_pushvalue(L, -1);
            lua_setiuservalue(L, 1, slot);
        }
        return 1;
    }
    lua_getmetatable(L, 1);
    lua_getfield(L, -1, "__methods");
    lua_pushvalue(L, 2);
    lua_rawget(L, -2);
    return 1;
}

/* ==== Session ================================================================ */

typedef struct {
    kv_session *s;    /* NULL when closed */
    l_model *lm;      /* owner (kept alive by user value 1) */
    l_cache *lc;      /* the shared cache it draws from (user value 4), NULL: private pool */
    float *logits;    /* scratch for the last row(s) */
    size_t logits_cap;
    /* stats */
    double ttft;      /* seconds of the first prefill, -1 before */
    double *itl;      /* decode latencies, seconds */
    size_t n_itl, cap_itl;
    uint64_t prefill_tokens, decode_tokens;
    double prefill_seconds;
} l_session;

static l_session *l_session_check(lua_State *L, int idx) {
    l_session *ls = luaL_checkudata(L, idx, L_SESSION);
    if (!ls->s) luaL_error(L, "attempt to use a closed session");
    return ls;
}

/* A new session userdata (born closed) keeping the model at index mi and
 * the cache at index ci (0: none) alive. */
static l_session *l_session_push(lua_State *L, int mi, int ci) {
    /* user values: 1 model, 2 last Logits, 3 table of Lua-side fields, 4 cache */
    l_session *ls = lua_newuserdatauv(L, sizeof *ls, 4);
    memset(ls, 0, sizeof *ls);
    ls->ttft = -1;
    luaL_setmetatable(L, L_SESSION);
    lua_pushvalue(L, mi);
    lua_setiuservalue(L, -2, 1); /* keep the model alive */
    if (ci) {
        lua_pushvalue(L, ci);
        lua_setiuservalue(L, -2, 4); /* and the cache */
    }
    return ls;
}

static int l_session_new(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    if (!lua_isnoneornil(L, 2)) luaL_checktype(L, 2, LUA_TTABLE);
    const kv_model_info *in = kv_model_info_get(lm->m);
    lua_Integer ctx = l_opt_int(L, 2, "ctx", in->n_ctx_train < 4096 ? in->n_ctx_train : 4096);
    if (ctx <= 0 || ctx > (1 << 24)) luaL_error(L, "option 'ctx' out of range: %d", (int)ctx);
    l_cache *lc = NULL;
    int ci = 0;
    if (l_opt_field(L, 2, "cache") != LUA_TNIL) {
        lc = l_cache_check(L, -1);
        ci = lua_gettop(L);
        if (kv_cache_model(lc->c) != lm->m) luaL_error(L, "option 'cache': the cache belongs to another model");
    } else {
        lua_pop(L, 1);
    }
    /* the storage, per layer: "f16" (default), "f32", "q8_0", "q4_0"; with a cache, its own */
    const int n_layer = in->n_layer;
    int *types = lua_newuserdatauv(L, 2 * sizeof(int) * (size_t)(n_layer ? n_layer : 1), 0);
    int given = l_kv_types(L, 2, "ktype", n_layer, types) | l_kv_types(L, 2, "vtype", n_layer, types + n_layer);
    if (lc && given)
        for (int il = 0; il < n_layer; il++) {
            int ckt, cvt;
            kv_cache_types(lc->c, il, &ckt, &cvt);
            if (ckt != types[il] || cvt != types[n_layer + il])
                luaL_error(L, "options 'ktype'/'vtype' differ from the cache's types (layer %d)", il);
        }
    if (!in->has_weights) return l_fail(L, "model has no weights (vocabulary-only file)");

    l_session *ls = l_session_push(L, 1, ci);
    kv_error e = {{0}};
    kv_session *s = NULL;
    kv_session_params p = {.n_ctx = (int)ctx, .ktypes = types, .vtypes = types + n_layer, .cache = lc ? lc->c : NULL};
    if (kv_session_open_p(lm->m, &p, &s, &e) != KV_OK) return l_fail(L, e.msg);
    ls->s = s;
    ls->lm = lm;
    ls->lc = lc;
    lm->sessions++;
    return 1;
}

static int l_session_gc(lua_State *L) {
    l_session *ls = luaL_checkudata(L, 1, L_SESSION);
    if (ls->s) {
        kv_session_close(ls->s);
        ls->s = NULL;
        ls->lm->sessions--;
        l_model_release(ls->lm);
    }
    free(ls->logits);
    ls->logits = NULL;
    ls->logits_cap = 0;
    free(ls->itl);
    ls->itl = NULL;
    ls->n_itl = ls->cap_itl = 0;
    return 0;
}

static float *l_session_scratch(lua_State *L, l_session *ls, size_t n) {
    if (n > ls->logits_cap) {
        float *p = realloc(ls->logits, n * sizeof(float));
        if (!p) luaL_error(L, "out of memory (%d logits)", (int)n);
        ls->logits = p;
        ls->logits_cap = n;
    }
    return ls->logits;
}

/* Runs ids through the session; pushes a Logits (or nil, message). */
static int l_session_run(lua_State *L, l_session *ls, const int32_t *ids, size_t n, int mode, int is_decode) {
    int n_vocab = kv_model_info_get(ls->lm->m)->n_vocab;
    size_t rows = mode == KV_LOGITS_ALL ? n : 1;
    if (rows && (size_t)n_vocab > SIZE_MAX / sizeof(float) / rows) luaL_error(L, "too many logits");
    float *out = l_session_scratch(L, ls, rows * (size_t)n_vocab);
    kv_error e = {{0}};
    l_cache_before_eval(L, ls->lc);
    double t0 = l_now();
    kv_status st = kv_session_eval(ls->s, ids, n, mode, out, &e);
    double dt = l_now() - t0;
    l_cache_after_eval(L, ls->lc); /* raises what the eviction policy raised */
    if (st != KV_OK) return l_fail(L, e.msg);
    if (is_decode) {
        if (ls->n_itl == ls->cap_itl) {
            size_t cap = ls->cap_itl ? ls->cap_itl * 2 : 256;
            double *p = realloc(ls->itl, cap * sizeof(double));
            if (p) ls->itl = p, ls->cap_itl = cap;
        }
        if (ls->n_itl < ls->cap_itl) ls->itl[ls->n_itl++] = dt;
        ls->decode_tokens += n;
    } else {
        if (ls->ttft < 0) ls->ttft = dt;
        ls->prefill_tokens += n;
        ls->prefill_seconds += dt;
    }
    float *dst = l_logits_push(L, n_vocab, (int)rows);
    memcpy(dst, out, rows * (size_t)n_vocab * sizeof(float));
    /* remember the last logits for s:logits() / generate */
    if (mode == KV_LOGITS_ALL && rows > 1) {
        float *last = l_logits_push(L, n_vocab, 1);
        memcpy(last, out + (rows - 1) * (size_t)n_vocab, (size_t)n_vocab * sizeof(float));
        lua_setiuservalue(L, 1, 2);
    } else {
        lua_pushvalue(L, -1);
        lua_setiuservalue(L, 1, 2);
    }
    return 1;
}

static int l_session_prefill(lua_State *L) {
    l_session *ls = l_session_check(L, 1);
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    const char *lg = l_opt_str(L, 3, "logits", "last");
    int mode;
    if (!strcmp(lg, "last")) mode = KV_LOGITS_LAST;
    else if (!strcmp(lg, "all")) mode = KV_LOGITS_ALL;
    else if (!strcmp(lg, "none")) mode = KV_LOGITS_NONE;
    else return luaL_error(L, "option 'logits' must be \"last\", \"all\" or \"none\"");
    size_t n;
    int32_t *owned = l_check_ids(L, 2, kv_model_info_get(ls->lm->m)->n_vocab, &n);
    if (n == 0) luaL_argerror(L, 2, "empty token list");
    if (mode == KV_LOGITS_NONE) {
        kv_error e = {{0}};
        l_cache_before_eval(L, ls->lc);
        double t0 = l_now();
        kv_status st = kv_session_eval(ls->s, owned, n, KV_LOGITS_NONE, NULL, &e);
        double dt = l_now() - t0;
        l_cache_after_eval(L, ls->lc);
        if (st != KV_OK) return l_fail(L, e.msg);
        if (ls->ttft < 0) ls->ttft = dt;
        ls->prefill_tokens += n;
        ls->prefill_seconds += dt;
        lua_pushboolean(L, 1);
        return 1;
    }
    return l_session_run(L, ls, owned, n, mode, 0);
}

static int l_session_decode(lua_State *L) {
    l_session *ls = l_session_check(L, 1);
    lua_Integer id = luaL_checkinteger(L, 2);
    int n_vocab = kv_model_info_get(ls->lm->m)->n_vocab;
    if (id < 0 || id >= n_vocab) luaL_error(L, "token id %d out of range [0, %d)", (int)id, n_vocab);
    int32_t tok = (int32_t)id;
    return l_session_run(L, ls, &tok, 1, KV_LOGITS_LAST, 1);
}

static int l_session_logits(lua_State *L) {
    l_session_check(L, 1);
    lua_getiuservalue(L, 1, 2);
    return 1;
}

static int l_session_tokens(lua_State *L) {
    l_session *ls = l_session_check(L, 1);
    l_push_ids(L, kv_session_tokens(ls->s), (size_t)kv_session_pos(ls->s));
    return 1;
}

static int l_session_rewind(lua_State *L) {
    l_session *ls = l_session_check(L, 1);
    lua_Integer n = luaL_checkinteger(L, 2);
    if (n < 0) luaL_argerror(L, 2, "must be >= 0");
    if (n > kv_session_pos(ls->s)) n = kv_session_pos(ls->s);
    kv_session_rewind(ls->s, (int)n);
    if (n > 0) { /* the remembered logits no longer match the sequence */
        lua_pushnil(L);
        lua_setiuservalue(L, 1, 2);
    }
    return 0;
}

static int l_session_stats(lua_State *L) {
    l_session *ls = l_session_check(L, 1);
    lua_createtable(L, 0, 10);
    if (ls->ttft >= 0) {
        lua_pushnumber(L, ls->ttft);
        lua_setfield(L, -2, "ttft");
    }
    lua_createtable(L, (int)ls->n_itl, 0);
    for (size_t i = 0; i < ls->n_itl; i++) {
        lua_pushnumber(L, ls->itl[i]);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    lua_setfield(L, -2, "itl");
    lua_pushinteger(L, (lua_Integer)ls->prefill_tokens), lua_setfield(L, -2, "prefill_tokens");
    lua_pushnumber(L, ls->prefill_seconds), lua_setfield(L, -2, "prefill_seconds");
    lua_pushinteger(L, (lua_Integer)kv_session_reused_tokens(ls->s)), lua_setfield(L, -2, "reused_tokens");
    lua_pushinteger(L, (lua_Integer)ls->decode_tokens), lua_setfield(L, -2, "decode_tokens");
    lua_pushinteger(L, (lua_Integer)kv_session_kv_bytes(ls->s)), lua_setfield(L, -2, "kv_bytes");
    lua_pushinteger(L, kv_session_pos(ls->s)), lua_setfield(L, -2, "pos");
    lua_pushinteger(L, kv_session_ctx(ls->s)), lua_setfield(L, -2, "ctx");
    return 1;
}

/* s:fork() --> a session with the same tokens sharing every page (copy on write) */
static int l_session_fork(lua_State *L) {
    l_session *ls = l_session_check(L, 1);
    if (ls->lc) l_cache_before_eval(L, ls->lc), ls->lc->L = NULL;
    int ci = 0;
    if (ls->lc) {
        lua_getiuservalue(L, 1, 4);
        ci = lua_gettop(L);
    }
    lua_getiuservalue(L, 1, 1);
    int mi = lua_gettop(L);
    l_session *f = l_session_push(L, mi, ci);
    kv_error e = {{0}};
    kv_session *s = NULL;
    if (kv_session_fork(ls->s, &s, &e) != KV_OK) return l_fail(L, e.msg);
    f->s = s;
    f->lm = ls->lm;
    f->lc = ls->lc;
    f->lm->sessions++;
    lua_getiuservalue(L, 1, 2); /* the same last logits */
    lua_setiuservalue(L, -2, 2);
    return 1;
}

/* The 'key' option: nil, or a string of exactly 32 bytes (raises otherwise). */
static const uint8_t *l_opt_key(lua_State *L, int opts) {
    if (l_opt_field(L, opts, "key") == LUA_TNIL) {
        lua_pop(L, 1);
        return NULL;
    }
    size_t n = 0;
    const char *k = lua_type(L, -1) == LUA_TSTRING ? lua_tolstring(L, -1, &n) : NULL;
    if (!k || n != 32) luaL_error(L, "option 'key' must be a string of 32 bytes");
    lua_pop(L, 1); /* the string stays referenced by the options table */
    return (const uint8_t *)k;
}

/* s:save(path, { key = }) --> true | nil, err */
static int l_session_save(lua_State *L) {
    l_session *ls = l_session_check(L, 1);
    size_t n;
    const char *path = luaL_checklstring(L, 2, &n);
    if (strlen(path) != n) luaL_argerror(L, 2, "path contains a NUL byte");
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    const uint8_t *key = l_opt_key(L, 3);
    kv_error e = {{0}};
    if (kv_session_save(ls->s, path, key, &e) != KV_OK) return l_fail(L, e.msg);
    lua_pushboolean(L, 1);
    return 1;
}

/* kvlua.restore(model, path, { key =, cache =, ctx = }) --> session | nil, err */
static int l_restore(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    size_t n;
    const char *path = luaL_checklstring(L, 2, &n);
    if (strlen(path) != n) luaL_argerror(L, 2, "path contains a NUL byte");
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    const uint8_t *key = l_opt_key(L, 3);
    lua_Integer ctx = l_opt_int(L, 3, "ctx", 0);
    if (ctx < 0 || ctx > (1 << 24)) luaL_error(L, "option 'ctx' out of range");
    l_cache *lc = NULL;
    int ci = 0;
    if (l_opt_field(L, 3, "cache") != LUA_TNIL) {
        lc = l_cache_check(L, -1);
        ci = lua_gettop(L);
        if (kv_cache_model(lc->c) != lm->m) luaL_error(L, "option 'cache': the cache belongs to another model");
    } else {
        lua_pop(L, 1);
    }
    l_session *ls = l_session_push(L, 1, ci);
    kv_error e = {{0}};
    kv_session *s = NULL;
    l_cache_before_eval(L, lc);
    kv_status st = kv_session_restore(lm->m, path, key, lc ? lc->c : NULL, (int)ctx, &s, &e);
    l_cache_after_eval(L, lc);
    if (st != KV_OK) return l_fail(L, e.msg);
    ls->s = s;
    ls->lm = lm;
    ls->lc = lc;
    lm->sessions++;
    return 1;
}

static int l_session_tostring(lua_State *L) {
    l_session *ls = luaL_checkudata(L, 1, L_SESSION);
    if (!ls->s) lua_pushstring(L, "kvlua.Session (closed)");
    else lua_pushfstring(L, "kvlua.Session (%d/%d tokens)", kv_session_pos(ls->s), kv_session_ctx(ls->s));
    return 1;
}

static const luaL_Reg l_session_methods[] = {
    {"prefill", l_session_prefill},
    {"decode", l_session_decode},
    {"logits", l_session_logits},
    {"tokens", l_session_tokens},
    {"rewind", l_session_rewind},
    {"stats", l_session_stats},
    {"fork", l_session_fork},
    {"save", l_session_save},
    {"close", l_session_gc},
    {NULL, NULL},
};

static int l_session_index(lua_State *L) {
    l_session *ls = luaL_checkudata(L, 1, L_SESSION);
    const char *k = lua_tostring(L, 2);
    if (k && (!strcmp(k, "pos") || !strcmp(k, "ctx"))) {
        if (!ls->s) luaL_error(L, "attempt to use a closed session");
        lua_pushinteger(L, k[0] == 'p' ? kv_session_pos(ls->s) : kv_session_ctx(ls->s));
        return 1;
    }
    if (k && !strcmp(k, "model")) {
        lua_getiuservalue(L, 1, 1);
        return 1;
    }
    if (k && !strcmp(k, "cache")) { /* the shared Cache, or nil for a private pool */
        lua_getiuservalue(L, 1, 4);
        return 1;
    }
    lua_getmetatable(L, 1);
    lua_getfield(L, -1, "__methods");
    lua_pushvalue(L, 2);
    if (lua_rawget(L, -2) != LUA_TNIL) return 1;
    if (lua_getiuservalue(L, 1, 3) != LUA_TTABLE) return 0;
    lua_pushvalue(L, 2);
    lua_rawget(L, -2);
    return 1;
}

/* Sessions carry Lua-side fields (s.finish_reason from generate, or
 * anything a script attaches); built-in names are read-only. */
static int l_session_newindex(lua_State *L) {
    luaL_checkudata(L, 1, L_SESSION);
    const char *k = lua_tostring(L, 2);
    if (k && (!strcmp(k, "pos") || !strcmp(k, "ctx") || !strcmp(k, "model") || !strcmp(k, "cache")))
        luaL_error(L, "session field '%s' is read-only", k);
    lua_getmetatable(L, 1);
    lua_getfield(L, -1, "__methods");
    lua_pushvalue(L, 2);
    if (lua_rawget(L, -2) != LUA_TNIL) luaL_error(L, "cannot overwrite session method '%s'", k ? k : "?");
    if (lua_getiuservalue(L, 1, 3) != LUA_TTABLE) {
        lua_pop(L, 1);
        lua_newtable(L);
        lua_pushvalue(L, -1);
        lua_setiuservalue(L, 1, 3);
    }
    lua_pushvalue(L, 2);
    lua_pushvalue(L, 3);
    lua_rawset(L, -3);
    return 0;
}

/* kvlua.decode_batch({s1, s2, ...}, {id1, id2, ...}) --> {Logits, ...} | nil, err:
 * one forward pass for the next token of every session (distinct sessions
 * of one model); each Logits is the same bits s:decode(id) would give. */
static int l_decode_batch(lua_State *L) {
    luaL_checktype(L, 1, LUA_TTABLE);
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_Integer n = luaL_len(L, 1);
    if (n < 1 || n > 65536) luaL_argerror(L, 1, "between 1 and 65536 sessions");
    if (luaL_len(L, 2) != n) luaL_argerror(L, 2, "one token id per session");
    kv_session **ss = lua_newuserdatauv(L, (size_t)n * sizeof *ss, 0);
    l_session **lss = lua_newuserdatauv(L, (size_t)n * sizeof *lss, 0);
    int32_t *ids = lua_newuserdatauv(L, (size_t)n * sizeof *ids, 0);
    int n_vocab = 0;
    for (lua_Integer i = 1; i <= n; i++) {
        lua_geti(L, 1, i);
        if (!luaL_testudata(L, -1, L_SESSION)) luaL_error(L, "decode_batch: entry %I is not a session", i);
        l_session *ls = l_session_check(L, -1);
        lua_pop(L, 1);
        if (i == 1) n_vocab = kv_model_info_get(ls->lm->m)->n_vocab;
        else if (ls->lm != lss[0]->lm) luaL_error(L, "decode_batch: session %I belongs to another model", i);
        for (lua_Integer j = 1; j < i; j++)
            if (lss[j - 1] == ls) luaL_error(L, "decode_batch: session %I appears twice", i);
        lua_geti(L, 2, i);
        int ok = 0;
        lua_Integer id = lua_tointegerx(L, -1, &ok);
        lua_pop(L, 1);
        if (!ok || id < 0 || id >= n_vocab) luaL_error(L, "decode_batch: token id at index %I out of range [0, %d)", i, n_vocab);
        lss[i - 1] = ls;
        ss[i - 1] = ls->s;
        ids[i - 1] = (int32_t)id;
    }
    if ((size_t)n_vocab > SIZE_MAX / sizeof(float) / (size_t)n) luaL_error(L, "decode_batch: too many logits");
    float *out = lua_newuserdatauv(L, (size_t)n * (size_t)n_vocab * sizeof(float), 0);
    for (lua_Integer i = 0; i < n; i++) l_cache_before_eval(L, lss[i]->lc);
    kv_error e = {{0}};
    double t0 = l_now();
    kv_status st = kv_decode_batch(ss, ids, (size_t)n, out, &e);
    double dt = l_now() - t0;
    for (lua_Integer i = 0; i < n; i++) l_cache_after_eval(L, lss[i]->lc);
    if (st != KV_OK) return l_fail(L, e.msg);
    lua_createtable(L, (int)n, 0);
    for (lua_Integer i = 1; i <= n; i++) {
        l_session *ls = lss[i - 1];
        float *dst = l_logits_push(L, n_vocab, 1);
        memcpy(dst, out + (size_t)(i - 1) * n_vocab, (size_t)n_vocab * sizeof(float));
        lua_geti(L, 1, i); /* the session: remember its last logits */
        lua_pushvalue(L, -2);
        lua_setiuservalue(L, -2, 2);
        lua_pop(L, 1);
        lua_rawseti(L, -2, i);
        if (ls->n_itl == ls->cap_itl) {
            size_t cap = ls->cap_itl ? ls->cap_itl * 2 : 256;
            double *p = realloc(ls->itl, cap * sizeof(double));
            if (p) ls->itl = p, ls->cap_itl = cap;
        }
        if (ls->n_itl < ls->cap_itl) ls->itl[ls->n_itl++] = dt;
        ls->decode_tokens++;
    }
    return 1;
}

/* ==== module functions =================================================== */

static int l_devices(lua_State *L) {
    kvcl_device_info devs[16];
    int n = kvcl_devices(devs, 16);
    if (n > 16) n = 16;
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_createtable(L, 0, 7);
        lua_pushinteger(L, i + 1), lua_setfield(L, -2, "index");
        lua_pushstring(L, devs[i].platform), lua_setfield(L, -2, "platform");
        lua_pushstring(L, devs[i].name), lua_setfield(L, -2, "name");
        lua_pushstring(L, devs[i].type), lua_setfield(L, -2, "type");
        lua_pushinteger(L, (lua_Integer)devs[i].memory), lua_setfield(L, -2, "memory");
        lua_pushinteger(L, (lua_Integer)devs[i].max_alloc), lua_setfield(L, -2, "max_alloc");
        lua_pushboolean(L, devs[i].has_fp16), lua_setfield(L, -2, "fp16");
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* kvlua.utf8_complete(s) -> length of the longest prefix not ending inside
 * an incomplete UTF-8 sequence (what a streaming printer may emit). */
static int l_utf8_complete(lua_State *L) {
    size_t n;
    const char *s = luaL_checklstring(L, 1, &n);
    lua_pushinteger(L, (lua_Integer)kv_utf8_complete_prefix(s, n));
    return 1;
}

static const luaL_Reg l_funcs[] = {
    {"load", l_load},
    {"cache", l_cache_new},
    {"decode_batch", l_decode_batch},
    {"restore", l_restore},
    {"devices", l_devices},
    {"logits", l_logits_new},
    {"utf8_complete", l_utf8_complete},
    {NULL, NULL},
};

static void l_new_class(lua_State *L, const char *name, const luaL_Reg *methods, lua_CFunction index,
                        lua_CFunction gc, lua_CFunction tostring) {
    luaL_newmetatable(L, name);
    lua_newtable(L);
    luaL_setfuncs(L, methods, 0);
    lua_setfield(L, -2, "__methods");
    lua_pushcfunction(L, index), lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, gc), lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, gc), lua_setfield(L, -2, "__close");
    lua_pushcfunction(L, tostring), lua_setfield(L, -2, "__tostring");
    lua_pushstring(L, name), lua_setfield(L, -2, "__name");
    lua_pop(L, 1);
}

/* Installs a method written in Lua (luamod/kvlua/<module>.lua returns the
 * function) into a class; a missing module leaves the method out. */
static void l_lua_method(lua_State *L, const char *cls, const char *method, const char *module) {
    lua_getglobal(L, "require");
    lua_pushstring(L, module);
    if (lua_pcall(L, 1, 1, 0) != LUA_OK || !lua_isfunction(L, -1)) {
        lua_pop(L, 1);
        return;
    }
    luaL_getmetatable(L, cls);
    lua_getfield(L, -1, "__methods");
    lua_pushvalue(L, -3);
    lua_setfield(L, -2, method);
    lua_pop(L, 3);
}

int luaopen_kvlua(lua_State *L) {
    l_new_class(L, L_MODEL, l_model_methods, l_model_index, l_model_gc, l_model_tostring);
    l_new_class(L, L_SESSION, l_session_methods, l_session_index, l_session_gc, l_session_tostring);
    luaL_getmetatable(L, L_SESSION);
    lua_pushcfunction(L, l_session_newindex);
    lua_setfield(L, -2, "__newindex");
    lua_pop(L, 1);
    l_logits_open(L);
    l_cache_open(L);
    luaL_newlib(L, l_funcs);
    lua_pushstring(L, KVLUA_VERSION);
    lua_setfield(L, -2, "version");
    /* register the module before loading the Lua-side parts, which require it */
    lua_getfield(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
    lua_pushvalue(L, -2);
    lua_setfield(L, -2, "kvlua");
    lua_pop(L, 1);
    l_lua_method(L, L_SESSION, "generate", "kvlua.generate");
    return 1;
}
