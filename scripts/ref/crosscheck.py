#!/usr/bin/env python3
"""Cross-check the two llama.cpp builds (llama-cpp-python vs xllamacpp) on the fixture inputs.

    python3 scripts/ref/crosscheck.py [--models smollm2,gemma3]

Compares, per model: tokenization of every valid-UTF-8 text of gen-fixtures.py
(all add_special/parse_special combinations), the top-20 next-token ids and
log-probabilities, and the 32-token greedy continuation of every logits prompt.
Prints mismatches and a summary; exit status 1 if tokenization differs (numeric
differences between builds are reported, not fatal: the greedy continuation may
legitimately split at a near-tie).
"""

import argparse
import importlib.util
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import refimpl  # noqa: E402
import xlref  # noqa: E402

_spec = importlib.util.spec_from_file_location("genfix", os.path.join(HERE, "gen-fixtures.py"))
genfix = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(genfix)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma3")
    a = ap.parse_args()
    bad_tok = 0
    for mname in a.models.split(","):
        path = genfix.model_path(mname)
        ref = refimpl.Ref(path, n_ctx=genfix.LOGITS_N_CTX, n_threads=2, n_batch=512)
        xl = xlref.XlRef(path, n_ctx=genfix.LOGITS_N_CTX, n_threads=2)
        n_tok = 0
        for t in genfix.TOKEN_TEXTS:
            if not isinstance(t, str):
                continue
            for add_special in (False, True):
                for parse_special in (False, True):
                    a1 = ref.tokenize(t, add_special, parse_special)
                    a2 = xl.tokenize(t, add_special, parse_special)
                    n_tok += 1
                    if a1 != a2:
                        bad_tok += 1
                        print("%s TOKENIZE MISMATCH %r add=%s parse=%s\n  lcp %s\n  xl  %s"
                              % (mname, t, add_special, parse_special, a1, a2))
        print("%s: %d tokenization cases compared" % (mname, n_tok))
        for name, text, parse_special in genfix.logit_prompts(mname, ref):
            ids = ref.tokenize(text, True, parse_special)
            ref.clear()
            lg = ref.eval(ids).astype(np.float64)
            lp = lg - (lg.max() + np.log(np.exp(lg - lg.max()).sum()))
            top = xl.top_logprobs(ids, 20)
            top_ids = [i for i, _ in top]
            my_ids = [int(i) for i in np.argsort(-lg, kind="stable")[:20]]
            dmax = max(abs(lp[i] - v) for i, v in top)
            g1 = ref.greedy(ids, genfix.N_GREEDY)
            g2 = xl.greedy(ids, genfix.N_GREEDY)
            same = next((k for k in range(len(g1)) if k >= len(g2) or g1[k] != g2[k]), len(g1))
            print("%s %-22s top1 %s  top20 overlap %2d/20  max|dlogprob| %.4f  greedy agree %d/%d"
                  % (mname, name, "same" if top_ids[0] == my_ids[0] else "DIFF",
                     len(set(top_ids) & set(my_ids)), dmax, same, len(g1)))
        ref.close()
        xl.close()
    print("tokenization mismatches: %d" % bad_tok)
    sys.exit(1 if bad_tok else 0)


if __name__ == "__main__":
    main()
