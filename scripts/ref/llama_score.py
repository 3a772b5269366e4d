"""Multiple-choice log-likelihood scoring with llama.cpp (llama-cpp-python),
one evaluation per context+choice, as lm-evaluation-harness's llama.cpp
backend scores a loglikelihood request: nothing is shared between requests.

    python3 scripts/ref/llama_score.py IN.json OUT.json

IN.json (written by scripts/bench-score.lua):
    {"model": path, "threads": n, "ctx": n,
     "items": [{"context": [ids], "choices": [[ids], ...], "chars": [n, ...], "answer": k}, ...]}
Token ids are given (kvlua's tokenization), so both engines score the same
sequences. For each choice the context and the choice but its last token
are evaluated from an empty cache; the choice's score is the summed
log-probability of its tokens (log-softmax of the logits in float64).

OUT.json: {"seconds": scoring time, "tokens": evaluated tokens, "items": n,
           "correct": n, "correct_norm": n, "predicted": [k, ...], "scores": [[...], ...]}
"""
import json
import sys
import time

import numpy as np
from llama_cpp import Llama


def log_softmax(row):
    x = row.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def argmax(xs):
    best = 0
    for k in range(1, len(xs)):
        if xs[k] > xs[best]:
            best = k
    return best


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    llm = Llama(model_path=job["model"], n_ctx=job["ctx"], n_batch=512, n_threads=job["threads"],
                n_threads_batch=job["threads"], logits_all=True, verbose=False)
    scores, predicted = [], []
    correct = correct_norm = tokens = 0
    t0 = time.perf_counter()
    for it in job["items"]:
        ctx, item_scores = it["context"], []
        for choice in it["choices"]:
            seq = ctx + choice[:-1]
            llm.reset()
            llm.eval(seq)
            tokens += len(seq)
            s = 0.0
            for j, tok in enumerate(choice):
                s += float(log_softmax(llm.scores[len(ctx) - 1 + j])[tok])
            item_scores.append(s)
        norm = [s / c for s, c in zip(item_scores, it["chars"])]
        p = argmax(item_scores)
        predicted.append(p)
        scores.append(item_scores)
        correct += p == it["answer"]
        correct_norm += argmax(norm) == it["answer"]
    seconds = time.perf_counter() - t0
    with open(sys.argv[2], "w") as f:
        json.dump({"seconds": seconds, "tokens": tokens, "items": len(job["items"]), "correct": correct,
                   "correct_norm": correct_norm, "predicted": predicted, "scores": scores}, f)


if __name__ == "__main__":
    main()
