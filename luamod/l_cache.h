/* l_cache.h — the Cache userdata ("kvlua.Cache"): a KV page pool that
 * sessions share (kvlua.cache(model, opts)), its stats, lookup, pins and
 * the Lua eviction policy. See l_cache.c for the contract. */
#ifndef L_CACHE_H
#define L_CACHE_H

#include <lua.h>

#include "kvlua.h"
#include "l_obj.h"

#define L_CACHE "kvlua.Cache"

typedef struct {
    l_obj o;           /* closed / busy (a method in progress defers the close) */
    kv_cache *c;       /* the owner's reference; NULL once released */
    kv_cache *eng;     /* the engine cache (alive while sessions use it, even closed) */
    void *owner;       /* the model's binding object (released when the cache is collected) */
    int policy_ref;    /* registry reference of the policy function, or LUA_NOREF */
    lua_State *L;      /* the thread of the evaluation in progress (the policy runs on it) */
    int in_policy;     /* the policy is running: evaluations on this cache raise */
    int policy_failed; /* the last policy call raised or returned nonsense */
    char policy_err[512];
} l_cache;

/* Registers the metatable; call once from luaopen_kvlua. */
void l_cache_open(lua_State *L);
/* kvlua.cache(model, opts) */
int l_cache_new(lua_State *L);
/* The Cache at idx (raises if it is not one, or is closed). */
l_cache *l_cache_check(lua_State *L, int idx);

/* Around an evaluation of a session drawing from lc (NULL: private pool):
 * before raises if the policy is running; after raises the policy's error
 * if it failed, else returns. */
void l_cache_before_eval(lua_State *L, l_cache *lc);
void l_cache_after_eval(lua_State *L, l_cache *lc);

/* Reads option field of the options table at opts as K/V types per layer
 * into out (n_layer entries): absent (f16 everywhere; returns 0), a name
 * ("f16", "f32", "q8_0", "q4_0"), or a table { default = name, [i] = name }
 * / { name, [i] = name } with 0-based layer indices i (returns 1). Raises
 * on anything else. */
int l_kv_types(lua_State *L, int opts, const char *field, int n_layer, int *out);

/* Token id arrays, checked as every method checks them (kvlua.c): the
 * length of the array at idx, and its n ids in a userdata left on the
 * stack (raises on a non-integer or an id outside [0, n_vocab)). */
size_t l_ids_len(lua_State *L, int idx);
int32_t *l_check_ids(lua_State *L, int idx, size_t n, int32_t n_vocab);

/* Provided by kvlua.c: the engine model of the Model at idx (raises if
 * closed): l_model_peek only looks; l_model_hold counts it as used until
 * l_model_unhold. */
kv_model *l_model_peek(lua_State *L, int idx);
kv_model *l_model_hold(lua_State *L, int idx, void **owner);
void l_model_unhold(void *owner);
/* Counts the eviction policies running for evaluations of the model
 * (owner from l_model_hold); while one runs, l_model_not_in_policy raises
 * "what: not allowed while an eviction policy of this model is running". */
void l_model_policy(void *owner, int delta);
void l_model_not_in_policy(lua_State *L, void *owner, const char *what);

#endif
