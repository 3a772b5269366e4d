/*
 * matmul.cl — products with weights in their GGUF formats, and their
 * dequantization: y(T, rows) [row stride ldy] = x(T, cols) . W(rows, cols)^T.
 *
 *   gemv_<type>     decode: one item per (row, token), the row's blocks
 *                   decoded in registers (deq_block: float16 vectors; PoCL
 *                   and other CPU drivers vectorize inside an item), 16
 *                   lane sums.
 *   gemv3_<type>    decode of up to three weights of one input in one launch.
 *   gemv_wg_<type>  decode for GPUs: one work-group per (row, token), its
 *                   items take sub-blocks in turn (neighbouring items read
 *                   neighbouring blocks), a tree sum in local memory.
 *   tiled_<type>    prefill: one item per (2 rows, 4 tokens) (tiled_pair), or
 *                   for K-quants per (row, 8 tokens) (tiled); each block is
 *                   decoded once and used for all the item's tokens.
 *   deq_<type>      rows to float (the CLBlast path's tiles; the embedding
 *                   lookup with an id list).
 *
 * A weight larger than the device's largest allocation is split into parts
 * of whole rows; the host launches once per part, with row0 = the part's
 * first row (outputs and bias are indexed by the global row row0 + r).
 * Float activations: the weights are dequantized to float, not the inputs
 * quantized (the CPU engine quantizes x to 8 bits; see the tests for the
 * difference that makes). On x86 CPU drivers the 32-element quantized
 * formats take matmul_i8.cl's integer kernels instead (the host decides:
 * kvcl_matmul.c).
 */
/* contraction off, as in every kernel source (test_opencl): an fma is written fma() */
#pragma OPENCL FP_CONTRACT OFF

#define MM_TOKENS 8   /* tokens per item of tiled (K-quants) */
#define MM_PAIR_TOKENS 4 /* tokens per item of tiled_pair (the other formats) */
#define GEMV_GROUP 64 /* work-group size of gemv_wg_<type> */

/* The order of the sums, shared by row_dot and tiled (a token gets the
 * same bits from both): the row's 16-element vectors i = 0, 1, ... go to
 * chain (i / 2) % 2 (two chains of fma: one waits on every fma's latency,
 * a 20-byte Q4_1 block per 8 cycles), in order within a chain, and the
 * result is the lane sum of chain 0 + chain 1. For 32-element blocks:
 * even blocks to chain 0, odd ones to chain 1. */

/* dot(row of W, x) over cols; quantized 32-element blocks 16 at a time,
 * their scales decoded as vectors (one at a time, the f16 conversions
 * cost more than the products) */
KV_INL float row_dot(const int type, const global uchar *w, const global float *x, int cols) {
    const int be = block_elems(type), nb = cols / be;
    float16 a0 = 0.0f, a1 = 0.0f, v[16];
    int b = 0;
    if (quant32(type))
        for (; b + 16 <= nb; b += 16) {
            float d[16], m[16];
            const global uchar *wb = w + bytes32(type) * b;
            scales16(type, wb, 16, d, m);
#pragma unroll
            for (int k = 0; k < 16; k += 2) {
                float16 lo, hi;
                const global float *xb = x + 32 * (b + k);
                deq32s(type, wb + bytes32(type) * k, d[k], has_min32(type) ? m[k] : 0.0f, &lo, &hi);
                a0 = fma(hi, vload16(1, xb), fma(lo, vload16(0, xb), a0));
                deq32s(type, wb + bytes32(type) * (k + 1), d[k + 1], has_min32(type) ? m[k + 1] : 0.0f, &lo, &hi);
                a1 = fma(hi, vload16(3, xb), fma(lo, vload16(2, xb), a1));
            }
        }
    if (be == 32)
        for (; b < nb; b++) {
            deq_block(type, w, b, v);
            const global float *xb = x + 32 * b;
            if (b & 1)
                a1 = fma(v[1], vload16(1, xb), fma(v[0], vload16(0, xb), a1));
            else
                a0 = fma(v[1], vload16(1, xb), fma(v[0], vload16(0, xb), a0));
        }
    else
        for (; b < nb; b++) {
            deq_block(type, w, b, v);
#pragma unroll
            for (int k = 0; k < 16; k++) { /* be == 256: 16 vectors */
                const float16 xk = vload16(k, x + be * b);
                if ((k / 2) % 2) a1 = fma(v[k], xk, a1);
                else a0 = fma(v[k], xk, a0);
            }
        }
    float s = hsum16(a0 + a1);
    for (int i = be * nb; i < cols; i++) s = fma(deq1(type, w, i), x[i], s);
    return s;
}

#define GEMV_PARAMS                                                                               \
    global const uchar *W, ulong row_bytes, int rows, int cols, global const float *x, ulong xoff, \
        global float *y, ulong yoff, int ldy, global const float *bias, int row0

/* item (r, t): y[t, row0 + r] = W[r] . x[t] (+ bias) */
KV_INL void gemv(const int type, GEMV_PARAMS) {
    const int r = get_global_id(0), t = get_global_id(1);
    if (r >= rows) return;
    float s = row_dot(type, W + r * row_bytes, x + xoff + (ulong)t * cols, cols);
    if (bias) s += bias[row0 + r];
    y[yoff + (ulong)t * ldy + row0 + r] = s;
}

/* item r: the decode GEMVs (T = 1) of up to three weights of one type and
 * width in one launch (q, k, v; gate, up): rows [0, n0) of W0 into y0,
 * the next n1 of W1 into y1, the next n2 of W2 into y2; each output the
 * bits gemv gives it */
#define GEMV3_PARAMS                                                                                        \
    global const uchar *W0, global const uchar *W1, global const uchar *W2, ulong row_bytes, int n0, int n1, \
        int n2, int cols, global const float *x, ulong xoff, global float *y0, ulong y0off, global float *y1,  \
        ulong y1off, global float *y2, ulong y2off, global const float *b0, global const float *b1,          \
        global const float *b2
/* item r of a gemv3 launch: the weight, output and bias of its row, r
 * made the row within that weight; false past n0 + n1 + n2 */
KV_INL bool gemv3_row(int *r, int n0, int n1, int n2, global const uchar *W0, global const uchar *W1,
                      global const uchar *W2, global float *y0, global float *y1, global float *y2,
                      global const float *b0, global const float *b1, global const float *b2, global const uchar **W,
                      global float **y, global const float **bias) {
    if (*r < n0) {
        *W = W0, *y = y0, *bias = b0;
    } else if ((*r -= n0) < n1) {
        *W = W1, *y = y1, *bias = b1;
    } else if ((*r -= n1) < n2) {
        *W = W2, *y = y2, *bias = b2;
    } else {
        return false;
    }
    return true;
}

KV_INL void gemv3(const int type, GEMV3_PARAMS) {
    int r = get_global_id(0);
    global const uchar *W;
    global float *y;
    global const float *bias;
    if (!gemv3_row(&r, n0, n1, n2, W0, W1, W2, y0 + y0off, y1 + y1off, y2 + y2off, b0, b1, b2, &W, &y, &bias)) return;
    float s = row_dot(type, W + r * row_bytes, x + xoff, cols);
    if (bias) s += bias[r];
    y[r] = s;
}

/* group (r, t), GEMV_GROUP items: the same product, sub-blocks dealt out
 * round robin, a fixed-order tree sum in part (the kernel's local array) */
KV_INL void gemv_wg(const int type, GEMV_PARAMS, local float *part) {
    const int r = get_group_id(0), t = get_group_id(1), lid = get_local_id(0);
    const global uchar *w = W + r * row_bytes;
    const global float *xt = x + xoff + (ulong)t * cols;
    const int nsb = cols / 32;
    float16 acc = 0.0f;
    for (int sb = lid; sb < nsb; sb += GEMV_GROUP) {
        float16 lo, hi;
        deq32(type, w, sb, &lo, &hi);
        acc = fma(lo, vload16(0, xt + 32 * sb), acc);
        acc = fma(hi, vload16(0, xt + 32 * sb + 16), acc);
    }
    float s = hsum16(acc);
    for (int i = 32 * nsb + lid; i < cols; i += GEMV_GROUP) s = fma(deq1(type, w, i), xt[i], s);
    part[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int h = GEMV_GROUP / 2; h > 0; h /= 2) {
        if (lid < h) part[lid] += part[lid + h];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) y[yoff + (ulong)t * ldy + row0 + r] = part[0] + (bias ? bias[row0 + r] : 0.0f);
}

/* item (r, tb): tokens 8 tb .. 8 tb + 7 (< T) of row r, for the K-quants
 * (256-element blocks; the others take tiled_pair). Tokens past T read
 * token T - 1 and are not stored. */
KV_INL void tiled(const int type, GEMV_PARAMS, int T) {
    const int r = get_global_id(0), t0 = get_global_id(1) * MM_TOKENS;
    if (r >= rows) return;
    const global uchar *w = W + r * row_bytes;
    const global float *xt[MM_TOKENS];
    for (int k = 0; k < MM_TOKENS; k++) xt[k] = x + xoff + (ulong)min(t0 + k, T - 1) * cols;
    const int nb = cols / 256; /* K-quant rows are whole super-blocks */
    float16 acc0[MM_TOKENS], acc1[MM_TOKENS], v[16];
    for (int k = 0; k < MM_TOKENS; k++) acc0[k] = acc1[k] = 0.0f;
    for (int b = 0; b < nb; b++) { /* row_dot's order of the sums, for each token */
        deq_block(type, w, b, v);
#pragma unroll
        for (int j = 0; j < 16; j++)
#pragma unroll
            for (int k = 0; k < MM_TOKENS; k++) {
                const float16 xk = vload16(j, xt[k] + 256 * b);
                if ((j / 2) % 2) acc1[k] = fma(v[j], xk, acc1[k]);
                else acc0[k] = fma(v[j], xk, acc0[k]);
            }
    }
    for (int k = 0; k < MM_TOKENS && t0 + k < T; k++) {
        float s = hsum16(acc0[k] + acc1[k]);
        if (bias) s += bias[row0 + r];
        y[yoff + (ulong)(t0 + k) * ldy + row0 + r] = s;
    }
}

/* item (rp, tb): rows 2 rp and 2 rp + 1 (when < rows), tokens
 * MM_PAIR_TOKENS tb .. (< T), for the formats of 32-element blocks: each
 * activation vector serves both rows (a third of the loads per product of
 * tiled; twice the prefill rate on CPU drivers), the same order of the
 * sums per (row, token). Tokens past T read token T - 1 and are not stored. */
KV_INL void tiled_pair(const int type, GEMV_PARAMS, int T) {
    const int ra = 2 * get_global_id(0), t0 = get_global_id(1) * MM_PAIR_TOKENS;
    if (ra >= rows) return;
    const int rb = min(ra + 1, rows - 1); /* a last odd row computes itself twice */
    const global uchar *wa = W + ra * row_bytes, *wb = W + rb * row_bytes;
    const global float *xt[MM_PAIR_TOKENS];
    for (int k = 0; k < MM_PAIR_TOKENS; k++) xt[k] = x + xoff + (ulong)min(t0 + k, T - 1) * cols;
    const int nb = cols / 32;
    float16 a0[MM_PAIR_TOKENS], a1[MM_PAIR_TOKENS], b0[MM_PAIR_TOKENS], b1[MM_PAIR_TOKENS], va[16], vb[16];
    for (int k = 0; k < MM_PAIR_TOKENS; k++) a0[k] = a1[k] = b0[k] = b1[k] = 0.0f;
    for (int b = 0; b < nb; b++) { /* row_dot's order of the sums, for each (row, token) */
        deq_block(type, wa, b, va);
        deq_block(type, wb, b, vb);
        if (b & 1)
#pragma unroll
            for (int k = 0; k < MM_PAIR_TOKENS; k++) {
                const float16 x0 = vload16(0, xt[k] + 32 * b), x1 = vload16(1, xt[k] + 32 * b);
                a1[k] = fma(va[1], x1, fma(va[0], x0, a1[k]));
                b1[k] = fma(vb[1], x1, fma(vb[0], x0, b1[k]));
            }
        else
#pragma unroll
            for (int k = 0; k < MM_PAIR_TOKENS; k++) {
                const float16 x0 = vload16(0, xt[k] + 32 * b), x1 = vload16(1, xt[k] + 32 * b);
                a0[k] = fma(va[1], x1, fma(va[0], x0, a0[k]));
                b0[k] = fma(vb[1], x1, fma(vb[0], x0, b0[k]));
            }
    }
    for (int k = 0; k < MM_PAIR_TOKENS && t0 + k < T; k++) {
        global float *yt = y + yoff + (ulong)(t0 + k) * ldy + row0;
        float sa = hsum16(a0[k] + a1[k]), sb = hsum16(b0[k] + b1[k]);
        for (int i = 32 * nb; i < cols; i++) { /* the tail of a float row */
            sa = fma(deq1(type, wa, i), xt[k][i], sa);
            sb = fma(deq1(type, wb, i), xt[k][i], sb);
        }
        yt[ra] = bias ? sa + bias[row0 + ra] : sa;
        if (ra + 1 < rows) yt[rb] = bias ? sb + bias[row0 + rb] : sb;
    }
}

/* item (b, i): block b (deq_block) of output row i (b == cols / 32: the
 * tail of a float row; packed: the row in the integer kernels' layout,
 * blocks.cl). The source row is first + i, or with ids, ids[i] -
 * row0 when that falls in this part [row0, row0 + rows) (otherwise another
 * launch writes the row). out(n, cols) row stride ldo. */
KV_INL void deq(const int type, global const uchar *W, ulong row_bytes, int rows, int cols,
                global const int *ids, int row0, int first, global float *out, ulong ooff, int ldo, int packed) {
    const int b = get_global_id(0), i = get_global_id(1), be = block_elems(type);
    if (b >= (cols + be - 1) / be) return; /* the global size is rounded up */
    int r = first + i;
    if (ids) {
        r = ids[i] - row0;
        if (r < 0 || r >= rows) return;
    }
    const global uchar *w = W + r * row_bytes;
    global float *o = out + ooff + (ulong)i * ldo;
    if (b < cols / be) {
        float16 v[16];
        if (quant32(type) && packed) deq32_packed(type, w, cols / 32, b, &v[0], &v[1]); /* the integer kernels' layout */
        else if (packed_k4(type) && packed) deq256_k4_packed(type, w + group_bytes(type) * b, v);
        else deq_block(type, w, b, v);
#pragma unroll
        for (int k = 0; k < 16; k++)
            if (k < be / 16) vstore16(v[k], 0, o + be * b + 16 * k);
    } else {
        for (int k = be * b; k < cols; k++) o[k] = deq1(type, w, k);
    }
}

/* ---- one kernel of each kind per type ---- */

#define GEMV_ARGS W, row_bytes, rows, cols, x, xoff, y, yoff, ldy, bias, row0
#define DEQ_PARAMS                                                                       \
    global const uchar *W, ulong row_bytes, int rows, int cols, global const int *ids, int row0, \
        int first, global float *out, ulong ooff, int ldo, int packed
#define DEQ_ARGS W, row_bytes, rows, cols, ids, row0, first, out, ooff, ldo, packed

#define MATMUL_KERNELS(name, TYPE)                                                         \
    kernel void gemv_##name(GEMV_PARAMS) { gemv(TYPE, GEMV_ARGS); }                        \
    kernel void gemv_wg_##name(GEMV_PARAMS) {                                              \
        local float part[GEMV_GROUP];                                                      \
        gemv_wg(TYPE, GEMV_ARGS, part);                                                    \
    }                                                                                      \
    kernel void tiled_##name(GEMV_PARAMS, int T) {                                         \
        if (block_elems(TYPE) == 32) tiled_pair(TYPE, GEMV_ARGS, T);                       \
        else tiled(TYPE, GEMV_ARGS, T);                                                    \
    }                                                                                      \
    kernel void gemv3_##name(GEMV3_PARAMS) {                                               \
        gemv3(TYPE, W0, W1, W2, row_bytes, n0, n1, n2, cols, x, xoff, y0, y0off, y1, y1off, y2, y2off, b0, b1, b2); \
    }                                                                                      \
    kernel void deq_##name(DEQ_PARAMS) { deq(TYPE, DEQ_ARGS); }

MATMUL_KERNELS(f32, TYPE_F32)
MATMUL_KERNELS(f16, TYPE_F16)
MATMUL_KERNELS(bf16, TYPE_BF16)
MATMUL_KERNELS(q4_0, TYPE_Q4_0)
MATMUL_KERNELS(q4_1, TYPE_Q4_1)
MATMUL_KERNELS(q5_0, TYPE_Q5_0)
MATMUL_KERNELS(q5_1, TYPE_Q5_1)
MATMUL_KERNELS(q8_0, TYPE_Q8_0)
MATMUL_KERNELS(q4_k, TYPE_Q4_K)
MATMUL_KERNELS(q5_k, TYPE_Q5_K)
MATMUL_KERNELS(q6_k, TYPE_Q6_K)
