/*
 * matmul_i8.cl — products with Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights by
 * integer dot products, on
 * drivers that compile for x86 with AVX2 (PoCL and other CPU drivers): the
 * activations quantized to 8 bits per block of 32, as the CPU engine does,
 * and 32 byte products summed by pmaddubsw / pmaddwd. A float kernel spends
 * a dozen vector instructions to decode and multiply a block; this takes
 * about four. Elsewhere (GPUs, other CPUs, the portable build) KV_INT_DOT is
 * 0, the kernels below are empty and the host uses matmul.cl's float
 * kernels (int_dot_caps tells it which).
 *
 *   quant_x      x(T, cols) -> a record of I8_RECORD nbx bytes per token
 *                (the layout: blocks.cl), where no kernel wrote them with x.
 *   gemv_i8_<t>  decode, one item per (row, token) as gemv_<t>.
 *   gemv3_i8_<t> up to three weights of one input, as gemv3_<t>.
 *   tiled_i8_<t> prefill, one item per (row, 8 tokens): each pair of weight
 *                blocks unpacked once for the 8 tokens.
 *
 * The order of the float sums, shared by all three (a token gets the same
 * bits from each): a pair's eight integer sums (four lanes a block) times
 * (weight d) * (x d) into chain (pair % 2) by fma; the corrections for the
 * weights' offset (Q4_0: -8 d, Q5_0: -16 d) or min (Q4_1, Q5_1: m) as a
 * 16-lane fma chain of (d or m) * (x d * sum q) over groups of 16 blocks;
 * the result: the lane sum of chain 0 + chain 1, plus the correction's
 * lane sum (times -8 or -16 for the offsets), plus the bias.
 */

/* the compiler's own x86 builtins: only where it says it has them */
#if defined(__x86_64__) && defined(__AVX2__) && !defined(KVCL_PORTABLE) && defined(__has_builtin)
#if __has_builtin(__builtin_ia32_pmaddubsw256) && __has_builtin(__builtin_ia32_pmaddwd256) && \
    __has_builtin(__builtin_ia32_psignb256)
#define KV_INT_DOT 1
typedef char kv_c32 __attribute__((ext_vector_type(32)));
typedef short kv_s16 __attribute__((ext_vector_type(16)));
#endif
#endif
#ifndef KV_INT_DOT
#define KV_INT_DOT 0
#endif

/* out[0]: whether the kernels below compute (1) or are empty (0) */
kernel void int_dot_caps(global int *out) { out[0] = KV_INT_DOT; }

/* the quantized activations (blocks.cl): token t's record at xr + t * I8_RECORD nbx */
#define I8_PARAMS global const char *xr, int nbx

/* token t's quants, scales and sums */
#define I8_Q(t) (xr + (ulong)(t) * nbx * I8_RECORD)
#define I8_D(t) ((const global float *)(I8_Q(t) + 32 * nbx))
#define I8_S(t) ((const global float *)(I8_Q(t) + 48 * nbx))

/* item (p, t): blocks 2 p and 2 p + 1 of token t's record */
kernel void quant_x(global const float *x, ulong xoff, int cols, global char *xr, int nbx) {
    const int p = get_global_id(0), t = get_global_id(1), nb = cols / 32;
    if (2 * p >= nbx) return;
    global char *rec = xr + (ulong)t * nbx * I8_RECORD;
    for (int b = 2 * p; b < 2 * p + 2; b++) {
        if (b < nb) rec_block_at(x + xoff + (ulong)t * cols + 32 * b, rec, nbx, b);
        else rec_zero(rec, nbx, b);
    }
}

#if KV_INT_DOT
/* the fifth bits of 16 elements (bits lo .. lo + 15 of qh) as bytes 0 or
 * 16: each byte of qh spread over eight lanes and tested by a bit mask */
KV_INL char16 fifth_bits(uint qh, uint lo) {
    const uchar b0 = (uchar)(qh >> lo), b1 = (uchar)(qh >> (lo + 8));
    const uchar16 spread = (uchar16)(b0, b0, b0, b0, b0, b0, b0, b0, b1, b1, b1, b1, b1, b1, b1, b1);
    const uchar16 bit = (uchar16)(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
    return ((spread & bit) != (uchar16)0) & (char16)16;
}

/* a pair of weight blocks (w1 may be w0 again for a lone last block, its x
 * all 0) as the byte vectors of pmaddubsw's unsigned operand: Q4's nibbles
 * and Q5's five-bit values (u: first halves, v: second halves), Q8_0's
 * absolute values, sign sources in s, t (Q8_0) */
KV_INL void unpack_pair(const int type, const global uchar *w0, const global uchar *w1, kv_c32 *u, kv_c32 *v,
                        kv_c32 *s, kv_c32 *t) {
    if (type == TYPE_Q8_0) {
        kv_c32 a, b;
        a.lo = as_char16(vload16(0, w0 + 2)), a.hi = as_char16(vload16(0, w1 + 2));
        b.lo = as_char16(vload16(0, w0 + 18)), b.hi = as_char16(vload16(0, w1 + 18));
        *s = a, *t = b;
        *u = __builtin_ia32_psignb256(a, a), *v = __builtin_ia32_psignb256(b, b); /* |w| (-128 stays 0x80 = 128) */
    } else {
        const int o = bytes32(type) - 16; /* the nibbles end the block */
        kv_c32 n;
        n.lo = as_char16(vload16(0, w0 + o)), n.hi = as_char16(vload16(0, w1 + o));
        *u = n & (char)15, *v = (n >> (char)4) & (char)15;
        if (type == TYPE_Q5_0 || type == TYPE_Q5_1) {
            const uint h0 = as_uint(vload4(0, w0 + o - 4)), h1 = as_uint(vload4(0, w1 + o - 4));
            kv_c32 hu, hv;
            hu.lo = fifth_bits(h0, 0), hu.hi = fifth_bits(h1, 0);
            hv.lo = fifth_bits(h0, 16), hv.hi = fifth_bits(h1, 16);
            *u |= hu, *v |= hv;
        }
    }
}

/* the pair's eight integer sums against the quantized x at xp (64 bytes) */
KV_INL int8 dot_pair(const int type, kv_c32 u, kv_c32 v, kv_c32 s, kv_c32 t, const global char *xp) {
    const kv_c32 xa = *(const global kv_c32 *)xp, xb = *(const global kv_c32 *)(xp + 32);
    if (type == TYPE_Q8_0) { /* |w| x sign(w): two pmaddubsw sums may pass 16 bits, so widen each */
        const kv_s16 pa = __builtin_ia32_pmaddubsw256(u, __builtin_ia32_psignb256(xa, s));
        const kv_s16 pb = __builtin_ia32_pmaddubsw256(v, __builtin_ia32_psignb256(xb, t));
        return as_int8(__builtin_ia32_pmaddwd256(pa, (kv_s16)1)) + as_int8(__builtin_ia32_pmaddwd256(pb, (kv_s16)1));
    }
    const kv_s16 p = __builtin_ia32_pmaddubsw256(u, xa) + __builtin_ia32_pmaddubsw256(v, xb); /* <= 4 * 31 * 127 */
    return as_int8(__builtin_ia32_pmaddwd256(p, (kv_s16)1));
}

/* sum of the 8 lanes */
KV_INL float hsum8(float8 v) {
    float4 b = v.lo + v.hi;
    float2 c = b.lo + b.hi;
    return c.x + c.y;
}

/* lanes j, j + 1 of d, four times each (one vector permute) */
KV_INL float8 pair_scales(float16 d, int j) { return shuffle(d, (uint8)j + (uint8)(0, 0, 0, 0, 1, 1, 1, 1)); }

/* the result from the chains and the correction chain */
KV_INL float i8_result(const int type, float8 a0, float8 a1, float16 c) {
    const float s = hsum8(a0 + a1);
    return type == TYPE_Q4_0 ? s - 8.0f * hsum16(c) : type == TYPE_Q5_0 ? s - 16.0f * hsum16(c)
                             : has_min32(type) ? s + hsum16(c) : s;
}

/* blocks b, b + 1 of row w (dw: their scales, four lanes each; without a
 * second block, b again with scale 0 against x's zero block) for nt
 * tokens into token k's chain a[k] (a0 or a1: (b / 2) % 2, a literal at
 * every call, or the chains would live in memory), against its record's
 * quants xq[k] and scales xd[k]; the weight blocks unpacked once for all nt */
KV_INL void pair_i8(const int type, const global uchar *w, int b, bool two, float8 dw, const int nt,
                    const global char *const *xq, const global float *const *xd, float8 *a) {
    const global uchar *w0 = w + bytes32(type) * b, *w1 = two ? w0 + bytes32(type) : w0;
    kv_c32 u, v, s, t;
    unpack_pair(type, w0, w1, &u, &v, &s, &t);
#pragma unroll
    for (int k = 0; k < nt; k++) {
        const float8 sc = dw * vload8(0, xd[k] + 4 * b);
        const float8 f = convert_float8(dot_pair(type, u, v, s, t, xq[k] + 32 * b));
        a[k] = fma(sc, f, a[k]);
    }
}

/* the start of the group of n <= I8_GROUP blocks from b of row w for nt
 * tokens: its scales (returned) and each token's correction chain c[k]
 * against its sums xs[k] */
KV_INL float16 group_start(const int type, const global uchar *w, int b, int n, const int nt,
                           const global float *const *xs, float16 *c) {
    float16 d, m;
    scales16v(type, w + bytes32(type) * b, n, &d, &m);
    if (type != TYPE_Q8_0)
        for (int k = 0; k < nt; k++) c[k] = fma(has_min32(type) ? m : d, vload16(0, xs[k] + b), c[k]);
    return d;
}

/* the n <= I8_GROUP blocks from b (a multiple of I8_GROUP) of row w for
 * one token (record xq, xd, xs), pair by pair (pair_i8), and its
 * correction chain c. For whole groups n is a literal: the guards fold
 * away and the pairs unroll (scalar scale gathers and a loop per pair held
 * the GEMV to two thirds). */
KV_INL void group_i8(const int type, const global uchar *w, int b, int n, const global char *const *xq,
                     const global float *const *xd, const global float *const *xs, float8 *a0, float8 *a1,
                     float16 *c) {
    /* the group after next into the cache (past the row: the next item's
     * row; a prefetch never faults): the scale gathers waited on memory */
#pragma unroll
    for (int l = 0; l < I8_GROUP * bytes32(type); l += 64) __builtin_prefetch(w + bytes32(type) * (b + 2 * I8_GROUP) + l);
    const float16 d = group_start(type, w, b, n, 1, xs, c);
#pragma unroll
    for (int j = 0; j < I8_GROUP; j += 2)
        if (j < n)
            pair_i8(type, w, b + j, j + 1 < n, pair_scales(d, j), 1, xq, xd, (j / 2) % 2 ? a1 : a0);
}

/* dot(row w of nb blocks, a token's record xq, xd, xs) in the shared order */
KV_INL float row_dot_i8(const int type, const global uchar *w, int nb, const global char *xq,
                        const global float *xd, const global float *xs) {
    float8 a0 = 0.0f, a1 = 0.0f;
    float16 c = 0.0f;
    int b = 0;
    for (; b + I8_GROUP <= nb; b += I8_GROUP) group_i8(type, w, b, I8_GROUP, &xq, &xd, &xs, &a0, &a1, &c);
    /* the last group: a literal size where rows often end so (576 = 16 + 2 blocks; 640, 1152: 4) */
    if (b + 2 == nb) group_i8(type, w, b, 2, &xq, &xd, &xs, &a0, &a1, &c);
    else if (b + 4 == nb) group_i8(type, w, b, 4, &xq, &xd, &xs, &a0, &a1, &c);
    else if (b < nb) group_i8(type, w, b, nb - b, &xq, &xd, &xs, &a0, &a1, &c);
    return i8_result(type, a0, a1, c);
}
#endif

#define GEMV_I8_PARAMS                                                                                     \
    global const uchar *W, ulong row_bytes, int rows, int cols, I8_PARAMS, global float *y, ulong yoff, int ldy, \
        global const float *bias, int row0

/* item (r, t): y[t, row0 + r] = W[r] . x[t] (+ bias) */
KV_INL void gemv_i8(const int type, GEMV_I8_PARAMS) {
#if KV_INT_DOT
    const int r = get_global_id(0), t = get_global_id(1);
    if (r >= rows) return;
    float s = row_dot_i8(type, W + r * row_bytes, cols / 32, I8_Q(t), I8_D(t), I8_S(t));
    if (bias) s += bias[row0 + r];
    y[yoff + (ulong)t * ldy + row0 + r] = s;
#endif
}

/* gemv_i8 for one token (row0 0, ldy unused), then r(rows) += y and
 * y = rmsnorm(r) * nw by the last work-group to finish (count: 0 before
 * and after a launch), with y's record (yr not NULL): one launch for what
 * gemv_i8, then rmsnorm with an addend, do. CPU drivers only: the other
 * groups' rows are read after an atomic count, which OpenCL 1.2 does not
 * promise to order on every device. */
KV_INL void gemv_i8_norm(const int type, GEMV_I8_PARAMS, global float *res, ulong roff, global const float *nw,
                         float eps, global char *yr, int ynbx, global int *count, local int *last) {
#if KV_INT_DOT
    const int r = get_global_id(0);
    if (r < rows) {
        float s = row_dot_i8(type, W + r * row_bytes, cols / 32, I8_Q(0), I8_D(0), I8_S(0));
        if (bias) s += bias[r];
        y[yoff + r] = s;
    }
    barrier(CLK_GLOBAL_MEM_FENCE); /* the group's rows are stored */
    if (get_local_id(0) == 0) {
        mem_fence(CLK_GLOBAL_MEM_FENCE);
        *last = atomic_inc(count) == (int)get_num_groups(0) - 1;
        mem_fence(CLK_GLOBAL_MEM_FENCE);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (!*last || get_local_id(0) != 0) return;
    *count = 0;
    global float *yrow = y + yoff;
    rmsnorm_row1(yrow, res + roff, yrow, nw, rows, eps);
    for (int b = 0; yr && b < rows / 32; b++) rec_block_at(yrow + 32 * b, yr, ynbx, b);
#endif
}

/* For one token: g = W0 x, u = W1 x (n rows each), then g = act(g) * u
 * as ffn_act computes it (act_span over the same spans of 16), with g's
 * record (yr not NULL, n a multiple of 32): what gemv3_i8 of the two, then
 * ffn_act, do. Work-groups of 64 items: group k's first 32 take rows
 * 32 k .. 32 k + 31 of W0, the others the same rows of W1 (u is written
 * too: the product's value). */
KV_INL void gemv_act_i8(const int type, global const uchar *W0, global const uchar *W1, ulong row_bytes, int n,
                        int cols, I8_PARAMS, global float *g, ulong goff, global float *u, ulong uoff, int act,
                        global char *yr, int ynbx) {
#if KV_INT_DOT
    const int lid = get_local_id(0), r0 = get_group_id(0) * 32, r = r0 + lid % 32;
    global float *gr = g + goff, *ur = u + uoff;
    if (r < n) {
        const float s = row_dot_i8(type, (lid < 32 ? W0 : W1) + r * row_bytes, cols / 32, I8_Q(0), I8_D(0), I8_S(0));
        if (lid < 32) gr[r] = s;
        else ur[r] = s;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    if (lid % 16 == 0 && lid < 32 && r < n) act_span(gr + r, ur + r, min(n - r, 16), act);
    barrier(CLK_GLOBAL_MEM_FENCE);
    if (yr && lid == 0 && r < n) rec_block_at(gr + r, yr, ynbx, r / 32);
#endif
}

/* item r: gemv3's split of rows over up to three weights */
#define GEMV3_I8_PARAMS                                                                                         \
    global const uchar *W0, global const uchar *W1, global const uchar *W2, ulong row_bytes, int n0, int n1,     \
        int n2, int cols, I8_PARAMS, global float *y0, ulong y0off, global float *y1, ulong y1off, global float *y2, \
        ulong y2off, global const float *b0, global const float *b1, global const float *b2
KV_INL void gemv3_i8(const int type, GEMV3_I8_PARAMS) {
#if KV_INT_DOT
    int r = get_global_id(0);
    global const uchar *W;
    global float *y;
    global const float *bias;
    if (!gemv3_row(&r, n0, n1, n2, W0, W1, W2, y0 + y0off, y1 + y1off, y2 + y2off, b0, b1, b2, &W, &y, &bias)) return;
    float s = row_dot_i8(type, W + r * row_bytes, cols / 32, I8_Q(0), I8_D(0), I8_S(0));
    if (bias) s += bias[r];
    y[r] = s;
#endif
}

/* item (r, tb): tokens MM_TOKENS tb .. (< T) of row r, row_dot_i8's order
 * for each; tokens past T read token T - 1 and are not stored */
KV_INL void tiled_i8(const int type, GEMV_I8_PARAMS, int T) {
#if KV_INT_DOT
    const int r = get_global_id(0), t0 = get_global_id(1) * MM_TOKENS;
    if (r >= rows) return;
    const global uchar *w = W + r * row_bytes;
    const int nb = cols / 32;
    const global char *xq[MM_TOKENS];
    const global float *xd[MM_TOKENS], *xs[MM_TOKENS];
    for (int k = 0; k < MM_TOKENS; k++) {
        const int t = min(t0 + k, T - 1);
        xq[k] = I8_Q(t), xd[k] = I8_D(t), xs[k] = I8_S(t);
    }
    float8 a0[MM_TOKENS], a1[MM_TOKENS];
    float16 c[MM_TOKENS];
    for (int k = 0; k < MM_TOKENS; k++) a0[k] = a1[k] = 0.0f, c[k] = 0.0f;
    for (int b = 0; b < nb; b += I8_GROUP) { /* group_i8's steps for 8 tokens, the pairs not unrolled */
        const int n = min(I8_GROUP, nb - b);
        const float16 d = group_start(type, w, b, n, MM_TOKENS, xs, c);
        float8 dw[I8_GROUP / 2]; /* the pairs' scales by literal permutes (a variable one is lane by lane) */
#pragma unroll
        for (int j = 0; j < I8_GROUP; j += 2) dw[j / 2] = pair_scales(d, j);
        for (int j = 0; j < I8_GROUP; j += 4) { /* a pair for each chain */
            if (j >= n) break;
            pair_i8(type, w, b + j, j + 1 < n, dw[j / 2], MM_TOKENS, xq, xd, a0);
            if (j + 2 >= n) break;
            pair_i8(type, w, b + j + 2, j + 3 < n, dw[j / 2 + 1], MM_TOKENS, xq, xd, a1);
        }
    }
    for (int k = 0; k < MM_TOKENS && t0 + k < T; k++) {
        const float s = i8_result(type, a0[k], a1[k], c[k]);
        y[yoff + (ulong)(t0 + k) * ldy + row0 + r] = bias ? s + bias[row0 + r] : s;
    }
#endif
}

#define GEMV_I8_ARGS W, row_bytes, rows, cols, xr, nbx, y, yoff, ldy, bias, row0
#define MATMUL_I8_KERNELS(name, TYPE)                                                                          \
    kernel void gemv_i8_##name(GEMV_I8_PARAMS) { gemv_i8(TYPE, GEMV_I8_ARGS); }                                \
    kernel void gemv3_i8_##name(GEMV3_I8_PARAMS) {                                                             \
        gemv3_i8(TYPE, W0, W1, W2, row_bytes, n0, n1, n2, cols, xr, nbx, y0, y0off, y1, y1off, y2, y2off, \
                 b0, b1, b2);                                                                                  \
    }                                                                                                          \
    kernel void tiled_i8_##name(GEMV_I8_PARAMS, int T) { tiled_i8(TYPE, GEMV_I8_ARGS, T); }                    \
    kernel void gemv_act_i8_##name(global const uchar *W0, global const uchar *W1, ulong row_bytes, int n,     \
                                   int cols, I8_PARAMS, global float *g, ulong goff, global float *u,          \
                                   ulong uoff, int act, global char *yr, int ynbx) {                           \
        gemv_act_i8(TYPE, W0, W1, row_bytes, n, cols, xr, nbx, g, goff, u, uoff, act, yr, ynbx);                \
    }                                                                                                          \
    kernel void gemv_i8_norm_##name(GEMV_I8_PARAMS, global float *res, ulong roff, global const float *nw,     \
                                    float eps, global char *yr, int ynbx, global int *count) {                 \
        local int last; /* whether this group finished last */                                                 \
        gemv_i8_norm(TYPE, GEMV_I8_ARGS, res, roff, nw, eps, yr, ynbx, count, &last);                           \
    }

MATMUL_I8_KERNELS(q4_0, TYPE_Q4_0)
MATMUL_I8_KERNELS(q4_1, TYPE_Q4_1)
MATMUL_I8_KERNELS(q5_0, TYPE_Q5_0)
MATMUL_I8_KERNELS(q5_1, TYPE_Q5_1)
MATMUL_I8_KERNELS(q8_0, TYPE_Q8_0)
