/*
 * kvcl_matmul.c — weights on the device and the matrix products over them
 * (matmul.cl), three ways:
 *
 *   GEMV     gemv_<type> / gemv_wg_<type>: one pass over the weight per
 *            token; the decode path (T = 1).
 *   TILED    tiled_<type>: each weight block decoded once for 4 tokens (two
 *            rows an item) or, K-quants, 8 tokens (one row).
 *   CLBLAST  tiles of rows dequantized to float (deq_<type>) into scratch,
 *            then CLBlast's SGEMM; F32 weights go to SGEMM directly.
 *
 * Prefill (T > 1) takes the context's path: TILED, which gives a token
 * the GEMV's bits, unless the backend was asked for CLBLAST
 * (kvcl_prefill_choose measures both, for benchmarks). Where the
 * program's integer kernels compute (x86 CPU drivers: c->int_dot), Q4_0,
 * Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K take them for GEMV and TILED instead (their rows packed at upload: kvcl_weight.packed):
 * x quantized per 32 into scratch (quant_x), then
 * gemv_i8 / gemv3_i8 / tiled_i8 (matmul_i8.cl). Weights split over several buffer parts are handled
 * part by part: each launch covers the part's rows, writing the outputs of
 * rows row0 .. row0 + rows - 1.
 *
 * Fewer launches a decoded token, on those devices: the kernels that write
 * a product's input (rmsnorm, ffn_act, attention, and the two below) write
 * its records too (kvcl_xq_target; the product takes them instead of
 * quant_x while no launch or write came between), kvcl_matmul_act runs
 * the gate and up products with the activation, and
 * kvcl_matmul_add_rmsnorm a product with the residual add and the next
 * norm; each gives the bits of the ops it replaces.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvcl_internal.h"
#include "kvcl_ops.h"
#include "quant.h"

#ifdef KV_HAVE_CLBLAST
#include <clblast_c.h>
#endif

#define GEMV_ROWS 32       /* rows per work-group of gemv_<type> and tiled_<type> */
#define GEMV_GROUP 64      /* = GEMV_GROUP in matmul.cl */
#define MM_TOKENS 8        /* = MM_TOKENS in matmul.cl */
#define MM_PAIR_TOKENS 4   /* = MM_PAIR_TOKENS in matmul.cl */
#define DEQ_TILE (64 << 20) /* bytes of float weights per CLBlast tile at most */

/* ==== weights =================================================================== */

#define I8_GROUP 8 /* = I8_GROUP in blocks.cl: blocks a group of the records and packed rows */
#define I8_RECORD 40 /* = I8_RECORD in blocks.cl: bytes of a token's quantized x per block */

/* blocks of a token's record: cols / 32 rounded up to I8_GROUP */
static int64_t i8_blocks(int64_t cols) { return (cols / 32 + I8_GROUP - 1) / I8_GROUP * I8_GROUP; }

/* whether products with weights of this type and width take the *_i8
 * kernels (a token's record must fit one buffer) */
static bool i8_weight(const kvcl_ctx *c, int type, int64_t cols) {
    return c->int_dot && c->mm[type].gemv_i8 && (uint64_t)i8_blocks(cols) * I8_RECORD <= c->max_alloc;
}

/* A row of nb 32-element blocks (bs bytes each) in the integer kernels'
 * layout (blocks.cl): groups of 8 blocks (the last of nb % 8), each its
 * blocks' scales, mins, fifth-bit words, then their quants in 4-byte
 * words, block by block. */
static void pack_row(int type, const uint8_t *src, int64_t nb, uint8_t *dst) {
    const bool min = type == KV_TYPE_Q4_1 || type == KV_TYPE_Q5_1, five = type == KV_TYPE_Q5_0 || type == KV_TYPE_Q5_1;
    const size_t bs = kv_row_size(type, 32), sb = min ? 4 : 2, hb = five ? 4 : 0, words = (bs - sb - hb) / 4;
    for (int64_t g = 0; g < nb; g += I8_GROUP) {
        const size_t n = (size_t)(nb - g < I8_GROUP ? nb - g : I8_GROUP);
        const uint8_t *s = src + (size_t)g * bs;
        uint8_t *d = dst + (size_t)g * bs, *q = d + n * (sb + hb);
        for (size_t l = 0; l < n; l++) {
            const uint8_t *b = s + l * bs;
            memcpy(d + 2 * l, b, 2);
            if (min) memcpy(d + 2 * n + 2 * l, b + 2, 2);
            if (five) memcpy(d + sb * n + 4 * l, b + sb, 4);
            for (size_t v = 0; v < words; v++) memcpy(q + 4 * (n * v + l), b + sb + hb + 4 * v, 4);
        }
    }
}

/* A Q4_K / Q5_K row of ns super-blocks in the integer kernels' layout
 * (blocks.cl): per super-block d, dmin and the scales as they were, for
 * Q5_K a 32-bit word of fifth bits per sub-block, then the nibbles of each
 * sub-block as a Q4_0 block's (elements e and e + 16 in byte e), in 4-byte
 * words, sub-block by sub-block. */
static void pack_row_k(int type, const uint8_t *src, int64_t ns, uint8_t *dst) {
    const bool five = type == KV_TYPE_Q5_K;
    const size_t bs = five ? 176 : 144, qo = five ? 48 : 16;
    for (int64_t s = 0; s < ns; s++) {
        const uint8_t *b = src + (size_t)s * bs;
        uint8_t *o = dst + (size_t)s * bs;
        memcpy(o, b, 16);
        for (int l = 0; l < 8; l++) {
            if (five) { /* bit l of qh[e]: the fifth bit of element e of sub-block l */
                uint32_t wd = 0;
                for (int e = 0; e < 32; e++) wd |= (uint32_t)((b[16 + e] >> l) & 1) << e;
                for (int k = 0; k < 4; k++) o[16 + 4 * l + k] = (uint8_t)(wd >> 8 * k);
            }
            const uint8_t *qs = b + qo + 32 * (l / 2); /* sub-blocks 2 i, 2 i + 1: low, high nibbles */
            const int sh = 4 * (l % 2);
            for (int e = 0; e < 16; e++)
                o[qo + 32 * (e / 4) + 4 * l + e % 4] = (uint8_t)(((qs[e] >> sh) & 15) | ((qs[e + 16] >> sh) & 15) << 4);
        }
    }
}

/* rows of data packed (pack_row, pack_row_k) and written to b, some rows at a time */
static kv_status write_packed(kvcl_ctx *c, int type, int64_t rows, int64_t cols, const uint8_t *data, size_t rb,
                              kvcl_buf *b, kv_error *e) {
    const int64_t per = (int64_t)((4u << 20) / rb) + 1;
    uint8_t *tmp = malloc((size_t)(per < rows ? per : rows) * rb);
    if (!tmp) return kv_fail(e, KV_ERR_NOMEM, "out of memory");
    kv_status st = KV_OK;
    for (int64_t r = 0; r < rows && st == KV_OK; r += per) {
        const int64_t n = rows - r < per ? rows - r : per;
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *src = data + (size_t)(r + i) * rb;
            if (type == KV_TYPE_Q4_K || type == KV_TYPE_Q5_K) pack_row_k(type, src, cols / 256, tmp + (size_t)i * rb);
            else pack_row(type, src, cols / 32, tmp + (size_t)i * rb);
        }
        st = kvcl_write(c, b, (size_t)r * rb, tmp, (size_t)n * rb, e);
    }
    free(tmp);
    return st;
}

bool kvcl_type_supported(int type) {
    switch (type) {
    case KV_TYPE_F32: case KV_TYPE_F16: case KV_TYPE_BF16: case KV_TYPE_Q4_0: case KV_TYPE_Q4_1:
    case KV_TYPE_Q5_0: case KV_TYPE_Q5_1: case KV_TYPE_Q8_0: case KV_TYPE_Q4_K: case KV_TYPE_Q5_K:
    case KV_TYPE_Q6_K:
        return true;
    }
    return false;
}

kv_status kvcl_weight_upload(kvcl_ctx *c, int type, int64_t rows, int64_t cols, const void *data, kvcl_weight *w,
                             kv_error *e) {
    memset(w, 0, sizeof *w);
    const kv_type_traits *tr = kv_type_traits_get(type);
    if (!kvcl_type_supported(type))
        return kv_fail(e, KV_ERR_UNSUPPORTED, "OpenCL: weight type %s not supported", tr ? tr->name : "?");
    size_t rb = kv_row_size(type, cols);
    if (rows <= 0 || rows > INT32_MAX || cols > INT32_MAX || rb == 0)
        return kv_fail(e, KV_ERR_ARG, "OpenCL weight (%lld x %lld) of %s: bad shape", (long long)rows,
                       (long long)cols, tr->name);
    if ((size_t)rows > SIZE_MAX / rb) return kv_fail(e, KV_ERR_ARG, "OpenCL weight: size overflows");
    kvcl_buf *b;
    kv_status st = kvcl_buf_create(c, rb * (size_t)rows, rb, &b, e);
    if (st != KV_OK) return st;
    const bool packed = i8_weight(c, type, cols);
    st = packed ? write_packed(c, type, rows, cols, data, rb, b, e) : kvcl_write(c, b, 0, data, rb * (size_t)rows, e);
    if (st != KV_OK) {
        kvcl_buf_free(b);
        return st;
    }
    *w = (kvcl_weight){b, type, rows, cols, rb, packed};
    return KV_OK;
}

void kvcl_weight_free(kvcl_weight *w) {
    kvcl_buf_free(w->buf);
    memset(w, 0, sizeof *w);
}

/* ==== the three paths =========================================================== */

/* what every launch of one product shares */
typedef struct {
    kvcl_ctx *c;
    const kvcl_weight *w;
    cl_mem bias, x, y;
    size_t xoff, yoff;
    int64_t T, ldy;
    cl_mem rec; /* x's records (all T tokens), or NULL */
} mm_call;

/* rows in part p and the global index of its first row */
static int64_t part_rows(const mm_call *m, int p, int64_t *row0) {
    const kvcl_buf *b = m->w->buf;
    const int64_t per = (int64_t)(b->part_bytes / m->w->row_bytes);
    *row0 = p * per;
    return p + 1 < b->n_parts ? per : m->w->rows - *row0;
}

/* the arguments of gemv_* / gemv_wg_* / tiled_* for part p */
static kvcl_launch gemv_args(const mm_call *m, cl_kernel k, int p, int64_t rows, int64_t row0) {
    kvcl_launch L = kvcl_launch_begin(m->c, k);
    kvcl_arg_mem(&L, m->w->buf->parts[p]), kvcl_arg_ulong(&L, m->w->row_bytes);
    kvcl_arg_int(&L, (int)rows), kvcl_arg_int(&L, (int)m->w->cols);
    kvcl_arg_mem(&L, m->x), kvcl_arg_ulong(&L, m->xoff);
    kvcl_arg_mem(&L, m->y), kvcl_arg_ulong(&L, m->yoff), kvcl_arg_int(&L, (int)m->ldy);
    kvcl_arg_mem(&L, m->bias), kvcl_arg_int(&L, (int)row0);
    return L;
}

static kv_status mm_gemv(const mm_call *m, kv_error *e) {
    const kvcl_type_kernels *k = &m->c->mm[m->w->type];
    const bool group = m->c->gemv == KVCL_GEMV_GROUP;
    for (int p = 0; p < m->w->buf->n_parts; p++) {
        int64_t row0, rows = part_rows(m, p, &row0);
        kvcl_launch L = gemv_args(m, group ? k->gemv_wg : k->gemv, p, rows, row0);
        size_t g[2], l[2] = {group ? GEMV_GROUP : GEMV_ROWS, 1};
        g[0] = group ? (size_t)rows * GEMV_GROUP : kvcl_round_up((size_t)rows, GEMV_ROWS);
        g[1] = (size_t)m->T;
        if (kvcl_launch_run(&L, 2, g, l, "gemv", e) != KV_OK) return m->c->failed;
    }
    return KV_OK;
}

/* whether tiled_<type> takes two rows an item (MM_PAIR_TOKENS tokens): the
 * formats of 32-element blocks (block_elems in blocks.cl) */
static bool tiled_pairs(int type) {
    return type != KV_TYPE_Q4_K && type != KV_TYPE_Q5_K && type != KV_TYPE_Q6_K;
}

static kv_status mm_tiled(const mm_call *m, kv_error *e) {
    for (int p = 0; p < m->w->buf->n_parts; p++) {
        int64_t row0, rows = part_rows(m, p, &row0);
        kvcl_launch L = gemv_args(m, m->c->mm[m->w->type].tiled, p, rows, row0);
        kvcl_arg_int(&L, (int)m->T);
        const bool pair = tiled_pairs(m->w->type);
        const size_t items = pair ? (size_t)(rows + 1) / 2 : (size_t)rows, tokens = pair ? MM_PAIR_TOKENS : MM_TOKENS;
        size_t g[2] = {kvcl_round_up(items, GEMV_ROWS), (size_t)(m->T + tokens - 1) / tokens};
        size_t l[2] = {GEMV_ROWS, 1};
        if (kvcl_launch_run(&L, 2, g, l, "tiled matmul", e) != KV_OK) return m->c->failed;
    }
    return KV_OK;
}

bool kvcl_have_clblast(void) {
#ifdef KV_HAVE_CLBLAST
    return true;
#else
    return false;
#endif
}

#ifdef KV_HAVE_CLBLAST
/* y[:, row0 ..] (T, n) = x (T, K) . B(n, K)^T, B at element offset boff */
static kv_status sgemm(const mm_call *m, cl_mem B, size_t boff, int64_t n, int64_t row0, kv_error *e) {
    const size_t K = (size_t)m->w->cols;
    CLBlastStatusCode st = CLBlastSgemm(CLBlastLayoutRowMajor, CLBlastTransposeNo, CLBlastTransposeYes, (size_t)m->T,
                                        (size_t)n, K, 1.0f, m->x, m->xoff, K, B, boff, K, 0.0f, m->y,
                                        m->yoff + (size_t)row0, (size_t)m->ldy, &m->c->q, NULL);
    return st == CLBlastSuccess ? KV_OK : kvcl_mark_failed(m->c, e, st, "CLBlast SGEMM");
}

/* rows [r, r + n) of part p to float, tile(n, K) */
static kv_status dequant_tile(const mm_call *m, int p, int64_t r, int64_t n, cl_mem tile, kv_error *e) {
    const int64_t K = m->w->cols;
    kvcl_launch L = kvcl_launch_begin(m->c, m->c->mm[m->w->type].deq);
    kvcl_arg_mem(&L, m->w->buf->parts[p]), kvcl_arg_ulong(&L, m->w->row_bytes);
    kvcl_arg_int(&L, (int)(r + n)), kvcl_arg_int(&L, (int)K);
    kvcl_arg_mem(&L, NULL), kvcl_arg_int(&L, 0), kvcl_arg_int(&L, (int)r);
    kvcl_arg_mem(&L, tile), kvcl_arg_ulong(&L, 0), kvcl_arg_int(&L, (int)K), kvcl_arg_int(&L, m->w->packed);
    size_t g[2] = {kvcl_round_up(kvcl_deq_items(m->w->type, K), 16), (size_t)n}, l[2] = {16, 1};
    return kvcl_launch_run(&L, 2, g, l, "dequantize", e);
}

static kv_status add_bias(const mm_call *m, kv_error *e) {
    kvcl_launch L = kvcl_launch_begin(m->c, m->c->add_bias);
    kvcl_arg_mem(&L, m->y), kvcl_arg_ulong(&L, m->yoff), kvcl_arg_int(&L, (int)m->ldy);
    kvcl_arg_int(&L, (int)m->w->rows), kvcl_arg_mem(&L, m->bias);
    size_t g[2] = {kvcl_round_up((size_t)m->w->rows, 64), (size_t)m->T}, l[2] = {64, 1};
    return kvcl_launch_run(&L, 2, g, l, "bias", e);
}

static kv_status mm_clblast(const mm_call *m, kv_error *e) {
    const int64_t K = m->w->cols;
    for (int p = 0; p < m->w->buf->n_parts; p++) {
        int64_t row0, rows = part_rows(m, p, &row0);
        if (m->w->type == KV_TYPE_F32) {
            if (sgemm(m, m->w->buf->parts[p], 0, rows, row0, e) != KV_OK) return KV_ERR_DEVICE;
            continue;
        }
        const uint64_t cap = DEQ_TILE < m->c->max_alloc ? DEQ_TILE : m->c->max_alloc;
        int64_t tile_rows = (int64_t)(cap / ((uint64_t)K * sizeof(float)));
        if (tile_rows < 1) tile_rows = 1;
        if (tile_rows > rows) tile_rows = rows;
        cl_mem tile;
        kv_status st = kvcl_scratch(m->c, (size_t)(tile_rows * K) * sizeof(float), &tile, e);
        if (st != KV_OK) return st;
        for (int64_t r = 0; r < rows; r += tile_rows) {
            const int64_t n = rows - r < tile_rows ? rows - r : tile_rows;
            if (dequant_tile(m, p, r, n, tile, e) != KV_OK) return KV_ERR_DEVICE;
            if (sgemm(m, tile, 0, n, row0 + r, e) != KV_OK) return KV_ERR_DEVICE;
        }
    }
    return m->bias ? add_bias(m, e) : KV_OK;
}
#else
static kv_status mm_clblast(const mm_call *m, kv_error *e) {
    (void)m;
    return kv_fail(e, KV_ERR_UNSUPPORTED, "OpenCL: built without CLBlast");
}
#endif

/* ==== integer dot products (matmul_i8.cl) ======================================= */

/* whether products with w take the *_i8 kernels: its rows were packed for them at upload */
static bool int_path(const kvcl_weight *w) { return w->packed; }

#define XREC_MAX (64u << 20) /* bytes of one width's records at most */

cl_mem kvcl_xq_target(kvcl_ctx *c, int64_t cols, int64_t T, cl_mem avoid, int *nbx) {
    if (!c->int_dot || cols <= 0 || cols % 32 || cols > INT32_MAX || T <= 0 || T > INT32_MAX) return NULL;
    const uint64_t bytes = (uint64_t)T * (uint64_t)i8_blocks(cols) * I8_RECORD;
    if (bytes > XREC_MAX || bytes > c->max_alloc) return NULL;
    *nbx = (int)i8_blocks(cols);
    int i = 0;
    while (i < KVCL_XREC_SLOTS && !(c->xrec[i].m && c->xrec[i].cols == cols && c->xrec[i].m != avoid)) i++;
    if (i == KVCL_XREC_SLOTS) { /* a slot of its own: the next in turn, never the one the launch reads */
        i = c->xrec_next;
        if (avoid && c->xrec[i].m == avoid) i = (i + 1) % KVCL_XREC_SLOTS;
        c->xrec_next = (i + 1) % KVCL_XREC_SLOTS;
    } else if (c->xrec[i].bytes >= bytes) {
        return c->xrec[i].m;
    }
    /* a new buffer for this width, its blocks all zero (the kernels write only blocks < cols / 32) */
    if (c->xrec[i].m) clReleaseMemObject(c->xrec[i].m); /* freed once queued commands are done with it */
    c->in_use -= c->xrec[i].bytes;
    c->xrec[i].m = NULL, c->xrec[i].bytes = 0;
    if (bytes > c->info.memory - c->in_use) return NULL;
    cl_int err;
    cl_mem m = clCreateBuffer(c->ctx, CL_MEM_READ_WRITE, bytes, NULL, &err);
    if (err != CL_SUCCESS) return NULL;
    static const cl_char zero = 0;
    if (clEnqueueFillBuffer(c->q, m, &zero, 1, 0, bytes, 0, NULL, NULL) != CL_SUCCESS) {
        clReleaseMemObject(m);
        return NULL;
    }
    c->xrec[i].m = m, c->xrec[i].bytes = bytes, c->xrec[i].cols = cols;
    c->in_use += bytes;
    return m;
}

void kvcl_xq_set(kvcl_ctx *c, cl_mem x, size_t off, int64_t cols, int64_t T, cl_mem rec) {
    c->xq.x = x, c->xq.off = off, c->xq.cols = cols, c->xq.T = T, c->xq.rec = rec;
}

/* the records of x(T, cols) at (xm, off) if the last launch wrote them
 * (then forgotten: the next launch would clear them anyway) */
static cl_mem xq_take(kvcl_ctx *c, kvcl_view x, int64_t cols, int64_t T) {
    cl_mem rec = c->xq.rec;
    c->xq.rec = NULL;
    const cl_mem xm = x.buf && x.buf->n_parts == 1 ? x.buf->parts[0] : NULL;
    return rec && xm && c->xq.x == xm && c->xq.off == x.off && c->xq.cols == cols && c->xq.T == T ? rec : NULL;
}

/* tokens [t, t + n) of x (cols wide, at xm + xoff) quantized into the scratch buffer (*xr) */
static kv_status quantize_x(kvcl_ctx *c, cl_mem xm, size_t xoff, int64_t cols, int64_t n, cl_mem *xr,
                            kv_error *e) {
    const int64_t nbx = i8_blocks(cols);
    kv_status st = kvcl_scratch(c, (size_t)(n * nbx * I8_RECORD), xr, e);
    if (st != KV_OK) return st;
    kvcl_launch L = kvcl_launch_begin(c, c->quant_x);
    kvcl_arg_mem(&L, xm), kvcl_arg_ulong(&L, xoff), kvcl_arg_int(&L, (int)cols);
    kvcl_arg_mem(&L, *xr), kvcl_arg_int(&L, (int)nbx);
    size_t g[2] = {(size_t)nbx / 2, (size_t)n}, l[2] = {I8_GROUP / 2, 1};
    return kvcl_launch_run(&L, 2, g, l, "quantize x", e);
}

/* one token's records of x (cols wide, at xm + xoff): *xr if a kernel
 * wrote them with x (xq_take), else quantized into the scratch buffer now */
static kv_status token_records(kvcl_ctx *c, cl_mem xm, size_t xoff, int64_t cols, cl_mem *xr, kv_error *e) {
    return *xr ? KV_OK : quantize_x(c, xm, xoff, cols, 1, xr, e);
}

/* GEMV (one item per row and token) or tiled (MM_TOKENS tokens an item)
 * through the integer kernels: x's records from the kernel that wrote x
 * (m->rec), or quantized here, as many tokens at a time as the scratch
 * buffer holds */
static kv_status mm_i8(const mm_call *m, bool tiled, kv_error *e) {
    kvcl_ctx *c = m->c;
    const int64_t cols = m->w->cols, nbx = i8_blocks(cols);
    int64_t per = m->rec ? m->T : (int64_t)(c->max_alloc / ((uint64_t)nbx * I8_RECORD));
    if (per > m->T) per = m->T;
    for (int64_t t = 0; t < m->T; t += per) {
        const int64_t n = m->T - t < per ? m->T - t : per;
        cl_mem xr = m->rec;
        kv_status st = xr ? KV_OK : quantize_x(c, m->x, m->xoff + (size_t)(t * cols), cols, n, &xr, e);
        if (st != KV_OK) return st;
        for (int p = 0; p < m->w->buf->n_parts; p++) {
            int64_t row0, rows = part_rows(m, p, &row0);
            const kvcl_type_kernels *k = &c->mm[m->w->type];
            kvcl_launch L = kvcl_launch_begin(c, tiled ? k->tiled_i8 : k->gemv_i8);
            kvcl_arg_mem(&L, m->w->buf->parts[p]), kvcl_arg_ulong(&L, m->w->row_bytes);
            kvcl_arg_int(&L, (int)rows), kvcl_arg_int(&L, (int)cols);
            kvcl_arg_mem(&L, xr), kvcl_arg_int(&L, (int)nbx);
            kvcl_arg_mem(&L, m->y), kvcl_arg_ulong(&L, m->yoff + (size_t)(t * m->ldy)), kvcl_arg_int(&L, (int)m->ldy);
            kvcl_arg_mem(&L, m->bias), kvcl_arg_int(&L, (int)row0);
            if (tiled) kvcl_arg_int(&L, (int)n);
            size_t g[2] = {kvcl_round_up((size_t)rows, GEMV_ROWS), tiled ? (size_t)(n + MM_TOKENS - 1) / MM_TOKENS : (size_t)n};
            size_t l[2] = {GEMV_ROWS, 1};
            if (kvcl_launch_run(&L, 2, g, l, tiled ? "tiled matmul" : "gemv", e) != KV_OK) return c->failed;
        }
    }
    return KV_OK;
}

/* ==== entry points ================================================================ */

/* kvcl_matmul_with, x's records rec (or NULL) given */
static kv_status matmul_rec(kvcl_ctx *c, int path, const kvcl_weight *w, kvcl_buf *bias, kvcl_view x, int64_t T,
                            kvcl_view y, int64_t ldy, cl_mem rec, kv_error *e) {
    if (!w->buf || !kvcl_type_supported(w->type)) return kv_fail(e, KV_ERR_ARG, "matmul: no weight");
    if (T <= 0 || T > INT32_MAX || ldy < w->rows || ldy > INT32_MAX)
        return kv_fail(e, KV_ERR_ARG, "matmul: T %lld, ldy %lld for %lld rows", (long long)T, (long long)ldy,
                       (long long)w->rows);
    mm_call m = {c, w, NULL, NULL, NULL, x.off, y.off, T, ldy, NULL};
    if (kvcl_view_mem(x, (size_t)(T * w->cols), "matmul x", &m.x, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(y, (size_t)((T - 1) * ldy + w->rows), "matmul y", &m.y, e) != KV_OK) return KV_ERR_ARG;
    if (bias && kvcl_view_mem(kvcl_at(bias, 0), (size_t)w->rows, "matmul bias", &m.bias, e) != KV_OK)
        return KV_ERR_ARG;
    if (path == KVCL_MM_AUTO) path = T == 1 ? KVCL_MM_GEMV : c->prefill;
    if (path != KVCL_MM_CLBLAST && int_path(w)) {
        m.rec = rec;
        return mm_i8(&m, path == KVCL_MM_TILED, e);
    }
    switch (path) {
    case KVCL_MM_GEMV: return mm_gemv(&m, e);
    case KVCL_MM_TILED: return mm_tiled(&m, e);
    case KVCL_MM_CLBLAST: return mm_clblast(&m, e);
    }
    return kv_fail(e, KV_ERR_ARG, "matmul: path %d", path);
}

kv_status kvcl_matmul_with(kvcl_ctx *c, int path, const kvcl_weight *w, kvcl_buf *bias, kvcl_view x, int64_t T,
                           kvcl_view y, int64_t ldy, kv_error *e) {
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    return matmul_rec(c, path, w, bias, x, T, y, ldy, xq_take(c, x, w->cols, T), e);
}

kv_status kvcl_matmul(kvcl_ctx *c, const kvcl_weight *w, kvcl_buf *bias, kvcl_view x, int64_t T, kvcl_view y,
                      int64_t ldy, kv_error *e) {
    return kvcl_matmul_with(c, KVCL_MM_AUTO, w, bias, x, T, y, ldy, e);
}

kv_status kvcl_matmul_n(kvcl_ctx *c, int n, const kvcl_weight *const *w, kvcl_buf *const *bias, kvcl_view x,
                        int64_t T, const kvcl_view *y, kv_error *e) {
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    if (n < 1) return KV_OK;
    cl_mem rec = xq_take(c, x, w[0]->cols, T); /* for every product: none writes x */
    bool one = n <= 3 && T == 1 && c->gemv == KVCL_GEMV_ROW;
    int64_t all = 0; /* the kernel's row index is an int */
    for (int i = 0; one && i < n; i++)
        one = w[i]->buf && kvcl_buf_parts(w[i]->buf) == 1 && w[i]->type == w[0]->type && w[i]->cols == w[0]->cols &&
              (all += w[i]->rows) <= INT32_MAX - GEMV_ROWS && c->mm[w[0]->type].gemv3;
    if (!one) {
        for (int i = 0; i < n; i++) {
            kv_status st = matmul_rec(c, KVCL_MM_AUTO, w[i], bias[i], x, T, y[i], w[i]->rows,
                                      w[i]->cols == w[0]->cols ? rec : NULL, e);
            if (st != KV_OK) return st;
        }
        return KV_OK;
    }
    cl_mem xm, ym[3] = {NULL, NULL, NULL}, bm[3] = {NULL, NULL, NULL};
    size_t yoff[3] = {0, 0, 0};
    int64_t rows[3] = {0, 0, 0}, total = 0;
    if (kvcl_view_mem(x, (size_t)w[0]->cols, "matmul x", &xm, e) != KV_OK) return KV_ERR_ARG;
    for (int i = 0; i < n; i++) {
        rows[i] = w[i]->rows, total += rows[i], yoff[i] = y[i].off;
        if (kvcl_view_mem(y[i], (size_t)rows[i], "matmul y", &ym[i], e) != KV_OK) return KV_ERR_ARG;
        if (bias[i] && kvcl_view_mem(kvcl_at(bias[i], 0), (size_t)rows[i], "matmul bias", &bm[i], e) != KV_OK)
            return KV_ERR_ARG;
    }
    const bool i8 = int_path(w[0]);
    kv_status st = i8 ? token_records(c, xm, x.off, w[0]->cols, &rec, e) : KV_OK;
    if (st != KV_OK) return st;
    kvcl_launch L = kvcl_launch_begin(c, i8 ? c->mm[w[0]->type].gemv3_i8 : c->mm[w[0]->type].gemv3);
    for (int i = 0; i < 3; i++) kvcl_arg_mem(&L, w[i < n ? i : 0]->buf->parts[0]);
    kvcl_arg_ulong(&L, w[0]->row_bytes);
    for (int i = 0; i < 3; i++) kvcl_arg_int(&L, (int)rows[i]);
    kvcl_arg_int(&L, (int)w[0]->cols);
    if (i8) kvcl_arg_mem(&L, rec), kvcl_arg_int(&L, (int)i8_blocks(w[0]->cols));
    else kvcl_arg_mem(&L, xm), kvcl_arg_ulong(&L, x.off);
    for (int i = 0; i < 3; i++) kvcl_arg_mem(&L, ym[i < n ? i : 0]), kvcl_arg_ulong(&L, yoff[i]);
    for (int i = 0; i < 3; i++) kvcl_arg_mem(&L, bm[i]);
    size_t g[1] = {kvcl_round_up((size_t)total, GEMV_ROWS)}, l[1] = {GEMV_ROWS};
    return kvcl_launch_run(&L, 1, g, l, "gemv3", e);
}

kv_status kvcl_matmul_add_rmsnorm(kvcl_ctx *c, const kvcl_weight *w, kvcl_view x, int64_t T, kvcl_view r,
                                  kvcl_view y, kvcl_buf *nw, float eps, kv_error *e) {
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    cl_mem rec = xq_take(c, x, w->cols, T);
    const bool one = T == 1 && w->buf && int_path(w) && w->buf->n_parts == 1 && w->rows <= INT32_MAX - GEMV_ROWS &&
                     c->mm[w->type].gemv_i8_norm;
    if (!one) {
        kv_status st = matmul_rec(c, KVCL_MM_AUTO, w, NULL, x, T, y, w->rows, rec, e);
        return st != KV_OK ? st : kvcl_add_rmsnorm(c, r, y, y, nw, T, w->rows, eps, e);
    }
    const int64_t n = w->rows;
    cl_mem xm, rm, ym, nm = NULL;
    if (kvcl_view_mem(x, (size_t)w->cols, "matmul x", &xm, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(r, (size_t)n, "residual", &rm, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(y, (size_t)n, "matmul y", &ym, e) != KV_OK) return KV_ERR_ARG;
    if (nw && kvcl_view_mem(kvcl_at(nw, 0), (size_t)n, "rmsnorm weight", &nm, e) != KV_OK) return KV_ERR_ARG;
    kv_status st = token_records(c, xm, x.off, w->cols, &rec, e);
    if (st != KV_OK) return st;
    int ynbx = 0;
    cl_mem yrec = kvcl_xq_target(c, n, 1, rec, &ynbx); /* the normed row's records for the next product */
    kvcl_launch L = kvcl_launch_begin(c, c->mm[w->type].gemv_i8_norm);
    kvcl_arg_mem(&L, w->buf->parts[0]), kvcl_arg_ulong(&L, w->row_bytes);
    kvcl_arg_int(&L, (int)n), kvcl_arg_int(&L, (int)w->cols);
    kvcl_arg_mem(&L, rec), kvcl_arg_int(&L, (int)i8_blocks(w->cols));
    kvcl_arg_mem(&L, ym), kvcl_arg_ulong(&L, y.off), kvcl_arg_int(&L, (int)n);
    kvcl_arg_mem(&L, NULL), kvcl_arg_int(&L, 0);
    kvcl_arg_mem(&L, rm), kvcl_arg_ulong(&L, r.off), kvcl_arg_mem(&L, nm), kvcl_arg_float(&L, eps);
    kvcl_arg_mem(&L, yrec), kvcl_arg_int(&L, ynbx), kvcl_arg_mem(&L, c->count);
    size_t g[1] = {kvcl_round_up((size_t)n, GEMV_ROWS)}, l[1] = {GEMV_ROWS};
    st = kvcl_launch_run(&L, 1, g, l, "gemv", e);
    if (st == KV_OK && yrec) kvcl_xq_set(c, ym, y.off, n, 1, yrec);
    return st;
}

kv_status kvcl_matmul_act(kvcl_ctx *c, const kvcl_weight *wg, const kvcl_weight *wu, kvcl_view x, int64_t T,
                          kvcl_view g, kvcl_view u, int act, kv_error *e) {
    if (kvcl_check(c, e) != KV_OK) return c->failed;
    const bool one = T == 1 && wg->buf && wu->buf && int_path(wg) && wg->type == wu->type && wg->rows == wu->rows &&
                     wg->cols == wu->cols && wg->buf->n_parts == 1 && wu->buf->n_parts == 1 &&
                     wg->rows <= INT32_MAX - GEMV_ROWS && c->mm[wg->type].gemv_act_i8 &&
                     (act == KV_ACT_SILU || act == KV_ACT_GELU_TANH);
    if (!one) {
        const kvcl_weight *w[2] = {wg, wu};
        kvcl_buf *bias[2] = {NULL, NULL};
        const kvcl_view y[2] = {g, u};
        kv_status st = kvcl_matmul_n(c, 2, w, bias, x, T, y, e);
        return st != KV_OK ? st : kvcl_ffn_act(c, g, u, T, wg->rows, act, e);
    }
    const int64_t n = wg->rows;
    cl_mem xm, gm, um, rec = xq_take(c, x, wg->cols, 1);
    if (kvcl_view_mem(x, (size_t)wg->cols, "matmul x", &xm, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(g, (size_t)n, "matmul y", &gm, e) != KV_OK) return KV_ERR_ARG;
    if (kvcl_view_mem(u, (size_t)n, "matmul y", &um, e) != KV_OK) return KV_ERR_ARG;
    kv_status st = token_records(c, xm, x.off, wg->cols, &rec, e);
    if (st != KV_OK) return st;
    int ynbx = 0;
    cl_mem yrec = kvcl_xq_target(c, n, 1, rec, &ynbx); /* the activations' records for the down product */
    kvcl_launch L = kvcl_launch_begin(c, c->mm[wg->type].gemv_act_i8);
    kvcl_arg_mem(&L, wg->buf->parts[0]), kvcl_arg_mem(&L, wu->buf->parts[0]), kvcl_arg_ulong(&L, wg->row_bytes);
    kvcl_arg_int(&L, (int)n), kvcl_arg_int(&L, (int)wg->cols);
    kvcl_arg_mem(&L, rec), kvcl_arg_int(&L, (int)i8_blocks(wg->cols));
    kvcl_arg_mem(&L, gm), kvcl_arg_ulong(&L, g.off), kvcl_arg_mem(&L, um), kvcl_arg_ulong(&L, u.off);
    kvcl_arg_int(&L, act), kvcl_arg_mem(&L, yrec), kvcl_arg_int(&L, ynbx);
    size_t gs[1] = {(size_t)(n + 31) / 32 * 64}, l[1] = {64}; /* 32 rows of each weight a group */
    st = kvcl_launch_run(&L, 1, gs, l, "gemv", e);
    if (st == KV_OK && yrec) kvcl_xq_set(c, gm, g.off, n, 1, yrec);
    return st;
}

/* ==== choosing the prefill path ===================================================== */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

/* GFLOP/s of one path: one run to warm up (kernel compilation), then runs
 * until 0.3 s have passed */
static kv_status time_path(kvcl_ctx *c, int path, const kvcl_weight *w, kvcl_buf *x, kvcl_buf *y, int64_t T,
                           double *gflops, kv_error *e) {
    kv_status st = kvcl_matmul_with(c, path, w, NULL, kvcl_at(x, 0), T, kvcl_at(y, 0), w->rows, e);
    if (st == KV_OK) st = kvcl_finish(c, e);
    int runs = 0;
    const double t0 = now();
    while (st == KV_OK && (runs == 0 || now() - t0 < 0.3)) {
        st = kvcl_matmul_with(c, path, w, NULL, kvcl_at(x, 0), T, kvcl_at(y, 0), w->rows, e);
        if (st == KV_OK) st = kvcl_finish(c, e);
        runs++;
    }
    if (st == KV_OK) *gflops = 2.0 * (double)w->rows * (double)w->cols * (double)T * runs / (now() - t0) * 1e-9;
    return st;
}

/* both paths on a random weight of the shape: {tiled, clblast} GFLOP/s */
static kv_status measure(kvcl_ctx *c, int type, int64_t rows, int64_t cols, int64_t T, double g[2], kv_error *e) {
    const size_t rb = kv_row_size(type, cols);
    float *f = malloc(sizeof(float) * (size_t)cols);
    uint8_t *wbytes = malloc(rb * (size_t)rows);
    float *xs = malloc(sizeof(float) * (size_t)(T * cols));
    kvcl_weight w = {0};
    kvcl_buf *x = NULL, *y = NULL;
    kv_status st = f && wbytes && xs ? KV_OK : kv_fail(e, KV_ERR_NOMEM, "out of memory");
    uint32_t s = 12345;
    for (int64_t r = 0; st == KV_OK && r < rows; r++) {
        for (int64_t i = 0; i < cols; i++) f[i] = (float)((s = s * 1664525u + 1013904223u) >> 8) / (1 << 24) - 0.5f;
        if (kv_quantize_row(type, f, wbytes + (size_t)r * rb, cols) != 0)
            st = kv_fail(e, KV_ERR_UNSUPPORTED, "prefill choice: cannot write type %d", type);
    }
    for (int64_t i = 0; i < T * cols; i++) xs[i] = (float)(i % 7) * 0.1f;
    if (st == KV_OK) st = kvcl_weight_upload(c, type, rows, cols, wbytes, &w, e);
    if (st == KV_OK) st = kvcl_buf_create(c, sizeof(float) * (size_t)(T * cols), 1, &x, e);
    if (st == KV_OK) st = kvcl_buf_create(c, sizeof(float) * (size_t)(T * rows), 1, &y, e);
    if (st == KV_OK) st = kvcl_write(c, x, 0, xs, sizeof(float) * (size_t)(T * cols), e);
    g[0] = g[1] = 0.0;
    if (st == KV_OK) st = time_path(c, KVCL_MM_TILED, &w, x, y, T, &g[0], e);
    if (st == KV_OK && kvcl_have_clblast()) st = time_path(c, KVCL_MM_CLBLAST, &w, x, y, T, &g[1], e);
    kvcl_buf_free(x);
    kvcl_buf_free(y);
    kvcl_weight_free(&w);
    free(f);
    free(wbytes);
    free(xs);
    return st;
}

kv_status kvcl_prefill_choose(kvcl_ctx *c, int type, int64_t rows, int64_t cols, int64_t T, bool *measured,
                              double gflops[2], kv_error *e) {
    char suffix[96], path[1200], line[128], name[16];
    double g[2] = {0, 0};
    snprintf(suffix, sizeof suffix, ".prefill-%d-%lldx%lld-%lld", type, (long long)rows, (long long)cols,
             (long long)T);
    kvcl_cache_path(c, suffix, path, sizeof path);
    *measured = false;
    FILE *f = c->cache_dir[0] ? fopen(path, "r") : NULL;
    if (f) {
        bool ok = fgets(line, sizeof line, f) && sscanf(line, "%15s", name) == 1;
        fclose(f);
        if (ok && (strcmp(name, "tiled") == 0 || (strcmp(name, "clblast") == 0 && kvcl_have_clblast()))) {
            c->prefill = name[0] == 't' ? KVCL_MM_TILED : KVCL_MM_CLBLAST;
            if (gflops) gflops[0] = gflops[1] = 0.0;
            return KV_OK;
        }
    }
    kv_status st = measure(c, type, rows, cols, T, g, e);
    if (st != KV_OK) return st;
    c->prefill = g[1] > g[0] ? KVCL_MM_CLBLAST : KVCL_MM_TILED;
    *measured = true;
    if (gflops) gflops[0] = g[0], gflops[1] = g[1];
    if (c->cache_dir[0] && (f = fopen(path, "w"))) {
        fprintf(f, "%s tiled %.1f clblast %.1f GFLOP/s\n", c->prefill == KVCL_MM_TILED ? "tiled" : "clblast", g[0],
                g[1]);
        fclose(f);
    }
    return KV_OK;
}

int kvcl_prefill_path(const kvcl_ctx *c) { return c->prefill; }
