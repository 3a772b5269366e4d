/*
 * kvcl_ctx.c — one OpenCL context: opening it on a device (context, in-order
 * queue, program, the table of kernels), the sticky failure state, error
 * names, and the launch helpers every op uses (kvcl_internal.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcl_internal.h"
#include "kvcl_ops.h"

/* ==== errors ================================================================ */

const char *kvcl_errstr(cl_int err) {
    switch (err) {
#define E(x) \
    case x: return #x;
        E(CL_SUCCESS) E(CL_DEVICE_NOT_FOUND) E(CL_DEVICE_NOT_AVAILABLE) E(CL_COMPILER_NOT_AVAILABLE)
        E(CL_MEM_OBJECT_ALLOCATION_FAILURE) E(CL_OUT_OF_RESOURCES) E(CL_OUT_OF_HOST_MEMORY)
        E(CL_PROFILING_INFO_NOT_AVAILABLE) E(CL_MEM_COPY_OVERLAP) E(CL_IMAGE_FORMAT_MISMATCH)
        E(CL_IMAGE_FORMAT_NOT_SUPPORTED) E(CL_BUILD_PROGRAM_FAILURE) E(CL_MAP_FAILURE)
        E(CL_MISALIGNED_SUB_BUFFER_OFFSET) E(CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST)
        E(CL_COMPILE_PROGRAM_FAILURE) E(CL_LINKER_NOT_AVAILABLE) E(CL_LINK_PROGRAM_FAILURE)
        E(CL_DEVICE_PARTITION_FAILED) E(CL_KERNEL_ARG_INFO_NOT_AVAILABLE) E(CL_INVALID_VALUE)
        E(CL_INVALID_DEVICE_TYPE) E(CL_INVALID_PLATFORM) E(CL_INVALID_DEVICE) E(CL_INVALID_CONTEXT)
        E(CL_INVALID_QUEUE_PROPERTIES) E(CL_INVALID_COMMAND_QUEUE) E(CL_INVALID_HOST_PTR)
        E(CL_INVALID_MEM_OBJECT) E(CL_INVALID_IMAGE_FORMAT_DESCRIPTOR) E(CL_INVALID_IMAGE_SIZE)
        E(CL_INVALID_SAMPLER) E(CL_INVALID_BINARY) E(CL_INVALID_BUILD_OPTIONS) E(CL_INVALID_PROGRAM)
        E(CL_INVALID_PROGRAM_EXECUTABLE) E(CL_INVALID_KERNEL_NAME) E(CL_INVALID_KERNEL_DEFINITION)
        E(CL_INVALID_KERNEL) E(CL_INVALID_ARG_INDEX) E(CL_INVALID_ARG_VALUE) E(CL_INVALID_ARG_SIZE)
        E(CL_INVALID_KERNEL_ARGS) E(CL_INVALID_WORK_DIMENSION) E(CL_INVALID_WORK_GROUP_SIZE)
        E(CL_INVALID_WORK_ITEM_SIZE) E(CL_INVALID_GLOBAL_OFFSET) E(CL_INVALID_EVENT_WAIT_LIST)
        E(CL_INVALID_EVENT) E(CL_INVALID_OPERATION) E(CL_INVALID_GL_OBJECT) E(CL_INVALID_BUFFER_SIZE)
        E(CL_INVALID_MIP_LEVEL) E(CL_INVALID_GLOBAL_WORK_SIZE) E(CL_INVALID_PROPERTY)
        E(CL_INVALID_IMAGE_DESCRIPTOR) E(CL_INVALID_COMPILER_OPTIONS) E(CL_INVALID_LINKER_OPTIONS)
        E(CL_INVALID_DEVICE_PARTITION_COUNT)
#undef E
    }
    return "unknown OpenCL error";
}

kv_status kvcl_status_of(cl_int err) {
    if (err == CL_MEM_OBJECT_ALLOCATION_FAILURE || err == CL_OUT_OF_RESOURCES ||
        err == CL_OUT_OF_HOST_MEMORY || err == CL_INVALID_BUFFER_SIZE)
        return KV_ERR_NOMEM;
    return KV_ERR_DEVICE;
}

kv_status kvcl_mark_failed(kvcl_ctx *c, kv_error *e, cl_int err, const char *what) {
    if (c->failed == KV_OK) {
        c->failed = kvcl_status_of(err);
        snprintf(c->fail_msg, sizeof c->fail_msg, "OpenCL %s: %s (%d); the device context is unusable",
                 what, kvcl_errstr(err), (int)err);
    }
    return kvcl_check(c, e);
}

kv_status kvcl_check(const kvcl_ctx *c, kv_error *e) {
    if (c->failed == KV_OK) return KV_OK;
    return kv_fail(e, c->failed, "%s", c->fail_msg);
}

kv_status kvcl_ctx_status(const kvcl_ctx *c, kv_error *e) { return kvcl_check(c, e); }

kv_status kvcl_finish(kvcl_ctx *c, kv_error *e) {
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    cl_int err = clFinish(c->q);
    return err == CL_SUCCESS ? KV_OK : kvcl_mark_failed(c, e, err, "wait");
}

/* ==== launches ================================================================ */

/* a launch may write the buffer whose records c->xq names: they are stale then */
kvcl_launch kvcl_launch_begin(kvcl_ctx *c, cl_kernel k) {
    c->xq.rec = NULL;
    return (kvcl_launch){c, k, 0, CL_SUCCESS};
}

static void arg(kvcl_launch *L, size_t size, const void *v) {
    cl_int err = clSetKernelArg(L->k, L->n++, size, v);
    if (L->err == CL_SUCCESS) L->err = err;
}

void kvcl_arg_mem(kvcl_launch *L, cl_mem m) { arg(L, sizeof m, m ? (const void *)&m : NULL); }
void kvcl_arg_int(kvcl_launch *L, int v) { cl_int x = v; arg(L, sizeof x, &x); }
void kvcl_arg_long(kvcl_launch *L, int64_t v) { cl_long x = v; arg(L, sizeof x, &x); }
void kvcl_arg_ulong(kvcl_launch *L, uint64_t v) { cl_ulong x = v; arg(L, sizeof x, &x); }
void kvcl_arg_float(kvcl_launch *L, float v) { cl_float x = v; arg(L, sizeof x, &x); }

kv_status kvcl_launch_run(kvcl_launch *L, int dims, const size_t *global, const size_t *local,
                          const char *what, kv_error *e) {
    if (kvcl_check(L->c, e) != KV_OK) return L->c->failed;
    for (int d = 0; d < dims; d++)
        if (global[d] == 0) return KV_OK; /* nothing to do */
    cl_int err = L->err;
    if (err == CL_SUCCESS) err = clEnqueueNDRangeKernel(L->c->q, L->k, (cl_uint)dims, NULL, global, local, 0, NULL, NULL);
    return err == CL_SUCCESS ? KV_OK : kvcl_mark_failed(L->c, e, err, what);
}

/* ==== opening ================================================================== */

/* The types matmul.cl instantiates its kernels for, their suffixes, and
 * whether matmul_i8.cl has integer kernels for them. */
static const struct {
    int type;
    const char *suffix;
    bool i8;
} k_types[] = {
    {KV_TYPE_F32, "f32", false},   {KV_TYPE_F16, "f16", false},   {KV_TYPE_BF16, "bf16", false},
    {KV_TYPE_Q4_0, "q4_0", true},  {KV_TYPE_Q4_1, "q4_1", true},  {KV_TYPE_Q5_0, "q5_0", true},
    {KV_TYPE_Q5_1, "q5_1", true},  {KV_TYPE_Q8_0, "q8_0", true},  {KV_TYPE_Q4_K, "q4_k", true},
    {KV_TYPE_Q5_K, "q5_k", true},  {KV_TYPE_Q6_K, "q6_k", false},
};

static kv_status kernel(kvcl_ctx *c, const char *name, cl_kernel *out, kv_error *e) {
    cl_int err;
    *out = clCreateKernel(c->prog, name, &err);
    if (err == CL_SUCCESS) return KV_OK;
    *out = NULL;
    return kv_fail(e, KV_ERR_DEVICE, "OpenCL kernel %s: %s", name, kvcl_errstr(err));
}

static kv_status create_kernels(kvcl_ctx *c, kv_error *e) {
    for (size_t i = 0; i < sizeof k_types / sizeof k_types[0]; i++) {
        kvcl_type_kernels *t = &c->mm[k_types[i].type];
        char name[64];
        const struct {
            const char *prefix;
            cl_kernel *k;
        } kinds[] = {{"gemv", &t->gemv}, {"gemv_wg", &t->gemv_wg}, {"tiled", &t->tiled}, {"deq", &t->deq},
                     {"gemv3", &t->gemv3}};
        for (size_t j = 0; j < sizeof kinds / sizeof kinds[0]; j++) {
            snprintf(name, sizeof name, "%s_%s", kinds[j].prefix, k_types[i].suffix);
            if (kernel(c, name, kinds[j].k, e) != KV_OK) return KV_ERR_DEVICE;
        }
        if (!k_types[i].i8) continue;
        const struct {
            const char *prefix;
            cl_kernel *k;
        } i8[] = {{"gemv_i8", &t->gemv_i8}, {"gemv3_i8", &t->gemv3_i8}, {"tiled_i8", &t->tiled_i8},
                  {"gemv_i8_norm", &t->gemv_i8_norm}, {"gemv_act_i8", &t->gemv_act_i8}};
        for (size_t j = 0; j < sizeof i8 / sizeof i8[0]; j++) {
            snprintf(name, sizeof name, "%s_%s", i8[j].prefix, k_types[i].suffix);
            if (kernel(c, name, i8[j].k, e) != KV_OK) return KV_ERR_DEVICE;
        }
    }
    const struct {
        const char *name;
        cl_kernel *k;
    } named[] = {
        {"rmsnorm", &c->rmsnorm},       {"rope", &c->rope},       {"rope_qk", &c->rope_qk}, {"add", &c->add},
        {"scale", &c->scale},           {"softcap", &c->softcap}, {"add_bias", &c->add_bias},
        {"ffn_act", &c->ffn_act},       {"all_finite", &c->all_finite}, {"kv_store", &c->kv_store},
        {"attention", &c->attention},   {"attention_row", &c->attention_row},
        {"attention_merge", &c->attention_merge},
        {"hadamard", &c->hadamard},     {"quant_x", &c->quant_x},
    };
    for (size_t j = 0; j < sizeof named / sizeof named[0]; j++)
        if (kernel(c, named[j].name, named[j].k, e) != KV_OK) return KV_ERR_DEVICE;
    return KV_OK;
}

/* c->int_dot: whether the program's integer kernels compute (int_dot_caps,
 * run once); the work-group GEMV (GPUs) keeps the float kernels, and
 * KVLUA_CL_INT_DOT=0 turns them off (to compare, or to keep float
 * activations) */
static kv_status probe_int_dot(kvcl_ctx *c, kv_error *e) {
    cl_kernel k;
    if (kernel(c, "int_dot_caps", &k, e) != KV_OK) return KV_ERR_DEVICE;
    cl_int on = 0;
    size_t g = 1;
    cl_int err = clSetKernelArg(k, 0, sizeof(cl_mem), &c->flag);
    if (err == CL_SUCCESS) err = clEnqueueNDRangeKernel(c->q, k, 1, NULL, &g, NULL, 0, NULL, NULL);
    if (err == CL_SUCCESS) err = clEnqueueReadBuffer(c->q, c->flag, CL_TRUE, 0, sizeof on, &on, 0, NULL, NULL);
    clReleaseKernel(k);
    if (err != CL_SUCCESS) return kv_fail(e, kvcl_status_of(err), "OpenCL int_dot_caps: %s", kvcl_errstr(err));
    const char *env = getenv("KVLUA_CL_INT_DOT");
    c->int_dot = on == 1 && c->gemv == KVCL_GEMV_ROW && !(env && strcmp(env, "0") == 0);
    return KV_OK;
}

/* Properties every kernel relies on. */
static kv_status check_device(kvcl_ctx *c, kv_error *e) {
    cl_bool little = CL_FALSE;
    cl_ulong local = 0;
    size_t wg = 0;
    clGetDeviceInfo(c->dev, CL_DEVICE_ENDIAN_LITTLE, sizeof little, &little, NULL);
    clGetDeviceInfo(c->dev, CL_DEVICE_LOCAL_MEM_SIZE, sizeof local, &local, NULL);
    clGetDeviceInfo(c->dev, CL_DEVICE_MAX_WORK_GROUP_SIZE, sizeof wg, &wg, NULL);
    if (!little) return kv_fail(e, KV_ERR_UNSUPPORTED, "OpenCL device %s is big-endian", c->info.name);
    if (local < 36 * 1024)
        return kv_fail(e, KV_ERR_UNSUPPORTED, "OpenCL device %s: %llu bytes of local memory, 36 KiB needed",
                       c->info.name, (unsigned long long)local);
    if (wg < 64)
        return kv_fail(e, KV_ERR_UNSUPPORTED, "OpenCL device %s: work-groups of %zu items, 64 needed",
                       c->info.name, wg);
    return KV_OK;
}

static kv_status open_queue(kvcl_ctx *c, kv_error *e) {
    cl_int err;
    c->ctx = clCreateContext(NULL, 1, &c->dev, NULL, NULL, &err);
    if (err != CL_SUCCESS) return kv_fail(e, kvcl_status_of(err), "OpenCL context: %s", kvcl_errstr(err));
    c->q = clCreateCommandQueue(c->ctx, c->dev, 0, &err); /* in order */
    if (err != CL_SUCCESS) return kv_fail(e, kvcl_status_of(err), "OpenCL queue: %s", kvcl_errstr(err));
    c->flag = clCreateBuffer(c->ctx, CL_MEM_READ_WRITE, sizeof(cl_int), NULL, &err);
    if (err != CL_SUCCESS) return kv_fail(e, kvcl_status_of(err), "OpenCL buffer: %s", kvcl_errstr(err));
    static const cl_int zero = 0;
    c->count = clCreateBuffer(c->ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof zero, (void *)&zero, &err);
    if (err != CL_SUCCESS) return kv_fail(e, kvcl_status_of(err), "OpenCL buffer: %s", kvcl_errstr(err));
    return KV_OK;
}

kv_status kvcl_open(const kvcl_options *o, kvcl_ctx **out, kv_error *e) {
    static const kvcl_options defaults = {0};
    if (!o) o = &defaults;
    *out = NULL;
    kvcl_ctx *c = calloc(1, sizeof *c);
    if (!c) return kv_fail(e, KV_ERR_NOMEM, "out of memory");
    if (!kvcl_device_find(o->device, &c->dev, &c->info)) {
        free(c);
        int n = kvcl_devices(NULL, 0);
        if (n == 0) return kv_fail(e, KV_ERR_UNSUPPORTED, "no OpenCL device");
        return kv_fail(e, KV_ERR_ARG, "no OpenCL device %d (there are %d)", o->device, n);
    }
    c->max_alloc = o->max_alloc && o->max_alloc < c->info.max_alloc ? o->max_alloc : c->info.max_alloc;
    c->info.max_alloc = c->max_alloc;
    c->gemv = o->gemv != KVCL_GEMV_AUTO ? o->gemv : strcmp(c->info.type, "gpu") == 0 ? KVCL_GEMV_GROUP : KVCL_GEMV_ROW;
    c->prefill = KVCL_MM_TILED;
    kv_status st = check_device(c, e);
    if (st == KV_OK) st = open_queue(c, e);
    if (st == KV_OK) st = kvcl_program_load(c, o, e);
    if (st == KV_OK) st = create_kernels(c, e);
    if (st == KV_OK) st = probe_int_dot(c, e);
    if (st != KV_OK) {
        kvcl_close(c);
        return st;
    }
    *out = c;
    return KV_OK;
}

void kvcl_close(kvcl_ctx *c) {
    if (!c) return;
    if (c->q) clFinish(c->q);
    for (int t = 0; t < KV_TYPE_COUNT; t++) {
        cl_kernel *k[] = {&c->mm[t].gemv,  &c->mm[t].gemv_wg, &c->mm[t].tiled,   &c->mm[t].deq,
                          &c->mm[t].gemv3, &c->mm[t].gemv_i8, &c->mm[t].gemv3_i8, &c->mm[t].tiled_i8,
                          &c->mm[t].gemv_i8_norm, &c->mm[t].gemv_act_i8};
        for (size_t j = 0; j < sizeof k / sizeof k[0]; j++)
            if (*k[j]) clReleaseKernel(*k[j]);
    }
    cl_kernel named[] = {c->rmsnorm,  c->rope,     c->rope_qk,   c->add,       c->scale,
                         c->softcap,  c->add_bias, c->ffn_act,   c->all_finite,
                         c->kv_store, c->attention, c->attention_row, c->attention_merge, c->hadamard, c->quant_x};
    for (size_t j = 0; j < sizeof named / sizeof named[0]; j++)
        if (named[j]) clReleaseKernel(named[j]);
    if (c->prog) clReleaseProgram(c->prog);
    if (c->scratch) clReleaseMemObject(c->scratch);
    for (int i = 0; i < KVCL_XREC_SLOTS; i++)
        if (c->xrec[i].m) clReleaseMemObject(c->xrec[i].m);
    if (c->flag) clReleaseMemObject(c->flag);
    if (c->count) clReleaseMemObject(c->count);
    if (c->q) clReleaseCommandQueue(c->q);
    if (c->ctx) clReleaseContext(c->ctx);
    free(c);
}

const kvcl_device_info *kvcl_ctx_device(const kvcl_ctx *c) { return &c->info; }

bool kvcl_ctx_int_dot(const kvcl_ctx *c) { return c->int_dot; }

bool kvcl_ctx_vnni(const kvcl_ctx *c) { return c->int_dot && c->vnni; }

bool kvcl_ctx_from_cache(const kvcl_ctx *c) { return c->from_cache; }
