#!/usr/bin/env python3
"""Reference tokenization speed: llama.cpp's llama_tokenize (through the
xllamacpp wheel, llama_ref.py) on the same text file as
scripts/bench-tokenize.lua, add_special=false, parse_special=false.

    python3 scripts/ref/bench_tokenize_ref.py MODEL.gguf TEXT_FILE [REPEATS]

Prints one line: "<MB/s> <tokens> <seconds>" (best of REPEATS, default 3).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_ref import RefVocab  # noqa: E402


def main():
    model, path = sys.argv[1], sys.argv[2]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    text = open(path, "rb").read()
    v = RefVocab(model)
    best, n = None, 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        ids = v.tokenize(text, False, False)
        dt = time.perf_counter() - t0
        n = len(ids)
        best = dt if best is None or dt < best else best
    print("%.3f %d %.4f" % (len(text) / 1e6 / best, n, best))
    v.close()


main()
