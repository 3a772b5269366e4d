#!/usr/bin/env python3
"""Reference side of the benchmark: llama.cpp (via llama-cpp-python) speed on one model.

    python3 scripts/ref/bench_ref.py MODEL.gguf [--threads 2] [--json] [--decode 64]

Same measurements and JSON shape as scripts/bench.lua, on one sequence with an F16
KV cache (ctx 2048, n_batch = n_ubatch = 512):

  prefill_tps["128"|"512"]   tokens/s of one prefill from an empty cache (logits of
                             the last position only); ttft_ms[...] = its duration
  decode_tps["16"|"512"|"1792"]  tokens/s of --decode (64) single-token decode steps
                             after a prefill of that depth (teacher-forced tokens)
  itl_ms {p50, p90, p99}     per-step latency percentiles at the first depth (16)

Each timed span is one or more llama_decode calls plus the copy of the last
logits row. Prompt tokens: tests/data/public-domain.txt tokenized (repeated if
needed). One untimed warm-up (32-token prefill, 4 decode steps) runs first; with
--reps N every figure is the median of N repetitions. OMP_WAIT_POLICY defaults
to PASSIVE (see refimpl.py). Prints one JSON object with --json.

--backend xllamacpp times the xllamacpp build instead (an in-process llama-server
with its own thread pool): prefill and TTFT from the server's prompt_ms, decode
from predicted_ms of a 64-token greedy completion, ITL from streamed arrivals.
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


def bench(path, threads, n_decode, reps=1, prefills=PREFILL_SIZES, depths=DECODE_DEPTHS, kv="f16"):
    t0 = time.perf_counter()
    n_ctx = max(N_CTX, max(depths) + n_decode + 16)
    quant = kv is not None and any(t.startswith("q") for t in kv.split("/"))
    ref = refimpl.Ref(path, n_ctx=n_ctx, n_threads=threads, n_batch=N_BATCH, kv_type=kv,
                      flash_attn=True if quant else None)
    load_s = time.perf_counter() - t0
    toks = prompt_tokens(ref, max(max(prefills), max(depths) + n_decode))

    # warm-up (page in weights, build graphs)
    ref.clear()
    lg = ref.eval(toks[:32])
    for _ in range(4):
        lg = ref.eval([int(np.argmax(lg))])

    pre, ttft, dec, itl_first = {}, {}, {}, []
    for _ in range(reps):
        for n in prefills:
            ref.clear()
            t = time.perf_counter()
            lg = ref.eval(toks[:n])
            dt = time.perf_counter() - t
            pre.setdefault(n, []).append(n / dt)
            ttft.setdefault(n, []).append(dt * 1e3)
        for d in depths:
            ref.clear()
            lg = ref.eval(toks[:d])
            steps = []
            for tok in toks[d:d + n_decode]:       # teacher-forced, like bench.lua
                t = time.perf_counter()
                lg = ref.eval([tok])
                steps.append(time.perf_counter() - t)
            dec.setdefault(d, []).append(len(steps) / sum(steps))
            if d == depths[0]:
                itl_first.extend(steps)
    ref.close()
    med = lambda xs: float(np.median(xs))  # noqa: E731
    return {
        "engine": "llama.cpp",
        "reference": refimpl.version(),
        "model": os.path.basename(path),
        "threads": threads,
        "ctx": n_ctx,
        "n_batch": N_BATCH,
        "reps": reps,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "load_s": load_s,
        "prefill_tps": {str(k): med(v) for k, v in pre.items()},
        "ttft_ms": {str(k): med(v) for k, v in ttft.items()},
        "decode_tps": {str(k): med(v) for k, v in dec.items()},
        "itl_ms": {"p50": pct(itl_first, 50) * 1e3, "p90": pct(itl_first, 90) * 1e3,
                   "p99": pct(itl_first, 99) * 1e3},
    }


def bench_xllamacpp(path, threads, n_decode, reps=1, prefills=PREFILL_SIZES, depths=DECODE_DEPTHS):
    """The same figures from xllamacpp (llama-server in process): prefill from the server's
    own prompt_ms; decode from predicted_ms of a greedy completion; ITL from the arrival
    times of the streamed tokens at the first depth (HTTP overhead included, ~0.1 ms)."""
    import urllib.request
    import xlref
    n_ctx = max(N_CTX, max(depths) + n_decode + 16)
    t0 = time.perf_counter()
    xl = xlref.XlRef(path, n_ctx=n_ctx, n_threads=threads)
    load_s = time.perf_counter() - t0
    tok = refimpl.Ref(path, n_ctx=64, n_threads=1, n_batch=64)
    toks = prompt_tokens(tok, max(max(prefills), max(depths) + n_decode))
    tok.close()
    greedy = {"temperature": 0.0, "top_k": 1, "samplers": ["top_k"], "ignore_eos": True,
              "cache_prompt": False, "repeat_penalty": 1.0}
    xl._post("/completion", dict(greedy, prompt=toks[:32], n_predict=4))   # warm-up
    pre, ttft, dec, itl_first = {}, {}, {}, []
    for _ in range(reps):
        for n in prefills:
            tm = xl._post("/completion", dict(greedy, prompt=toks[:n], n_predict=1))["timings"]
            pre.setdefault(n, []).append(n / (tm["prompt_ms"] / 1e3))
            ttft.setdefault(n, []).append(tm["prompt_ms"])
        for d in depths:
            body = dict(greedy, prompt=toks[:d], n_predict=n_decode, stream=True)
            req = urllib.request.Request(xl.addr + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            arrivals, timings = [], None
            with urllib.request.urlopen(req, timeout=3600) as f:
                for line in f:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    ev = json.loads(line[5:])
                    if ev.get("tokens"):
                        arrivals.append(time.perf_counter())
                    if ev.get("timings"):
                        timings = ev["timings"]
            # first arrival = first sampled token (after the prefill); n_decode - 1 decode steps follow
            dec.setdefault(d, []).append(timings["predicted_n"] / (timings["predicted_ms"] / 1e3)
                                         if timings and timings.get("predicted_ms") else float("nan"))
            if d == depths[0]:
                itl_first.extend(b - a for a, b in zip(arrivals, arrivals[1:]))
    xl.close()
    med = lambda xs: float(np.median(xs))  # noqa: E731
    return {
        "engine": "llama.cpp",
        "reference": xlref.version(),
        "model": os.path.basename(path),
        "threads": threads,
        "ctx": n_ctx,
        "reps": reps,
        "load_s": load_s,
        "prefill_tps": {str(k): med(v) for k, v in pre.items()},
        "ttft_ms": {str(k): med(v) for k, v in ttft.items()},
        "decode_tps": {str(k): med(v) for k, v in dec.items()},
        "itl_ms": {"p50": pct(itl_first, 50) * 1e3, "p90": pct(itl_first, 90) * 1e3,
                   "p99": pct(itl_first, 99) * 1e3},
    }


def main():
    ap = argparse.ArgumentParser(description="llama.cpp reference benchmark")
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=64, help="decode steps per depth")
    ap.add_argument("--reps", type=int, default=1, help="repetitions (medians reported)")
    ap.add_argument("--prefill", default="128,512")
    ap.add_argument("--depth", default="16,512,1792")
    ap.add_argument("--backend", default="llama-cpp-python", choices=["llama-cpp-python", "xllamacpp"],
                    help="which llama.cpp package to time (default: llama-cpp-python)")
    ap.add_argument("--kv", default="f16",
                    help="K/V cache type: f16, f32, q8_0, q4_0 or K/V such as q8_0/q4_0 (llama-cpp-python only; quantized types turn flash attention on)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    if a.backend == "llama-cpp-python":
        res = bench(a.model, a.threads, a.decode, a.reps, ints(a.prefill), ints(a.depth), a.kv)
    else:
        if a.kv != "f16":
            ap.error("--kv needs --backend llama-cpp-python")
        res = bench_xllamacpp(a.model, a.threads, a.decode, a.reps, ints(a.prefill), ints(a.depth))
    if a.json:
        print(json.dumps(res))
        return
    print("model %s, %d threads, ctx %d, %s" % (res["model"], res["threads"], res["ctx"], res["reference"]))
    for k, v in res["prefill_tps"].items():
        print("prefill %5s tokens: %8.1f tok/s  (TTFT %.1f ms)" % (k, v, res["ttft_ms"][k]))
    for k, v in res["decode_tps"].items():
        print("decode at depth %5s: %8.1f tok/s" % (k, v))
    i = res["itl_ms"]
    print("ITL p50 %.2f ms, p90 %.2f ms, p99 %.2f ms" % (i["p50"], i["p90"], i["p99"]))


if __name__ == "__main__":
    main()
