/*
 * kvstore.cl — K/V pages: where a (head, position) row lives, and writing
 * new rows into them. attention.cl reads through the same kv_row().
 *
 * Page layout (the CPU cache uses the same): positions are grouped in pages
 * of pt = 2^pt_log2 tokens; a session's table tab[pos / pt] gives the page
 * id. In one layer's K (or V) buffer, head h, page p, token t of the page
 * is row ((h * max_pages + p) * pt + t), row_bytes each: F32 (head_dim
 * floats), F16 (head_dim halves), Q8_0 (head_dim / 32 blocks of an f16
 * scale and 32 int8, 34 bytes per 32 values) or Q4_0 (blocks of an f16
 * scale and 16 bytes: values 0-15 in the low nibbles, 16-31 in the high
 * ones, q + 8; 18 bytes per 32 values). Quantized rows hold Hadamard-rotated
 * K/V (forward.c). Head sizes are multiples of 16 (32 for Q8_0 / Q4_0):
 * rows are read and written 16 values at a time.
 */
#pragma OPENCL FP_CONTRACT OFF

/* KV_PAGE_PARAMS and kv_row(): blocks.cl (rope_qk writes rows too) */

/* values [i, i + 16) of a stored row (i % 16 == 0) */
KV_INL float16 kv_load16(int type, const global uchar *row, int i) {
    if (type == TYPE_F16) return vload_half16(0, (const global half *)row + i);
    if (type == TYPE_Q8_0) {
        const global uchar *b = row + (i / 32) * 34;
        return convert_float16(as_char16(vload16(0, b + 2 + i % 32))) * f16_at(b, 0);
    }
    if (type == TYPE_Q4_0) {
        const global uchar *b = row + (i / 32) * 18;
        const uchar16 q = vload16(0, b + 2);
        const uchar16 u = i % 32 ? q >> (uchar)4 : q & (uchar)0x0F;
        return (convert_float16(u) - 8.0f) * f16_at(b, 0);
    }
    return vload16(0, (const global float *)row + i);
}

/* one row of n floats into the type (Q8_0 as the engine's quantizer:
 * d = amax / 127 stored as f16, q = round(x / d) with the float d) */
KV_INL void kv_put(int type, global uchar *row, const global float *x, int n) {
    if (type == TYPE_F16) {
        for (int i = 0; i < n; i += 16) vstore_half16_rte(vload16(0, x + i), 0, (global half *)row + i);
    } else if (type == TYPE_Q8_0) {
        for (int b0 = 0; b0 < n; b0 += 32) {
            global uchar *b = row + (b0 / 32) * 34;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmax(amax, fabs(x[b0 + i]));
            const float d = amax / 127, id = d != 0.0f ? 1.0f / d : 0.0f;
            vstore_half_rte(d, 0, (global half *)b);
            for (int i = 0; i < 32; i++) ((global char *)b)[2 + i] = (char)round(x[b0 + i] * id);
        }
    } else if (type == TYPE_Q4_0) { /* the engine's: d = (value of largest magnitude) / -8,
                                       q = min(15, trunc(x / d + 8.5)) */
        for (int b0 = 0; b0 < n; b0 += 32) {
            global uchar *b = row + (b0 / 32) * 18;
            float amax = 0.0f, mx = 0.0f;
            for (int i = 0; i < 32; i++)
                if (fabs(x[b0 + i]) > amax) amax = fabs(x[b0 + i]), mx = x[b0 + i];
            const float d = mx / -8, id = d != 0.0f ? 1.0f / d : 0.0f;
            vstore_half_rte(d, 0, (global half *)b);
            for (int i = 0; i < 16; i++) {
                const int q0 = min(15, (int)(char)(x[b0 + i] * id + 8.5f));
                const int q1 = min(15, (int)(char)(x[b0 + 16 + i] * id + 8.5f));
                b[2 + i] = (uchar)(q0 | (q1 << 4));
            }
        }
    } else {
        for (int i = 0; i < n; i++) ((global float *)row)[i] = x[i];
    }
}

/* item (h, t): k(T, n_kv, hd) and v(T, n_kv, hdv) of token t, head h, to
 * position pos0 + t of the layer's K and V buffers */
kernel void kv_store(global uchar *K, global uchar *V, KV_PAGE_PARAMS, int ktype, int vtype,
                     int krow, int vrow, global const float *k, ulong koff, global const float *v,
                     ulong voff, int pos0, int n_kv, int hd, int hdv) {
    const int h = get_global_id(0), t = get_global_id(1);
    if (h >= n_kv) return;
    const int pos = pos0 + t;
    kv_put(ktype, K + kv_row(KV_PAGE_ARGS, h, pos, krow), k + koff + ((ulong)t * n_kv + h) * hd, hd);
    kv_put(vtype, V + kv_row(KV_PAGE_ARGS, h, pos, vrow), v + voff + ((ulong)t * n_kv + h) * hdv, hdv);
}
