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
 * Segments: a row reduces its keys in segments [256 s, 256 s + 256)
 * (ATT_SEG), each from a fresh state, in tiles of bk keys that start at
 * the segment's start (fixed by key positions: a row's bits do not depend
 * on the rows or the chunk it comes with, the split, or the kernel), and
 * merges the segments' (acc, m, l) in position order (seg_merge). With
 * n_split > 1, work-group sp takes segment sp only and writes its rows'
 * partials; attention_merge merges them with the same seg_merge. With one
 * split the output is written directly, and with xr its records for the
 * integer kernels too (blocks.cl).
 *
 * Numerics as the engine's scalar path: q rounded to f16 when K is F16,
 * scores q.k in float (16 lane sums), soft cap s = cap * tanh(s * scale / cap) (then the
 * softmax scale is 1), probabilities exp(scale * (s - max)).
 */
/* contraction off, as in every kernel source (test_opencl): an fma is written fma() */
#pragma OPENCL FP_CONTRACT OFF

#define ATT_TILE 4096  /* floats of the K tile and of the V tile: bk * head_dim <= ATT_TILE */
#define ATT_HD_MAX 256 /* largest head_dim / head_dim_v */
#define ATT_BK_MAX 64  /* largest bk */
#define ATT_SEG 256    /* keys per segment (= ATT_SEG in kvcl_attention.c) */

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
    *l = fma(*l, corr, ps);
    *m = cm;
    return corr;
}

/* A segment's state (m in exp units, sum l) merged into a row's running
 * (M, L), segments in position order: 0 when the segment saw no key (l is
 * 0: nothing to merge), 1 when it is the first that did (the total is its
 * accumulator as it is), 2 otherwise: total = total c1 + acc c2, each
 * element fma(acc, c2, total * c1) (seg_merge16, attention_merge). The
 * kernels that merge in a work-item and attention_merge across work-groups
 * share it, and so the bits of a row. */
KV_INL int seg_factors(float m, float l, float *M, float *L, float *c1, float *c2) {
    if (!(l > 0.0f)) return 0;
    if (!(*L > 0.0f)) {
        *M = m, *L = l;
        return 1;
    }
    const float Mn = fmax(*M, m);
    *c1 = exp(*M - Mn), *c2 = exp(m - Mn);
    *L = fma(l, *c2, *L * *c1);
    *M = Mn;
    return 2;
}

/* a segment's (acc, m in exp units, l) into the row's (tot, M, L), hdv values */
KV_INL void seg_merge16(float16 *tot, float *M, float *L, const float16 *acc, float m, float l, int hdv) {
    float c1 = 0.0f, c2 = 0.0f;
    const int how = seg_factors(m, l, M, L, &c1, &c2);
    for (int k = 0; how && k < hdv / 16; k++) tot[k] = how == 1 ? acc[k] : fma(acc[k], (float16)c2, tot[k] * c1);
}

/* a row's result out = tot / L (o, hdv floats), with rec its blocks b0 ..
 * of the token's record */
KV_INL void att_out(float16 *tot, int hdv, float L, global float *o, global char *rec, int nbx, int b0) {
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int k = 0; k < hdv / 16; k++) tot[k] *= inv;
    for (int k = 0; k < hdv / 16; k++) vstore16(tot[k], k, o);
    for (int k = 0; rec && k < hdv / 32; k++) rec_block(tot[2 * k], tot[2 * k + 1], rec, nbx, b0 + k);
}

/* a row's partial of one segment at p: acc, m in exp units, l (attention_merge combines them) */
KV_INL void att_part(const float16 *acc, int hdv, float m, float l, global float *p) {
    for (int k = 0; k < hdv / 16; k++) vstore16(acc[k], k, p);
    p[hdv] = m;
    p[hdv + 1] = l;
}

/* the K (or V) rows of keys k0 + j0 .. k0 + j1 of head g as floats into
 * rows j0 .. j1 of tile(bk, hd): one row per item in turn, 16 values at a
 * time (keys before j0 may be in pages a window dropped: never read) */
KV_INL void load_tile(local float *tile, const global uchar *buf, KV_PAGE_PARAMS, int type,
                      int row_bytes, int g, int k0, int j0, int j1, int hd) {
    const int lid = get_local_id(0), R = get_local_size(0);
    for (int j = j0 + lid; j <= j1; j += R) {
        const global uchar *row = buf + kv_row(KV_PAGE_ARGS, g, k0 + j, row_bytes);
        for (int i = 0; i < hd; i += 16) vstore16(kv_load16(type, row, i), 0, tile + j * hd + i);
    }
}

/* the first tile of the keys [k, ...] in segment s0: tiles of bk keys from the segment's start */
KV_INL int tile_start(int s0, int k, int bk) { return s0 + (k - s0) / bk * bk; }

/* the arguments of attention and attention_row */
#define ATT_PARAMS global const float *q, ulong qoff, global const uchar *K, global const uchar *V, KV_PAGE_PARAMS, \
    int ktype, int vtype, int krow, int vrow, int T, int pos0, int n_head, int n_kv, int hd, int hdv, float scale, \
    int window, float softcap, int tb, int bk, int n_split, global float *out, ulong ooff, global float *part, \
    global char *xr, int nbx

kernel void attention(ATT_PARAMS) {
    local float kt[ATT_TILE], vt[ATT_TILE]; /* (bk, hd), (bk, hdv) */
    const int G = n_head / n_kv, lid = get_local_id(0);
    const int blk = get_group_id(0), g = get_group_id(1), sp = get_group_id(2);
    const int t = blk * tb + lid / G, head = g * G + lid % G;
    const bool live = t < T;

    /* keys this group reads: the union of its rows' ranges, within segment sp when split */
    const int t_last = min(T, blk * tb + tb) - 1;
    int kmin = window > 0 ? max(0, pos0 + blk * tb - window + 1) : 0, kmax = pos0 + t_last;
    if (n_split > 1) {
        kmin = max(kmin, sp * ATT_SEG);
        kmax = min(kmax, sp * ATT_SEG + ATT_SEG - 1);
    }
    /* this row: query position and visible keys [lo, qpos] */
    const int qpos = pos0 + t, lo = window > 0 ? max(0, qpos - window + 1) : 0;

    /* q (rounded like the K type), the segment's accumulator and the row's total, 16 lanes each */
    float16 qv[ATT_HD_MAX / 16], acc[ATT_HD_MAX / 16], tot[ATT_HD_MAX / 16];
    float s[ATT_BK_MAX];
    const global float *qr = q + qoff + ((ulong)min(t, T - 1) * n_head + head) * hd; /* (hd) */
    for (int k = 0; k < hd / 16; k++) qv[k] = ktype == TYPE_F16 ? round_f16x16(vload16(k, qr)) : vload16(k, qr);
    for (int k = 0; k < hdv / 16; k++) tot[k] = 0.0f;
    float m = -INFINITY, l = 0.0f, M = -INFINITY, L = 0.0f;
    const float sc = softcap > 0.0f ? 1.0f : scale; /* the exp scale */

    for (int s0 = kmin / ATT_SEG * ATT_SEG; s0 <= kmax; s0 += ATT_SEG) {
        const int s1 = min(kmax, s0 + ATT_SEG - 1); /* the segment's keys [max(kmin, s0), s1] */
        for (int k = 0; k < hdv / 16; k++) acc[k] = 0.0f;
        m = -INFINITY, l = 0.0f;
        for (int k0 = tile_start(s0, max(kmin, s0), bk); k0 <= s1; k0 += bk) {
            const int j0 = max(0, kmin - k0), j1 = min(bk - 1, s1 - k0); /* the tile's keys loaded */
            barrier(CLK_LOCAL_MEM_FENCE); /* the previous tiles are consumed */
            load_tile(kt, K, KV_PAGE_ARGS, ktype, krow, g, k0, j0, j1, hd);
            load_tile(vt, V, KV_PAGE_ARGS, vtype, vrow, g, k0, j0, j1, hdv);
            barrier(CLK_LOCAL_MEM_FENCE);
            const int jlo = max(j0, lo - k0), jhi = min(j1, qpos - k0); /* visible part */
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
        if (n_split == 1) seg_merge16(tot, &M, &L, acc, m * sc, l, hdv);
    }
    if (!live) return;
    if (n_split > 1) att_part(acc, hdv, m * sc, l, part + (((ulong)sp * T + t) * n_head + head) * (hdv + 2));
    else /* with xr (hdv a multiple of 32): this head's blocks of the token's record */
        att_out(tot, hdv, L, out + ooff + ((ulong)t * n_head + head) * hdv, xr ? xr + (ulong)t * nbx * I8_RECORD : NULL,
                nbx, head * (hdv / 32));
}

/* item (i, row), row = t * n_head + head: the segments' partials merged in
 * order as attention merges them in a work-item (seg_factors), out =
 * total / L; part(n_split, T * n_head, hdv + 2) */
kernel void attention_merge(global const float *part, int n_split, int rows, int hdv, global float *out,
                            ulong ooff) {
    const int i = get_global_id(0), row = get_global_id(1);
    if (i >= hdv) return;
    const ulong stride = (ulong)rows * (hdv + 2);
    const global float *p = part + (ulong)row * (hdv + 2);
    float M = -INFINITY, L = 0.0f, o = 0.0f;
    for (int s = 0; s < n_split; s++) {
        const global float *ps = p + s * stride;
        float c1 = 0.0f, c2 = 0.0f;
        const int how = seg_factors(ps[hdv], ps[hdv + 1], &M, &L, &c1, &c2);
        if (how) o = how == 1 ? ps[i] : fma(ps[i], c2, o * c1);
    }
    out[ooff + (ulong)row * hdv + i] = o * (L > 0.0f ? 1.0f / L : 0.0f);
}

/* One token (decode) on CPU drivers: an item per (query head, key split),
 * no local memory and no barriers (a driver that runs a work-group's items
 * in turn keeps a row's arrays in memory across each barrier). The row's
 * operations are attention's for a one-token group, in its order:
 * segments, tiles of bk keys from each segment's start, scores, the tile's
 * max, the rescale, the values, the merge; so the bits are the same.
 * Arguments as attention's (T = 1, tb unused); the head sizes literals
 * where the kernel knows them (the arrays then live in registers). */
KV_INL void att_row(ATT_PARAMS, const int HD, const int HDV) {
    hd = HD, hdv = HDV;
    const int head = get_global_id(0), sp = get_global_id(1), g = head / (n_head / n_kv);
    const int lo = window > 0 ? max(0, pos0 - window + 1) : 0; /* visible keys [lo, pos0] */
    int kmin = lo, kmax = pos0;
    if (n_split > 1) {
        kmin = max(kmin, sp * ATT_SEG);
        kmax = min(kmax, sp * ATT_SEG + ATT_SEG - 1);
    }
    float16 qv[ATT_HD_MAX / 16], acc[ATT_HD_MAX / 16], tot[ATT_HD_MAX / 16];
    float s[ATT_BK_MAX];
    const global float *qr = q + qoff + (ulong)head * hd; /* (hd) */
    for (int k = 0; k < hd / 16; k++) qv[k] = ktype == TYPE_F16 ? round_f16x16(vload16(k, qr)) : vload16(k, qr);
    for (int k = 0; k < hdv / 16; k++) tot[k] = 0.0f;
    float m = -INFINITY, l = 0.0f, M = -INFINITY, L = 0.0f;
    const float sc = softcap > 0.0f ? 1.0f : scale;

    for (int s0 = kmin / ATT_SEG * ATT_SEG; s0 <= kmax; s0 += ATT_SEG) {
        const int s1 = min(kmax, s0 + ATT_SEG - 1);
        for (int k = 0; k < hdv / 16; k++) acc[k] = 0.0f;
        m = -INFINITY, l = 0.0f;
        for (int k0 = tile_start(s0, max(kmin, s0), bk); k0 <= s1; k0 += bk) {
            const int jlo = max(0, kmin - k0), jhi = min(bk - 1, s1 - k0);
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
        if (n_split == 1) seg_merge16(tot, &M, &L, acc, m * sc, l, hdv);
    }
    if (n_split > 1) att_part(acc, hdv, m * sc, l, part + ((ulong)sp * n_head + head) * (hdv + 2));
    else att_out(tot, hdv, L, out + ooff + (ulong)head * hdv, xr, nbx, head * (hdv / 32));
}

#define ATT_ARGS q, qoff, K, V, KV_PAGE_ARGS, ktype, vtype, krow, vrow, T, pos0, n_head, n_kv, hd, hdv, scale, \
    window, softcap, tb, bk, n_split, out, ooff, part, xr, nbx

kernel void attention_row(ATT_PARAMS) {
    if (get_global_id(0) >= n_head) return;
    if (hd == 64 && hdv == 64) att_row(ATT_ARGS, 64, 64);
    else if (hd == 128 && hdv == 128) att_row(ATT_ARGS, 128, 128);
    else if (hd == 256 && hdv == 256) att_row(ATT_ARGS, 256, 256);
    else att_row(ATT_ARGS, hd, hdv);
}
