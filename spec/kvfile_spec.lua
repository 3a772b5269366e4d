-- Session files: s:save(path, { key = }) and kvlua.restore(model, path, { key =, cache =, ctx = }).
--
-- A restored session continues with the same bits as the one that was
-- saved. Any other model, a wrong key, or a file that was altered,
-- truncated, reordered, duplicated or appended to gives nil, message,
-- and nothing partial is ever left under the file's name.
local kvlua = require "kvlua"
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"

local same = require("spec.support.ids").same -- the same bits

local some_ids = require("spec.support.ids").some

local files = require "spec.support.files"
local read, write = files.read, files.write

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local KEY = ("k"):rep(32)

describe("session files on a tiny model", function()
  local m, other, path
  setup(function()
    m = assert(kvlua.load(tiny.llama { seed = 41, n_embd = 64, n_head = 2, n_head_kv = 1 }, { threads = 1 }))
    other = assert(kvlua.load(tiny.llama { seed = 42, n_embd = 64, n_head = 2, n_head_kv = 1 }, { threads = 1 }))
    path = os.tmpname()
  end)
  teardown(function()
    os.remove(path)
    m:close(); other:close()
  end)

  local function saved_session(n, key)
    local s = assert(m:session { ctx = 512 })
    assert(s:prefill(some_ids(n, 64, n)))
    assert(s:save(path, { key = key }))
    return s
  end

  for _, key in ipairs { false, true } do
    local k = key and KEY or nil
    it("save then restore: the same tokens and the same next logits" .. (key and " (encrypted)" or ""), function()
      local s = saved_session(70, k)
      local r = assert(kvlua.restore(m, path, { key = k }))
      assert.same(s:tokens(), r:tokens())
      assert.is_true(same(assert(s:prefill({ 9, 10, 11 })), assert(r:prefill({ 9, 10, 11 }))))
      assert.is_true(same(assert(s:decode(12)), assert(r:decode(12))))
    end)
  end

  it("restores into a shared cache (and the restored pages serve prefix reuse)", function()
    local s = saved_session(40)
    local c = assert(kvlua.cache(m, { pages = 32 }))
    local r = assert(kvlua.restore(m, path, { cache = c, ctx = 1024 }))
    assert.equals(1024, r.ctx)
    assert.equals(c, r.cache)
    assert.same({ cached = 32, tokens = 40, reason = "partial page" }, c:lookup(s:tokens()))
    local q8 = assert(kvlua.cache(m, { pages = 32, ktype = "q8_0", vtype = "q8_0" }))
    local bad, err = kvlua.restore(m, path, { cache = q8 })
    assert.is_nil(bad)
    assert.matches("types", err)
  end)

  it("another model: nil, 'model fingerprint mismatch'", function()
    saved_session(20)
    local r, err = kvlua.restore(other, path)
    assert.is_nil(r)
    assert.matches("model fingerprint mismatch", err)
  end)

  it("wrong key, missing key, key for a plain file: nil, message; a key of the wrong size raises", function()
    saved_session(20, KEY)
    assert.is_nil((kvlua.restore(m, path, { key = ("x"):rep(32) })))
    assert.is_nil((kvlua.restore(m, path)))
    saved_session(20)
    assert.is_nil((kvlua.restore(m, path, { key = KEY })))
    assert.has_error(function() kvlua.restore(m, path, { key = "short" }) end)
    assert.has_error(function() m:session {}:save(path, { key = "short" }) end)
  end)

  for _, key in ipairs { false, true } do
    local k = key and KEY or nil
    it("every altered byte, truncation and appended byte is caught" .. (key and " (encrypted)" or ""), function()
      saved_session(50, k)
      local good = read(path)
      local bad = os.tmpname()
      local step = math.max(1, #good // 97)
      for i = 1, #good, step do -- a flipped byte anywhere
        write(bad, good:sub(1, i - 1) .. string.char(good:byte(i) ~ 0x20) .. good:sub(i + 1))
        local r, err = kvlua.restore(m, bad, { key = k })
        assert.is_nil(r, "byte " .. i .. " altered: restored")
        assert.is_string(err)
      end
      for _, n in ipairs { 0, 7, 16, 40, #good // 2, #good - 33, #good - 1 } do -- truncations
        write(bad, good:sub(1, n))
        assert.is_nil((kvlua.restore(m, bad, { key = k })), "truncated to " .. n)
      end
      write(bad, good .. "\0")
      local r, err = kvlua.restore(m, bad, { key = k })
      assert.is_nil(r)
      assert.matches("after the end", err)
      os.remove(bad)
    end)
  end

  it("a newer format version: nil, message naming it", function()
    saved_session(20)
    local good = read(path)
    write(path, good:sub(1, 8) .. string.pack("<I4", 99) .. good:sub(13))
    local r, err = kvlua.restore(m, path)
    assert.is_nil(r)
    assert.matches("version 99 is newer", err)
  end)

  it("a version 1 file with quantized pages (stored unrotated then): nil, message", function()
    local s = assert(m:session { ctx = 512, ktype = "q8_0", vtype = "q8_0" })
    assert(s:prefill(some_ids(40, 64, 3)))
    assert(s:save(path))
    write(path, files.as_version(read(path), 1)) -- as version 1 wrote it (checksum included)
    local r, err = kvlua.restore(m, path)
    assert.is_nil(r)
    assert.matches("session file version 1: this kvlua reads version 2", err)
  end)

  it("a failed save leaves nothing: no directory, or a full disk", function()
    local s = saved_session(20)
    local ok, err = s:save("/nonexistent-dir/x.kv")
    assert.is_nil(ok)
    assert.is_string(err)
    local dir = os.tmpname()
    os.remove(dir)
    os.execute("mkdir -p " .. dir)
    if not os.execute("mount -t tmpfs -o size=8k tmpfs " .. dir .. " 2>/dev/null") then
      os.execute("rmdir " .. dir)
      return pending("cannot mount a small tmpfs here")
    end
    local big = assert(m:session { ctx = 512 })
    assert(big:prefill(some_ids(300, 64, 3)))
    ok, err = big:save(dir .. "/s.kv")
    assert.is_nil(ok)
    assert.matches("No space left", err)
    local p = io.popen("ls -A " .. dir)
    local listing = p:read("a")
    p:close()
    os.execute("umount " .. dir .. "; rmdir " .. dir)
    assert.equals("", listing) -- nothing partial, not even the temporary file
  end)
end)

describe("session files on SmolLM2", function()
  it("reordered, duplicated and dropped records are caught; a clean file restores bit for bit", function()
    local p = models.path("smollm2")
    if not p then return pending("smollm2 not available") end
    local m = assert(kvlua.load(p))
    local s = assert(m:session { ctx = 1024 })
    assert(s:prefill(m:tokenize(("A long system prompt about rivers and mills. "):rep(40))))
    local path = os.tmpname()
    for _, key in ipairs { false, KEY } do
      local k = key or nil
      assert(s:save(path, { key = k }))
      local good = read(path)
      local head, recs, tail = files.records(good, k ~= nil)
      assert.is_true(#recs >= 3, "several records")
      local function try(list, what)
        local bad = os.tmpname()
        write(bad, head .. table.concat(list) .. tail)
        local r, err = kvlua.restore(m, bad, { key = k })
        os.remove(bad)
        assert.is_nil(r, what .. " restored")
        assert.is_string(err)
      end
      try({ recs[1], recs[3], recs[2], table.unpack(recs, 4) }, "reordered")
      try({ recs[1], recs[2], recs[2], table.unpack(recs, 3) }, "duplicated")
      try({ recs[1], table.unpack(recs, 3) }, "dropped")
      local r = assert(kvlua.restore(m, path, { key = k }))
      assert.is_true(same(assert(s:fork():decode(42)), assert(r:decode(42))))
    end
    os.remove(path)
    m:close()
  end)
end)

describe("scripts/prompt-cache.lua (separate processes)", function()
  local S = require "spec.support.scripts"
  it("saves a system prompt's cache once and answers from it in other processes, exactly and sooner", function()
    if not models.path("smollm2") then return pending("smollm2 not available") end
    local sys = os.tmpname()
    write(sys, "You answer questions about mills. " .. ("The mill by the river ground grain for the town. "):rep(25))
    local file = os.tmpname()
    local r = S.run("prompt-cache.lua", { "--save", file, "--system-file", sys, "--json" })
    S.assert_ok(r)
    local saved = S.json_decode(r.out)
    assert.is_true(saved.tokens > 200)
    for _, q in ipairs { "What does the mill grind?", "Where is the mill?" } do
      r = S.run("prompt-cache.lua", { "--load", file, "--system-file", sys, "--question", q, "--compare", "--json",
        "--max-tokens", "12" })
      S.assert_ok(r)
      local got = S.json_decode(r.out)
      assert.equals(saved.tokens, got.from_file)
      assert.is_true(got.same_answer, "the restored session answers as a cold prefill does")
      assert.is_true(got.prompt_tokens - got.from_file < 30)
    end
    r = S.run("prompt-cache.lua", { "--load", file .. ".missing", "--system-file", sys, "--question", "x" })
    assert.is_not.equals(0, r.rc)
    assert.matches("restore", r.err)
    os.remove(sys)
    os.remove(file)
  end)
end)
