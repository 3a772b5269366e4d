#!/usr/bin/env python3
"""How far llama.cpp agrees with itself: the fixture prompts re-run under
settings that should not change the answer (thread count, micro-batch size,
flash attention on/off), compared with a run under the fixtures' settings
(scripts/ref/gen-fixtures.py: 2 threads, n_batch 512, flash attention auto,
which is on for the CPU).

For each variant and model: how many greedy 32-token continuations are
identical to the baseline's, and the RMS / max difference of the baseline's
top-10 logits at the last prompt position. This is the noise floor any
second engine is up against.

    python3 scripts/ref/selfcheck.py [--models smollm2,gemma3]
"""
import argparse
import importlib.util
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
import sys  # noqa: E402
sys.path.insert(0, HERE)
import refimpl  # noqa: E402

_spec = importlib.util.spec_from_file_location("genfix", os.path.join(HERE, "gen-fixtures.py"))
genfix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(genfix)

VARIANTS = [
    ("1 thread", dict(n_threads=1)),
    ("4 threads", dict(n_threads=4)),
    ("n_ubatch 32", dict(n_threads=2, n_ubatch=32)),
    ("flash attention off", dict(n_threads=2, flash_attn=False)),
]


def run(path, kw, prompts):
    """Per prompt: (last-position logits, greedy continuation)."""
    out = []
    with refimpl.Ref(path, n_ctx=genfix.LOGITS_N_CTX, n_batch=512, **kw) as ref:
        for ids in prompts:
            ref.clear()
            lg = ref.eval(ids)
            out.append((lg, ref.greedy(ids, genfix.N_GREEDY)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    args = ap.parse_args()
    for name in args.models.split(","):
        path = genfix.model_path(name)
        with refimpl.Ref(path, n_ctx=genfix.LOGITS_N_CTX, n_threads=genfix.N_THREADS) as ref:
            prompts = [ref.tokenize(text, True, ps) for _, text, ps in genfix.logit_prompts(name, ref)]
        base = run(path, dict(n_threads=genfix.N_THREADS), prompts)
        print("== %s: %d prompts; baseline = the fixtures' settings (%d threads, n_batch 512, "
              "flash attention auto)" % (name, len(prompts), genfix.N_THREADS))
        again = run(path, dict(n_threads=genfix.N_THREADS), prompts)
        for label, res in [("baseline rerun", again)] + [(lb, run(path, kw, prompts)) for lb, kw in VARIANTS]:
            same, sq, n, mx, first = 0, 0.0, 0, 0.0, []
            for (lb, gb), (lv, gv) in zip(base, res):
                top = np.argsort(-lb, kind="stable")[:10]
                d = (lv[top] - lb[top]).astype(np.float64)
                sq += float(np.sum(d * d))
                n += len(d)
                mx = max(mx, float(np.max(np.abs(d))))
                if gv == gb:
                    same += 1
                else:
                    first.append(next(i for i, (a, b) in enumerate(zip(gv, gb)) if a != b) + 1)
            print("  %-20s greedy identical %2d/%d  top-10 logits vs baseline: RMS %.3f max %.3f%s" % (
                label, same, len(prompts), (sq / n) ** 0.5, mx,
                ("  (first differing step: %s)" % first) if first else ""), flush=True)


if __name__ == "__main__":
    main()
