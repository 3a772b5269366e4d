/*
 * quant_avx2.c — AVX2/FMA/F16C versions of the hot kernels.
 *
 * Every function carries a target attribute instead of the whole file being
 * compiled with -mavx2, so the library still loads on older CPUs;
 * kv_kernels_avx2() checks the CPU before installing anything.
 *
 * 32-element formats (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0) against Q8_0 / Q8_1:
 *   - decode (1 token): gemv8, 8 weight rows in the 8 float lanes; each
 *     row's exact int32 block sum is folded into its lane (hadd), so one
 *     convert and one or two FMAs serve 8 rows; rows further on are
 *     prefetched.
 *   - prefill, 8 or 16 tokens: tile8 / tile16 on the interleaved layout
 *     (quant_impl.h): 4 weight quants are broadcast and multiplied with 8
 *     tokens' 4 quants at once; lanes are tokens, so no horizontal sums.
 *   Both give every (row, token) the same float steps (see the section),
 *   so the results are batch invariant. The 4/5-bit quants stay unsigned
 *   (maddubs takes u8 x s8); their offset (-8, -16) or min is applied with
 *   the activation block sums of the side table. The integer products use
 *   maddubs (u8 x s8 -> s16 pairs) and madd with ones (-> s32), or VNNI's
 *   vpdpbusd.
 * K-quants (Q4_K Q5_K Q6_K) against Q8_K: 1 row x 4 tokens (or 1), the
 *   same steps per token either way; Q6_K's -32 and the K4 mins go through
 *   the Q8_K bsums.
 * Float weights (F32 F16 BF16) against F32: FMA loops.
 *
 * The activation quantizers reproduce the scalar ones byte for byte
 * (roundf's ties-away-from-zero is rebuilt from truncation), so the fast
 * and the reference paths see identical integer inputs.
 */
#include "quant_impl.h"

#include <math.h>
#include <string.h>

#include "types.h"

#ifndef KV_VNNI
#define KV_VNNI 0
#endif
#if KV_VNNI
#define KV_KERNELS_INSTALL kv_kernels_vnni
#else
#define KV_KERNELS_INSTALL kv_kernels_avx2
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <immintrin.h>

/* quant_vnni.c includes this file with KV_VNNI 1: the same kernels with the
 * u8 x s8 dot products done by AVX512-VNNI's vpdpbusd (on 256-bit vectors),
 * which adds 4 products straight into int32 lanes (no 16-bit step). */
#if KV_VNNI
#define KV_AVX2 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#else
#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif
#define KV_INL static inline __attribute__((always_inline)) KV_AVX2

/* =========================================================================
 * helpers
 * ========================================================================= */

KV_INL float h2f(uint16_t h) { return _cvtsh_ss(h); }

KV_INL float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

KV_INL int hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* acc + the int32 lane sums of 4 adjacent u8 x s8 products (exact: the
 * AVX2 pair sums cannot saturate on the operands used here, |u| <= 128). */
KV_INL __m256i dp_u8s8(__m256i acc, __m256i u, __m256i s) {
#if KV_VNNI
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Prefetch distance of the decode kernels, into L2 (T1: L1's miss buffers
 * would cap the distance): about this many bytes on, whole groups of 8 rows
 * in gemv8. 8 to 32 KiB read weights from memory fastest on Zen 4 (one
 * thread ~1.4x faster than 4 KiB to L1). */
#define GEMV_PF_BYTES 16384

/* The lines of the n bytes at p (n a constant), into L2. */
KV_INL void prefetch_lines(const void *p, int n) {
#pragma GCC unroll 8
    for (int i = 0; i < (n + 63) / 64; i++) _mm_prefetch((const char *)p + 64 * i, _MM_HINT_T1);
}

/* 16 bytes of packed nibbles -> 32 bytes 0..15: low nibbles first (elements 0..15). */
KV_INL __m256i nibbles32(const uint8_t *q) {
    __m128i t = _mm_loadu_si128((const __m128i *)q);
    __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* 32 bits -> 32 bytes, 0xFF where the bit is set. */
KV_INL __m256i bits32(const uint8_t *qh) {
    uint32_t x;
    memcpy(&x, qh, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

/* =========================================================================
 * 32-element formats x Q8_0 / Q8_1
 *
 * The order of the sums is fixed, so that a row of y does not depend on how
 * many rows and tokens are computed beside it (batch invariance: decode and
 * prefill give a token the same bits). For each (row, token), blocks b in
 * order, with I the exact int32 sum of the block's 32 products (the weight
 * quants as stored: unsigned u for the 4/5-bit formats, signed for Q8_0),
 * dw / mw the weight block's scale / min, dx the activation block's scale
 * and sx = dx * sum(qx) (a float product, from the side table):
 *   Q4_0, Q5_0:  acc = fma(dw, fma(I, dx, -off * sx), acc)    off = 8, 16
 *   Q4_1, Q5_1:  acc = fma(dw, I * dx, acc);  acc = fma(mw, sx, acc)
 *   Q8_0:        acc = fma(dw, I * dx, acc)
 * and y = acc (w32_acc). Integer sums are exact in any order, so the
 * kernels group the products as suits them; only the float steps above are
 * shared. Lanes are tokens in the prefill tiles (tile8, tile16) and rows in
 * the decode kernel (gemv8); a lane never mixes with another.
 * ========================================================================= */

/* Weight block b of a row: the 32 quants as bytes (unsigned 0..15 / 0..31
 * for the 4- and 5-bit formats, signed for Q8_0), the scale d, and c, the
 * coefficient of the activation block's sum d_x * sum(q_x): the offset of
 * the symmetric formats (-8 d, -16 d) or the min of Q4_1 / Q5_1. */
KV_INL __m256i w32_load(int WT, const uint8_t *row, int64_t b, float *d, float *c) {
    switch (WT) {
    case KV_TYPE_Q4_0: {
        const kv_block_q4_0 *x = (const kv_block_q4_0 *)row + b;
        *d = h2f(x->d), *c = -8 * *d;
        return nibbles32(x->qs);
    }
    case KV_TYPE_Q4_1: {
        const kv_block_q4_1 *x = (const kv_block_q4_1 *)row + b;
        *d = h2f(x->d), *c = h2f(x->m);
        return nibbles32(x->qs);
    }
    case KV_TYPE_Q5_0: {
        const kv_block_q5_0 *x = (const kv_block_q5_0 *)row + b;
        *d = h2f(x->d), *c = -16 * *d;
        __m256i hi = _mm256_and_si256(bits32(x->qh), _mm256_set1_epi8(0x10));
        return _mm256_or_si256(nibbles32(x->qs), hi);
    }
    case KV_TYPE_Q5_1: {
        const kv_block_q5_1 *x = (const kv_block_q5_1 *)row + b;
        *d = h2f(x->d), *c = h2f(x->m);
        __m256i hi = _mm256_and_si256(bits32(x->qh), _mm256_set1_epi8(0x10));
        return _mm256_or_si256(nibbles32(x->qs), hi);
    }
    default: { /* Q8_0 */
        const kv_block_q8_0 *x = (const kv_block_q8_0 *)row + b;
        *d = h2f(x->d), *c = 0;
        return _mm256_loadu_si256((const __m256i *)x->qs);
    }
    }
}

#define W32_SIGNED(WT) ((WT) == KV_TYPE_Q8_0)
#define W32_MIN(WT) ((WT) == KV_TYPE_Q4_1 || (WT) == KV_TYPE_Q5_1)
#define W32_5BIT(WT) ((WT) == KV_TYPE_Q5_0 || (WT) == KV_TYPE_Q5_1)
#define W32_BS(WT) ((WT) == KV_TYPE_Q4_0 ? 18 : (WT) == KV_TYPE_Q4_1 ? 20 : (WT) == KV_TYPE_Q5_0 ? 22 \
                    : (WT) == KV_TYPE_Q5_1 ? 24 : 34)
/* byte offsets in a weight block: the high bits (Q5), the quants */
#define W32_QH(WT) (W32_MIN(WT) ? 4 : 2)
#define W32_QS(WT) ((W32_MIN(WT) ? 4 : 2) + (W32_5BIT(WT) ? 4 : 0))
/* activation blocks: Q8_1 (36 bytes, qs at 4) for Q4_1 / Q5_1, else Q8_0 (34, qs at 2) */
#define X32_BS(WT) (W32_MIN(WT) ? 36 : 34)
#define X32_QS(WT) (W32_MIN(WT) ? 4 : 2)
/* The symmetric 4/5-bit formats are stored as unsigned u = q + off. */
#define W32_OFF(WT) ((WT) == KV_TYPE_Q4_0 ? 8 : (WT) == KV_TYPE_Q5_0 ? 16 : 0)

/* The float step of block b (see the top of this section), lane by lane:
 * I the exact block sums, dw / mw the weight scales / mins, dx / sx the
 * activation scales / scaled sums. */
KV_INL __m256 w32_acc(int WT, __m256 acc, __m256i I, __m256 dw, __m256 mw, __m256 dx, __m256 sx) {
    __m256 v = _mm256_cvtepi32_ps(I);
    if (W32_OFF(WT))
        return _mm256_fmadd_ps(dw, _mm256_fmadd_ps(v, dx, _mm256_mul_ps(sx, _mm256_set1_ps(-W32_OFF(WT)))), acc);
    acc = _mm256_fmadd_ps(dw, _mm256_mul_ps(v, dx), acc);
    return W32_MIN(WT) ? _mm256_fmadd_ps(mw, sx, acc) : acc;
}

/* 8 int32 partial sums of one weight block times one activation block */
KV_INL __m256i w32_dot(int WT, __m256i wq, __m256i wa, __m256i xq) {
    return W32_SIGNED(WT) ? dp_u8s8(_mm256_setzero_si256(), wa, _mm256_sign_epi8(xq, wq))
                          : dp_u8s8(_mm256_setzero_si256(), wq, xq);
}

/* ---- decode: 8 rows in the lanes ------------------------------------------ */

/* 16 bytes at p in the low 128-bit lane, 16 at q in the high one. */
KV_INL __m256i load2x128(const uint8_t *p, const uint8_t *q) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                   _mm_loadu_si128((const __m128i *)q), 1);
}

/* 0x10 in the bytes of elements 16h .. 16h + 15 whose fifth bit is set, for
 * two blocks with high-bit words a (low lane) and c (high lane). */
KV_INL __m256i hbits_pair(uint32_t a, uint32_t c, int h) {
#if KV_VNNI
    __mmask32 k = h ? (a >> 16) | (c & 0xFFFF0000u) : (a & 0xFFFFu) | (c << 16);
    return _mm256_maskz_mov_epi8(k, _mm256_set1_epi8(0x10));
#else
    /* byte j of a lane <- byte 2h + j / 8 of its word */
    const int64_t b0 = 0x0101010101010101 * (2 * h), b1 = 0x0101010101010101 * (2 * h + 1);
    __m256i v = _mm256_set_m128i(_mm_set1_epi32((int)c), _mm_set1_epi32((int)a));
    v = _mm256_shuffle_epi8(v, _mm256_setr_epi64x(b0, b1, b0, b1));
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)); /* all ones iff the bit is set */
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
#endif
}

/* Block b of rows p (low lane) and q (high lane) of a 4/5-bit format as
 * unsigned quants: elements 0..15 in *lo, 16..31 in *hi. */
KV_INL void w32_pair(int WT, const uint8_t *p, const uint8_t *q, size_t o, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i v = load2x128(p + o + W32_QS(WT), q + o + W32_QS(WT));
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (W32_5BIT(WT)) {
        uint32_t a, c;
        memcpy(&a, p + o + W32_QH(WT), 4), memcpy(&c, q + o + W32_QH(WT), 4);
        *lo = _mm256_or_si256(*lo, hbits_pair(a, c, 0));
        *hi = _mm256_or_si256(*hi, hbits_pair(a, c, 1));
    }
}

/* [4 int32 partial sums of row p | 4 of row q] of a pair against the
 * activation block's elements 0..15 (xlo) and 16..31 (xhi), both lanes. */
KV_INL __m256i dp_pair(__m256i lo, __m256i hi, __m256i xlo, __m256i xhi) {
#if KV_VNNI
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xlo), hi, xhi);
#else /* pair sums <= 2 * 2 * 31 * 127 fit in 16 bits */
    __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* p[k] = [row k | row k + 4] partial sums -> [sum of row 0 .. sum of row 7]. */
KV_INL __m256i fold_pairs(const __m256i p[4]) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
}

/* p[k] = 8 partial sums of row k -> [sum of row 0 .. sum of row 7]. */
KV_INL __m256i fold8(const __m256i p[8]) {
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

KV_INL int32_t load_i32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
KV_INL int load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* The scales (and, for Q4_1 / Q5_1, the mins in *m) of the blocks at byte
 * o of 8 rows, lane k = row k. */
KV_INL __m256 w32_scales8(int WT, const uint8_t *const row[8], size_t o, __m256 *m) {
    if (W32_MIN(WT)) { /* d and m adjacent: 32-bit loads, then split */
        __m128i a = _mm_cvtsi32_si128(load_i32(row[0] + o)), c = _mm_cvtsi32_si128(load_i32(row[4] + o));
        a = _mm_insert_epi32(a, load_i32(row[1] + o), 1), c = _mm_insert_epi32(c, load_i32(row[5] + o), 1);
        a = _mm_insert_epi32(a, load_i32(row[2] + o), 2), c = _mm_insert_epi32(c, load_i32(row[6] + o), 2);
        a = _mm_insert_epi32(a, load_i32(row[3] + o), 3), c = _mm_insert_epi32(c, load_i32(row[7] + o), 3);
        const __m128i split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        a = _mm_shuffle_epi8(a, split), c = _mm_shuffle_epi8(c, split);
        *m = _mm256_cvtph_ps(_mm_unpackhi_epi64(a, c));
        return _mm256_cvtph_ps(_mm_unpacklo_epi64(a, c));
    }
    __m128i h = _mm_cvtsi32_si128(load_u16(row[0] + o));
    h = _mm_insert_epi16(h, load_u16(row[1] + o), 1), h = _mm_insert_epi16(h, load_u16(row[2] + o), 2);
    h = _mm_insert_epi16(h, load_u16(row[3] + o), 3), h = _mm_insert_epi16(h, load_u16(row[4] + o), 4);
    h = _mm_insert_epi16(h, load_u16(row[5] + o), 5), h = _mm_insert_epi16(h, load_u16(row[6] + o), 6);
    h = _mm_insert_epi16(h, load_u16(row[7] + o), 7);
    *m = _mm256_setzero_ps();
    return _mm256_cvtph_ps(h);
}

/* y[0 .. nr) for rows W, W + ws, ... (nr <= 8) and token t of X (decode):
 * lanes are rows; rows past nr repeat the last one and are not stored.
 * The rows pf bytes on (a later group) are prefetched line by line in
 * address order, 8 blocks' worth per step. */
KV_INL void gemv8(int WT, int64_t nb, const uint8_t *W, size_t ws, int nr, const uint8_t *X,
                  const float *xf, int64_t t, float *y, size_t pf) {
    const uint8_t *row[8];
    for (int k = 0; k < 8; k++) row[k] = W + (size_t)(k < nr ? k : nr - 1) * ws;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        size_t o = (size_t)b * W32_BS(WT);
        prefetch_lines(W + pf + 8 * o, 8 * W32_BS(WT));
        const uint8_t *xq = X + b * X32_BS(WT) + X32_QS(WT);
        __m256i I;
        if (W32_SIGNED(WT)) {
            __m256i x = _mm256_loadu_si256((const __m256i *)xq), p[8];
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(row[k] + o + 2));
                p[k] = dp_u8s8(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
            }
            I = fold8(p);
        } else {
            __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xq));
            __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xq + 16)));
            __m256i p[4];
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                __m256i lo, hi;
                w32_pair(WT, row[k], row[k + 4], o, &lo, &hi);
                p[k] = dp_pair(lo, hi, xlo, xhi);
            }
            I = fold_pairs(p);
        }
        __m256 mw, dw = w32_scales8(WT, row, o, &mw);
        const float *f = xf + KV_XF(t, b, nb);
        acc = w32_acc(WT, acc, I, dw, mw, _mm256_set1_ps(f[0]), _mm256_set1_ps(f[4]));
    }
    if (nr == 8) {
        _mm256_storeu_ps(y, acc);
    } else {
        float o[8];
        _mm256_storeu_ps(o, acc);
        memcpy(y, o, (size_t)nr * sizeof(float));
    }
}

/* ---- prefill: 8 or 16 tokens in the lanes ---------------------------------- */

/* Scales of block b of 4 rows (rows ws bytes apart): d as [d0 d1 d2 d3 d0 d1 d2 d3];
 * for Q4_1 / Q5_1 also the mins as [m0 m1 m2 m3 . . . .]. */
KV_INL __m256 w32_scales4(int WT, const uint8_t *W, size_t ws, int64_t b, __m256 *m) {
    const uint8_t *p = W + b * W32_BS(WT);
    if (W32_MIN(WT)) { /* d, m adjacent halves */
        int32_t v0, v1, v2, v3;
        memcpy(&v0, p, 4), memcpy(&v1, p + ws, 4), memcpy(&v2, p + 2 * ws, 4), memcpy(&v3, p + 3 * ws, 4);
        __m256 f = _mm256_cvtph_ps(_mm_setr_epi32(v0, v1, v2, v3)); /* d0 m0 d1 m1 d2 m2 d3 m3 */
        *m = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7));
        return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    }
    uint16_t h0, h1, h2, h3;
    memcpy(&h0, p, 2), memcpy(&h1, p + ws, 2), memcpy(&h2, p + 2 * ws, 2), memcpy(&h3, p + 3 * ws, 2);
    __m128 d = _mm_cvtph_ps(_mm_setr_epi16((short)h0, (short)h1, (short)h2, (short)h3, 0, 0, 0, 0));
    *m = _mm256_setzero_ps();
    return _mm256_set_m128(d, d);
}

/* Weight block b of a row as the bytes the prefill tiles broadcast: the
 * 4/5-bit quants as they are; Q8_0's signed quants + 128 with VNNI (u8 for
 * vpdpbusd; the 128 * sum(qx) this adds is taken off with the side table's
 * integer sums), else their magnitudes, the signs going to *sg. */
KV_INL void w32_bytes(int WT, const uint8_t *row, int64_t b, uint8_t *u, uint8_t *sg, float *d, float *c) {
    __m256i q = w32_load(WT, row, b, d, c);
    if (W32_SIGNED(WT)) {
#if KV_VNNI
        q = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
#else
        _mm256_store_si256((__m256i *)sg, q);
        q = _mm256_sign_epi8(q, q);
#endif
    }
    _mm256_store_si256((__m256i *)u, q);
}

/* isum (int32 per token) += the products of 4 weight quants (broadcast) and
 * the 8 tokens' 4 quants xv; s16 the 16-bit partial sums (AVX2) that
 * widen() moves into isum. */
KV_INL void t8_step(int WT, __m256i *isum, __m256i *s16, const uint8_t *u, const uint8_t *sg, __m256i xv) {
    __m256i wv = _mm256_castps_si256(_mm256_broadcast_ss((const float *)u));
#if KV_VNNI
    (void)sg, (void)s16;
    *isum = _mm256_dpbusd_epi32(*isum, wv, xv);
#else
    if (W32_SIGNED(WT)) { /* |w| x sign(w) x: pairs of 2 * 128 * 127 fit, one step */
        __m256i sv = _mm256_castps_si256(_mm256_broadcast_ss((const float *)sg));
        *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(_mm256_maddubs_epi16(wv, _mm256_sign_epi8(xv, sv)),
                                                          _mm256_set1_epi16(1)));
    } else {
        *s16 = _mm256_add_epi16(*s16, _mm256_maddubs_epi16(wv, xv));
    }
#endif
}

KV_INL void t8_widen(int WT, __m256i *isum, __m256i *s16) {
#if !KV_VNNI
    if (!W32_SIGNED(WT)) {
        *isum = _mm256_add_epi32(*isum, _mm256_madd_epi16(*s16, _mm256_set1_epi16(1)));
        *s16 = _mm256_setzero_si256();
    }
#endif
}

/* The exact block sums I of a token group: isum less VNNI Q8_0's 128 * sum(qx). */
KV_INL __m256i t8_sums(int WT, __m256i isum, const float *f) {
    if (KV_VNNI && W32_SIGNED(WT))
        return _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_load_si256((const __m256i *)(f + 16)), 7));
    return isum;
}

/* Stores lanes t < nt of v as y[t * ldy]. */
KV_INL void store_tokens(__m256 v, float *y, int64_t ldy, int nt) {
    _Alignas(32) float o[8];
    _mm256_store_ps(o, v);
    for (int t = 0; t < 8 && t < nt; t++) y[t * ldy] = o[t];
}

/* NR rows x 8 tokens on the interleaved layout (see quant_impl.h): for each
 * group g of 4 weight quants, broadcast them and multiply with the 8 tokens'
 * 4 quants at once; lanes stay tokens, so no horizontal sums at all. The
 * 16-bit sums are widened every FL groups (8 * 2 * 15 * 127 < 32768 for the
 * 4-bit formats, 4 groups for the 5-bit ones). Tokens t < nt are stored. */
KV_INL void tile8(int WT, int NR, int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,
                  const float *xs8, float *y, int64_t ldy, int nt) {
    const int FL = W32_5BIT(WT) ? 4 : 8;
    __m256 acc[4];
    _Alignas(32) uint8_t wb[4][32], sg[4][32];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        float wd[4], wc[4];
        /* the next rows' block b: weights larger than the caches stream from
         * memory, and the hardware prefetchers stop at page ends */
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) _mm_prefetch((const char *)W + (NR + r) * ws + b * W32_BS(WT), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) w32_bytes(WT, W + r * ws, b, wb[r], sg[r], &wd[r], &wc[r]);
        __m256 d4 = _mm256_setzero_ps(), m4 = d4;
        if (NR == 4) d4 = w32_scales4(WT, W, ws, b, &m4); /* 4 rows' scales in one convert */
        const uint8_t *xb = xi + b * 256;
        __m256i isum[4], s16[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) isum[r] = _mm256_setzero_si256(), s16[r] = isum[r];
        for (int h = 0; h < 8; h += FL) {
            /* a rolled loop keeps the 16-bit sums in registers (fully
             * unrolled, gcc turns the chains into trees and spills) */
#pragma GCC unroll 2
            for (int g = h; g < h + FL; g++) {
                __m256i xv = _mm256_load_si256((const __m256i *)(xb + 32 * g));
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) t8_step(WT, &isum[r], &s16[r], &wb[r][4 * g], &sg[r][4 * g], xv);
            }
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) t8_widen(WT, &isum[r], &s16[r]);
        }
        const float *f = xs8 + b * KV_X8F;
        __m256 dx = _mm256_load_ps(f), sx = _mm256_load_ps(f + 8);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            __m256 dr, mr;
            if (NR == 4) {
                dr = _mm256_permutevar8x32_ps(d4, _mm256_set1_epi32(r));
                mr = _mm256_permutevar8x32_ps(m4, _mm256_set1_epi32(r));
            } else {
                dr = _mm256_set1_ps(wd[r]), mr = _mm256_set1_ps(wc[r]);
            }
            acc[r] = w32_acc(WT, acc[r], t8_sums(WT, isum[r], f), dr, mr, dx, sx);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) store_tokens(acc[r], y + r, ldy, nt);
}

#if KV_VNNI
/* tile8 for 4 rows with 512-bit vectors: lanes 0-7 hold row r's 8 tokens,
 * lanes 8-15 row r + 1's (two row pairs), so one vpdpbusd serves two rows.
 * Every lane goes through the integer sums and the float steps tile8 gives
 * it, in the same order: the same bits, in half the instructions. */
KV_INL __m512 w32_acc_z(int WT, __m512 acc, __m512i I, __m512 dw, __m512 mw, __m512 dx, __m512 sx) {
    __m512 v = _mm512_cvtepi32_ps(I);
    if (W32_OFF(WT))
        return _mm512_fmadd_ps(dw, _mm512_fmadd_ps(v, dx, _mm512_mul_ps(sx, _mm512_set1_ps(-W32_OFF(WT)))), acc);
    acc = _mm512_fmadd_ps(dw, _mm512_mul_ps(v, dx), acc);
    return W32_MIN(WT) ? _mm512_fmadd_ps(mw, sx, acc) : acc;
}

KV_INL __m512 dup256_ps(__m256 v) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v))); }

KV_INL void tile8_z(int WT, int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi, const float *xs8, float *y,
                    int64_t ldy, int nt) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    _Alignas(32) uint8_t wb[4][32], sg[4][32];
    const __m512i pair_idx[2] = {_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                 _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2)};
    for (int64_t b = 0; b < nb; b++) {
        float wd[4], wc[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) _mm_prefetch((const char *)W + (4 + r) * ws + b * W32_BS(WT), _MM_HINT_T0);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) w32_bytes(WT, W + r * ws, b, wb[r], sg[r], &wd[r], &wc[r]);
        __m256 m4 = _mm256_setzero_ps(), d4 = w32_scales4(WT, W, ws, b, &m4);
        const uint8_t *xb = xi + b * 256;
        __m512i isum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, w2[2];
#pragma GCC unroll 2
        for (int p = 0; p < 2; p++) /* [row 2p's quants | row 2p+1's] */
            w2[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)wb[2 * p])),
                                       _mm256_load_si256((const __m256i *)wb[2 * p + 1]), 1);
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const __m512i xv = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(xb + 32 * g)));
            const __m512i ix = _mm512_add_epi32(_mm512_set1_epi32(g), _mm512_set_epi32(8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0));
#pragma GCC unroll 2
            for (int p = 0; p < 2; p++) isum[p] = _mm512_dpbusd_epi32(isum[p], _mm512_permutexvar_epi32(ix, w2[p]), xv);
        }
        const float *f = xs8 + b * KV_X8F;
        const __m512 dx = dup256_ps(_mm256_load_ps(f)), sx = dup256_ps(_mm256_load_ps(f + 8));
#pragma GCC unroll 2
        for (int p = 0; p < 2; p++) {
            __m512i I = isum[p];
            if (W32_SIGNED(WT)) /* t8_sums: the +128 bias of the quants off */
                I = _mm512_sub_epi32(I, _mm512_slli_epi32(_mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(f + 16))), 7));
            const __m512 dw = _mm512_permutexvar_ps(pair_idx[p], _mm512_castps256_ps512(d4));
            const __m512 mw = _mm512_permutexvar_ps(pair_idx[p], _mm512_castps256_ps512(m4));
            acc[p] = w32_acc_z(WT, acc[p], I, dw, mw, dx, sx);
        }
    }
#pragma GCC unroll 2
    for (int p = 0; p < 2; p++) {
        _Alignas(64) float o[16];
        _mm512_store_ps(o, acc[p]);
        for (int t = 0; t < 8 && t < nt; t++) y[t * ldy + 2 * p] = o[t], y[t * ldy + 2 * p + 1] = o[8 + t];
    }
}

/* 16 rows x 8 tokens with the rows in the lanes (the 32-element formats):
 * the weights of a block are transposed so that vector g holds group g (4
 * quants) of the 16 rows, and each token's 4 activation quants of group g
 * come in as an embedded broadcast, so there are no shuffles in the inner
 * loop. Lane 4i + j holds row 4j + i (a 4 x 4 transpose within the 128-bit
 * lanes; Q8_0: lane L row L); the stores put the rows back in order. The
 * integer sums and the float steps of a (row, token) are those of the
 * other tiles: the same bits. */
#define R16_OK(WT) ((WT) == KV_TYPE_Q4_0 || (WT) == KV_TYPE_Q4_1 || (WT) == KV_TYPE_Q5_0 || (WT) == KV_TYPE_Q5_1 || \
                    (WT) == KV_TYPE_Q8_0)

/* 16 bytes at each of 16 rows (p, ws apart) -> t[k] = dword k of every row, lane 4i + j <- row 4j + i. */
KV_INL void r16_transpose(const uint8_t *p, size_t ws, __m512i t[4]) {
    __m512i z[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const uint8_t *q = p + (size_t)(4 * j) * ws;
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)q));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q + ws)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q + 2 * ws)), 2);
        z[j] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q + 3 * ws)), 3);
    }
    /* z[j] lane i = row 4j + i */
    const __m512i a0 = _mm512_unpacklo_epi32(z[0], z[1]), a1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i a2 = _mm512_unpacklo_epi32(z[2], z[3]), a3 = _mm512_unpackhi_epi32(z[2], z[3]);
    t[0] = _mm512_unpacklo_epi64(a0, a2), t[1] = _mm512_unpackhi_epi64(a0, a2);
    t[2] = _mm512_unpacklo_epi64(a1, a3), t[3] = _mm512_unpackhi_epi64(a1, a3);
}

/* 32 bytes at each of 16 rows (p, ws apart) -> t[k] = dword k of every row,
 * lane L <- row L (not r16_transpose's order): 4 x 4 transposes within the
 * 128-bit lanes of [row r | row r + 4] pairs, then the lanes regrouped. */
KV_INL void r16_transpose32(const uint8_t *p, size_t ws, __m512i t[8]) {
    __m512i u[2][4];
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 */
        __m512i z[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) { /* lanes [r.lo r.hi r'.lo r'.hi], r = 8h + k, r' = r + 4 */
            const uint8_t *q = p + (size_t)(8 * h + k) * ws;
            z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q)),
                                      _mm256_loadu_si256((const __m256i *)(q + 4 * ws)), 1);
        }
        const __m512i a0 = _mm512_unpacklo_epi32(z[0], z[1]), a1 = _mm512_unpackhi_epi32(z[0], z[1]);
        const __m512i a2 = _mm512_unpacklo_epi32(z[2], z[3]), a3 = _mm512_unpackhi_epi32(z[2], z[3]);
        /* u[h][k] lanes: dword k of rows 8h+0..3 | dword 4+k of them | dword k of rows 8h+4..7 | dword 4+k */
        u[h][0] = _mm512_unpacklo_epi64(a0, a2), u[h][1] = _mm512_unpackhi_epi64(a0, a2);
        u[h][2] = _mm512_unpacklo_epi64(a1, a3), u[h][3] = _mm512_unpackhi_epi64(a1, a3);
    }
    /* 128-bit lanes 0 / 2 of u[h][k] (dword k of rows 8h..8h+3 / 8h+4..8h+7)
     * side by side: lane L holds row L */
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        t[k] = _mm512_shuffle_i64x2(u[0][k], u[1][k], 0x88);     /* lanes 0, 2 of each: dword k */
        t[4 + k] = _mm512_shuffle_i64x2(u[0][k], u[1][k], 0xDD); /* lanes 1, 3: dword 4 + k */
    }
}

KV_INL void tile8_r16(int WT, int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi, const float *xs8, float *y,
                      int64_t ldy, int nt) {
    __m512 acc[8];
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) acc[t] = _mm512_setzero_ps();
    /* lane L's row: 4 (L % 4) + L / 4 (r16_transpose; the map is its own
     * inverse, so the stores use it too), L for Q8_0 (r16_transpose32) */
    const __m512i swap = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i lane = W32_SIGNED(WT) ? _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15) : swap;
    const __m512i roff = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)ws));
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = W + b * W32_BS(WT);
        /* block b of the rows two tiles ahead, into L2 (the hardware prefetchers
         * stop at page ends; into L1 the requests queue behind the loads) */
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) _mm_prefetch((const char *)wb + (32 + r) * ws, _MM_HINT_T1);
        const __m512i dm = _mm512_i32gather_epi32(roff, wb, 1); /* d (| m) of each lane's row */
        const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        const __m512 mw = W32_MIN(WT) ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16))) : dw;
        __m512i wt[8];
        if (W32_SIGNED(WT)) { /* Q8_0: quants + 128 as u8; 128 * sum(qx) taken off below */
            r16_transpose32(wb + W32_QS(WT), ws, wt);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) wt[k] = _mm512_xor_si512(wt[k], _mm512_set1_epi8((char)0x80));
        } else { /* byte i: element i (low nibble), element 16 + i (high) */
            __m512i q[4];
            r16_transpose(wb + W32_QS(WT), ws, q);
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                wt[k] = _mm512_and_si512(q[k], m4), wt[4 + k] = _mm512_and_si512(_mm512_srli_epi16(q[k], 4), m4);
            if (W32_5BIT(WT)) { /* element e's fifth bit: bit e of the row's qh word */
                const __m512i qh = _mm512_i32gather_epi32(roff, wb + W32_QH(WT), 1);
#pragma GCC unroll 8
                for (int g = 0; g < 8; g++) {
                    /* byte g / 2 of each lane's qh in all four of its bytes; byte j tests bit 4 (g % 2) + j */
                    const __m512i ctl = _mm512_add_epi8(_mm512_set4_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0),
                                                        _mm512_set1_epi8((char)(g / 2)));
                    const __m512i bit = _mm512_set1_epi32(g % 2 ? (int)0x80402010 : 0x08040201);
                    const __mmask64 k = _mm512_test_epi8_mask(_mm512_shuffle_epi8(qh, ctl), bit);
                    wt[g] = _mm512_mask_add_epi8(wt[g], k, wt[g], _mm512_set1_epi8(0x10));
                }
            }
        }
        const uint8_t *xb = xi + b * 256;
        __m512i isum[8];
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) isum[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const int32_t *xg = (const int32_t *)(xb + 32 * g);
#pragma GCC unroll 8
            for (int t = 0; t < 8; t++) isum[t] = _mm512_dpbusd_epi32(isum[t], wt[g], _mm512_set1_epi32(xg[t]));
        }
        const float *f = xs8 + b * KV_X8F;
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            __m512i I = isum[t];
            if (W32_SIGNED(WT)) {
                int32_t sq;
                memcpy(&sq, f + 16 + t, 4);
                I = _mm512_sub_epi32(I, _mm512_set1_epi32((int32_t)((uint32_t)sq << 7)));
            }
            acc[t] = w32_acc_z(WT, acc[t], I, dw, mw, _mm512_set1_ps(f[t]), _mm512_set1_ps(f[8 + t]));
        }
    }
    /* row R = 4j + i sits in lane 4i + j (Q8_0: in lane R) */
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++)
        if (t < nt) _mm512_storeu_ps(y + t * ldy, W32_SIGNED(WT) ? acc[t] : _mm512_permutexvar_ps(swap, acc[t]));
}
#endif

/* NR rows x 16 tokens (two consecutive 8-token groups): each broadcast weight
 * group serves 16 tokens and the block overhead is paid once per 16. */
KV_INL void tile16(int WT, int NR, int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,
                   const float *xs8, float *y, int64_t ldy, int nt) {
    const int FL = W32_5BIT(WT) ? 4 : 8;
    __m256 acc[2][2];
    _Alignas(32) uint8_t wb[2][32], sg[2][32];
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const uint8_t *xi1 = xi + nb * 256;
    const float *xs1 = xs8 + nb * KV_X8F;
    for (int64_t b = 0; b < nb; b++) {
        float wd[2], wc[2];
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) _mm_prefetch((const char *)W + (NR + r) * ws + b * W32_BS(WT), _MM_HINT_T0);
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) w32_bytes(WT, W + r * ws, b, wb[r], sg[r], &wd[r], &wc[r]);
        const uint8_t *xb0 = xi + b * 256, *xb1 = xi1 + b * 256;
        __m256i isum[2][2], s16[2][2];
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++)
            isum[r][0] = isum[r][1] = s16[r][0] = s16[r][1] = _mm256_setzero_si256();
        for (int h = 0; h < 8; h += FL) {
#pragma GCC unroll 2
            for (int g = h; g < h + FL; g++) {
                __m256i x0 = _mm256_load_si256((const __m256i *)(xb0 + 32 * g));
                __m256i x1 = _mm256_load_si256((const __m256i *)(xb1 + 32 * g));
#pragma GCC unroll 2
                for (int r = 0; r < NR; r++) {
                    t8_step(WT, &isum[r][0], &s16[r][0], &wb[r][4 * g], &sg[r][4 * g], x0);
                    t8_step(WT, &isum[r][1], &s16[r][1], &wb[r][4 * g], &sg[r][4 * g], x1);
                }
            }
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++) t8_widen(WT, &isum[r][0], &s16[r][0]), t8_widen(WT, &isum[r][1], &s16[r][1]);
        }
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++) {
            const float *f = (k ? xs1 : xs8) + b * KV_X8F;
            __m256 dx = _mm256_load_ps(f), sx = _mm256_load_ps(f + 8);
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++)
                acc[r][k] = w32_acc(WT, acc[r][k], t8_sums(WT, isum[r][k], f), _mm256_set1_ps(wd[r]),
                                    _mm256_set1_ps(wc[r]), dx, sx);
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++) store_tokens(acc[r][k], y + 8 * k * ldy + r, ldy, nt - 8 * k);
}

#if KV_VNNI
#define TILE8_4(WT, nb, W, ws, xi, xs8, y, ldy, nt) tile8_z(WT, nb, W, ws, xi, xs8, y, ldy, nt)
/* 16-row tiles where the row offsets fit the gather's int32 indices */
#define TILE8_R16(WT, ws) (R16_OK(WT) && (ws) <= INT32_MAX / 16)
#define TILE8_R16_CALL(WT, nb, W, ws, xi, xs8, y, ldy, nt)                       \
    do {                                                                           \
        if (R16_OK(WT)) tile8_r16(R16_OK(WT) ? WT : KV_TYPE_Q8_0, nb, W, ws, xi, xs8, y, ldy, nt); \
    } while (0)
#else
#define TILE8_R16(WT, ws) 0
#define TILE8_R16_CALL(WT, nb, W, ws, xi, xs8, y, ldy, nt) ((void)0)
#define TILE8_4(WT, nb, W, ws, xi, xs8, y, ldy, nt) tile8(WT, 4, nb, W, ws, xi, xs8, y, ldy, nt)
#endif

#define TILE8_FNS(NAME, WT)                                                                        \
    static KV_AVX2 void NAME##_4(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,      \
                                 const float *xs8, float *y, int64_t ldy, int nt) {                 \
        TILE8_4(WT, nb, W, ws, xi, xs8, y, ldy, nt);                                                \
    }                                                                                               \
    static KV_AVX2 void NAME##_r16(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,    \
                                   const float *xs8, float *y, int64_t ldy, int nt) {               \
        TILE8_R16_CALL(WT, nb, W, ws, xi, xs8, y, ldy, nt);                                         \
    }                                                                                               \
    static KV_AVX2 void NAME##_1(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,      \
                                 const float *xs8, float *y, int64_t ldy, int nt) {                 \
        tile8(WT, 1, nb, W, ws, xi, xs8, y, ldy, nt);                                               \
    }                                                                                               \
    static KV_AVX2 void NAME##_16x2(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,   \
                                    const float *xs8, float *y, int64_t ldy, int nt) {              \
        tile16(WT, 2, nb, W, ws, xi, xs8, y, ldy, nt);                                              \
    }                                                                                               \
    static KV_AVX2 void NAME##_16x1(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,   \
                                    const float *xs8, float *y, int64_t ldy, int nt) {              \
        tile16(WT, 1, nb, W, ws, xi, xs8, y, ldy, nt);                                              \
    }                                                                                               \
    static KV_AVX2 void NAME(int64_t K, const uint8_t *W, size_t ws, int nr, const uint8_t *xi,    \
                             const float *xs8, int nt, float *y, int64_t ldy) {                     \
        int64_t nb = K / 32;                                                                        \
        int t = 0;                                                                                  \
        for (; t + 8 < nt; t += 16) { /* two groups, the second possibly partial */                 \
            const uint8_t *xg = xi + (t / 8) * nb * 256;                                            \
            const float *fg = xs8 + (t / 8) * nb * KV_X8F;                                          \
            float *yg = y + (int64_t)t * ldy;                                                       \
            int r = 0;                                                                              \
            for (; r + 2 <= nr; r += 2) NAME##_16x2(nb, W + r * ws, ws, xg, fg, yg + r, ldy, nt - t); \
            for (; r < nr; r++) NAME##_16x1(nb, W + r * ws, ws, xg, fg, yg + r, ldy, nt - t);       \
        }                                                                                           \
        if (t < nt) {                                                                               \
            const uint8_t *xg = xi + (t / 8) * nb * 256;                                            \
            const float *fg = xs8 + (t / 8) * nb * KV_X8F;                                          \
            float *yg = y + (int64_t)t * ldy;                                                       \
            int r = 0;                                                                              \
            if (TILE8_R16(WT, ws)) {                                                                \
                /* the first two tiles, which the tiles' own prefetch (two ahead) does not reach */    \
                for (size_t o = 0; o < (size_t)(nr < 32 ? nr : 32) * ws; o += 64)                     \
                    _mm_prefetch((const char *)W + o, _MM_HINT_T1);                                 \
                for (; r + 16 <= nr; r += 16) NAME##_r16(nb, W + r * ws, ws, xg, fg, yg + r, ldy, nt - t); \
            }                                                                                       \
            for (; r + 4 <= nr; r += 4) NAME##_4(nb, W + r * ws, ws, xg, fg, yg + r, ldy, nt - t);  \
            for (; r < nr; r++) NAME##_1(nb, W + r * ws, ws, xg, fg, yg + r, ldy, nt - t);          \
        }                                                                                           \
    }

TILE8_FNS(tile8_q4_0, KV_TYPE_Q4_0)
TILE8_FNS(tile8_q4_1, KV_TYPE_Q4_1)
TILE8_FNS(tile8_q5_0, KV_TYPE_Q5_0)
TILE8_FNS(tile8_q5_1, KV_TYPE_Q5_1)
TILE8_FNS(tile8_q8_0, KV_TYPE_Q8_0)

/* The tile entry (kv_tile_fn) for one weight type: token by token, 8 rows
 * at a time (the decode kernel; the prefill tiles take groups of 8 tokens). */
#define TILE32_FNS(NAME, WT)                                                                       \
    static KV_AVX2 void NAME##_gemv8(int64_t nb, const uint8_t *W, size_t ws, int nr, const uint8_t *X, \
                                     const float *xf, int64_t t, float *y, size_t pf) {            \
        gemv8(WT, nb, W, ws, nr, X, xf, t, y, pf);                                                  \
    }                                                                                               \
    static KV_AVX2 void NAME(int64_t K, const uint8_t *W, size_t ws, int nr, const uint8_t *X,     \
                             size_t xs, int nt, float *y, int64_t ldy, const float *xf, int64_t t0) { \
        int64_t nb = K / 32;                                                                        \
        size_t grp = 8 * ws, pf = (GEMV_PF_BYTES + grp - 1) / grp * grp;                            \
        for (int t = 0; t < nt; t++)                                                                \
            for (int r = 0; r < nr; r += 8)                                                         \
                NAME##_gemv8(nb, W + r * ws, ws, nr - r < 8 ? nr - r : 8, X + t * xs, xf, t0 + t,   \
                             y + t * ldy + r, pf);                                                  \
    }

TILE32_FNS(tile_q4_0, KV_TYPE_Q4_0)
TILE32_FNS(tile_q4_1, KV_TYPE_Q4_1)
TILE32_FNS(tile_q5_0, KV_TYPE_Q5_0)
TILE32_FNS(tile_q5_1, KV_TYPE_Q5_1)
TILE32_FNS(tile_q8_0, KV_TYPE_Q8_0)

/* ---- single dot products (public kv_vec_dot: plain ggml activation blocks) ---- */

KV_INL float dot32(int WT, int64_t nb, const uint8_t *w, const uint8_t *x) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    float corr = 0;
    for (int64_t b = 0; b < nb; b++) {
        float d, c;
        __m256i wq = w32_load(WT, w, b, &d, &c);
        __m256i wa = W32_SIGNED(WT) ? _mm256_sign_epi8(wq, wq) : wq;
        const uint8_t *xb = x + b * X32_BS(WT);
        uint16_t dh;
        memcpy(&dh, xb, 2);
        float dx = h2f(dh);
        __m256i xq = _mm256_loadu_si256((const __m256i *)(xb + X32_QS(WT)));
        __m256 p = _mm256_cvtepi32_ps(w32_dot(WT, wq, wa, xq));
        if (b & 1) acc1 = _mm256_fmadd_ps(p, _mm256_set1_ps(d * dx), acc1);
        else acc0 = _mm256_fmadd_ps(p, _mm256_set1_ps(d * dx), acc0);
        if (WT == KV_TYPE_Q4_1 || WT == KV_TYPE_Q5_1) { /* Q8_1: s = d * sum(q), f16 */
            uint16_t sh;
            memcpy(&sh, xb + 2, 2);
            corr += c * h2f(sh);
        } else if (!W32_SIGNED(WT)) { /* Q8_0: sum the quants */
            corr += c * dx * (float)hsum_epi32(dp_u8s8(_mm256_setzero_si256(), _mm256_set1_epi8(1), xq));
        }
    }
    return hsum_ps(_mm256_add_ps(acc0, acc1)) + corr;
}

#define DOT32_FN(NAME, WT)                                                                  \
    static KV_AVX2 void NAME(int64_t n, float *s, const void *w, const void *x) {          \
        *s = dot32(WT, n / 32, w, x);                                                       \
    }
DOT32_FN(tile_q4_0_dot, KV_TYPE_Q4_0)
DOT32_FN(tile_q4_1_dot, KV_TYPE_Q4_1)
DOT32_FN(tile_q5_0_dot, KV_TYPE_Q5_0)
DOT32_FN(tile_q5_1_dot, KV_TYPE_Q5_1)
DOT32_FN(tile_q8_0_dot, KV_TYPE_Q8_0)

/* =========================================================================
 * K-quants x Q8_K
 * ========================================================================= */

/* Q4_K / Q5_K: the 8 six-bit scales and mins of a super-block, unpacked with
 * 32-bit masks (bytes 0..7 scales, 8..15 mins); returns the mins as 8 int16
 * and the scales as 16-bit values repeated in both 128-bit lanes. */
KV_INL __m128i k4_scales(const uint8_t *s, __m256i *sc16) {
    uint32_t u[4];
    memcpy(u, s, 12);
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
    uint32_t mins_lo = u[1] & m1;
    u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
    u[2] = mins_lo;
    u[0] &= m1;
    __m128i v = _mm_loadu_si128((const __m128i *)u);
    __m128i sc = _mm_cvtepu8_epi16(v);
    *sc16 = _mm256_set_m128i(sc, sc);
    return _mm_cvtepu8_epi16(_mm_srli_si128(v, 8));
}

/* Broadcast 16-bit lane k of each 128-bit half. */
KV_INL __m256i bcast16(__m256i v, int k) {
    const __m256i idx = _mm256_set1_epi16((short)((2 * k) | ((2 * k + 1) << 8)));
    return _mm256_shuffle_epi8(v, idx);
}

/* Sum over 8 sub-blocks of m_j * (bsums[2j] + bsums[2j+1]). */
KV_INL int k_minsum(__m128i mins, const int16_t *bsums) {
    __m256i bs = _mm256_loadu_si256((const __m256i *)bsums);
    __m128i pair = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
    __m128i p = _mm_madd_epi16(mins, pair);
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0x4E));
    p = _mm_add_epi32(p, _mm_shuffle_epi32(p, 0xB1));
    return _mm_cvtsi128_si32(p);
}

/* Tokens a K-quant tile takes at once: 8 with AVX-512's 32 vector
 * registers (a batched decode step), 4 with AVX2's 16. */
#define K_NT_MAX (KV_VNNI ? 8 : 4)

/* One Q4_K/Q5_K super-block against NT Q8_K rows; Q5 when QH != NULL. */
KV_INL void k45_block(int NT, const uint8_t *qs, const uint8_t *qh, __m256i sc,
                      const kv_block_q8_k *const *xb, __m256i *isum) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (qh) {
            __m256i h = _mm256_loadu_si256((const __m256i *)qh);
            __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(h, 2 * j), _mm256_set1_epi8(1));
            __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(h, 2 * j + 1), _mm256_set1_epi8(1));
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
        }
        __m256i s0 = bcast16(sc, 2 * j);
        __m256i s1 = bcast16(sc, 2 * j + 1);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            __m256i y0 = _mm256_loadu_si256((const __m256i *)(xb[t]->qs + 64 * j));
            __m256i y1 = _mm256_loadu_si256((const __m256i *)(xb[t]->qs + 64 * j + 32));
#if KV_VNNI /* two chains of sums (exact, so in any order) */
            isum[t] = _mm256_dpwssd_epi32(isum[t], _mm256_maddubs_epi16(lo, y0), s0);
            isum[NT + t] = _mm256_dpwssd_epi32(isum[NT + t], _mm256_maddubs_epi16(hi, y1), s1);
#else
            __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, y0), s0);
            __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, y1), s1);
            isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(p0, p1));
#endif
        }
    }
}

#if KV_VNNI
/* lane l + lane l + 8 of v */
KV_INL __m256i fold512_epi32(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* k45_block with 512-bit vectors for 8 tokens (a batched decode step): the
 * low and high nibbles of qs[32 j ..] (sub-blocks 2j, 2j + 1) side by side,
 * against the token's 64 quants of those sub-blocks, so one vpmaddubsw and
 * one vpdpwssd do what two of each do on 256 bits. Lane l of the result
 * sums what lane l of the two 256-bit chains does (l < 8: sub-block 2j,
 * else 2j + 1, the same 4 elements), so folding the halves gives the exact
 * integers k45_block gives. */
KV_INL void k45_block_z8(const uint8_t *qs, const uint8_t *qh, __m256i sc, const kv_block_q8_k *const *xb,
                         __m256i *isum) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i z[8];
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) z[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
        w = _mm512_and_si512(w, m4);
        if (qh) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
            const __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(h, 2 * j)),
                                                  _mm256_srli_epi16(h, 2 * j + 1), 1);
            w = _mm512_or_si512(w, _mm512_slli_epi16(_mm512_and_si512(hb, _mm512_set1_epi8(1)), 4));
        }
        const __m512i s = _mm512_inserti64x4(_mm512_castsi256_si512(bcast16(sc, 2 * j)), bcast16(sc, 2 * j + 1), 1);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m512i yv = _mm512_loadu_si512((const void *)(xb[t]->qs + 64 * j));
            z[t] = _mm512_dpwssd_epi32(z[t], _mm512_maddubs_epi16(w, yv), s);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) isum[t] = fold512_epi32(z[t]), isum[8 + t] = _mm256_setzero_si256();
}
#endif

KV_INL void tile_k45(int Q5, int NT, int64_t nb, const uint8_t *W, const uint8_t *X, size_t xs,
                     float *y, int64_t ldy) {
    __m256 acc[K_NT_MAX];
    float macc[K_NT_MAX];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps(), macc[t] = 0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qs, *qh = NULL, *scales;
        float d, dmin;
        if (NT == 1) /* decode reads rows one after another */
            prefetch_lines(W + b * (Q5 ? 176 : 144) + GEMV_PF_BYTES, Q5 ? 176 : 144);
        if (Q5) {
            const kv_block_q5_k *w = (const kv_block_q5_k *)W + b;
            qs = w->qs, qh = w->qh, scales = w->scales, d = h2f(w->d), dmin = h2f(w->dmin);
        } else {
            const kv_block_q4_k *w = (const kv_block_q4_k *)W + b;
            qs = w->qs, scales = w->scales, d = h2f(w->d), dmin = h2f(w->dmin);
        }
        __m256i sc;
        __m128i mins = k4_scales(scales, &sc);
        const kv_block_q8_k *xb[K_NT_MAX];
        __m256i isum[2 * K_NT_MAX];
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            xb[t] = (const kv_block_q8_k *)(X + t * xs) + b;
            isum[t] = isum[NT + t] = _mm256_setzero_si256();
        }
#if KV_VNNI
        if (NT == 8)
            k45_block_z8(qs, qh, sc, xb, isum);
        else
#endif
            k45_block(NT, qs, qh, sc, xb, isum);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            float dx = xb[t]->d;
            if (KV_VNNI) isum[t] = _mm256_add_epi32(isum[t], isum[NT + t]);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * dx), acc[t]);
            macc[t] = fmaf(dmin * dx, (float)k_minsum(mins, xb[t]->bsums), macc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) y[t * ldy] = hsum_ps(acc[t]) - macc[t];
}

/* Q6_K: q = (4 low bits | 2 high bits << 4) in 0..63, minus 32 via bsums. */
KV_INL void tile_q6k(int NT, int64_t nb, const uint8_t *W, const uint8_t *X, size_t xs, float *y,
                     int64_t ldy) {
    __m256 acc[K_NT_MAX];
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < nb; b++) {
        const kv_block_q6_k *w = (const kv_block_q6_k *)W + b;
        if (NT == 1) prefetch_lines((const uint8_t *)w + GEMV_PF_BYTES, sizeof *w);
        const kv_block_q8_k *xb[K_NT_MAX];
        __m256i isum[2 * K_NT_MAX];
        __m128i sc8 = _mm_loadu_si128((const __m128i *)w->scales);
        __m256i sc16 = _mm256_cvtepi8_epi16(sc8); /* 16 scales as int16 */
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            xb[t] = (const kv_block_q8_k *)(X + t * xs) + b;
            /* -32 * sum_j sc_j * bsums_j */
            __m256i bs = _mm256_loadu_si256((const __m256i *)xb[t]->bsums);
            isum[t] = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
            isum[t] = _mm256_sub_epi32(_mm256_setzero_si256(), isum[t]);
            isum[NT + t] = _mm256_setzero_si256();
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w->ql + 64 * h, *qh = w->qh + 32 * h;
            __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i hh = _mm256_loadu_si256((const __m256i *)qh);
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hh, m2), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 2), m2), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 4), m2), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hh, 6), m2), 4));
            /* q[k] covers elements 128h + 32k .. +32: scales 8h + 2k, 8h + 2k + 1 */
            __m256i sc[4];
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                int i0 = 8 * h + 2 * k;
                __m128i a = _mm_set1_epi16((short)w->scales[i0]);
                __m128i c = _mm_set1_epi16((short)w->scales[i0 + 1]);
                sc[k] = _mm256_set_m128i(c, a);
            }
#if KV_VNNI
            if (NT == 8) { /* 512 bits: q[k], q[k + 1] side by side (k45_block_z8's folding) */
                const __m512i w01 = _mm512_inserti64x4(_mm512_castsi256_si512(q[0]), q[1], 1);
                const __m512i w23 = _mm512_inserti64x4(_mm512_castsi256_si512(q[2]), q[3], 1);
                const __m512i s01 = _mm512_inserti64x4(_mm512_castsi256_si512(sc[0]), sc[1], 1);
                const __m512i s23 = _mm512_inserti64x4(_mm512_castsi256_si512(sc[2]), sc[3], 1);
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) {
                    const int8_t *yq = xb[t]->qs + 128 * h;
                    const __m512i y01 = _mm512_loadu_si512((const void *)yq);
                    const __m512i y23 = _mm512_loadu_si512((const void *)(yq + 64));
                    __m512i z = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(w01, y01), s01);
                    z = _mm512_dpwssd_epi32(z, _mm512_maddubs_epi16(w23, y23), s23);
                    isum[t] = _mm256_add_epi32(isum[t], fold512_epi32(z));
                }
                continue;
            }
#endif
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                const int8_t *yq = xb[t]->qs + 128 * h;
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    __m256i yy = _mm256_loadu_si256((const __m256i *)(yq + 32 * k));
#if KV_VNNI /* two chains of sums (exact, so in any order) */
                    int c = (k & 1) * NT + t;
                    isum[c] = _mm256_dpwssd_epi32(isum[c], _mm256_maddubs_epi16(q[k], yy), sc[k]);
#else
                    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], yy), sc[k]);
                    isum[t] = _mm256_add_epi32(isum[t], p);
#endif
                }
            }
        }
        float d = h2f(w->d);
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) {
            isum[t] = _mm256_add_epi32(isum[t], isum[NT + t]);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * xb[t]->d), acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; t++) y[t * ldy] = hsum_ps(acc[t]);
}

#define TILEK_FNS(NAME, CALL8, CALL4, CALL1)                                                              \
    static KV_AVX2 void NAME##_4(int64_t nb, const uint8_t *W, const uint8_t *X, size_t xs,        \
                                 float *y, int64_t ldy) { CALL4; }                                  \
    static KV_AVX2 void NAME##_8(int64_t nb, const uint8_t *W, const uint8_t *X, size_t xs,        \
                                 float *y, int64_t ldy) { CALL8; }                                  \
    static KV_AVX2 void NAME##_1(int64_t nb, const uint8_t *W, const uint8_t *X, size_t xs,        \
                                 float *y, int64_t ldy) { CALL1; }                                  \
    static KV_AVX2 void NAME(int64_t K, const uint8_t *W, size_t ws, int nr, const uint8_t *X,     \
                             size_t xs, int nt, float *y, int64_t ldy, const float *xf,             \
                             int64_t t0) {                                                          \
        int64_t nb = K / 256;                                                                       \
        int t = 0;                                                                                  \
        if (K_NT_MAX == 8)                                                                          \
            for (; t + 8 <= nt; t += 8)                                                             \
                for (int r = 0; r < nr; r++) NAME##_8(nb, W + r * ws, X + t * xs, xs, y + t * ldy + r, ldy); \
        for (; t + 4 <= nt; t += 4)                                                                 \
            for (int r = 0; r < nr; r++) NAME##_4(nb, W + r * ws, X + t * xs, xs, y + t * ldy + r, ldy); \
        for (; t < nt; t++)                                                                         \
            for (int r = 0; r < nr; r++) NAME##_1(nb, W + r * ws, X + t * xs, xs, y + t * ldy + r, ldy); \
    }                                                                                               \
    static KV_AVX2 void NAME##_dot(int64_t n, float *s, const void *w, const void *x) {             \
        NAME##_1(n / 256, w, x, 0, s, 0);                                                           \
    }

TILEK_FNS(tile_q4_k, tile_k45(0, K_NT_MAX, nb, W, X, xs, y, ldy), tile_k45(0, 4, nb, W, X, xs, y, ldy),
          tile_k45(0, 1, nb, W, X, xs, y, ldy))
TILEK_FNS(tile_q5_k, tile_k45(1, K_NT_MAX, nb, W, X, xs, y, ldy), tile_k45(1, 4, nb, W, X, xs, y, ldy),
          tile_k45(1, 1, nb, W, X, xs, y, ldy))
TILEK_FNS(tile_q6_k, tile_q6k(K_NT_MAX, nb, W, X, xs, y, ldy), tile_q6k(4, nb, W, X, xs, y, ldy),
          tile_q6k(1, nb, W, X, xs, y, ldy))

/* =========================================================================
 * float weights x F32 activations
 * ========================================================================= */

KV_INL __m256 load8(int WT, const void *w, int64_t i) {
    if (WT == KV_TYPE_F32) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    if (WT == KV_TYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

KV_INL float scalar_w(int WT, const void *w, int64_t i) {
    if (WT == KV_TYPE_F32) return ((const float *)w)[i];
    uint16_t h = ((const uint16_t *)w)[i];
    if (WT == KV_TYPE_F16) return h2f(h);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

KV_INL float dotf(int WT, int64_t n, const void *w, const float *x) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(load8(WT, w, i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(load8(WT, w, i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(load8(WT, w, i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(load8(WT, w, i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load8(WT, w, i), _mm256_loadu_ps(x + i), a0);
    float s = hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) s += scalar_w(WT, w, i) * x[i];
    return s;
}

#define FLOAT_FNS(NAME, WT)                                                                        \
    static KV_AVX2 void NAME##_dot(int64_t n, float *s, const void *w, const void *x) {             \
        *s = dotf(WT, n, w, x);                                                                     \
    }                                                                                               \
    static KV_AVX2 void NAME(int64_t K, const uint8_t *W, size_t ws, int nr, const uint8_t *X,     \
                             size_t xs, int nt, float *y, int64_t ldy, const float *xf,             \
                             int64_t t0) {                                                          \
        for (int t = 0; t < nt; t++)                                                                \
            for (int r = 0; r < nr; r++)                                                            \
                y[t * ldy + r] = dotf(WT, K, W + r * ws, (const float *)(X + t * xs));             \
    }

FLOAT_FNS(tile_f32, KV_TYPE_F32)
FLOAT_FNS(tile_f16, KV_TYPE_F16)
FLOAT_FNS(tile_bf16, KV_TYPE_BF16)

/* =========================================================================
 * activation quantizers (byte-identical to the scalar ones)
 * ========================================================================= */

/* roundf (ties away from zero) of 8 floats, as int32. */
KV_INL __m256i round_away(__m256 v) {
    __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(v, t); /* exact */
    __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 big = _mm256_cmp_ps(_mm256_and_ps(f, absmask), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_andnot_ps(absmask, v)); /* +-1 */
    return _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(big, one)));
}

/* 32 int32 (4 vectors) -> 32 int8 in order. */
KV_INL __m256i pack32(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    __m256i r = _mm256_packs_epi16(ab, cd);
    return _mm256_permutevar8x32_epi32(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

KV_INL float amax32(const float *x) {
    __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_and_ps(_mm256_loadu_ps(x), absmask);
    m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + 8), absmask));
    m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + 16), absmask));
    m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + 24), absmask));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

KV_INL __m256i q8_block(const float *x, float id) {
    __m256 vid = _mm256_set1_ps(id);
    __m256i a = round_away(_mm256_mul_ps(_mm256_loadu_ps(x), vid));
    __m256i b = round_away(_mm256_mul_ps(_mm256_loadu_ps(x + 8), vid));
    __m256i c = round_away(_mm256_mul_ps(_mm256_loadu_ps(x + 16), vid));
    __m256i d = round_away(_mm256_mul_ps(_mm256_loadu_ps(x + 24), vid));
    return pack32(a, b, c, d);
}

/* The 32 floats at x as a Q8_0 / Q8_1 block: the quants, *d the scale. */
KV_INL __m256i q8_quants(const float *x, float *d) {
    *d = amax32(x) / 127;
    return q8_block(x, *d != 0 ? 1.0f / *d : 0.0f);
}

/* the sum of 32 int8 quants */
KV_INL int q8_sum(__m256i q) {
    return hsum_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1)));
}

static KV_AVX2 void quant_q8_0(const float *x, void *dst, int64_t n) {
    kv_block_q8_0 *b = dst;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        float d;
        _mm256_storeu_si256((__m256i *)b[i].qs, q8_quants(x, &d));
        b[i].d = _cvtss_sh(d, 0);
    }
}

static KV_AVX2 void quant_q8_1(const float *x, void *dst, int64_t n) {
    kv_block_q8_1 *b = dst;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        float d;
        __m256i q = q8_quants(x, &d);
        _mm256_storeu_si256((__m256i *)b[i].qs, q);
        b[i].d = _cvtss_sh(d, 0);
        b[i].s = _cvtss_sh((float)q8_sum(q) * d, 0);
    }
}

/* out[g] = dword g of each of v[0..7] (an 8 x 8 transpose of dwords). */
KV_INL void transpose8x8_epi32(__m256i v[8]) {
    __m256i a[8], b[8];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        a[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
        a[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            b[4 * i + 2 * h] = _mm256_unpacklo_epi64(a[4 * i + h], a[4 * i + 2 + h]);
            b[4 * i + 2 * h + 1] = _mm256_unpackhi_epi64(a[4 * i + h], a[4 * i + 2 + h]);
        }
    /* b[k] (k < 4): dwords k, 4 + k of rows 0-3; b[4 + k]: of rows 4-7 */
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_permute2x128_si256(b[k], b[4 + k], 0x20);
        v[4 + k] = _mm256_permute2x128_si256(b[k], b[4 + k], 0x31);
    }
}

static KV_AVX2 void quant_x8(const float *x, int64_t ldx, int nt, int64_t b0, int64_t b1, uint8_t *xi, float *xs8) {
    for (int64_t b = b0; b < b1; b++) {
        __m256i q[8];
        _Alignas(32) float d8[8], s8[8];
        _Alignas(32) int32_t n8[8];
        for (int t = 0; t < 8; t++) {
            if (t >= nt) {
                q[t] = _mm256_setzero_si256(), d8[t] = s8[t] = 0.0f, n8[t] = 0;
                continue;
            }
            float d;
            q[t] = q8_quants(x + t * ldx + 32 * b, &d);
            n8[t] = q8_sum(q[t]);
            d8[t] = _cvtsh_ss(_cvtss_sh(d, 0)); /* the scale as stored (f16) */
            s8[t] = d8[t] * (float)n8[t];
        }
        transpose8x8_epi32(q);
        uint8_t *dst = xi + b * 256;
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) _mm256_store_si256((__m256i *)(dst + 32 * g), q[g]);
        float *f = xs8 + b * KV_X8F;
        _mm256_storeu_ps(f, _mm256_load_ps(d8));
        _mm256_storeu_ps(f + 8, _mm256_load_ps(s8));
        _mm256_storeu_si256((__m256i *)(f + 16), _mm256_load_si256((const __m256i *)n8));
    }
}

static KV_AVX2 void quant_q8_k(const float *x, void *dst, int64_t n) {
    kv_block_q8_k *b = dst;
    for (int64_t i = 0; i < n / 256; i++, x += 256) {
        float amax = 0;
        for (int j = 0; j < 256; j += 32) {
            float a = amax32(x + j);
            if (a > amax) amax = a;
        }
        if (amax == 0) {
            memset(&b[i], 0, sizeof b[i]);
            continue;
        }
        /* the first element with |x| == amax gives the sign, as in the scalar code */
        float max = 0;
        __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        __m256 va = _mm256_set1_ps(amax);
        for (int j = 0; j < 256; j += 8) {
            __m256 v = _mm256_loadu_ps(x + j);
            int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(v, absmask), va, _CMP_EQ_OQ));
            if (m) {
                max = x[j + __builtin_ctz((unsigned)m)];
                break;
            }
        }
        float iscale = -127.f / max;
        __m256 vis = _mm256_set1_ps(iscale);
        __m256i lim = _mm256_set1_epi32(127);
        for (int j = 0; j < 256; j += 32) {
            __m256i q[4];
            for (int k = 0; k < 4; k++) {
                __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * k), vis);
                v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(v), lim);
            }
            __m256i p = pack32(q[0], q[1], q[2], q[3]);
            _mm256_storeu_si256((__m256i *)(b[i].qs + j), p);
            /* two bsums of 16 */
            __m256i s16 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p),
                                            _mm256_set1_epi16(1)); /* 8 x int32, 4 per 16 */
            __m128i lo = _mm256_castsi256_si128(s16), hi = _mm256_extracti128_si256(s16, 1);
            lo = _mm_hadd_epi32(lo, hi);  /* 4 sums of 8 */
            lo = _mm_hadd_epi32(lo, lo);  /* 2 sums of 16 */
            b[i].bsums[j / 16] = (int16_t)_mm_cvtsi128_si32(lo);
            b[i].bsums[j / 16 + 1] = (int16_t)_mm_extract_epi32(lo, 1);
        }
        b[i].d = 1 / iscale;
    }
}

/* =========================================================================
 * half rows (F16C; round to nearest even like the scalar code)
 * ========================================================================= */

static KV_AVX2 void f16_to_f32_row(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = h2f(src[i]);
}

static KV_AVX2 void f32_to_f16_row(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

/* =========================================================================
 * install
 * ========================================================================= */

int KV_KERNELS_INSTALL(kv_kernels *k) {
#ifdef KV_NO_AVX2_KERNELS /* build option: the portable kernels only */
    return 0;
#endif
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    /* F16C has no __builtin_cpu_supports name in older compilers: CPUID.1:ECX bit 29 */
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
    if (!(c & (1u << 29))) return 0;
#if KV_VNNI
    if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512vl") ||
        !__builtin_cpu_supports("avx512bw"))
        return 0;
#endif

    k->tile[KV_TYPE_Q4_0] = tile_q4_0, k->dot[KV_TYPE_Q4_0] = tile_q4_0_dot;
    k->tile[KV_TYPE_Q4_1] = tile_q4_1, k->dot[KV_TYPE_Q4_1] = tile_q4_1_dot;
    k->tile[KV_TYPE_Q5_0] = tile_q5_0, k->dot[KV_TYPE_Q5_0] = tile_q5_0_dot;
    k->tile[KV_TYPE_Q5_1] = tile_q5_1, k->dot[KV_TYPE_Q5_1] = tile_q5_1_dot;
    k->tile[KV_TYPE_Q8_0] = tile_q8_0, k->dot[KV_TYPE_Q8_0] = tile_q8_0_dot;
    k->tile[KV_TYPE_Q4_K] = tile_q4_k, k->dot[KV_TYPE_Q4_K] = tile_q4_k_dot;
    k->tile[KV_TYPE_Q5_K] = tile_q5_k, k->dot[KV_TYPE_Q5_K] = tile_q5_k_dot;
    k->tile[KV_TYPE_Q6_K] = tile_q6_k, k->dot[KV_TYPE_Q6_K] = tile_q6_k_dot;
    k->tile[KV_TYPE_F32] = tile_f32, k->dot[KV_TYPE_F32] = tile_f32_dot;
    k->tile[KV_TYPE_F16] = tile_f16, k->dot[KV_TYPE_F16] = tile_f16_dot;
    k->tile[KV_TYPE_BF16] = tile_bf16, k->dot[KV_TYPE_BF16] = tile_bf16_dot;
    k->tile8[KV_TYPE_Q4_0] = tile8_q4_0;
    k->tile8[KV_TYPE_Q4_1] = tile8_q4_1;
    k->tile8[KV_TYPE_Q5_0] = tile8_q5_0;
    k->tile8[KV_TYPE_Q5_1] = tile8_q5_1;
    k->tile8[KV_TYPE_Q8_0] = tile8_q8_0;
    k->f16_to_f32_row = f16_to_f32_row;
    k->f32_to_f16_row = f32_to_f16_row;
    k->quant[KV_TYPE_Q8_0] = quant_q8_0;
    k->quant[KV_TYPE_Q8_1] = quant_q8_1;
    k->quant_x8 = quant_x8;
    k->quant[KV_TYPE_Q8_K] = quant_q8_k;
    k->tile_rows = 8;
    k->tile_toks = 4;
    return 1;
}

#else

int KV_KERNELS_INSTALL(kv_kernels *k) {
    (void)k;
    return 0;
}

#endif
