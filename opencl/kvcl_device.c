/*
 * kvcl_device.c — enumerate OpenCL platforms and devices (see kvcl.h): the
 * order kvcl_devices lists them in is the index kvcl_open takes. Compiled
 * with or without OpenCL (then there are no devices).
 */
#include "kvcl.h"

#include <string.h>

#ifdef KV_HAVE_OPENCL
#include "kvcl_internal.h"

static void kvcl_copy_info(cl_device_id d, cl_device_info what, char *dst, size_t cap) {
    size_t got = 0;
    dst[0] = 0;
    if (clGetDeviceInfo(d, what, cap - 1, dst, &got) != CL_SUCCESS) dst[0] = 0;
    dst[cap - 1] = 0;
}

/* Visits the devices in index order; stops when fn returns true (then
 * returns that index), else returns the count. */
typedef bool (*device_fn)(void *arg, int index, const char *pname, cl_device_id d);

static int each_device(device_fn fn, void *arg) {
    cl_uint np = 0;
    if (clGetPlatformIDs(0, NULL, &np) != CL_SUCCESS || np == 0) return 0;
    cl_platform_id plats[16];
    if (np > 16) np = 16;
    if (clGetPlatformIDs(np, plats, NULL) != CL_SUCCESS) return 0;
    int count = 0;
    for (cl_uint p = 0; p < np; p++) {
        char pname[128] = {0};
        clGetPlatformInfo(plats[p], CL_PLATFORM_NAME, sizeof pname - 1, pname, NULL);
        cl_uint nd = 0;
        if (clGetDeviceIDs(plats[p], CL_DEVICE_TYPE_ALL, 0, NULL, &nd) != CL_SUCCESS) continue;
        cl_device_id devs[32];
        if (nd > 32) nd = 32;
        if (clGetDeviceIDs(plats[p], CL_DEVICE_TYPE_ALL, nd, devs, NULL) != CL_SUCCESS) continue;
        for (cl_uint i = 0; i < nd; i++, count++)
            if (fn(arg, count, pname, devs[i])) return count;
    }
    return count;
}

static void kvcl_device_describe(cl_device_id d, const char *pname, kvcl_device_info *o) {
    memset(o, 0, sizeof *o);
    strncpy(o->platform, pname, sizeof o->platform - 1);
    kvcl_copy_info(d, CL_DEVICE_NAME, o->name, sizeof o->name);
    cl_device_type t = 0;
    clGetDeviceInfo(d, CL_DEVICE_TYPE, sizeof t, &t, NULL);
    strcpy(o->type, (t & CL_DEVICE_TYPE_GPU) ? "gpu" : (t & CL_DEVICE_TYPE_CPU) ? "cpu"
                    : (t & CL_DEVICE_TYPE_ACCELERATOR) ? "accel" : "other");
    cl_ulong mem = 0, alloc = 0;
    clGetDeviceInfo(d, CL_DEVICE_GLOBAL_MEM_SIZE, sizeof mem, &mem, NULL);
    clGetDeviceInfo(d, CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof alloc, &alloc, NULL);
    o->memory = mem;
    o->max_alloc = alloc;
    char ext[4096];
    kvcl_copy_info(d, CL_DEVICE_EXTENSIONS, ext, sizeof ext);
    o->has_fp16 = strstr(ext, "cl_khr_fp16") != NULL;
}

typedef struct {
    kvcl_device_info *out;
    int max;
} list_arg;

static bool list_one(void *arg, int index, const char *pname, cl_device_id d) {
    list_arg *a = arg;
    if (index < a->max) kvcl_device_describe(d, pname, &a->out[index]);
    return false;
}

int kvcl_devices(kvcl_device_info *out, int max) {
    list_arg a = {out, max};
    return each_device(list_one, &a);
}

typedef struct {
    int want;
    cl_device_id dev;
    char pname[128];
} find_arg;

static bool find_one(void *arg, int index, const char *pname, cl_device_id d) {
    find_arg *a = arg;
    if (index != a->want) return false;
    a->dev = d;
    strncpy(a->pname, pname, sizeof a->pname - 1);
    return true;
}

bool kvcl_device_find(int index, cl_device_id *dev, kvcl_device_info *info) {
    find_arg a = {index, NULL, {0}};
    if (index < 0) return false;
    each_device(find_one, &a);
    if (!a.dev) return false;
    *dev = a.dev;
    kvcl_device_describe(a.dev, a.pname, info);
    return true;
}
#else
int kvcl_devices(kvcl_device_info *out, int max) {
    (void)out;
    (void)max;
    return 0;
}
#endif
