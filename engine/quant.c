/*
 * quant.c — weight block formats and the portable CPU kernels.
 *
 * This file owns: half/bfloat16 conversion, dequantization and quantization
 * of rows in the GGUF block formats, the scalar reference dot products
 * (written to mirror ggml's reference code, so results are comparable), the
 * run-time choice between these and the AVX2 kernels of quant_avx2.c, and
 * the threaded matrix product kv_matmul.
 *
 * Dequantization reproduces ggml / gguf-python bit for bit: the float
 * operations are done in the same order ((d * sc) * q - dmin * m ...).
 */
#include "quant.h"

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "quant_impl.h"

/* =========================================================================
 * half / bfloat16
 * ========================================================================= */

static inline float bits_f32(uint32_t w) { float f; memcpy(&f, &w, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t w; memcpy(&w, &f, 4); return w; }

float kv_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | (man << 13)); /* inf / nan */
    if (exp == 0) {
        if (man == 0) return bits_f32(sign);
        /* subnormal: man * 2^-24, exact in float */
        float v = (float)man * 0x1.0p-24f;
        return bits_f32(sign | f32_bits(v));
    }
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t kv_f32_to_f16(float f) {
    uint32_t w = f32_bits(f);
    uint16_t sign = (uint16_t)((w >> 16) & 0x8000);
    uint32_t a = w & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00;             /* nan */
    if (a >= 0x477FF000u) return sign | 0x7C00;            /* rounds to inf (>= 65520) */
    if (a < 0x38800000u) {                                  /* below 2^-14: subnormal half */
        /* value * 2^24 rounded to nearest even integer = half mantissa */
        float v = bits_f32(a) * 0x1.0p24f;                 /* exact: power-of-two scale */
        float r = nearbyintf(v);                            /* default rounding: ties to even */
        return sign | (uint16_t)r;
    }
    /* normal: round mantissa 23 -> 10 bits, ties to even; carries into exp fine */
    uint32_t e = ((a >> 23) - 112) << 10;
    uint32_t m = a & 0x7FFFFFu;
    uint32_t h = e | (m >> 13);
    uint32_t rest = m & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return sign | (uint16_t)h;
}

float kv_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static uint16_t f32_to_bf16(float f) {
    uint32_t w = f32_bits(f);
    if ((w & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((w >> 16) | 64); /* quiet nan */
    return (uint16_t)((w + (0x7FFF + ((w >> 16) & 1))) >> 16);
}

static void f16_to_f32_row_ref(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = kv_f16_to_f32(src[i]);
}

static void f32_to_f16_row_ref(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = kv_f32_to_f16(src[i]);
}

static const kv_kernels *kernels(void);

void kv_f16_to_f32_row(const uint16_t *src, float *dst, int64_t n) {
    kernels()->f16_to_f32_row(src, dst, n);
}

void kv_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n) {
    kernels()->f32_to_f16_row(src, dst, n);
}

#define F16(x) kv_f16_to_f32(x)

/* =========================================================================
 * dequantization (one row; n % block == 0 checked by the caller)
 * ========================================================================= */

static void deq_q4_0(const kv_block_q4_0 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = F16(b[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)((b[i].qs[j] & 0xF) - 8);
            y[j + 16] = d * (float)((b[i].qs[j] >> 4) - 8);
        }
    }
}

static void deq_q4_1(const kv_block_q4_1 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = F16(b[i].d), m = F16(b[i].m);
        for (int j = 0; j < 16; j++) {
            float p0 = d * (float)(b[i].qs[j] & 0xF), p1 = d * (float)(b[i].qs[j] >> 4);
            y[j] = p0 + m;
            y[j + 16] = p1 + m;
        }
    }
}

static void deq_q5_0(const kv_block_q5_0 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = F16(b[i].d);
        uint32_t qh;
        memcpy(&qh, b[i].qh, 4);
        for (int j = 0; j < 16; j++) {
            int x0 = (b[i].qs[j] & 0xF) | (((qh >> j) & 1) << 4);
            int x1 = (b[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)(x0 - 16);
            y[j + 16] = d * (float)(x1 - 16);
        }
    }
}

static void deq_q5_1(const kv_block_q5_1 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = F16(b[i].d), m = F16(b[i].m);
        uint32_t qh;
        memcpy(&qh, b[i].qh, 4);
        for (int j = 0; j < 16; j++) {
            int x0 = (b[i].qs[j] & 0xF) | (((qh >> j) & 1) << 4);
            int x1 = (b[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            float p0 = d * (float)x0, p1 = d * (float)x1;
            y[j] = p0 + m;
            y[j + 16] = p1 + m;
        }
    }
}

static void deq_q8_0(const kv_block_q8_0 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = F16(b[i].d);
        for (int j = 0; j < 32; j++) y[j] = (float)b[i].qs[j] * d;
    }
}

static void deq_q8_1(const kv_block_q8_1 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 32) {
        float d = F16(b[i].d);
        for (int j = 0; j < 32; j++) y[j] = (float)b[i].qs[j] * d;
    }
}

static void deq_q4_k(const kv_block_q4_k *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        const uint8_t *q = b[i].qs;
        for (int j = 0; j < 8; j += 2, q += 32) {
            uint8_t sc, m;
            kv_scale_min_k4(j, b[i].scales, &sc, &m);
            float d1 = d * (float)sc, m1 = dmin * (float)m;
            kv_scale_min_k4(j + 1, b[i].scales, &sc, &m);
            float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; l++) { float p = d1 * (float)(q[l] & 0xF); *y++ = p - m1; }
            for (int l = 0; l < 32; l++) { float p = d2 * (float)(q[l] >> 4); *y++ = p - m2; }
        }
    }
}

static void deq_q5_k(const kv_block_q5_k *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        const uint8_t *ql = b[i].qs, *qh = b[i].qh;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0; j < 8; j += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
            uint8_t sc, m;
            kv_scale_min_k4(j, b[i].scales, &sc, &m);
            float d1 = d * (float)sc, m1 = dmin * (float)m;
            kv_scale_min_k4(j + 1, b[i].scales, &sc, &m);
            float d2 = d * (float)sc, m2 = dmin * (float)m;
            for (int l = 0; l < 32; l++) {
                float p = d1 * (float)((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0));
                *y++ = p - m1;
            }
            for (int l = 0; l < 32; l++) {
                float p = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0));
                *y++ = p - m2;
            }
        }
    }
}

static void deq_q6_k(const kv_block_q6_k *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = F16(b[i].d);
        const uint8_t *ql = b[i].ql, *qh = b[i].qh;
        const int8_t *sc = b[i].scales;
        for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = (d * (float)sc[is]) * (float)q1;
                y[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
                y[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
                y[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
            }
        }
    }
}

static void deq_q8_k(const kv_block_q8_k *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += 256)
        for (int j = 0; j < 256; j++) y[j] = b[i].d * (float)b[i].qs[j];
}

void kv_dequantize_row(int type, const void *src, float *dst, int64_t n) {
    const kv_type_traits *t = kv_type_traits_get(type);
    if (!t || n <= 0 || n % t->blck != 0) return;
    int64_t nb = n / t->blck;
    switch (type) {
    case KV_TYPE_F32: memcpy(dst, src, (size_t)n * 4); break;
    case KV_TYPE_F16: kv_f16_to_f32_row(src, dst, n); break;
    case KV_TYPE_BF16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = kv_bf16_to_f32(s[i]);
        break;
    }
    case KV_TYPE_Q4_0: deq_q4_0(src, dst, nb); break;
    case KV_TYPE_Q4_1: deq_q4_1(src, dst, nb); break;
    case KV_TYPE_Q5_0: deq_q5_0(src, dst, nb); break;
    case KV_TYPE_Q5_1: deq_q5_1(src, dst, nb); break;
    case KV_TYPE_Q8_0: deq_q8_0(src, dst, nb); break;
    case KV_TYPE_Q8_1: deq_q8_1(src, dst, nb); break;
    case KV_TYPE_Q4_K: deq_q4_k(src, dst, nb); break;
    case KV_TYPE_Q5_K: deq_q5_k(src, dst, nb); break;
    case KV_TYPE_Q6_K: deq_q6_k(src, dst, nb); break;
    case KV_TYPE_Q8_K: deq_q8_k(src, dst, nb); break;
    default: memset(dst, 0, (size_t)n * sizeof(float)); break;
    }
}

/* =========================================================================
 * quantization (mirrors ggml's reference quantizers)
 * ========================================================================= */

static void q_q4_0(const float *x, kv_block_q4_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float amax = 0, max = 0;
        for (int j = 0; j < 32; j++)
            if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
        float d = max / -8, id = d != 0 ? 1.0f / d : 0.0f;
        b[i].d = kv_f32_to_f16(d);
        for (int j = 0; j < 16; j++) {
            int x0 = (int8_t)(x[j] * id + 8.5f), x1 = (int8_t)(x[j + 16] * id + 8.5f);
            if (x0 > 15) x0 = 15;
            if (x1 > 15) x1 = 15;
            b[i].qs[j] = (uint8_t)(x0 | (x1 << 4));
        }
    }
}

static void q_q4_1(const float *x, kv_block_q4_1 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float mn = INFINITY, mx = -INFINITY;
        for (int j = 0; j < 32; j++) {
            if (x[j] < mn) mn = x[j];
            if (x[j] > mx) mx = x[j];
        }
        float d = (mx - mn) / 15, id = d != 0 ? 1.0f / d : 0.0f;
        b[i].d = kv_f32_to_f16(d);
        b[i].m = kv_f32_to_f16(mn);
        for (int j = 0; j < 16; j++) {
            int x0 = (int8_t)((x[j] - mn) * id + 0.5f), x1 = (int8_t)((x[j + 16] - mn) * id + 0.5f);
            if (x0 > 15) x0 = 15;
            if (x1 > 15) x1 = 15;
            b[i].qs[j] = (uint8_t)(x0 | (x1 << 4));
        }
    }
}

static void q_q5_0(const float *x, kv_block_q5_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float amax = 0, max = 0;
        for (int j = 0; j < 32; j++)
            if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
        float d = max / -16, id = d != 0 ? 1.0f / d : 0.0f;
        b[i].d = kv_f32_to_f16(d);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            int x0 = (int8_t)(x[j] * id + 16.5f), x1 = (int8_t)(x[j + 16] * id + 16.5f);
            if (x0 > 31) x0 = 31;
            if (x1 > 31) x1 = 31;
            b[i].qs[j] = (uint8_t)((x0 & 0xF) | ((x1 & 0xF) << 4));
            qh |= (uint32_t)((x0 & 0x10) >> 4) << j;
            qh |= (uint32_t)((x1 & 0x10) >> 4) << (j + 16);
        }
        memcpy(b[i].qh, &qh, 4);
    }
}

static void q_q5_1(const float *x, kv_block_q5_1 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float mn = INFINITY, mx = -INFINITY;
        for (int j = 0; j < 32; j++) {
            if (x[j] < mn) mn = x[j];
            if (x[j] > mx) mx = x[j];
        }
        float d = (mx - mn) / 31, id = d != 0 ? 1.0f / d : 0.0f;
        b[i].d = kv_f32_to_f16(d);
        b[i].m = kv_f32_to_f16(mn);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            int x0 = (int8_t)((x[j] - mn) * id + 0.5f), x1 = (int8_t)((x[j + 16] - mn) * id + 0.5f);
            if (x0 > 31) x0 = 31;
            if (x1 > 31) x1 = 31;
            b[i].qs[j] = (uint8_t)((x0 & 0xF) | ((x1 & 0xF) << 4));
            qh |= (uint32_t)((x0 & 0x10) >> 4) << j;
            qh |= (uint32_t)((x1 & 0x10) >> 4) << (j + 16);
        }
        memcpy(b[i].qh, &qh, 4);
    }
}

static void q_q8_0(const float *x, kv_block_q8_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127, id = d != 0 ? 1.0f / d : 0.0f;
        b[i].d = kv_f32_to_f16(d);
        for (int j = 0; j < 32; j++) b[i].qs[j] = (int8_t)roundf(x[j] * id);
    }
}

static void q_q8_1(const float *x, kv_block_q8_1 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127, id = d != 0 ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            b[i].qs[j] = (int8_t)roundf(x[j] * id);
            sum += b[i].qs[j];
        }
        b[i].d = kv_f32_to_f16(d);
        b[i].s = kv_f32_to_f16((float)sum * d);
    }
}

static void q_q8_k(const float *x, kv_block_q8_k *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 256) {
        float amax = 0, max = 0;
        for (int j = 0; j < 256; j++)
            if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
        if (amax == 0) {
            memset(&b[i], 0, sizeof b[i]);
            continue;
        }
        float iscale = -127.f / max;
        for (int j = 0; j < 256; j++) {
            int v = (int)nearbyintf(iscale * x[j]);
            b[i].qs[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += b[i].qs[j * 16 + l];
            b[i].bsums[j] = (int16_t)s;
        }
        b[i].d = 1 / iscale;
    }
}

/* K-quant writers: a simple, correct (not optimal) quantizer for test models. */

static int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Scales and mins (>= 0, subtracted) of the 8 sub-blocks of 32; nmax levels. */
static void k_sub_scales(const float *x, int nmax, float sc[8], float mn[8]) {
    for (int j = 0; j < 8; j++) {
        float lo = 0, hi = 0; /* min clamped to <= 0 as in ggml */
        for (int l = 0; l < 32; l++) {
            float v = x[j * 32 + l];
            if (v < lo) lo = v;
            if (v > hi) hi = v;
        }
        sc[j] = (hi - lo) / (float)nmax;
        mn[j] = -lo;
    }
}

static void k_pack_scales(uint8_t *s, const uint8_t ls[8], const uint8_t lm[8]) {
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)((ls[j] & 63) | ((ls[j + 4] >> 4) << 6));
        s[j + 4] = (uint8_t)((lm[j] & 63) | ((lm[j + 4] >> 4) << 6));
        s[j + 8] = (uint8_t)((ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4));
    }
}

/* Shared by Q4_K (nmax 15) and Q5_K (nmax 31): levels L[256]. */
static void k_quant_super(const float *x, int nmax, uint16_t *dd, uint16_t *dm, uint8_t *scales,
                          uint8_t L[256]) {
    float sc[8], mn[8], maxsc = 0, maxmn = 0;
    k_sub_scales(x, nmax, sc, mn);
    for (int j = 0; j < 8; j++) {
        if (sc[j] > maxsc) maxsc = sc[j];
        if (mn[j] > maxmn) maxmn = mn[j];
    }
    float d = maxsc / 63, dmin = maxmn / 63;
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        ls[j] = (uint8_t)(d > 0 ? clampi((int)nearbyintf(sc[j] / d), 0, 63) : 0);
        lm[j] = (uint8_t)(dmin > 0 ? clampi((int)nearbyintf(mn[j] / dmin), 0, 63) : 0);
    }
    *dd = kv_f32_to_f16(d);
    *dm = kv_f32_to_f16(dmin);
    k_pack_scales(scales, ls, lm);
    float df = kv_f16_to_f32(*dd), dmf = kv_f16_to_f32(*dm);
    for (int j = 0; j < 8; j++) {
        float s = df * ls[j], m = dmf * lm[j];
        for (int l = 0; l < 32; l++) {
            int q = s > 0 ? (int)nearbyintf((x[j * 32 + l] + m) / s) : 0;
            L[j * 32 + l] = (uint8_t)clampi(q, 0, nmax);
        }
    }
}

static void q_q4_k(const float *x, kv_block_q4_k *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 256) {
        uint8_t L[256];
        k_quant_super(x, 15, &b[i].d, &b[i].dmin, b[i].scales, L);
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                b[i].qs[j * 32 + l] = (uint8_t)(L[j * 64 + l] | (L[j * 64 + 32 + l] << 4));
    }
}

static void q_q5_k(const float *x, kv_block_q5_k *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 256) {
        uint8_t L[256];
        k_quant_super(x, 31, &b[i].d, &b[i].dmin, b[i].scales, L);
        memset(b[i].qh, 0, 32);
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int a = L[j * 64 + l], c = L[j * 64 + 32 + l];
                b[i].qs[j * 32 + l] = (uint8_t)((a & 0xF) | ((c & 0xF) << 4));
                if (a & 16) b[i].qh[l] |= (uint8_t)(1 << (2 * j));
                if (c & 16) b[i].qh[l] |= (uint8_t)(2 << (2 * j));
            }
    }
}

static void q_q6_k(const float *x, kv_block_q6_k *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += 256) {
        float s[16], maxs = 0;
        for (int j = 0; j < 16; j++) {
            float amax = 0;
            for (int l = 0; l < 16; l++) amax = fmaxf(amax, fabsf(x[j * 16 + l]));
            s[j] = amax / 31;
            if (s[j] > maxs) maxs = s[j];
        }
        float d = maxs / 127;
        b[i].d = kv_f32_to_f16(d);
        float df = kv_f16_to_f32(b[i].d);
        uint8_t L[256];
        for (int j = 0; j < 16; j++) {
            int sc = d > 0 ? clampi((int)nearbyintf(s[j] / d), -128, 127) : 0;
            b[i].scales[j] = (int8_t)sc;
            float ss = df * (float)sc;
            for (int l = 0; l < 16; l++) {
                int q = ss != 0 ? (int)nearbyintf(x[j * 16 + l] / ss) : 0;
                L[j * 16 + l] = (uint8_t)(clampi(q, -32, 31) + 32);
            }
        }
        uint8_t *ql = b[i].ql, *qh = b[i].qh;
        for (int n = 0; n < 256; n += 128, ql += 64, qh += 32)
            for (int l = 0; l < 32; l++) {
                int q1 = L[n + l], q2 = L[n + l + 32], q3 = L[n + l + 64], q4 = L[n + l + 96];
                ql[l] = (uint8_t)((q1 & 0xF) | ((q3 & 0xF) << 4));
                ql[l + 32] = (uint8_t)((q2 & 0xF) | ((q4 & 0xF) << 4));
                qh[l] = (uint8_t)((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
            }
    }
}

static void quant_ref(int type, const float *src, void *dst, int64_t n) {
    switch (type) {
    case KV_TYPE_F32: memcpy(dst, src, (size_t)n * 4); break;
    case KV_TYPE_F16: f32_to_f16_row_ref(src, dst, n); break;
    case KV_TYPE_BF16: {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
        break;
    }
    case KV_TYPE_Q4_0: q_q4_0(src, dst, n / 32); break;
    case KV_TYPE_Q4_1: q_q4_1(src, dst, n / 32); break;
    case KV_TYPE_Q5_0: q_q5_0(src, dst, n / 32); break;
    case KV_TYPE_Q5_1: q_q5_1(src, dst, n / 32); break;
    case KV_TYPE_Q8_0: q_q8_0(src, dst, n / 32); break;
    case KV_TYPE_Q8_1: q_q8_1(src, dst, n / 32); break;
    case KV_TYPE_Q8_K: q_q8_k(src, dst, n / 256); break;
    case KV_TYPE_Q4_K: q_q4_k(src, dst, n / 256); break;
    case KV_TYPE_Q5_K: q_q5_k(src, dst, n / 256); break;
    case KV_TYPE_Q6_K: q_q6_k(src, dst, n / 256); break;
    }
}

static int quant_supported(int type) {
    switch (type) {
    case KV_TYPE_F32: case KV_TYPE_F16: case KV_TYPE_BF16: case KV_TYPE_Q4_0: case KV_TYPE_Q4_1:
    case KV_TYPE_Q5_0: case KV_TYPE_Q5_1: case KV_TYPE_Q8_0: case KV_TYPE_Q8_1: case KV_TYPE_Q8_K:
    case KV_TYPE_Q4_K: case KV_TYPE_Q5_K: case KV_TYPE_Q6_K: return 1;
    }
    return 0;
}

/* =========================================================================
 * scalar reference dot products
 * ========================================================================= */

static void dot_q4_0(int64_t n, float *s, const void *vw, const void *vx) {
    const kv_block_q4_0 *w = vw;
    const kv_block_q8_0 *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        int si = 0;
        for (int j = 0; j < 16; j++)
            si += ((w[i].qs[j] & 0xF) - 8) * x[i].qs[j] + ((w[i].qs[j] >> 4) - 8) * x[i].qs[j + 16];
        sum += (float)si * F16(w[i].d) * F16(x[i].d);
    }
    *s = sum;
}

static void dot_q4_1(int64_t n, float *s, const void *vw, const void *vx) {
    const kv_block_q4_1 *w = vw;
    const kv_block_q8_1 *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        int si = 0;
        for (int j = 0; j < 16; j++)
            si += (w[i].qs[j] & 0xF) * x[i].qs[j] + (w[i].qs[j] >> 4) * x[i].qs[j + 16];
        sum += (F16(w[i].d) * F16(x[i].d)) * (float)si + F16(w[i].m) * F16(x[i].s);
    }
    *s = sum;
}

static void dot_q5_0(int64_t n, float *s, const void *vw, const void *vx) {
    const kv_block_q5_0 *w = vw;
    const kv_block_q8_0 *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        uint32_t qh;
        memcpy(&qh, w[i].qh, 4);
        int si = 0;
        for (int j = 0; j < 16; j++) {
            int x0 = ((w[i].qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - 16;
            int x1 = ((w[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
            si += x0 * x[i].qs[j] + x1 * x[i].qs[j + 16];
        }
        sum += (float)si * F16(w[i].d) * F16(x[i].d);
    }
    *s = sum;
}

static void dot_q5_1(int64_t n, float *s, const void *vw, const void *vx) {
    const kv_block_q5_1 *w = vw;
    const kv_block_q8_1 *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        uint32_t qh;
        memcpy(&qh, w[i].qh, 4);
        int si = 0;
        for (int j = 0; j < 16; j++) {
            int x0 = (w[i].qs[j] & 0xF) | (((qh >> j) & 1) << 4);
            int x1 = (w[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            si += x0 * x[i].qs[j] + x1 * x[i].qs[j + 16];
        }
        sum += (F16(w[i].d) * F16(x[i].d)) * (float)si + F16(w[i].m) * F16(x[i].s);
    }
    *s = sum;
}

static void dot_q8_0(int64_t n, float *s, const void *vw, const void *vx) {
    const kv_block_q8_0 *w = vw;
    const kv_block_q8_0 *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        int si = 0;
        for (int j = 0; j < 32; j++) si += w[i].qs[j] * x[i].qs[j];
        sum += (float)si * (F16(w[i].d) * F16(x[i].d));
    }
    *s = sum;
}

/* One 256-element super-block of Q4_K or Q5_K (qh == NULL: Q4_K, no fifth
 * bit) against Q8_K: 8 sub-blocks of 32 with 6-bit scales and mins. */
static float dot_k45_block(uint16_t d, uint16_t dmin, const uint8_t *scales, const uint8_t *q,
                           const uint8_t *qh, const kv_block_q8_k *x) {
    const int8_t *y = x->qs;
    int sumi = 0, summ = 0;
    for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
        uint8_t sc0, m0, sc1, m1;
        kv_scale_min_k4(j, scales, &sc0, &m0);
        kv_scale_min_k4(j + 1, scales, &sc1, &m1);
        int a = 0, c = 0;
        for (int l = 0; l < 32; l++) {
            int h0 = qh ? ((qh[l] >> j) & 1) << 4 : 0;
            int h1 = qh ? ((qh[l] >> (j + 1)) & 1) << 4 : 0;
            a += ((q[l] & 0xF) | h0) * y[l];
            c += ((q[l] >> 4) | h1) * y[l + 32];
        }
        sumi += sc0 * a + sc1 * c;
        summ += m0 * (x->bsums[2 * j] + x->bsums[2 * j + 1]) + m1 * (x->bsums[2 * j + 2] + x->bsums[2 * j + 3]);
    }
    return x->d * F16(d) * (float)sumi - x->d * F16(dmin) * (float)summ;
}

static void dot_q4_k(int64_t n, float *s, const void *vw, const void *vx) {
    const kv_block_q4_k *w = vw;
    const kv_block_q8_k *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / 256; i++) sum += dot_k45_block(w[i].d, w[i].dmin, w[i].scales, w[i].qs, NULL, &x[i]);
    *s = sum;
}

static void dot_q5_k(int64_t n, float *s, const void *vw, const void *vx) {
    const kv_block_q5_k *w = vw;
    const kv_block_q8_k *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / 256; i++) sum += dot_k45_block(w[i].d, w[i].dmin, w[i].scales, w[i].qs, w[i].qh, &x[i]);
    *s = sum;
}

static void dot_q6_k(int64_t n, float *s, const void *vw, const void *vx) {
    const kv_block_q6_k *w = vw;
    const kv_block_q8_k *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *ql = w[i].ql, *qh = w[i].qh;
        const int8_t *y = x[i].qs;
        int sumi = 0;
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, y += 128) {
            const int8_t *sc = w[i].scales + 8 * h;
            for (int g = 0; g < 2; g++) { /* l in [16g, 16g+16) */
                int a1 = 0, a2 = 0, a3 = 0, a4 = 0;
                for (int l = 16 * g; l < 16 * g + 16; l++) {
                    int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    a1 += q1 * y[l];
                    a2 += q2 * y[l + 32];
                    a3 += q3 * y[l + 64];
                    a4 += q4 * y[l + 96];
                }
                sumi += sc[g] * a1 + sc[g + 2] * a2 + sc[g + 4] * a3 + sc[g + 6] * a4;
            }
        }
        sum += x[i].d * F16(w[i].d) * (float)sumi;
    }
    *s = sum;
}

static void dot_f32(int64_t n, float *s, const void *vw, const void *vx) {
    const float *w = vw, *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n; i++) sum += w[i] * x[i];
    *s = sum;
}

static void dot_f16(int64_t n, float *s, const void *vw, const void *vx) {
    const uint16_t *w = vw;
    const float *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n; i++) sum += kv_f16_to_f32(w[i]) * x[i];
    *s = sum;
}

static void dot_bf16(int64_t n, float *s, const void *vw, const void *vx) {
    const uint16_t *w = vw;
    const float *x = vx;
    float sum = 0;
    for (int64_t i = 0; i < n; i++) sum += kv_bf16_to_f32(w[i]) * x[i];
    *s = sum;
}

int kv_vec_dot_type(int wtype) {
    switch (wtype) {
    case KV_TYPE_Q4_0: case KV_TYPE_Q5_0: case KV_TYPE_Q8_0: return KV_TYPE_Q8_0;
    case KV_TYPE_Q4_1: case KV_TYPE_Q5_1: return KV_TYPE_Q8_1;
    case KV_TYPE_Q4_K: case KV_TYPE_Q5_K: case KV_TYPE_Q6_K: return KV_TYPE_Q8_K;
    case KV_TYPE_F32: case KV_TYPE_F16: case KV_TYPE_BF16: return KV_TYPE_F32;
    }
    return -1;
}

static kv_dot_fn dot_ref_fn(int wtype) {
    switch (wtype) {
    case KV_TYPE_Q4_0: return dot_q4_0;
    case KV_TYPE_Q4_1: return dot_q4_1;
    case KV_TYPE_Q5_0: return dot_q5_0;
    case KV_TYPE_Q5_1: return dot_q5_1;
    case KV_TYPE_Q8_0: return dot_q8_0;
    case KV_TYPE_Q4_K: return dot_q4_k;
    case KV_TYPE_Q5_K: return dot_q5_k;
    case KV_TYPE_Q6_K: return dot_q6_k;
    case KV_TYPE_F32: return dot_f32;
    case KV_TYPE_F16: return dot_f16;
    case KV_TYPE_BF16: return dot_bf16;
    }
    return NULL;
}

/* =========================================================================
 * dispatch
 * ========================================================================= */

/* Scalar tile: one dot per (row, token). */
static kv_dot_fn g_ref_dot_for_tile[64];
#define REF_TILE(T)                                                                          \
    static void tile_ref_##T(int64_t K, const uint8_t *W, size_t ws, int nr, const uint8_t *X, \
                             size_t xs, int nt, float *y, int64_t ldy, const float *xf,      \
                             int64_t t0) {                                                   \
        for (int t = 0; t < nt; t++)                                                         \
            for (int r = 0; r < nr; r++)                                                     \
                g_ref_dot_for_tile[T](K, &y[t * ldy + r], W + r * ws, X + t * xs);           \
    }
REF_TILE(KV_TYPE_F32)
REF_TILE(KV_TYPE_F16)
REF_TILE(KV_TYPE_BF16)
REF_TILE(KV_TYPE_Q4_0)
REF_TILE(KV_TYPE_Q4_1)
REF_TILE(KV_TYPE_Q5_0)
REF_TILE(KV_TYPE_Q5_1)
REF_TILE(KV_TYPE_Q8_0)
REF_TILE(KV_TYPE_Q4_K)
REF_TILE(KV_TYPE_Q5_K)
REF_TILE(KV_TYPE_Q6_K)

static kv_kernels g_k;
static const char *g_simd = "scalar";
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

#define QREF(T, fn, bs) static void qref_##T(const float *s, void *d, int64_t n) { fn(s, d, n / bs); }
QREF(KV_TYPE_Q8_0, q_q8_0, 32)
QREF(KV_TYPE_Q8_1, q_q8_1, 32)
QREF(KV_TYPE_Q8_K, q_q8_k, 256)
static void qref_f32(const float *s, void *d, int64_t n) { memcpy(d, s, (size_t)n * 4); }

static void kernels_init(void) {
    static const int wt[] = {KV_TYPE_F32, KV_TYPE_F16, KV_TYPE_BF16, KV_TYPE_Q4_0,
                             KV_TYPE_Q4_1, KV_TYPE_Q5_0, KV_TYPE_Q5_1, KV_TYPE_Q8_0,
                             KV_TYPE_Q4_K, KV_TYPE_Q5_K, KV_TYPE_Q6_K};
    for (size_t i = 0; i < sizeof wt / sizeof wt[0]; i++) {
        g_k.dot[wt[i]] = dot_ref_fn(wt[i]);
        g_ref_dot_for_tile[wt[i]] = dot_ref_fn(wt[i]);
    }
    g_k.tile[KV_TYPE_F32] = tile_ref_KV_TYPE_F32;
    g_k.tile[KV_TYPE_F16] = tile_ref_KV_TYPE_F16;
    g_k.tile[KV_TYPE_BF16] = tile_ref_KV_TYPE_BF16;
    g_k.tile[KV_TYPE_Q4_0] = tile_ref_KV_TYPE_Q4_0;
    g_k.tile[KV_TYPE_Q4_1] = tile_ref_KV_TYPE_Q4_1;
    g_k.tile[KV_TYPE_Q5_0] = tile_ref_KV_TYPE_Q5_0;
    g_k.tile[KV_TYPE_Q5_1] = tile_ref_KV_TYPE_Q5_1;
    g_k.tile[KV_TYPE_Q8_0] = tile_ref_KV_TYPE_Q8_0;
    g_k.tile[KV_TYPE_Q4_K] = tile_ref_KV_TYPE_Q4_K;
    g_k.tile[KV_TYPE_Q5_K] = tile_ref_KV_TYPE_Q5_K;
    g_k.tile[KV_TYPE_Q6_K] = tile_ref_KV_TYPE_Q6_K;
    g_k.quant[KV_TYPE_F32] = qref_f32;
    g_k.quant[KV_TYPE_Q8_0] = qref_KV_TYPE_Q8_0;
    g_k.quant[KV_TYPE_Q8_1] = qref_KV_TYPE_Q8_1;
    g_k.quant[KV_TYPE_Q8_K] = qref_KV_TYPE_Q8_K;
    g_k.tile_rows = 1;
    g_k.tile_toks = 1;
    g_k.f16_to_f32_row = f16_to_f32_row_ref;
    g_k.f32_to_f16_row = f32_to_f16_row_ref;

    const char *env = getenv("KVLUA_SIMD");
    if (env && strcmp(env, "scalar") == 0) return;
    /* KVLUA_SIMD=avx2 keeps the AVX2 kernels on a VNNI machine (to test or
     * compare them); otherwise the best set the CPU runs. */
    if (!(env && strcmp(env, "avx2") == 0) && kv_kernels_vnni(&g_k)) g_simd = "avx512vnni";
    else if (kv_kernels_avx2(&g_k)) g_simd = "avx2";
}

static inline const kv_kernels *kernels(void) {
    pthread_once(&g_once, kernels_init);
    return &g_k;
}

const kv_kernels *kv_kernels_get(void) { return kernels(); }

const char *kv_simd_name(void) {
    kernels();
    return g_simd;
}

void kv_vec_dot(int wtype, int64_t n, float *out, const void *w_row, const void *x) {
    const kv_kernels *k = kernels();
    if (wtype < 0 || wtype >= 64 || !k->dot[wtype]) { *out = 0; return; }
    k->dot[wtype](n, out, w_row, x);
}

void kv_vec_dot_ref(int wtype, int64_t n, float *out, const void *w_row, const void *x) {
    kv_dot_fn f = dot_ref_fn(wtype);
    if (!f) { *out = 0; return; }
    f(n, out, w_row, x);
}

int kv_quantize_row(int type, const float *src, void *dst, int64_t n) {
    const kv_type_traits *t = kv_type_traits_get(type);
    if (!t || !quant_supported(type) || n < 0 || n % t->blck != 0) return -1;
    const kv_kernels *k = kernels();
    if (type < 64 && k->quant[type]) /* the SIMD quantizers write the same bytes */
        k->quant[type](src, dst, n);
    else
        quant_ref(type, src, dst, n);
    return 0;
}

/* ---- Hadamard rotation ------------------------------------------------ */

int kv_hadamard_block(int64_t n) {
    int b = 1;
    while (b < 256 && n % (2 * b) == 0) b *= 2;
    return b;
}

/* Fast Walsh-Hadamard transform of each block of hb values, scaled by
 * 1/sqrt(hb) (orthonormal; the matrix is symmetric, so it is its own
 * inverse). Butterflies (a + c, a - c) stage by stage, len = 1, 2, 4, ...:
 * every row gets the same float operations, and the vector form below
 * performs exactly the scalar one's (a + c is c + a, bit for bit), so the
 * OpenCL kernel, written as the scalar loop, gives the same bits. */
typedef float kv_v4 __attribute__((vector_size(16)));
typedef int kv_i4 __attribute__((vector_size(16)));
#ifdef __clang__
#define SHUF1(x, a, b, c, d) __builtin_shufflevector(x, x, a, b, c, d)
#define SHUF2(x, y, a, b, c, d) __builtin_shufflevector(x, y, a, b, c, d)
#else
#define SHUF1(x, a, b, c, d) __builtin_shuffle(x, (kv_i4){a, b, c, d})
#define SHUF2(x, y, a, b, c, d) __builtin_shuffle(x, y, (kv_i4){a, b, c, d})
#endif

static void hadamard_block(float *v, int hb) {
    if (hb < 8) {
        for (int len = 1; len < hb; len *= 2)
            for (int i = 0; i < hb; i += 2 * len)
                for (int j = i; j < i + len; j++) {
                    const float a = v[j], c = v[j + len];
                    v[j] = a + c, v[j + len] = a - c;
                }
        return;
    }
    for (int i = 0; i < hb; i += 8) { /* len 1, 2 inside each 4, then 4 across the two halves */
        kv_v4 x, y;
        memcpy(&x, v + i, 16), memcpy(&y, v + i + 4, 16);
        kv_v4 t = SHUF1(x, 1, 0, 3, 2), u = SHUF1(y, 1, 0, 3, 2);
        x = SHUF2(x + t, t - x, 0, 5, 2, 7); /* [a0+a1, a0-a1, a2+a3, a2-a3] */
        y = SHUF2(y + u, u - y, 0, 5, 2, 7);
        t = SHUF1(x, 2, 3, 0, 1), u = SHUF1(y, 2, 3, 0, 1);
        x = SHUF2(x + t, t - x, 0, 1, 6, 7);
        y = SHUF2(y + u, u - y, 0, 1, 6, 7);
        const kv_v4 s = x + y, d = x - y;
        memcpy(v + i, &s, 16), memcpy(v + i + 4, &d, 16);
    }
    for (int len = 8; len < hb; len *= 2)
        for (int i = 0; i < hb; i += 2 * len)
            for (int j = i; j < i + len; j += 4) {
                kv_v4 a, c;
                memcpy(&a, v + j, 16), memcpy(&c, v + j + len, 16);
                const kv_v4 s = a + c, d = a - c;
                memcpy(v + j, &s, 16), memcpy(v + j + len, &d, 16);
            }
}

void kv_hadamard_rows(float *x, int64_t rows, int64_t n) {
    const int hb = kv_hadamard_block(n);
    if (hb < 2) return;
    const float s = (float)(1.0 / sqrt((double)hb));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b0 = 0; b0 < n; b0 += hb) {
            float *v = x + r * n + b0;
            hadamard_block(v, hb);
            for (int j = 0; j < hb; j++) v[j] *= s;
        }
}

/* =========================================================================
 * matrix product
 *
 * 1. x (T, K) is quantized once to the dot type (threads split the tokens
 *    when T is large), with a float side table of block scales and sums,
 *    and, for weight types with a tile8 kernel, an 8-token interleaved
 *    copy (see quant_impl.h).
 * 2. Output rows are cut into chunks (about 4 per thread, at most ~256 KiB
 *    of weights when T > 1 so a chunk stays in L2 while all tokens pass over
 *    it), handed out through an atomic counter.
 * 3. Each chunk runs the tile kernels: 8/16-token tiles over the whole
 *    chunk, then tile_rows x tile_toks tiles for the remaining tokens.
 * Every kernel gives a (row, token) the same sequence of float operations,
 * so y does not depend on T, on a token's place in the batch or on the
 * thread count (batch invariance; tests/test_quant.c checks it).
 * ========================================================================= */

#define SCRATCH_ALIGN 64
/* The fewest tokens of a last, partial 8-token group worth a padded tile8
 * pass; fewer go one by one through the decode kernel. Either way a token
 * gets the same bits (the kernels share the order of the sums). */
#define TILE8_MIN_TAIL 3

/* Scratch (each part 64-byte aligned):
 *   X    (T, row size)              activations quantized to the dot type
 *   xf   side table (groups of 4)   32-element formats only
 *   xi   8-token interleaved quants (T / 8 groups)    when a tile8 kernel exists
 *   xs8  8-token scales and sums                      idem */
static size_t al64(size_t n) { return (n + SCRATCH_ALIGN - 1) / SCRATCH_ALIGN * SCRATCH_ALIGN; }

static size_t side_floats(int vt, int64_t K, int64_t T) {
    if (vt != KV_TYPE_Q8_0 && vt != KV_TYPE_Q8_1) return 0;
    return (size_t)((T + 3) / 4) * (size_t)(K / 32) * 8;
}

/* groups of 8 tokens, the last one padded */
static size_t inter_bytes(int vt, int64_t K, int64_t T) {
    if (vt != KV_TYPE_Q8_0 && vt != KV_TYPE_Q8_1) return 0;
    return (size_t)((T + 7) / 8) * (size_t)(K / 32) * 256;
}

static size_t inter_floats(int vt, int64_t K, int64_t T) {
    return inter_bytes(vt, K, T) / 256 * KV_X8F;
}

size_t kv_matmul_scratch_size(int wtype, int64_t K, int64_t T) {
    int vt = kv_vec_dot_type(wtype);
    size_t rs = vt < 0 ? 0 : kv_row_size(vt, K);
    if (T < 0) T = 0;
    return SCRATCH_ALIGN + al64(rs * (size_t)T) + al64(side_floats(vt, K, T) * sizeof(float)) +
           al64(inter_bytes(vt, K, T)) + inter_floats(vt, K, T) * sizeof(float);
}

/* One weight of a product: its rows go to y (row stride ldy); its chunks
 * are [c0, c0 + nchunks) of the job's shared counter. */
typedef struct {
    kv_tile_fn tile;
    const uint8_t *W;
    size_t ws;
    int64_t rows, ldy;
    float *y;
    int wtype;
    int64_t chunk, nchunks, c0;
} mm_part;

typedef struct {
    const kv_kernels *k;
    int64_t K, T;
    size_t xs;
    const float *x;
    uint8_t *X; /* (T, xs) quantized activations */
    float *xf;  /* side table or NULL */
    uint8_t *xi; /* 8-token interleaved quants or NULL */
    float *xs8;  /* their scales and sums */
    int64_t t8;  /* tokens [0, t8) go through the tile8 kernel */
    int vt;
    int64_t nq;  /* blocks of the dot type in a row of x */
    mm_part *parts;
    int64_t nchunks; /* all parts' */
    atomic_long next;
} mm_job;

/* Blocks [b0, b1) (of the dot type) of every token: the tile8 tokens
 * (below t8) straight into the interleaved layout, the others quantized
 * as rows with their side table entries. Threads split the blocks, so
 * each writes its own cache lines of the interleaved layout (a split by
 * tokens would have them share every line). */
static void mm_quant_blocks(mm_job *j, int64_t b0, int64_t b1) {
    if (b0 >= b1) return;
    kv_quant_fn qf = j->k->quant[j->vt];
    const int64_t blk = kv_type_traits_get(j->vt)->blck, nb = j->K / 32;
    const size_t bsz = kv_row_size(j->vt, blk);
    int64_t t = 0;
    if (j->xi) /* 8-token groups, the last one padded with zeros */
        for (; t < j->t8; t += 8)
            j->k->quant_x8(j->x + t * j->K, j->K, (int)(j->t8 - t < 8 ? j->t8 - t : 8), b0, b1,
                           j->xi + t / 8 * nb * 256, j->xs8 + t / 8 * nb * KV_X8F);
    for (t = j->t8; t < j->T; t++) {
        uint8_t *row = j->X + t * j->xs;
        qf(j->x + t * j->K + b0 * blk, row + b0 * bsz, (b1 - b0) * blk);
        if (!j->xf) continue; /* 32-element blocks from here (Q8_0 / Q8_1) */
        const size_t qoff = j->vt == KV_TYPE_Q8_0 ? offsetof(kv_block_q8_0, qs) : offsetof(kv_block_q8_1, qs);
        for (int64_t b = b0; b < b1; b++) {
            const uint8_t *bp = row + b * bsz;
            uint16_t dh;
            memcpy(&dh, bp, 2);
            const int8_t *qs = (const int8_t *)(bp + qoff);
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) sum += qs[i];
            float d = kv_f16_to_f32(dh);
            j->xf[KV_XF(t, b, nb)] = d;
            j->xf[KV_XF(t, b, nb) + 4] = d * (float)sum;
        }
    }
}

static void mm_quant_task(void *arg, int ith, int nth) {
    mm_job *j = arg;
    mm_quant_blocks(j, j->nq * ith / nth, j->nq * (ith + 1) / nth);
}

/* Rows [r0, r1) of part p for all tokens, tiles of tr rows x tt tokens (x 8
 * tokens with the interleaved layout where there is one). */
static void mm_rows(const mm_job *j, const mm_part *p, int64_t r0, int64_t r1) {
    int tr = j->k->tile_rows, tt = j->k->tile_toks;
    int64_t t = 0;
    if (j->xi) {
        j->k->tile8[p->wtype](j->K, p->W + r0 * p->ws, p->ws, (int)(r1 - r0), j->xi, j->xs8, (int)j->t8,
                              p->y + r0, p->ldy);
        t = j->t8;
    }
    for (; t < j->T; t += tt) {
        int nt = (int)(j->T - t < tt ? j->T - t : tt);
        for (int64_t r = r0; r < r1; r += tr) {
            int nr = (int)(r1 - r < tr ? r1 - r : tr);
            p->tile(j->K, p->W + r * p->ws, p->ws, nr, j->X + t * j->xs, j->xs, nt, p->y + t * p->ldy + r,
                    p->ldy, j->xf, t);
        }
    }
}

static void mm_task(void *arg, int ith, int nth) {
    mm_job *j = arg;
    /* every chunk from the shared counter: a thread that starts late finds
     * the work done instead of holding a chunk of its own */
    (void)ith, (void)nth;
    int pi = 0;
    for (int64_t c = atomic_fetch_add(&j->next, 1); c < j->nchunks; c = atomic_fetch_add(&j->next, 1)) {
        while (c >= j->parts[pi].c0 + j->parts[pi].nchunks) pi++; /* chunks only grow */
        const mm_part *p = &j->parts[pi];
        int64_t r0 = (c - p->c0) * p->chunk, r1 = r0 + p->chunk;
        if (r1 > p->rows) r1 = p->rows;
        mm_rows(j, p, r0, r1);
    }
}

/* The product of every part with x (T, K), all parts' weight types sharing
 * the dot type vt: x is quantized once, and the parts' row chunks go
 * through one dispatch. Parts with nothing to do (bad arguments) are
 * skipped, as kv_matmul skips them. */
static void matmul_parts(kv_pool *pool, int vt, mm_part *parts, int nparts, int64_t K, const float *x, int64_t T,
                         void *scratch) {
    const kv_kernels *k = kernels();
    size_t xs = kv_row_size(vt, K);
    if (xs == 0 || !x || (vt != KV_TYPE_F32 && !scratch)) return;
    int nth = pool ? kv_pool_size(pool) : 1;

    mm_job j;
    memset(&j, 0, sizeof j);
    j.k = k;
    j.K = K, j.T = T, j.xs = xs, j.x = x, j.vt = vt;
    j.parts = parts;
    if (vt == KV_TYPE_F32) {
        j.X = (uint8_t *)x; /* row stride K floats = xs bytes */
    } else {
        uintptr_t p = ((uintptr_t)scratch + SCRATCH_ALIGN - 1) & ~(uintptr_t)(SCRATCH_ALIGN - 1);
        j.X = (uint8_t *)p;
        uint8_t *q = j.X + al64(xs * (size_t)T);
        if (side_floats(vt, K, T)) j.xf = (float *)q;
        q += al64(side_floats(vt, K, T) * sizeof(float));
        /* 8-token tiles for the whole groups, and for a last partial
         * group (padded) unless a token or two alone are cheaper */
        j.t8 = T % 8 >= TILE8_MIN_TAIL ? T : T / 8 * 8;
        bool tile8 = j.t8 > 0 && inter_bytes(vt, K, T) > 0;
        for (int i = 0; i < nparts; i++) tile8 = tile8 && k->tile8[parts[i].wtype] && k->quant_x8;
        if (tile8) {
            j.xi = q;
            j.xs8 = (float *)(q + al64(inter_bytes(vt, K, T)));
        } else {
            j.t8 = 0;
        }
        /* threads split the blocks: worth a dispatch from 4 tokens a thread */
        j.nq = K / kv_type_traits_get(vt)->blck;
        if (nth > 1 && T >= 4 * nth && j.nq >= nth)
            kv_pool_run(pool, mm_quant_task, &j);
        else
            mm_quant_blocks(&j, 0, j.nq);
    }

    /* Row chunks: about 4 per thread (dynamic balance), rounded to the tile
     * (16 rows with the 8-token tiles, whose widest kernel takes 16),
     * small enough that a chunk's weights stay in L2 across token tiles. */
    int tr = j.xi && 16 % k->tile_rows == 0 ? 16 : k->tile_rows;
    for (int i = 0; i < nparts; i++) {
        mm_part *p = &parts[i];
        int64_t chunk = (p->rows + 4 * nth - 1) / (4 * nth);
        int64_t maxrows = (int64_t)((256 * 1024) / p->ws);
        if (T > 1 && chunk > maxrows) chunk = maxrows;
        if (chunk < 16) chunk = 16;
        chunk = (chunk + tr - 1) / tr * tr;
        p->chunk = chunk;
        p->nchunks = (p->rows + chunk - 1) / chunk;
        p->c0 = j.nchunks;
        j.nchunks += p->nchunks;
    }
    atomic_init(&j.next, 0);
    if (nth > 1 && j.nchunks > 1)
        kv_pool_run(pool, mm_task, &j);
    else
        mm_task(&j, 0, 1);
}

/* A part for W, or false when the product has nothing to do. */
static bool mm_part_init(mm_part *p, int wtype, const void *W, int64_t rows, int64_t K, float *y, int64_t ldy,
                         int64_t T) {
    const kv_kernels *k = kernels();
    if (kv_vec_dot_type(wtype) < 0 || rows <= 0 || T <= 0 || K <= 0 || !k->tile[wtype]) return false;
    size_t ws = kv_row_size(wtype, K);
    if (ws == 0 || !W || !y || (T > 1 && ldy < rows)) return false;
    *p = (mm_part){.tile = k->tile[wtype], .W = W, .ws = ws, .rows = rows, .ldy = ldy, .y = y, .wtype = wtype};
    return true;
}

void kv_matmul(kv_pool *pool, int wtype, const void *W, int64_t rows, int64_t K,
               const float *x, int64_t T, float *y, int64_t ldy, void *scratch) {
    mm_part p;
    if (mm_part_init(&p, wtype, W, rows, K, y, ldy, T))
        matmul_parts(pool, kv_vec_dot_type(wtype), &p, 1, K, x, T, scratch);
}

void kv_matmul_n(kv_pool *pool, int n, const kv_mm_out *outs, int64_t K, const float *x, int64_t T, void *scratch) {
    mm_part parts[KV_MATMUL_N_MAX];
    int np = 0, vt = -1;
    for (int i = 0; i < n && i < KV_MATMUL_N_MAX; i++) {
        const kv_mm_out *o = &outs[i];
        if (!mm_part_init(&parts[np], o->wtype, o->W, o->rows, K, o->y, o->ldy, T)) continue;
        int v = kv_vec_dot_type(o->wtype);
        if (np > 0 && v != vt) { /* another dot type: its own quantization */
            matmul_parts(pool, v, &parts[np], 1, K, x, T, scratch);
            continue;
        }
        vt = v, np++;
    }
    if (np > 0) matmul_parts(pool, vt, parts, np, K, x, T, scratch);
}
