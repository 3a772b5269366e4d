/*
 * kvcl_internal.h — private to the opencl/ sources: the context and buffer structs,
 * the kernel table, and the launch helpers every op goes through.
 *
 * A launch: L = kvcl_launch_begin(c, kernel); arguments in order with
 * kvcl_arg_*(&L, ...); kvcl_launch_run(&L, dims, global, local, "what", e).
 * A failure of any step marks the context failed (kvcl_mark_failed) with
 * "OpenCL <what>: <error name>", and every later op returns it.
 */
#ifndef KVCL_INTERNAL_H
#define KVCL_INTERNAL_H

#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

#include "kvcl.h"
#include "types.h"

/* ---- embedded kernel sources (generated from the .cl files in opencl/kernels) ---- */
typedef struct {
    const char *name; /* file name */
    const char *text; /* its bytes (NUL-terminated) */
    size_t len;
} kvcl_source;

extern const kvcl_source kvcl_kernel_sources[];
extern const int kvcl_kernel_count;

/* ---- context ---- */

#define KVCL_XREC_SLOTS 4 /* records buffers at once: n_embd, n_ff and attention's widths (two of one width a
                           * fused op reads and writes) */

/* the kernels of one weight type (matmul.cl; the *_i8 ones matmul_i8.cl,
 * for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K, NULL for the others) */
typedef struct {
    cl_kernel gemv, gemv_wg, tiled, deq, gemv3;
    cl_kernel gemv_i8, gemv3_i8, tiled_i8, gemv_i8_norm, gemv_act_i8;
} kvcl_type_kernels;

struct kvcl_ctx {
    kvcl_device_info info;
    cl_device_id dev;
    cl_context ctx;
    cl_command_queue q;
    cl_program prog;
    bool from_cache;      /* prog came from the binary cache */
    uint64_t max_alloc;   /* bytes per buffer part */
    int gemv;             /* KVCL_GEMV_ROW / GROUP */
    int prefill;          /* KVCL_MM_TILED / CLBLAST (kvcl_ops.h), chosen by kvcl_prefill_choose */
    bool int_dot;         /* the *_i8 kernels compute (an x86 CPU driver, gemv ROW): their types use them */
    bool vnni;            /* the program was built with KVCL_VNNI (the *_i8 kernels' vpdpbusd) */
    char cache_dir[1024]; /* "" : no cache */
    unsigned char dev_key[32]; /* hash of the device's identity (cache file names) */

    kvcl_type_kernels mm[KV_TYPE_COUNT];
    cl_kernel rmsnorm, rope, rope_qk, add, scale, softcap, add_bias, ffn_act, all_finite, hadamard;
    cl_kernel kv_store, attention, attention_row, attention_merge, quant_x;

    /* Records of quantized activations (matmul_i8.cl) that a kernel wrote
     * with its output (rmsnorm, ffn_act, attention), so the product that
     * reads that output skips quant_x: one buffer per row width (the zero
     * blocks past it written once), and which rows the last launch left
     * there. kvcl_xq_target / kvcl_xq_set (kvcl_matmul.c). */
    struct {
        cl_mem m;
        size_t bytes;
        int64_t cols;
    } xrec[KVCL_XREC_SLOTS];
    int xrec_next; /* the slot a new width takes */
    struct {
        cl_mem x;     /* the output's buffer and offset (floats) */
        size_t off;
        int64_t cols, T;
        cl_mem rec;   /* NULL: none (every launch and write clears it) */
    } xq;

    uint64_t in_use;      /* bytes of buffers (and scratch) allocated, at most info.memory */
    cl_mem scratch;       /* grows on demand: CLBlast tiles, attention partials */
    size_t scratch_bytes;
    cl_mem flag;          /* one int (all_finite) */
    cl_mem count;         /* one int, 0 between launches (gemv_i8_norm's finished work-groups) */

    kv_status failed;     /* KV_OK until a launch or wait fails */
    char fail_msg[KV_ERROR_MAX];
};

struct kvcl_buf {
    kvcl_ctx *c;
    size_t bytes;      /* total */
    size_t part_bytes; /* of every part but the last */
    int n_parts;
    cl_mem *parts;
};

/* The device of index kvcl_devices() lists, and its description; false
 * when there is no such device. kvcl_device.c */
bool kvcl_device_find(int index, cl_device_id *dev, kvcl_device_info *info);

/* Name of an OpenCL error code ("CL_OUT_OF_RESOURCES"). */
const char *kvcl_errstr(cl_int err);
/* The status an OpenCL error maps to (allocation failures: KV_ERR_NOMEM). */
kv_status kvcl_status_of(cl_int err);
/* Marks c failed with "OpenCL <what>: <error>" (first failure wins) and
 * returns that status with the message in e. */
kv_status kvcl_mark_failed(kvcl_ctx *c, kv_error *e, cl_int err, const char *what);
/* The sticky failure, if any (into e). */
kv_status kvcl_check(const kvcl_ctx *c, kv_error *e);

/* Builds (or loads from the cache) c->prog for c->dev. kvcl_program.c */
kv_status kvcl_program_load(kvcl_ctx *c, const kvcl_options *o, kv_error *e);
/* Hex name of a cache file in c->cache_dir: dev_key then suffix. */
void kvcl_cache_path(const kvcl_ctx *c, const char *suffix, char *out, size_t cap);

/* Scratch of at least bytes (reallocated when smaller; the old buffer is
 * released once queued commands are done with it). */
kv_status kvcl_scratch(kvcl_ctx *c, size_t bytes, cl_mem *out, kv_error *e);

/* Where a kernel writing x(T, cols) should write its records too (the
 * buffer, *nbx its blocks per row), or NULL: not an integer-kernel device,
 * cols not a multiple of 32, or no room (then the product quantizes x
 * itself). Never the buffer avoid (NULL: none), the records the same
 * launch reads: a fused kernel whose input and output have one width
 * (n_ff = n_embd, or attention's width) would overwrite blocks that its
 * other work-groups still read. kvcl_xq_set after the launch says they
 * are there. */
cl_mem kvcl_xq_target(kvcl_ctx *c, int64_t cols, int64_t T, cl_mem avoid, int *nbx);
void kvcl_xq_set(kvcl_ctx *c, cl_mem x, size_t off, int64_t cols, int64_t T, cl_mem rec);

/* The single part of a buffer meant for activations (error when split). */
kv_status kvcl_buf_single(const kvcl_buf *b, const char *what, cl_mem *out, kv_error *e);
/* The buffer of a view that must hold n floats from its offset on. */
kv_status kvcl_view_mem(kvcl_view v, size_t n, const char *what, cl_mem *out, kv_error *e);

/* ---- launches ---- */
typedef struct {
    kvcl_ctx *c;
    cl_kernel k;
    cl_uint n;   /* next argument index */
    cl_int err;  /* first clSetKernelArg error */
} kvcl_launch;

kvcl_launch kvcl_launch_begin(kvcl_ctx *c, cl_kernel k);
void kvcl_arg_mem(kvcl_launch *L, cl_mem m); /* NULL: a NULL pointer argument */
void kvcl_arg_int(kvcl_launch *L, int v);
void kvcl_arg_long(kvcl_launch *L, int64_t v);
void kvcl_arg_ulong(kvcl_launch *L, uint64_t v);
void kvcl_arg_float(kvcl_launch *L, float v);
/* Global sizes must be multiples of the local ones. Every op passes its
 * local size (not NULL): drivers that compile a kernel per work-group
 * size (PoCL) would otherwise build one per global size they are given. */
kv_status kvcl_launch_run(kvcl_launch *L, int dims, const size_t *global, const size_t *local,
                          const char *what, kv_error *e);

static inline size_t kvcl_round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

/* The page table arguments of a layer's pages (KV_PAGE_PARAMS in blocks.cl). kvcl_attention.c */
struct kvcl_pages_s;
void kvcl_page_args(kvcl_launch *L, const struct kvcl_pages_s *pg);

/* items of deq_<type> along a row: its blocks (deq_block in blocks.cl: 256
 * elements for the K-quants, 32 otherwise) and a float row's tail */
static inline size_t kvcl_deq_items(int type, int64_t cols) {
    const int64_t be = kv_type_traits_get(type)->blck == 256 ? 256 : 32;
    return (size_t)((cols + be - 1) / be);
}

#endif
