/* l_logits.h — the Logits userdata ("kvlua.Logits").
 *
 * A Logits is one block of rows x n floats (row-major) owned by Lua: the
 * scores a forward pass produced for one position (rows == 1) or for every
 * position of a prefill with logits="all". It is never copied into a Lua
 * table unless asked (l:totable()); the sampling chain (kvlua.sampling)
 * works on it through C methods so nothing per token walks the vocabulary
 * in Lua. Token ids are 0-based GGUF ids on both sides of the API.
 */
#ifndef L_LOGITS_H
#define L_LOGITS_H

#include <lua.h>

#define L_LOGITS_MT "kvlua.Logits"

/* Registers the "kvlua.Logits" metatable (call once from luaopen_kvlua). */
void l_logits_open(lua_State *L);

/* Pushes a new Logits of rows x n floats and returns its storage to fill
   (row-major). Raises on OOM (lua_newuserdatauv) and on n < 1, rows < 1 or
   a size that overflows. The storage starts zeroed. */
float *l_logits_push(lua_State *L, int n, int rows);

/* Checks that index idx is a Logits; returns its data / sizes (raises
   otherwise). n and rows may be NULL. */
float *l_logits_check(lua_State *L, int idx, int *n, int *rows);

/* The same for writing in place (a C sampler stage masking tokens): the
   cached log-sum-exp of the rows is dropped. */
float *l_logits_write(lua_State *L, int idx, int *n, int *rows);

/* Lua: kvlua.logits({1.0, 2.0, ...}) -> Logits (one row) from a plain array
   of numbers; kvlua.logits({{...}, {...}}) -> a multi-row Logits (rows of
   equal length). For tests and for users who score outside the engine.
   Register it as kvlua.logits in luaopen_kvlua. */
int l_logits_new(lua_State *L);

#endif /* L_LOGITS_H */
