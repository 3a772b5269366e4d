/*
 * kvcl_buffer.c — device memory: buffers split into parts of whole units
 * when larger than the device's largest allocation, copies to and from the
 * host across parts, and the context's scratch buffer.
 */
#include <stdlib.h>
#include <string.h>

#include "kvcl_internal.h"

kv_status kvcl_buf_create(kvcl_ctx *c, size_t bytes, size_t unit, kvcl_buf **out, kv_error *e) {
    *out = NULL;
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    if (unit == 0 || bytes % unit != 0)
        return kv_fail(e, KV_ERR_ARG, "OpenCL buffer of %zu bytes: not whole units of %zu", bytes, unit);
    if (unit > c->max_alloc)
        return kv_fail(e, KV_ERR_NOMEM, "OpenCL buffer: a unit of %zu bytes exceeds the largest allocation (%llu)",
                       unit, (unsigned long long)c->max_alloc);
    if (bytes == 0) bytes = unit;
    if (bytes > c->info.memory - c->in_use) /* drivers that allocate lazily would fail later, or never */
        return kv_fail(e, KV_ERR_NOMEM, "OpenCL: %zu bytes more exceed the %llu bytes of %s (%llu in use)", bytes,
                       (unsigned long long)c->info.memory, c->info.name, (unsigned long long)c->in_use);
    size_t part = (size_t)(c->max_alloc / unit) * unit;
    if (part > bytes) part = bytes;
    size_t n_parts = (bytes + part - 1) / part;
    kvcl_buf *b = calloc(1, sizeof *b);
    cl_mem *parts = calloc(n_parts, sizeof *parts);
    if (!b || !parts) {
        free(b);
        free(parts);
        return kv_fail(e, KV_ERR_NOMEM, "out of memory");
    }
    *b = (kvcl_buf){c, bytes, part, (int)n_parts, parts};
    c->in_use += bytes;
    for (size_t i = 0; i < n_parts; i++) {
        size_t n = i + 1 < n_parts ? part : bytes - part * i;
        cl_int err;
        parts[i] = clCreateBuffer(c->ctx, CL_MEM_READ_WRITE, n, NULL, &err);
        if (err != CL_SUCCESS) {
            kvcl_buf_free(b);
            return kv_fail(e, kvcl_status_of(err), "OpenCL buffer of %zu bytes on %s: %s", n, c->info.name,
                           kvcl_errstr(err));
        }
    }
    *out = b;
    return KV_OK;
}

void kvcl_buf_free(kvcl_buf *b) {
    if (!b) return;
    for (int i = 0; i < b->n_parts; i++)
        if (b->parts[i]) clReleaseMemObject(b->parts[i]);
    b->c->in_use -= b->bytes;
    free(b->parts);
    free(b);
}

size_t kvcl_buf_bytes(const kvcl_buf *b) { return b->bytes; }

int kvcl_buf_parts(const kvcl_buf *b) { return b->n_parts; }

kv_status kvcl_buf_single(const kvcl_buf *b, const char *what, cl_mem *out, kv_error *e) {
    if (b->n_parts != 1)
        return kv_fail(e, KV_ERR_ARG, "OpenCL %s: a buffer of %zu bytes in %d parts where one is needed", what,
                       b->bytes, b->n_parts);
    *out = b->parts[0];
    return KV_OK;
}

kv_status kvcl_view_mem(kvcl_view v, size_t n, const char *what, cl_mem *out, kv_error *e) {
    if (!v.buf) return kv_fail(e, KV_ERR_ARG, "OpenCL %s: no buffer", what);
    if (kvcl_buf_single(v.buf, what, out, e) != KV_OK) return KV_ERR_ARG;
    size_t cap = v.buf->bytes / sizeof(float);
    if (v.off > cap || n > cap - v.off)
        return kv_fail(e, KV_ERR_ARG, "OpenCL %s: %zu floats at %zu do not fit a buffer of %zu", what, n, v.off, cap);
    return KV_OK;
}

/* Copies [off, off + n) part by part; read or write. An error here is the
 * caller's memory or the device's: allocation failures (a buffer is often
 * allocated at its first use) return KV_ERR_NOMEM and leave the context
 * usable; other errors mark it failed. */
static kv_status copy(kvcl_ctx *c, kvcl_buf *b, size_t off, void *host, size_t n, bool write, kv_error *e) {
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    if (write) c->xq.rec = NULL; /* records of what it overwrites would be stale */
    if (off > b->bytes || n > b->bytes - off)
        return kv_fail(e, KV_ERR_ARG, "OpenCL %s of %zu bytes at %zu: the buffer holds %zu", write ? "write" : "read",
                       n, off, b->bytes);
    while (n > 0) {
        size_t i = off / b->part_bytes, in = off - i * b->part_bytes;
        size_t len = b->part_bytes - in < n ? b->part_bytes - in : n;
        cl_int err = write ? clEnqueueWriteBuffer(c->q, b->parts[i], CL_TRUE, in, len, host, 0, NULL, NULL)
                           : clEnqueueReadBuffer(c->q, b->parts[i], CL_TRUE, in, len, host, 0, NULL, NULL);
        if (err != CL_SUCCESS) {
            if (kvcl_status_of(err) == KV_ERR_NOMEM)
                return kv_fail(e, KV_ERR_NOMEM, "OpenCL %s of %zu bytes on %s: %s", write ? "write" : "read", len,
                               c->info.name, kvcl_errstr(err));
            return kvcl_mark_failed(c, e, err, write ? "write" : "read");
        }
        off += len;
        n -= len;
        host = (char *)host + len;
    }
    return KV_OK;
}

kv_status kvcl_write(kvcl_ctx *c, kvcl_buf *b, size_t off, const void *src, size_t n, kv_error *e) {
    return copy(c, b, off, (void *)src, n, true, e);
}

kv_status kvcl_read(kvcl_ctx *c, kvcl_buf *b, size_t off, void *dst, size_t n, kv_error *e) {
    return copy(c, b, off, dst, n, false, e);
}

kv_status kvcl_copy(kvcl_ctx *c, kvcl_buf *dst, size_t doff, kvcl_buf *src, size_t soff, size_t n, kv_error *e) {
    cl_mem dm = NULL, sm = NULL;
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    if (kvcl_buf_single(dst, "copy", &dm, e) || kvcl_buf_single(src, "copy", &sm, e)) return KV_ERR_ARG;
    if (doff > dst->bytes || n > dst->bytes - doff || soff > src->bytes || n > src->bytes - soff)
        return kv_fail(e, KV_ERR_ARG, "OpenCL copy of %zu bytes from %zu to %zu: past a buffer", n, soff, doff);
    if (n == 0) return KV_OK;
    c->xq.rec = NULL;
    cl_int err = clEnqueueCopyBuffer(c->q, sm, dm, soff, doff, n, 0, NULL, NULL);
    return err == CL_SUCCESS ? KV_OK : kvcl_mark_failed(c, e, err, "copy");
}

kv_status kvcl_scratch(kvcl_ctx *c, size_t bytes, cl_mem *out, kv_error *e) {
    if (bytes <= c->scratch_bytes) {
        *out = c->scratch;
        return KV_OK;
    }
    if (bytes > c->max_alloc || bytes > c->info.memory - (c->in_use - c->scratch_bytes))
        return kv_fail(e, KV_ERR_NOMEM, "OpenCL scratch of %zu bytes: more than %s holds", bytes, c->info.name);
    if (c->scratch) clReleaseMemObject(c->scratch); /* freed once queued commands are done with it */
    c->in_use -= c->scratch_bytes;
    c->scratch = NULL;
    c->scratch_bytes = 0;
    cl_int err;
    c->scratch = clCreateBuffer(c->ctx, CL_MEM_READ_WRITE, bytes, NULL, &err);
    if (err != CL_SUCCESS) {
        c->scratch = NULL;
        return kv_fail(e, kvcl_status_of(err), "OpenCL scratch of %zu bytes: %s", bytes, kvcl_errstr(err));
    }
    c->scratch_bytes = bytes;
    c->in_use += bytes;
    *out = c->scratch;
    return KV_OK;
}
