#!/usr/bin/env bash
# Compare kvlua with llama.cpp on the benchmark models.
#
#   scripts/bench-compare.sh [-r REPS] [-t THREADS] [-m "smollm2 synth-..."]
#                            [-x "EXTRA ARGS"] [-b llama-cpp-python|xllamacpp] [-o results.jsonl]
#
# For each model, runs `lua5.4 scripts/bench.lua --model M --threads T --reps 1
# --json EXTRA` (when scripts/bench.lua exists) and `python3 scripts/ref/bench_ref.py
# M --threads T --reps 1 --json EXTRA` alternately, REPS times (default 3), so
# both engines see the same machine load; EXTRA (e.g. "--decode 16 --depth 16,512")
# goes to both; -b picks the llama.cpp package that bench_ref.py times. Collects the JSON
# objects in a JSON-lines file and prints medians and kvlua / llama.cpp ratios
# (scripts/ref/bench_table.py). Models (default): the real SmolLM2 Q4_1 and the
# four synthetic files of scripts/make-synthetic.py (created if missing).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

reps=3
threads=2
models="smollm2 synth-smollm2-135m-Q4_0 synth-smollm2-135m-Q8_0 synth-llama32-1b-Q4_0 synth-llama32-1b-Q8_0"
out=""
extra=""
backend="llama-cpp-python"
while getopts "r:t:m:o:x:b:h" opt; do
  case "$opt" in
    r) reps="$OPTARG" ;;
    t) threads="$OPTARG" ;;
    m) models="$OPTARG" ;;
    o) out="$OPTARG" ;;
    x) extra="$OPTARG" ;;
    b) backend="$OPTARG" ;;
    *) sed -n '2,15p' "$0"; exit 2 ;;
  esac
done
[ -n "$out" ] || out="$(mktemp -t bench-compare.XXXXXX.jsonl)"
: > "$out"

model_path() { # name -> path
  case "$1" in
    smollm2|gemma3) scripts/fetch-models.sh "$1" ;;
    synth-*)
      local rest="${1#synth-}" shape type
      type="${rest##*-}"; shape="${rest%-*}"
      python3 scripts/make-synthetic.py --shape "$shape" --type "$type" | tail -n1 ;;
    *) echo "$1" ;;
  esac
}

have_kvlua=0
[ -f scripts/bench.lua ] && have_kvlua=1
[ "$have_kvlua" = 1 ] || echo "bench-compare: scripts/bench.lua not found; reference side only" >&2

record() { # side model json-line
  python3 -c 'import json,sys; print(json.dumps({"side": sys.argv[1], "model": sys.argv[2], "result": json.loads(sys.argv[3])}))' "$1" "$2" "$3" >> "$out"
}

last_json() { grep '^{' | tail -n1; }

for name in $models; do
  path="$(model_path "$name")"
  for r in $(seq 1 "$reps"); do
    if [ "$have_kvlua" = 1 ]; then
      if j="$(lua5.4 scripts/bench.lua --model "$path" --threads "$threads" --reps 1 --json $extra | last_json)" && [ -n "$j" ]; then
        record kvlua "$name" "$j"
      else
        echo "bench-compare: kvlua run $r on $name failed" >&2
      fi
    fi
    if j="$(python3 scripts/ref/bench_ref.py "$path" --threads "$threads" --reps 1 --json --backend "$backend" $extra | last_json)" && [ -n "$j" ]; then
      record llama.cpp "$name" "$j"
    else
      echo "bench-compare: llama.cpp run $r on $name failed" >&2
    fi
    echo "bench-compare: $name run $r/$reps done" >&2
  done
done

echo "results: $out"
python3 scripts/ref/bench_table.py "$out"
