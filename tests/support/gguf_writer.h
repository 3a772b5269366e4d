/*
 * gguf_writer.h — a small GGUF writer for tests: valid files of every
 * metadata value type and any tensor type, and deliberately malformed ones.
 *
 *   gw *w = gw_new(3);                        // GGUF version (2, 3, or a bad one)
 *   gw_kv_str(w, "general.architecture", "llama");
 *   gw_kv_u32(w, "llama.block_count", 2);
 *   int64_t ne[2] = {64, 8};
 *   gw_tensor(w, "tok_embd.weight", 2, ne, KV_TYPE_F32, data);  // data NULL: zeros
 *   uint8_t *buf; size_t len;
 *   gw_finish(w, &buf, &len);                 // buf: malloc'd file image
 *   gw_free(w);
 *
 * Layout: header, kvs, tensor infos, padding to the layout alignment (32, or
 * gw_set_alignment), tensor data at their offsets, and nothing after the
 * last tensor's bytes (so cutting any byte off a file makes it invalid).
 * A file without tensors ends right after its last kv.
 *
 * Malformations: gw_set_counts overrides the header counts, gw_kv_raw
 * writes a key with any type id and a verbatim value body (build it with a
 * gw_buf), gw_raw writes verbatim bytes as one kv or tensor info, and
 * gw_tensor_ex takes raw dims, any type id and an explicit offset.
 * Allocation failure is sticky: gw_finish then returns -1.
 */
#ifndef KV_TEST_GGUF_WRITER_H
#define KV_TEST_GGUF_WRITER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ==== byte buffers ======================================================= */

typedef struct {
    uint8_t *p;
    size_t n, cap;
    bool oom;
} gw_buf;

void gw_buf_bytes(gw_buf *b, const void *p, size_t n);
void gw_buf_u8(gw_buf *b, uint8_t v);
void gw_buf_u16(gw_buf *b, uint16_t v);
void gw_buf_u32(gw_buf *b, uint32_t v);
void gw_buf_u64(gw_buf *b, uint64_t v);
void gw_buf_f32(gw_buf *b, float v);
void gw_buf_f64(gw_buf *b, double v);
void gw_buf_str(gw_buf *b, const char *s);           /* u64 length + bytes */
void gw_buf_strn(gw_buf *b, const char *s, size_t n);
void gw_buf_free(gw_buf *b);

/* ==== files ============================================================== */

typedef struct gw gw;

#define GW_AUTO UINT64_MAX /* gw_tensor_ex: place after the previous tensor */

gw *gw_new(uint32_t version);
void gw_free(gw *w); /* NULL is fine */

/* Layout alignment for the data section and automatic offsets (default 32).
 * It does not write general.alignment: do that with gw_kv_u32 (or any
 * malformed variant). */
void gw_set_alignment(gw *w, uint64_t alignment);
/* Header counts to write instead of the real ones. */
void gw_set_counts(gw *w, uint64_t n_tensors, uint64_t n_kv);

/* ---- metadata ---- */
void gw_kv_u8(gw *w, const char *key, uint8_t v);
void gw_kv_i8(gw *w, const char *key, int8_t v);
void gw_kv_u16(gw *w, const char *key, uint16_t v);
void gw_kv_i16(gw *w, const char *key, int16_t v);
void gw_kv_u32(gw *w, const char *key, uint32_t v);
void gw_kv_i32(gw *w, const char *key, int32_t v);
void gw_kv_f32(gw *w, const char *key, float v);
void gw_kv_bool(gw *w, const char *key, bool v);
void gw_kv_str(gw *w, const char *key, const char *v);
void gw_kv_u64(gw *w, const char *key, uint64_t v);
void gw_kv_i64(gw *w, const char *key, int64_t v);
void gw_kv_f64(gw *w, const char *key, double v);
/* An array of n scalars of type elem (a kv_gguf_vtype id), packed
 * little-endian in elems. */
void gw_kv_arr(gw *w, const char *key, uint32_t elem, const void *elems, uint64_t n);
void gw_kv_arr_str(gw *w, const char *key, const char *const *strs, uint64_t n);
/* Key, then the u32 type id vtype, then body verbatim. */
void gw_kv_raw(gw *w, const char *key, uint32_t vtype, const void *body, size_t n);
/* Verbatim bytes counted as one kv (malformed keys). */
void gw_raw_kv(gw *w, const void *bytes, size_t n);

/* ---- tensors ---- */
/* A tensor of ggml type `type`; data holds its bytes (row size x rows), or
 * NULL for zeros. Placed at the next aligned offset. */
void gw_tensor(gw *w, const char *name, int n_dims, const int64_t *ne, uint32_t type, const void *data);
/* Raw variant: any n_dims and dims, any type id, offset GW_AUTO or explicit,
 * and nbytes bytes of data (NULL: zeros) placed at the offset. */
void gw_tensor_ex(gw *w, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                  uint64_t offset, const void *data, size_t nbytes);

/* The file image (malloc'd; the caller frees it). 0 on success, -1 on
 * allocation failure. */
int gw_finish(gw *w, uint8_t **out, size_t *len);
/* Writes buf to path; 0 on success. */
int gw_write_file(const char *path, const void *buf, size_t len);

/* Bytes of a tensor of that type and shape per the engine's type table
 * (0 if the type is unknown or ne[0] is not a multiple of the block). */
size_t gw_tensor_nbytes(int n_dims, const int64_t *ne, uint32_t type);

#endif
