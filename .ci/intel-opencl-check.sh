#!/usr/bin/env bash
# CI: the OpenCL tests (test_opencl, spec/opencl_spec.lua) again on Intel's
# CPU runtime for OpenCL (PyPI wheels, scripts/intel-opencl.sh), the only
# device the loader sees there. Needs the build in build/ (./dev test).
set -euo pipefail
cd "$(dirname "$0")/.."

# the devices the tests will see: exactly one, Intel's
devices=$(scripts/intel-opencl.sh lua5.4 -e 'package.cpath = "build/?.so;" .. package.cpath
  for _, d in ipairs(require("kvlua").devices()) do print(d.platform .. ": " .. d.name) end')
echo "devices: ${devices:-none}"
if [ "$(echo "$devices" | grep -c .)" != 1 ] || ! echo "$devices" | grep -q '^Intel(R) OpenCL: '; then
  echo "intel-opencl-check: expected Intel's CPU device alone" >&2
  exit 1
fi

# a skip (exit 77: no device) is a failure here
scripts/intel-opencl.sh build/test_opencl
scripts/intel-opencl.sh env KVLUA_BUILD=build busted --lua=lua5.4 -o utfTerminal spec/opencl_spec.lua
