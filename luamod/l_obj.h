/* l_obj.h — what the binding's objects (Model, Session, Cache) share: the
 * closed flag, the busy count of the method calls in progress, and a guard
 * that ends one busy call when the calling C function returns or raises
 * (see "Re-entry" at the top of kvlua.c). */
#ifndef L_OBJ_H
#define L_OBJ_H

#include <lauxlib.h>
#include <lua.h>

typedef struct l_obj l_obj;
struct l_obj {
    int closed;               /* closed by close(), <close> or __gc */
    int busy;                 /* method calls in progress */
    void (*release)(l_obj *); /* frees what is freeable now */
};

#define L_GUARD "kvlua.Guard"
/* A method reads at most this many arguments, self included. */
#define L_MAX_ARGS 3

/* The guard of object o (the userdata at index owner), kept as user value slot. */
void l_guard_new(lua_State *L, l_obj *o, int owner, int slot);
/* Marks o (the object at index 1) busy until the calling C function returns
 * or raises; pads the arguments to L_MAX_ARGS. */
void l_busy(lua_State *L, l_obj *o, int slot);
/* close() / <close>: frees now, or when the last busy call returns. */
void l_obj_close(l_obj *o);
/* __gc: unreachable, so no call is in progress: frees now. */
void l_obj_finalize(l_obj *o);
/* Registers a class: methods (in __methods), __index, __close, __gc, __tostring, __name. */
void l_new_class(lua_State *L, const char *name, const luaL_Reg *methods, lua_CFunction index,
                 lua_CFunction close, lua_CFunction gc, lua_CFunction tostring);

#endif
