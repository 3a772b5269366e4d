#!/usr/bin/env python3
"""Reference side of scripts/bench-grammar.lua: llama.cpp's grammar sampler speed.

    python3 scripts/ref/bench_grammar_ref.py MODEL.gguf --grammar-file G.gbnf --prompt TEXT
        [--max-tokens 64] [--reps 3] [--temp 0] [--threads 1,2] [--json]

The same measurement as bench-grammar.lua, through llama-cpp-python: the prompt
(tokenized with BOS) is prefilled, then --max-tokens tokens are generated with
Llama.generate, past end-of-generation tokens (so every run has the same length),
constrained (LlamaGrammar from the GBNF text: a fresh grammar sampler each run)
and unconstrained, taking turns inside every repetition. Greedy at --temp 0, else
llama-cpp-python's default chain (top_k 40, top_p 0.95, min_p 0.05, temp, seed 1),
which is the chain sampling.from_opts{temp = T} builds. tok/s is (tokens - 1) over
the time from the first generated token to the last (the prefill and the first
sample excluded: the steps timed are decode + sample, as in bench-grammar.lua).
Every thread count in --threads is measured (OMP_WAIT_POLICY defaults to PASSIVE:
on a small machine spinning threads slow llama.cpp down); the best is reported.
Figures are medians over --reps.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import llama_cpp  # noqa: E402


def run(llm, toks, n, temp, grammar_text):
    grammar = llama_cpp.LlamaGrammar.from_string(grammar_text, verbose=False) if grammar_text else None
    llm.reset()
    llm.set_seed(1)
    times = []
    for _ in llm.generate(toks, temp=temp, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                          reset=True, grammar=grammar):
        times.append(time.perf_counter())
        if len(times) == n:
            break
    if len(times) != n:
        raise SystemExit("generated %d tokens, not %d" % (len(times), n))
    return (n - 1) / (times[-1] - times[0])


def bench(path, grammar_text, prompt, n, reps, temp, threads):
    llm = llama_cpp.Llama(model_path=path, n_ctx=max(512, n + 256), n_threads=threads, n_batch=512,
                          verbose=False, seed=1)
    toks = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=False)
    run(llm, toks, min(n, 8), temp, None)  # warm-up
    free, cons = [], []
    for rep in range(reps):
        for k in range(2):  # alternate which goes first
            constrained = (rep + k) % 2 == 0
            rate = run(llm, toks, n, temp, grammar_text if constrained else None)
            (cons if constrained else free).append(rate)
    llm.close()
    return {"threads": threads, "unconstrained_tok_s": statistics.median(free),
            "constrained_tok_s": statistics.median(cons),
            "ratio": statistics.median(cons) / statistics.median(free)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--grammar-file", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--threads", default="1,2", help="thread counts to try, comma-separated")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with open(a.grammar_file, encoding="utf-8") as f:
        text = f.read()
    by_threads = [bench(a.model, text, a.prompt, a.max_tokens, a.reps, a.temp, int(t))
                  for t in a.threads.split(",")]
    best_free = max(by_threads, key=lambda r: r["unconstrained_tok_s"])
    best_cons = max(by_threads, key=lambda r: r["constrained_tok_s"])
    res = {"llama_cpp_python": llama_cpp.__version__, "tokens": a.max_tokens, "reps": a.reps, "temp": a.temp,
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "by_threads": by_threads,
           "unconstrained_tok_s": best_free["unconstrained_tok_s"], "unconstrained_threads": best_free["threads"],
           "constrained_tok_s": best_cons["constrained_tok_s"], "constrained_threads": best_cons["threads"]}
    res["ratio"] = res["constrained_tok_s"] / res["unconstrained_tok_s"]
    if a.json:
        print(json.dumps(res))
    else:
        for r in by_threads:
            print("llama.cpp %d thread(s): unconstrained %.1f tok/s   constrained %.1f tok/s   ratio %.3f"
                  % (r["threads"], r["unconstrained_tok_s"], r["constrained_tok_s"], r["ratio"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
