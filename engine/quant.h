/*
 * quant.h — weight block formats and the CPU kernels that compute on them.
 *
 * Weights stay in their GGUF block format; matrix products quantize the
 * activations on the fly to the format each weight type's dot product
 * consumes (Q8_0 for the 32-element formats, Q8_K for the K-quants, F32 or
 * F16 for float weights) and run integer dot products block by block.
 *
 * Every kernel has a portable scalar version (the reference the tests and
 * the future OpenCL backend compare against) and, where the CPU has them,
 * AVX2/FMA/F16C (and AVX-512) versions picked once at run time.
 */
#ifndef KV_QUANT_H
#define KV_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "threadpool.h"
#include "types.h"

/* ---- half / bfloat16 conversion ---------------------------------------- */
float kv_f16_to_f32(uint16_t h);
uint16_t kv_f32_to_f16(float f);   /* round to nearest even */
float kv_bf16_to_f32(uint16_t h);
void kv_f16_to_f32_row(const uint16_t *src, float *dst, int64_t n);
void kv_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n);

/* ---- rows ----------------------------------------------------------- */
/* dst[0..n) = the n values of one row of a supported type (n % blck == 0). */
void kv_dequantize_row(int type, const void *src, float *dst, int64_t n);
/* Quantizes a row; implemented for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
 * Q8_0, Q8_1, Q8_K (Q4_K/Q5_K/Q6_K too, for writing test models). Returns 0
 * on success, -1 for a type it cannot write. */
int kv_quantize_row(int type, const float *src, void *dst, int64_t n);

/* ---- rotation of quantized K/V ---------------------------------------- */
/* Quantized K/V cache pages hold rows multiplied by an orthonormal Hadamard
 * matrix (blocks of kv_hadamard_block(n) values: the largest power of two
 * dividing n, at most 256): the rotation spreads the few large channels of
 * K over a whole block, so the 32-value quantization blocks see no outliers.
 * Q is rotated the same way (q.k is unchanged), V before it is stored and
 * the attention output after (H.H = I). */
static inline bool kv_type_rotated(int type) { return type == KV_TYPE_Q8_0 || type == KV_TYPE_Q4_0; }
int kv_hadamard_block(int64_t n);
/* x(rows, n) = x H, in place, row by row (the same float operations for
 * every row: batch invariant). */
void kv_hadamard_rows(float *x, int64_t rows, int64_t n);

/* ---- dot products ------------------------------------------------------ */
/* The activation type the dot product of weight type wtype consumes. */
int kv_vec_dot_type(int wtype);
/* *out = dot(w_row[0..n), x[0..n)), w_row of type wtype, x quantized to
 * kv_vec_dot_type(wtype). Best implementation for this CPU. */
void kv_vec_dot(int wtype, int64_t n, float *out, const void *w_row, const void *x);
/* The same, portable scalar code only (the reference). */
void kv_vec_dot_ref(int wtype, int64_t n, float *out, const void *w_row, const void *x);

/* Name of the SIMD level in use: "avx512", "avx2", "scalar". Set
 * KVLUA_SIMD=scalar in the environment to force the portable path. */
const char *kv_simd_name(void);

/* ---- matrix products -------------------------------------------------------
 * y[t][r] = sum_k W[r][k] * x[t][k]
 *   W: rows x K, type wtype, rows contiguous (kv_row_size(wtype, K) bytes each)
 *   x: (T, K) float, row stride K
 *   y: (T, rows) float, row stride ldy (>= rows)
 * Work is split over the pool's threads; for T > 1 weight blocks are reused
 * across several tokens (the prefill path). scratch must hold
 * kv_matmul_scratch_size(wtype, K, T) bytes (quantized activations).
 * Batch invariant: y[t] depends on x[t] and W only, bit for bit, whatever T,
 * t's place in the batch and the thread count (one-token decode and the
 * tiled prefill sum in the same order); it may differ between SIMD levels. */
size_t kv_matmul_scratch_size(int wtype, int64_t K, int64_t T);
void kv_matmul(kv_pool *pool, int wtype, const void *W, int64_t rows, int64_t K,
               const float *x, int64_t T, float *y, int64_t ldy, void *scratch);

/* Several products of the same x (T, K): y_i = x W_i^T for each out i (at
 * most KV_MATMUL_N_MAX), the bits kv_matmul gives each. x is quantized once
 * for the weights sharing a dot type and their rows go through one
 * dispatch (the q, k, v projections; gate and up). scratch: the largest
 * kv_matmul_scratch_size of the weights. */
#define KV_MATMUL_N_MAX 4
typedef struct {
    int wtype;
    const void *W;
    int64_t rows;
    float *y;
    int64_t ldy;
} kv_mm_out;
void kv_matmul_n(kv_pool *pool, int n, const kv_mm_out *outs, int64_t K, const float *x, int64_t T, void *scratch);

#endif
