/*
 * matmul_i8.cl — products with Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K
 * weights by integer dot products, on drivers that compile for x86 with
 * AVX2 (PoCL and other CPU drivers): the activations quantized to 8 bits
 * per block of 32 (as the CPU engine does for the 32-element formats; it
 * takes 256 for the K-quants), and byte products summed by vpdpbusd (where
 * the CPU has AVX512-VNNI) or pmaddubsw / pmaddwd. Weights and records are
 * both laid out in lanes of 8 blocks (blocks.cl: the host packs the
 * weights at upload), so a 32-byte vector holds 4 bytes of 8 blocks and
 * the sums of block l stay in lane l: a group of 8 blocks costs 8 integer
 * dot instructions and one float step, with no gathers and no shuffles.
 * Elsewhere (GPUs, other CPUs, the portable build) KV_INT_DOT is 0, the
 * kernels below are empty and the host uses matmul.cl's float kernels
 * (int_dot_caps tells it which).
 *
 *   quant_x      x(T, cols) -> a record of I8_RECORD nbx bytes per token
 *                (the layout: blocks.cl), where no kernel wrote them with x.
 *   gemv_i8_<t>  decode, one item per (row, token) as gemv_<t>.
 *   gemv3_i8_<t> up to three weights of one input, as gemv3_<t>.
 *   tiled_i8_<t> prefill, one item per (row, 8 tokens): each group of
 *                weight blocks unpacked once for the 8 tokens.
 *   gemv_act_i8_<t>, gemv_i8_norm_<t>: one token's product with the next
 *                op (below).
 *
 * The order of the float sums, shared by all (a token gets the same bits
 * from each): per group g of 8 blocks, lane l (block 8 g + l) with I its
 * exact integer sum, a chain a = fma(d, I * (x d), a) over the groups, and
 * for the weights' offset (Q4_0: -8 d, Q5_0: -16 d) or min (Q4_1, Q5_1: m;
 * Q4_K, Q5_K: dmin m) a chain c = fma(d or m, x d * sum q, c); the result:
 * the lane sum of a, plus the lane sum of c (times -8 or -16 for the
 * offsets, -1 for the K-quants' mins), plus the bias. A K-quant's d is
 * d sc and its min dmin m, each one float product (the CPU's dequantization
 * computes the same two).
 */
/* contraction off, as in every kernel source (test_opencl): an fma is written fma() */
#pragma OPENCL FP_CONTRACT OFF

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
#define I8_S(t) ((const global float *)(I8_Q(t) + 36 * nbx))

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
/* acc + the sums of 4 byte products u (unsigned) x (signed) per 32-bit
 * lane: vpdpbusd where the host found it (KVCL_VNNI: the CPU that runs
 * this driver has AVX512-VNNI and AVX512-VL; the compiler may not know
 * it, so it is written out), else pmaddubsw + pmaddwd. The same integer
 * sums either way: a pair of products (<= 2 * 128 * 127) fits pmaddubsw's
 * 16 bits. */
KV_INL int8 dot4(int8 acc, kv_c32 u, kv_c32 x) {
#ifdef KVCL_VNNI
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(x));
    return acc;
#else
    return acc + as_int8(__builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256(u, x), (kv_s16)1));
#endif
}

/* 32 bytes at p (any alignment) */
typedef char kv_c32u __attribute__((ext_vector_type(32), aligned(1)));
KV_INL kv_c32 load32(const global uchar *p) { return *(const global kv_c32u *)p; }

/* lanes 0 .. n - 1 of a group's word at p (4 n bytes), 0 past n (no byte
 * past the word is read: n a literal 8 is one load) */
KV_INL kv_c32 word_lanes(const global uchar *p, const int n) {
    if (n == 8) return load32(p);
    uint8 v = 0;
#pragma unroll
    for (int l = 0; l < 8; l++)
        if (l < n) ((uint *)&v)[l] = as_uint(vload4(l, p));
    return __builtin_astype(v, kv_c32);
}

/* the n f16 values at p as lanes 0 .. n - 1, 0 past n */
KV_INL float8 half_lanes(const global uchar *p, const int n) {
    if (n == 8) { /* PoCL's vload_half8 assumes 16-byte alignment: through a private copy */
        const uchar16 h = vload16(0, p);
        return vload_half8(0, (const private half *)&h);
    }
    float8 v = 0.0f;
#pragma unroll
    for (int l = 0; l < 8; l++)
        if (l < n) ((float *)&v)[l] = vload_half(l, (const global half *)p);
    return v;
}

/* 0 or 16 in byte i of lane l: bit s + i of lane l's fifth bits h (i < 4) */
KV_INL kv_c32 fifth_lanes(uint8 h, uint s) {
    const uint8 t = (h >> s) & 0xFu; /* bit i to bit 8 i, 0 or 1 a byte */
    return __builtin_astype(((t * 0x00204081u) & 0x01010101u) << 4, kv_c32);
}

/* Group g (n <= 8 blocks: a literal) of the packed row w (blocks.cl) for
 * nt tokens: token k's integer sums into I[k] (lane l: block 8 g + l)
 * against its record's quants xq[k]; *d the blocks' scales, *m their
 * mins (Q4_1, Q5_1). The weight words unpacked once for all nt. One
 * token takes two accumulators (J: the high nibbles, or Q8_0's odd words),
 * or its eight vpdpbusd would each wait on the last; several tokens' are
 * independent already (and more would not fit the registers). */
KV_INL void group_dot(const int type, const global uchar *w, int g, const int n, const int nt,
                      const global char *const *xq, float8 *d, float8 *m, int8 *I) {
    const global uchar *p = w + group_bytes(type) * g, *hp, *q;
    packed_parts(type, p, n, &hp, &q);
    if (packed_k4(type)) { /* a super-block (n is 8): d sc and dmin m */
        k4_scales8(p, d, m);
    } else {
        *d = half_lanes(p, n);
        *m = has_min32(type) ? half_lanes(p + 2 * n, n) : 0.0f;
    }
    const bool hb = five32(type) || type == TYPE_Q5_K;
    const uint8 h = hb ? as_uint8(word_lanes(hp, n)) : (uint8)0;
    int8 J[MM_TOKENS];
    for (int k = 0; k < nt; k++) I[k] = J[k] = 0;
    if (type == TYPE_Q8_0) { /* |w| against x with w's sign */
#pragma unroll
        for (int v = 0; v < 8; v++) {
            const kv_c32 s = word_lanes(q + 4 * n * v, n), u = __builtin_ia32_psignb256(s, s);
            for (int k = 0; k < nt; k++) {
                const kv_c32 x = __builtin_ia32_psignb256(*(const global kv_c32 *)(xq[k] + 256 * g + 32 * v), s);
                if (nt == 1 && v % 2) J[k] = dot4(J[k], u, x);
                else I[k] = dot4(I[k], u, x);
            }
        }
    } else {
#pragma unroll
        for (int v = 0; v < 4; v++) { /* word v: elements 4 v .. 4 v + 3 (low nibbles), 16 + 4 v .. (high) */
            const kv_c32 b = word_lanes(q + 4 * n * v, n);
            kv_c32 lo = b & (char)15, hi = (b >> (char)4) & (char)15;
            if (hb) lo |= fifth_lanes(h, 4 * v), hi |= fifth_lanes(h, 16 + 4 * v);
            for (int k = 0; k < nt; k++) {
                const global kv_c32 *x = (const global kv_c32 *)(xq[k] + 256 * g);
                I[k] = dot4(I[k], lo, x[v]);
                if (nt == 1) J[k] = dot4(J[k], hi, x[4 + v]);
                else I[k] = dot4(I[k], hi, x[4 + v]);
            }
        }
    }
    if (nt == 1) I[0] += J[0];
}

/* Group g of row w for nt tokens (records xq, xd, xs) into their chains:
 * lane by lane a[k] = fma(d, I * x d, a[k]) and the correction chain
 * c[k] = fma(d or m, x d * sum q, c[k]) (i8_result ends them). */
KV_INL void group_i8(const int type, const global uchar *w, int g, const int n, const int nt,
                     const global char *const *xq, const global float *const *xd, const global float *const *xs,
                     float8 *a, float8 *c) {
    /* two groups ahead into the cache (past the row: the next item's row; a prefetch never faults); a
     * constant loop of 3 to 5, unrolled without asking (an unroll pragma here made the compiler warn) */
    for (int l = 0; l < group_bytes(type); l += 64) __builtin_prefetch(w + group_bytes(type) * (g + 2) + l);
    float8 d, m;
    int8 I[MM_TOKENS];
    group_dot(type, w, g, n, nt, xq, &d, &m, I);
    for (int k = 0; k < nt; k++) {
        a[k] = fma(d, convert_float8(I[k]) * vload8(g, xd[k]), a[k]);
        if (type != TYPE_Q8_0) c[k] = fma(has_min32(type) || packed_k4(type) ? m : d, vload8(g, xs[k]), c[k]);
    }
}

/* sum of the 8 lanes */
KV_INL float hsum8(float8 v) {
    float4 b = v.lo + v.hi;
    float2 c = b.lo + b.hi;
    return c.x + c.y;
}

/* the result from the chain a and the correction chain c: the offsets of
 * Q4_0 (-8 d) and Q5_0 (-16 d), the min (Q4_1, Q5_1: + m; Q4_K, Q5_K: - dmin m) */
KV_INL float i8_result(const int type, float8 a, float8 c) {
    const float s = hsum8(a);
    return type == TYPE_Q4_0 ? s - 8.0f * hsum8(c) : type == TYPE_Q5_0 ? s - 16.0f * hsum8(c)
                             : has_min32(type) ? s + hsum8(c) : packed_k4(type) ? s - hsum8(c) : s;
}

/* a row w of nb blocks against nt tokens' records into a[k], c[k]: whole
 * groups, then the last one with a literal size where rows often end so
 * (576 = 16 + 2 blocks, 640 = 16 + 4, 960 = 24 + 6) */
KV_INL void row_i8(const int type, const global uchar *w, int nb, const int nt, const global char *const *xq,
                   const global float *const *xd, const global float *const *xs, float8 *a, float8 *c) {
    for (int k = 0; k < nt; k++) a[k] = c[k] = 0.0f;
    const int g = nb / 8, n = nb % 8;
    for (int j = 0; j < g; j++) group_i8(type, w, j, 8, nt, xq, xd, xs, a, c);
    if (n == 2) group_i8(type, w, g, 2, nt, xq, xd, xs, a, c);
    else if (n == 4) group_i8(type, w, g, 4, nt, xq, xd, xs, a, c);
    else if (n == 6) group_i8(type, w, g, 6, nt, xq, xd, xs, a, c);
    else if (n) group_i8(type, w, g, n, nt, xq, xd, xs, a, c);
}

/* dot(row w of nb blocks, a token's record xq, xd, xs) in the shared order */
KV_INL float row_dot_i8(const int type, const global uchar *w, int nb, const global char *xq,
                        const global float *xd, const global float *xs) {
    float8 a, c;
    row_i8(type, w, nb, 1, &xq, &xd, &xs, &a, &c);
    return i8_result(type, a, c);
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
 * for each (each weight group unpacked once for the 8); tokens past T
 * read token T - 1 and are not stored */
KV_INL void tiled_i8(const int type, GEMV_I8_PARAMS, int T) {
#if KV_INT_DOT
    const int r = get_global_id(0), t0 = get_global_id(1) * MM_TOKENS;
    if (r >= rows) return;
    const global char *xq[MM_TOKENS];
    const global float *xd[MM_TOKENS], *xs[MM_TOKENS];
    for (int k = 0; k < MM_TOKENS; k++) {
        const int t = min(t0 + k, T - 1);
        xq[k] = I8_Q(t), xd[k] = I8_D(t), xs[k] = I8_S(t);
    }
    float8 a[MM_TOKENS], c[MM_TOKENS];
    row_i8(type, W + r * row_bytes, cols / 32, MM_TOKENS, xq, xd, xs, a, c);
    for (int k = 0; k < MM_TOKENS && t0 + k < T; k++) {
        const float s = i8_result(type, a[k], c[k]);
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
MATMUL_I8_KERNELS(q4_k, TYPE_Q4_K)
MATMUL_I8_KERNELS(q5_k, TYPE_Q5_K)
