-- Findings of an audit of session and cache files on disk, one describe per
-- finding, each written to fail before its fix:
--
--   1  version-1 files were refused as altered (the reader authenticated
--      every file as version 2), and a version field changed from 2 to 1
--      went unnoticed (f16 pages restored; quantized ones were refused for
--      their version)
--   2  a plain record of 1 MiB + 17 bytes was read into a 1 MiB buffer
--
-- Everything runs on tiny random-weight models written to temporary files;
-- what could corrupt the heap (2) runs in a child lua5.4.
local kvlua = require "kvlua"
local tiny = require "spec.support.tiny_models"
local run_child = require "spec.support.child"
local files = require "spec.support.files"
local same = require("spec.support.ids").same
local some_ids = require("spec.support.ids").some
local child, quote = run_child.run, run_child.quote
local read, write = files.read, files.write

local KEY = ("k"):rep(32)

-- ==== helpers ================================================================

local function sh(cmd)
  return os.execute(cmd) == true
end

-- A new folder, removed after the test whatever its outcome.
local made = {}
local function tempdir()
  local p = assert(io.popen("mktemp -d"))
  local d = p:read("l")
  p:close()
  made[#made + 1] = d
  return d
end
after_each(function()
  for _, d in ipairs(made) do sh("rm -rf " .. quote(d)) end
  made = {}
end)

-- The names in folder dir (dot files too), sorted.
local function listing(dir)
  local p = assert(io.popen("ls -A " .. quote(dir)))
  local t = {}
  for name in p:lines() do t[#t + 1] = name end
  p:close()
  table.sort(t)
  return t
end

local function is_link(p) return sh("test -L " .. quote(p)) end
local function is_fifo(p) return sh("test -p " .. quote(p)) end
local function is_dir(p) return sh("test -d " .. quote(p) .. " && test ! -L " .. quote(p)) end

local path, m -- a tiny llama, 64 tokens of vocabulary
setup(function()
  path = tiny.llama { seed = 61, n_embd = 64, n_head = 2, n_head_kv = 1 }
  m = assert(kvlua.load(path, { threads = 1 }))
end)
teardown(function()
  m:close()
  tiny.cleanup()
end)

local function session(n, opts)
  opts = opts or {}
  opts.ctx = opts.ctx or 512
  local s = assert(m:session(opts))
  assert(s:prefill(some_ids(n, 64, n)))
  return s
end

-- The next logits after token 9: the same bits for a session and its restored copy.
local function same_next(a, b)
  return same(assert(a:fork():decode(9)), assert(b:fork():decode(9)))
end

-- ==== 1 ======================================================================

describe("1: the version field is authenticated; version 1 is refused by its version", function()
  local function saved(opts, key)
    local s = session(40, opts)
    local p = os.tmpname()
    assert(s:save(p, { key = key }))
    local b = read(p)
    return s, p, b
  end

  it("a genuine version-1 file with f16 pages restores", function()
    local s, p, b = saved()
    write(p, files.as_version(b, 1))
    local r, err = kvlua.restore(m, p)
    os.remove(p)
    assert(r, err)
    assert.is_true(same_next(s, r))
  end)

  it("a genuine version-1 file with quantized pages: refused by its version", function()
    local _, p, b = saved { ktype = "q8_0", vtype = "q8_0" }
    write(p, files.as_version(b, 1))
    local r, err = kvlua.restore(m, p)
    os.remove(p)
    assert.is_nil(r)
    assert.matches("session file version 1: this kvlua reads version 2", err)
    assert.matches("save it again", err)
  end)

  it("a version-2 file whose version reads 1: altered (plain, f16 and q8_0 pages)", function()
    for _, opts in ipairs { {}, { ktype = "q8_0", vtype = "q8_0" } } do
      local _, p, b = saved(opts)
      write(p, b:sub(1, 8) .. string.pack("<I4", 1) .. b:sub(13))
      local r, err = kvlua.restore(m, p)
      os.remove(p)
      assert.is_nil(r, opts.ktype or "f16")
      assert.matches("checksum mismatch %(altered", err)
    end
  end)

  it("a version-2 file whose version reads 1: altered (encrypted)", function()
    for _, opts in ipairs { {}, { ktype = "q8_0", vtype = "q8_0" } } do
      local _, p, b = saved(opts, KEY)
      write(p, b:sub(1, 8) .. string.pack("<I4", 1) .. b:sub(13))
      local r, err = kvlua.restore(m, p, { key = KEY })
      os.remove(p)
      assert.is_nil(r, opts.ktype or "f16")
      assert.matches("the file was altered", err)
    end
  end)

  it("cache files: a genuine version 1 restores (f16) or is refused by its version (q8_0); an altered one", function()
    for _, t in ipairs { "f16", "q8_0" } do
      local c = assert(kvlua.cache(m, { pages = 16, ktype = t, vtype = t }))
      local s = assert(m:session { ctx = 512, cache = c })
      assert(s:prefill(some_ids(40, 64, 3), { logits = "none" }))
      s:close()
      local p = os.tmpname()
      assert(c:save(p))
      local b = read(p)
      write(p, files.as_version(b, 1))
      local c2 = assert(kvlua.cache(m, { pages = 16, ktype = t, vtype = t }))
      local got, added = kvlua.restore(m, p, { cache = c2 })
      if t == "f16" then
        assert.equals(c2, got, added)
        assert.equals(2, added)
      else
        assert.is_nil(got)
        assert.matches("cache file version 1: this kvlua reads version 2", added)
      end
      write(p, b:sub(1, 8) .. string.pack("<I4", 1) .. b:sub(13))
      local got2, err2 = kvlua.restore(m, p, { cache = c2 })
      os.remove(p)
      assert.is_nil(got2)
      assert.matches("checksum mismatch %(altered", err2)
    end
  end)
end)

-- ==== 2 ======================================================================

describe("2: a plain record larger than 1 MiB is refused before it is read", function()
  it("1 MiB + 17 bytes (the encrypted limit) in a plain file: nil, message (in a child: it corrupted the heap)", function()
    local p = os.tmpname()
    assert(session(20):save(p))
    local b = read(p)
    local n = (1 << 20) + 17
    write(p, b:sub(1, 16) .. string.pack("<I4", n) .. ("\0"):rep(n) .. string.pack("<I4", 0) .. ("\0"):rep(32))
    local out, rc = child(([[
      local kvlua = require "kvlua"
      local m = assert(kvlua.load(%q, { threads = 1 }))
      print("session:", select(2, kvlua.restore(m, %q)))
      local c = assert(kvlua.cache(m, { pages = 16 }))
      io.open(%q, "r+b"):write("KVLUAKC1"):close()
      print("cache:", select(2, kvlua.restore(m, %q, { cache = c })))
    ]]):format(path, p, p, p), 60)
    os.remove(p)
    assert.equals(0, rc, out)
    assert.matches("session:%s+kv file: record larger than allowed", out)
    assert.matches("cache:%s+kv file: record larger than allowed", out)
  end)
end)
