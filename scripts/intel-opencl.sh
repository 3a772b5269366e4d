#!/usr/bin/env bash
# intel-opencl.sh — run a command on Intel's CPU runtime for OpenCL instead of
# the system's drivers (PoCL):
#
#   scripts/intel-opencl.sh build/test_opencl
#   scripts/intel-opencl.sh busted --lua=lua5.4 spec/opencl_spec.lua
#   scripts/intel-opencl.sh            (sets up, prints the environment)
#
# The runtime comes from PyPI: the wheels intel-opencl-rt, intel-cmplr-lib-rt
# and tbb are downloaded once (pip download --no-deps) and their libraries
# unpacked into $KVLUA_INTEL_OCL (default ~/.cache/kvlua/intel-ocl, about
# 800 MB); an ICD directory there holds one intel.icd naming libintelocl.so.
# The command runs with OCL_ICD_VENDORS set to that directory, so Intel's
# device is the only OpenCL device it sees, and LD_LIBRARY_PATH covering the
# wheels' libraries. The programs keep the system's ICD loader (the wheel's
# own libOpenCL.so is removed). Idempotent: a complete setup of these
# versions is reused; a half-finished one, or one of other versions, is
# done again.
set -euo pipefail

ROOT=${KVLUA_INTEL_OCL:-${XDG_CACHE_HOME:-$HOME/.cache}/kvlua/intel-ocl}
# the versions tested (the runtime's cl.cfg names its TBB version)
WHEELS=(intel-opencl-rt==2026.2.0 intel-cmplr-lib-rt==2026.2.0 tbb==2023.2.0)

lib_dirs() {
  local d dirs=""
  for d in "$ROOT"/unpacked/*.data/data/lib; do dirs="${dirs:+$dirs:}$d"; done
  echo "$dirs"
}

setup() {
  [ -f "$ROOT/icd/intel.icd" ] && [ "$(cat "$ROOT/done" 2>/dev/null)" = "${WHEELS[*]}" ] && return 0
  echo "intel-opencl: fetching ${WHEELS[*]} into $ROOT" >&2
  rm -rf "$ROOT"
  mkdir -p "$ROOT/wheels" "$ROOT/unpacked" "$ROOT/icd"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$ROOT/wheels" "${WHEELS[@]}" >&2
  local w
  for w in "$ROOT"/wheels/*.whl; do
    unzip -q -o "$w" '*.data/data/lib/*' -d "$ROOT/unpacked" # the libraries only
  done
  rm -rf "$ROOT/wheels" "$ROOT"/unpacked/*/data/lib/libOpenCL.so* # the wheel's own ICD loader
  local lib
  lib=$(ls "$ROOT"/unpacked/intel_opencl_rt-*.data/data/lib/libintelocl.so)
  echo "$lib" >"$ROOT/icd/intel.icd"
  echo "${WHEELS[*]}" >"$ROOT/done"
}

setup
export OCL_ICD_VENDORS="$ROOT/icd"
export LD_LIBRARY_PATH="$(lib_dirs)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ $# -eq 0 ]; then
  echo "OCL_ICD_VENDORS=$OCL_ICD_VENDORS"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  exit 0
fi
exec "$@"
