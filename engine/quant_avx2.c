/*
 * quant_avx2.c — AVX2/FMA/F16C versions of the hot kernels.
 *
 * Every function carries a target attribute instead of the whole file being
 * compiled with -mavx2, so the library still loads on older CPUs;
 * kv_kernels_avx2() checks the CPU before installing anything.
 *
 * 32-element formats (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0) against Q8_0 / Q8_1:
 *   - decode (1 token): tile32r4, 4 weight rows folded into one vector
 *     ([r0 r1 r2 r3 | r0 r1 r2 r3] int32), so one convert and one FMA serve
 *     4 rows; the next row group is prefetched.
 *   - prefill, 8 or 16 tokens: tile8 / tile16 on the interleaved layout
 *     (quant_impl.h): 4 weight quants are broadcast and multiplied with 8
 *     tokens' 4 quants at once; lanes are tokens, so no horizontal sums.
 *     (4/5-bit formats; Q8_0 uses tile32x4, 4 tokens folded by hadd.)
 *   The 4/5-bit quants stay unsigned (maddubs takes u8 x s8); their offset
 *   (-8, -16) or min is applied with the activation block sums of the side
 *   table. The integer products use maddubs (u8 x s8 -> s16 pairs) and
 *   madd with ones (-> s32), and one float FMA per block with the product
 *   of the two block scales.
 * K-quants (Q4_K Q5_K Q6_K) against Q8_K: 1 row x 4 tokens (or 1); Q6_K's
 *   -32 and the K4 mins go through the Q8_K bsums.
 * Float weights (F32 F16 BF16) against F32: FMA loops.
 *
 * The activation quantizers reproduce the scalar ones byte for byte
 * (roundf's ties-away-from-zero is rebuilt from truncation), so the fast
 * and the reference paths see identical integer inputs.
 */
#include "quant_impl.h"

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
 * 32-element formats x Q8_0 / Q8_1: one generic tile
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
#define W32_BS(WT) ((WT) == KV_TYPE_Q4_0 ? 18 : (WT) == KV_TYPE_Q4_1 ? 20 : (WT) == KV_TYPE_Q5_0 ? 22 \
                    : (WT) == KV_TYPE_Q5_1 ? 24 : 34)
/* activation blocks: Q8_1 (36 bytes, qs at 4) for Q4_1 / Q5_1, else Q8_0 (34, qs at 2) */
#define X32_BS(WT) (((WT) == KV_TYPE_Q4_1 || (WT) == KV_TYPE_Q5_1) ? 36 : 34)
#define X32_QS(WT) (((WT) == KV_TYPE_Q4_1 || (WT) == KV_TYPE_Q5_1) ? 4 : 2)

/* 8 int32 partial sums of one weight block times one activation block */
KV_INL __m256i w32_dot(int WT, __m256i wq, __m256i wa, __m256i xq) {
    return W32_SIGNED(WT) ? dp_u8s8(_mm256_setzero_si256(), wa, _mm256_sign_epi8(xq, wq))
                          : dp_u8s8(_mm256_setzero_si256(), wq, xq);
}

/* The 16-bit pair sums of one weight block times one activation block
 * (VNNI: the int32 sums of 4, as w32_dot). */
KV_INL __m256i w32_pairs(int WT, __m256i wq, __m256i wa, __m256i xq) {
#if KV_VNNI
    return w32_dot(WT, wq, wa, xq);
#else
    return W32_SIGNED(WT) ? _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xq, wq))
                          : _mm256_maddubs_epi16(wq, xq);
#endif
}

/* Folds 4 pair-sum vectors (a, b, c, d) into [a b c d | a b c d] int32, each
 * lane holding half of one block's sum (low / high 16 elements). The 4- and
 * 5-bit formats add in 16 bits (at most 8 * 31 * 127 < 32768); Q8_0 cannot. */
KV_INL __m256i fold4(int WT, __m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (KV_VNNI) { /* already int32 */
        __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
        return _mm256_hadd_epi32(ab, cd);
    }
    if (W32_SIGNED(WT)) {
        __m256i ab = _mm256_hadd_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones));
        __m256i cd = _mm256_hadd_epi32(_mm256_madd_epi16(c, ones), _mm256_madd_epi16(d, ones));
        return _mm256_hadd_epi32(ab, cd);
    }
    __m256i s = _mm256_hadd_epi16(_mm256_hadd_epi16(a, b), _mm256_hadd_epi16(c, d));
    return _mm256_madd_epi16(s, ones);
}

/* The symmetric 4/5-bit formats are stored as unsigned u = q + off; the
 * offset is taken off in integers: sum (u - off) x = sum u x - off sum x. */
#define W32_OFF(WT) ((WT) == KV_TYPE_Q4_0 ? 8 : (WT) == KV_TYPE_Q5_0 ? 16 : 0)

/* NR rows x NT tokens, any t0 (tokens' scales read one by one): decode. */
KV_INL void tile32(int WT, int NR, int NT, int64_t nb, const uint8_t *W, size_t ws,
                   const uint8_t *X, size_t xs, float *y, int64_t ldy, const float *xf, int64_t t0) {
    __m256 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[r][t] = _mm256_setzero_ps();

    for (int64_t b = 0; b < nb; b++) {
        __m256i wq[4], wa[4];
        __m256 wd[4], wc[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            float d, c;
            if (NT == 1) _mm_prefetch((const char *)(W + (r + NR) * ws) + b * W32_BS(WT), _MM_HINT_T0);
            wq[r] = w32_load(WT, W + r * ws, b, &d, &c);
            wd[r] = _mm256_set1_ps(d);
            wc[r] = _mm256_set1_ps(c);
            wa[r] = W32_SIGNED(WT) ? _mm256_sign_epi8(wq[r], wq[r]) : wq[r];
        }
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(X + t * xs + b * X32_BS(WT) + X32_QS(WT)));
            const float *f = xf + KV_XF(t0 + t, b, nb);
            __m256 xd = _mm256_set1_ps(f[0]);
            __m256i off = _mm256_setzero_si256();
            if (W32_OFF(WT))
                off = dp_u8s8(_mm256_setzero_si256(), _mm256_set1_epi8(W32_OFF(WT)), xq);
            __m256 sx = _mm256_setr_ps(f[4], 0, 0, 0, 0, 0, 0, 0);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                __m256i i = w32_dot(WT, wq[r], wa[r], xq);
                if (W32_OFF(WT)) i = _mm256_sub_epi32(i, off);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(wd[r], xd), acc[r][t]);
                if ((WT) == KV_TYPE_Q4_1 || (WT) == KV_TYPE_Q5_1)
                    acc[r][t] = _mm256_fmadd_ps(wc[r], sx, acc[r][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++)
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) y[t * ldy + r] = hsum_ps(acc[r][t]);
}

/* Scales of block b of 4 rows (rows ws bytes apart): d as [d0 d1 d2 d3 d0 d1 d2 d3];
 * for Q4_1 / Q5_1 also the mins as [m0 m1 m2 m3 . . . .]. */
KV_INL __m256 w32_scales4(int WT, const uint8_t *W, size_t ws, int64_t b, __m256 *m) {
    const uint8_t *p = W + b * W32_BS(WT);
    if (WT == KV_TYPE_Q4_1 || WT == KV_TYPE_Q5_1) { /* d, m adjacent halves */
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

/* 4 rows x 1 token (decode): the 4 rows' integer sums are folded into one
 * vector (hadd): lane r holds row r's low half, lane r + 4 its high half. */
KV_INL void tile32r4(int WT, int64_t nb, const uint8_t *W, size_t ws, const uint8_t *X, float *y,
                     const float *xf, int64_t t0) {
    __m256 acc = _mm256_setzero_ps();
    const __m256 zero_hi = _mm256_castsi256_ps(_mm256_setr_epi32(-1, -1, -1, -1, 0, 0, 0, 0));
    for (int64_t b = 0; b < nb; b++) {
        const float *f = xf + KV_XF(t0, b, nb);
        __m256i xq = _mm256_loadu_si256((const __m256i *)(X + b * X32_BS(WT) + X32_QS(WT)));
        __m256i i4[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            float d, c;
            _mm_prefetch((const char *)(W + (r + 4) * ws) + b * W32_BS(WT), _MM_HINT_T0);
            __m256i wq = w32_load(WT, W + r * ws, b, &d, &c);
            __m256i wa = W32_SIGNED(WT) ? _mm256_sign_epi8(wq, wq) : wq;
            i4[r] = w32_pairs(WT, wq, wa, xq);
        }
        __m256i h = fold4(WT, i4[0], i4[1], i4[2], i4[3]);
        if (W32_OFF(WT)) {
            __m256i off = dp_u8s8(_mm256_setzero_si256(), _mm256_set1_epi8(W32_OFF(WT)), xq);
            off = _mm256_hadd_epi32(off, off);
            h = _mm256_sub_epi32(h, _mm256_hadd_epi32(off, off));
        }
        __m256 m;
        __m256 d = w32_scales4(WT, W, ws, b, &m);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_mul_ps(d, _mm256_set1_ps(f[0])), acc);
        if (WT == KV_TYPE_Q4_1 || WT == KV_TYPE_Q5_1)
            acc = _mm256_fmadd_ps(m, _mm256_and_ps(_mm256_set1_ps(f[4]), zero_hi), acc);
    }
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    _mm_storeu_ps(y, v);
}

/* NR rows x 4 tokens t0..t0+3, t0 % 4 == 0: the 4 tokens' integer sums are
 * folded into one vector (hadd), so one convert and one FMA serve 4 tokens. */
KV_INL void tile32x4(int WT, int NR, int64_t nb, const uint8_t *W, size_t ws, const uint8_t *X,
                     size_t xs, float *y, int64_t ldy, const float *xf, int64_t t0) {
    __m256 acc[4];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    const float *g = xf + KV_XF(t0, 0, nb);
    for (int64_t b = 0; b < nb; b++) {
        __m256i xq[4];
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++)
            xq[t] = _mm256_loadu_si256((const __m256i *)(X + t * xs + b * X32_BS(WT) + X32_QS(WT)));
        __m256 d4 = _mm256_broadcast_ps((const __m128 *)(g + b * 8));           /* d0..d3 d0..d3 */
        __m256 s4 = _mm256_castps128_ps256(_mm_loadu_ps(g + b * 8 + 4));
        s4 = _mm256_insertf128_ps(s4, _mm_setzero_ps(), 1);                     /* s0..s3 0 0 0 0 */
        __m256 d8 = _mm256_setzero_ps(), m8 = d8;
        if (NR == 4) d8 = w32_scales4(WT, W, ws, b, &m8); /* 4 rows' scales at once */
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            float d, c;
            __m256i wq = w32_load(WT, W + r * ws, b, &d, &c);
            __m256i wa = W32_SIGNED(WT) ? _mm256_sign_epi8(wq, wq) : wq;
            __m256 p = _mm256_cvtepi32_ps(fold4(WT, w32_pairs(WT, wq, wa, xq[0]), w32_pairs(WT, wq, wa, xq[1]),
                                                w32_pairs(WT, wq, wa, xq[2]), w32_pairs(WT, wq, wa, xq[3])));
            __m256 dv, cv;
            if (NR == 4) {
                dv = _mm256_permutevar8x32_ps(d8, _mm256_set1_epi32(r));
                cv = (WT == KV_TYPE_Q4_1 || WT == KV_TYPE_Q5_1)
                         ? _mm256_permutevar8x32_ps(m8, _mm256_set1_epi32(r))
                         : _mm256_mul_ps(dv, _mm256_set1_ps((float)-W32_OFF(WT)));
            } else {
                dv = _mm256_set1_ps(d), cv = _mm256_set1_ps(c);
            }
            acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(dv, d4), acc[r]);
            if (!W32_SIGNED(WT)) acc[r] = _mm256_fmadd_ps(cv, s4, acc[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        float o[4];
        _mm_storeu_ps(o, v);
        for (int t = 0; t < 4; t++) y[t * ldy + r] = o[t];
    }
}

/* NR rows x 8 tokens on the interleaved layout (see quant_impl.h): for each
 * group g of 4 weight quants, broadcast them and multiply with the 8 tokens'
 * 4 quants at once; lanes stay tokens, so no horizontal sums at all. The
 * 16-bit sums are widened every FL groups (8 * 2 * 15 * 127 < 32768 for the
 * 4-bit formats, 4 groups for the 5-bit ones). */
KV_INL void tile8(int WT, int NR, int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,
                  const float *xs8, float *y, int64_t ldy) {
    const int FL = (WT == KV_TYPE_Q5_0 || WT == KV_TYPE_Q5_1) ? 4 : 8;
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
    __m256 acc[4];
    _Alignas(32) uint8_t wb[4][32];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        float wd[4], wc[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            __m256i u = w32_load(WT, W + r * ws, b, &wd[r], &wc[r]);
            _mm256_store_si256((__m256i *)wb[r], u);
        }
        __m256 d4 = _mm256_setzero_ps(), m4 = d4;
        if (NR == 4) d4 = w32_scales4(WT, W, ws, b, &m4); /* 4 rows' scales in one convert */
        const uint8_t *xb = xi + b * 256;
        __m256i isum[4], s16[4];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) isum[r] = _mm256_setzero_si256(), s16[r] = isum[r];
        (void)s16;
        const uint8_t *wp = &wb[0][0];
        for (int h = 0; h < 8; h += FL) {
            /* a rolled loop keeps the 16-bit sums in registers (fully
             * unrolled, gcc turns the chains into trees and spills) */
#pragma GCC unroll 2
            for (int g = h; g < h + FL; g++) {
                __m256i xv = _mm256_load_si256((const __m256i *)(xb + 32 * g));
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++) {
                    __m256i wv = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(wp + 32 * r + 4 * g)));
#if KV_VNNI
                    isum[r] = _mm256_dpbusd_epi32(isum[r], wv, xv);
#else
                    s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(wv, xv));
#endif
                }
            }
#if !KV_VNNI
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) {
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s16[r], ones));
                s16[r] = _mm256_setzero_si256();
            }
#endif
        }
        __m256 d8 = _mm256_load_ps(xs8 + b * 16), s8 = _mm256_load_ps(xs8 + b * 16 + 8);
        const int MIN = WT == KV_TYPE_Q4_1 || WT == KV_TYPE_Q5_1;
        /* offset formats: d * (sum * d8 - off * s8); min formats: d * sum * d8 + m * s8 */
        __m256 s8o = MIN ? s8 : _mm256_mul_ps(s8, _mm256_set1_ps((float)-W32_OFF(WT)));
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            __m256 dr, mr;
            if (NR == 4) {
                dr = _mm256_permutevar8x32_ps(d4, _mm256_set1_epi32(r));
                mr = _mm256_permutevar8x32_ps(m4, _mm256_set1_epi32(r));
            } else {
                dr = _mm256_set1_ps(wd[r]), mr = _mm256_set1_ps(wc[r]);
            }
            __m256 v = _mm256_cvtepi32_ps(isum[r]);
            if (MIN) {
                acc[r] = _mm256_fmadd_ps(dr, _mm256_mul_ps(v, d8), acc[r]);
                acc[r] = _mm256_fmadd_ps(mr, s8, acc[r]);
            } else {
                acc[r] = _mm256_fmadd_ps(dr, _mm256_fmadd_ps(v, d8, s8o), acc[r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        _Alignas(32) float o[8];
        _mm256_store_ps(o, acc[r]);
        for (int t = 0; t < 8; t++) y[t * ldy + r] = o[t];
    }
}

/* NR rows x 16 tokens (two consecutive 8-token groups): each broadcast weight
 * group serves 16 tokens and the block overhead is paid once per 16. */
KV_INL void tile16(int WT, int NR, int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,
                   const float *xs8, float *y, int64_t ldy) {
    const int FL = (WT == KV_TYPE_Q5_0 || WT == KV_TYPE_Q5_1) ? 4 : 8;
    const int MIN = WT == KV_TYPE_Q4_1 || WT == KV_TYPE_Q5_1;
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
    __m256 acc[2][2];
    _Alignas(32) uint8_t wb[2][32];
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const uint8_t *xi1 = xi + nb * 256;
    const float *xs1 = xs8 + nb * 16;
    for (int64_t b = 0; b < nb; b++) {
        float wd[2], wc[2];
#pragma GCC unroll 2
        for (int r = 0; r < NR; r++) {
            __m256i u = w32_load(WT, W + r * ws, b, &wd[r], &wc[r]);
            _mm256_store_si256((__m256i *)wb[r], u);
        }
        const uint8_t *xb0 = xi + b * 256, *xb1 = xi1 + b * 256, *wp = &wb[0][0];
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
                    __m256i wv = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(wp + 32 * r + 4 * g)));
#if KV_VNNI
                    isum[r][0] = _mm256_dpbusd_epi32(isum[r][0], wv, x0);
                    isum[r][1] = _mm256_dpbusd_epi32(isum[r][1], wv, x1);
#else
                    s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_maddubs_epi16(wv, x0));
                    s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_maddubs_epi16(wv, x1));
#endif
                }
            }
#if !KV_VNNI
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++)
#pragma GCC unroll 2
                for (int k = 0; k < 2; k++) {
                    isum[r][k] = _mm256_add_epi32(isum[r][k], _mm256_madd_epi16(s16[r][k], ones));
                    s16[r][k] = _mm256_setzero_si256();
                }
#endif
        }
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++) {
            const float *f = (k ? xs1 : xs8) + b * 16;
            __m256 d8 = _mm256_load_ps(f), s8 = _mm256_load_ps(f + 8);
            __m256 s8o = MIN ? s8 : _mm256_mul_ps(s8, _mm256_set1_ps((float)-W32_OFF(WT)));
#pragma GCC unroll 2
            for (int r = 0; r < NR; r++) {
                __m256 v = _mm256_cvtepi32_ps(isum[r][k]);
                __m256 dr = _mm256_set1_ps(wd[r]);
                if (MIN) {
                    acc[r][k] = _mm256_fmadd_ps(dr, _mm256_mul_ps(v, d8), acc[r][k]);
                    acc[r][k] = _mm256_fmadd_ps(_mm256_set1_ps(wc[r]), s8, acc[r][k]);
                } else {
                    acc[r][k] = _mm256_fmadd_ps(dr, _mm256_fmadd_ps(v, d8, s8o), acc[r][k]);
                }
            }
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 2
        for (int k = 0; k < 2; k++) {
            _Alignas(32) float o[8];
            _mm256_store_ps(o, acc[r][k]);
            for (int t = 0; t < 8; t++) y[(8 * k + t) * ldy + r] = o[t];
        }
}

#define TILE8_FNS(NAME, WT)                                                                        \
    static KV_AVX2 void NAME##_4(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,      \
                                 const float *xs8, float *y, int64_t ldy) {                         \
        tile8(WT, 4, nb, W, ws, xi, xs8, y, ldy);                                                   \
    }                                                                                               \
    static KV_AVX2 void NAME##_1(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,      \
                                 const float *xs8, float *y, int64_t ldy) {                         \
        tile8(WT, 1, nb, W, ws, xi, xs8, y, ldy);                                                   \
    }                                                                                               \
    static KV_AVX2 void NAME##_16x2(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,   \
                                    const float *xs8, float *y, int64_t ldy) {                      \
        tile16(WT, 2, nb, W, ws, xi, xs8, y, ldy);                                                  \
    }                                                                                               \
    static KV_AVX2 void NAME##_16x1(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *xi,   \
                                    const float *xs8, float *y, int64_t ldy) {                      \
        tile16(WT, 1, nb, W, ws, xi, xs8, y, ldy);                                                  \
    }                                                                                               \
    static KV_AVX2 void NAME(int64_t K, const uint8_t *W, size_t ws, int nr, const uint8_t *xi,    \
                             const float *xs8, int ng, float *y, int64_t ldy) {                     \
        int64_t nb = K / 32;                                                                        \
        int G = 0;                                                                                  \
        for (; KV_T16 && G + 2 <= ng; G += 2) {                                                     \
            const uint8_t *xg = xi + G * nb * 256;                                                  \
            const float *fg = xs8 + G * nb * 16;                                                    \
            float *yg = y + (int64_t)G * 8 * ldy;                                                   \
            int r = 0;                                                                              \
            for (; r + 2 <= nr; r += 2) NAME##_16x2(nb, W + r * ws, ws, xg, fg, yg + r, ldy);       \
            for (; r < nr; r++) NAME##_16x1(nb, W + r * ws, ws, xg, fg, yg + r, ldy);               \
        }                                                                                           \
        for (; G < ng; G++) {                                                                       \
            const uint8_t *xg = xi + G * nb * 256;                                                  \
            const float *fg = xs8 + G * nb * 16;                                                    \
            float *yg = y + (int64_t)G * 8 * ldy;                                                   \
            int r = 0;                                                                              \
            for (; r + 4 <= nr; r += 4) NAME##_4(nb, W + r * ws, ws, xg, fg, yg + r, ldy);          \
            for (; r < nr; r++) NAME##_1(nb, W + r * ws, ws, xg, fg, yg + r, ldy);                  \
        }                                                                                           \
    }

#ifndef KV_T16
#define KV_T16 1
#endif

TILE8_FNS(tile8_q4_0, KV_TYPE_Q4_0)
TILE8_FNS(tile8_q4_1, KV_TYPE_Q4_1)
TILE8_FNS(tile8_q5_0, KV_TYPE_Q5_0)
TILE8_FNS(tile8_q5_1, KV_TYPE_Q5_1)

/* Instantiations and the tile dispatcher for one weight type. */
#define TILE32_FNS(NAME, WT)                                                                       \
    static KV_AVX2 void NAME##_x4_4(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *X,    \
                                    size_t xs, float *y, int64_t ldy, const float *xf, int64_t t0) { \
        tile32x4(WT, 4, nb, W, ws, X, xs, y, ldy, xf, t0);                                          \
    }                                                                                               \
    static KV_AVX2 void NAME##_x4_1(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *X,    \
                                    size_t xs, float *y, int64_t ldy, const float *xf, int64_t t0) { \
        tile32x4(WT, 1, nb, W, ws, X, xs, y, ldy, xf, t0);                                          \
    }                                                                                               \
    static KV_AVX2 void NAME##_4x1(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *X,     \
                                   size_t xs, float *y, int64_t ldy, const float *xf, int64_t t0) { \
        tile32r4(WT, nb, W, ws, X, y, xf, t0); /* one token: y[0..4) contiguous */                 \
    }                                                                                               \
    static KV_AVX2 void NAME##_1x1(int64_t nb, const uint8_t *W, size_t ws, const uint8_t *X,     \
                                   size_t xs, float *y, int64_t ldy, const float *xf, int64_t t0) { \
        tile32(WT, 1, 1, nb, W, ws, X, xs, y, ldy, xf, t0);                                         \
    }                                                                                               \
    static KV_AVX2 void NAME(int64_t K, const uint8_t *W, size_t ws, int nr, const uint8_t *X,     \
                             size_t xs, int nt, float *y, int64_t ldy, const float *xf, int64_t t0) { \
        int64_t nb = K / 32;                                                                        \
        int t = 0;                                                                                  \
        for (; t + 4 <= nt && (t0 + t) % 4 == 0; t += 4) {                                          \
            int r = 0;                                                                              \
            for (; r + 4 <= nr; r += 4)                                                             \
                NAME##_x4_4(nb, W + r * ws, ws, X + t * xs, xs, y + t * ldy + r, ldy, xf, t0 + t);  \
            for (; r < nr; r++)                                                                     \
                NAME##_x4_1(nb, W + r * ws, ws, X + t * xs, xs, y + t * ldy + r, ldy, xf, t0 + t);  \
        }                                                                                           \
        for (; t < nt; t++) {                                                                       \
            int r = 0;                                                                              \
            for (; r + 4 <= nr; r += 4)                                                             \
                NAME##_4x1(nb, W + r * ws, ws, X + t * xs, xs, y + t * ldy + r, ldy, xf, t0 + t);   \
            for (; r < nr; r++)                                                                     \
                NAME##_1x1(nb, W + r * ws, ws, X + t * xs, xs, y + t * ldy + r, ldy, xf, t0 + t);   \
        }                                                                                           \
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
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            __m256i y0 = _mm256_loadu_si256((const __m256i *)(xb[t]->qs + 64 * j));
            __m256i y1 = _mm256_loadu_si256((const __m256i *)(xb[t]->qs + 64 * j + 32));
#if KV_VNNI
            isum[t] = _mm256_dpwssd_epi32(isum[t], _mm256_maddubs_epi16(lo, y0), s0);
            isum[t] = _mm256_dpwssd_epi32(isum[t], _mm256_maddubs_epi16(hi, y1), s1);
#else
            __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, y0), s0);
            __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, y1), s1);
            isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(p0, p1));
#endif
        }
    }
}

KV_INL void tile_k45(int Q5, int NT, int64_t nb, const uint8_t *W, const uint8_t *X, size_t xs,
                     float *y, int64_t ldy) {
    __m256 acc[4];
    float macc[4];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps(), macc[t] = 0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qs, *qh = NULL, *scales;
        float d, dmin;
        if (Q5) {
            const kv_block_q5_k *w = (const kv_block_q5_k *)W + b;
            qs = w->qs, qh = w->qh, scales = w->scales, d = h2f(w->d), dmin = h2f(w->dmin);
        } else {
            const kv_block_q4_k *w = (const kv_block_q4_k *)W + b;
            qs = w->qs, scales = w->scales, d = h2f(w->d), dmin = h2f(w->dmin);
        }
        __m256i sc;
        __m128i mins = k4_scales(scales, &sc);
        const kv_block_q8_k *xb[4];
        __m256i isum[4];
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            xb[t] = (const kv_block_q8_k *)(X + t * xs) + b;
            isum[t] = _mm256_setzero_si256();
        }
        k45_block(NT, qs, qh, sc, xb, isum);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            float dx = xb[t]->d;
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * dx), acc[t]);
            macc[t] += dmin * dx * (float)k_minsum(mins, xb[t]->bsums);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) y[t * ldy] = hsum_ps(acc[t]) - macc[t];
}

/* Q6_K: q = (4 low bits | 2 high bits << 4) in 0..63, minus 32 via bsums. */
KV_INL void tile_q6k(int NT, int64_t nb, const uint8_t *W, const uint8_t *X, size_t xs, float *y,
                     int64_t ldy) {
    __m256 acc[4];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < nb; b++) {
        const kv_block_q6_k *w = (const kv_block_q6_k *)W + b;
        const kv_block_q8_k *xb[4];
        __m256i isum[4];
        __m128i sc8 = _mm_loadu_si128((const __m128i *)w->scales);
        __m256i sc16 = _mm256_cvtepi8_epi16(sc8); /* 16 scales as int16 */
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            xb[t] = (const kv_block_q8_k *)(X + t * xs) + b;
            /* -32 * sum_j sc_j * bsums_j */
            __m256i bs = _mm256_loadu_si256((const __m256i *)xb[t]->bsums);
            isum[t] = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
            isum[t] = _mm256_sub_epi32(_mm256_setzero_si256(), isum[t]);
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
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const int8_t *yq = xb[t]->qs + 128 * h;
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    __m256i yy = _mm256_loadu_si256((const __m256i *)(yq + 32 * k));
#if KV_VNNI
                    isum[t] = _mm256_dpwssd_epi32(isum[t], _mm256_maddubs_epi16(q[k], yy), sc[k]);
#else
                    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], yy), sc[k]);
                    isum[t] = _mm256_add_epi32(isum[t], p);
#endif
                }
            }
        }
        float d = h2f(w->d);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * xb[t]->d), acc[t]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) y[t * ldy] = hsum_ps(acc[t]);
}

#define TILEK_FNS(NAME, CALL4, CALL1)                                                              \
    static KV_AVX2 void NAME##_4(int64_t nb, const uint8_t *W, const uint8_t *X, size_t xs,        \
                                 float *y, int64_t ldy) { CALL4; }                                  \
    static KV_AVX2 void NAME##_1(int64_t nb, const uint8_t *W, const uint8_t *X, size_t xs,        \
                                 float *y, int64_t ldy) { CALL1; }                                  \
    static KV_AVX2 void NAME(int64_t K, const uint8_t *W, size_t ws, int nr, const uint8_t *X,     \
                             size_t xs, int nt, float *y, int64_t ldy, const float *xf,             \
                             int64_t t0) {                                                          \
        int64_t nb = K / 256;                                                                       \
        int t = 0;                                                                                  \
        for (; t + 4 <= nt; t += 4)                                                                 \
            for (int r = 0; r < nr; r++) NAME##_4(nb, W + r * ws, X + t * xs, xs, y + t * ldy + r, ldy); \
        for (; t < nt; t++)                                                                         \
            for (int r = 0; r < nr; r++) NAME##_1(nb, W + r * ws, X + t * xs, xs, y + t * ldy + r, ldy); \
    }                                                                                               \
    static KV_AVX2 void NAME##_dot(int64_t n, float *s, const void *w, const void *x) {             \
        NAME##_1(n / 256, w, x, 0, s, 0);                                                           \
    }

TILEK_FNS(tile_q4_k, tile_k45(0, 4, nb, W, X, xs, y, ldy), tile_k45(0, 1, nb, W, X, xs, y, ldy))
TILEK_FNS(tile_q5_k, tile_k45(1, 4, nb, W, X, xs, y, ldy), tile_k45(1, 1, nb, W, X, xs, y, ldy))
TILEK_FNS(tile_q6_k, tile_q6k(4, nb, W, X, xs, y, ldy), tile_q6k(1, nb, W, X, xs, y, ldy))

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

static KV_AVX2 void quant_q8_0(const float *x, void *dst, int64_t n) {
    kv_block_q8_0 *b = dst;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        float amax = amax32(x);
        float d = amax / 127, id = d != 0 ? 1.0f / d : 0.0f;
        b[i].d = _cvtss_sh(d, 0);
        _mm256_storeu_si256((__m256i *)b[i].qs, q8_block(x, id));
    }
}

static KV_AVX2 void quant_q8_1(const float *x, void *dst, int64_t n) {
    kv_block_q8_1 *b = dst;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        float amax = amax32(x);
        float d = amax / 127, id = d != 0 ? 1.0f / d : 0.0f;
        __m256i q = q8_block(x, id);
        _mm256_storeu_si256((__m256i *)b[i].qs, q);
        __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
        int sum = hsum_epi32(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
        b[i].d = _cvtss_sh(d, 0);
        b[i].s = _cvtss_sh((float)sum * d, 0);
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
    k->f16_to_f32_row = f16_to_f32_row;
    k->f32_to_f16_row = f32_to_f16_row;
    k->quant[KV_TYPE_Q8_0] = quant_q8_0;
    k->quant[KV_TYPE_Q8_1] = quant_q8_1;
    k->quant[KV_TYPE_Q8_K] = quant_q8_k;
    k->tile_rows = 4;
    k->tile_toks = 4;
    return 1;
}

#else

int KV_KERNELS_INSTALL(kv_kernels *k) {
    (void)k;
    return 0;
}

#endif
