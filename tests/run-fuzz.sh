#!/usr/bin/env bash
# Fuzz the GGUF reader, the session- and cache-file readers, the tokenizer and the
# GBNF grammar compiler and masks with libFuzzer + ASan/UBSan, SECONDS in all
# (default 60), an equal share each.
#
#   tests/run-fuzz.sh [SECONDS]
#
# Builds tests/fuzz_*.c with clang into build-fuzz/ (override with
# KV_FUZZ_BUILD), writes a seed corpus of small valid files into
# tests/fuzz-corpus/seeds (git-ignored), grows tests/fuzz-corpus/gguf across
# runs (kvfile, tokenizer, grammar: the same with their own seeds), and leaves any
# crashing input in tests/fuzz-artifacts/. Exits
# non-zero if the fuzzer finds a crash, a leak, a timeout or an allocation
# over -malloc_limit_mb.
#
# KV_FUZZ_DIRECT=1 skips CMake and compiles the fuzzer from the three files
# the reader needs (engine/gguf.c, types.c, kv_error.c): useful while some
# other engine file does not build with clang. It fuzzes only that reader,
# for all of SECONDS.
set -euo pipefail
secs="${1:-60}"
# SECONDS split evenly over the n_targets runs below, each at least 1 s
# (libFuzzer reads -max_total_time=0 as no limit); share SECS EXTRA
n_targets=4
share() { local t=$(( ($1 + $2) / n_targets )); echo $(( t > 0 ? t : 1 )); }
if [ "${KV_FUZZ_DIRECT:-0}" = 1 ]; then gguf_secs=$secs; else gguf_secs=$(share "$secs" 3); fi
kv_secs=$(share "$secs" 2)
tok_secs=$(share "$secs" 1)
gram_secs=$(share "$secs" 0)
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
build="${KV_FUZZ_BUILD:-build-fuzz}"
cc="${CC:-clang}"

if [ "${KV_FUZZ_DIRECT:-0}" = 1 ]; then
  mkdir -p "$build"
  "$cc" -g -O1 -fsanitize=address,undefined,fuzzer -fno-sanitize-recover=undefined -Iengine \
    tests/fuzz_gguf.c engine/gguf.c engine/types.c engine/kv_error.c -o "$build/fuzz_gguf"
else
  # -O1 as libFuzzer advises (the tokenizer target ran about twice as many inputs a second as at -O0)
  CC="$cc" cmake -S . -B "$build" -DKV_FUZZ=ON -DKV_TESTS=OFF -DCMAKE_BUILD_TYPE=Debug \
    -DCMAKE_C_FLAGS_DEBUG="-g -O1" >/dev/null
  cmake --build "$build" --target fuzz_gguf fuzz_kvfile fuzz_tokenizer fuzz_grammar -j2 >/dev/null
fi

seeds=tests/fuzz-corpus/seeds
corpus=tests/fuzz-corpus/gguf
artifacts=tests/fuzz-artifacts
mkdir -p "$seeds" "$corpus" "$artifacts"
"$cc" -O1 -Iengine -Itests/support tests/make_fuzz_seeds.c tests/support/gguf_writer.c engine/types.c \
  -o "$build/make_fuzz_seeds"
"$build/make_fuzz_seeds" "$seeds"

# fuzz TARGET MAX_LEN MALLOC_MB SECS CORPUS SEEDS: one libFuzzer run of
# $build/fuzz_TARGET, its crashes left in $artifacts
fuzz() {
  "$build/fuzz_$1" -max_len="$2" -max_total_time="$4" -timeout=10 \
    -malloc_limit_mb="$3" -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" "$5" "$6"
}

# Parsing a 64 KiB input never needs more than about 2 MiB (16x the input
# plus 1 MiB is the reader's own cap); -malloc_limit_mb flags anything near it.
fuzz gguf 65536 8 "$gguf_secs" "$corpus" "$seeds"

[ "${KV_FUZZ_DIRECT:-0}" = 1 ] && exit 0
# session and cache files: seeds saved by the target itself (its model is built in)
kvseeds=tests/fuzz-corpus/kvfile-seeds
kvcorpus=tests/fuzz-corpus/kvfile
mkdir -p "$kvseeds" "$kvcorpus"
KVFILE_SEEDS="$kvseeds" fuzz kvfile 65536 64 "$kv_secs" "$kvcorpus" "$kvseeds"

# the tokenizer: every vendored vocabulary (tests/data/vocab) on each input;
# seeds are the inputs of their .inp files, written by the target itself
tokseeds=tests/fuzz-corpus/tokenizer-seeds
tokcorpus=tests/fuzz-corpus/tokenizer
mkdir -p "$tokseeds" "$tokcorpus"
TOKENIZER_SEEDS="$tokseeds" fuzz tokenizer 1024 64 "$tok_secs" "$tokcorpus" "$tokseeds"

# GBNF grammars: compiled, then masks checked against feeding each token;
# seeds are a few grammars of the kinds the specs use, written here
gramseeds=tests/fuzz-corpus/grammar-seeds
gramcorpus=tests/fuzz-corpus/grammar
mkdir -p "$gramseeds" "$gramcorpus"
printf 'root ::= "{" pair ("," pair){0,2} "}"\npair ::= "\\"" [a-z]{1,4} "\\":" ("-"? [0-9]+ | "true")\n' \
  >"$gramseeds/json-small.gbnf"
printf 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"\n' >"$gramseeds/arith.gbnf"
printf 'root ::= [\xce\xb1-\xcf\x89]+ | [^"\\\\\\x00-\\x1F]{2,5} "\\n"? # classes\n' >"$gramseeds/classes.gbnf"
fuzz grammar 4096 512 "$gram_secs" "$gramcorpus" "$gramseeds"
