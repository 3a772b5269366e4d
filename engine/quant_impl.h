/*
 * quant_impl.h — private to the quant kernels (quant.c, quant_avx2.c).
 *
 * The ggml block layouts as C structs (byte-exact with GGUF), and the table
 * of per-type kernels the dispatcher fills once: the scalar reference
 * entries live in quant.c, the AVX2/FMA/F16C ones in quant_avx2.c.
 */
#ifndef KV_QUANT_IMPL_H
#define KV_QUANT_IMPL_H

#include <stddef.h>
#include <stdint.h>

#define KV_QK 32   /* elements per block of the 32-wide formats */
#define KV_QKK 256 /* elements per K-quant super-block */

/* ---- block layouts (GGUF / ggml, little endian) --------------------------- */
typedef struct { uint16_t d; uint8_t qs[16]; } kv_block_q4_0;              /* 18 */
typedef struct { uint16_t d, m; uint8_t qs[16]; } kv_block_q4_1;           /* 20 */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } kv_block_q5_0; /* 22 */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } kv_block_q5_1; /* 24 */
typedef struct { uint16_t d; int8_t qs[32]; } kv_block_q8_0;               /* 34 */
typedef struct { uint16_t d, s; int8_t qs[32]; } kv_block_q8_1;            /* 36: s = d * sum(qs) */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12]; /* 8 six-bit scales and 8 six-bit mins, packed */
    uint8_t qs[128];
} kv_block_q4_k;        /* 144 */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[32];
    uint8_t qs[128];
} kv_block_q5_k;        /* 176 */
typedef struct {
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    uint16_t d;
} kv_block_q6_k;        /* 210 */
typedef struct {
    float d;
    int8_t qs[256];
    int16_t bsums[16];  /* sums of qs in groups of 16 */
} kv_block_q8_k;        /* 292 */

_Static_assert(sizeof(kv_block_q4_0) == 18, "q4_0");
_Static_assert(sizeof(kv_block_q4_1) == 20, "q4_1");
_Static_assert(sizeof(kv_block_q5_0) == 22, "q5_0");
_Static_assert(sizeof(kv_block_q5_1) == 24, "q5_1");
_Static_assert(sizeof(kv_block_q8_0) == 34, "q8_0");
_Static_assert(sizeof(kv_block_q8_1) == 36, "q8_1");
_Static_assert(sizeof(kv_block_q4_k) == 144, "q4_k");
_Static_assert(sizeof(kv_block_q5_k) == 176, "q5_k");
_Static_assert(sizeof(kv_block_q6_k) == 210, "q6_k");
_Static_assert(sizeof(kv_block_q8_k) == 292, "q8_k");

/* The 6-bit scale j and min j (j < 8) of a Q4_K / Q5_K super-block. */
static inline void kv_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* ---- kernel table ------------------------------------------------------------
 * tile: y[t * ldy + r] = dot(W row r, X row t) for r < nr, t < nt, where
 *   W rows are wstride bytes apart (weight type), X rows xstride bytes apart
 *   (already quantized to the dot type), K elements each. Any nr, nt >= 1.
 *   X is token t0 of the matmul; xf is the matmul's side table for the
 *   32-element activation formats (Q8_0 / Q8_1), NULL otherwise:
 *     xf[KV_XF(t, b, nb)]     = float scale d of block b of token t
 *     xf[KV_XF(t, b, nb) + 4] = d * sum(qs) of that block
 *   (tokens in groups of 4, so a 4-token tile loads 4 scales at once).
 * quant: quantizes one activation row of K floats to the dot type. */
#define KV_XF(t, b, nb) ((((t) / 4) * (nb) + (b)) * 8 + (t) % 4)
typedef void (*kv_tile_fn)(int64_t K, const uint8_t *W, size_t wstride, int nr,
                           const uint8_t *X, size_t xstride, int nt, float *y, int64_t ldy,
                           const float *xf, int64_t t0);
typedef void (*kv_dot_fn)(int64_t n, float *out, const void *w, const void *x);
typedef void (*kv_quant_fn)(const float *src, void *dst, int64_t n);

/* The 8-token prefill layout of Q8_0 / Q8_1 activations (built by kv_matmul
 * when the weight type has a tile8 kernel). For each group of 8 tokens (the
 * last one padded with zero tokens) and each block b: 256 bytes, quants
 * 4g..4g+3 of tokens 0..7 for g = 0..7:
 *   xi[(G * nb + b) * 256 + 32 g + 4 t + k] = q of token 8G + t, element 32 b + 4 g + k
 * and KV_X8F floats: the 8 tokens' block scales d, their d * sum(q), and
 * sum(q) as int32:
 *   xs8[(G * nb + b) * KV_X8F + t], ... + 8 + t, ((int32_t *)...)[16 + t]
 * tile8: y[t * ldy + r] for r < nr, t < nt: ceil(nt / 8) consecutive
 * groups, xi / xs8 / y pointing at the first one. */
#define KV_X8F 24
typedef void (*kv_tile8_fn)(int64_t K, const uint8_t *W, size_t wstride, int nr,
                            const uint8_t *xi, const float *xs8, int nt, float *y, int64_t ldy);

typedef struct {
    kv_dot_fn dot[64];   /* by weight type */
    kv_tile_fn tile[64]; /* by weight type */
    kv_tile8_fn tile8[64]; /* by weight type, NULL if none */
    kv_quant_fn quant[64]; /* by activation type */
    /* Blocks [b0, b1) of an 8-token group straight into the interleaved
     * layout (xi, xs8 at the group's start): tokens t < nt from x + t * ldx,
     * quantized as Q8_0 / Q8_1 quantize them; the others zeros. NULL: none. */
    void (*quant_x8)(const float *x, int64_t ldx, int nt, int64_t b0, int64_t b1, uint8_t *xi, float *xs8);
    int tile_rows, tile_toks; /* preferred tile shape (rows x tokens) */
    void (*f16_to_f32_row)(const uint16_t *src, float *dst, int64_t n);
    void (*f32_to_f16_row)(const float *src, uint16_t *dst, int64_t n);
} kv_kernels;

/* Fills in the entries this CPU can run faster; returns 1 if it did. */
int kv_kernels_avx2(kv_kernels *k);
/* The same kernels through AVX512-VNNI (quant_vnni.c); 0 when the CPU lacks it. */
int kv_kernels_vnni(kv_kernels *k);

/* The table in use (after KVLUA_SIMD and CPU detection); for tests. */
const kv_kernels *kv_kernels_get(void);

#endif
