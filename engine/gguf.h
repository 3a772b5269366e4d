/*
 * gguf.h — the GGUF container: a hardened reader (v2 and v3).
 *
 * A GGUF file is: header (magic "GGUF", version, n_tensors, n_kv),
 * n_kv metadata pairs (key string, value type, value), n_tensors tensor
 * infos (name, n_dims, ne[n_dims], ggml type, offset), padding to
 * general.alignment (default 32), then the tensor data section.
 *
 * The reader never trusts a count or a length: each is compared with the
 * bytes left before anything is allocated, and size sums are overflow
 * checked. Strings and scalar arrays are not copied: they point into the
 * file's bytes (the mmap, or the caller's buffer for kv_gguf_parse), which
 * live as long as the kv_gguf. Strings are NOT NUL-terminated.
 */
#ifndef KV_GGUF_H
#define KV_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_error.h"

typedef enum {
    KV_GGUF_U8 = 0,
    KV_GGUF_I8 = 1,
    KV_GGUF_U16 = 2,
    KV_GGUF_I16 = 3,
    KV_GGUF_U32 = 4,
    KV_GGUF_I32 = 5,
    KV_GGUF_F32 = 6,
    KV_GGUF_BOOL = 7,
    KV_GGUF_STRING = 8,
    KV_GGUF_ARRAY = 9,
    KV_GGUF_U64 = 10,
    KV_GGUF_I64 = 11,
    KV_GGUF_F64 = 12,
    KV_GGUF_NTYPES
} kv_gguf_vtype;

typedef struct {
    const char *ptr; /* into the file; not NUL-terminated */
    uint64_t len;
} kv_gguf_str;

typedef struct kv_gguf_value {
    kv_gguf_vtype type;
    union {
        uint64_t u;     /* U8, U16, U32, U64 */
        int64_t i;      /* I8, I16, I32, I64 */
        double f;       /* F32, F64 */
        bool b;         /* BOOL */
        kv_gguf_str s;  /* STRING */
        struct {
            kv_gguf_vtype type; /* element type */
            uint64_t n;         /* element count */
            const uint8_t *raw; /* scalar elements, packed little-endian, in the file */
            kv_gguf_str *strs;  /* type == STRING: n strings */
            struct kv_gguf_value *items; /* type == ARRAY: n nested arrays */
        } arr;
    } v;
} kv_gguf_value;

typedef struct {
    kv_gguf_str key;
    kv_gguf_value val;
} kv_gguf_kv;

#define KV_GGUF_MAX_DIMS 4

typedef struct {
    kv_gguf_str name;
    int n_dims;
    int64_t ne[KV_GGUF_MAX_DIMS]; /* ne[0] is the fastest-varying (row length); unused dims are 1 */
    int type;                     /* ggml type id (see quant.h, kv_type_traits_get) */
    uint64_t offset;              /* relative to the data section */
    uint64_t nbytes;
    const void *data;             /* base + data_offset + offset */
} kv_gguf_tensor;

typedef struct kv_gguf kv_gguf;
struct kv_gguf {
    uint32_t version;
    uint64_t n_kv;
    kv_gguf_kv *kv;
    uint64_t n_tensors;
    kv_gguf_tensor *tensors;
    uint64_t alignment;
    uint64_t data_offset; /* start of the tensor data section in the file */
    const uint8_t *base;  /* the whole file */
    size_t size;
    void *impl;           /* owned allocations, mapping, lookup tables */
};

/* Opens and memory-maps a regular file (anything else, a FIFO or a
 * directory, is KV_ERR_IO at once, without blocking). On failure *out is
 * NULL and e says what and where (byte offset, key or tensor name). */
kv_status kv_gguf_open(const char *path, kv_gguf **out, kv_error *e);

/* Parses a GGUF image in memory; buf must outlive the result (no copy). */
kv_status kv_gguf_parse(const void *buf, size_t len, kv_gguf **out, kv_error *e);

void kv_gguf_close(kv_gguf *g); /* NULL is fine */

/* For an opened file (kv_gguf_open keeps its descriptor): KV_ERR_IO when
 * the file on disk is now shorter than the mapping, whose pages past the
 * new end would fault on access. KV_OK for a parsed buffer. */
kv_status kv_gguf_check_file(const kv_gguf *g, kv_error *e);

/* Lookups (hashed; NULL when absent). */
const kv_gguf_value *kv_gguf_get(const kv_gguf *g, const char *key);
const kv_gguf_tensor *kv_gguf_tensor_find(const kv_gguf *g, const char *name);

const char *kv_gguf_vtype_name(kv_gguf_vtype t);

/* Typed getters. Absent key: KV_OK and *out untouched when !required, a
 * KV_ERR_FORMAT "missing key" otherwise. Present with the wrong type (e.g.
 * a string where a number is expected, or a negative number for an
 * unsigned): KV_ERR_FORMAT naming the key, the expected and actual types.
 * Integer getters accept any integer type whose value fits. */
kv_status kv_gguf_get_u32(const kv_gguf *g, const char *key, uint32_t *out, bool required, kv_error *e);
kv_status kv_gguf_get_i64(const kv_gguf *g, const char *key, int64_t *out, bool required, kv_error *e);
kv_status kv_gguf_get_f32(const kv_gguf *g, const char *key, float *out, bool required, kv_error *e);
kv_status kv_gguf_get_bool(const kv_gguf *g, const char *key, bool *out, bool required, kv_error *e);
kv_status kv_gguf_get_str(const kv_gguf *g, const char *key, kv_gguf_str *out, bool required, kv_error *e);
/* An array whose element type is elem (KV_GGUF_NTYPES: any). */
kv_status kv_gguf_get_arr(const kv_gguf *g, const char *key, kv_gguf_vtype elem,
                          const kv_gguf_value **out, bool required, kv_error *e);

/* Element i of a scalar array as a number (any numeric or bool type). */
double kv_gguf_arr_num(const kv_gguf_value *arr, uint64_t i);
int64_t kv_gguf_arr_int(const kv_gguf_value *arr, uint64_t i);

/* True when s equals the NUL-terminated c string. */
bool kv_gguf_str_eq(kv_gguf_str s, const char *c);

#endif
