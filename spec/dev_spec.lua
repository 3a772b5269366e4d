-- ./dev test's closing line, "tests: N passed, N failed, N skipped", from
-- the two runners' output (./dev summary CTEST_LOG BUSTED_LOG). The logs
-- below are ctest's and busted's own formats; the counts are read off them
-- by hand. And the rule behind its skipped count: a C test that cannot run
-- here exits 77, which every C test's ctest registration takes as skipped.
local json = require "kvlua.json"

local BUILD = os.getenv("KVLUA_BUILD") or "build"

local function write(text)
  local path = os.tmpname()
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
  return path
end

local function summary(ctest_log, busted_log)
  local c, b = write(ctest_log), write(busted_log)
  local p = assert(io.popen(("./dev summary %s %s 2>&1"):format(c, b)))
  local out = p:read("a")
  local ok = p:close()
  os.remove(c)
  os.remove(b)
  return out, ok
end

-- ctest with SKIP_RETURN_CODE 77: test_opencl without a device exits 77
local CTEST_SKIP = [[
Test project /src/build
    Start 1: test_gguf
1/4 Test #1: test_gguf ........................   Passed    0.31 sec
    Start 2: test_opencl
2/4 Test #2: test_opencl ......................***Skipped   0.02 sec
    Start 3: test_quant
3/4 Test #3: test_quant .......................   Passed    2.10 sec
    Start 4: test_model
4/4 Test #4: test_model .......................***Failed    1.20 sec
FAIL tests/test_model.c:10: something
5 passed, 1 failed

75% tests passed, 1 tests failed out of 4

Total Test time (real) =   3.63 sec

The following tests did not run:
	  2 - test_opencl (Skipped)

The following tests FAILED:
	  4 - test_model (Failed)
]]

local BUSTED = [[
●●●●●◌◌●
6 successes / 0 failures / 1 error / 2 pending : 12.5 seconds
]]

describe("./dev summary", function()
  it("counts a C test that exits 77 as skipped, not passed", function()
    local out = summary(CTEST_SKIP, BUSTED)
    -- C: 2 passed, 1 failed, 1 skipped; Lua: 6 passed, 1 error, 2 pending
    assert.equals("tests: 8 passed, 2 failed, 3 skipped\n", out)
  end)

  it("with every C test run and no pending spec", function()
    local ctest = [[
1/2 Test #1: test_gguf ........................   Passed    0.31 sec
2/2 Test #2: test_opencl ......................   Passed   90.02 sec

100% tests passed, 0 tests failed out of 2
]]
    local out = summary(ctest, "3 successes / 0 failures / 0 errors / 0 pending : 1.0 seconds\n")
    assert.equals("tests: 5 passed, 0 failed, 0 skipped\n", out)
  end)
end)

describe("C tests that cannot run here", function()
  local function read(cmd)
    local p = assert(io.popen(cmd))
    local out = p:read("a")
    p:close()
    return out
  end

  it("are registered with ctest's SKIP_RETURN_CODE 77, every one", function()
    local tests = json.decode(read("ctest --test-dir " .. BUILD .. " --show-only=json-v1")).tests
    assert(#tests >= 8, "ctest lists " .. #tests .. " tests")
    for _, t in ipairs(tests) do
      local code
      for _, p in ipairs(t.properties or {}) do
        if p.name == "SKIP_RETURN_CODE" then code = p.value end
      end
      assert(code == 77, t.name .. ": SKIP_RETURN_CODE " .. tostring(code))
    end
  end)

  it("test_opencl without an OpenCL platform: exit 77, ctest says Skipped", function()
    -- an empty vendor directory hides every ICD from the loader
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir " .. dir))
    local out = read(("OCL_ICD_VENDORS=%s %s/test_opencl; echo status $?"):format(dir, BUILD))
    assert.matches("skip: ", out)
    assert.matches("status 77\n$", out)
    out = read(("OCL_ICD_VENDORS=%s ctest --test-dir %s -R '^test_opencl$' 2>&1"):format(dir, BUILD))
    os.remove(dir)
    assert.matches("test_opencl %.+%*%*%*Skipped", out)
  end)
end)
