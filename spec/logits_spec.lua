-- The Logits userdata: read-only methods, sampling primitives and their
-- error paths. Logits are built with kvlua.logits{...}, so no model is
-- needed; the keep_* primitives are checked against plain-Lua reference
-- implementations of llama.cpp's samplers (full sorts, no shortcuts).

local kvlua = require "kvlua"

local NEG_INF = -math.huge

-- Deterministic test vectors (a small LCG; any fixed generator will do).
local function lcg(seed)
  local s = seed
  return function()
    s = (s * 6364136223846793005 + 1442695040888963407)
    return ((s >> 11) & ((1 << 53) - 1)) / (1 << 53)
  end
end

local function random_vector(n, seed, scale)
  local r = lcg(seed)
  local t = {}
  for i = 1, n do t[i] = (r() * 2 - 1) * (scale or 4) end
  return t
end

-- ---------------------------------------------------------------------------
-- Plain-Lua reference (ids are 0-based; x is the Logits' own values)
-- ---------------------------------------------------------------------------

local function candidates_desc(x)
  local c = {}
  for i, v in ipairs(x) do
    if v > NEG_INF then c[#c + 1] = { id = i - 1, v = v } end
  end
  table.sort(c, function(a, b) return a.v > b.v or (a.v == b.v and a.id < b.id) end)
  return c
end

local function softmax(c)
  local mx = NEG_INF
  for _, e in ipairs(c) do mx = math.max(mx, e.v) end
  local s = 0
  for _, e in ipairs(c) do e.p = math.exp(e.v - mx); s = s + e.p end
  for _, e in ipairs(c) do e.p = e.p / s end
end

local function kept(c, n)
  local set = {}
  for i = 1, n do set[c[i].id] = true end
  return set
end

local ref = {}

function ref.top_k(x, k)
  local c = candidates_desc(x)
  if k <= 0 or k >= #c then return kept(c, #c) end
  return kept(c, k)
end

function ref.top_p(x, p, min_keep)
  local c = candidates_desc(x)
  if p >= 1 then return kept(c, #c) end
  softmax(c)
  local cum = 0
  for i, e in ipairs(c) do
    cum = cum + e.p
    if cum >= p and i >= min_keep then return kept(c, i) end
  end
  return kept(c, #c)
end

function ref.min_p(x, p, min_keep)
  local c = candidates_desc(x)
  if p <= 0 or #c == 0 then return kept(c, #c) end
  local thr = c[1].v + math.log(p)
  local n = 0
  for _, e in ipairs(c) do if e.v >= thr then n = n + 1 end end
  n = math.max(n, min_keep, 1)
  return kept(c, math.min(n, #c))
end

function ref.typical(x, p, min_keep)
  local c = candidates_desc(x)
  if p >= 1 then return kept(c, #c) end
  softmax(c)
  local H = 0
  for _, e in ipairs(c) do if e.p > 0 then H = H - e.p * math.log(e.p) end end
  for _, e in ipairs(c) do e.s = e.p > 0 and math.abs(-math.log(e.p) - H) or math.huge end
  table.sort(c, function(a, b) return a.s < b.s or (a.s == b.s and a.id < b.id) end)
  local cum = 0
  for i, e in ipairs(c) do
    cum = cum + e.p
    if cum > p and (min_keep == 0 or i >= min_keep) then return kept(c, i) end
  end
  return kept(c, #c)
end

-- The set of ids a Logits still has (> -inf), and a check that kept values
-- are unchanged.
local function survivors(l, before)
  local set, t = {}, l:totable()
  for i, v in ipairs(t) do
    if v > NEG_INF then
      set[i - 1] = true
      assert.are.equal(before[i], v)
    end
  end
  return set
end

-- ---------------------------------------------------------------------------

describe("kvlua.logits", function()
  it("builds a single-row Logits from an array", function()
    local l = kvlua.logits{ 1.0, 2.5, -3.0 }
    assert.are.equal(3, l.n)
    assert.are.equal(1, l.rows)
    assert.are.equal(3, #l)
    assert.are.same({ 1.0, 2.5, -3.0 }, l:totable())
    assert.matches("^kvlua%.Logits%(n=3, rows=1%)", tostring(l))
  end)

  it("builds a multi-row Logits from an array of rows", function()
    local l = kvlua.logits{ { 1, 2 }, { 3, 4 }, { 6, 5 } }
    assert.are.equal(2, l.n)
    assert.are.equal(3, l.rows)
    assert.are.same({ { 1, 2 }, { 3, 4 }, { 6, 5 } }, l:totable())
  end)

  it("rejects malformed input", function()
    assert.has_error(function() kvlua.logits{} end)
    assert.has_error(function() kvlua.logits("1 2 3") end)
    assert.has_error(function() kvlua.logits{ 1, "x", 3 } end)
    assert.has_error(function() kvlua.logits{ 1, {}, 3 } end)
    assert.has_error(function() kvlua.logits{ { 1, 2 }, { 3 } } end)
    assert.has_error(function() kvlua.logits{ { 1, 2 }, 3 } end)
    assert.has_error(function() kvlua.logits{ {} } end)
  end)

  it("stores float32 values", function()
    local l = kvlua.logits{ 0.1 }
    assert.are_not.equal(0.1, l:get(0))
    assert.is_true(math.abs(l:get(0) - 0.1) < 1e-7)
  end)
end)

describe("Logits read-only methods", function()
  local l = kvlua.logits{ 1.0, 3.0, 2.0, 3.0, -1.0 }

  it("argmax returns the lowest id among equal maxima", function()
    assert.are.equal(1, l:argmax())
    assert.are.equal(1, kvlua.logits{ 0 / 0, -5, -5 }:argmax())
  end)

  it("topk returns ids and values in descending order, ties by lower id", function()
    local ids, vals = l:topk(3)
    assert.are.same({ 1, 3, 2 }, ids)
    assert.are.same({ 3.0, 3.0, 2.0 }, vals)
    ids = l:topk(10)
    assert.are.same({ 1, 3, 2, 0, 4 }, ids)
    assert.are.same({}, (l:topk(0)))
  end)

  it("topk ranks -inf after finite values and NaN last", function()
    local ids = kvlua.logits{ 0 / 0, NEG_INF, 1, math.huge }:topk(4)
    assert.are.same({ 3, 2, 1, 0 }, ids)
  end)

  it("topk agrees with a full sort on a large vocabulary", function()
    local x = random_vector(65536, 7)
    local big = kvlua.logits(x)
    local c = candidates_desc(big:totable())
    local ids, vals = big:topk(50)
    for i = 1, 50 do
      assert.are.equal(c[i].id, ids[i])
      assert.are.equal(c[i].v, vals[i])
    end
  end)

  it("get returns the value of a 0-based id", function()
    assert.are.equal(1.0, l:get(0))
    assert.are.equal(-1.0, l:get(4))
    assert.are.equal(3.0, l:get(3.0)) -- an integral float is an integer id
  end)

  it("logprob is a stable log-softmax", function()
    local x = random_vector(100, 3, 30)
    local lx = kvlua.logits(x)
    local t = lx:totable()
    local mx = NEG_INF
    for _, v in ipairs(t) do mx = math.max(mx, v) end
    local s = 0
    for _, v in ipairs(t) do s = s + math.exp(v - mx) end
    local lse = mx + math.log(s)
    for id = 0, 99 do
      assert.is_true(math.abs(lx:logprob(id) - (t[id + 1] - lse)) < 1e-12)
    end
    -- huge logits do not overflow
    local h = kvlua.logits{ 1e30, 1e30 }
    assert.is_true(math.abs(h:logprob(0) - math.log(0.5)) < 1e-12)
    -- masked entries have log-probability -inf
    assert.are.equal(NEG_INF, kvlua.logits{ 0, NEG_INF }:logprob(1))
    assert.are.equal(0, kvlua.logits{ 0, NEG_INF }:logprob(0))
  end)

  it("logprob follows writes (the cached logsumexp is invalidated)", function()
    local a = kvlua.logits{ 0, 0 }
    assert.is_true(math.abs(a:logprob(0) - math.log(0.5)) < 1e-12)
    a:set(1, NEG_INF)
    assert.are.equal(0, a:logprob(0))
  end)

  it("row(i) copies one row of a multi-row Logits", function()
    local m = kvlua.logits{ { 1, 2 }, { 5, 4 } }
    local r2 = m:row(2)
    assert.are.equal(1, r2.rows)
    assert.are.same({ 5, 4 }, r2:totable())
    assert.are.equal(0, r2:argmax())
    r2:set(0, -1)
    assert.are.same({ 5, 4 }, m:row(2):totable())
    assert.are.equal(1, m:argmax(1))
    assert.are.equal(4, m:get(1, 2))
    assert.are.equal(m:row(2):logprob(0), m:logprob(0, 2))
  end)

  it("has_nonfinite sees NaN and +inf but not -inf masks", function()
    assert.is_false(l:has_nonfinite())
    assert.is_false(kvlua.logits{ 1, NEG_INF }:has_nonfinite())
    assert.is_true(kvlua.logits{ 1, 0 / 0 }:has_nonfinite())
    assert.is_true(kvlua.logits{ 1, math.huge }:has_nonfinite())
  end)

  it("count gives the number of candidates", function()
    assert.are.equal(5, l:count())
    assert.are.equal(1, kvlua.logits{ 1, NEG_INF }:count())
  end)
end)

describe("Logits misuse raises", function()
  local l = kvlua.logits{ 1, 2, 3 }
  local m = kvlua.logits{ { 1, 2 }, { 3, 4 } }

  it("for out-of-range or non-integer ids", function()
    assert.has_error(function() l:get(3) end, "bad argument #1 to 'get' (token id 3 out of range [0, 3))")
    assert.has_error(function() l:get(-1) end)
    assert.has_error(function() l:get(1.5) end, "bad argument #1 to 'get' (token id must be an integer)")
    assert.has_error(function() l:get("1") end)
    assert.has_error(function() l:get() end)
    assert.has_error(function() l:logprob(3) end)
    assert.has_error(function() l:set(3, 0) end)
    assert.has_error(function() l:set(0, "x") end)
  end)

  it("for bad rows", function()
    assert.has_error(function() m:row(0) end)
    assert.has_error(function() m:row(3) end)
    assert.has_error(function() m:row(1.5) end)
    assert.has_error(function() m:argmax() end)
    assert.has_error(function() m:get(0) end)
    assert.has_error(function() l:get(0, 2) end)
  end)

  it("for in-place methods on a multi-row Logits", function()
    assert.has_error(function() m:set(0, 1) end)
    assert.has_error(function() m:keep_top_k(1) end)
    assert.has_error(function() m:softmax_sample(0.5) end)
  end)

  it("for bad options", function()
    assert.has_error(function() l:topk(-1) end)
    assert.has_error(function() l:topk(1.5) end)
    assert.has_error(function() l:scale(0) end)
    assert.has_error(function() l:scale(-1) end)
    assert.has_error(function() l:scale(math.huge) end)
    assert.has_error(function() l:keep_top_p(0 / 0) end)
    assert.has_error(function() l:keep_top_p(0.5, -1) end)
    assert.has_error(function() l:keep_min_p(0.5, 1.5) end)
    assert.has_error(function() l:softmax_sample(1.0) end)
    assert.has_error(function() l:softmax_sample(-0.1) end)
    assert.has_error(function() l:penalize({ 0, 3 }, 1.1, 0, 0) end)
    assert.has_error(function() l:penalize({ 0, 0.5 }, 1.1, 0, 0) end)
    assert.has_error(function() l:penalize({ 0 }, 0, 0, 0) end)
    assert.has_error(function() l:penalize("0", 1.1, 0, 0) end)
  end)

  it("for a non-Logits self", function()
    assert.has_error(function() l.get({}, 0) end)
    assert.has_error(function() l.argmax(42) end)
  end)
end)

describe("Logits in-place primitives", function()
  it("clone is independent", function()
    local a = kvlua.logits{ 1, 2 }
    local b = a:clone()
    b:set(0, 5)
    assert.are.same({ 1, 2 }, a:totable())
    assert.are.same({ 5, 2 }, b:totable())
  end)

  it("scale multiplies every entry and keeps masks", function()
    local a = kvlua.logits{ 1, -2, NEG_INF }
    assert.are.equal(a, a:scale(2))
    assert.are.same({ 2, -4, NEG_INF }, a:totable())
  end)

  it("penalize follows llama.cpp (divide positives, multiply negatives, then freq and presence)", function()
    local a = kvlua.logits{ 3.0, -1.0, 2.0, 0.0 }
    a:penalize({ 0, 0, 1, 3, 0 }, 1.5, 0.25, 0.5)
    local t = a:totable()
    assert.is_true(math.abs(t[1] - (3.0 / 1.5 - 3 * 0.25 - 0.5)) < 1e-6)
    assert.is_true(math.abs(t[2] - (-1.0 * 1.5 - 1 * 0.25 - 0.5)) < 1e-6)
    assert.are.equal(2.0, t[3])
    assert.is_true(math.abs(t[4] - (0.0 - 0.25 - 0.5)) < 1e-6)
    -- neutral settings change nothing
    local b = kvlua.logits{ 3.0, -1.0 }
    b:penalize({ 0, 1 }, 1.0, 0, 0)
    assert.are.same({ 3.0, -1.0 }, b:totable())
  end)

  it("keep_top_k masks all but the k best (ties by lower id); k <= 0 is a no-op", function()
    local a = kvlua.logits{ 1, 3, 2, 3 }
    a:keep_top_k(2)
    assert.are.same({ NEG_INF, 3, NEG_INF, 3 }, a:totable())
    local b = kvlua.logits{ 1, 3, 2, 3 }
    b:keep_top_k(0)
    assert.are.same({ 1, 3, 2, 3 }, b:totable())
    local c = kvlua.logits{ 2, 2, 2 }
    c:keep_top_k(1)
    assert.are.same({ 2, NEG_INF, NEG_INF }, c:totable())
  end)

  for _, case in ipairs{
    { "keep_top_k", "top_k", { 1, 5, 17, 40 } },
    { "keep_top_p", "top_p", { 0.1, 0.5, 0.9, 0.95, 0.999 } },
    { "keep_min_p", "min_p", { 0.01, 0.05, 0.2, 0.6 } },
    { "keep_typical", "typical", { 0.2, 0.5, 0.9, 0.95 } },
  } do
    local method, refname, params = case[1], case[2], case[3]
    it(method .. " matches the reference on random vectors", function()
      for seed = 1, 25 do
        local n = 8 + (seed * 7) % 57
        local x = random_vector(n, seed, 1 + seed % 6)
        for _, p in ipairs(params) do
          for _, min_keep in ipairs(method == "keep_top_k" and { 1 } or { 0, 1, 3 }) do
            local l = kvlua.logits(x)
            -- a few masks first, as an earlier stage would leave them
            if seed % 3 == 0 then l:set(0, NEG_INF); l:set(n - 1, NEG_INF) end
            local before = l:totable()
            local want = ref[refname](before, p, min_keep)
            local r = l[method](l, p, min_keep)
            assert.are.equal(l, r)
            assert.are.same(want, survivors(l, before))
          end
        end
      end
    end)
  end

  it("keep_* agree with the reference on a large vocabulary", function()
    local x = random_vector(65536, 11, 8)
    local l = kvlua.logits(x)
    local before = l:totable()
    l:keep_top_p(0.9)
    assert.are.same(ref.top_p(before, 0.9, 1), survivors(l, before))
    local l2 = kvlua.logits(x)
    l2:keep_typical(0.9)
    assert.are.same(ref.typical(before, 0.9, 1), survivors(l2, before))
    local l3 = kvlua.logits(x):keep_top_k(40):keep_min_p(0.05)
    local c = l3:count()
    assert.is_true(c >= 1 and c <= 40)
  end)

  it("handle a 262144-entry vocabulary (Gemma 3)", function()
    local l = kvlua.logits(random_vector(262144, 13, 8))
    local ids = l:topk(40)
    local k = l:clone():keep_top_k(40)
    assert.are.equal(40, k:count())
    for _, id in ipairs(ids) do assert.are.equal(l:get(id), k:get(id)) end
    assert.are.equal(ids[1], l:argmax())
    local big = l:clone():keep_top_k(10000)
    assert.are.equal(10000, big:count())
    assert.is_true(l:clone():keep_top_p(0.5):count() >= 1)
  end)

  it("keep_top_p/keep_typical return nil, message on non-finite logits", function()
    local a = kvlua.logits{ 1, 0 / 0 }
    local r, err = a:keep_top_p(0.5)
    assert.is_nil(r)
    assert.are.equal("non-finite logits", err)
    r, err = kvlua.logits{ math.huge, 1 }:keep_typical(0.5)
    assert.is_nil(r)
    assert.are.equal("non-finite logits", err)
  end)

  it("softmax_sample inverts the CDF over candidates in id order", function()
    local p = { 0.5, 0.3, 0.2 }
    local a = kvlua.logits{ math.log(p[1]), math.log(p[2]), math.log(p[3]) }
    assert.are.equal(0, a:softmax_sample(0.0))
    assert.are.equal(0, a:softmax_sample(0.49))
    assert.are.equal(1, a:softmax_sample(0.51))
    assert.are.equal(1, a:softmax_sample(0.79))
    assert.are.equal(2, a:softmax_sample(0.81))
    assert.are.equal(2, a:softmax_sample(0.999999999))
    local b = kvlua.logits{ NEG_INF, 0, NEG_INF }
    assert.are.equal(1, b:softmax_sample(0.0))
    assert.are.equal(1, b:softmax_sample(0.999))
  end)

  it("softmax_sample returns nil, message when there is nothing to sample", function()
    local r, err = kvlua.logits{ 0 / 0, 1 }:softmax_sample(0.5)
    assert.is_nil(r)
    assert.are.equal("non-finite logits", err)
    r, err = kvlua.logits{ NEG_INF, NEG_INF }:softmax_sample(0.5)
    assert.is_nil(r)
    assert.is_string(err)
  end)
end)
