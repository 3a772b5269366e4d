/*
 * fuzz_gguf.c — libFuzzer entry point for the GGUF reader.
 *
 * Parses the input as a GGUF image (kv_gguf_parse, no copy); when it parses,
 * walks every kv and every tensor, reads every byte the reader points at,
 * runs every typed getter on every key, and traps if an invariant the reader
 * promises does not hold (lookups find what was parsed, tensor data lies
 * inside the image, aligned, without overlap in bounds). Run it with
 * tests/run-fuzz.sh SECONDS.
 */
#include "gguf.h"
#include "types.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static volatile uint64_t g_sink;

#define REQUIRE(c) do { if (!(c)) __builtin_trap(); } while (0)

static void touch(const void *p, uint64_t n) {
    const uint8_t *b = p;
    uint64_t h = 0;
    for (uint64_t i = 0; i < n; i++) h = h * 31 + b[i];
    g_sink += h;
}

static void walk_value(const kv_gguf *g, const kv_gguf_value *v) {
    switch (v->type) {
    case KV_GGUF_STRING:
        REQUIRE(v->v.s.len <= g->size && (const uint8_t *)v->v.s.ptr >= g->base &&
                (const uint8_t *)v->v.s.ptr + v->v.s.len <= g->base + g->size);
        touch(v->v.s.ptr, v->v.s.len);
        break;
    case KV_GGUF_ARRAY:
        if (v->v.arr.type == KV_GGUF_STRING) {
            for (uint64_t i = 0; i < v->v.arr.n; i++) {
                kv_gguf_value s = {.type = KV_GGUF_STRING, .v.s = v->v.arr.strs[i]};
                walk_value(g, &s);
            }
        } else if (v->v.arr.type == KV_GGUF_ARRAY) {
            for (uint64_t i = 0; i < v->v.arr.n; i++) {
                REQUIRE(v->v.arr.items[i].type == KV_GGUF_ARRAY);
                walk_value(g, &v->v.arr.items[i]);
            }
        } else {
            for (uint64_t i = 0; i < v->v.arr.n; i++) {
                double x = kv_gguf_arr_num(v, i);
                int64_t k = kv_gguf_arr_int(v, i);
                g_sink += (uint64_t)k + (x == x ? 1u : 0u);
            }
        }
        break;
    default:
        g_sink += v->v.u;
        break;
    }
}

/* A NUL-terminated copy of s, or NULL when s holds a NUL or is too long. */
static const char *cstr(kv_gguf_str s, char *buf, size_t cap) {
    if (s.len >= cap || memchr(s.ptr, 0, (size_t)s.len)) return NULL;
    memcpy(buf, s.ptr, (size_t)s.len);
    buf[s.len] = '\0';
    return buf;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kv_gguf *g = NULL;
    kv_error e;
    if (kv_gguf_parse(data, size, &g, &e) != KV_OK) {
        REQUIRE(g == NULL && memchr(e.msg, 0, sizeof e.msg) && strncmp(e.msg, "gguf: ", 6) == 0);
        return 0;
    }
    REQUIRE(g->version == 2 || g->version == 3);
    REQUIRE(g->alignment >= 1 && (g->alignment & (g->alignment - 1)) == 0);
    char buf[4096];
    for (uint64_t i = 0; i < g->n_kv; i++) {
        const kv_gguf_kv *kv = &g->kv[i];
        touch(kv->key.ptr, kv->key.len);
        walk_value(g, &kv->val);
        const char *k = cstr(kv->key, buf, sizeof buf);
        if (!k) continue;
        REQUIRE(kv_gguf_get(g, k) == &kv->val);
        uint32_t u; int64_t i64; float f; bool b; kv_gguf_str s; const kv_gguf_value *a;
        kv_gguf_get_u32(g, k, &u, true, &e);
        kv_gguf_get_i64(g, k, &i64, true, &e);
        kv_gguf_get_f32(g, k, &f, true, &e);
        kv_gguf_get_bool(g, k, &b, true, &e);
        kv_gguf_get_str(g, k, &s, true, &e);
        kv_gguf_get_arr(g, k, KV_GGUF_NTYPES, &a, true, &e);
        kv_gguf_get_arr(g, k, KV_GGUF_STRING, &a, false, &e);
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        const kv_gguf_tensor *t = &g->tensors[i];
        REQUIRE(t->n_dims >= 1 && t->n_dims <= KV_GGUF_MAX_DIMS);
        const kv_type_traits *tr = kv_type_traits_get(t->type);
        REQUIRE(tr != NULL);
        uint64_t nb = kv_row_size(t->type, t->ne[0]);
        for (int d = 0; d < KV_GGUF_MAX_DIMS; d++) {
            REQUIRE(t->ne[d] >= 1);
            if (d) nb *= (uint64_t)t->ne[d];
        }
        REQUIRE(nb == t->nbytes && t->offset % g->alignment == 0);
        const uint8_t *p = t->data;
        REQUIRE(p >= g->base + g->data_offset && p + t->nbytes <= g->base + g->size);
        g_sink += p[0] + p[t->nbytes - 1];
        touch(t->name.ptr, t->name.len);
        const char *n = cstr(t->name, buf, sizeof buf);
        if (n) REQUIRE(kv_gguf_tensor_find(g, n) == t);
    }
    kv_gguf_close(g);
    return 0;
}
