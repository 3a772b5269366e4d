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
 * of model:close(), __gc and session closing happens last. A session stays
 * fully usable after model:close() (prefill, decode, generate); the closed
 * model itself raises on every use. A Cache (l_cache.c) counts as a user
 * of its model too; a session drawing from a Cache keeps it alive (user
 * value 5).
 *
 * Re-entry: any allocation inside a method may run a finalizer, and any
 * read of a user's table may run a metamethod; either may close the object
 * the method is using. So every method that holds an engine pointer across
 * a call into Lua marks its object busy for the length of the call
 * (l_busy: a guard kept as a user value, made to-be-closed on the method's
 * stack, so an error unwinds it too). close() and <close> on a busy object
 * only mark it closed; its engine objects are freed when the last busy
 * call returns. __gc frees at once: an unreachable object has no call in
 * progress (a call keeps its object on a live stack).
 */
#include <errno.h>
#include <limits.h>
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
#include "l_obj.h"
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
        size_t len;
        if (t != LUA_TSTRING) luaL_error(L, "option '%s' must be a string", k);
        v = lua_tolstring(L, -1, &len);
        if (strlen(v) != len) luaL_error(L, "option '%s' contains a NUL byte", k);
    }
    return v; /* the value stays on the stack: an __index metamethod may have made it */
}

/* A string argument handed to C as a C string: an embedded NUL would cut
 * it silently, so it is refused. */
static const char *l_check_cstr(lua_State *L, int arg) {
    size_t len;
    const char *s = luaL_checklstring(L, arg, &len);
    if (strlen(s) != len) luaL_argerror(L, arg, "contains a NUL byte");
    return s;
}

static int l_fail(lua_State *L, const char *msg) {
    lua_pushnil(L);
    lua_pushstring(L, msg);
    return 2;
}

/* Length of the array of token ids at idx (raises on a bad one). */
size_t l_ids_len(lua_State *L, int idx) {
    luaL_checktype(L, idx, LUA_TTABLE);
    lua_Integer n = luaL_len(L, idx);
    if (n < 0 || n > (1 << 30)) luaL_argerror(L, idx, lua_pushfstring(L, "bad length %I", (LUAI_UACINT)n));
    return (size_t)n;
}

/* Reads the n token ids of the array at idx into a buffer owned by Lua (a
 * userdata pushed on the stack, so nothing leaks if anything raises).
 * Raises on a non-integer or out-of-range id (n_vocab < 0: no range check). */
int32_t *l_check_ids(lua_State *L, int idx, size_t n, int32_t n_vocab) {
    int32_t *ids = lua_newuserdatauv(L, sizeof(int32_t) * (n ? n : 1), 0);
    for (lua_Integer i = 1; i <= (lua_Integer)n; i++) {
        lua_geti(L, idx, i);
        int ok = 0;
        lua_Integer v = lua_tointegerx(L, -1, &ok);
        lua_pop(L, 1);
        if (!ok) luaL_error(L, "token id at index %I is not an integer", (LUAI_UACINT)i);
        if (v < 0 || (n_vocab >= 0 && v >= n_vocab))
            luaL_error(L, "token id %I at index %I out of range [0, %d)", (LUAI_UACINT)v, (LUAI_UACINT)i,
                       (int)n_vocab);
        ids[i - 1] = (int32_t)v;
    }
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

/* ==== busy objects ======================================================== */

/* What a Model and a Session share: the closed flag and the busy count
 * (see "Re-entry" at the top), and the function that frees the engine
 * objects once the object is closed and idle (idempotent). */
/* The guard of an object: a small userdata pointing back at it, whose
 * __close ends one busy call. Created with the object (user value slot). */
void l_guard_new(lua_State *L, l_obj *o, int owner, int slot) {
    owner = lua_absindex(L, owner);
    l_obj **g = lua_newuserdatauv(L, sizeof *g, 0);
    *g = o;
    luaL_setmetatable(L, L_GUARD);
    lua_setiuservalue(L, owner, slot);
}

static int l_guard_close(lua_State *L) {
    l_obj *o = *(l_obj **)lua_touserdata(L, 1);
    o->busy--;
    o->release(o);
    return 0;
}

/* Marks o (the object at index 1) busy until the calling C function
 * returns or raises. The guard goes above the arguments, which are padded
 * with nil (a method reads at most L_MAX_ARGS, self included). */
void l_busy(lua_State *L, l_obj *o, int slot) {
    lua_settop(L, L_MAX_ARGS);
    lua_getiuservalue(L, 1, slot);
    lua_toclose(L, -1);
    o->busy++;
}

/* close() / <close>: frees now, or when the last busy call returns. */
void l_obj_close(l_obj *o) {
    o->closed = 1;
    o->release(o);
}

/* __gc: the object is unreachable, so no call on it is in progress (an
 * unfinished one can only sit on a dead coroutine's stack): free now. */
void l_obj_finalize(l_obj *o) {
    o->closed = 1;
    o->busy = 0;
    o->release(o);
}

/* ==== Model ================================================================ */

#define L_MODEL_GUARD 3 /* user values: 1 info, 2 vocab, 3 guard, 4 decode_batch's logits buffer */
#define L_MODEL_BATCH_OUT 4

typedef struct {
    l_obj o;
    kv_model *m;  /* NULL until opened, and once freed */
    int sessions; /* open sessions using m */
    int policies; /* eviction policies running (called from evaluations of its sessions) */
} l_model;

static void l_model_release(l_obj *o) {
    l_model *lm = (l_model *)o;
    if (lm->m && o->closed && o->busy == 0 && lm->sessions == 0) {
        kv_model_close(lm->m);
        lm->m = NULL;
    }
}

static l_model *l_model_check(lua_State *L, int idx) {
    l_model *lm = luaL_checkudata(L, idx, L_MODEL);
    if (lm->o.closed || !lm->m) luaL_error(L, "attempt to use a closed model");
    return lm;
}

/* The start of every model method that uses the engine: self is an open
 * model, busy until the method returns. */
static l_model *l_model_enter(lua_State *L) {
    l_model *lm = l_model_check(L, 1);
    l_busy(L, &lm->o, L_MODEL_GUARD);
    return lm;
}

kv_model *l_model_peek(lua_State *L, int idx) { return l_model_check(L, idx)->m; }

kv_model *l_model_hold(lua_State *L, int idx, void **owner) {
    l_model *lm = l_model_check(L, idx);
    lm->sessions++;
    *owner = lm;
    return lm->m;
}

/* While an eviction policy runs, nothing may change the evaluation that
 * called it: no session or cache of the model changes (raises). Reading
 * (tokens, stats, lookup) and closing (deferred for busy objects; pages a
 * finalizer releases only add room) stay possible. */
void l_model_policy(void *owner, int delta) {
    if (owner) ((l_model *)owner)->policies += delta;
}

void l_model_not_in_policy(lua_State *L, void *owner, const char *what) {
    if (owner && ((l_model *)owner)->policies > 0)
        luaL_error(L, "%s: not allowed while an eviction policy of this model is running", what);
}

void l_model_unhold(void *owner) {
    l_model *lm = owner;
    lm->sessions--;
    l_model_release(&lm->o);
}

static const kv_vocab *l_vocab_of(lua_State *L, const kv_model *m) {
    const kv_vocab *v = kv_model_vocab(m);
    if (!v) luaL_error(L, "model has no tokenizer (no tokenizer.ggml.model in the file)");
    return v;
}

static int l_load(lua_State *L) {
    const char *path = l_check_cstr(L, 1);
    if (!lua_isnoneornil(L, 2)) luaL_checktype(L, 2, LUA_TTABLE);
    const char *backend = l_opt_str(L, 2, "backend", "auto");
    lua_Integer threads = l_opt_int(L, 2, "threads", 0);
    lua_Integer device = l_opt_int(L, 2, "device", 1); /* as kvlua.devices() numbers them: from 1 */
    int be = strcmp(backend, "cpu") == 0      ? KV_BACKEND_CPU
             : strcmp(backend, "opencl") == 0 ? KV_BACKEND_OPENCL
             : strcmp(backend, "auto") == 0   ? KV_BACKEND_AUTO
                                              : -1;
    if (be < 0) luaL_error(L, "option 'backend' must be \"auto\", \"cpu\" or \"opencl\" (got \"%s\")", backend);
    if (threads < 0 || threads > KV_MAX_THREADS)
        luaL_error(L, "option 'threads' out of range: %I (1..%d, or 0 for the physical cores)",
                   (LUAI_UACINT)threads, KV_MAX_THREADS);
    if (be == KV_BACKEND_OPENCL) { /* which devices exist is the world's business: nil, message */
        kvcl_device_info devs[16];
        int n = kvcl_devices(devs, 16);
        if (n > 16) n = 16;
        if (n > 0 && (device < 1 || device > n))
            return l_fail(L, lua_pushfstring(L, "no OpenCL device %I (kvlua.devices() lists %d: give 1 to %d)",
                                             (LUAI_UACINT)device, n, n));
    }
    if (device < 1) device = 1; /* "auto" and "cpu" choose without it */

    l_model *lm = lua_newuserdatauv(L, sizeof *lm, 4); /* born closed */
    memset(lm, 0, sizeof *lm);
    lm->o.closed = 1;
    lm->o.release = l_model_release;
    luaL_setmetatable(L, L_MODEL);
    l_guard_new(L, &lm->o, -1, L_MODEL_GUARD);

    kv_model_params p = {.threads = (int)threads, .backend = be, .device = (int)(device > 1024 ? 1024 : device - 1)};
    kv_error e = {{0}};
    kv_model *m = NULL;
    if (kv_model_open(path, &p, &m, &e) != KV_OK) return l_fail(L, e.msg);
    lm->m = m;
    lm->o.closed = 0;
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
    if (in->device_index >= 0) SETI("device_index", in->device_index + 1); /* kvlua.devices()[device_index] */
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
    l_model *lm = l_model_enter(L);
    const char *key = l_check_cstr(L, 2); /* meta_keys lists no key with a NUL byte */
    const kv_gguf_value *v = kv_gguf_get(kv_model_gguf(lm->m), key);
    if (!v) {
        lua_pushnil(L);
        return 1;
    }
    l_push_gguf_value(L, v, 0);
    return 1;
}

/* model:meta_keys() -> array of the metadata keys, in file order: every
 * one model:meta takes, so a key with a NUL byte (which meta refuses, as
 * every C-string argument) is left out. */
static int l_model_meta_keys(lua_State *L) {
    l_model *lm = l_model_enter(L);
    const kv_gguf *g = kv_model_gguf(lm->m);
    lua_createtable(L, (int)g->n_kv, 0);
    lua_Integer k = 0;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const size_t len = (size_t)g->kv[i].key.len;
        if (memchr(g->kv[i].key.ptr, 0, len)) continue;
        lua_pushlstring(L, g->kv[i].key.ptr, len);
        lua_rawseti(L, -2, ++k);
    }
    return 1;
}

static int l_model_tensors(lua_State *L) {
    l_model *lm = l_model_enter(L);
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

/* ---- the vocabulary, shared by model methods and the session helpers of
 * generate (which work after model:close()); the object is busy. */

/* tokenize(text at arg, options at arg + 1) -> {id, ...} | nil, err */
static int l_vocab_tokenize(lua_State *L, const kv_vocab *v, int arg) {
    size_t len;
    const char *text = luaL_checklstring(L, arg, &len);
    if (!lua_isnoneornil(L, arg + 1)) luaL_checktype(L, arg + 1, LUA_TTABLE);
    int add_special = l_opt_bool(L, arg + 1, "add_special", 1);
    int parse_special = l_opt_bool(L, arg + 1, "parse_special", 0);
    /* literal = { {i, j}, ... }: byte ranges text:sub(i, j) read as with
     * parse_special false (no control token is recognized there) */
    uint8_t *literal = NULL;
    if (l_opt_field(L, arg + 1, "literal") != LUA_TNIL) {
        if (!lua_istable(L, -1)) luaL_error(L, "option 'literal' must be an array of {i, j} byte ranges");
        int spans = lua_gettop(L);
        literal = lua_newuserdatauv(L, len + 1, 0); /* freed by the GC, even if we raise */
        memset(literal, 0, len + 1);
        lua_Integer k = luaL_len(L, spans);
        for (lua_Integer r = 1; r <= k; r++) {
            lua_Integer ij[2];
            int ok = lua_geti(L, spans, r) == LUA_TTABLE;
            for (int b = 0; ok && b < 2; b++) {
                int isnum;
                lua_geti(L, -1 - b, b + 1);
                ij[b] = lua_tointegerx(L, -1, &isnum);
                ok = isnum;
            }
            if (!ok) luaL_error(L, "option 'literal': range %d must be {i, j} with integers", (int)r);
            lua_pop(L, 3);
            if (ij[0] < 1 || ij[1] > (lua_Integer)len || ij[0] > ij[1] + 1)
                luaL_error(L, "option 'literal': range %d {%d, %d} is outside the text (%d bytes)", (int)r,
                           (int)ij[0], (int)ij[1], (int)len);
            if (ij[1] >= ij[0]) memset(literal + ij[0] - 1, 1, (size_t)(ij[1] - ij[0] + 1));
        }
    }
    int32_t *ids = NULL;
    size_t n = 0;
    kv_error e = {{0}};
    if (kv_tokenize_literal(v, text, len, add_special, parse_special, literal, &ids, &n, &e) != KV_OK) {
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

static int32_t l_check_id(lua_State *L, int idx, const kv_vocab *v) {
    lua_Integer id = luaL_checkinteger(L, idx);
    if (id < 0 || id >= kv_vocab_n(v))
        luaL_error(L, "token id %I out of range [0, %d)", (LUAI_UACINT)id, (int)kv_vocab_n(v));
    return (int32_t)id;
}

/* piece(id at arg [, special at arg + 1 = true]) -> string */
static int l_vocab_piece(lua_State *L, const kv_vocab *v, int arg) {
    int32_t id = l_check_id(L, arg, v);
    int special = lua_isnoneornil(L, arg + 1) ? 1 : lua_toboolean(L, arg + 1);
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

/* is_eog(id at arg) -> boolean */
static int l_vocab_is_eog(lua_State *L, const kv_vocab *v, int arg) {
    lua_pushboolean(L, kv_vocab_is_eog(v, l_check_id(L, arg, v)));
    return 1;
}

static int l_model_tokenize(lua_State *L) {
    l_model *lm = l_model_enter(L);
    return l_vocab_tokenize(L, l_vocab_of(L, lm->m), 2);
}

static int l_model_detokenize(lua_State *L) {
    l_model *lm = l_model_enter(L);
    const kv_vocab *v = l_vocab_of(L, lm->m);
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    int remove_special = l_opt_bool(L, 3, "remove_special", 0);
    int unparse_special = l_opt_bool(L, 3, "unparse_special", 0);
    size_t n = l_ids_len(L, 2);
    int32_t *ids = l_check_ids(L, 2, n, kv_vocab_n(v));
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

static int l_model_piece(lua_State *L) {
    l_model *lm = l_model_enter(L);
    return l_vocab_piece(L, l_vocab_of(L, lm->m), 2);
}

/* model:token_text(id) -> raw stored text */
static int l_model_token_text(lua_State *L) {
    l_model *lm = l_model_enter(L);
    const kv_vocab *v = l_vocab_of(L, lm->m);
    size_t len = 0;
    const char *s = kv_vocab_text(v, l_check_id(L, 2, v), &len);
    lua_pushlstring(L, s ? s : "", s ? len : 0);
    return 1;
}

static int l_model_is_eog(lua_State *L) {
    l_model *lm = l_model_enter(L);
    return l_vocab_is_eog(L, l_vocab_of(L, lm->m), 2);
}

/* model:kv_bytes{ctx, batch, ktype, vtype, page_tokens}: bytes sessions of
 * ctx positions hold (page-rounded); a count past 2^63 raises rather than
 * wrapping. */
static int l_model_kv_bytes(lua_State *L) {
    l_model *lm = l_model_enter(L);
    if (!lua_isnoneornil(L, 2)) luaL_checktype(L, 2, LUA_TTABLE);
    lua_Integer ctx = l_opt_int(L, 2, "ctx", kv_model_info_get(lm->m)->n_ctx_train);
    lua_Integer batch = l_opt_int(L, 2, "batch", 1);
    lua_Integer pt = l_opt_int(L, 2, "page_tokens", 16);
    const int n_layer = kv_model_info_get(lm->m)->n_layer;
    int *types = lua_newuserdatauv(L, 2 * sizeof(int) * (size_t)(n_layer ? n_layer : 1), 0);
    l_kv_types(L, 2, "ktype", n_layer, types);
    l_kv_types(L, 2, "vtype", n_layer, types + n_layer);
    if (ctx < 0 || batch < 0)
        luaL_error(L, "ctx and batch must be >= 0 (got ctx %I, batch %I)", (LUAI_UACINT)ctx, (LUAI_UACINT)batch);
    if (pt <= 0 || pt > 65536 || (pt & (pt - 1)))
        luaL_error(L, "option 'page_tokens' must be a power of two (got %I)", (LUAI_UACINT)pt);
    uint64_t b = kv_model_kv_bytes_layers(lm->m, ctx, types, types + n_layer, (int)pt); /* saturates */
    if (b == UINT64_MAX || (batch > 0 && b > (uint64_t)LUA_MAXINTEGER / (uint64_t)batch))
        luaL_error(L, "kv_bytes: ctx %I x batch %I needs more than 2^63 bytes", (LUAI_UACINT)ctx,
                   (LUAI_UACINT)batch);
    lua_pushinteger(L, (lua_Integer)(b * (uint64_t)batch));
    return 1;
}

/* model:fingerprint() --> hex BLAKE2b of the file, seconds it took (once) */
static int l_model_fingerprint(lua_State *L) {
    l_model *lm = l_model_enter(L);
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

static int l_model_close(lua_State *L) {
    l_obj_close(luaL_checkudata(L, 1, L_MODEL));
    return 0;
}

static int l_model_gc(lua_State *L) {
    l_obj_finalize(luaL_checkudata(L, 1, L_MODEL));
    return 0;
}

static int l_model_tostring(lua_State *L) {
    l_model *lm = luaL_checkudata(L, 1, L_MODEL);
    if (lm->o.closed || !lm->m) {
        lua_pushstring(L, "kvlua.Model (closed)");
        return 1;
    }
    l_busy(L, &lm->o, L_MODEL_GUARD); /* pushfstring allocates while reading the names */
    const kv_model_info *in = kv_model_info_get(lm->m);
    lua_pushfstring(L, "kvlua.Model (%s, %s)", in->arch, in->name);
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
    {"close", l_model_close},
    {NULL, NULL},
};

/* model.info / model.vocab are built once and cached in user values 1, 2. */
static int l_model_index(lua_State *L) {
    l_model *lm = luaL_checkudata(L, 1, L_MODEL);
    const char *k = lua_tostring(L, 2);
    if (k && (!strcmp(k, "info") || !strcmp(k, "vocab"))) {
        l_model_enter(L);
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

/* user values: 1 the model, 2 the last Logits (or a string saying why there
 * are none), 3 a table of Lua-side fields, 4 the guard, 5 the Cache */
#define L_SESSION_GUARD 4
#define L_SESSION_CACHE 5
#define L_MAX_CTX (1 << 24)

typedef struct {
    l_obj o;
    kv_session *s;    /* NULL until opened, and once freed */
    l_model *lm;      /* owner (kept alive by user value 1) */
    l_cache *lc;      /* the shared cache it draws from (user value 5), NULL: private pool */
    uint64_t gen;     /* bumped by every change of its sequence (eval, rewind, shift, decode_batch) */
    /* stats */
    double ttft;      /* seconds of the first prefill, -1 before */
    double *itl;      /* decode latencies, seconds */
    size_t n_itl, cap_itl;
    uint64_t prefill_tokens, decode_tokens;
    double prefill_seconds;
} l_session;

static void l_session_release(l_obj *o) {
    l_session *ls = (l_session *)o;
    if (!o->closed || o->busy) return;
    if (ls->s) {
        kv_session_close(ls->s);
        ls->s = NULL;
        ls->lm->sessions--;
        l_model_release(&ls->lm->o);
    }
    free(ls->itl);
    ls->itl = NULL;
    ls->n_itl = ls->cap_itl = 0;
}

static l_session *l_session_check(lua_State *L, int idx) {
    l_session *ls = luaL_checkudata(L, idx, L_SESSION);
    if (ls->o.closed || !ls->s) luaL_error(L, "attempt to use a closed session");
    return ls;
}

/* The start of every session method that uses the engine (see l_model_enter). */
static l_session *l_session_enter(lua_State *L) {
    l_session *ls = l_session_check(L, 1);
    l_busy(L, &ls->o, L_SESSION_GUARD);
    return ls;
}

/* Why s:logits() has nothing to give (user value 2). */
static void l_session_no_logits(lua_State *L, const char *why) {
    lua_pushstring(L, why);
    lua_setiuservalue(L, 1, 2);
}

/* A new session userdata, born closed, keeping the model at index mi and
 * the Cache at index ci (0: none) alive. l_session_open opens it. */
static l_session *l_session_push(lua_State *L, int mi, int ci) {
    mi = lua_absindex(L, mi);
    ci = ci ? lua_absindex(L, ci) : 0;
    l_session *ls = lua_newuserdatauv(L, sizeof *ls, 5);
    memset(ls, 0, sizeof *ls);
    ls->o.closed = 1;
    ls->o.release = l_session_release;
    ls->ttft = -1;
    luaL_setmetatable(L, L_SESSION);
    lua_pushvalue(L, mi);
    lua_setiuservalue(L, -2, 1); /* keep the model alive */
    if (ci) {
        lua_pushvalue(L, ci);
        lua_setiuservalue(L, -2, L_SESSION_CACHE); /* and the cache */
    }
    l_guard_new(L, &ls->o, -1, L_SESSION_GUARD);
    lua_pushliteral(L, "no logits yet: nothing was evaluated");
    lua_setiuservalue(L, -2, 2);
    return ls;
}

static void l_session_open(lua_State *L, l_session *ls, kv_session *s, l_model *lm, l_cache *lc) {
    ls->lm = lm;
    ls->lc = lc;
    ls->s = s;
    lm->sessions++;
    ls->o.closed = 0;
    /* Lua sees a small userdata: step the collector as if the cache had
     * been allocated through it, so dropped sessions are reclaimed in step
     * with new ones (closing them, or <close>, frees at once) */
    uint64_t kb = kv_session_kv_bytes(s) >> 10;
    if (!lc) /* a private pool holds up to its whole context (pages come as tokens do) */
        kb = kv_cache_bytes_per_token(kv_session_cache(s)) * (uint64_t)kv_session_ctx(s) >> 10;
    lua_gc(L, LUA_GCSTEP, kb > INT_MAX ? INT_MAX : (int)kb);
}

static int l_session_new(lua_State *L) {
    l_model *lm = l_model_enter(L);
    if (!lua_isnoneornil(L, 2)) luaL_checktype(L, 2, LUA_TTABLE);
    const kv_model_info *in = kv_model_info_get(lm->m);
    lua_Integer ctx = l_opt_int(L, 2, "ctx", in->n_ctx_train < 4096 ? in->n_ctx_train : 4096);
    if (ctx <= 0 || ctx > L_MAX_CTX)
        luaL_error(L, "option 'ctx' out of range: %I (1..%d)", (LUAI_UACINT)ctx, L_MAX_CTX);
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
    l_model_not_in_policy(L, lm, "session");

    l_session *ls = l_session_push(L, 1, ci);
    kv_error e = {{0}};
    kv_session *s = NULL;
    kv_session_params p = {.n_ctx = (int)ctx, .ktypes = types, .vtypes = types + n_layer, .cache = lc ? lc->c : NULL};
    if (kv_session_open_p(lm->m, &p, &s, &e) != KV_OK) return l_fail(L, e.msg);
    l_session_open(L, ls, s, lm, lc);
    return 1;
}

static int l_session_close(lua_State *L) {
    l_obj_close(luaL_checkudata(L, 1, L_SESSION));
    return 0;
}

static int l_session_gc(lua_State *L) {
    l_obj_finalize(luaL_checkudata(L, 1, L_SESSION));
    return 0;
}

/* Pushes nil, "context full: ..." unless n more tokens fit; returns 0 when
 * they do. */
static int l_session_room(lua_State *L, l_session *ls, size_t n) {
    int pos = kv_session_pos(ls->s), ctx = kv_session_ctx(ls->s);
    if (n <= (size_t)(ctx - pos)) return 0;
    lua_pushnil(L);
    lua_pushfstring(L, "context full: %d tokens in session + %I new > n_ctx %d", pos, (LUAI_UACINT)n, ctx);
    return 2;
}

static void l_session_count(l_session *ls, size_t n, double dt, int is_decode) {
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
}

/* Runs n ids through the session (self at index 1). Pushes the Logits of
 * mode (KV_LOGITS_LAST, _ALL), or true for KV_LOGITS_NONE; or nil, message.
 * The forward pass writes straight into the Logits, which is created only
 * once the context is known to have room. */
static int l_session_eval(lua_State *L, l_session *ls, const int32_t *ids, size_t n, int mode, int is_decode) {
    l_model_not_in_policy(L, ls->lm, is_decode ? "decode" : "prefill");
    kv_error e = {{0}};
    if (kv_model_check_file(ls->lm->m, &e) != KV_OK) return l_fail(L, e.msg);
    int r = l_session_room(L, ls, n);
    if (r) return r;
    int n_vocab = kv_model_info_get(ls->lm->m)->n_vocab;
    int rows = mode == KV_LOGITS_ALL ? (int)n : 1;
    float *out = mode == KV_LOGITS_NONE ? NULL : l_logits_push(L, n_vocab, rows);
    l_cache_before_eval(L, ls->lc);
    double t0 = l_now();
    kv_status st = kv_session_eval(ls->s, ids, n, mode, out, &e);
    double dt = l_now() - t0;
    l_cache_after_eval(L, ls->lc); /* raises what the eviction policy raised */
    if (st != KV_OK) return l_fail(L, e.msg);
    ls->gen++;
    l_session_count(ls, n, dt, is_decode);
    if (mode == KV_LOGITS_NONE) {
        l_session_no_logits(L, "no logits: the last eval computed none (prefill with logits = \"none\")");
        lua_pushboolean(L, 1);
        return 1;
    }
    /* remember the last position's logits for s:logits() / generate */
    if (rows > 1) {
        float *last = l_logits_push(L, n_vocab, 1);
        memcpy(last, out + (size_t)(rows - 1) * (size_t)n_vocab, (size_t)n_vocab * sizeof(float));
    } else {
        lua_pushvalue(L, -1);
    }
    lua_setiuservalue(L, 1, 2);
    return 1;
}

static int l_session_prefill(lua_State *L) {
    l_session *ls = l_session_enter(L);
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    const char *lg = l_opt_str(L, 3, "logits", "last");
    int mode;
    if (!strcmp(lg, "last")) mode = KV_LOGITS_LAST;
    else if (!strcmp(lg, "all")) mode = KV_LOGITS_ALL;
    else if (!strcmp(lg, "none")) mode = KV_LOGITS_NONE;
    else return luaL_error(L, "option 'logits' must be \"last\", \"all\" or \"none\"");
    size_t n = l_ids_len(L, 2);
    if (n == 0) luaL_argerror(L, 2, "empty token list");
    int r = l_session_room(L, ls, n); /* before the ids are copied */
    if (r) return r;
    int32_t *ids = l_check_ids(L, 2, n, kv_model_info_get(ls->lm->m)->n_vocab);
    return l_session_eval(L, ls, ids, n, mode, 0);
}

static int l_session_decode(lua_State *L) {
    l_session *ls = l_session_enter(L);
    lua_Integer id = luaL_checkinteger(L, 2);
    int n_vocab = kv_model_info_get(ls->lm->m)->n_vocab;
    if (id < 0 || id >= n_vocab)
        luaL_error(L, "token id %I out of range [0, %d)", (LUAI_UACINT)id, n_vocab);
    int32_t tok = (int32_t)id;
    return l_session_eval(L, ls, &tok, 1, KV_LOGITS_LAST, 1);
}

/* s:logits() -> the last position's Logits | nil, why there are none */
static int l_session_logits(lua_State *L) {
    l_session_check(L, 1);
    if (lua_getiuservalue(L, 1, 2) != LUA_TSTRING) return 1;
    lua_pushnil(L);
    lua_insert(L, -2);
    return 2;
}

static int l_session_tokens(lua_State *L) {
    l_session *ls = l_session_enter(L);
    l_push_ids(L, kv_session_tokens(ls->s), (size_t)kv_session_pos(ls->s));
    return 1;
}

static int l_session_rewind(lua_State *L) {
    l_session *ls = l_session_enter(L);
    lua_Integer n = luaL_checkinteger(L, 2);
    if (n < 0) luaL_argerror(L, 2, "must be >= 0");
    l_model_not_in_policy(L, ls->lm, "rewind");
    if (n > kv_session_pos(ls->s)) n = kv_session_pos(ls->s);
    kv_session_rewind(ls->s, (int)n);
    if (n > 0) {
        ls->gen++;
        l_session_no_logits(L, "no logits: the session was rewound since its last eval");
    }
    return 0;
}

static int l_session_stats(lua_State *L) {
    l_session *ls = l_session_enter(L);
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
    l_session *ls = l_session_enter(L);
    l_model_not_in_policy(L, ls->lm, "fork");
    if (ls->lc) l_cache_before_eval(L, ls->lc), ls->lc->L = NULL; /* not inside its eviction policy */
    int ci = 0;
    if (ls->lc) {
        lua_getiuservalue(L, 1, L_SESSION_CACHE);
        ci = lua_gettop(L);
    }
    lua_getiuservalue(L, 1, 1);
    l_session *f = l_session_push(L, -1, ci);
    kv_error e = {{0}};
    kv_session *s = NULL;
    if (kv_session_fork(ls->s, &s, &e) != KV_OK) return l_fail(L, e.msg);
    l_session_open(L, f, s, ls->lm, ls->lc);
    lua_getiuservalue(L, 1, 2); /* the same last logits (or why there are none) */
    lua_setiuservalue(L, -2, 2);
    return 1;
}

/* s:shift{ keep = n_keep, drop = n } --> true | nil, err: drops positions
 * [keep, keep + drop) and moves the rest down (keys re-rotated) */
static int l_session_shift(lua_State *L) {
    l_session *ls = l_session_enter(L);
    l_model_not_in_policy(L, ls->lm, "shift");
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_Integer keep = l_opt_int(L, 2, "keep", 0), drop = l_opt_int(L, 2, "drop", 0);
    lua_Integer pos = kv_session_pos(ls->s);
    if (keep < 0 || drop <= 0 || keep > pos || drop > pos - keep)
        luaL_error(L, "shift: need 0 <= keep and 0 < drop with keep + drop <= %I tokens (got keep %I, drop %I)",
                   (LUAI_UACINT)pos, (LUAI_UACINT)keep, (LUAI_UACINT)drop);
    kv_error e = {{0}};
    l_cache_before_eval(L, ls->lc);
    kv_status st = kv_session_shift(ls->s, (int)keep, (int)drop, &e);
    l_cache_after_eval(L, ls->lc);
    if (st != KV_OK) return l_fail(L, e.msg);
    ls->gen++;
    l_session_no_logits(L, "no logits: the session was shifted since its last eval");
    lua_pushboolean(L, 1);
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
    return (const uint8_t *)k; /* stays on the stack */
}

/* s:save(path, { key = }) --> true | nil, err */
static int l_session_save(lua_State *L) {
    l_session *ls = l_session_enter(L);
    const char *path = l_check_cstr(L, 2);
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    const uint8_t *key = l_opt_key(L, 3);
    l_model_not_in_policy(L, ls->lm, "save");
    kv_error e = {{0}};
    if (kv_session_save(ls->s, path, key, &e) != KV_OK) return l_fail(L, e.msg);
    lua_pushboolean(L, 1);
    return 1;
}

static int l_session_tostring(lua_State *L) {
    l_session *ls = luaL_checkudata(L, 1, L_SESSION);
    if (ls->o.closed || !ls->s) lua_pushstring(L, "kvlua.Session (closed)");
    else lua_pushfstring(L, "kvlua.Session (%d/%d tokens)", kv_session_pos(ls->s), kv_session_ctx(ls->s));
    return 1;
}

/* ---- the vocabulary through a session, for kvlua.generate: it works
 * after model:close(), since an open session keeps the model's engine
 * object alive. Passed to the generate module, not installed as methods. */

static int l_session_vocab_tokenize(lua_State *L) {
    l_session *ls = l_session_enter(L);
    return l_vocab_tokenize(L, l_vocab_of(L, ls->lm->m), 2);
}

static int l_session_vocab_piece(lua_State *L) {
    l_session *ls = l_session_enter(L);
    return l_vocab_piece(L, l_vocab_of(L, ls->lm->m), 2);
}

static int l_session_vocab_is_eog(lua_State *L) {
    l_session *ls = l_session_enter(L);
    return l_vocab_is_eog(L, l_vocab_of(L, ls->lm->m), 2);
}

/* generation(s) -> a count bumped by every change of the session's sequence
 * (prefill, decode, decode_batch, rewind, shift): generate's iterator knows
 * that the session moved under it even when pos ends up the same. */
static int l_session_generation(lua_State *L) {
    l_session *ls = l_session_check(L, 1);
    lua_pushinteger(L, (lua_Integer)ls->gen);
    return 1;
}

static const luaL_Reg l_session_vocab[] = {
    {"generation", l_session_generation},
    {"tokenize", l_session_vocab_tokenize},
    {"piece", l_session_vocab_piece},
    {"is_eog", l_session_vocab_is_eog},
    {NULL, NULL},
};

static const luaL_Reg l_session_methods[] = {
    {"prefill", l_session_prefill},
    {"decode", l_session_decode},
    {"logits", l_session_logits},
    {"tokens", l_session_tokens},
    {"rewind", l_session_rewind},
    {"stats", l_session_stats},
    {"fork", l_session_fork},
    {"save", l_session_save},
    {"shift", l_session_shift},
    {"close", l_session_close},
    {NULL, NULL},
};

static int l_session_index(lua_State *L) {
    l_session *ls = luaL_checkudata(L, 1, L_SESSION);
    const char *k = lua_tostring(L, 2);
    if (k && (!strcmp(k, "pos") || !strcmp(k, "ctx"))) {
        l_session_check(L, 1);
        lua_pushinteger(L, k[0] == 'p' ? kv_session_pos(ls->s) : kv_session_ctx(ls->s));
        return 1;
    }
    if (k && !strcmp(k, "model")) {
        lua_getiuservalue(L, 1, 1);
        return 1;
    }
    if (k && !strcmp(k, "cache")) { /* the shared Cache, or nil for a private pool */
        lua_getiuservalue(L, 1, L_SESSION_CACHE);
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

/* kvlua.restore(model, path, { key =, cache =, ctx = }) --> session | nil, err
 * for a session file; for a cache file (c:save) with cache = c:
 * --> c, pages_added | nil, err (the pages join c; ctx does not apply). */
static int l_restore(lua_State *L) {
    l_model *lm = l_model_enter(L);
    const char *path = l_check_cstr(L, 2);
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    const uint8_t *key = l_opt_key(L, 3);
    lua_Integer ctx = l_opt_int(L, 3, "ctx", 0);
    if (ctx < 0 || ctx > L_MAX_CTX) luaL_error(L, "option 'ctx' out of range: %I (0..%d)", (LUAI_UACINT)ctx, L_MAX_CTX);
    l_cache *lc = NULL;
    int ci = 0;
    if (l_opt_field(L, 3, "cache") != LUA_TNIL) {
        lc = l_cache_check(L, -1);
        ci = lua_gettop(L);
        if (kv_cache_model(lc->c) != lm->m) luaL_error(L, "option 'cache': the cache belongs to another model");
    } else {
        lua_pop(L, 1);
    }
    l_model_not_in_policy(L, lm, "restore");
    if (kv_file_kind(path) == KV_FILE_CACHE) {
        if (!lc) return l_fail(L, "restore: a cache file: restore it into a cache (kvlua.restore(model, path, { cache = c }))");
        kv_error e = {{0}};
        int64_t added = 0;
        l_cache_before_eval(L, lc); /* not while its policy runs */
        kv_status st = kv_cache_restore(lc->c, path, key, &added, &e);
        l_cache_after_eval(L, lc);
        if (st != KV_OK) return l_fail(L, e.msg);
        lua_pushvalue(L, ci);
        lua_pushinteger(L, (lua_Integer)added);
        return 2;
    }
    l_session *ls = l_session_push(L, 1, ci);
    kv_error e = {{0}};
    kv_session *s = NULL;
    l_cache_before_eval(L, lc);
    kv_status st = kv_session_restore(lm->m, path, key, lc ? lc->c : NULL, (int)ctx, &s, &e);
    l_cache_after_eval(L, lc);
    if (st != KV_OK) return l_fail(L, e.msg);
    l_session_open(L, ls, s, lm, lc);
    return 1;
}

#define L_MAX_BATCH 4096

/* The n sessions of the table at index 1, for fn (decode_batch,
 * prefill_batch): raises unless they are distinct sessions of one model.
 * Pushes each session and its guard (to-be-closed) in turn, so session i
 * (from 1) lands at top + 2i - 1, and marks it busy. */
static void l_batch_sessions(lua_State *L, lua_Integer n, const char *fn, l_session **lss, kv_session **ss) {
    for (lua_Integer i = 1; i <= n; i++) {
        lua_geti(L, 1, i);
        if (!luaL_testudata(L, -1, L_SESSION)) luaL_error(L, "%s: entry %I is not a session", fn, (LUAI_UACINT)i);
        l_session *ls = l_session_check(L, -1);
        for (lua_Integer j = 1; j < i; j++)
            if (lss[j - 1] == ls) luaL_error(L, "%s: session %I appears twice", fn, (LUAI_UACINT)i);
        if (i > 1 && ls->lm != lss[0]->lm)
            luaL_error(L, "%s: session %I belongs to another model", fn, (LUAI_UACINT)i);
        lua_getiuservalue(L, -1, L_SESSION_GUARD);
        lua_toclose(L, -1);
        ls->o.busy++;
        lss[i - 1] = ls;
        ss[i - 1] = ls->s;
    }
}

/* kvlua.decode_batch({s1, s2, ...}, {id1, id2, ...}) --> {Logits, ...} | nil, err:
 * one forward pass for the next token of every session (distinct sessions
 * of one model); each Logits is the same bits s:decode(id) would give.
 * Every session is kept on the stack and marked busy for the call. */
static int l_decode_batch(lua_State *L) {
    luaL_checktype(L, 1, LUA_TTABLE);
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_settop(L, 2);
    lua_Integer n = luaL_len(L, 1);
    if (n < 1 || n > L_MAX_BATCH) luaL_argerror(L, 1, "between 1 and 4096 sessions");
    if (luaL_len(L, 2) != n) luaL_argerror(L, 2, "one token id per session");
    luaL_checkstack(L, (int)(2 * n + 16), "decode_batch");
    kv_session **ss = lua_newuserdatauv(L, (size_t)n * sizeof *ss, 0);
    l_session **lss = lua_newuserdatauv(L, (size_t)n * sizeof *lss, 0);
    int32_t *ids = lua_newuserdatauv(L, (size_t)n * sizeof *ids, 0);
    const int base = lua_gettop(L); /* sessions at base + 2i - 1, their guards above each */
    l_batch_sessions(L, n, "decode_batch", lss, ss);
    const int n_vocab = kv_model_info_get(lss[0]->lm->m)->n_vocab;
    for (lua_Integer i = 1; i <= n; i++) {
        lua_geti(L, 2, i);
        int ok = 0;
        lua_Integer id = lua_tointegerx(L, -1, &ok);
        lua_pop(L, 1);
        if (!ok || id < 0 || id >= n_vocab)
            luaL_error(L, "decode_batch: token id at index %I out of range [0, %d)", (LUAI_UACINT)i, n_vocab);
        ids[i - 1] = (int32_t)id;
    }
    if ((size_t)n_vocab > SIZE_MAX / sizeof(float) / (size_t)n) luaL_error(L, "decode_batch: too many logits");
    const size_t out_bytes = (size_t)n * (size_t)n_vocab * sizeof(float);
    lua_createtable(L, (int)n, 0);
    const int out_t = lua_gettop(L);
    /* the logits of every session before they are copied out: the model
     * keeps the buffer between calls (fresh memory every step would cost a
     * page fault per 4 KiB), taken off it for the call so that a call from
     * a finalizer meanwhile makes its own */
    lua_getiuservalue(L, base + 1, 1); /* the first session's model */
    const int model_i = lua_gettop(L);
    float *out = NULL;
    if (lua_getiuservalue(L, model_i, L_MODEL_BATCH_OUT) == LUA_TUSERDATA && lua_rawlen(L, -1) >= out_bytes) {
        out = lua_touserdata(L, -1);
        lua_pushnil(L);
        lua_setiuservalue(L, model_i, L_MODEL_BATCH_OUT);
    } else {
        lua_pop(L, 1);
        out = lua_newuserdatauv(L, out_bytes, 0);
    }
    const int buf_i = lua_gettop(L);
    l_model_not_in_policy(L, lss[0]->lm, "decode_batch");
    kv_error e = {{0}};
    if (kv_model_check_file(lss[0]->lm->m, &e) != KV_OK) return l_fail(L, e.msg);
    for (lua_Integer i = 0; i < n; i++) l_cache_before_eval(L, lss[i]->lc);
    double t0 = l_now();
    kv_status st = kv_decode_batch(ss, ids, (size_t)n, out, &e);
    double dt = l_now() - t0;
    for (lua_Integer i = 0; i < n; i++) l_cache_after_eval(L, lss[i]->lc);
    if (st != KV_OK) return l_fail(L, e.msg);
    for (lua_Integer i = 1; i <= n; i++) {
        float *dst = l_logits_push(L, n_vocab, 1);
        memcpy(dst, out + (size_t)(i - 1) * n_vocab, (size_t)n_vocab * sizeof(float));
        lua_pushvalue(L, -1); /* the session remembers its last logits */
        lua_setiuservalue(L, base + 2 * (int)i - 1, 2);
        lua_rawseti(L, out_t, i);
        lss[i - 1]->gen++;
        l_session_count(lss[i - 1], 1, dt, 1);
    }
    lua_pushvalue(L, buf_i); /* back to the model for the next call */
    lua_setiuservalue(L, model_i, L_MODEL_BATCH_OUT);
    lua_pushvalue(L, out_t);
    return 1;
}

/* kvlua.prefill_batch({s1, s2, ...}, {ids1, ids2, ...}, {logits = "last"}) --> {r1, r2, ...} | nil, err:
 * s_i:prefill(ids_i, opts) for distinct sessions of one model, the rows of
 * several sessions going through each forward pass together; r_i is what
 * that prefill returns (a Logits, or true for logits = "none"), the same
 * bits. Every session is kept on the stack and marked busy for the call. */
static int l_prefill_batch(lua_State *L) {
    luaL_checktype(L, 1, LUA_TTABLE);
    luaL_checktype(L, 2, LUA_TTABLE);
    if (!lua_isnoneornil(L, 3)) luaL_checktype(L, 3, LUA_TTABLE);
    const char *lg = l_opt_str(L, 3, "logits", "last");
    int mode;
    if (!strcmp(lg, "last"))
        mode = KV_LOGITS_LAST;
    else if (!strcmp(lg, "all"))
        mode = KV_LOGITS_ALL;
    else if (!strcmp(lg, "none"))
        mode = KV_LOGITS_NONE;
    else
        return luaL_error(L, "option 'logits' must be \"last\", \"all\" or \"none\"");
    lua_settop(L, 2);
    lua_Integer n = luaL_len(L, 1);
    if (n < 1 || n > L_MAX_BATCH) luaL_argerror(L, 1, "between 1 and 4096 sessions");
    if (luaL_len(L, 2) != n) luaL_argerror(L, 2, "one array of token ids per session");
    luaL_checkstack(L, (int)(2 * n + 16), "prefill_batch");
    kv_session **ss = lua_newuserdatauv(L, (size_t)n * sizeof *ss, 0);
    l_session **lss = lua_newuserdatauv(L, (size_t)n * sizeof *lss, 0);
    const int32_t **ids = lua_newuserdatauv(L, (size_t)n * sizeof *ids, 0);
    size_t *n_ids = lua_newuserdatauv(L, (size_t)n * sizeof *n_ids, 0);
    float **outs = lua_newuserdatauv(L, (size_t)n * sizeof *outs, 0);
    lua_createtable(L, (int)n, 0); /* the ids buffers, kept alive */
    const int ids_t = lua_gettop(L);
    lua_createtable(L, (int)n, 0); /* the results */
    const int out_t = lua_gettop(L);
    const int base = lua_gettop(L); /* sessions at base + 2i - 1, their guards above each */
    l_batch_sessions(L, n, "prefill_batch", lss, ss);
    const int n_vocab = kv_model_info_get(lss[0]->lm->m)->n_vocab;
    size_t total = 0;
    for (lua_Integer i = 1; i <= n; i++) {
        lua_geti(L, 2, i);
        if (lua_type(L, -1) != LUA_TTABLE)
            luaL_error(L, "prefill_batch: entry %I of the ids is not an array", (LUAI_UACINT)i);
        size_t len = l_ids_len(L, -1);
        if (len == 0) luaL_error(L, "prefill_batch: empty token list for session %I", (LUAI_UACINT)i);
        ids[i - 1] = l_check_ids(L, lua_gettop(L), len, n_vocab);
        lua_rawseti(L, ids_t, i);
        lua_pop(L, 1);
        n_ids[i - 1] = len;
        total += len;
    }
    l_model_not_in_policy(L, lss[0]->lm, "prefill_batch");
    for (lua_Integer i = 0; i < n; i++) { /* before any Logits is made */
        int r = l_session_room(L, lss[i], n_ids[i]);
        if (r) {
            lua_pushfstring(L, "session %I: %s", (LUAI_UACINT)(i + 1), lua_tostring(L, -1));
            lua_remove(L, -2);
            return r;
        }
    }
    kv_error e = {{0}};
    if (kv_model_check_file(lss[0]->lm->m, &e) != KV_OK) return l_fail(L, e.msg);
    for (lua_Integer i = 1; i <= n; i++) { /* the forward passes write into these */
        if (mode == KV_LOGITS_NONE) {
            outs[i - 1] = NULL;
            lua_pushboolean(L, 1);
        } else {
            outs[i - 1] = l_logits_push(L, n_vocab, mode == KV_LOGITS_ALL ? (int)n_ids[i - 1] : 1);
        }
        lua_rawseti(L, out_t, i);
    }
    for (lua_Integer i = 0; i < n; i++) l_cache_before_eval(L, lss[i]->lc);
    double t0 = l_now();
    kv_status st = kv_prefill_batch(ss, ids, n_ids, (size_t)n, mode, outs, &e);
    double dt = l_now() - t0;
    for (lua_Integer i = 0; i < n; i++) l_cache_after_eval(L, lss[i]->lc); /* raises what a policy raised */
    if (st != KV_OK) return l_fail(L, e.msg);
    for (lua_Integer i = 1; i <= n; i++) {
        const int si = base + 2 * (int)i - 1;
        if (mode == KV_LOGITS_NONE) {
            lua_pushliteral(L, "no logits: the last eval computed none (prefill with logits = \"none\")");
        } else if (mode == KV_LOGITS_ALL && n_ids[i - 1] > 1) { /* the session remembers its last logits */
            float *last = l_logits_push(L, n_vocab, 1);
            memcpy(last, outs[i - 1] + (n_ids[i - 1] - 1) * (size_t)n_vocab, (size_t)n_vocab * sizeof(float));
        } else {
            lua_rawgeti(L, out_t, i);
        }
        lua_setiuservalue(L, si, 2);
        lss[i - 1]->gen++;
        /* the call's time shared by tokens, so sums over sessions add up */
        l_session_count(lss[i - 1], n_ids[i - 1], dt * (double)n_ids[i - 1] / (double)total, 0);
    }
    lua_pushvalue(L, out_t);
    return 1;
}

/* kvlua.clock() --> seconds of a monotonic clock (the one stats() times with) */
static int l_clock(lua_State *L) {
    lua_pushnumber(L, l_now());
    return 1;
}

static const luaL_Reg l_funcs[] = {
    {"load", l_load},
    {"cache", l_cache_new},
    {"decode_batch", l_decode_batch},
    {"prefill_batch", l_prefill_batch},
    {"clock", l_clock},
    {"restore", l_restore},
    {"devices", l_devices},
    {"logits", l_logits_new},
    {"utf8_complete", l_utf8_complete},
    {NULL, NULL},
};

void l_new_class(lua_State *L, const char *name, const luaL_Reg *methods, lua_CFunction index,
                 lua_CFunction close, lua_CFunction gc, lua_CFunction tostring) {
    luaL_newmetatable(L, name);
    lua_newtable(L);
    luaL_setfuncs(L, methods, 0);
    lua_setfield(L, -2, "__methods");
    lua_pushcfunction(L, index), lua_setfield(L, -2, "__index");
    lua_pushcfunction(L, gc), lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, close), lua_setfield(L, -2, "__close");
    lua_pushcfunction(L, tostring), lua_setfield(L, -2, "__tostring");
    lua_pushstring(L, name), lua_setfield(L, -2, "__name");
    lua_pop(L, 1);
}

/* Installs s:generate: luamod/kvlua/generate.lua returns a function that,
 * given the vocabulary helpers of a session (l_session_vocab), returns the
 * method. A missing module leaves the method out. */
static void l_install_generate(lua_State *L) {
    lua_getglobal(L, "require");
    lua_pushliteral(L, "kvlua.generate");
    if (lua_pcall(L, 1, 1, 0) != LUA_OK || !lua_isfunction(L, -1)) {
        lua_pop(L, 1);
        return;
    }
    luaL_newlib(L, l_session_vocab);
    lua_call(L, 1, 1);
    luaL_getmetatable(L, L_SESSION);
    lua_getfield(L, -1, "__methods");
    lua_pushvalue(L, -3);
    lua_setfield(L, -2, "generate");
    lua_pop(L, 3);
}

/* the module's one exported symbol (the build hides the rest) */
__attribute__((visibility("default"))) int luaopen_kvlua(lua_State *L) {
    luaL_newmetatable(L, L_GUARD);
    lua_pushcfunction(L, l_guard_close), lua_setfield(L, -2, "__close");
    lua_pop(L, 1);
    l_new_class(L, L_MODEL, l_model_methods, l_model_index, l_model_close, l_model_gc, l_model_tostring);
    l_new_class(L, L_SESSION, l_session_methods, l_session_index, l_session_close, l_session_gc,
                l_session_tostring);
    luaL_getmetatable(L, L_SESSION);
    lua_pushcfunction(L, l_session_newindex);
    lua_setfield(L, -2, "__newindex");
    lua_pop(L, 1);
    l_logits_open(L);
    l_cache_open(L);
    luaL_newlib(L, l_funcs);
    {
        void l_grammar_open(lua_State *L); /* l_grammar.c: kvlua.grammar and its classes */
        l_grammar_open(L);
    }
    lua_pushstring(L, KVLUA_VERSION);
    lua_setfield(L, -2, "version");
    /* register the module before loading the Lua-side parts, which require it */
    lua_getfield(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
    lua_pushvalue(L, -2);
    lua_setfield(L, -2, "kvlua");
    lua_pop(L, 1);
    l_install_generate(L);
    return 1;
}
