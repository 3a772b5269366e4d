#!/usr/bin/env python3
"""Independent float64 numpy forward passes for llama and gemma3 GGUF models (tie-breaker).

Dequantizes every weight with the gguf package and runs the transformer in
float64 with no activation quantization, so it gives the "exact" logits of the
quantized weights. Used to judge which llama.cpp build is closer when the two
references disagree (scripts/ref/crosscheck.py), not for fixtures.

    python3 scripts/ref/np_llama.py MODEL.gguf "prompt text" [--parse-special] [--top 10]

llama (SmolLM2, the synthetic models): RMSNorm, rotary embedding on adjacent
pairs (ggml's normal mode; GGUF stores Q/K permuted for it), GQA, SwiGLU FFN,
tied or separate output matrix.

gemma3: embeddings scaled by sqrt(n_embd); per-head RMSNorm of Q and K; rotary
embedding on half-split pairs (NEOX mode); Q scaled by 1/sqrt(head_dim); every
6th layer (il % 6 == 5) global with rope base gemma3.rope.freq_base, the others
local with a sliding window (j > i - window) and rope base 10000; post-attention
and post-FFN RMSNorms; GELU(tanh)-gated FFN; tied output. GGUF norm weights
already include Gemma's +1.
"""

import argparse
import os
import sys

import numpy as np
import gguf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def load(path):
    """NpLlama or NpGemma3 for the file's architecture (SystemExit for others)."""
    arch = gguf.GGUFReader(path).fields["general.architecture"].contents()
    if arch == "llama":
        return NpLlama(path)
    if arch == "gemma3":
        return NpGemma3(path)
    raise SystemExit("np_llama: unsupported architecture " + arch)


def greedy_margins(model, ids, greedy):
    """Teacher-forced over ids + greedy: per step i, the top-1 id and the top1 - top2
    logit of the position before greedy[i] (lists of len(greedy))."""
    seq = list(ids) + list(greedy[:-1])
    logits = model.forward(seq, last_only=False)[len(ids) - 1:]
    top, margin = [], []
    for row in logits:
        i2 = np.argsort(-row, kind="stable")[:2]
        top.append(int(i2[0]))
        margin.append(float(row[i2[0]] - row[i2[1]]))
    return top, margin


def _weights(r):
    w = {}
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        w[t.name] = a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim > 1 else a.reshape(-1)
    return w


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def _softmax_rows(a):
    a = np.exp(a - a.max(axis=-1, keepdims=True))
    return a / a.sum(axis=-1, keepdims=True)


class NpGemma3:
    def __init__(self, path):
        r = gguf.GGUFReader(path)
        f = r.fields
        g = lambda k, d=None: f[k].contents() if k in f else d  # noqa: E731
        self.n_layer = g("gemma3.block_count")
        self.n_embd = g("gemma3.embedding_length")
        self.n_head = g("gemma3.attention.head_count")
        self.n_head_kv = g("gemma3.attention.head_count_kv")
        self.head_dim = g("gemma3.attention.key_length")
        self.eps = g("gemma3.attention.layer_norm_rms_epsilon")
        self.theta_global = g("gemma3.rope.freq_base", 1000000.0)
        self.theta_local = 10000.0
        self.window = g("gemma3.attention.sliding_window")
        self.w = _weights(r)

    @staticmethod
    def rope_neox(x, pos, theta):
        d = x.shape[-1]
        inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = pos[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., :d // 2], x[..., d // 2:]
        return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)

    def forward(self, ids, last_only=True):
        T, H, KV, D, e = len(ids), self.n_head, self.n_head_kv, self.head_dim, self.eps
        pos = np.arange(T, dtype=np.float64)
        x = self.w["token_embd.weight"][ids] * np.sqrt(self.n_embd)
        ii, jj = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
        causal = np.where(jj <= ii, 0.0, -np.inf)
        local = np.where((jj <= ii) & (ii - jj < self.window), 0.0, -np.inf)
        for i in range(self.n_layer):
            p = "blk.%d." % i
            is_global = i % 6 == 5
            h = _rms(x, self.w[p + "attn_norm.weight"], e)
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(T, H, D)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(T, KV, D)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(T, KV, D)
            q = _rms(q, self.w[p + "attn_q_norm.weight"], e)
            k = _rms(k, self.w[p + "attn_k_norm.weight"], e)
            theta = self.theta_global if is_global else self.theta_local
            q, k = self.rope_neox(q, pos, theta), self.rope_neox(k, pos, theta)
            q = q / np.sqrt(D)
            k = np.repeat(k, H // KV, axis=1)
            v = np.repeat(v, H // KV, axis=1)
            att = np.einsum("thd,shd->hts", q, k) + (causal if is_global else local)[None]
            o = np.einsum("hts,shd->thd", _softmax_rows(att), v).reshape(T, H * D)
            o = o @ self.w[p + "attn_output.weight"].T
            x = x + _rms(o, self.w[p + "post_attention_norm.weight"], e)
            h = _rms(x, self.w[p + "ffn_norm.weight"], e)
            gate = h @ self.w[p + "ffn_gate.weight"].T
            up = h @ self.w[p + "ffn_up.weight"].T
            gelu = 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate ** 3)))
            y = (gelu * up) @ self.w[p + "ffn_down.weight"].T
            x = x + _rms(y, self.w[p + "post_ffw_norm.weight"], e)
        if last_only:
            x = x[-1:]
        x = _rms(x, self.w["output_norm.weight"], e)
        return x @ self.w.get("output.weight", self.w["token_embd.weight"]).T


class NpLlama:
    def __init__(self, path):
        r = gguf.GGUFReader(path)
        f = r.fields
        g = lambda k, d=None: f[k].contents() if k in f else d  # noqa: E731
        self.n_layer = g("llama.block_count")
        self.n_embd = g("llama.embedding_length")
        self.n_head = g("llama.attention.head_count")
        self.n_head_kv = g("llama.attention.head_count_kv")
        self.eps = g("llama.attention.layer_norm_rms_epsilon")
        self.theta = g("llama.rope.freq_base", 10000.0)
        self.head_dim = self.n_embd // self.n_head
        self.w = {}
        for t in r.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            self.w[t.name] = a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim > 1 else a.reshape(-1)
        self.out = self.w.get("output.weight", self.w["token_embd.weight"])

    def rms(self, x, w):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):
        # x: (T, H, D), rotate pairs (2i, 2i+1) by pos * theta^(-2i/D)
        d = x.shape[-1]
        inv = self.theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)      # (D/2,)
        ang = pos[:, None] * inv[None, :]                                      # (T, D/2)
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    def forward(self, ids, last_only=False):
        """Logits (T, n_vocab) for all positions of ids, from position 0 (the last
        one only, (1, n_vocab), with last_only)."""
        T, H, KV, D = len(ids), self.n_head, self.n_head_kv, self.head_dim
        pos = np.arange(T, dtype=np.float64)
        x = self.w["token_embd.weight"][ids]                                   # (T, E)
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for i in range(self.n_layer):
            p = "blk.%d." % i
            h = self.rms(x, self.w[p + "attn_norm.weight"])
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(T, H, D)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(T, KV, D)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(T, KV, D)
            q, k = self.rope(q, pos), self.rope(k, pos)
            rep = H // KV
            k = np.repeat(k, rep, axis=1)
            v = np.repeat(v, rep, axis=1)
            att = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + mask[None]   # (H, T, T)
            att = np.exp(att - att.max(axis=-1, keepdims=True))
            att /= att.sum(axis=-1, keepdims=True)
            o = np.einsum("hts,shd->thd", att, v).reshape(T, H * D)
            x = x + o @ self.w[p + "attn_output.weight"].T
            h = self.rms(x, self.w[p + "ffn_norm.weight"])
            gate = h @ self.w[p + "ffn_gate.weight"].T
            up = h @ self.w[p + "ffn_up.weight"].T
            x = x + ((gate / (1.0 + np.exp(-gate))) * up) @ self.w[p + "ffn_down.weight"].T
        if last_only:
            x = x[-1:]
        x = self.rms(x, self.w["output_norm.weight"])
        return x @ self.out.T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("text")
    ap.add_argument("--parse-special", action="store_true")
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()
    import refimpl
    ref = refimpl.Ref(a.model, n_ctx=2048, n_threads=2)
    ids = ref.tokenize(a.text, True, a.parse_special)
    ref.clear()
    lr = ref.eval(ids).astype(np.float64)
    ln = load(a.model).forward(ids)[-1]
    lsm = lambda v: v - (v.max() + np.log(np.exp(v - v.max()).sum()))  # noqa: E731
    pr, pn = lsm(lr), lsm(ln)
    for i in np.argsort(-pn)[:a.top]:
        print("%6d  numpy %.4f  llama.cpp %.4f" % (i, pn[i], pr[i]))
    print("max |dlogprob| over the numpy top-%d: %.4f" % (a.top, max(abs(pn[i] - pr[i]) for i in np.argsort(-pn)[:a.top])))


if __name__ == "__main__":
    main()
