#!/usr/bin/env bash
# The OpenCL backend on one device in one short run: its tests, its GEMV and
# prefill kernels, and whole-model decode against the memory-bandwidth
# roofline.
#
#   scripts/opencl-check.sh [-d DEVICE] [-w GBPS] [-b BUILD] [-k KIT] [MODEL.gguf ...]
#
# -d  OpenCL device number as kvlua.devices() lists them, from 1 (default 1)
# -w  the device's memory bandwidth in GB/s for the roofline (default: 4300, an
#     H200's HBM3e; give yours)
# -b  a build folder holding kvlua.so, test_opencl and bench-opencl (default
#     build; built here if they are missing and cmake can)
# -k  a folder where Debian packages were unpacked (dpkg -x pkg.deb KIT): lua5.4,
#     liblua5.4-0, ocl-icd-libopencl1, libclblast1, libsodium23, for a machine
#     that has a GPU driver but none of these
#
# On a machine whose NVIDIA driver is mounted without an ICD file (containers:
# /usr/local/nvidia), one naming its libnvidia-opencl.so.1 is written to a
# temporary folder and used (OCL_ICD_VENDORS). bench-opencl prints what a
# launch costs (a decode token queues about 14 a layer). Each model is decoded for 64
# tokens after a 16-token prompt: tok/s, the bytes read per token (the model's
# weights, size_bytes: tied or output weights are read whole each token; the
# K/V cache at this depth is negligible), the GB/s that makes, its fraction of
# the roofline, and the ITL percentiles. Exits non-zero when the tests fail.
set -uo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

device=1
bw=4300
build=build
kit=""
while getopts "d:w:b:k:h" opt; do
  case "$opt" in
    d) device="$OPTARG" ;;
    w) bw="$OPTARG" ;;
    b) build="$OPTARG" ;;
    k) kit="$OPTARG" ;;
    *) sed -n '2,24p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))

if [ -n "$kit" ]; then
  kit="$(cd "$kit" && pwd)"
  export PATH="$kit/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$kit/usr/lib/x86_64-linux-gnu:$kit/usr/lib:${LD_LIBRARY_PATH:-}"
fi

# an ICD file for a driver that has none
if [ -z "${OCL_ICD_VENDORS:-}" ] && ! ls /etc/OpenCL/vendors/*.icd >/dev/null 2>&1; then
  for lib in /usr/local/nvidia/lib64/libnvidia-opencl.so.1 /usr/local/nvidia/lib/libnvidia-opencl.so.1 \
             /usr/lib/x86_64-linux-gnu/libnvidia-opencl.so.1; do
    if [ -e "$lib" ]; then
      icd="$(mktemp -d)"
      echo "$lib" > "$icd/nvidia.icd"
      export OCL_ICD_VENDORS="$icd"
      echo "ICD: $lib (written to $icd)"
      break
    fi
  done
fi

lua=lua5.4
command -v "$lua" >/dev/null || { echo "no lua5.4 (give -k with the unpacked packages)"; exit 2; }

if [ ! -e "$build/kvlua.so" ] || [ ! -e "$build/test_opencl" ] || [ ! -e "$build/bench-opencl" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null &&
    cmake --build "$build" -j "$(nproc)" --target kvlua test_opencl bench-opencl >/dev/null ||
    { echo "build failed (no kvlua.so, test_opencl or bench-opencl in $build)"; exit 2; }
fi

export LUA_CPATH="$root/$build/?.so;;"
export LUA_PATH="$root/luamod/?.lua;$root/luamod/?/init.lua;;"

echo "== devices"
"$lua" -e '
local kvlua = require "kvlua"
for _, d in ipairs(kvlua.devices()) do
  print(string.format("%d: %s (%s, %s), %.1f GiB, max allocation %.1f GiB, fp16 %s", d.index, d.name, d.platform,
                      d.type, d.memory / 2^30, d.max_alloc / 2^30, tostring(d.fp16)))
end'

echo "== test_opencl"
status=0
"$build/test_opencl" > /tmp/kvlua-test-opencl.log 2>&1 || status=1
grep -E "^(FAIL|device)|passed|products" /tmp/kvlua-test-opencl.log

echo "== bench-opencl (GEMV GB/s, prefill GFLOP/s; the CPU engine beside)"
"$build/bench-opencl" "$((device - 1))" 0.5 F16,Q4_0,Q4_1,Q8_0,Q4_K,Q6_K

for model in "$@"; do
  echo "== $model"
  "$lua" - "$model" "$device" "$bw" <<'EOF'
local kvlua = require "kvlua"
local path, device, bw = arg[1], tonumber(arg[2]), tonumber(arg[3])
local m = assert(kvlua.load(path, { backend = "opencl", device = device }))
local s = assert(m:session { ctx = 256 })
local prompt = {}
for i = 1, 16 do prompt[i] = 100 + 7 * i end
assert(s:prefill(prompt))
for i = 1, 64 do assert(s:decode(200 + i)) end
local itl = s:stats().itl
local sum = 0
for i = 1, #itl do sum = sum + itl[i] end
table.sort(itl)
local ms = sum / #itl * 1e3
local tps = 1e3 / ms
local bytes = m.info.size_bytes
local gbs = bytes * tps / 1e9
print(string.format("%s on %s: decode %.1f tok/s (%.2f ms, ITL p50 %.2f p90 %.2f ms); %.0f MB a token -> %.0f GB/s, %.0f%% of %.0f GB/s",
                    m.info.name, m.info.device, tps, ms, itl[#itl // 2 + 1] * 1e3, itl[math.ceil(#itl * 0.9)] * 1e3,
                    bytes / 1e6, gbs, 100 * gbs / bw, bw))
EOF
done
exit $status
