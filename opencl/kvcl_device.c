/* kvcl_device.c — enumerate OpenCL platforms and devices (see kvcl.h). */
#include "kvcl.h"

#include <string.h>

#ifdef KV_HAVE_OPENCL
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>

static void kvcl_copy_info(cl_device_id d, cl_device_info what, char *dst, size_t cap) {
    size_t got = 0;
    dst[0] = 0;
    if (clGetDeviceInfo(d, what, cap - 1, dst, &got) != CL_SUCCESS) dst[0] = 0;
    dst[cap - 1] = 0;
}

int kvcl_devices(kvcl_device_info *out, int max) {
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
        for (cl_uint i = 0; i < nd; i++, count++) {
            if (count >= max) continue;
            kvcl_device_info *o = &out[count];
            memset(o, 0, sizeof *o);
            memcpy(o->platform, pname, sizeof o->platform);
            kvcl_copy_info(devs[i], CL_DEVICE_NAME, o->name, sizeof o->name);
            cl_device_type t = 0;
            clGetDeviceInfo(devs[i], CL_DEVICE_TYPE, sizeof t, &t, NULL);
            strcpy(o->type, (t & CL_DEVICE_TYPE_GPU) ? "gpu" : (t & CL_DEVICE_TYPE_CPU) ? "cpu"
                            : (t & CL_DEVICE_TYPE_ACCELERATOR) ? "accel" : "other");
            cl_ulong mem = 0, alloc = 0;
            clGetDeviceInfo(devs[i], CL_DEVICE_GLOBAL_MEM_SIZE, sizeof mem, &mem, NULL);
            clGetDeviceInfo(devs[i], CL_DEVICE_MAX_MEM_ALLOC_SIZE, sizeof alloc, &alloc, NULL);
            o->memory = mem;
            o->max_alloc = alloc;
            char ext[4096];
            kvcl_copy_info(devs[i], CL_DEVICE_EXTENSIONS, ext, sizeof ext);
            o->has_fp16 = strstr(ext, "cl_khr_fp16") != NULL;
        }
    }
    return count;
}
#else
int kvcl_devices(kvcl_device_info *out, int max) {
    (void)out;
    (void)max;
    return 0;
}
#endif
