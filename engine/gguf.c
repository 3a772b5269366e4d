/*
 * gguf.c — the hardened GGUF reader (see gguf.h).
 *
 * This file owns the parse of a GGUF image (v2 and v3, little-endian) into
 * a kv_gguf: the header, the metadata pairs, the tensor infos, the layout of
 * the data section, and the hashed lookups over keys and tensor names.
 *
 * Trust nothing. Every count and every length read from the file is checked
 * against the bytes that are left BEFORE anything is allocated, and every
 * size sum and product is overflow checked, so a hostile file can make the
 * reader allocate at most a small multiple of its own size:
 *
 *   in memory                      bytes        least bytes in the file
 *   kv_gguf_kv (one kv pair)       ~64          14 (key len, 1-byte key, type, u8)
 *   kv_gguf_str (array of strings) 16           8  (string length)
 *   kv_gguf_value (nested array)   ~48          12 (element type, count)
 *   kv_gguf_tensor                 ~88          33 (name len, 1-byte name, n_dims, ne[0], type, offset)
 *   hash slots                     <= 16 / entry
 *
 * Strings and scalar arrays are not copied; they point into the image.
 * Errors name what is wrong and where: the byte offset, the key or tensor
 * name, and the numbers involved.
 */
#include "gguf.h"
#include "types.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_ALIGNMENT (1u << 20)   /* 1 MiB: beyond that a file is hostile, not exotic */
#define GGUF_MAX_NESTING 8              /* arrays of arrays of ... */
#define GGUF_MAX_STRING (1ull << 40)    /* no string is a terabyte long */
#define GGUF_MIN_KV 14u                 /* u64 key len + 1-byte key + u32 type + 1-byte value */
#define GGUF_MIN_TENSOR 33u             /* u64 name len + 1 + u32 n_dims + u64 ne0 + u32 type + u64 offset */
#define GGUF_HEADER 24u                 /* magic, u32 version, u64 n_tensors, u64 n_kv */

/* ==== owned memory ====================================================== */

/* Every allocation of one kv_gguf hangs off a singly linked list so that
 * close (and a failed parse) frees them in one walk. */
typedef struct blk {
    struct blk *next;
    max_align_t data[];
} blk;

typedef struct {
    blk *blocks;
    size_t allocated;   /* bytes handed out, for the budget check */
    size_t budget;      /* a small multiple of the image size */
    void *map;          /* mmap base, or NULL for kv_gguf_parse */
    size_t map_len;
    int fd;             /* the mapped file, kept open for kv_gguf_check_file; -1: none */
    uint32_t *kv_hash;  /* (kv_cap) index + 1 into g->kv, 0 = empty */
    uint64_t kv_cap;
    uint32_t *t_hash;   /* (t_cap) index + 1 into g->tensors, 0 = empty */
    uint64_t t_cap;
} gguf_impl;

static void *impl_alloc(gguf_impl *im, uint64_t n, uint64_t size) {
    if (n == 0) n = 1;
    if (size != 0 && n > (SIZE_MAX - sizeof(blk)) / size) return NULL;
    size_t bytes = (size_t)(n * size);
    if (bytes > im->budget || im->allocated > im->budget - bytes) return NULL;
    blk *b = calloc(1, sizeof(blk) + bytes);
    if (!b) return NULL;
    b->next = im->blocks;
    im->blocks = b;
    im->allocated += bytes;
    return b->data;
}

static void impl_free(gguf_impl *im) {
    blk *b = im->blocks;
    while (b) {
        blk *next = b->next;
        free(b);
        b = next;
    }
    if (im->map) munmap(im->map, im->map_len);
    if (im->fd >= 0) close(im->fd);
    free(im);
}

/* ==== hashing ============================================================ */

static uint64_t hash_bytes(const void *p, size_t n) {
    const uint8_t *s = p;
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 1099511628211ull;
    }
    h ^= h >> 29; /* spread the high bits into the low ones we mask with */
    return h;
}

static uint64_t hash_cap_for(uint64_t n) {
    uint64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    return cap;
}

/* ==== the reader ========================================================= */

typedef struct {
    const uint8_t *base;
    size_t size;
    size_t pos;
    kv_error *e;
    gguf_impl *im;
    char where[160]; /* "key 'general.name'" or "tensor 'tok_embd.weight'" */
} reader;

/* A printable, bounded copy of a name from the file, for messages. */
static void printable(char *out, size_t cap, const char *p, uint64_t len) {
    size_t n = 0, lim = cap > 8 ? cap - 4 : 0;
    for (uint64_t i = 0; i < len && n < lim; i++) {
        unsigned char c = (unsigned char)p[i];
        out[n++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    if (len > n && n == lim) {
        memcpy(out + n, "...", 3);
        n += 3;
    }
    if (cap) out[n < cap ? n : cap - 1] = '\0';
}

static void set_where(reader *r, const char *what, kv_gguf_str name) {
    char buf[100];
    printable(buf, sizeof buf, name.ptr, name.len);
    snprintf(r->where, sizeof r->where, "%s '%s'", what, buf);
}

static kv_status fail_at(reader *r, size_t at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static kv_status fail_at(reader *r, size_t at, const char *fmt, ...) {
    char msg[KV_ERROR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (r->where[0])
        return kv_fail(r->e, KV_ERR_FORMAT, "gguf: %s: %s (at byte %zu)", r->where, msg, at);
    return kv_fail(r->e, KV_ERR_FORMAT, "gguf: %s (at byte %zu)", msg, at);
}

static kv_status nomem(reader *r) {
    return kv_fail(r->e, KV_ERR_NOMEM, "gguf: out of memory%s%s", r->where[0] ? " reading " : "", r->where);
}

static size_t left(const reader *r) { return r->size - r->pos; }

static kv_status need(reader *r, uint64_t n, const char *what) {
    if (n > left(r))
        return fail_at(r, r->pos, "truncated: %s needs %llu bytes, %zu left", what,
                       (unsigned long long)n, left(r));
    return KV_OK;
}

static kv_status rd(reader *r, void *out, size_t n, const char *what) {
    kv_status s = need(r, n, what);
    if (s) return s;
    memcpy(out, r->base + r->pos, n); /* the host is little-endian, like the format */
    r->pos += n;
    return KV_OK;
}

static kv_status rd_u32(reader *r, uint32_t *v, const char *what) { return rd(r, v, 4, what); }
static kv_status rd_u64(reader *r, uint64_t *v, const char *what) { return rd(r, v, 8, what); }

static kv_status rd_str(reader *r, kv_gguf_str *s, const char *what) {
    size_t at = r->pos;
    uint64_t len;
    kv_status st = rd_u64(r, &len, what);
    if (st) return st;
    if (len >= GGUF_MAX_STRING)
        return fail_at(r, at, "%s length %llu is absurd (>= 2^40)", what, (unsigned long long)len);
    if (len > left(r))
        return fail_at(r, at, "%s length %llu runs past the end (%zu bytes left)", what,
                       (unsigned long long)len, left(r));
    s->ptr = (const char *)r->base + r->pos;
    s->len = len;
    r->pos += (size_t)len;
    return KV_OK;
}

/* ==== metadata values ==================================================== */

static const char *const k_vtype_names[KV_GGUF_NTYPES] = {
    "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64",
};

const char *kv_gguf_vtype_name(kv_gguf_vtype t) {
    if ((unsigned)t >= KV_GGUF_NTYPES) return "unknown";
    return k_vtype_names[t];
}

/* Bytes of one scalar element; 0 for STRING, ARRAY and unknown types. */
static size_t scalar_size(kv_gguf_vtype t) {
    switch (t) {
    case KV_GGUF_U8: case KV_GGUF_I8: case KV_GGUF_BOOL: return 1;
    case KV_GGUF_U16: case KV_GGUF_I16: return 2;
    case KV_GGUF_U32: case KV_GGUF_I32: case KV_GGUF_F32: return 4;
    case KV_GGUF_U64: case KV_GGUF_I64: case KV_GGUF_F64: return 8;
    default: return 0;
    }
}

/* Decodes one scalar at p into v (v->type already set). */
static void decode_scalar(kv_gguf_value *v, const uint8_t *p) {
    uint8_t u8; uint16_t u16; uint32_t u32; uint64_t u64;
    float f32; double f64;
    switch (v->type) {
    case KV_GGUF_U8: v->v.u = p[0]; break;
    case KV_GGUF_I8: v->v.i = (int8_t)p[0]; break;
    case KV_GGUF_BOOL: u8 = p[0]; v->v.b = u8 != 0; break;
    case KV_GGUF_U16: memcpy(&u16, p, 2); v->v.u = u16; break;
    case KV_GGUF_I16: memcpy(&u16, p, 2); v->v.i = (int16_t)u16; break;
    case KV_GGUF_U32: memcpy(&u32, p, 4); v->v.u = u32; break;
    case KV_GGUF_I32: memcpy(&u32, p, 4); v->v.i = (int32_t)u32; break;
    case KV_GGUF_F32: memcpy(&f32, p, 4); v->v.f = f32; break;
    case KV_GGUF_U64: memcpy(&u64, p, 8); v->v.u = u64; break;
    case KV_GGUF_I64: memcpy(&u64, p, 8); v->v.i = (int64_t)u64; break;
    case KV_GGUF_F64: memcpy(&f64, p, 8); v->v.f = f64; break;
    default: break;
    }
}

static kv_status rd_vtype(reader *r, kv_gguf_vtype *t, const char *what) {
    size_t at = r->pos;
    uint32_t raw;
    kv_status s = rd_u32(r, &raw, what);
    if (s) return s;
    if (raw >= KV_GGUF_NTYPES) return fail_at(r, at, "unknown %s %u", what, raw);
    *t = (kv_gguf_vtype)raw;
    return KV_OK;
}

/* The body of an array: element type, count, elements. depth counts the
 * arrays we are already inside. */
static kv_status rd_array(reader *r, kv_gguf_value *v, int depth) {
    size_t at = r->pos;
    if (depth >= GGUF_MAX_NESTING)
        return fail_at(r, at, "arrays nested deeper than %d", GGUF_MAX_NESTING);
    kv_gguf_vtype et = KV_GGUF_U8;
    uint64_t n;
    kv_status s = rd_vtype(r, &et, "array element type");
    if (s) return s;
    size_t at_n = r->pos;
    if ((s = rd_u64(r, &n, "array count"))) return s;
    v->type = KV_GGUF_ARRAY;
    v->v.arr.type = et;
    v->v.arr.n = n;
    v->v.arr.raw = NULL;
    v->v.arr.strs = NULL;
    v->v.arr.items = NULL;

    size_t es = scalar_size(et);
    if (es) {
        if (n > left(r) / es)
            return fail_at(r, at_n, "array of %llu %s needs %llu bytes, %zu left", (unsigned long long)n,
                           kv_gguf_vtype_name(et),
                           n > UINT64_MAX / es ? UINT64_MAX : (unsigned long long)(n * es), left(r));
        v->v.arr.raw = r->base + r->pos;
        r->pos += (size_t)(n * es);
        return KV_OK;
    }
    if (et == KV_GGUF_STRING) {
        if (n > left(r) / 8)
            return fail_at(r, at_n, "array of %llu strings needs at least %llu bytes, %zu left",
                           (unsigned long long)n,
                           n > UINT64_MAX / 8 ? UINT64_MAX : (unsigned long long)(n * 8), left(r));
        kv_gguf_str *strs = impl_alloc(r->im, n, sizeof *strs);
        if (!strs) return nomem(r);
        v->v.arr.strs = strs;
        for (uint64_t i = 0; i < n; i++) {
            char what[48];
            snprintf(what, sizeof what, "string %llu of the array", (unsigned long long)i);
            if ((s = rd_str(r, &strs[i], what))) return s;
        }
        return KV_OK;
    }
    /* et == ARRAY: each element is (element type, count, elements). */
    if (n > left(r) / 12)
        return fail_at(r, at_n, "array of %llu arrays needs at least %llu bytes, %zu left",
                       (unsigned long long)n,
                       n > UINT64_MAX / 12 ? UINT64_MAX : (unsigned long long)(n * 12), left(r));
    kv_gguf_value *items = impl_alloc(r->im, n, sizeof *items);
    if (!items) return nomem(r);
    v->v.arr.items = items;
    for (uint64_t i = 0; i < n; i++)
        if ((s = rd_array(r, &items[i], depth + 1))) return s;
    return KV_OK;
}

static kv_status rd_value(reader *r, kv_gguf_value *v) {
    kv_status s = rd_vtype(r, &v->type, "value type");
    if (s) return s;
    size_t es = scalar_size(v->type);
    if (es) {
        if ((s = need(r, es, kv_gguf_vtype_name(v->type)))) return s;
        decode_scalar(v, r->base + r->pos);
        r->pos += es;
        return KV_OK;
    }
    if (v->type == KV_GGUF_STRING) return rd_str(r, &v->v.s, "string");
    return rd_array(r, v, 0);
}

/* ==== lookups ============================================================= */

/* Inserts index idx (name s) into table; returns the index already there
 * under an equal name, or -1. */
static int64_t hash_insert(uint32_t *table, uint64_t cap, kv_gguf_str s, uint32_t idx,
                           kv_gguf_str (*name_of)(const kv_gguf *, uint32_t), const kv_gguf *g) {
    uint64_t mask = cap - 1, h = hash_bytes(s.ptr, (size_t)s.len) & mask;
    for (;;) {
        uint32_t slot = table[h];
        if (slot == 0) {
            table[h] = idx + 1;
            return -1;
        }
        kv_gguf_str o = name_of(g, slot - 1);
        if (o.len == s.len && memcmp(o.ptr, s.ptr, (size_t)s.len) == 0) return (int64_t)(slot - 1);
        h = (h + 1) & mask;
    }
}

static int64_t hash_find(const uint32_t *table, uint64_t cap, const char *name,
                         kv_gguf_str (*name_of)(const kv_gguf *, uint32_t), const kv_gguf *g) {
    if (!table || !name) return -1;
    size_t len = strlen(name);
    uint64_t mask = cap - 1, h = hash_bytes(name, len) & mask;
    for (;;) {
        uint32_t slot = table[h];
        if (slot == 0) return -1;
        kv_gguf_str o = name_of(g, slot - 1);
        if (o.len == len && memcmp(o.ptr, name, len) == 0) return (int64_t)(slot - 1);
        h = (h + 1) & mask;
    }
}

static kv_gguf_str kv_name(const kv_gguf *g, uint32_t i) { return g->kv[i].key; }
static kv_gguf_str tensor_name(const kv_gguf *g, uint32_t i) { return g->tensors[i].name; }

const kv_gguf_value *kv_gguf_get(const kv_gguf *g, const char *key) {
    if (!g) return NULL;
    const gguf_impl *im = g->impl;
    int64_t i = hash_find(im->kv_hash, im->kv_cap, key, kv_name, g);
    return i < 0 ? NULL : &g->kv[i].val;
}

const kv_gguf_tensor *kv_gguf_tensor_find(const kv_gguf *g, const char *name) {
    if (!g) return NULL;
    const gguf_impl *im = g->impl;
    int64_t i = hash_find(im->t_hash, im->t_cap, name, tensor_name, g);
    return i < 0 ? NULL : &g->tensors[i];
}

/* ==== tensor infos ======================================================== */

static kv_status rd_tensor(reader *r, kv_gguf_tensor *t, uint64_t index) {
    size_t at = r->pos;
    kv_status s;
    r->where[0] = '\0';
    char what[48];
    snprintf(what, sizeof what, "name of tensor %llu", (unsigned long long)index);
    if ((s = rd_str(r, &t->name, what))) return s;
    if (t->name.len == 0) return fail_at(r, at, "tensor %llu has an empty name", (unsigned long long)index);
    set_where(r, "tensor", t->name);

    size_t at_dims = r->pos;
    uint32_t n_dims;
    if ((s = rd_u32(r, &n_dims, "n_dims"))) return s;
    if (n_dims < 1 || n_dims > KV_GGUF_MAX_DIMS)
        return fail_at(r, at_dims, "n_dims %u not in 1..%d", n_dims, KV_GGUF_MAX_DIMS);
    t->n_dims = (int)n_dims;
    for (int d = 0; d < KV_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        size_t at_d = r->pos;
        uint64_t raw;
        if ((s = rd_u64(r, &raw, "dimension"))) return s;
        int64_t ne = (int64_t)raw;
        if (raw > (uint64_t)INT64_MAX || ne < 1)
            return fail_at(r, at_d, "dimension %u is %lld (must be >= 1)", d, (long long)ne);
        t->ne[d] = ne;
    }
    int64_t nel = 1;
    for (int d = 0; d < KV_GGUF_MAX_DIMS; d++) {
        if (t->ne[d] > INT64_MAX / nel)
            return fail_at(r, at_dims, "element count overflows (%lld x %lld x %lld x %lld)",
                           (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                           (long long)t->ne[3]);
        nel *= t->ne[d];
    }

    size_t at_type = r->pos;
    uint32_t type;
    if ((s = rd_u32(r, &type, "type"))) return s;
    const kv_type_traits *tr = type < KV_TYPE_COUNT ? kv_type_traits_get((int)type) : NULL;
    if (!tr) return fail_at(r, at_type, "unknown ggml type %u", type);
    t->type = (int)type;
    if (t->ne[0] % tr->blck != 0)
        return fail_at(r, at_dims, "row length %lld is not a multiple of the %s block size %d",
                       (long long)t->ne[0], tr->name, tr->blck);
    /* nbytes = (ne0 / blck) * type_size * ne1 * ne2 * ne3, each step checked */
    uint64_t nb = (uint64_t)(t->ne[0] / tr->blck);
    if (nb > UINT64_MAX / tr->type_size) goto too_big;
    nb *= tr->type_size;
    for (int d = 1; d < KV_GGUF_MAX_DIMS; d++) {
        if (nb > UINT64_MAX / (uint64_t)t->ne[d]) goto too_big;
        nb *= (uint64_t)t->ne[d];
    }
    t->nbytes = nb;

    if ((s = rd_u64(r, &t->offset, "offset"))) return s;
    return KV_OK;
too_big:
    return fail_at(r, at_dims, "byte size overflows (%lld x %lld x %lld x %lld of %s)", (long long)t->ne[0],
                   (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3], tr->name);
}

static int cmp_by_offset(const void *a, const void *b) {
    const kv_gguf_tensor *x = *(const kv_gguf_tensor *const *)a, *y = *(const kv_gguf_tensor *const *)b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return 0;
}

/* ==== the parse ============================================================ */

static kv_status parse(kv_gguf *g, kv_error *e) {
    gguf_impl *im = g->impl;
    reader rr = {.base = g->base, .size = g->size, .pos = 0, .e = e, .im = im};
    reader *r = &rr;
    kv_status s;

    /* ---- header ---- */
    if (g->size < 4 || memcmp(g->base, GGUF_MAGIC, 4) != 0) {
        if (g->size < 4) return fail_at(r, 0, "truncated: %zu bytes is too short for a GGUF header", g->size);
        char m[16];
        printable(m, sizeof m, (const char *)g->base, 4);
        return fail_at(r, 0, "bad magic '%s' (expected 'GGUF'); not a GGUF file", m);
    }
    r->pos = 4;
    if ((s = rd_u32(r, &g->version, "version"))) return s;
    if (g->version != 2 && g->version != 3) {
        uint32_t sw = __builtin_bswap32(g->version);
        if (sw == 2 || sw == 3)
            return kv_fail(e, KV_ERR_UNSUPPORTED, "gguf: big-endian GGUF (version %u) is not supported", sw);
        return kv_fail(e, KV_ERR_UNSUPPORTED, "gguf: unsupported version %u (supported: 2, 3)", g->version);
    }
    if ((s = rd_u64(r, &g->n_tensors, "n_tensors"))) return s;
    if ((s = rd_u64(r, &g->n_kv, "n_kv"))) return s;
    /* Each kv and each tensor info has a least size: both counts must fit in
     * what is left before we allocate for them. */
    uint64_t room = left(r);
    if (g->n_kv > room / GGUF_MIN_KV)
        return fail_at(r, 16, "n_kv %llu cannot fit in the %llu bytes left (>= %u bytes each)",
                       (unsigned long long)g->n_kv, (unsigned long long)room, GGUF_MIN_KV);
    if (g->n_tensors > room / GGUF_MIN_TENSOR)
        return fail_at(r, 8, "n_tensors %llu cannot fit in the %llu bytes left (>= %u bytes each)",
                       (unsigned long long)g->n_tensors, (unsigned long long)room, GGUF_MIN_TENSOR);
    if (g->n_kv >= UINT32_MAX || g->n_tensors >= UINT32_MAX)
        return fail_at(r, 8, "n_kv %llu or n_tensors %llu is too large", (unsigned long long)g->n_kv,
                       (unsigned long long)g->n_tensors);
    if (g->n_kv * GGUF_MIN_KV + g->n_tensors * GGUF_MIN_TENSOR > room)
        return fail_at(r, 8, "n_kv %llu and n_tensors %llu cannot fit in the %llu bytes left",
                       (unsigned long long)g->n_kv, (unsigned long long)g->n_tensors,
                       (unsigned long long)room);

    /* ---- metadata ---- */
    g->kv = impl_alloc(im, g->n_kv, sizeof *g->kv);
    im->kv_cap = hash_cap_for(g->n_kv);
    im->kv_hash = impl_alloc(im, im->kv_cap, sizeof *im->kv_hash);
    if (!g->kv || !im->kv_hash) return nomem(r);
    for (uint64_t i = 0; i < g->n_kv; i++) {
        kv_gguf_kv *kv = &g->kv[i];
        size_t at = r->pos;
        r->where[0] = '\0';
        char what[40];
        snprintf(what, sizeof what, "key %llu", (unsigned long long)i);
        if ((s = rd_str(r, &kv->key, what))) return s;
        if (kv->key.len == 0) return fail_at(r, at, "key %llu is empty", (unsigned long long)i);
        set_where(r, "key", kv->key);
        int64_t dup = hash_insert(im->kv_hash, im->kv_cap, kv->key, (uint32_t)i, kv_name, g);
        if (dup >= 0)
            return fail_at(r, at, "duplicate key (kv %lld and kv %llu)", (long long)dup, (unsigned long long)i);
        if ((s = rd_value(r, &kv->val))) return s;
    }
    r->where[0] = '\0';

    /* ---- alignment ---- */
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    const kv_gguf_value *al = kv_gguf_get(g, "general.alignment");
    if (al) {
        if (al->type != KV_GGUF_U32)
            return kv_fail(e, KV_ERR_FORMAT, "gguf: key 'general.alignment' has type %s, expected u32",
                           kv_gguf_vtype_name(al->type));
        uint64_t a = al->v.u;
        if (a == 0 || (a & (a - 1)) != 0 || a > GGUF_MAX_ALIGNMENT)
            return kv_fail(e, KV_ERR_FORMAT,
                           "gguf: key 'general.alignment' is %llu (must be a power of two in 1..%u)",
                           (unsigned long long)a, GGUF_MAX_ALIGNMENT);
        g->alignment = a;
    }

    /* ---- tensor infos ---- */
    g->tensors = impl_alloc(im, g->n_tensors, sizeof *g->tensors);
    im->t_cap = hash_cap_for(g->n_tensors);
    im->t_hash = impl_alloc(im, im->t_cap, sizeof *im->t_hash);
    if (!g->tensors || !im->t_hash) return nomem(r);
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        kv_gguf_tensor *t = &g->tensors[i];
        size_t at = r->pos;
        if ((s = rd_tensor(r, t, i))) return s;
        int64_t dup = hash_insert(im->t_hash, im->t_cap, t->name, (uint32_t)i, tensor_name, g);
        if (dup >= 0)
            return fail_at(r, at, "duplicate tensor name (tensors %lld and %llu)", (long long)dup,
                           (unsigned long long)i);
        if (t->offset % g->alignment != 0)
            return fail_at(r, at, "offset %llu not aligned to %llu", (unsigned long long)t->offset,
                           (unsigned long long)g->alignment);
    }
    r->where[0] = '\0';

    /* ---- data section ---- */
    uint64_t end = r->pos;
    uint64_t pad = (g->alignment - end % g->alignment) % g->alignment;
    g->data_offset = end + pad; /* end < 2^63 and pad < 2^20: no overflow */
    if (g->n_tensors == 0) return KV_OK; /* vocabulary-only: the file may stop right here */
    if (g->data_offset > g->size)
        return fail_at(r, (size_t)end, "truncated: the tensor data section starts at %llu, past the end (%zu)",
                       (unsigned long long)g->data_offset, g->size);
    uint64_t data_len = g->size - g->data_offset;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        kv_gguf_tensor *t = &g->tensors[i];
        if (t->offset > data_len || t->nbytes > data_len - t->offset) {
            set_where(r, "tensor", t->name);
            return kv_fail(e, KV_ERR_FORMAT,
                           "gguf: %s: data [%llu, +%llu) runs past the end of the file (data section is %llu bytes)",
                           r->where, (unsigned long long)t->offset, (unsigned long long)t->nbytes,
                           (unsigned long long)data_len);
        }
        t->data = g->base + g->data_offset + t->offset;
    }
    /* Overlap: sort by offset, then each tensor must end before the next starts. */
    const kv_gguf_tensor **by_off = impl_alloc(im, g->n_tensors, sizeof *by_off);
    if (!by_off) return nomem(r);
    for (uint64_t i = 0; i < g->n_tensors; i++) by_off[i] = &g->tensors[i];
    qsort(by_off, (size_t)g->n_tensors, sizeof *by_off, cmp_by_offset);
    for (uint64_t i = 1; i < g->n_tensors; i++) {
        const kv_gguf_tensor *a = by_off[i - 1], *b = by_off[i];
        if (a->offset + a->nbytes > b->offset) {
            char na[100], nb[100];
            printable(na, sizeof na, a->name.ptr, a->name.len);
            printable(nb, sizeof nb, b->name.ptr, b->name.len);
            return kv_fail(e, KV_ERR_FORMAT,
                           "gguf: tensor '%s' [%llu, +%llu) overlaps tensor '%s' at offset %llu", na,
                           (unsigned long long)a->offset, (unsigned long long)a->nbytes, nb,
                           (unsigned long long)b->offset);
        }
    }
    return KV_OK;
}

/* ==== open / parse / close ================================================ */

/* Takes ownership of map and fd (-1: none), also on failure. */
static kv_status start(const void *buf, size_t len, void *map, int fd, kv_gguf **out, kv_error *e) {
    kv_gguf *g = calloc(1, sizeof *g);
    gguf_impl *im = calloc(1, sizeof *im);
    if (!g || !im) {
        free(g);
        free(im);
        if (map) munmap(map, len);
        if (fd >= 0) close(fd);
        return kv_fail(e, KV_ERR_NOMEM, "gguf: out of memory");
    }
    im->map = map;
    im->map_len = len;
    im->fd = fd;
    /* 16x the image plus some slack: the table at the top bounds the real need well below */
    im->budget = len > (SIZE_MAX - (1u << 20)) / 16 ? SIZE_MAX : len * 16 + (1u << 20);
    g->impl = im;
    g->base = buf;
    g->size = len;
    kv_status s = parse(g, e);
    if (s != KV_OK) {
        kv_gguf_close(g);
        return s;
    }
    *out = g;
    return KV_OK;
}

kv_status kv_gguf_parse(const void *buf, size_t len, kv_gguf **out, kv_error *e) {
    if (!out) return kv_fail(e, KV_ERR_ARG, "gguf: out is NULL");
    *out = NULL;
    if (!buf && len) return kv_fail(e, KV_ERR_ARG, "gguf: buffer is NULL");
    static const uint8_t empty[1];
    return start(buf ? buf : empty, len, NULL, -1, out, e);
}

kv_status kv_gguf_open(const char *path, kv_gguf **out, kv_error *e) {
    if (!out) return kv_fail(e, KV_ERR_ARG, "gguf: out is NULL");
    *out = NULL;
    if (!path) return kv_fail(e, KV_ERR_ARG, "gguf: path is NULL");
    /* O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused
     * below like every other file that is not a regular one */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return kv_fail(e, KV_ERR_IO, "gguf: cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int err = errno;
        close(fd);
        return kv_fail(e, KV_ERR_IO, "gguf: cannot stat '%s': %s", path, strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return kv_fail(e, KV_ERR_IO, "gguf: '%s' is not a regular file", path);
    }
    if (st.st_size <= 0) {
        close(fd);
        return kv_fail(e, KV_ERR_FORMAT, "gguf: '%s' is empty; not a GGUF file", path);
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        close(fd);
        return kv_fail(e, KV_ERR_IO, "gguf: '%s' is too large to map", path);
    }
    size_t len = (size_t)st.st_size;
    void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        int err = errno;
        close(fd);
        return kv_fail(e, KV_ERR_IO, "gguf: cannot map '%s': %s", path, strerror(err));
    }
    kv_status s = start(map, len, map, fd, out, e);
    if (s != KV_OK && e) {
        /* prefix the path: "gguf: file.gguf: ..." reads better from Lua */
        char msg[2 * KV_ERROR_MAX + 16];
        const char *m = e->msg;
        if (strncmp(m, "gguf: ", 6) == 0) m += 6;
        snprintf(msg, sizeof msg, "gguf: %.*s: %s", KV_ERROR_MAX, path, m);
        size_t n = strlen(msg);
        if (n >= KV_ERROR_MAX) n = KV_ERROR_MAX - 1;
        memcpy(e->msg, msg, n);
        e->msg[n] = '\0';
    }
    return s;
}

void kv_gguf_close(kv_gguf *g) {
    if (!g) return;
    if (g->impl) impl_free(g->impl);
    free(g);
}

kv_status kv_gguf_check_file(const kv_gguf *g, kv_error *e) {
    const gguf_impl *im = g ? g->impl : NULL;
    if (!im || im->fd < 0) return KV_OK;
    struct stat st;
    if (fstat(im->fd, &st) != 0) return kv_fail(e, KV_ERR_IO, "gguf: cannot stat the model file: %s", strerror(errno));
    if ((uint64_t)st.st_size < (uint64_t)im->map_len)
        return kv_fail(e, KV_ERR_IO,
                       "model file changed on disk: %llu bytes at load, %llu now (truncated); load it again",
                       (unsigned long long)im->map_len, (unsigned long long)st.st_size);
    return KV_OK;
}

/* ==== typed getters ======================================================== */

static bool is_int(kv_gguf_vtype t) {
    switch (t) {
    case KV_GGUF_U8: case KV_GGUF_I8: case KV_GGUF_U16: case KV_GGUF_I16:
    case KV_GGUF_U32: case KV_GGUF_I32: case KV_GGUF_U64: case KV_GGUF_I64: return true;
    default: return false;
    }
}

static bool is_unsigned(kv_gguf_vtype t) {
    return t == KV_GGUF_U8 || t == KV_GGUF_U16 || t == KV_GGUF_U32 || t == KV_GGUF_U64;
}

/* Looks key up; *v NULL when absent and not required. */
static kv_status lookup(const kv_gguf *g, const char *key, bool required, const kv_gguf_value **v,
                        kv_error *e) {
    *v = kv_gguf_get(g, key);
    if (!*v && required) return kv_fail(e, KV_ERR_FORMAT, "gguf: missing key '%s'", key);
    return KV_OK;
}

static kv_status wrong_type(const char *key, const kv_gguf_value *v, const char *expected, kv_error *e) {
    if (v->type == KV_GGUF_ARRAY)
        return kv_fail(e, KV_ERR_FORMAT, "gguf: key '%s' has type array of %s, expected %s", key,
                       kv_gguf_vtype_name(v->v.arr.type), expected);
    return kv_fail(e, KV_ERR_FORMAT, "gguf: key '%s' has type %s, expected %s", key,
                   kv_gguf_vtype_name(v->type), expected);
}

kv_status kv_gguf_get_u32(const kv_gguf *g, const char *key, uint32_t *out, bool required, kv_error *e) {
    const kv_gguf_value *v;
    kv_status s = lookup(g, key, required, &v, e);
    if (s || !v) return s;
    if (!is_int(v->type)) return wrong_type(key, v, "an integer (u32)", e);
    if (is_unsigned(v->type) ? v->v.u > UINT32_MAX : (v->v.i < 0 || v->v.i > (int64_t)UINT32_MAX)) {
        if (is_unsigned(v->type))
            return kv_fail(e, KV_ERR_FORMAT, "gguf: key '%s' is %llu, out of range for u32", key,
                           (unsigned long long)v->v.u);
        return kv_fail(e, KV_ERR_FORMAT, "gguf: key '%s' is %lld, out of range for u32", key,
                       (long long)v->v.i);
    }
    *out = is_unsigned(v->type) ? (uint32_t)v->v.u : (uint32_t)v->v.i;
    return KV_OK;
}

kv_status kv_gguf_get_i64(const kv_gguf *g, const char *key, int64_t *out, bool required, kv_error *e) {
    const kv_gguf_value *v;
    kv_status s = lookup(g, key, required, &v, e);
    if (s || !v) return s;
    if (!is_int(v->type)) return wrong_type(key, v, "an integer (i64)", e);
    if (is_unsigned(v->type)) {
        if (v->v.u > (uint64_t)INT64_MAX)
            return kv_fail(e, KV_ERR_FORMAT, "gguf: key '%s' is %llu, out of range for i64", key,
                           (unsigned long long)v->v.u);
        *out = (int64_t)v->v.u;
    } else {
        *out = v->v.i;
    }
    return KV_OK;
}

kv_status kv_gguf_get_f32(const kv_gguf *g, const char *key, float *out, bool required, kv_error *e) {
    const kv_gguf_value *v;
    kv_status s = lookup(g, key, required, &v, e);
    if (s || !v) return s;
    if (v->type != KV_GGUF_F32 && v->type != KV_GGUF_F64) return wrong_type(key, v, "a float (f32 or f64)", e);
    *out = (float)v->v.f;
    return KV_OK;
}

kv_status kv_gguf_get_bool(const kv_gguf *g, const char *key, bool *out, bool required, kv_error *e) {
    const kv_gguf_value *v;
    kv_status s = lookup(g, key, required, &v, e);
    if (s || !v) return s;
    if (v->type != KV_GGUF_BOOL) return wrong_type(key, v, "bool", e);
    *out = v->v.b;
    return KV_OK;
}

kv_status kv_gguf_get_str(const kv_gguf *g, const char *key, kv_gguf_str *out, bool required, kv_error *e) {
    const kv_gguf_value *v;
    kv_status s = lookup(g, key, required, &v, e);
    if (s || !v) return s;
    if (v->type != KV_GGUF_STRING) return wrong_type(key, v, "string", e);
    *out = v->v.s;
    return KV_OK;
}

kv_status kv_gguf_get_arr(const kv_gguf *g, const char *key, kv_gguf_vtype elem, const kv_gguf_value **out,
                          bool required, kv_error *e) {
    const kv_gguf_value *v;
    kv_status s = lookup(g, key, required, &v, e);
    if (s || !v) return s;
    if (v->type != KV_GGUF_ARRAY || (elem != KV_GGUF_NTYPES && v->v.arr.type != elem)) {
        char expected[40];
        if (elem == KV_GGUF_NTYPES) snprintf(expected, sizeof expected, "an array");
        else snprintf(expected, sizeof expected, "array of %s", kv_gguf_vtype_name(elem));
        return wrong_type(key, v, expected, e);
    }
    *out = v;
    return KV_OK;
}

/* ==== array elements ======================================================= */

int64_t kv_gguf_arr_int(const kv_gguf_value *arr, uint64_t i) {
    if (!arr || arr->type != KV_GGUF_ARRAY || i >= arr->v.arr.n || !arr->v.arr.raw) return 0;
    kv_gguf_value v = {.type = arr->v.arr.type};
    size_t es = scalar_size(v.type);
    if (!es) return 0;
    decode_scalar(&v, arr->v.arr.raw + i * es);
    switch (v.type) {
    case KV_GGUF_U8: case KV_GGUF_U16: case KV_GGUF_U32: case KV_GGUF_U64:
        return v.v.u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)v.v.u;
    case KV_GGUF_I8: case KV_GGUF_I16: case KV_GGUF_I32: case KV_GGUF_I64: return v.v.i;
    case KV_GGUF_BOOL: return v.v.b;
    case KV_GGUF_F32: case KV_GGUF_F64:
        if (!(v.v.f == v.v.f)) return 0;
        if (v.v.f >= 9.2233720368547758e18) return INT64_MAX;
        if (v.v.f <= -9.2233720368547758e18) return INT64_MIN;
        return (int64_t)v.v.f;
    default: return 0;
    }
}

double kv_gguf_arr_num(const kv_gguf_value *arr, uint64_t i) {
    if (!arr || arr->type != KV_GGUF_ARRAY || i >= arr->v.arr.n || !arr->v.arr.raw) return 0;
    kv_gguf_value v = {.type = arr->v.arr.type};
    size_t es = scalar_size(v.type);
    if (!es) return 0;
    decode_scalar(&v, arr->v.arr.raw + i * es);
    switch (v.type) {
    case KV_GGUF_U8: case KV_GGUF_U16: case KV_GGUF_U32: case KV_GGUF_U64: return (double)v.v.u;
    case KV_GGUF_I8: case KV_GGUF_I16: case KV_GGUF_I32: case KV_GGUF_I64: return (double)v.v.i;
    case KV_GGUF_BOOL: return v.v.b ? 1.0 : 0.0;
    case KV_GGUF_F32: case KV_GGUF_F64: return v.v.f;
    default: return 0;
    }
}

bool kv_gguf_str_eq(kv_gguf_str s, const char *c) {
    if (!c) return false;
    size_t n = strlen(c);
    return s.len == n && (n == 0 || memcmp(s.ptr, c, n) == 0);
}
