#!/usr/bin/env bash
# rockspec/pack.sh — a source rock of this checkout, which `luarocks install`
# builds on any machine (with Lua 5.4, a C compiler, CMake, libsodium and an
# OpenCL ICD loader):
#
#   rockspec/pack.sh [--version V] [DIR]       # V: CMakeLists.txt's project version; DIR: .
#   luarocks --lua-version=5.4 install DIR/kvlua-V-1.src.rock
#
# Writes into DIR:
#   kvlua-V.tar.gz      the last commit (git archive HEAD) under kvlua-V/,
#                       without the test fixtures (tests/data/): the rock
#                       builds without the C tests
#   kvlua-V-1.rockspec  rockspec/kvlua-scm-1.rockspec with that tarball as its
#                       source (a file:// URL: this rockspec builds only here)
#   kvlua-V-1.src.rock  the two packed by `luarocks pack`: the rockspec and the
#                       tarball, so installing it fetches nothing but the
#                       dependencies (argparse)
#
# The development rockspec cannot be packed itself: luarocks fetches a
# rockspec's source from its URL into a temporary folder, and this checkout
# has no URL that resolves there.
set -euo pipefail

usage() { echo "usage: rockspec/pack.sh [--version V] [DIR]" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
version="" out="."
while [ $# -gt 0 ]; do
  case "$1" in
    --version) [ $# -ge 2 ] || usage; version=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) usage ;;
    *) out=$1; shift ;;
  esac
done
if [ -z "$version" ]; then
  version=$(sed -n 's/^project(kvlua VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
  [ -n "$version" ] || { echo "pack: no project version in CMakeLists.txt" >&2; exit 2; }
fi
case "$version" in
  *[!0-9.]*|.*|*.|"") echo "pack: bad version '$version' (digits and dots, e.g. 0.1.0)" >&2; exit 2 ;;
esac
git -C "$root" rev-parse --git-dir >/dev/null 2>&1 || { echo "pack: $root is not a git checkout" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
name="kvlua-$version"
tarball="$out/$name.tar.gz"

git -C "$root" diff --quiet HEAD -- 2>/dev/null \
  || echo "pack: the checkout has uncommitted changes; the rock holds the last commit" >&2
git -C "$root" archive --format=tar.gz --prefix="$name/" -o "$tarball" HEAD -- . ':(exclude)tests/data'

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
# new_version unpacks the tarball next to it to find its top folder: what it
# leaves there is removed unless it was there before
leftovers=()
for f in "$out/$name" "$out/$name.tar"; do [ -e "$f" ] || leftovers+=("$f"); done
git -C "$root" show HEAD:rockspec/kvlua-scm-1.rockspec > kvlua-scm-1.rockspec
luarocks --lua-version=5.4 new_version kvlua-scm-1.rockspec "$version-1" "file://$tarball" \
  --dir "$out" >/dev/null
rm -rf "${leftovers[@]}"
cd "$out"
rm -f "$name-1.src.rock"
luarocks --lua-version=5.4 pack "$name-1.rockspec" >/dev/null
[ -f "$name-1.src.rock" ] || { echo "pack: luarocks pack wrote no $name-1.src.rock" >&2; exit 1; }
echo "$out/$name-1.src.rock"
