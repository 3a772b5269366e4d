#!/usr/bin/env python3
"""Reference side of the benchmark: llama.cpp (via llama-cpp-python) speed on one model.

    python3 scripts/ref/bench_ref.py MODEL.gguf [--threads 2] [--json] [--decode 64]

Measures, on one sequence with an F16 KV cache (n_ctx 2048, n_batch = n_ubatch = 512):

  prefill_128_tps, prefill_512_tps   tokens/s of one prefill of 128 / 512 tokens from
                                     an empty cache (logits of the last position only)
  decode_16_tps, decode_512_tps,     tokens/s of --decode (64) single-token decode steps
  decode_1792_tps                    (greedy: argmax of the previous logits, included)
                                     after a prefill of 16 / 512 / 1792 tokens
  ttft_128_ms, ttft_512_ms           empty cache -> prefill of 128 / 512 tokens -> argmax
                                     of the first new token
  itl_p50_ms, itl_p90_ms, itl_p99_ms inter-token latency percentiles over the decode
                                     steps at depth 512 (one decode + argmax each)

The prompt tokens are the tokenization of tests/data/public-domain.txt (repeated
if needed). One untimed warm-up (a 32-token prefill and 4 decode steps) runs first.
Prints one JSON object with --json (always on the last line), else a short table.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import refimpl  # noqa: E402

N_CTX = 2048
N_BATCH = 512
PREFILL_SIZES = (128, 512)
DECODE_DEPTHS = (16, 512, 1792)


def prompt_tokens(ref, n):
    with open(os.path.join(ROOT, "tests", "data", "public-domain.txt"), "rb") as f:
        toks = ref.tokenize(f.read(), add_special=True, parse_special=False)
    while len(toks) < n:
        toks = toks + toks
    return toks[:n]


def pct(xs, p):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), p))


def bench(path, threads, n_decode):
    t0 = time.perf_counter()
    ref = refimpl.Ref(path, n_ctx=N_CTX, n_threads=threads, n_batch=N_BATCH)
    load_s = time.perf_counter() - t0
    toks = prompt_tokens(ref, max(max(PREFILL_SIZES), max(DECODE_DEPTHS)))
    res = {
        "engine": "llama.cpp",
        "reference": refimpl.version(),
        "model": os.path.basename(path),
        "threads": threads,
        "n_ctx": N_CTX,
        "n_batch": N_BATCH,
        "n_decode": n_decode,
        "load_s": load_s,
    }

    # warm-up (page in weights, build graphs)
    ref.clear()
    lg = ref.eval(toks[:32])
    for _ in range(4):
        lg = ref.eval([int(np.argmax(lg))])

    for n in PREFILL_SIZES:
        ref.clear()
        t = time.perf_counter()
        lg = ref.eval(toks[:n])
        first = int(np.argmax(lg))
        dt = time.perf_counter() - t
        res["prefill_%d_tps" % n] = n / dt
        res["ttft_%d_ms" % n] = dt * 1e3
        del first

    for d in DECODE_DEPTHS:
        ref.clear()
        lg = ref.eval(toks[:d])
        itl = []
        t_all = time.perf_counter()
        for _ in range(n_decode):
            t = time.perf_counter()
            lg = ref.eval([int(np.argmax(lg))])
            itl.append(time.perf_counter() - t)
        dt = time.perf_counter() - t_all
        res["decode_%d_tps" % d] = n_decode / dt
        if d == 512:
            res["itl_p50_ms"] = pct(itl, 50) * 1e3
            res["itl_p90_ms"] = pct(itl, 90) * 1e3
            res["itl_p99_ms"] = pct(itl, 99) * 1e3
    ref.close()
    return res


def main():
    ap = argparse.ArgumentParser(description="llama.cpp reference benchmark")
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=64, help="decode steps per depth")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    res = bench(a.model, a.threads, a.decode)
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print("%-18s %s" % (k, ("%.2f" % v) if isinstance(v, float) else v))


if __name__ == "__main__":
    main()
