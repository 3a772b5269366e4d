#!/usr/bin/env python3
"""Aggregate benchmark JSON lines into a table of medians and kvlua / llama.cpp ratios.

    python3 scripts/ref/bench_table.py RESULTS.jsonl

Each input line: {"side": "kvlua"|"llama.cpp", "model": NAME, "result": {...}} where
result is the JSON object printed by scripts/bench.lua --json or
scripts/ref/bench_ref.py --json (nested tables like prefill_tps = {["128"] = x} are
flattened to prefill_128_tps). Every numeric key present on a side is reported;
the ratio column appears for keys both sides have. For *_tps keys a ratio > 1
means kvlua is faster; for *_ms keys a ratio < 1 means kvlua is faster.
"""

import json
import statistics
import sys
from collections import OrderedDict

ORDER = ["prefill_128_tps", "prefill_512_tps", "decode_16_tps", "decode_512_tps",
         "decode_1792_tps", "ttft_128_ms", "ttft_512_ms", "itl_p50_ms", "itl_p90_ms",
         "itl_p99_ms", "load_s"]


def flatten(res):
    """bench.lua / bench_ref.py nested figures -> flat keys (prefill_tps["128"] -> prefill_128_tps)."""
    out = {}
    for k, v in res.items():
        if isinstance(v, dict):
            for sub, x in v.items():
                if k.endswith("_tps") or k.endswith("_ms"):
                    base, unit = k.rsplit("_", 1)
                    out["%s_%s_%s" % (base, sub, unit)] = x
                else:
                    out["%s_%s" % (k, sub)] = x
        else:
            out[k] = v
    return out


def main():
    data = OrderedDict()   # model -> side -> key -> [values]
    with open(sys.argv[1]) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            side = data.setdefault(rec["model"], OrderedDict()).setdefault(rec["side"], {})
            for k, v in flatten(rec["result"]).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    side.setdefault(k, []).append(float(v))
    skip = {"threads", "n_ctx", "ctx", "n_batch", "n_decode", "reps", "kv_bytes", "peak_rss", "n_params", "file_type"}
    for model, sides in data.items():
        ku = sides.get("kvlua", {})
        lc = sides.get("llama.cpp", {})
        keys = [k for k in ORDER if k in ku or k in lc]
        keys += sorted(k for k in set(ku) | set(lc) if k not in keys and k not in skip)
        nk = len(next(iter(ku.values()))) if ku else 0
        nl = len(next(iter(lc.values()))) if lc else 0
        print("\n== %s  (medians; runs: kvlua %d, llama.cpp %d)" % (model, nk, nl))
        print("%-18s %12s %12s %9s" % ("metric", "kvlua", "llama.cpp", "ratio"))
        for k in keys:
            a = statistics.median(ku[k]) if k in ku else None
            b = statistics.median(lc[k]) if k in lc else None
            r = (a / b) if (a is not None and b) else None
            print("%-18s %12s %12s %9s" % (
                k,
                "%.2f" % a if a is not None else "-",
                "%.2f" % b if b is not None else "-",
                "%.3f" % r if r is not None else "-"))


if __name__ == "__main__":
    main()
