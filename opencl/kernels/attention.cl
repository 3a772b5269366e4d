/*
 * attention.cl — softmax(q k^T * scale) v over K/V pages (kvstore.cl),
 * causal with an optional sliding window, grouped-query heads, soft cap.
 *
 * attention: one work-group per (block of tb query tokens, KV head g, key
 * split sp); its items are the rows (token, query head of group g), so the
 * K and V tiles it loads into local memory (bk keys, dequantized to float)
 * serve tb * G rows. Each row keeps its query, an online softmax (running
 * max m and sum l, as the CPU engine's att_task) and its output
 * accumulator in private memory.
 *
 * Splits: with split_len > 0, split sp covers keys [sp * split_len,
 * (sp + 1) * split_len): boundaries fixed by key positions, so the result
 * does not depend on the device's work-group count. Each split writes its
 * rows' partial (acc, m, l) and attention_merge combines them in split
 * order. split_len = 0: one split, the output written directly, and with
 * xr its records for the integer kernels too (blocks.cl).
 *
 * Numerics as the engine's scalar path: q rounded to f16 when K is F16,
 * scores q.k in float (16 lane sums), soft cap s = cap * tanh(s * scale / cap) (then the
 * softmax scale is 1), probabilities exp(scale * (s - max)).
 */
#pragma OPENCL FP_CONTRACT ON

#define ATT_TILE 4096  /* floats of the K tile and of the V tile: bk * head_dim <= ATT_TILE */
#define ATT_HD_MAX 256 /* largest head_dim / head_dim_v */
#define ATT_BK_MAX 64  /* largest bk */

/* the online softmax over a tile's scores s[jlo .. jhi], cm their max
 * (and the running max m's): s[j] = exp(sc (s[j] - cm)), the running sum
 * l and max m moved to cm; returns the factor that rescales what came
 * before (attention and attention_row share it, and so their bits) */
KV_INL float softmax_tile(float *s, int jlo, int jhi, float cm, float sc, float *m, float *l) {
    const float corr = *m == -INFINITY ? 0.0f : exp(sc * (*m - cm));
    float ps = 0.0f;
    for (int j = jlo; j <= jhi; j++) {
        s[j] = exp(sc * (s[j] - cm));
        ps += s[j];
    }
    *l = *l * corr + ps;
    *m = cm;
    return corr;
}

/* a row's result: with one split, out = acc / l (o, hdv floats) and with
 * rec its blocks b0 .. of the token's record; else the split's partial
 * (acc, m in exp units, l) at p (attention_merge combines them) */
KV_INL void att_write(float16 *acc, int hdv, float m, float l, float sc, global float *o, global char *rec, int nbx,
                      int b0, global float *p) {
    if (o) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        for (int k = 0; k < hdv / 16; k++) acc[k] *= inv;
        for (int k = 0; k < hdv / 16; k++) vstore16(acc[k], k, o);
        for (int k = 0; rec && k < hdv / 32; k++) rec_block(acc[2 * k], acc[2 * k + 1], rec, nbx, b0 + k);
    } else {
        for (int k = 0; k < hdv / 16; k++) vstore16(acc[k], k, p);
        p[hdv] = m * sc; /* the max in exp units */
        p[hdv + 1] = l;
    }
}

/* the K (or V) rows of keys k0 .. k0 + n - 1 of head g as floats,
 * tile(n, hd): one row per item in turn, 16 values at a time */
KV_INL void load_tile(local float *tile, const global uchar *buf, KV_PAGE_PARAMS, int type,
                      int row_bytes, int g, int k0, int n, int hd) {
    const int lid = get_local_id(0), R = get_local_size(0);
    for (int j = lid; j < n; j += R) {
        const global uchar *row = buf + kv_row(KV_PAGE_ARGS, g, k0 + j, row_bytes);
        for (int i = 0; i < hd; i += 16) vstore16(kv_load16(type, row, i), 0, tile + j * hd + i);
    }
}

/* the arguments of attention and attention_row */
#define ATT_PARAMS global const float *q, ulong qoff, global const uchar *K, global const uchar *V, KV_PAGE_PARAMS, \
    int ktype, int vtype, int krow, int vrow, int T, int pos0, int n_head, int n_kv, int hd, int hdv, float scale, \
    int window, float softcap, int tb, int bk, int split_len, int n_split, global float *out, ulong ooff, \
    global float *part, global char *xr, int nbx

kernel void attention(ATT_PARAMS) {
    local float kt[ATT_TILE], vt[ATT_TILE]; /* (bk, hd), (bk, hdv) */
    const int G = n_head / n_kv, lid = get_local_id(0);
    const int blk = get_group_id(0), g = get_group_id(1), sp = get_group_id(2);
    const int t = blk * tb + lid / G, head = g * G + lid % G;
    const bool live = t < T;

    /* keys this group reads: the union of its rows' ranges, within the split */
    const int t_last = min(T, blk * tb + tb) - 1;
    int kmin = window > 0 ? max(0, pos0 + blk * tb - window + 1) : 0, kmax = pos0 + t_last;
    if (split_len > 0) {
        kmin = max(kmin, sp * split_len);
        kmax = min(kmax, sp * split_len + split_len - 1);
    }
    /* this row: query position and visible keys [lo, qpos] */
    const int qpos = pos0 + t, lo = window > 0 ? max(0, qpos - window + 1) : 0;

    /* q (rounded like the K type) and the output accumulator, 16 lanes each */
    float16 qv[ATT_HD_MAX / 16], acc[ATT_HD_MAX / 16];
    float s[ATT_BK_MAX];
    const global float *qr = q + qoff + ((ulong)min(t, T - 1) * n_head + head) * hd; /* (hd) */
    for (int k = 0; k < hd / 16; k++) qv[k] = ktype == TYPE_F16 ? round_f16x16(vload16(k, qr)) : vload16(k, qr);
    for (int k = 0; k < hdv / 16; k++) acc[k] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const float sc = softcap > 0.0f ? 1.0f : scale; /* the exp scale */

    for (int k0 = kmin; k0 <= kmax; k0 += bk) {
        const int n = min(bk, kmax - k0 + 1);
        barrier(CLK_LOCAL_MEM_FENCE); /* the previous tiles are consumed */
        load_tile(kt, K, KV_PAGE_ARGS, ktype, krow, g, k0, n, hd);
        load_tile(vt, V, KV_PAGE_ARGS, vtype, vrow, g, k0, n, hdv);
        barrier(CLK_LOCAL_MEM_FENCE);
        const int jlo = max(0, lo - k0), jhi = min(n - 1, qpos - k0); /* visible part */
        if (!live || jlo > jhi) continue;
        /* scores and their max */
        float cm = m;
        for (int j = jlo; j <= jhi; j++) {
            float16 a = 0.0f;
            for (int k = 0; k < hd / 16; k++) a = fma(qv[k], vload16(0, kt + j * hd + 16 * k), a);
            float d = hsum16(a);
            if (softcap > 0.0f) d = softcap * tanh(d * scale / softcap);
            s[j] = d;
            cm = fmax(cm, d);
        }
        const float corr = softmax_tile(s, jlo, jhi, cm, sc, &m, &l);
        for (int k = 0; k < hdv / 16; k++) {
            float16 a = acc[k] * corr;
            for (int j = jlo; j <= jhi; j++) a = fma((float16)s[j], vload16(0, vt + j * hdv + 16 * k), a);
            acc[k] = a;
        }
    }
    if (!live) return;
    /* with xr (hdv a multiple of 32): this head's blocks of the token's record */
    att_write(acc, hdv, m, l, sc, n_split == 1 ? out + ooff + ((ulong)t * n_head + head) * hdv : NULL,
              xr ? xr + (ulong)t * nbx * I8_RECORD : NULL, nbx, head * (hdv / 32),
              n_split == 1 ? NULL : part + (((ulong)sp * T + t) * n_head + head) * (hdv + 2));
}

/* item (i, row), row = t * n_head + head: out = sum_s acc_s e^(m_s - M) /
 * sum_s l_s e^(m_s - M), splits in order; part(n_split, T * n_head, hdv + 2) */
kernel void attention_merge(global const float *part, int n_split, int rows, int hdv, global float *out,
                            ulong ooff) {
    const int i = get_global_id(0), row = get_global_id(1);
    if (i >= hdv) return;
    const ulong stride = (ulong)rows * (hdv + 2);
    const global float *p = part + (ulong)row * (hdv + 2);
    float M = -INFINITY;
    for (int s = 0; s < n_split; s++)
        if (p[s * stride + hdv + 1] > 0.0f) M = fmax(M, p[s * stride + hdv]);
    float L = 0.0f, o = 0.0f;
    for (int s = 0; s < n_split; s++) {
        const global float *ps = p + s * stride;
        if (!(ps[hdv + 1] > 0.0f)) continue;
        const float w = exp(ps[hdv] - M);
        L += ps[hdv + 1] * w;
        o += ps[i] * w;
    }
    out[ooff + (ulong)row * hdv + i] = o * (L > 0.0f ? 1.0f / L : 0.0f);
}

/* One token (decode) on CPU drivers: an item per (query head, key split),
 * no local memory and no barriers (a driver that runs a work-group's items
 * in turn keeps a row's arrays in memory across each barrier). The row's
 * operations are attention's for a one-token group, in its order: tiles
 * of bk keys from kmin, scores, the tile's max, the rescale, the values;
 * so the bits are the same. Arguments as attention's (T = 1, tb unused);
 * the head sizes literals where the kernel knows them (the arrays then
 * live in registers). */
KV_INL void att_row(ATT_PARAMS, const int HD, const int HDV) {
    hd = HD, hdv = HDV;
    const int head = get_global_id(0), sp = get_global_id(1), g = head / (n_head / n_kv);
    const int lo = window > 0 ? max(0, pos0 - window + 1) : 0; /* visible keys [lo, pos0] */
    int kmin = lo, kmax = pos0;
    if (split_len > 0) {
        kmin = max(kmin, sp * split_len);
        kmax = min(kmax, sp * split_len + split_len - 1);
    }
    float16 qv[ATT_HD_MAX / 16], acc[ATT_HD_MAX / 16];
    float s[ATT_BK_MAX];
    const global float *qr = q + qoff + (ulong)head * hd; /* (hd) */
    for (int k = 0; k < hd / 16; k++) qv[k] = ktype == TYPE_F16 ? round_f16x16(vload16(k, qr)) : vload16(k, qr);
    for (int k = 0; k < hdv / 16; k++) acc[k] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const float sc = softcap > 0.0f ? 1.0f : scale;

    for (int k0 = kmin; k0 <= kmax; k0 += bk) {
        const int n = min(bk, kmax - k0 + 1);
        const int jlo = max(0, lo - k0), jhi = min(n - 1, pos0 - k0);
        if (jlo > jhi) continue;
        float cm = m;
        for (int j = jlo; j <= jhi; j++) {
            const global uchar *row = K + kv_row(KV_PAGE_ARGS, g, k0 + j, krow);
            float16 a = 0.0f;
            for (int k = 0; k < hd / 16; k++) a = fma(qv[k], kv_load16(ktype, row, 16 * k), a);
            float d = hsum16(a);
            if (softcap > 0.0f) d = softcap * tanh(d * scale / softcap);
            s[j] = d;
            cm = fmax(cm, d);
        }
        const float corr = softmax_tile(s, jlo, jhi, cm, sc, &m, &l);
        for (int k = 0; k < hdv / 16; k++) acc[k] *= corr;
        for (int j = jlo; j <= jhi; j++) {
            const global uchar *row = V + kv_row(KV_PAGE_ARGS, g, k0 + j, vrow);
            for (int k = 0; k < hdv / 16; k++) acc[k] = fma((float16)s[j], kv_load16(vtype, row, 16 * k), acc[k]);
        }
    }
    att_write(acc, hdv, m, l, sc, n_split == 1 ? out + ooff + (ulong)head * hdv : NULL, xr, nbx, head * (hdv / 32),
              n_split == 1 ? NULL : part + ((ulong)sp * n_head + head) * (hdv + 2));
}

#define ATT_ARGS q, qoff, K, V, KV_PAGE_ARGS, ktype, vtype, krow, vrow, T, pos0, n_head, n_kv, hd, hdv, scale, \
    window, softcap, tb, bk, split_len, n_split, out, ooff, part, xr, nbx

kernel void attention_row(ATT_PARAMS) {
    if (get_global_id(0) >= n_head) return;
    if (hd == 64 && hdv == 64) att_row(ATT_ARGS, 64, 64);
    else if (hd == 128 && hdv == 128) att_row(ATT_ARGS, 128, 128);
    else if (hd == 256 && hdv == 256) att_row(ATT_ARGS, 256, 256);
    else att_row(ATT_ARGS, hd, hdv);
}
