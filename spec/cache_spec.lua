-- Caches: a pool of KV pages that sessions share, with exact prefix reuse,
-- copy-on-write forks and eviction a Lua policy can decide.
--
--   local c = kvlua.cache(model, { pages = 256, page_tokens = 16 })
--   local s = model:session{ ctx = 2048, cache = c }
--   s:prefill(ids)            -- takes the cached pages ids starts with
--   local f = s:fork()        -- shares every page until it writes
--   c:stats(), c:lookup(ids), c:pin(ids), c:unpin(ids), c:clear()
--
-- Reuse is exact: the logits after a reused prefix are the same bits as a
-- cold prefill of the same ids, however the ids were split into calls and
-- whether earlier tokens were decoded one at a time.
local kvlua = require "kvlua"
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"

local some_ids = require("spec.support.ids").some

local function slice(t, a, b) return table.move(t, a, b, 1, {}) end

local same = require("spec.support.ids").same -- the same bits

local function row(l, i) return l.rows > 1 and l:row(i) or l end

-- ==== bad input ==================================================================

describe("kvlua.cache: bad input", function()
  local m, other
  setup(function()
    m = assert(kvlua.load(tiny.llama { seed = 4, n_embd = 64, n_head = 2, n_head_kv = 1 }, { threads = 1 }))
    other = assert(kvlua.load(tiny.llama { seed = 5 }, { threads = 1 }))
  end)
  teardown(function() m:close(); other:close() end)

  it("page_tokens 0 or not a power of two raises", function()
    assert.has_error(function() kvlua.cache(m, { pages = 8, page_tokens = 0 }) end)
    assert.has_error(function() kvlua.cache(m, { pages = 8, page_tokens = 24 }) end)
  end)

  it("capacity: exactly one of bytes and pages; below one page is nil, message", function()
    assert.has_error(function() kvlua.cache(m, {}) end)
    assert.has_error(function() kvlua.cache(m, { pages = 4, bytes = 1 << 20 }) end)
    local c, err = kvlua.cache(m, { bytes = 100 })
    assert.is_nil(c)
    assert.matches("below one page", err)
  end)

  it("a cache of another model raises; so do a closed cache and other types", function()
    local c = assert(kvlua.cache(other, { pages = 8 }))
    assert.has_error(function() m:session { cache = c } end, "option 'cache': the cache belongs to another model")
    local c2 = assert(kvlua.cache(m, { pages = 8 }))
    assert.has_error(function() m:session { cache = c2, ktype = "q8_0" } end)
    c2:close()
    assert.has_error(function() m:session { cache = c2 } end, "attempt to use a closed cache")
    c:close()
  end)

  it("closing a cache with live sessions: the sessions keep it working", function()
    local c = assert(kvlua.cache(m, { pages = 16 }))
    local s = assert(m:session { ctx = 128, cache = c })
    c:close()
    collectgarbage()
    assert(s:prefill(some_ids(40, 64, 1)))
    assert(s:decode(5))
    assert.equals(41, s.pos)
    s:close()
  end)
end)

-- ==== pages, forks, eviction, pins, policies =========================================

describe("a cache on a tiny model", function()
  local m
  setup(function()
    m = assert(kvlua.load(tiny.llama { seed = 6, n_embd = 64, n_head = 2, n_head_kv = 1 }, { threads = 1 }))
  end)
  teardown(function() m:close() end)

  it("pages are taken as tokens arrive (100 tokens in a ctx-4096 session: 7 pages)", function()
    local c = assert(kvlua.cache(m, { pages = 300 }))
    local s = assert(m:session { ctx = 4096, cache = c })
    assert.equals(0, c:stats().used)
    assert(s:prefill(some_ids(100, 64, 2), { logits = "none" }))
    assert.equals(7, c:stats().used)
    assert.equals(m:kv_bytes { ctx = 100 }, s:stats().kv_bytes)
    s:close()
    local st = c:stats()
    assert.equals(0, st.used)
    assert.equals(6, st.cached) -- the full pages stay cached; the partial one is freed
  end)

  it("64 forks of a 1,000-token session share its pages; 16 decode steps each take at most 2 more", function()
    local c = assert(kvlua.cache(m, { pages = 400 }))
    local s = assert(m:session { ctx = 2048, cache = c })
    assert(s:prefill(some_ids(1000, 64, 3)))
    local base = c:stats().used
    local forks = {}
    for i = 1, 64 do forks[i] = s:fork() end
    assert.equals(base, c:stats().used)
    for i, f in ipairs(forks) do
      assert.equals(1000, f.pos)
      for k = 1, 16 do assert(f:decode(3 + (i + k) % 60)) end
    end
    local more = c:stats().used - base
    assert.is_true(more <= 2 * 64, "forks took " .. more .. " pages")
    for _, f in ipairs(forks) do f:close() end
    s:close()
  end)

  it("a fork continues exactly like its parent", function()
    local s = assert(m:session { ctx = 256 })
    assert(s:prefill(some_ids(37, 64, 4)))
    local f = s:fork()
    local a, b = assert(s:prefill({ 7, 8, 9 })), assert(f:prefill({ 7, 8, 9 }))
    assert.is_true(same(a, b))
    assert.same(s:tokens(), f:tokens())
  end)

  it("when nothing can be evicted: nil, 'cache full' with numbers, and the session stays usable", function()
    local c = assert(kvlua.cache(m, { pages = 6 }))
    local s = assert(m:session { ctx = 512, cache = c })
    local l, err = s:prefill(some_ids(200, 64, 5))
    assert.is_nil(l)
    assert.matches("cache full: %d+ more pages needed", err)
    assert.equals(0, s.pos)
    assert(s:prefill(some_ids(50, 64, 6)))
    assert.equals(50, s.pos)
  end)

  it("LRU by default; pins hold; pin of more than the cache holds is nil, message", function()
    local c = assert(kvlua.cache(m, { pages = 8 }))
    local a, b = some_ids(64, 64, 7), some_ids(96, 64, 8)
    local s = assert(m:session { ctx = 256, cache = c })
    assert(s:prefill(a, { logits = "none" })); s:close()
    assert(c:pin(slice(a, 1, 32)))
    s = assert(m:session { ctx = 256, cache = c })
    assert(s:prefill(b, { logits = "none" })); s:close()    -- 6 pages: 4 free, then a's 2 unpinned pages
    local st = c:stats()
    assert.equals(2, st.evictions)
    assert.equals(2, st.pinned)
    assert.same({ cached = 32, tokens = 64, reason = "evicted" }, c:lookup(a))
    assert.same({ cached = 96, tokens = 96 }, c:lookup(b))
    local ok, err = c:pin(some_ids(16 * 9, 64, 9))
    assert.is_nil(ok)
    assert.matches("cannot pin", err)
    assert(c:unpin(slice(a, 1, 32)))
    assert.equals(0, c:stats().pinned)
  end)

  it("a policy decides what is evicted (here: the longest prefixes first)", function()
    local calls = {}
    local c = assert(kvlua.cache(m, { pages = 8, policy = function(cands, need)
      calls[#calls + 1] = { n = #cands, need = need, first = cands[1] }
      table.sort(cands, function(x, y) return x.tokens > y.tokens end)
      local out = {}
      for i = 1, need do out[i] = cands[i] end
      return out
    end }))
    local a, b = some_ids(64, 64, 10), some_ids(32, 64, 11)
    local s = assert(m:session { ctx = 256, cache = c })
    assert(s:prefill(a, { logits = "none" })); s:close()   -- 4 cached pages of a
    s = assert(m:session { ctx = 256, cache = c })
    assert(s:prefill(b, { logits = "none" }))              -- 2 pages: 4 free... no eviction yet
    assert.equals(0, #calls)
    assert(s:prefill(some_ids(48, 64, 12), { logits = "none" })) -- 3 more: 2 free, 1 evicted by the policy
    assert.equals(1, #calls)
    assert.equals(1, calls[1].need)
    assert.equals(4, calls[1].n)
    for _, k in ipairs { "id", "group", "window", "tokens", "hits", "last_use", "bytes", "pinned" } do
      assert.is_not_nil(calls[1].first[k], k)
    end
    -- the policy took a's last page (64 tokens), not the oldest: a's first 48 tokens are still there
    assert.same({ cached = 48, tokens = 64, reason = "evicted" }, c:lookup(a))
    s:close()
  end)

  it("a policy that errors or answers nonsense raises; nothing is lost and the cache stays usable", function()
    local mode = "error"
    local c = assert(kvlua.cache(m, { pages = 4, policy = function(cands, need)
      if mode == "error" then error("my policy broke") end
      if mode == "nonsense" then return { 12345 } end
      if mode == "twice" then return { cands[1], cands[1] } end
      if mode == "none" then return {} end
      local out = {}
      for i = 1, need do out[i] = cands[i].id end
      return out
    end }))
    local a = some_ids(64, 64, 13)
    local s = assert(m:session { ctx = 256, cache = c })
    assert(s:prefill(a, { logits = "none" })); s:close()   -- 4 cached pages, 0 free
    s = assert(m:session { ctx = 256, cache = c })
    local b = some_ids(20, 64, 14)
    assert.error_matches(function() s:prefill(b) end, "cache policy failed: .*my policy broke")
    mode = "nonsense"
    assert.has_error(function() s:prefill(b) end)
    mode = "twice"
    assert.has_error(function() s:prefill(b) end)
    mode = "none"
    local l, err = s:prefill(b)
    assert.is_nil(l)
    assert.matches("cache full: the policy evicted 0 of the %d pages needed", err)
    assert.equals(0, s.pos)
    assert.same({ cached = 64, tokens = 64 }, c:lookup(a)) -- nothing lost
    mode = "ok"
    assert(s:prefill(b))
    assert.equals(20, s.pos)
    assert.equals(2, c:stats().evictions)
  end)

  it("the policy cannot evaluate sessions of its own cache", function()
    local s2, tried
    local c = assert(kvlua.cache(m, { pages = 4, policy = function(cands, need)
      if not tried then
        tried = true
        s2:prefill({ 5 }) -- raises: the cache is busy
      end
      return { cands[1] }
    end }))
    local s = assert(m:session { ctx = 256, cache = c })
    assert(s:prefill(some_ids(64, 64, 15), { logits = "none" })); s:close()
    s2 = assert(m:session { ctx = 256, cache = c })
    s = assert(m:session { ctx = 256, cache = c })
    assert.has_error(function() s:prefill(some_ids(20, 64, 16)) end)
    assert(s:prefill(some_ids(3, 64, 17)))
  end)

  it("lookup explains a miss: never seen, evicted, other types, partial page", function()
    local c = assert(kvlua.cache(m, { pages = 16 }))
    local q = assert(kvlua.cache(m, { pages = 16, ktype = "q8_0", vtype = "q8_0" }))
    local ids = some_ids(40, 64, 18)
    assert.same({ cached = 0, tokens = 40, reason = "never seen" }, c:lookup(ids))
    local s = assert(m:session { ctx = 64, cache = q })
    assert(s:prefill(ids, { logits = "none" }))
    assert.same({ cached = 0, tokens = 40, reason = "other types" }, c:lookup(ids))
    assert.same({ cached = 32, tokens = 40, reason = "partial page" }, q:lookup(ids))
    s:close()
    q:clear()
    assert.same({ cached = 0, tokens = 40, reason = "evicted" }, q:lookup(ids))
  end)
end)

describe("a cache on Gemma 3 (sliding-window layers)", function()
  local m
  setup(function()
    local p = models.path("gemma3")
    if p then m = assert(kvlua.load(p)) end
  end)
  teardown(function() if m then m:close() end end)

  it("window layers hold only their window; dropped window pages are explained; reuse resumes exactly", function()
    if not m then return pending("gemma3 not available") end
    local W = m.info.sliding_window
    local ids = some_ids(W + 300, 32000, 21)
    -- a policy that drops every cached window-layer page when window pages
    -- are short (leaving the global layers' pages), else the oldest
    local c = assert(kvlua.cache(m, { pages = 70, policy = function(cands, need)
      if cands[1].window > 0 then return cands end
      return { table.unpack(cands, 1, need) }
    end }))
    local s = assert(m:session { ctx = 2048, cache = c })
    local cold = assert(s:prefill(ids))
    local st = s:stats()
    assert.equals(m:kv_bytes { ctx = #ids }, st.kv_bytes, "session bytes vs model:kv_bytes")
    -- the 15 window layers hold ~W positions, the 3 global ones all of them
    local per_pos = m.info.n_head_kv * m.info.head_dim * 2 * 2 -- bytes of K and V (f16) per layer and position
    local n_global = m.info.n_layer // 6
    local bound = (n_global * (#ids + 16) + (m.info.n_layer - n_global) * (W + 32)) * per_pos
    assert.is_true(st.kv_bytes <= bound, st.kv_bytes .. " > " .. bound)
    s:close()
    -- reuse: a new session resumes at the end of the cached pages, the window pages it needs included
    local r = assert(m:session { ctx = 2048, cache = c })
    assert.is_true(same(cold, assert(r:prefill(ids))))
    assert.is_true(r:stats().reused_tokens >= #ids - 16)
    r:close()
    -- fill the cache with other tokens: the policy drops window pages first
    local o = assert(m:session { ctx = 2048, cache = c })
    assert(o:prefill(some_ids(W, 32000, 22), { logits = "none" }))
    o:close()
    local lk = c:lookup(ids)
    assert.equals("window pages dropped", lk.reason)
  end)
end)

-- ==== exact reuse on the real models ====================================================

local function exact_suite(name, n_tokens)
  describe("exact reuse on " .. name, function()
    local m, ids, cold, cold_all
    setup(function()
      local p = models.path(name)
      if not p then return end
      m = assert(kvlua.load(p))
      local text = ("In the beginning the Universe was created. This has made a lot of people very angry "
        .. "and been widely regarded as a bad move. "):rep(8)
      ids = slice(m:tokenize(text), 1, n_tokens)
      local s = assert(m:session { ctx = 512 })
      cold = assert(s:prefill(ids))
      s:close()
      s = assert(m:session { ctx = 512 })
      cold_all = assert(s:prefill(ids, { logits = "all" }))
      s:close()
    end)
    teardown(function() if m then m:close() end end)

    it("a reused prefix gives the cold prefill's bits", function()
      if not m then return pending(name .. " not available") end
      local c = assert(kvlua.cache(m, { pages = 256 }))
      local a = assert(m:session { ctx = 512, cache = c })
      assert.is_true(same(cold, assert(a:prefill(ids))))
      local b = assert(m:session { ctx = 512, cache = c })
      local l = assert(b:prefill(ids))
      assert.is_true(b:stats().reused_tokens >= (#ids - 1) // 16 * 16)
      assert.is_true(same(cold, l))
      c:close()
    end)

    it("the same ids split at every offset of a page, and at page multiples, give the same bits", function()
      if not m then return pending(name .. " not available") end
      for _, k in ipairs { 1, 2, 3, 5, 7, 8, 11, 15, 16, 17, 31, 32, 33, 48, 64, 100 } do
        if k < #ids then
          local s = assert(m:session { ctx = 512 })
          assert(s:prefill(slice(ids, 1, k), { logits = "none" }))
          local l = assert(s:prefill(slice(ids, k + 1, #ids)))
          assert.is_true(same(cold, l), "split at " .. k)
          s:close()
        end
      end
    end)

    it("decoded one at a time, then reused as a prefix: the same bits", function()
      if not m then return pending(name .. " not available") end
      local c = assert(kvlua.cache(m, { pages = 256 }))
      local d = assert(m:session { ctx = 512, cache = c })
      assert(d:prefill(slice(ids, 1, 5)))
      local l
      for i = 6, #ids do l = assert(d:decode(ids[i])) end
      assert.is_true(same(cold, l), "decode steps")
      local r = assert(m:session { ctx = 512, cache = c })
      l = assert(r:prefill(ids))
      assert.is_true(r:stats().reused_tokens > 0)
      assert.is_true(same(cold, l), "reused after decode")
      c:close()
    end)

    it("all-position logits after a reused prefix equal the cold ones, row for row", function()
      if not m then return pending(name .. " not available") end
      local c = assert(kvlua.cache(m, { pages = 256 }))
      local a = assert(m:session { ctx = 512, cache = c })
      assert(a:prefill(ids, { logits = "none" }))
      local b = assert(m:session { ctx = 512, cache = c })
      local k = 40
      assert(b:prefill(slice(ids, 1, k), { logits = "none" }))
      assert.equals(32, b:stats().reused_tokens) -- full pages (the 8 after them are computed)
      local rest = assert(b:prefill(slice(ids, k + 1, #ids), { logits = "all" }))
      for i = 1, #ids - k do
        assert.is_true(same(row(cold_all, k + i), row(rest, i)), "row " .. (k + i))
      end
      c:close()
    end)
  end)
end

exact_suite("smollm2", 150)
exact_suite("gemma3", 120)
