-- kvlua.sampling: chains, determinism, penalties, distribution sanity and
-- error paths. Logits come from kvlua.logits{...}; no model is needed.

local kvlua = require "kvlua"
local sampling = require "kvlua.sampling"

local NEG_INF = -math.huge

local function logits_of_probs(p)
  local t = {}
  for i, v in ipairs(p) do t[i] = math.log(v) end
  return kvlua.logits(t)
end

local function frequencies(s, l, n)
  local c = {}
  for _ = 1, n do
    local id = assert(s:sample(l))
    c[id] = (c[id] or 0) + 1
  end
  for k, v in pairs(c) do c[k] = v / n end
  return c
end

describe("sampling.rng", function()
  it("is xoshiro256** seeded with splitmix64", function()
    -- Reference values from an independent Python implementation of
    -- splitmix64 + xoshiro256** (Vigna's reference C code transcribed):
    -- seed 42 -> first three outputs as signed 64-bit integers.
    local r = sampling.rng(42)
    assert.are.equal(1546998764402558742, r:next())
    assert.are.equal(6990951692964543102, r:next())
    assert.are.equal(-5902157311460992607, r:next())
  end)

  it("gives floats in [0, 1) and the same stream for the same seed", function()
    local a, b = sampling.rng(7), sampling.rng(7)
    for _ = 1, 1000 do
      local x = a:random()
      assert.is_true(x >= 0 and x < 1)
      assert.are.equal(x, b:random())
    end
  end)

  it("rejects a non-integer seed", function()
    assert.has_error(function() sampling.rng(1.5) end)
    assert.has_error(function() sampling.rng("42") end)
  end)
end)

describe("sampling chains", function()
  local l = kvlua.logits{ 1.0, 3.0, 2.0, 0.5 }

  it("greedy picks the argmax", function()
    assert.are.equal(1, sampling.greedy():sample(l))
    assert.are.equal(1, sampling.chain{ sampling.greedy() }:sample(l))
    assert.are.equal(1, sampling.chain{}:sample(l)) -- no selector: greedy
  end)

  it("temperature 0 is greedy, even before dist", function()
    local s = sampling.chain{ sampling.temperature(0), sampling.dist{ seed = 1 } }
    for _ = 1, 50 do assert.are.equal(1, s:sample(l)) end
    assert.are.equal(1, sampling.from_opts{ temp = 0 }:sample(l))
  end)

  it("never modifies the Logits passed in", function()
    local before = l:totable()
    local s = sampling.chain{
      sampling.penalties{ last_n = 8, repeat_ = 1.5, freq = 0.1, presence = 0.2 },
      sampling.top_k(2), sampling.top_p(0.5), sampling.min_p(0.1), sampling.typical(0.9),
      sampling.temperature(0.7), sampling.dist{ seed = 3 },
    }
    s:accept(1); s:accept(2)
    for _ = 1, 10 do s:sample(l) end
    assert.are.same(before, l:totable())
  end)

  it("is deterministic for a seed, and seeds differ", function()
    local function run(seed)
      local s = sampling.from_opts{ seed = seed, top_k = 0, top_p = 1.0, min_p = 0, temp = 1.5 }
      local flat = kvlua.logits{ 0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7 }
      local out = {}
      for i = 1, 64 do out[i] = s:sample(flat) end
      return table.concat(out, ",")
    end
    assert.are.equal(run(42), run(42))
    assert.are_not.equal(run(42), run(43))
  end)

  it("reset restarts the random stream and clears history", function()
    local s = sampling.chain{ sampling.penalties{ repeat_ = 100 }, sampling.dist(5) }
    local flat = kvlua.logits{ 0, 0, 0, 0 }
    local a = {}
    for i = 1, 20 do a[i] = s:sample(flat) end
    s:accept(0)
    s:reset()
    local b = {}
    for i = 1, 20 do b[i] = s:sample(flat) end
    assert.are.same(a, b)
  end)

  it("applies stages in the order written", function()
    local x = kvlua.logits{ 2.0, 1.9 }
    local pen_first = sampling.chain{ sampling.penalties{ repeat_ = 2.0 }, sampling.top_k(1), sampling.dist(1) }
    local topk_first = sampling.chain{ sampling.top_k(1), sampling.penalties{ repeat_ = 2.0 }, sampling.dist(1) }
    pen_first:accept(0)
    topk_first:accept(0)
    assert.are.equal(1, pen_first:sample(x))  -- 2.0 / 2 = 1.0 < 1.9
    assert.are.equal(0, topk_first:sample(x)) -- only id 0 survives top_k
  end)

  it("samples a known distribution with the right frequencies", function()
    local p = { 0.5, 0.3, 0.15, 0.05 }
    local f = frequencies(sampling.chain{ sampling.dist{ seed = 123 } }, logits_of_probs(p), 40000)
    for id = 0, 3 do
      assert.is_true(math.abs((f[id] or 0) - p[id + 1]) < 0.015,
        ("id %d: %.4f vs %.4f"):format(id, f[id] or 0, p[id + 1]))
    end
  end)

  it("renormalizes over what top_k / top_p leave", function()
    local p = { 0.5, 0.3, 0.15, 0.05 }
    local f = frequencies(sampling.chain{ sampling.top_k(2), sampling.dist{ seed = 9 } }, logits_of_probs(p), 40000)
    assert.is_nil(f[2]); assert.is_nil(f[3])
    assert.is_true(math.abs(f[0] - 0.625) < 0.015)
    -- top_p 0.8: 0.5 + 0.3 reaches 0.8, so ids 0 and 1 only
    f = frequencies(sampling.chain{ sampling.top_p(0.8), sampling.dist{ seed = 9 } }, logits_of_probs(p), 20000)
    assert.is_nil(f[2]); assert.is_nil(f[3])
  end)

  it("temperature sharpens and flattens", function()
    local p = { 0.6, 0.4 }
    local cold = frequencies(sampling.chain{ sampling.temperature(0.5), sampling.dist(1) }, logits_of_probs(p), 20000)
    local hot = frequencies(sampling.chain{ sampling.temperature(2.0), sampling.dist(1) }, logits_of_probs(p), 20000)
    -- p^(1/T) renormalized: T=0.5 -> 0.36/0.52 = 0.692; T=2 -> 0.7746/1.407 = 0.5505
    assert.is_true(math.abs(cold[0] - 0.6923) < 0.015)
    assert.is_true(math.abs(hot[0] - 0.5505) < 0.015)
  end)

  it("penalties use the last last_n accepted ids", function()
    local x = kvlua.logits{ 1.0, 0.9 }
    local s = sampling.chain{ sampling.penalties{ last_n = 2, repeat_ = 2.0 }, sampling.greedy() }
    assert.are.equal(0, s:sample(x))
    s:accept(0)
    assert.are.equal(1, s:sample(x)) -- 1.0 / 2 < 0.9
    s:accept(1); s:accept(1)         -- id 0 falls out of the window
    assert.are.equal(0, s:sample(x))
    -- frequency and presence alone (repeat 1.0)
    local f = sampling.chain{ sampling.penalties{ freq = 0.04, presence = 0.05 }, sampling.greedy() }
    f:accept(0)
    assert.are.equal(0, f:sample(x)) -- 1.0 - 0.04 - 0.05 = 0.91 > 0.9
    f:accept(0)
    assert.are.equal(1, f:sample(x)) -- 1.0 - 0.08 - 0.05 = 0.87 < 0.9
  end)

  it("accepts plain functions as stages", function()
    local s = sampling.chain{ function(x) x:set(1, NEG_INF) end, sampling.greedy() }
    assert.are.equal(2, s:sample(l))
    local pick = sampling.chain{ function() return 3 end }
    assert.are.equal(3, pick:sample(l))
    local bad = sampling.chain{ function() return 99 end }
    local id, err = bad:sample(l)
    assert.is_nil(id)
    assert.is_string(err)
  end)

  it("from_opts builds llama.cpp's order", function()
    assert.are.equal("sampling.chain{penalties, top_k, typical, top_p, min_p, temperature, dist}",
      tostring(sampling.from_opts{ seed = 1 }))
    assert.are.equal("sampling.chain{penalties, greedy}", tostring(sampling.from_opts{ temp = 0 }))
  end)
end)

describe("sampling with bad logits", function()
  it("returns nil, 'non-finite logits' on NaN or +inf", function()
    for _, s in ipairs{ sampling.greedy(), sampling.from_opts{ seed = 1 }, sampling.chain{ sampling.dist(1) } } do
      local id, err = s:sample(kvlua.logits{ 1, 0 / 0, 2 })
      assert.is_nil(id)
      assert.are.equal("non-finite logits", err)
      id, err = s:sample(kvlua.logits{ 1, math.huge })
      assert.is_nil(id)
      assert.are.equal("non-finite logits", err)
    end
  end)

  it("samples fine around -inf masks", function()
    local s = sampling.chain{ sampling.dist(1) }
    for _ = 1, 20 do assert.are.equal(2, s:sample(kvlua.logits{ NEG_INF, NEG_INF, 0 })) end
  end)
end)

describe("sampling misuse raises", function()
  it("for wrong option types and ranges", function()
    assert.has_error(function() sampling.top_k(1.5) end)
    assert.has_error(function() sampling.top_k("40") end)
    assert.has_error(function() sampling.top_p("x") end)
    assert.has_error(function() sampling.top_p(1.5) end)
    assert.has_error(function() sampling.top_p(0.5, -1) end)
    assert.has_error(function() sampling.min_p(-0.1) end)
    assert.has_error(function() sampling.typical(0 / 0) end)
    assert.has_error(function() sampling.temperature(-1) end)
    assert.has_error(function() sampling.dist{ seed = 1.5 } end)
    assert.has_error(function() sampling.penalties{ repeat_ = 0 } end)
    assert.has_error(function() sampling.penalties{ last_n = "64" } end)
    assert.has_error(function() sampling.penalties("x") end)
    assert.has_error(function() sampling.chain{ 42 } end)
    assert.has_error(function() sampling.chain(42) end)
    assert.has_error(function() sampling.from_opts{ temp = "hot" } end)
  end)

  it("for a non-Logits or a multi-row Logits", function()
    local s = sampling.greedy()
    assert.has_error(function() s:sample("x") end)
    assert.has_error(function() s:sample({}) end)
    assert.has_error(function() s:sample(kvlua.logits{ { 1, 2 }, { 3, 4 } }) end)
  end)

  it("for a bad accepted id", function()
    local s = sampling.from_opts{}
    assert.has_error(function() s:accept(-1) end)
    assert.has_error(function() s:accept(1.5) end)
    assert.has_error(function() s:accept("1") end)
  end)
end)
