/* kv_error.c — status names and the one formatter every engine file uses. */
#include "kv_error.h"

#include <stdio.h>

const char *kv_status_to_string(kv_status s) {
    switch (s) {
    case KV_OK: return "ok";
    case KV_ERR_IO: return "io";
    case KV_ERR_FORMAT: return "format";
    case KV_ERR_UNSUPPORTED: return "unsupported";
    case KV_ERR_NOMEM: return "out of memory";
    case KV_ERR_ARG: return "bad argument";
    case KV_ERR_CONTEXT_FULL: return "context full";
    case KV_ERR_NUMERIC: return "numeric";
    case KV_ERR_CACHE_FULL: return "cache full";
    case KV_ERR_DEVICE: return "device";
    }
    return "unknown";
}

kv_status kv_fail(kv_error *e, kv_status s, const char *fmt, ...) {
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof e->msg, fmt, ap);
        va_end(ap);
    }
    return s;
}
