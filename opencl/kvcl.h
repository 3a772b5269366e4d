/*
 * kvcl.h — OpenCL host code: device discovery (the OpenCL backend proper,
 * running every engine op in .cl kernels, is the next milestone).
 *
 * Built only when the OpenCL ICD loader is found (KV_HAVE_OPENCL); without
 * it kvcl_devices reports none.
 */
#ifndef KVCL_H
#define KVCL_H

#include <stdint.h>

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

#endif
