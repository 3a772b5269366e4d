#!/usr/bin/env python3
"""How far llama.cpp agrees with itself: the fixture prompts re-run under
settings that should not change the answer (thread count, micro-batch size,
flash attention on/off), compared with a run under the fixtures' settings
(scripts/ref/gen-fixtures.py: 2 threads, n_batch 512, flash attention auto,
which is on for the CPU).

For each variant and model: how many greedy 32-token continuations are
identical to the baseline's, and the RMS / max difference of the baseline's
top-10 logits at the last prompt position. This is the noise floor any
second engine is up against. "stored fixture" compares the baseline with the
fixture file itself (same llama.cpp version, recorded on whatever CPU ran
gen-fixtures.py).

    python3 scripts/ref/selfcheck.py [--models smollm2,gemma3]
"""
import argparse
import importlib.util
import json
import os
import subprocess

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


# The stored fixture (tests/fixtures/ref_logits_<model>.lua) as JSON, through lua5.4.
_DUMP = r"""
local f = dofile(arg[1])
local out = {}
local function arr(t) local s = {} for i, v in ipairs(t) do s[i] = string.format("%.9g", v) end
  return "[" .. table.concat(s, ",") .. "]" end
for _, p in ipairs(f.prompts) do
  out[#out + 1] = string.format('{"ids":%s,"greedy":%s,"top_ids":%s,"top_logits":%s}',
    arr(p.ids), arr(p.greedy), arr(p.top_ids), arr(p.top_logits))
end
print("[" .. table.concat(out, ",") .. "]")
"""


def stored_fixture(name):
    path = os.path.join(genfix.ROOT, "tests", "fixtures", "ref_logits_%s.lua" % name)
    out = subprocess.run(["lua5.4", "-e", _DUMP.replace("arg[1]", repr(path))], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


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
        # the stored fixture was recorded by the same llama.cpp version, maybe on another CPU
        fixture = None
        try:
            fx = stored_fixture(name)
            if [p["ids"] for p in fx] == prompts:
                n_vocab = len(base[0][0])
                fixture = []
                for p in fx:
                    lg = np.full(n_vocab, -1e30, dtype=np.float32)  # only its top logits are known
                    lg[p["top_ids"]] = p["top_logits"]
                    fixture.append((lg, p["greedy"]))
        except (OSError, subprocess.CalledProcessError, ValueError) as err:
            print("  (stored fixture not compared: %s)" % err)
        runs = [("baseline rerun", again)] + ([("stored fixture", fixture)] if fixture else [])
        for label, res in runs + [(lb, run(path, kw, prompts)) for lb, kw in VARIANTS]:
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
