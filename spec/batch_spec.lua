-- kvlua.decode_batch(sessions, ids): one forward pass for the next token of
-- many sessions (the weights read once per step, attention per session
-- through its own pages). Each Logits is the same bits a s:decode(id) of
-- that session would give.
local kvlua = require "kvlua"
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"

local same = require("spec.support.ids").same -- the same bits

local function prompt(i, n_vocab)
  local p = {}
  for k = 1, 5 + 3 * i do p[k] = 3 + (i * 37 + k * 11) % (n_vocab - 3) end
  return p
end

local function check_model(m, n)
  local ss, ids, single = {}, {}, {}
  local c = assert(kvlua.cache(m, { pages = 64 * n }))
  for i = 1, n do
    ss[i] = assert(m:session { ctx = 256, cache = i % 2 == 0 and c or nil }) -- shared and private pools
    ids[i] = assert(ss[i]:prefill(prompt(i, m.info.n_vocab))):argmax()
  end
  for i = 1, n do single[i] = assert(ss[i]:fork():decode(ids[i])) end
  local out = assert(kvlua.decode_batch(ss, ids))
  for i = 1, n do
    assert.is_true(same(single[i], out[i]), "session " .. i)
    assert.equals(#prompt(i, m.info.n_vocab) + 1, ss[i].pos)
    assert.is_true(same(out[i], ss[i]:logits()))
  end
  -- and on: each step the same as decoding alone
  for _ = 1, 3 do
    local nxt = {}
    for i = 1, n do nxt[i] = out[i]:argmax() end
    for i = 1, n do single[i] = assert(ss[i]:fork():decode(nxt[i])) end
    out = assert(kvlua.decode_batch(ss, nxt))
    for i = 1, n do assert.is_true(same(single[i], out[i]), "session " .. i) end
  end
end

describe("kvlua.decode_batch", function()
  local m
  setup(function() m = assert(kvlua.load(tiny.llama { seed = 31 }, { threads = 2 })) end)
  teardown(function() m:close() end)

  it("gives each session the bits of its own decode (sessions of different lengths, shared and private pools)", function()
    check_model(m, 6)
  end)

  it("batches of changing sizes (the model reuses its logits buffer), and a batch from a finalizer midway", function()
    local ss, ids = {}, {}
    for i = 1, 5 do
      ss[i] = assert(m:session { ctx = 64 })
      ids[i] = assert(ss[i]:prefill(prompt(i, m.info.n_vocab))):argmax()
    end
    for _, n in ipairs { 5, 2, 4, 1, 5 } do
      local group, feed, single = {}, {}, {}
      for i = 1, n do group[i], feed[i] = ss[i], ids[i] end
      for i = 1, n do single[i] = assert(ss[i]:fork():decode(feed[i])) end
      local out = assert(kvlua.decode_batch(group, feed))
      assert.equals(n, #out)
      for i = 1, n do
        assert.is_true(same(single[i], out[i]), "batch of " .. n .. ", session " .. i)
        ids[i] = out[i]:argmax()
      end
    end
    -- objects whose finalizers decode a batch of their own, collected while
    -- decode_batch allocates its Logits: each call keeps its own logits
    local side = { assert(m:session { ctx = 64 }), assert(m:session { ctx = 64 }) }
    local side_ok = 0
    for _ = 1, 50 do
      setmetatable({}, { __gc = function()
        local r = kvlua.decode_batch(side, { 7, 8 })
        if r and #r == 2 then side_ok = side_ok + 1 end
        for _, s in ipairs(side) do s:rewind(1) end
      end })
    end
    local feed, single = {}, {}
    for i = 1, 5 do feed[i] = ids[i] end
    for i = 1, 5 do single[i] = assert(ss[i]:fork():decode(feed[i])) end
    collectgarbage("step", 0)
    local out = assert(kvlua.decode_batch(ss, feed))
    collectgarbage()
    for i = 1, 5 do assert.is_true(same(single[i], out[i]), "session " .. i .. " with finalizers") end
    assert.equals(50, side_ok)
  end)

  it("kvlua.clock: monotonic seconds, the clock stats() times with", function()
    local s = assert(m:session { ctx = 16 })
    local t0 = kvlua.clock()
    assert(s:prefill { 1, 2, 3 })
    assert(s:decode(4))
    local t1 = kvlua.clock()
    assert.is_true(t1 >= t0)
    assert.is_true(s:stats().itl[1] <= t1 - t0)
  end)

  it("misuse raises: not a session, a session twice, ids that do not match, another model", function()
    local a, b = assert(m:session { ctx = 16 }), assert(m:session { ctx = 16 })
    local other = assert(kvlua.load(tiny.llama { seed = 32 }, { threads = 1 }))
    local o = assert(other:session { ctx = 16 })
    assert.has_error(function() kvlua.decode_batch({ a, {} }, { 1, 2 }) end)
    assert.has_error(function() kvlua.decode_batch({ a, a }, { 1, 2 }) end)
    assert.has_error(function() kvlua.decode_batch({ a, b }, { 1 }) end)
    assert.has_error(function() kvlua.decode_batch({ a, b }, { 1, 1 << 40 }) end)
    assert.has_error(function() kvlua.decode_batch({ a, o }, { 1, 2 }) end)
    assert.has_error(function() kvlua.decode_batch({}, {}) end)
    other:close()
  end)

  it("a full session: nil, message, and no session moves", function()
    local a, b = assert(m:session { ctx = 16 }), assert(m:session { ctx = 4 })
    assert(b:prefill({ 1, 2, 3, 4 }))
    local r, err = kvlua.decode_batch({ a, b }, { 5, 6 })
    assert.is_nil(r)
    assert.matches("context full", err)
    assert.equals(0, a.pos)
    assert.equals(4, b.pos)
  end)

  it("on SmolLM2: the same bits as one decode each", function()
    local p = models.path("smollm2")
    if not p then return pending("smollm2 not available") end
    local real = assert(kvlua.load(p))
    check_model(real, 8)
    real:close()
  end)
end)
