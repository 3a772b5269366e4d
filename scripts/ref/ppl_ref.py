#!/usr/bin/env python3
"""Perplexity of a text with llama.cpp (llama-cpp-python), llama-perplexity's
default method (non-overlapping chunks of --ctx tokens, first token replaced
by BOS, the second half of each chunk scored), with a chosen K/V cache type:
the reference side of the README's cache-type table.

    python3 scripts/ref/ppl_ref.py MODEL.gguf --file TEXT [--ctx 512] [--chunks N] [--kv f16|q8_0|q4_0|q8_0/q4_0] [--json]

llama.cpp's quantized V cache needs flash attention, which is turned on for
any quantized type (as llama-perplexity requires).
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import refimpl  # noqa: E402


def perplexity(ref, tokens, n_ctx, max_chunks=0):
    first = n_ctx // 2
    n_chunk = len(tokens) // n_ctx
    if max_chunks > 0:
        n_chunk = min(n_chunk, max_chunks)
    nll_total, count = 0.0, 0
    for i in range(n_chunk):
        batch = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if ref.add_bos:
            batch[0] = ref.bos
        ref.clear()
        rows = ref.eval(batch, all_logits=True, first_output=first)
        lg = rows[:n_ctx - 1 - first].astype(np.float64)
        tgt = np.array(tokens[i * n_ctx + first + 1:(i + 1) * n_ctx])
        m = lg.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(lg - m).sum(axis=1))
        nll_total += float((lse - lg[np.arange(len(tgt)), tgt]).sum())
        count += len(tgt)
    return float(np.exp(nll_total / count)), n_chunk


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--file", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=0, help="at most this many chunks (0: all)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    quant = any(t.startswith("q") for t in a.kv.split("/"))
    with open(a.file, "rb") as f:
        text = f.read()
    with refimpl.Ref(a.model, n_ctx=a.ctx, n_threads=a.threads, n_batch=a.ctx, kv_type=a.kv,
                     flash_attn=True if quant else None) as ref:
        tokens = ref.tokenize(text, add_special=True, parse_special=False)
        ppl, n_chunk = perplexity(ref, tokens, a.ctx, a.chunks)
    if a.json:
        print(json.dumps({"ppl": ppl, "chunks": n_chunk, "ctx": a.ctx, "kv": a.kv, "engine": "llama.cpp"}))
    else:
        print("perplexity %.4f over %d chunks of %d (llama.cpp, kv %s)" % (ppl, n_chunk, a.ctx, a.kv))


if __name__ == "__main__":
    main()
