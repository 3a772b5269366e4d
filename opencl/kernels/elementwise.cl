/*
 * elementwise.cl — the ops between the matrix products: RMSNorm, RoPE,
 * residual add, scale, FFN activation, soft cap, bias, the finiteness check.
 *
 * Each mirrors the engine's CPU op (engine/backend_cpu.c) operation for
 * operation with contraction off: RMS sums of float squares in double (in
 * float with compensated summation where the device has no fp64), RoPE
 * angles by repeated float multiplication, GELU through f16 inputs and
 * outputs as llama.cpp's CPU table does. Buffers are float arrays with an
 * element offset (`*off`) so views into larger buffers work.
 *
 * Work sizes: elementwise kernels run one item per element, the global size
 * rounded up to the work-group size (items past n return); ffn_act takes
 * 16 elements an item (act16, which the fused gate/up kernel shares).
 */
#pragma OPENCL FP_CONTRACT OFF

#if defined(cl_khr_fp64) && !defined(KVCL_PORTABLE) && !defined(KVCL_NO_FP64)
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#define RMS_DOUBLE 1
#endif

/* ---- RMSNorm: one work-group per row, a fixed-order tree reduction ---- */

#define RMS_GROUP 64 /* work-group size of rmsnorm (the host launches with it) */

/* 1 / sqrt(mean square + eps) from a row's sum of squares (double or float) */
#ifdef RMS_DOUBLE
KV_INL float rms_factor(double sum, int n, float eps) { return 1.0f / sqrt((float)(sum / (double)n) + eps); }
#else
KV_INL float rms_factor(float sum, int n, float eps) { return 1.0f / sqrt(sum / (float)n + eps); }
#endif

/* y(T, n) = x / rms(x) * w (w may be NULL); y == x is fine. With a (not
 * NULL), x += a first (the bits of add; y == a is fine): each item adds the
 * elements it then sums and scales. With xr (not NULL, n a multiple of
 * 32), each row's record of y too (blocks.cl; the zero blocks past n are
 * the host's). */
kernel void rmsnorm(global float *y, ulong yoff, global float *x, ulong xoff, global const float *a, ulong aoff,
                    global const float *w, int n, float eps, global char *xr, int nbx) {
    const int row = get_group_id(0), lid = get_local_id(0);
    global float *xrow = x + xoff + (ulong)row * n; /* (n) */
    global float *yrow = y + yoff + (ulong)row * n; /* (n) */
    if (a) {
        const global float *ar = a + aoff + (ulong)row * n;
        for (int i = lid; i < n; i += RMS_GROUP) xrow[i] += ar[i];
    }
#ifdef RMS_DOUBLE
    local double part[RMS_GROUP];
    double s = 0.0;
    for (int i = lid; i < n; i += RMS_GROUP) s += (double)(xrow[i] * xrow[i]);
#else
    /* float with a compensation term: far below float's rounding for n < 2^20 */
    local float part[RMS_GROUP];
    float s = 0.0f, c = 0.0f;
    for (int i = lid; i < n; i += RMS_GROUP) {
        float v = xrow[i] * xrow[i] - c, t = s + v;
        c = (t - s) - v;
        s = t;
    }
#endif
    part[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int h = RMS_GROUP / 2; h > 0; h /= 2) {
        if (lid < h) part[lid] += part[lid + h];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float sc = rms_factor(part[0], n, eps);
    for (int i = lid; i < n; i += RMS_GROUP) yrow[i] = w ? xrow[i] * sc * w[i] : xrow[i] * sc;
    barrier(CLK_GLOBAL_MEM_FENCE); /* the row's y, written by every item */
    if (!xr) return;
    global char *rec = xr + (ulong)row * nbx * I8_RECORD;
    for (int b = lid; b < n / 32; b += RMS_GROUP) rec_block_at(yrow + 32 * b, rec, nbx, b);
}

/* rmsnorm's row (with a) by one item: the RMS_GROUP lanes' sums kept in
 * an array, element i into lane i % RMS_GROUP in the order a lane's item
 * adds them, then the same tree; so the bits are rmsnorm's. For a kernel
 * whose last work-group norms a row the others wrote (gemv_i8_norm). */
KV_INL void rmsnorm_row1(global float *yrow, global float *xrow, const global float *a, global const float *w, int n,
                         float eps) {
#ifdef RMS_DOUBLE
    double part[RMS_GROUP];
    for (int l = 0; l < RMS_GROUP; l++) part[l] = 0.0;
    for (int i = 0; i < n; i++) {
        if (a) xrow[i] += a[i];
        part[i % RMS_GROUP] += (double)(xrow[i] * xrow[i]);
    }
#else
    float part[RMS_GROUP], comp[RMS_GROUP];
    for (int l = 0; l < RMS_GROUP; l++) part[l] = comp[l] = 0.0f;
    for (int i = 0; i < n; i++) {
        if (a) xrow[i] += a[i];
        const int l = i % RMS_GROUP;
        float v = xrow[i] * xrow[i] - comp[l], t = part[l] + v;
        comp[l] = (t - part[l]) - v;
        part[l] = t;
    }
#endif
    for (int h = RMS_GROUP / 2; h > 0; h /= 2)
        for (int l = 0; l < h; l++) part[l] += part[l + h];
    const float sc = rms_factor(part[0], n, eps);
    for (int i = 0; i < n; i++) yrow[i] = w ? xrow[i] * sc * w[i] : xrow[i] * sc;
}

/* ---- RoPE: one item per (rotated pair i, token t), all heads ---- */

/* pair i's angle at position pos: theta = pos * theta_scale^i by i float
 * multiplications in order (as ggml), then freq_scale * (theta / ff[i]).
 * The running product is volatile: a compiler may otherwise reassociate the
 * chain (Intel's CPU runtime multiplied powers by squaring in rope_qk and
 * not in rope: 10.000001 against 9.99999714 at pos 1000, pair 16 of 32),
 * and rope_qk must give rope's bits, rope the CPU's angles. */
KV_INL float rope_theta(int pos, int i, float theta_scale, float freq_scale, global const float *ff) {
    volatile float theta = (float)pos;
    for (int k = 0; k < i; k++) theta *= theta_scale;
    return freq_scale * (theta / (ff ? ff[i] : 1.0f));
}

/* x(T, n_head, head_dim) rotated in place by rope_theta's angles; NORM
 * rotates (x[2i], x[2i+1]), NEOX (x[i], x[i + n_rot/2]). */
kernel void rope(global float *x, ulong xoff, global const int *pos, int n_head, int head_dim,
                 int n_rot, int neox, float theta_scale, float freq_scale, global const float *ff) {
    const int i = get_global_id(0), t = get_global_id(1), half_rot = n_rot / 2;
    if (i >= half_rot) return;
    const float th = rope_theta(pos[t], i, theta_scale, freq_scale, ff);
    const float c = cos(th), s = sin(th);
    const int a = neox ? i : 2 * i, b = neox ? i + half_rot : 2 * i + 1;
    for (int h = 0; h < n_head; h++) {
        global float *v = x + xoff + ((ulong)t * n_head + h) * head_dim; /* (head_dim) */
        const float p = v[a], d = v[b];
        v[a] = p * c - d * s;
        v[b] = p * s + d * c;
    }
}

/* q(T, n_head, head_dim) and k(T, n_kv, head_dim) of a layer in one launch:
 * rope as above, then q *= q_scale, and every value of both checked
 * finite (atomic_min(flag, 0) otherwise); what rope, rope, scale and two
 * all_finite launches do, with their arithmetic. Item (i, t): i < n_rot / 2
 * rotates pair i of every head; the others take two of the unrotated
 * elements [n_rot, head_dim). With K (not NULL): then token t's rotated
 * keys and its values v(T, n_kv, hdv) into the pages at pos0 + t (F16 or
 * F32 rows), what kv_store does; the same kernel either way, so a rotation
 * has the same bits with or without the store. */
kernel void rope_qk(global float *q, ulong qoff, global float *k, ulong koff, global const int *pos, int n_head,
                    int n_kv, int head_dim, int n_rot, int neox, float theta_scale, float freq_scale,
                    global const float *ff, float q_scale, global int *flag, global uchar *K, global uchar *V,
                    KV_PAGE_PARAMS, int ktype, int vtype, int krow, int vrow, global const float *v, ulong voff,
                    int hdv, int pos0) {
    const int i = get_global_id(0), t = get_global_id(1), half_rot = n_rot / 2;
    if (i >= head_dim / 2) return;
    const bool rot = i < half_rot;
    float c = 1.0f, s = 0.0f;
    int a = n_rot + 2 * (i - half_rot), b = a + 1;
    if (rot) {
        const float th = rope_theta(pos[t], i, theta_scale, freq_scale, ff);
        c = cos(th), s = sin(th);
        a = neox ? i : 2 * i, b = neox ? i + half_rot : 2 * i + 1;
    }
    bool fin = true;
    for (int h = 0; h < n_head + n_kv; h++) {
        const bool isq = h < n_head;
        global float *r = isq ? q + qoff + ((ulong)t * n_head + h) * head_dim
                              : k + koff + ((ulong)t * n_kv + (h - n_head)) * head_dim;
        float p = r[a], d = r[b];
        if (rot) {
            const float p2 = p * c - d * s, d2 = p * s + d * c;
            p = p2, d = d2;
        }
        if (isq && q_scale != 1.0f) p *= q_scale, d *= q_scale;
        r[a] = p, r[b] = d;
        fin = fin && isfinite(p) && isfinite(d);
        if (K && !isq) {
            global uchar *row = K + kv_row(KV_PAGE_ARGS, h - n_head, pos0 + t, krow);
            kv_put1(ktype, row, a, p), kv_put1(ktype, row, b, d);
        }
    }
    if (!fin) atomic_min(flag, 0);
    for (int h = 0; K && h < n_kv; h++) {
        const global float *vr = v + voff + ((ulong)t * n_kv + h) * hdv;
        global uchar *row = V + kv_row(KV_PAGE_ARGS, h, pos0 + t, vrow);
        for (int j = 2 * i; j < hdv; j += head_dim) {
            kv_put1(vtype, row, j, vr[j]);
            if (j + 1 < hdv) kv_put1(vtype, row, j + 1, vr[j + 1]);
        }
    }
}

/* ---- one item per element ---- */

/* y(n) += x(n) */
kernel void add(global float *y, ulong yoff, global const float *x, ulong xoff, long n) {
    const long i = get_global_id(0);
    if (i < n) y[yoff + i] += x[xoff + i];
}

/* x(n) *= s */
kernel void scale(global float *x, ulong xoff, long n, float s) {
    const long i = get_global_id(0);
    if (i < n) x[xoff + i] *= s;
}

/* x(rows, n) = x H: an orthonormal Hadamard matrix on each block of hb
 * values (a power of two <= 256), the rotation of quantized K/V pages
 * (engine/quant.h): item (block, row), butterflies in the CPU's order. */
kernel void hadamard(global float *x, ulong xoff, long rows, int n, int hb, float s) {
    const int blk = get_global_id(0);
    const long r = get_global_id(1);
    if (r >= rows || (blk + 1) * hb > n) return;
    global float *p = x + xoff + r * n + blk * hb;
    float v[256];
    for (int j = 0; j < hb; j++) v[j] = p[j];
    for (int len = 1; len < hb; len *= 2)
        for (int i = 0; i < hb; i += 2 * len)
            for (int j = i; j < i + len; j++) {
                const float a = v[j], c = v[j + len];
                v[j] = a + c, v[j + len] = a - c;
            }
    for (int j = 0; j < hb; j++) p[j] = v[j] * s;
}

/* x(n) = cap * tanh(x / cap) */
kernel void softcap(global float *x, ulong xoff, long n, float cap) {
    const long i = get_global_id(0);
    if (i < n) x[xoff + i] = cap * tanh(x[xoff + i] / cap);
}

/* y(T, rows) [row stride ldy] += bias(rows): item (r, t) */
kernel void add_bias(global float *y, ulong yoff, int ldy, int rows, global const float *bias) {
    const int r = get_global_id(0), t = get_global_id(1);
    if (r < rows) y[yoff + (ulong)t * ldy + r] += bias[r];
}

KV_INL float16 gelu_tanh16(float16 x) {
    const float k0 = 0.79788456080286535587989211986876f, k1 = 0.044715f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + tanh(k0 * x * (1.0f + k1 * x * x)));
}

#define ACT_SILU 0
#define ACT_GELU_TANH 1

/* act(g) * u, 16 lanes computed alike (vector exp and tanh: an element
 * gets the same bits whichever 16 it is computed with). GELU: the input
 * rounded to f16, the result rounded to f16, identity from 10 up and zero
 * from -10 down (the CPU's table). */
KV_INL float16 act16(float16 g, float16 u, int act) {
    float16 y;
    if (act == ACT_GELU_TANH) {
        const float16 t = round_f16x16(gelu_tanh16(round_f16x16(g)));
        y = select(select(t, g, g >= 10.0f), (float16)0.0f, g <= -10.0f);
    } else {
        y = g / (1.0f + exp(-g));
    }
    return y * u;
}

/* g[i] = act(g[i]) * u[i] for i < n <= 16 */
KV_INL void act_span(global float *g, const global float *u, int n, int act) {
    if (n == 16) {
        vstore16(act16(vload16(0, g), vload16(0, u), act), 0, g);
        return;
    }
    float a[16], b[16];
    for (int i = 0; i < 16; i++) a[i] = i < n ? g[i] : 0.0f, b[i] = i < n ? u[i] : 0.0f;
    vstore16(act16(vload16(0, a), vload16(0, b), act), 0, a);
    for (int i = 0; i < n; i++) g[i] = a[i];
}

#define ACT_GROUP 64 /* work-group size of ffn_act (the host launches with it) */

/* gate(n) = act(gate) * up(n), item i taking elements [16 i, 16 i + 16).
 * With xr (not NULL; cols a multiple of 32, so a group's 1024 elements
 * are whole blocks of rows): their records, from what the group stored. */
kernel void ffn_act(global float *gate, ulong goff, global const float *up, ulong uoff, long n, int act,
                    global char *xr, int cols, int nbx) {
    const long i0 = get_global_id(0) * 16;
    if (i0 < n) act_span(gate + goff + i0, up + uoff + i0, (int)min(n - i0, 16L), act);
    barrier(CLK_GLOBAL_MEM_FENCE);
    const int lid = get_local_id(0);
    const long blk = (long)get_group_id(0) * (ACT_GROUP / 2) + lid; /* of gate(T, cols) */
    if (!xr || lid >= ACT_GROUP / 2 || blk * 32 >= n) return;
    const long t = blk / (cols / 32);
    rec_block_at(gate + goff + blk * 32, xr + t * nbx * I8_RECORD, nbx, (int)(blk - t * (cols / 32)));
}

/* *flag = 0 when some x(n) is not finite (the host sets it to 1 first) */
kernel void all_finite(global const float *x, ulong xoff, long n, global int *flag) {
    const long i = get_global_id(0);
    if (i < n && !isfinite(x[xoff + i])) atomic_min(flag, 0);
}
