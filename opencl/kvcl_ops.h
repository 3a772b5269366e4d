/*
 * kvcl_ops.h — every op of the forward pass (engine/backend.h) on OpenCL
 * buffers. Each call queues kernels and returns; nothing waits until a
 * read (kvcl_read), kvcl_all_finite or kvcl_finish. Shapes as in backend.h:
 * activations are row-major float (T, n) views (kvcl_view).
 *
 * Numerics follow the engine's scalar CPU path, which the tests compare
 * every kernel with (tests/test_opencl.c): weights are dequantized
 * bit-identically, elementwise ops repeat the CPU's float operations, and
 * the one deliberate difference is that matrix products multiply float
 * activations (the CPU quantizes them to 8 bits first).
 *
 * K/V pages (kvcl_pages): positions grouped in pages of pt tokens (a power
 * of two); tab[pos / pt] = page id (int32); in one layer's K buffer, head h,
 * page p, token t is row ((h * max_pages + p) * pt + t) of
 * kvcl_kv_row_bytes(ktype, head_dim) bytes (F16, F32 or Q8_0); V likewise.
 */
#ifndef KVCL_OPS_H
#define KVCL_OPS_H

#include "backend.h"
#include "kvcl.h"

#ifdef KV_HAVE_OPENCL

/* ---- weights ---- */

/* A weight matrix on the device, rows of `cols` elements of `type` as in
 * the GGUF, or packed (where the integer kernels take the type: each
 * row's blocks in groups of 8, kernels/blocks.cl); split into parts of
 * whole rows past the largest allocation. */
typedef struct {
    kvcl_buf *buf;
    int type;
    int64_t rows, cols;
    size_t row_bytes;
    bool packed;
} kvcl_weight;

/* True for the types the kernels read: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1
 * Q8_0 Q4_K Q5_K Q6_K. */
bool kvcl_type_supported(int type);
kv_status kvcl_weight_upload(kvcl_ctx *c, int type, int64_t rows, int64_t cols, const void *data, kvcl_weight *w,
                             kv_error *e);
void kvcl_weight_free(kvcl_weight *w); /* zeroes *w; a zeroed weight is fine */

/* ---- matrix products ----
 * y(T, w.rows) [row stride ldy] = x(T, w.cols) . w^T (+ bias(w.rows), NULL: none).
 * AUTO: the decode GEMV for T = 1, else the context's prefill choice. */
enum { KVCL_MM_AUTO = 0, KVCL_MM_GEMV, KVCL_MM_TILED, KVCL_MM_CLBLAST };

kv_status kvcl_matmul(kvcl_ctx *c, const kvcl_weight *w, kvcl_buf *bias, kvcl_view x, int64_t T, kvcl_view y,
                      int64_t ldy, kv_error *e);
kv_status kvcl_matmul_with(kvcl_ctx *c, int path, const kvcl_weight *w, kvcl_buf *bias, kvcl_view x, int64_t T,
                           kvcl_view y, int64_t ldy, kv_error *e);
/* y[i] = x . w[i]^T (+ bias[i]) for n <= 3 weights of the same width, y[i]
 * row stride w[i].rows, each the bits kvcl_matmul gives it: one launch
 * when T = 1, the row GEMV is the device's and the weights share a type
 * and are single buffers (q, k, v; gate, up), else one product each. */
kv_status kvcl_matmul_n(kvcl_ctx *c, int n, const kvcl_weight *const *w, kvcl_buf *const *bias, kvcl_view x,
                        int64_t T, const kvcl_view *y, kv_error *e);
/* g(T, n) = x . wg^T, u = x . wu^T, then g = act(g) * u: kvcl_matmul_n
 * then kvcl_ffn_act, their bits (the gate and up projections). One launch
 * for a token on an integer-kernel device, else those two. */
kv_status kvcl_matmul_act(kvcl_ctx *c, const kvcl_weight *wg, const kvcl_weight *wu, kvcl_view x, int64_t T,
                          kvcl_view g, kvcl_view u, int act, kv_error *e);
/* y(T, w.rows) = x . w^T, then r += y and y = rmsnorm(r) * nw (nw NULL:
 * no weight): kvcl_matmul then kvcl_add_rmsnorm, their bits. One launch
 * for a token on an integer-kernel device (the last work-group to finish
 * its rows adds and norms), else those two. */
kv_status kvcl_matmul_add_rmsnorm(kvcl_ctx *c, const kvcl_weight *w, kvcl_view x, int64_t T, kvcl_view r,
                                  kvcl_view y, kvcl_buf *nw, float eps, kv_error *e);
/* True when this build has CLBlast. */
bool kvcl_have_clblast(void);

/* Times the tiled kernel and CLBlast once on a (rows x cols, type) weight
 * and T tokens, makes the faster one the context's prefill path, and keeps
 * the choice in the cache directory (a later call with the same device and
 * shape reads it back: *measured false). gflops (may be NULL): {tiled,
 * clblast}, 0 when not measured now or unavailable. For benchmarks: the
 * session backend takes TILED (exact) unless KVLUA_CL_PREFILL=clblast. */
kv_status kvcl_prefill_choose(kvcl_ctx *c, int type, int64_t rows, int64_t cols, int64_t T, bool *measured,
                              double gflops[2], kv_error *e);
int kvcl_prefill_path(const kvcl_ctx *c); /* KVCL_MM_TILED or KVCL_MM_CLBLAST */

/* ---- elementwise ---- */

/* y(T, n) = x / rms(x) * w (w NULL: no weight); y may be x. */
kv_status kvcl_rmsnorm(kvcl_ctx *c, kvcl_view y, kvcl_view x, kvcl_buf *w, int64_t T, int64_t n, float eps,
                       kv_error *e);
/* x(T, n) += a, then y = x / rms(x) * w in one launch: the bits of
 * kvcl_add and kvcl_rmsnorm; y may be a (not x). */
kv_status kvcl_add_rmsnorm(kvcl_ctx *c, kvcl_view x, kvcl_view a, kvcl_view y, kvcl_buf *w, int64_t T, int64_t n,
                           float eps, kv_error *e);
/* x(T, n_head, head_dim) rotated in place at positions pos(T) (int32
 * buffer); rp->freq_factors is ignored: factors (n_rot / 2 floats) or NULL. */
kv_status kvcl_rope(kvcl_ctx *c, kvcl_view x, int64_t T, int n_head, int head_dim, kvcl_buf *pos,
                    const kv_rope_params *rp, kvcl_buf *factors, kv_error *e);
/* rope of a layer's q (T, n_head, head_dim) and k (T, n_kv, head_dim), then
 * q *= q_scale and both checked finite into the all_finite flag (reset it
 * first with kvcl_finite_reset): one launch for rope, rope, scale and two
 * finite checks, the same values. */
kv_status kvcl_rope_qk(kvcl_ctx *c, kvcl_view q, kvcl_view k, int64_t T, int n_head, int n_kv, int head_dim,
                       kvcl_buf *pos, const kv_rope_params *rp, kvcl_buf *factors, float q_scale, kv_error *e);
/* kvcl_rope_qk, then the rotated k and v(T, n_kv, head_dim_v) into the
 * pages at positions pos0 .. pos0 + T - 1 (F16 or F32 pages; else
 * KV_ERR_UNSUPPORTED, nothing queued): kvcl_kv_store's rows, in the
 * same launch. */
struct kvcl_pages_s;
kv_status kvcl_rope_qk_store(kvcl_ctx *c, kvcl_view q, kvcl_view k, kvcl_view v, int64_t T, int n_head, int n_kv,
                             int head_dim, kvcl_buf *pos, const kv_rope_params *rp, kvcl_buf *factors, float q_scale,
                             const struct kvcl_pages_s *pg, int pos0, kv_error *e);
kv_status kvcl_add(kvcl_ctx *c, kvcl_view y, kvcl_view x, int64_t n, kv_error *e);   /* y += x */
kv_status kvcl_scale(kvcl_ctx *c, kvcl_view x, int64_t n, float s, kv_error *e);     /* x *= s */
kv_status kvcl_softcap(kvcl_ctx *c, kvcl_view x, int64_t n, float cap, kv_error *e); /* cap tanh(x / cap) */
/* x(rows, n) = x H in place (kv_hadamard_rows, engine/quant.h) */
kv_status kvcl_hadamard(kvcl_ctx *c, kvcl_view x, int64_t rows, int64_t n, kv_error *e);
/* gate(T, n) = act(gate) * up(T, n), act KV_ACT_SILU or KV_ACT_GELU_TANH */
kv_status kvcl_ffn_act(kvcl_ctx *c, kvcl_view gate, kvcl_view up, int64_t T, int64_t n, int act, kv_error *e);
/* *ok = every x(n) finite. Waits. */
kv_status kvcl_all_finite(kvcl_ctx *c, kvcl_view x, int64_t n, bool *ok, kv_error *e);
/* The same in parts, so several checks share one wait: reset the
 * context's flag, queue checks of views (each clears the flag on a
 * non-finite value), then read it (waits): *ok = all were finite. */
kv_status kvcl_finite_reset(kvcl_ctx *c, kv_error *e);
kv_status kvcl_finite_check(kvcl_ctx *c, kvcl_view x, int64_t n, kv_error *e);
kv_status kvcl_finite_read(kvcl_ctx *c, bool *ok, kv_error *e);
/* out(T, emb.cols) = rows ids(T) (int32 buffer) of the table, dequantized.
 * ids must be < emb.rows (the caller checks them: an id out of range
 * leaves its output row unwritten). */
kv_status kvcl_embed(kvcl_ctx *c, const kvcl_weight *emb, kvcl_buf *ids, int64_t T, kvcl_view out, kv_error *e);

/* ---- K/V pages and attention ---- */

typedef struct kvcl_pages_s {
    kvcl_buf *k, *v;   /* one layer's K and V rows */
    kvcl_buf *tab;     /* int32 page ids: tab[pos / pt] */
    int pt;            /* tokens per page, a power of two */
    int max_pages;     /* pages per head in k and v */
    int ktype, vtype;  /* KV_TYPE_F16, F32 or Q8_0 */
    int n_head_kv, head_dim, head_dim_v;
} kvcl_pages;

/* Checks that the pages hold positions below end (types, sizes, table). */
kv_status kvcl_pages_check(const kvcl_pages *pg, int64_t end, const char *what, kv_error *e);

/* Bytes of one stored row (0: type unusable for K/V with n; n must be a
 * multiple of 16, of 32 for Q8_0). */
size_t kvcl_kv_row_bytes(int type, int n);
/* k(T, n_head_kv, head_dim) and v(T, n_head_kv, head_dim_v) into positions
 * pos0 .. pos0 + T - 1 (their pages must be in the table, and the table's
 * ids below max_pages: the kernels do not check them). */
kv_status kvcl_kv_store(kvcl_ctx *c, const kvcl_pages *pg, int pos0, int64_t T, kvcl_view k, kvcl_view v,
                        kv_error *e);
/* out(T, n_head, head_dim_v) = softmax(q k^T * scale, causal + window) v for
 * q(T, n_head, head_dim) at positions pos0 .. pos0 + T - 1 (ap->layer is
 * not used: pg is the layer). head sizes <= 256. */
kv_status kvcl_attention(kvcl_ctx *c, const kvcl_pages *pg, const kv_attn_params *ap, kvcl_view q, int64_t T,
                         int pos0, kvcl_view out, kv_error *e);

#endif /* KV_HAVE_OPENCL */
#endif
