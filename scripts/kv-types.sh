#!/usr/bin/env bash
# The README's cache-type table: perplexity on two texts and decode speed at
# depth 16 and 1792, for each K/V storage type, kvlua and llama.cpp side by
# side in one run (llama.cpp only for the types it has; its quantized V cache
# needs flash attention, which scripts/ref turns on).
#
#   scripts/kv-types.sh [-m "smollm2 gemma3"] [-c CHUNKS] [-t THREADS] [-o results.jsonl]
#
# -t sets the threads of both engines (default 2). On some 2-vCPU machines
# llama.cpp's 2-thread decode is several times slower than its 1-thread one
# (its threads wait for each other by spinning): compare at -t 1 there.
#
# Texts: tests/data/public-domain.txt (prose) and README.md (this project's
# README: prose and code). Configurations: f16, q8_0, q4_0, K q8_0 + V q4_0,
# and a per-layer mix (q4_0, with layers 0 and 1 in f16). Writes JSON lines
# and prints a Markdown table (medians are not taken: one run each).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
models="smollm2 gemma3"
chunks=8
threads=2
out=$(mktemp)
while getopts "m:c:t:o:h" opt; do
  case "$opt" in
    m) models="$OPTARG" ;;
    c) chunks="$OPTARG" ;;
    t) threads="$OPTARG" ;;
    o) out="$OPTARG" ;;
    *) sed -n 2,12p "$0"; exit 2 ;;
  esac
done
: > "$out"
texts="tests/data/public-domain.txt README.md"
configs="f16 q8_0 q4_0 q8_0/q4_0 mix"
for m in $models; do
  path=$(scripts/fetch-models.sh "$m")
  for cfg in $configs; do
    if [ "$cfg" = mix ]; then k="q4_0,0=f16,1=f16"; v="$k"; bk="q4_0+0=f16+1=f16"; else k=${cfg%/*}; v=${cfg#*/}; bk="$cfg"; fi
    for t in $texts; do
      ppl=$(lua5.4 scripts/perplexity.lua --model "$path" --file "$t" --chunks "$chunks" --ktype "$k" --vtype "$v" --threads "$threads" --json --quiet)
      echo "{\"model\":\"$m\",\"cfg\":\"$cfg\",\"text\":\"$t\",\"engine\":\"kvlua\",\"ppl\":$(echo "$ppl" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ppl"])')}" >> "$out"
      if [ "$cfg" != mix ]; then
        r=$(python3 scripts/ref/ppl_ref.py "$path" --file "$t" --kv "$cfg" --json --ctx 512 --chunks "$chunks" --threads "$threads" 2>/dev/null || echo '{"ppl": null}')
        echo "{\"model\":\"$m\",\"cfg\":\"$cfg\",\"text\":\"$t\",\"engine\":\"llama.cpp\",\"ppl\":$(echo "$r" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["ppl"]))')}" >> "$out"
      fi
    done
    b=$(lua5.4 scripts/bench.lua --model "$path" --kv "$bk" --depth 16,1792 --prefill 16 --decode 32 --reps 1 --threads "$threads" --json)
    echo "{\"model\":\"$m\",\"cfg\":\"$cfg\",\"engine\":\"kvlua\",\"bench\":$b}" >> "$out"
    if [ "$cfg" != mix ]; then
      r=$(python3 scripts/ref/bench_ref.py "$path" --kv "$cfg" --depth 16,1792 --prefill 16 --decode 32 --threads "$threads" --json 2>/dev/null || echo null)
      echo "{\"model\":\"$m\",\"cfg\":\"$cfg\",\"engine\":\"llama.cpp\",\"bench\":$r}" >> "$out"
    fi
  done
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def get(m, c, e, key):
    for r in rows:
        if r["model"] == m and r["cfg"] == c and r["engine"] == e and key(r) is not None:
            return key(r)
    return None
texts = ["tests/data/public-domain.txt", "README.md"]
def f(x, fmt="%.3f"):
    return "-" if x is None else fmt % x
print("| model | K/V | ppl prose kvlua / llama.cpp | ppl README kvlua / llama.cpp | decode @16 tok/s kvlua / llama.cpp | @1792 kvlua / llama.cpp | kvlua @1792/@16 |")
print("|---|---|---|---|---|---|---|")
for m in dict.fromkeys(r["model"] for r in rows):
    for c in dict.fromkeys(r["cfg"] for r in rows if r["model"] == m):
        p = [(get(m, c, "kvlua", lambda r, t=t: r.get("ppl") if r.get("text") == t else None),
              get(m, c, "llama.cpp", lambda r, t=t: r.get("ppl") if r.get("text") == t else None)) for t in texts]
        def dec(e, d):
            return get(m, c, e, lambda r: (r.get("bench") or {}).get("decode_tps", {}).get(str(d)) if r.get("bench") else None)
        k16, k1792, l16, l1792 = dec("kvlua", 16), dec("kvlua", 1792), dec("llama.cpp", 16), dec("llama.cpp", 1792)
        ratio = None if not (k16 and k1792) else k1792 / k16
        print("| %s | %s | %s / %s | %s / %s | %s / %s | %s / %s | %s |" % (m, c, f(p[0][0]), f(p[0][1]), f(p[1][0]), f(p[1][1]),
              f(k16, "%.1f"), f(l16, "%.1f"), f(k1792, "%.1f"), f(l1792, "%.1f"), f(ratio, "%.2f")))
PY
echo "results: $out" >&2
