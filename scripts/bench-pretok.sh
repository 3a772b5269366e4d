#!/bin/sh
# Pre-tokenizer throughput per family on ~1 MB of mixed text (or a file).
#   scripts/bench-pretok.sh [file]
set -e
cd "$(dirname "$0")/.."
out=${TMPDIR:-/tmp}/kv_bench_pretok.$$
${CC:-cc} -O2 -Iengine engine/pretok.c engine/unicode.c engine/unicode_tables.c engine/kv_error.c \
    tests/bench_pretok.c -o "$out"
"$out" "$@"
rm -f "$out"
