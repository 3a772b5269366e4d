/*
 * blocks.cl — the GGUF weight formats on the device: every kernel that reads
 * weights (GEMV, the tiled prefill GEMM, dequantization for CLBlast and the
 * embedding lookup) decodes them here.
 *
 * Two ways to read a row of `cols` elements:
 *   deq32()      sub-block sb = elements [32 sb, 32 sb + 32) as two float16
 *                (lo: the first 16, hi: the next 16); fine-grained, for
 *                kernels that deal sub-blocks out to many work-items.
 *   deq_block()  block b = block_elems(type) elements as float16 v[]: a
 *                whole K-quant super-block of 256 (its scales decoded once;
 *                three times faster per element on CPU drivers) or one
 *                sub-block of 32 for the other formats.
 * Float rows (F32, F16, BF16) may end in a tail of fewer than 32 elements
 * (deq1()); rows of the quantized formats are whole blocks (checked on the
 * host).
 *
 * The arithmetic repeats the engine's scalar dequantization (engine/quant.c)
 * operation for operation, with contraction off, so values are bit-identical
 * to kv_dequantize_row: (d * sc) * q - dmin * m ...
 *
 * This file is the first of the program; it also holds what every later
 * file shares (type ids, f16 rounding).
 */
#pragma OPENCL FP_CONTRACT OFF

/* every helper inlined: a CPU driver that calls one per block instead
 * (large kernels pass its limits) runs the GEMVs several times slower */
#define KV_INL inline __attribute__((always_inline))

/* ggml type ids (engine/types.h) */
#define TYPE_F32 0
#define TYPE_F16 1
#define TYPE_Q4_0 2
#define TYPE_Q4_1 3
#define TYPE_Q5_0 6
#define TYPE_Q5_1 7
#define TYPE_Q8_0 8
#define TYPE_Q4_K 12
#define TYPE_Q5_K 13
#define TYPE_Q6_K 14
#define TYPE_BF16 30

/* the f16 bits h as a float, exactly (infinities and NaNs too): a few
 * integer operations, where a CPU driver's vload_half is a library call
 * (two of them a block held a Q4_1 GEMV to a fifth of the bandwidth) */
KV_INL float f16_bits(uint h) {
    const uint em = h & 0x7fffu;
    float f;
    if (em < 0x400u) /* zero or subnormal: em 2^-24 (no float subnormal on the way) */
        f = (float)em * 0x1p-24f;
    else if (em >= 0x7c00u) /* infinity or NaN */
        f = as_float(0x7f800000u | ((em & 0x3ffu) << 13));
    else /* exponent rebiased from 15 to 127 */
        f = as_float((em << 13) + 0x38000000u);
    return as_float(as_uint(f) | ((h & 0x8000u) << 16));
}

/* the f16 value at byte offset o of p */
KV_INL float f16_at(const global uchar *p, int o) { return f16_bits((uint)p[o] | ((uint)p[o + 1] << 8)); }

/* x rounded to the nearest f16 (ties to even) and back (the bits live in a
 * ushort: without cl_khr_fp16 a half variable may not be declared) */
KV_INL float round_f16(float x) {
    ushort h;
    vstore_half_rte(x, 0, (private half *)&h);
    return vload_half(0, (const private half *)&h);
}

/* the same for 16 values */
KV_INL float16 round_f16x16(float16 x) {
    ushort16 h;
    vstore_half16_rte(x, 0, (private half *)&h);
    return vload_half16(0, (const private half *)&h);
}

/* ---- the integer kernels' records and weights (matmul_i8.cl) ----
 * Both in lanes of 8 blocks, so that one 32-byte vector holds 4 bytes of
 * each of 8 blocks and vpdpbusd / pmaddwd leave block l's sums in lane l.
 *
 * A token's record of x (cols wide): nbx blocks of 32, nbx = cols / 32
 * rounded up to I8_GROUP. First the quants, 32 bytes a block: in group g
 * of 8 blocks, 32-byte word j (0 .. 7) holds elements 4 j .. 4 j + 3 of
 * block 8 g + l at bytes 4 l .. 4 l + 3. Then the scales d (nbx floats:
 * f16-rounded amax / 127, as the CPU's Q8_0), then d * (sum of the block's
 * quants) (nbx floats). Blocks past cols are 0. quant_x writes records
 * from x; the kernels that produce the input of a product (rmsnorm,
 * ffn_act, attention) write them too where the host asks, from the values
 * they store, so the records are the same bits either way.
 *
 * Weights of those kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 where they run)
 * are packed by the host at upload, row by row, in the bytes the row
 * had: its blocks in groups of 8 (the last one of nb % 8 blocks, if any);
 * a group of n blocks holds their n scales d (f16), then for Q4_1 / Q5_1
 * their n mins m, for Q5_0 / Q5_1 their n 32-bit words of fifth bits, then
 * the quants as words of 4 n bytes: word v holds bytes 4 v .. 4 v + 3 of
 * each block's quants in turn (4 words for the nibble formats, 8 for
 * Q8_0). deq32_packed reads one block of such a row. Q4_K and Q5_K rows
 * (super-blocks of 8 sub-blocks of 32) are packed a super-block a group:
 * d, dmin and the 12 scale bytes as they were, for Q5_K the 8 sub-blocks'
 * 32-bit words of fifth bits (bit e: element e), then 4 words of 32 bytes:
 * word v holds, at bytes 4 l .. 4 l + 3, elements 4 v .. 4 v + 3 of
 * sub-block l in the low nibbles and 16 + 4 v .. in the high ones (the
 * nibbles of a Q4_0 block); deq256_k4_packed reads one. */

#define I8_GROUP 8 /* blocks a group (and nbx a multiple of it) */

/* bytes of a token's record per block: 32 quants, a scale, a sum (= I8_RECORD in kvcl_matmul.c) */
#define I8_RECORD 40

/* block b of the record rec (nbx blocks): 32 quants (lo: elements 0 .. 15,
 * hi: 16 .. 31), scale d, sum s */
KV_INL void rec_store(char16 lo, char16 hi, float d, float s, global char *rec, int nbx, int b) {
    global char *qp = rec + 256 * (b / 8) + 4 * (b % 8);
    vstore4(lo.s0123, 0, qp), vstore4(lo.s4567, 0, qp + 32), vstore4(lo.s89ab, 0, qp + 64);
    vstore4(lo.scdef, 0, qp + 96), vstore4(hi.s0123, 0, qp + 128), vstore4(hi.s4567, 0, qp + 160);
    vstore4(hi.s89ab, 0, qp + 192), vstore4(hi.scdef, 0, qp + 224);
    ((global float *)(rec + 32 * nbx))[b] = d;
    ((global float *)(rec + 36 * nbx))[b] = s;
}

/* block b of the record rec from its 32 values (a: the first 16, c: the
 * next 16) */
KV_INL void rec_block(float16 a, float16 c, global char *rec, int nbx, int b) {
    const float16 m = fmax(fabs(a), fabs(c));
    const float8 m8 = fmax(m.lo, m.hi);
    const float4 m4 = fmax(m8.lo, m8.hi);
    const float amax = fmax(fmax(m4.x, m4.y), fmax(m4.z, m4.w));
    const float dd = amax / 127, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    const char16 lo = convert_char16_sat(rint(a * id)), hi = convert_char16_sat(rint(c * id));
    const int16 qs = convert_int16(lo) + convert_int16(hi);
    const int8 q8 = qs.lo + qs.hi;
    const int4 q4 = q8.lo + q8.hi;
    float d = round_f16(dd);
    /* a NaN among the 32 (which fmax and the conversion drop) makes the scale NaN */
    if (any(isnan(a)) || any(isnan(c))) d = NAN;
    rec_store(lo, hi, d, d * (float)(q4.x + q4.y + q4.z + q4.w), rec, nbx, b);
}

/* block b of the record rec from the 32 floats at v */
KV_INL void rec_block_at(const global float *v, global char *rec, int nbx, int b) {
    rec_block(vload16(0, v), vload16(1, v), rec, nbx, b);
}

/* block b of the record rec: zero (past cols) */
KV_INL void rec_zero(global char *rec, int nbx, int b) { rec_store((char16)0, (char16)0, 0.0f, 0.0f, rec, nbx, b); }

/* ---- K/V pages (kvstore.cl): the row of (head h, position pos) ---- */
#define KV_PAGE_PARAMS global const int *tab, int pt_log2, int max_pages
#define KV_PAGE_ARGS tab, pt_log2, max_pages

/* byte offset of the row of (head h, position pos) */
KV_INL ulong kv_row(KV_PAGE_PARAMS, int h, int pos, int row_bytes) {
    const int page = tab[pos >> pt_log2], t = pos & ((1 << pt_log2) - 1);
    return (((ulong)h * max_pages + page) * (1 << pt_log2) + t) * row_bytes;
}

/* element i of an F16 or F32 row set to x (F16: rounded to nearest even, as kv_put) */
KV_INL void kv_put1(int type, global uchar *row, int i, float x) {
    if (type == TYPE_F16) vstore_half_rte(x, i, (global half *)row);
    else ((global float *)row)[i] = x;
}

/* 16 unsigned nibbles (low or high) as ints */
KV_INL int16 nib_lo(uchar16 q) { return convert_int16(q & (uchar16)0xF); }
KV_INL int16 nib_hi(uchar16 q) { return convert_int16(q >> (uchar16)4); }

/* bits [s, s + 16) of h, each as 0 or 16 */
KV_INL int16 bits16(uint h, uint s) {
    const uint16 lane = (uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return convert_int16(((uint16)h >> (lane + s)) & 1u) << 4;
}

/* ---- the 32-element formats (one block per sub-block) ---- */

/* bytes of a block, whether it has a min after d, whether it has fifth bits (32-element formats) */
KV_INL int bytes32(const int type) {
    return type == TYPE_Q4_0 ? 18 : type == TYPE_Q4_1 ? 20 : type == TYPE_Q5_0 ? 22 : type == TYPE_Q5_1 ? 24 : 34;
}
KV_INL bool has_min32(const int type) { return type == TYPE_Q4_1 || type == TYPE_Q5_1; }
KV_INL bool five32(const int type) { return type == TYPE_Q5_0 || type == TYPE_Q5_1; }
KV_INL bool quant32(const int type) {
    return type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_Q5_0 || type == TYPE_Q5_1 || type == TYPE_Q8_0;
}

/* ---- packed rows (the integer kernels' layout: see the records above) ---- */

/* the K-quants packed a super-block a group (Q6_K is not), and the bytes
 * of a whole group of 8 blocks */
KV_INL bool packed_k4(const int type) { return type == TYPE_Q4_K || type == TYPE_Q5_K; }
KV_INL int group_bytes(const int type) {
    return type == TYPE_Q4_K ? 144 : type == TYPE_Q5_K ? 176 : 8 * bytes32(type);
}

/* where the group of n blocks at p keeps its fifth-bit words (*h) and its
 * quant words (*q); its scales start at p (the mins at p + 2 n), a K-quant
 * super-block's d, dmin and scale bytes at p */
KV_INL void packed_parts(const int type, const global uchar *p, int n, const global uchar **h, const global uchar **q) {
    if (packed_k4(type)) {
        *h = p + 16, *q = p + (type == TYPE_Q5_K ? 48 : 16);
        return;
    }
    *h = p + (has_min32(type) ? 4 : 2) * n;
    *q = *h + (five32(type) ? 4 : 0) * n;
}

/* A block's values from its parts, however stored: q the first 16 quant
 * bytes (the nibbles; Q8_0's first 16 int8), q2 Q8_0's next 16, qh the
 * fifth bits (Q5), d the scale, m the min (Q4_1, Q5_1).
 *   Q4_0: d * (q - 8)   Q4_1: d * q + m   Q5_0: d * (q - 16)   Q5_1: d * q + m   Q8_0: q * d */
KV_INL void deq32v(const int type, uchar16 q, uchar16 q2, uint qh, float d, float m, float16 *lo, float16 *hi) {
    switch (type) {
    case TYPE_Q4_0:
        *lo = d * convert_float16(nib_lo(q) - 8);
        *hi = d * convert_float16(nib_hi(q) - 8);
        break;
    case TYPE_Q4_1:
        *lo = d * convert_float16(nib_lo(q)) + m;
        *hi = d * convert_float16(nib_hi(q)) + m;
        break;
    case TYPE_Q5_0:
        *lo = d * convert_float16((nib_lo(q) | bits16(qh, 0)) - 16);
        *hi = d * convert_float16((nib_hi(q) | bits16(qh, 16)) - 16);
        break;
    case TYPE_Q5_1:
        *lo = d * convert_float16(nib_lo(q) | bits16(qh, 0)) + m;
        *hi = d * convert_float16(nib_hi(q) | bits16(qh, 16)) + m;
        break;
    case TYPE_Q8_0:
        *lo = convert_float16(as_char16(q)) * d;
        *hi = convert_float16(as_char16(q2)) * d;
        break;
    }
}

/* the block at b (GGUF layout: d, [m], [qh], quants), scales given */
KV_INL void deq32s(const int type, const global uchar *b, float d, float m, float16 *lo, float16 *hi) {
    const int o = (has_min32(type) ? 4 : 2) + (five32(type) ? 4 : 0); /* the quants */
    const uint qh = five32(type) ? as_uint(vload4(0, b + o - 4)) : 0u;
    deq32v(type, vload16(0, b + o), type == TYPE_Q8_0 ? vload16(0, b + o + 16) : (uchar16)0, qh, d, m, lo, hi);
}

KV_INL void deq32_q(const int type, const global uchar *b, float16 *lo, float16 *hi) {
    deq32s(type, b, f16_at(b, 0), has_min32(type) ? f16_at(b, 2) : 0.0f, lo, hi);
}

/* block b of a packed row of nb blocks (the integer kernels' layout above) */
KV_INL void deq32_packed(const int type, const global uchar *row, int nb, int b, float16 *lo, float16 *hi) {
    const int l = b % 8, n = min(8, nb - (b - l));
    const global uchar *p = row + bytes32(type) * (b - l), *h, *q;
    packed_parts(type, p, n, &h, &q);
    q += 4 * l;
    const float d = f16_at(p, 2 * l), m = has_min32(type) ? f16_at(p, 2 * n + 2 * l) : 0.0f;
    const uint qh = five32(type) ? as_uint(vload4(l, h)) : 0u;
    const int w = 4 * n; /* bytes a word */
    const uchar16 q1 = (uchar16)(vload4(0, q), vload4(0, q + w), vload4(0, q + 2 * w), vload4(0, q + 3 * w));
    uchar16 q2 = (uchar16)0;
    if (type == TYPE_Q8_0) q2 = (uchar16)(vload4(0, q + 4 * w), vload4(0, q + 5 * w), vload4(0, q + 6 * w), vload4(0, q + 7 * w));
    deq32v(type, q1, q2, qh, d, m, lo, hi);
}

/* f16_bits for 16 values at once */
KV_INL float16 f16_bits16(uint16 h) {
    const uint16 em = h & 0x7fffu;
    const uint16 big = select((em << 13) + 0x38000000u, (em << 13) | 0x7f800000u, em >= 0x7c00u);
    const float16 f = select(as_float16(big), convert_float16(em) * 0x1p-24f, em < 0x400u);
    return as_float16(as_uint16(f) | ((h & 0x8000u) << 16));
}

/* the scales (and mins: 0 for formats without) of the n <= 16 consecutive
 * blocks from b of a 32-element format, lane k for block k (0 past n) */
KV_INL void scales16v(const int type, const global uchar *b, int n, float16 *d, float16 *m) {
    const int bs = bytes32(type);
    if (has_min32(type)) { /* d and m side by side: one 32-bit load a block (blocks of 20 and 24 bytes: aligned) */
        uint hdm[16];
#pragma unroll
        for (int k = 0; k < 16; k++) hdm[k] = k < n ? *(const global uint *)(b + bs * k) : 0;
        const uint16 v = vload16(0, hdm);
        *d = f16_bits16(v & 0xffffu);
        *m = f16_bits16(v >> 16);
        return;
    }
    ushort hd[16];
#pragma unroll
    for (int k = 0; k < 16; k++) hd[k] = k < n ? *(const global ushort *)(b + bs * k) : 0;
    *d = f16_bits16(convert_uint16(vload16(0, hd)));
    *m = 0.0f;
}

/* the same into arrays d[k], m[k] */
KV_INL void scales16(const int type, const global uchar *b, int n, float *d, float *m) {
    float16 dv, mv;
    scales16v(type, b, n, &dv, &mv);
    vstore16(dv, 0, d);
    if (has_min32(type)) vstore16(mv, 0, m);
}

/* ---- K-quants: super-blocks of 256, sub-block j < 8 ---- */

/* the 6-bit scale and min of sub-block j of a Q4_K / Q5_K scales[12] */
KV_INL void scale_min_k4(int j, const global uchar *s, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *mn = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Q4_K (144 bytes): d, dmin, scales[12], qs[128]; sub-blocks 2i and 2i+1
 * share qs[32 i ..] (low, high nibbles); y = (d * sc) * q - dmin * m.
 * Q5_K (176 bytes): d, dmin, scales[12], qh[32], qs[128] as Q4_K; bit j
 * of qh[l] is the fifth bit of element l of sub-block j. */

/* sub-block j of either: qs at byte qs_off, h0 / h1 the fifth bits (times
 * 16) of its two halves (0 for Q4_K) */
KV_INL void deq32_k4(const global uchar *b, int j, int qs_off, int16 h0, int16 h1, float16 *lo, float16 *hi) {
    float sc, mn;
    scale_min_k4(j, b + 4, &sc, &mn);
    const float d1 = f16_at(b, 0) * sc, m1 = f16_at(b, 2) * mn;
    const global uchar *qs = b + qs_off + 32 * (j / 2);
    const uchar16 q0 = vload16(0, qs), q1 = vload16(0, qs + 16);
    const int16 a = ((j & 1) ? nib_hi(q0) : nib_lo(q0)) + h0;
    const int16 c = ((j & 1) ? nib_hi(q1) : nib_lo(q1)) + h1;
    *lo = d1 * convert_float16(a) - m1;
    *hi = d1 * convert_float16(c) - m1;
}

KV_INL void deq32_q4_k(const global uchar *b, int j, float16 *lo, float16 *hi) {
    deq32_k4(b, j, 16, (int16)0, (int16)0, lo, hi);
}

KV_INL void deq32_q5_k(const global uchar *b, int j, float16 *lo, float16 *hi) {
    const int16 h0 = convert_int16((vload16(0, b + 16) >> (uchar16)j) & (uchar16)1) << 4;
    const int16 h1 = convert_int16((vload16(0, b + 32) >> (uchar16)j) & (uchar16)1) << 4;
    deq32_k4(b, j, 48, h0, h1, lo, hi);
}

/* Q6_K (210 bytes): ql[128], qh[64], int8 scales[16], d. Sub-block j is
 * quarter g = j % 4 of half n = j / 4: low 4 bits from ql[64 n + 32 (g & 1)
 * + l] (low nibble for g < 2, high otherwise), 2 high bits (qh[32 n + l] >>
 * 2g), one scale per 16 elements; y = (d * sc) * (q - 32) */
KV_INL void deq32_q6_k(const global uchar *b, int j, float16 *lo, float16 *hi) {
    const int n = j / 4, g = j % 4;
    const global uchar *ql = b + 64 * n + 32 * (g & 1), *qh = b + 128 + 32 * n;
    const global char *sc = (const global char *)(b + 192 + 8 * n + 2 * g);
    const float d = f16_at(b, 208);
    const uchar16 l0 = vload16(0, ql), l1 = vload16(0, ql + 16);
    const uchar sh = (uchar)(2 * g);
    const int16 h0 = convert_int16((vload16(0, qh) >> sh) & (uchar16)3) << 4;
    const int16 h1 = convert_int16((vload16(0, qh + 16) >> sh) & (uchar16)3) << 4;
    const int16 a = ((g < 2) ? nib_lo(l0) : nib_hi(l0)) | h0;
    const int16 c = ((g < 2) ? nib_lo(l1) : nib_hi(l1)) | h1;
    *lo = (d * (float)sc[0]) * convert_float16(a - 32);
    *hi = (d * (float)sc[1]) * convert_float16(c - 32);
}

/* ---- whole K-quant super-blocks (scales decoded once, v[16] = 256 values) ---- */

/* the 8 scales and 8 mins of a Q4_K / Q5_K super-block, times d and dmin */
KV_INL void k4_scales8(const global uchar *b, float8 *d1, float8 *m1) {
    const float d = f16_at(b, 0), dmin = f16_at(b, 2);
    const uchar4 s0 = vload4(0, b + 4), s1 = vload4(0, b + 8), s2 = vload4(0, b + 12);
    const uchar4 sc_lo = s0 & (uchar4)63, mn_lo = s1 & (uchar4)63;
    const uchar4 sc_hi = (s2 & (uchar4)0xF) | ((s0 >> (uchar4)6) << (uchar4)4);
    const uchar4 mn_hi = (s2 >> (uchar4)4) | ((s1 >> (uchar4)6) << (uchar4)4);
    *d1 = d * convert_float8((uchar8)(sc_lo, sc_hi));
    *m1 = dmin * convert_float8((uchar8)(mn_lo, mn_hi));
}

KV_INL void k4_scales(const global uchar *b, float *d1, float *m1) {
    float8 d, m;
    k4_scales8(b, &d, &m);
    vstore8(d, 0, d1);
    vstore8(m, 0, m1);
}

/* Q4_K (qh NULL) or Q5_K: pair p of sub-blocks (2p, 2p + 1) = the low and
 * high nibbles of qs[32 p ..] (qs at byte qs_off), plus bits 2p and 2p + 1
 * of qh[l] for Q5_K */
KV_INL void deq256_k4(const global uchar *b, int qs_off, const global uchar *qh, float16 *v) {
    float d1[8], m1[8];
    k4_scales(b, d1, m1);
    const uchar16 h0 = qh ? vload16(0, qh) : (uchar16)0, h1 = qh ? vload16(1, qh) : (uchar16)0;
#pragma unroll
    for (int p = 0; p < 4; p++) {
        const uchar16 q0 = vload16(0, b + qs_off + 32 * p), q1 = vload16(1, b + qs_off + 32 * p);
        const uchar s0 = (uchar)(2 * p), s1 = (uchar)(2 * p + 1);
        const int16 a0 = nib_lo(q0) + (convert_int16((h0 >> s0) & (uchar16)1) << 4);
        const int16 a1 = nib_lo(q1) + (convert_int16((h1 >> s0) & (uchar16)1) << 4);
        const int16 c0 = nib_hi(q0) + (convert_int16((h0 >> s1) & (uchar16)1) << 4);
        const int16 c1 = nib_hi(q1) + (convert_int16((h1 >> s1) & (uchar16)1) << 4);
        v[4 * p + 0] = d1[2 * p] * convert_float16(a0) - m1[2 * p];
        v[4 * p + 1] = d1[2 * p] * convert_float16(a1) - m1[2 * p];
        v[4 * p + 2] = d1[2 * p + 1] * convert_float16(c0) - m1[2 * p + 1];
        v[4 * p + 3] = d1[2 * p + 1] * convert_float16(c1) - m1[2 * p + 1];
    }
}

/* A packed Q4_K / Q5_K super-block (the integer kernels' layout, below):
 * the same values as deq256_k4, sub-block j into v[2 j], v[2 j + 1] */
KV_INL void deq256_k4_packed(const int type, const global uchar *b, float16 *v) {
    float d1[8], m1[8];
    k4_scales(b, d1, m1);
    const global uchar *hw, *q;
    packed_parts(type, b, 8, &hw, &q);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const uchar16 x = (uchar16)(vload4(0, q + 4 * j), vload4(0, q + 32 + 4 * j), vload4(0, q + 64 + 4 * j),
                                    vload4(0, q + 96 + 4 * j));
        const uint h = type == TYPE_Q5_K ? as_uint(vload4(j, hw)) : 0u;
        v[2 * j] = d1[j] * convert_float16(nib_lo(x) + bits16(h, 0)) - m1[j];
        v[2 * j + 1] = d1[j] * convert_float16(nib_hi(x) + bits16(h, 16)) - m1[j];
    }
}

/* Q6_K: half n, quarter g: values 128 n + 32 g + l (see deq32_q6_k) */
KV_INL void deq256_q6_k(const global uchar *b, float16 *v) {
    const float d = f16_at(b, 208);
    const global char *sc = (const global char *)(b + 192);
#pragma unroll
    for (int n = 0; n < 2; n++) {
        const global uchar *ql = b + 64 * n, *qh = b + 128 + 32 * n;
        const uchar16 h0 = vload16(0, qh), h1 = vload16(1, qh);
#pragma unroll
        for (int g = 0; g < 4; g++) {
            const uchar16 l0 = vload16(0, ql + 32 * (g & 1)), l1 = vload16(1, ql + 32 * (g & 1));
            const uchar sh = (uchar)(2 * g);
            const int16 a = ((g < 2) ? nib_lo(l0) : nib_hi(l0)) | (convert_int16((h0 >> sh) & (uchar16)3) << 4);
            const int16 c = ((g < 2) ? nib_lo(l1) : nib_hi(l1)) | (convert_int16((h1 >> sh) & (uchar16)3) << 4);
            v[8 * n + 2 * g] = (d * (float)sc[8 * n + 2 * g]) * convert_float16(a - 32);
            v[8 * n + 2 * g + 1] = (d * (float)sc[8 * n + 2 * g + 1]) * convert_float16(c - 32);
        }
    }
}

/* ---- any type ---- */

/* Sub-block sb of a row of type `type` (a constant in every kernel that
 * calls it, so the switch folds away). */
KV_INL void deq32(const int type, const global uchar *row, int sb, float16 *lo, float16 *hi) {
    switch (type) {
    case TYPE_F32: {
        const global float *p = (const global float *)row + 32 * sb;
        *lo = vload16(0, p);
        *hi = vload16(1, p);
        break;
    }
    case TYPE_F16: {
        const global half *p = (const global half *)row + 32 * sb;
        *lo = vload_half16(0, p);
        *hi = vload_half16(1, p);
        break;
    }
    case TYPE_BF16: {
        const global ushort *p = (const global ushort *)row + 32 * sb;
        *lo = as_float16(convert_uint16(vload16(0, p)) << 16);
        *hi = as_float16(convert_uint16(vload16(1, p)) << 16);
        break;
    }
    case TYPE_Q4_0:
    case TYPE_Q4_1:
    case TYPE_Q5_0:
    case TYPE_Q5_1:
    case TYPE_Q8_0: deq32_q(type, row + bytes32(type) * sb, lo, hi); break;
    case TYPE_Q4_K: deq32_q4_k(row + 144 * (sb / 8), sb % 8, lo, hi); break;
    case TYPE_Q5_K: deq32_q5_k(row + 176 * (sb / 8), sb % 8, lo, hi); break;
    case TYPE_Q6_K: deq32_q6_k(row + 210 * (sb / 8), sb % 8, lo, hi); break;
    }
}

/* Elements per block as deq_block() decodes them: a K-quant super-block
 * (256), else 32 (one sub-block; float rows too). */
KV_INL int block_elems(const int type) {
    return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K ? 256 : 32;
}

/* Block b of a row into v[0 .. block_elems / 16): whole super-blocks for
 * the K-quants (their scales decoded once), sub-blocks otherwise. */
KV_INL void deq_block(const int type, const global uchar *row, int b, float16 *v) {
    switch (type) {
    case TYPE_Q4_K: deq256_k4(row + 144 * b, 16, NULL, v); break;
    case TYPE_Q5_K: deq256_k4(row + 176 * b, 48, row + 176 * b + 16, v); break;
    case TYPE_Q6_K: deq256_q6_k(row + 210 * b, v); break;
    default: deq32(type, row, b, &v[0], &v[1]); break;
    }
}

/* Element i of a float row (the tail past the last whole sub-block).
 * Quantized rows have no tail, so they never get here. */
KV_INL float deq1(const int type, const global uchar *row, int i) {
    switch (type) {
    case TYPE_F32: return ((const global float *)row)[i];
    case TYPE_F16: return vload_half(i, (const global half *)row);
    case TYPE_BF16: return as_float((uint)((const global ushort *)row)[i] << 16);
    }
    return 0.0f;
}

/* sum of the 16 lanes */
KV_INL float hsum16(float16 v) {
    float8 a = v.lo + v.hi;
    float4 b = a.lo + a.hi;
    float2 c = b.lo + b.hi;
    return c.x + c.y;
}
