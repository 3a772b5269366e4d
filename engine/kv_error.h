/*
 * kv_error.h — status codes and error messages shared by every engine file.
 *
 * Every fallible engine function returns a kv_status and, on failure, writes
 * a human-readable message into a caller-owned kv_error. Nothing in the
 * engine prints, exits or aborts on bad input: the host (Lua) decides.
 */
#ifndef KV_ERROR_H
#define KV_ERROR_H

#include <stdarg.h>

typedef enum {
    KV_OK = 0,
    KV_ERR_IO,           /* file missing, unreadable, mmap failed */
    KV_ERR_FORMAT,       /* malformed or inconsistent file contents */
    KV_ERR_UNSUPPORTED,  /* valid but not supported (architecture, type) */
    KV_ERR_NOMEM,        /* allocation failed */
    KV_ERR_ARG,          /* caller misuse: bad argument */
    KV_ERR_CONTEXT_FULL, /* a session has no room for more tokens */
    KV_ERR_NUMERIC,      /* NaN/Inf produced (corrupted weights) */
    KV_ERR_CACHE_FULL,   /* a KV cache has no page to give (all used or pinned) */
    KV_ERR_DEVICE,       /* a compute device failed (kernel build, launch, wait) */
} kv_status;

#define KV_ERROR_MAX 512

typedef struct {
    char msg[KV_ERROR_MAX];
} kv_error;

/* Static name of a status ("ok", "io", "format", ...). */
const char *kv_status_to_string(kv_status s);

/* Formats into e (if non-NULL) and returns s, so callers can write
 * `return kv_fail(e, KV_ERR_FORMAT, "tensor %s: ...", name);` */
kv_status kv_fail(kv_error *e, kv_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
