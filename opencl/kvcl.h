/*
 * kvcl.h — OpenCL host code, the device layer: devices, one context per
 * model, buffers, and the kernel program.
 *
 *   kvcl_devices()        lists every OpenCL device (platforms in order,
 *                         then their devices); the index chooses one.
 *   kvcl_open()           a context and an in-order queue on one device,
 *                         the kernels of opencl/kernels/ built for it
 *                         (the program binary is cached on disk, keyed by
 *                         device, driver, sources and build options).
 *   kvcl_buf              device memory; one larger than the device's
 *                         largest allocation is split into parts of whole
 *                         units (rows). Ops on it: kvcl_ops.h.
 *
 * Errors: every function returns a kv_status and a message (kv_error.h);
 * nothing exits. Ops are queued, not waited for; an error from a launch or
 * a wait marks the context failed, and every later call returns that first
 * message (closing still works). Buffers count against the device's
 * global memory: asking for more fails up front with KV_ERR_NOMEM (some
 * drivers allocate lazily and would fail later, or overcommit).
 *
 * A context and its buffers are used by one thread at a time (kernel
 * arguments live in the context). Without OpenCL at build time
 * (KV_HAVE_OPENCL undefined) only kvcl_devices exists and reports none.
 */
#ifndef KVCL_H
#define KVCL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_error.h"

typedef struct {
    char platform[128];
    char name[128];
    char type[8];        /* "gpu", "cpu", "accel", "other" */
    uint64_t memory;     /* global memory, bytes */
    uint64_t max_alloc;  /* largest single allocation, bytes */
    int has_fp16;        /* cl_khr_fp16 */
} kvcl_device_info;

/* Fills up to max entries, returns how many devices exist (0 when OpenCL is
 * unavailable or no platform is installed). Never fails otherwise. */
int kvcl_devices(kvcl_device_info *out, int max);

#ifdef KV_HAVE_OPENCL

typedef struct kvcl_ctx kvcl_ctx;
typedef struct kvcl_buf kvcl_buf;

/* Decode GEMV flavour: one row per work-item (CPU drivers vectorize inside
 * an item) or one work-group per row (GPUs). AUTO: by device type. */
enum { KVCL_GEMV_AUTO = 0, KVCL_GEMV_ROW, KVCL_GEMV_GROUP };

typedef struct {
    int device;             /* index in kvcl_devices() order */
    const char *cache_dir;  /* program binaries; NULL: $XDG_CACHE_HOME/kvlua/cl
                               or ~/.cache/kvlua/cl; "": no cache */
    uint64_t max_alloc;     /* 0: the device's; else a smaller cap (splits buffers sooner) */
    bool portable;          /* use no optional extension (fp64), to test the fallbacks */
    bool no_fp64;           /* only no fp64 (the integer kernels stay), to test their float sums */
    bool no_vnni;           /* integer kernels without vpdpbusd even where the CPU has it, to test the other sums */
    int gemv;               /* KVCL_GEMV_* */
    const char *extra_source; /* appended to the program (NULL: none); tests of build errors */
} kvcl_options;

/* A context on device o->device (o NULL: device 0). *out NULL on failure. */
kv_status kvcl_open(const kvcl_options *o, kvcl_ctx **out, kv_error *e);
void kvcl_close(kvcl_ctx *c); /* NULL is fine; free its buffers first */

const kvcl_device_info *kvcl_ctx_device(const kvcl_ctx *c);
/* True when the program came from the binary cache (no build from source). */
bool kvcl_ctx_from_cache(const kvcl_ctx *c);
/* Whether Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K products take the integer kernels
 * (activations quantized to 8 bits per block of 32; matmul_i8.cl): on x86 CPU drivers
 * with AVX2, unless built portable. */
bool kvcl_ctx_int_dot(const kvcl_ctx *c);
/* Whether those kernels sum bytes by vpdpbusd (a PoCL device on a CPU with AVX512-VNNI, not
 * turned off by no_vnni), else by pmaddubsw / pmaddwd: the same integer sums. */
bool kvcl_ctx_vnni(const kvcl_ctx *c);
/* KV_OK, or the error that marked the context failed (copied into e). */
kv_status kvcl_ctx_status(const kvcl_ctx *c, kv_error *e);
/* Waits for everything queued. */
kv_status kvcl_finish(kvcl_ctx *c, kv_error *e);

/* ---- buffers ----------------------------------------------------------------
 * bytes of device memory in parts of whole units (unit bytes each: a weight
 * row; 1 for plain buffers), each part at most the largest allocation.
 * Contents are undefined until written. */
kv_status kvcl_buf_create(kvcl_ctx *c, size_t bytes, size_t unit, kvcl_buf **out, kv_error *e);
void kvcl_buf_free(kvcl_buf *b); /* NULL is fine */
size_t kvcl_buf_bytes(const kvcl_buf *b);
int kvcl_buf_parts(const kvcl_buf *b);
/* Copies n bytes at byte offset off, across parts. Both wait until the
 * copy is done (a read therefore waits for the ops queued before it). */
kv_status kvcl_write(kvcl_ctx *c, kvcl_buf *b, size_t off, const void *src, size_t n, kv_error *e);
kv_status kvcl_read(kvcl_ctx *c, kvcl_buf *b, size_t off, void *dst, size_t n, kv_error *e);
/* Queues a device copy of n bytes from src at soff to dst at doff (single
 * part buffers; ranges inside one buffer must not overlap). Does not wait. */
kv_status kvcl_copy(kvcl_ctx *c, kvcl_buf *dst, size_t doff, kvcl_buf *src, size_t soff, size_t n, kv_error *e);

/* A float array inside a buffer: elements from off on. Ops take views so
 * one activation buffer can hold several tensors (and rows of one). */
typedef struct {
    kvcl_buf *buf;
    size_t off; /* in floats */
} kvcl_view;

static inline kvcl_view kvcl_at(kvcl_buf *b, size_t off) { return (kvcl_view){b, off}; }

#endif /* KV_HAVE_OPENCL */
#endif
