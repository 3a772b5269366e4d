#!/usr/bin/env bash
# .ci/rock-check.sh — the rock as a user gets it: rockspec/pack.sh packs a
# source rock of the checkout, luarocks installs it into a fresh tree, and
# from another folder `require "kvlua"` (with the tree's `luarocks path`) and
# the tree's kvlua-generate run; its text must match the checkout's
# scripts/generate.lua with the same options (when build/, or $KVLUA_BUILD,
# has the module).
#
#   .ci/rock-check.sh [MODEL.gguf]        (default: SmolLM2, scripts/fetch-models.sh)
#
# The argparse dependency offline: a user's luarocks installs it from
# luarocks.org, which this CI cannot reach. Debian's lua-argparse puts
# argparse.lua on Lua 5.4's default path, but luarocks knows only rocks, so
# this run's luarocks config says that Debian provides it (rocks_provided,
# the version dpkg reports) and lists no rock servers. Every other step is
# what a user runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
model=${1:-$("$root/scripts/fetch-models.sh" smollm2)}
[ -f "$model" ] || { echo "rock-check: no model at '$model'" >&2; exit 2; }
lr=(luarocks --lua-version=5.4)

argparse_version=$(dpkg-query -W -f='${Version}' lua-argparse 2>/dev/null | sed 's/-[^-]*$//') || true
[ -n "$argparse_version" ] || { echo "rock-check: Debian's lua-argparse is not installed" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/config.lua" <<EOF
rocks_servers = {}
rocks_provided = { argparse = "$argparse_version-1" }
EOF
export LUAROCKS_CONFIG_5_4="$tmp/config.lua"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}

echo "rock-check: packing"
rock=$("$root/rockspec/pack.sh" "$tmp/dist")
unzip -Z1 "$rock" | grep '\.tar\.gz$' >/dev/null || { echo "rock-check: $rock holds no source tarball" >&2; exit 1; }

echo "rock-check: installing $(basename "$rock") into a fresh tree"
"${lr[@]}" --tree "$tmp/tree" install "$rock" > "$tmp/install.log" 2>&1 \
  || { tail -40 "$tmp/install.log" >&2; echo "rock-check: luarocks install failed" >&2; exit 1; }

# from a folder with nothing of the checkout in it
mkdir "$tmp/elsewhere"
cd "$tmp/elsewhere"
eval "$("${lr[@]}" --tree "$tmp/tree" path)"
lua5.4 - "$tmp/tree" <<'EOF'
local tree = arg[1]
local so = assert(package.searchpath("kvlua", package.cpath))
assert(so:sub(1, #tree) == tree, "kvlua found outside the tree: " .. so)
local cli = assert(package.searchpath("kvlua.util.cli", package.path))
assert(cli:sub(1, #tree) == tree, "kvlua.util.cli found outside the tree: " .. cli)
local k = require "kvlua"
print("rock-check: require 'kvlua': version " .. k.version .. " from " .. so)
EOF

for c in kvlua-generate kvlua-chat kvlua-batch-generate kvlua-mc-eval kvlua-bench kvlua-agent kvlua-perplexity; do
  [ -x "$tmp/tree/bin/$c" ] || { echo "rock-check: the tree has no bin/$c" >&2; exit 1; }
done
"$tmp/tree/bin/kvlua-generate" --help > /dev/null

# --json: the generated text and its token count (the plain output starts
# with the prompt); read with the tree's kvlua.json
opts=(--model "$model" --prompt "The capital of France is" --max-tokens 4 --temp 0 --threads 2 --backend cpu --json)
text_of() {
  lua5.4 -e 'local json = require "kvlua.json"
    local j = assert(json.decode(io.read("a")))
    assert(j.tokens > 0 and j.text:find("%S"), "no text came out")
    io.write(j.tokens, " tokens: ", json.encode(j.text))'
}
text=$("$tmp/tree/bin/kvlua-generate" "${opts[@]}" | text_of)
echo "rock-check: kvlua-generate: $text"
build=${KVLUA_BUILD:-build}
case "$build" in /*) ;; *) build=$root/$build ;; esac
if [ -f "$build/kvlua.so" ]; then
  want=$(env -u LUA_PATH -u LUA_CPATH KVLUA_BUILD="$build" lua5.4 "$root/scripts/generate.lua" "${opts[@]}" | text_of)
  [ "$text" = "$want" ] || { echo "rock-check: the checkout's generate.lua: $want" >&2; exit 1; }
  echo "rock-check: the same text as the checkout's build"
fi
echo "rock-check: ok"
