-- Cache files: c:save(path, { key =, prefixes = }) and kvlua.restore(model, path, { key =, cache = c }).
--
-- A cache file holds sealed pages and the token ids of their chains; a
-- restore recomputes every chain hash from the target cache and adds the
-- pages as cached ones, so a later prefill of a saved prefix reuses them
-- and gives the same bits as a cold prefill. Any other model, other types,
-- a wrong key, an altered, truncated or appended file, or a cache too small
-- gives nil, message and leaves the target cache exactly as it was.
local kvlua = require "kvlua"
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"
local child = require "spec.support.child"

local same = require("spec.support.ids").same -- the same bits
local some_ids = require("spec.support.ids").some

local files = require "spec.support.files"
local read, write = files.read, files.write

local function slice(t, i, j)
  return { table.unpack(t, i, j) }
end

local KEY = ("k"):rep(32)

describe("cache files on a tiny model", function()
  local m, other, path, model_path
  setup(function()
    model_path = tiny.llama { seed = 41, n_embd = 64, n_head = 2, n_head_kv = 1 }
    m = assert(kvlua.load(model_path, { threads = 1 }))
    other = assert(kvlua.load(tiny.llama { seed = 42, n_embd = 64, n_head = 2, n_head_kv = 1 }, { threads = 1 }))
    path = os.tmpname()
  end)
  teardown(function()
    os.remove(path)
    m:close(); other:close()
  end)

  -- A cache holding the pages of a prefill of ids (the session closed: cached pages).
  local function filled(ids, opts)
    local c = assert(kvlua.cache(m, opts or { pages = 64 }))
    local s = assert(m:session { ctx = 512, cache = c })
    assert(s:prefill(ids, { logits = "none" }))
    s:close()
    return c
  end

  local function cold(ids)
    local s = assert(m:session { ctx = 512 })
    local l = assert(s:prefill(ids))
    s:close()
    return l
  end

  for _, key in ipairs { false, true } do
    local k = key and KEY or nil
    it("save, restore into a fresh cache: the pages are reused, the logits are the same bits" ..
      (key and " (encrypted)" or ""), function()
      local ids = some_ids(70, 64, 5)
      local c = filled(ids)
      assert.equals(4, c:stats().cached)
      local ok, n = c:save(path, { key = k })
      assert.is_true(ok)
      assert.equals(4, n)
      c:close()
      local c2 = assert(kvlua.cache(m, { pages = 64 }))
      local got, added = kvlua.restore(m, path, { key = k, cache = c2 })
      assert.equals(c2, got)
      assert.equals(4, added)
      local st = c2:stats()
      assert.equals(4, st.cached)
      assert.equals(0, st.used)
      assert.same({ cached = 64, tokens = 70, reason = "partial page" }, c2:lookup(ids))
      -- a second restore adds nothing: the pages are there
      assert.equals(0, select(2, kvlua.restore(m, path, { key = k, cache = c2 })))
      local prompt = slice(ids, 1, 70)
      prompt[71], prompt[72] = 9, 10
      local s = assert(m:session { ctx = 512, cache = c2 })
      local warm = assert(s:prefill(prompt))
      assert.equals(64, s:stats().reused_tokens)
      assert.equals(64, c2:stats().reused_tokens)
      assert.is_true(same(cold(prompt), warm))
    end)
  end

  for _, t in ipairs { "q8_0", "q4_0" } do
    it("quantized pages (" .. t .. ") restore as they were: reuse with a cold prefill's bits", function()
      local ids = some_ids(50, 64, 13)
      local types = { pages = 64, ktype = t, vtype = t }
      local c = filled(ids, types)
      assert.same({ true, 3 }, { c:save(path) })
      local c2 = assert(kvlua.cache(m, types))
      assert.equals(3, select(2, assert(kvlua.restore(m, path, { cache = c2 }))))
      local s = assert(m:session { ctx = 512, cache = c2 })
      local warm = assert(s:prefill(ids))
      assert.equals(48, s:stats().reused_tokens)
      local ref = assert(m:session { ctx = 512, ktype = t, vtype = t })
      assert.is_true(same(assert(ref:prefill(ids)), warm))
    end)
  end

  it("restores in another process (the hashes come from the target cache, not the file)", function()
    local ids = some_ids(100, 64, 6)
    local c = filled(ids)
    assert(c:save(path, { key = KEY }))
    c:close()
    local want = assert(cold(ids)):totable()
    local out, rc = child.run(([[
      local kvlua = require 'kvlua'
      local m = assert(kvlua.load(%q, { threads = 1 }))
      local c = assert(kvlua.cache(m, { pages = 32 }))
      local _, added = assert(kvlua.restore(m, %q, { key = %q, cache = c }))
      local s = assert(m:session { ctx = 512, cache = c })
      local l = assert(s:prefill({ %s }))
      local t = {}
      for i, x in ipairs(l:totable()) do t[i] = string.format('%%a', x) end
      print(added, s:stats().reused_tokens, table.concat(t, ','))
    ]]):format(model_path, path, KEY, table.concat(ids, ",")), 60)
    assert.equals(0, rc, out)
    local added, reused, bits = out:match("^(%d+)\t(%d+)\t(%S+)\n$")
    assert(added, out)
    assert.equals("6", added)
    assert.equals("96", reused)
    local t = {}
    for i, x in ipairs(want) do t[i] = string.format("%a", x) end
    assert.equals(table.concat(t, ","), bits)
  end)

  it("prefixes: only the full pages they reach, each page once", function()
    local a, b = some_ids(70, 64, 7), some_ids(40, 64, 8)
    local c = filled(a)
    local s = assert(m:session { ctx = 512, cache = c })
    assert(s:prefill(b, { logits = "none" }))
    s:close()
    assert.equals(6, c:stats().cached)
    assert.same({ true, 2 }, { c:save(path, { prefixes = { slice(a, 1, 40) } }) })
    assert.same({ true, 4 }, { c:save(path, { prefixes = { a, slice(a, 1, 40), a } }) })
    assert.same({ true, 6 }, { c:save(path, { prefixes = { a, b } }) })
    assert.same({ true, 6 }, { c:save(path) })
    assert.same({ true, 0 }, { c:save(path, { prefixes = { slice(a, 1, 15), { 1, 2, 3 } } }) })
    assert.same({ true, 0 }, { c:save(path, { prefixes = {} }) })
    -- a prefix stops at the first page the cache lacks
    local x = slice(b, 1, 16)
    for i = 17, 48 do x[i] = 5 end
    assert.same({ true, 1 }, { c:save(path, { prefixes = { x } }) })
    -- the file of the first two pages of a: a prefill of a reuses 32 tokens
    assert(c:save(path, { prefixes = { slice(a, 1, 40) } }))
    local c2 = assert(kvlua.cache(m, { pages = 64 }))
    assert.equals(2, select(2, assert(kvlua.restore(m, path, { cache = c2 }))))
    assert.same({ cached = 32, tokens = 70, reason = "never seen" }, c2:lookup(a))
  end)

  it("bad arguments raise: key size, non-integer ids, ids out of the vocabulary", function()
    local c = filled(some_ids(20, 64, 9))
    assert.has_error(function() c:save(path, { key = "short" }) end, "option 'key' must be a string of 32 bytes")
    assert.has_error(function() c:save(path, { prefixes = { { 1, 2.5 } } }) end,
      "option 'prefixes': item 1, index 2 is not an integer token id")
    assert.has_error(function() c:save(path, { prefixes = { { 1 }, { 3, 64 } } }) end,
      "option 'prefixes': item 2, index 2: token id 64 out of range [0, 64)")
    assert.has_error(function() c:save(path, { prefixes = { { -1 } } }) end)
    assert.has_error(function() c:save(path, { prefixes = { "abc" } }) end)
    assert.has_error(function() c:save(path, { prefixes = 3 }) end)
    assert.has_error(function() c:save(nil) end)
    local ok, err = c:save("/nonexistent-dir/x.kvc")
    assert.is_nil(ok)
    assert.is_string(err)
  end)

  it("a metamethod of the prefixes closing the cache mid-call: the save completes, then the cache is closed", function()
    local ids = some_ids(40, 64, 10)
    local c = filled(ids)
    local prefix = setmetatable({}, {
      __len = function() return 40 end,
      __index = function(_, i)
        if i == 20 then c:close(); collectgarbage() end
        return ids[i]
      end,
    })
    assert.same({ true, 2 }, { c:save(path, { prefixes = { prefix } }) })
    assert.has_error(function() c:stats() end, "attempt to use a closed cache")
    local c2 = assert(kvlua.cache(m, { pages = 8 }))
    assert.equals(2, select(2, assert(kvlua.restore(m, path, { cache = c2 }))))
  end)

  describe("refusals leave the target cache as it was", function()
    local ids, good, goodk
    setup(function()
      ids = some_ids(90, 64, 11)
      local c = filled(ids)
      assert(c:save(path))
      good = read(path)
      assert(c:save(path, { key = KEY }))
      goodk = read(path)
      c:close()
    end)

    -- a target holding other pages already, and its stats
    local function target(opts)
      local c = filled(some_ids(50, 64, 12), opts)
      return c, c:stats()
    end

    local function refused(bytes, opts, pattern, what)
      local bad = os.tmpname()
      write(bad, bytes)
      local c, before = target(opts and opts.cache)
      local r, err = kvlua.restore(opts and opts.model or m, bad, { key = opts and opts.key, cache = c })
      os.remove(bad)
      assert.is_nil(r, (what or "") .. ": restored")
      assert.is_string(err)
      if pattern then assert.matches(pattern, err, 1, true) end
      assert.same(before, c:stats(), what)
      c:close()
      return err
    end

    for _, key in ipairs { false, true } do
      local k = key and KEY or nil
      it("every altered byte, truncation and appended byte" .. (key and " (encrypted)" or ""), function()
        local file = key and goodk or good
        local c, before = target()
        local bad = os.tmpname()
        local step = math.max(1, #file // 250)
        local spots = { 1, 8, 9, 12, 13, 16, 17, 20, 21, 52, 53, 60, 77, 81, 85, 90, 100, 120, 200, #file - 40,
          #file - 36, #file - 32, #file - 1, #file }
        for i = 1, #file, step do spots[#spots + 1] = i end
        for _, i in ipairs(spots) do
          write(bad, file:sub(1, i - 1) .. string.char(file:byte(i) ~ 0x20) .. file:sub(i + 1))
          local r, err = kvlua.restore(m, bad, { key = k, cache = c })
          assert.is_nil(r, "byte " .. i .. " altered: restored")
          assert.is_string(err)
        end
        for _, n in ipairs { 0, 7, 16, 40, 80, #file // 2, #file - 33, #file - 1 } do
          write(bad, file:sub(1, n))
          assert.is_nil((kvlua.restore(m, bad, { key = k, cache = c })), "truncated to " .. n)
        end
        write(bad, file .. "\0")
        local r, err = kvlua.restore(m, bad, { key = k, cache = c })
        assert.is_nil(r)
        assert.matches("after the end", err)
        os.remove(bad)
        assert.same(before, c:stats())
        -- and the good file still restores into it
        assert.equals(5, select(2, assert(kvlua.restore(m, path, { key = KEY, cache = c }))))
      end)
    end

    it("wrong key, missing key, key for a plain file", function()
      refused(goodk, { key = ("x"):rep(32) }, "decryption failed")
      refused(goodk, nil, "a key is needed")
      refused(good, { key = KEY }, "not encrypted")
    end)

    it("another model: 'model fingerprint mismatch'", function()
      local c = assert(kvlua.cache(other, { pages = 64 }))
      local bad = os.tmpname()
      write(bad, good)
      local before = c:stats()
      local r, err = kvlua.restore(other, bad, { cache = c })
      os.remove(bad)
      assert.is_nil(r)
      assert.matches("model fingerprint mismatch", err)
      assert.same(before, c:stats())
    end)

    it("a cache of other K/V types or another page size", function()
      refused(good, { cache = { pages = 64, ktype = "q8_0", vtype = "q8_0" } }, "K/V types or page size")
      refused(good, { cache = { pages = 64, vtype = "f32" } }, "K/V types or page size")
      refused(good, { cache = { pages = 64, page_tokens = 32 } }, "K/V types or page size")
    end)

    it("a cache too small: 'cache full', nothing added (nothing evicted either)", function()
      -- 3 pages of the other prompt cached, room for 2 more
      refused(good, { cache = { pages = 5 } }, "cache full")
    end)

    it("a header promising more than the file holds; a newer version", function()
      -- n_nodes: after 16 bytes, the record length, the fingerprint and 6 u32
      local at = 16 + 4 + 32 + 6 * 4
      refused(good:sub(1, at) .. string.pack("<I4", 0x7fffffff) .. good:sub(at + 5), nil, "promises more")
      refused(good:sub(1, 8) .. string.pack("<I4", 99) .. good:sub(13), nil, "version 99 is newer")
    end)

    it("a session file and a cache file are not confused", function()
      -- a cache file without a cache: nil, message
      local r, err = kvlua.restore(m, path, { key = KEY })
      assert.is_nil(r)
      assert.matches("a cache file: restore it into a cache", err, 1, true)
      -- a session file with a cache is restored as a session (in that cache), not as pages
      local s = assert(m:session { ctx = 128 })
      assert(s:prefill(slice(ids, 1, 40), { logits = "none" }))
      local spath = os.tmpname()
      assert(s:save(spath))
      local c = assert(kvlua.cache(m, { pages = 16 }))
      local got = assert(kvlua.restore(m, spath, { cache = c }))
      assert.equals("kvlua.Session", getmetatable(got).__name)
      assert.equals(40, got.pos)
      os.remove(spath)
    end)
  end)
end)

-- ==== SmolLM2: several records ================================================

describe("cache files on SmolLM2", function()
  it("reordered, duplicated and dropped records are caught; a clean file restores, reused bit for bit", function()
    local p = models.path("smollm2")
    if not p then return pending("smollm2 not available") end
    local m = assert(kvlua.load(p))
    local ids = m:tokenize(("A long system prompt about rivers and mills. "):rep(60))
    local c = assert(kvlua.cache(m, { pages = 256 }))
    local s = assert(m:session { ctx = 1024, cache = c })
    local cold = assert(s:prefill(ids))
    s:close()
    local path = os.tmpname()
    for _, key in ipairs { false, KEY } do
      local k = key or nil
      local t0 = os.clock()
      local ok, n = c:save(path, { key = k, prefixes = { ids } })
      assert.is_true(ok)
      assert.equals(#ids // 16, n)
      local good = read(path)
      local head, recs, tail = files.records(good, k ~= nil)
      assert.is_true(#recs >= 3, "several records")
      local target = assert(kvlua.cache(m, { pages = 256 }))
      local before = target:stats()
      local function try(list, what)
        local bad = os.tmpname()
        write(bad, head .. table.concat(list) .. tail)
        local r, err = kvlua.restore(m, bad, { key = k, cache = target })
        os.remove(bad)
        assert.is_nil(r, what .. " restored")
        assert.is_string(err)
        assert.same(before, target:stats(), what)
      end
      try({ recs[1], recs[3], recs[2], table.unpack(recs, 4) }, "reordered")
      try({ recs[1], recs[2], recs[2], table.unpack(recs, 3) }, "duplicated")
      try({ recs[1], table.unpack(recs, 3) }, "dropped")
      try({ table.unpack(recs, 1, #recs - 1) }, "last dropped")
      local _, added = assert(kvlua.restore(m, path, { key = k, cache = target }))
      assert.equals(n, added)
      local r = assert(m:session { ctx = 1024, cache = target })
      assert.is_true(same(cold, assert(r:prefill(ids))))
      assert.equals(math.min(#ids // 16 * 16, #ids - 1), r:stats().reused_tokens)
      r:close()
      target:close()
    end
    os.remove(path)
    c:close()
    m:close()
  end)
end)

-- ==== Gemma 3: window groups ==================================================

describe("cache files on Gemma 3 (sliding-window layers)", function()
  it("the window groups' pages are saved and found by hash: reuse past the window, bit for bit", function()
    local p = models.path("gemma3")
    if not p then return pending("gemma3 not available") end
    local m = assert(kvlua.load(p))
    local W = m.info.sliding_window
    local ids = some_ids(W + 200, 32000, 31)
    local c = assert(kvlua.cache(m, { pages = 400 }))
    local s = assert(m:session { ctx = 2048, cache = c })
    assert(s:prefill(ids, { logits = "none" }))
    s:close()
    local path = os.tmpname()
    local ok, n = c:save(path, { key = KEY, prefixes = { ids } })
    assert.is_true(ok)
    -- every full page, in the global group and in the window group
    assert.equals(2 * (#ids // 16), n)
    c:close()
    local c2 = assert(kvlua.cache(m, { pages = 400 }))
    assert.equals(n, select(2, assert(kvlua.restore(m, path, { key = KEY, cache = c2 }))))
    local prompt = slice(ids, 1, #ids)
    prompt[#prompt + 1] = 77
    local r = assert(m:session { ctx = 2048, cache = c2 })
    local warm = assert(r:prefill(prompt))
    assert.equals(#ids // 16 * 16, r:stats().reused_tokens)
    local cold = assert(assert(m:session { ctx = 2048 }):prefill(prompt))
    assert.is_true(same(cold, warm))
    os.remove(path)
    m:close()
  end)
end)
