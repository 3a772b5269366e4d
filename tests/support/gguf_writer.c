/*
 * gguf_writer.c — the test GGUF writer (see gguf_writer.h).
 *
 * Kvs and tensor infos are serialized as they are added; the data section is
 * a byte buffer indexed by tensor offset. gw_finish glues header, kvs,
 * infos, padding and data together.
 */
#include "gguf_writer.h"
#include "types.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ==== byte buffers ======================================================= */

static void buf_reserve(gw_buf *b, size_t extra) {
    if (b->oom) return;
    if (extra > SIZE_MAX - b->n) { b->oom = true; return; }
    if (b->n + extra <= b->cap) return;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->n + extra) {
        if (cap > SIZE_MAX / 2) { b->oom = true; return; }
        cap *= 2;
    }
    uint8_t *p = realloc(b->p, cap);
    if (!p) { b->oom = true; return; }
    b->p = p;
    b->cap = cap;
}

void gw_buf_bytes(gw_buf *b, const void *p, size_t n) {
    buf_reserve(b, n);
    if (b->oom || n == 0) return;
    if (p) memcpy(b->p + b->n, p, n);
    else memset(b->p + b->n, 0, n);
    b->n += n;
}

void gw_buf_u8(gw_buf *b, uint8_t v) { gw_buf_bytes(b, &v, 1); }
void gw_buf_u16(gw_buf *b, uint16_t v) { gw_buf_bytes(b, &v, 2); } /* host is little-endian */
void gw_buf_u32(gw_buf *b, uint32_t v) { gw_buf_bytes(b, &v, 4); }
void gw_buf_u64(gw_buf *b, uint64_t v) { gw_buf_bytes(b, &v, 8); }
void gw_buf_f32(gw_buf *b, float v) { gw_buf_bytes(b, &v, 4); }
void gw_buf_f64(gw_buf *b, double v) { gw_buf_bytes(b, &v, 8); }
void gw_buf_strn(gw_buf *b, const char *s, size_t n) {
    gw_buf_u64(b, n);
    gw_buf_bytes(b, s, n);
}
void gw_buf_str(gw_buf *b, const char *s) { gw_buf_strn(b, s, strlen(s)); }
void gw_buf_free(gw_buf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* ==== files ============================================================== */

struct gw {
    uint32_t version;
    uint64_t alignment;
    bool counts_set;
    uint64_t n_tensors_hdr, n_kv_hdr;
    uint64_t n_kv, n_tensors;
    gw_buf kvs;    /* serialized kv pairs */
    gw_buf infos;  /* serialized tensor infos */
    gw_buf data;   /* the data section, by offset */
    uint64_t next; /* end of the last placed tensor */
    bool oom;
};

gw *gw_new(uint32_t version) {
    gw *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->version = version;
    w->alignment = 32;
    return w;
}

void gw_free(gw *w) {
    if (!w) return;
    gw_buf_free(&w->kvs);
    gw_buf_free(&w->infos);
    gw_buf_free(&w->data);
    free(w);
}

void gw_set_alignment(gw *w, uint64_t alignment) { w->alignment = alignment ? alignment : 1; }

void gw_set_counts(gw *w, uint64_t n_tensors, uint64_t n_kv) {
    w->counts_set = true;
    w->n_tensors_hdr = n_tensors;
    w->n_kv_hdr = n_kv;
}

/* ---- metadata ---- */

static void kv_head(gw *w, const char *key, uint32_t vtype) {
    gw_buf_str(&w->kvs, key);
    gw_buf_u32(&w->kvs, vtype);
    w->n_kv++;
}

/* Value type ids (as in gguf.h; repeated so the writer stands alone). */
enum { T_U8, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STRING, T_ARRAY, T_U64, T_I64, T_F64 };

static size_t elem_size(uint32_t t) {
    switch (t) {
    case T_U8: case T_I8: case T_BOOL: return 1;
    case T_U16: case T_I16: return 2;
    case T_U32: case T_I32: case T_F32: return 4;
    case T_U64: case T_I64: case T_F64: return 8;
    default: return 0;
    }
}

void gw_kv_u8(gw *w, const char *key, uint8_t v) { kv_head(w, key, T_U8); gw_buf_u8(&w->kvs, v); }
void gw_kv_i8(gw *w, const char *key, int8_t v) { kv_head(w, key, T_I8); gw_buf_u8(&w->kvs, (uint8_t)v); }
void gw_kv_u16(gw *w, const char *key, uint16_t v) { kv_head(w, key, T_U16); gw_buf_u16(&w->kvs, v); }
void gw_kv_i16(gw *w, const char *key, int16_t v) { kv_head(w, key, T_I16); gw_buf_u16(&w->kvs, (uint16_t)v); }
void gw_kv_u32(gw *w, const char *key, uint32_t v) { kv_head(w, key, T_U32); gw_buf_u32(&w->kvs, v); }
void gw_kv_i32(gw *w, const char *key, int32_t v) { kv_head(w, key, T_I32); gw_buf_u32(&w->kvs, (uint32_t)v); }
void gw_kv_f32(gw *w, const char *key, float v) { kv_head(w, key, T_F32); gw_buf_f32(&w->kvs, v); }
void gw_kv_bool(gw *w, const char *key, bool v) { kv_head(w, key, T_BOOL); gw_buf_u8(&w->kvs, v ? 1 : 0); }
void gw_kv_str(gw *w, const char *key, const char *v) { kv_head(w, key, T_STRING); gw_buf_str(&w->kvs, v); }
void gw_kv_u64(gw *w, const char *key, uint64_t v) { kv_head(w, key, T_U64); gw_buf_u64(&w->kvs, v); }
void gw_kv_i64(gw *w, const char *key, int64_t v) { kv_head(w, key, T_I64); gw_buf_u64(&w->kvs, (uint64_t)v); }
void gw_kv_f64(gw *w, const char *key, double v) { kv_head(w, key, T_F64); gw_buf_f64(&w->kvs, v); }

void gw_kv_arr(gw *w, const char *key, uint32_t elem, const void *elems, uint64_t n) {
    kv_head(w, key, T_ARRAY);
    gw_buf_u32(&w->kvs, elem);
    gw_buf_u64(&w->kvs, n);
    size_t es = elem_size(elem);
    if (es && n) gw_buf_bytes(&w->kvs, elems, (size_t)n * es);
}

void gw_kv_arr_str(gw *w, const char *key, const char *const *strs, uint64_t n) {
    kv_head(w, key, T_ARRAY);
    gw_buf_u32(&w->kvs, T_STRING);
    gw_buf_u64(&w->kvs, n);
    for (uint64_t i = 0; i < n; i++) gw_buf_str(&w->kvs, strs[i]);
}

void gw_kv_raw(gw *w, const char *key, uint32_t vtype, const void *body, size_t n) {
    kv_head(w, key, vtype);
    gw_buf_bytes(&w->kvs, body, n);
}

void gw_raw_kv(gw *w, const void *bytes, size_t n) {
    gw_buf_bytes(&w->kvs, bytes, n);
    w->n_kv++;
}

/* ---- tensors ---- */

size_t gw_tensor_nbytes(int n_dims, const int64_t *ne, uint32_t type) {
    if (n_dims < 1) return 0;
    size_t nb = kv_row_size((int)type, ne[0]);
    for (int d = 1; d < n_dims; d++) nb *= (size_t)ne[d];
    return nb;
}

void gw_tensor_ex(gw *w, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                  uint64_t offset, const void *data, size_t nbytes) {
    if (offset == GW_AUTO) offset = (w->next + w->alignment - 1) / w->alignment * w->alignment;
    gw_buf_str(&w->infos, name);
    gw_buf_u32(&w->infos, n_dims);
    for (uint32_t d = 0; d < n_dims; d++) gw_buf_u64(&w->infos, ne[d]);
    gw_buf_u32(&w->infos, type);
    gw_buf_u64(&w->infos, offset);
    w->n_tensors++;
    if (nbytes == 0) return;
    if (offset > SIZE_MAX - nbytes) { w->oom = true; return; }
    size_t end = (size_t)offset + nbytes;
    if (end > w->data.n) gw_buf_bytes(&w->data, NULL, end - w->data.n);
    if (w->data.oom) return;
    if (data) memcpy(w->data.p + offset, data, nbytes);
    else memset(w->data.p + offset, 0, nbytes);
    if (end > w->next) w->next = end;
}

void gw_tensor(gw *w, const char *name, int n_dims, const int64_t *ne, uint32_t type, const void *data) {
    uint64_t une[8];
    for (int d = 0; d < n_dims && d < 8; d++) une[d] = (uint64_t)ne[d];
    gw_tensor_ex(w, name, (uint32_t)n_dims, une, type, GW_AUTO, data, gw_tensor_nbytes(n_dims, ne, type));
}

int gw_finish(gw *w, uint8_t **out, size_t *len) {
    *out = NULL;
    *len = 0;
    if (w->oom || w->kvs.oom || w->infos.oom || w->data.oom) return -1;
    gw_buf f = {0};
    gw_buf_bytes(&f, "GGUF", 4);
    gw_buf_u32(&f, w->version);
    gw_buf_u64(&f, w->counts_set ? w->n_tensors_hdr : w->n_tensors);
    gw_buf_u64(&f, w->counts_set ? w->n_kv_hdr : w->n_kv);
    gw_buf_bytes(&f, w->kvs.p, w->kvs.n);
    gw_buf_bytes(&f, w->infos.p, w->infos.n);
    if (w->n_tensors > 0) {
        size_t pad = (size_t)((w->alignment - f.n % w->alignment) % w->alignment);
        gw_buf_bytes(&f, NULL, pad);
        gw_buf_bytes(&f, w->data.p, w->data.n);
    }
    if (f.oom) {
        gw_buf_free(&f);
        return -1;
    }
    *out = f.p;
    *len = f.n;
    return 0;
}

int gw_write_file(const char *path, const void *buf, size_t len) {
    FILE *fp = fopen(path, "wb");
    if (!fp) return -1;
    size_t n = len ? fwrite(buf, 1, len, fp) : 0;
    int rc = fclose(fp);
    return (n == len && rc == 0) ? 0 : -1;
}
