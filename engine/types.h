/*
 * types.h — ggml tensor type ids as stored in GGUF, and their block layout.
 *
 * A row of n elements of a block type occupies (n / blck) * type_size
 * bytes; n must be a multiple of blck. `supported` says whether the CPU
 * engine can compute with the type (the loader accepts every known type,
 * so metadata tools work on any file).
 */
#ifndef KV_TYPES_H
#define KV_TYPES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum {
    KV_TYPE_F32 = 0,
    KV_TYPE_F16 = 1,
    KV_TYPE_Q4_0 = 2,
    KV_TYPE_Q4_1 = 3,
    KV_TYPE_Q5_0 = 6,
    KV_TYPE_Q5_1 = 7,
    KV_TYPE_Q8_0 = 8,
    KV_TYPE_Q8_1 = 9,
    KV_TYPE_Q2_K = 10,
    KV_TYPE_Q3_K = 11,
    KV_TYPE_Q4_K = 12,
    KV_TYPE_Q5_K = 13,
    KV_TYPE_Q6_K = 14,
    KV_TYPE_Q8_K = 15,
    KV_TYPE_IQ2_XXS = 16,
    KV_TYPE_IQ2_XS = 17,
    KV_TYPE_IQ3_XXS = 18,
    KV_TYPE_IQ1_S = 19,
    KV_TYPE_IQ4_NL = 20,
    KV_TYPE_IQ3_S = 21,
    KV_TYPE_IQ2_S = 22,
    KV_TYPE_IQ4_XS = 23,
    KV_TYPE_I8 = 24,
    KV_TYPE_I16 = 25,
    KV_TYPE_I32 = 26,
    KV_TYPE_I64 = 27,
    KV_TYPE_F64 = 28,
    KV_TYPE_IQ1_M = 29,
    KV_TYPE_BF16 = 30,
    KV_TYPE_TQ1_0 = 34,
    KV_TYPE_TQ2_0 = 35,
    KV_TYPE_MXFP4 = 39,
    KV_TYPE_COUNT = 40
};

typedef struct {
    const char *name; /* "Q4_K", ... */
    int blck;         /* elements per block */
    size_t type_size; /* bytes per block */
    bool supported;   /* the CPU engine computes with it */
} kv_type_traits;

/* NULL for an id that is not a known ggml type. */
const kv_type_traits *kv_type_traits_get(int type);

/* Bytes of a row of n elements; 0 if the type is unknown or n is not a
 * multiple of its block size. */
size_t kv_row_size(int type, int64_t n);

#endif
