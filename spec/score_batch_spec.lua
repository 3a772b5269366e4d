-- kvlua.prefill_batch(sessions, id_arrays, {logits =}): s:prefill of many
-- sessions with the rows of several sessions in each forward pass (scoring
-- the choices of many items at once). Findings, one describe each:
--   1. Batch invariance: every session's logits (all rows, the last row,
--      none then the next decode) are the bits of its own s:prefill on a
--      fork of the same state, for sessions longer than a pass, passes
--      holding many sessions, prefix reuse from a cache, and real models
--      (quantized weights; gemma3's sliding-window layers).
--   2. The guards of decode_batch: a session twice, a closed one, another
--      model's, an entry that is not a session, empty or bad ids raise;
--      context full is nil, message before anything moved.
--   3. All or nothing: a cache that fills midway gives nil, "cache full"
--      and every session is back at its position; evaluating again gives
--      a cold session's bits.
--   4. A policy cannot act on the batch: a policy calling prefill_batch, or
--      rewinding a session of the batch, raises in the caller and nothing
--      moved.
--   (1 also on OpenCL, where a device is present.)
--   5. scripts/bench-score.lua: its figures are there and consistent (no
--      timing is asserted); the llama.cpp side is left out here.
local kvlua = require "kvlua"
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"
local some = require("spec.support.ids").some
-- true when two Logits hold the same bits (every row of several)
local function same(a, b)
  if a.n ~= b.n or a.rows ~= b.rows then return false end
  local ta, tb = a:totable(), b:totable()
  if a.rows == 1 then ta, tb = { ta }, { tb } end
  for r = 1, a.rows do
    for i = 1, a.n do
      if ta[r][i] ~= tb[r][i] then return false end
    end
  end
  return true
end

-- Each choice on a fork of ctx_s (or of ctx_s[i], a table of sessions),
-- prefilled alone (the reference), then the same choices on other forks
-- through one prefill_batch; compares them.
local function check_against_alone(ctx_s, choices, mode)
  local alone, forks = {}, {}
  for i, ids in ipairs(choices) do
    local base = type(ctx_s) == "table" and ctx_s[i] or ctx_s
    local f = assert(base:fork())
    alone[i] = { r = assert(f:prefill(ids, { logits = mode })), pos = f.pos, last = mode ~= "none" and f:logits() }
    if mode == "none" then alone[i].next = assert(f:decode(5)) end
    f:close()
    forks[i] = assert(base:fork())
  end
  local out = assert(kvlua.prefill_batch(forks, choices, { logits = mode }))
  assert.equals(#choices, #out)
  for i, f in ipairs(forks) do
    assert.equals(alone[i].pos, f.pos, "pos of session " .. i)
    if mode == "none" then
      assert.is_true(out[i])
      assert.is_true(same(alone[i].next, assert(f:decode(5))), "next decode of session " .. i)
    else
      assert.is_true(same(alone[i].r, out[i]), "logits of session " .. i)
      assert.is_true(same(alone[i].last, f:logits()), "s:logits() of session " .. i)
    end
    f:close()
  end
end

-- Choices of the given lengths (distinct ids for each).
local function choices_of(lengths, n_vocab)
  local cs = {}
  for i, n in ipairs(lengths) do cs[i] = some(n, n_vocab, 100 + i) end
  return cs
end

describe("prefill_batch: each session's rows are the bits of its own prefill", function()
  local m
  setup(function() m = assert(kvlua.load(tiny.llama { seed = 41 }, { threads = 2 })) end)
  teardown(function() m:close() end)

  it("logits = all: short choices (many sessions a pass) and long ones (a session across passes)", function()
    local c = assert(kvlua.cache(m, { pages = 256 }))
    local s = assert(m:session { ctx = 512, cache = c })
    assert(s:prefill(some(37, m.info.n_vocab, 7)))
    -- 1..4 tokens for 40 sessions (several to a pass), then 200 and 130 (longer than a pass of 128)
    local lengths = {}
    for i = 1, 40 do lengths[i] = 1 + i % 4 end
    lengths[#lengths + 1], lengths[#lengths + 2], lengths[#lengths + 3] = 200, 3, 130
    check_against_alone(s, choices_of(lengths, m.info.n_vocab), "all")
  end)

  it("sessions at different positions in one pass (each row at its own position)", function()
    local c = assert(kvlua.cache(m, { pages = 256 }))
    local bases, lengths = {}, {}
    for i = 1, 12 do
      bases[i] = assert(m:session { ctx = 256, cache = i % 3 == 0 and c or nil })
      assert(bases[i]:prefill(some(3 + 7 * i, m.info.n_vocab, 60 + i)))
      lengths[i] = 1 + (i * 5) % 13
    end
    lengths[5] = 140
    check_against_alone(bases, choices_of(lengths, m.info.n_vocab), "all")
    check_against_alone(bases, choices_of(lengths, m.info.n_vocab), "last")
  end)

  it("logits = last and none, sessions in private pools and a shared cache", function()
    local c = assert(kvlua.cache(m, { pages = 256 }))
    for _, shared in ipairs { true, false } do
      local s = assert(m:session { ctx = 512, cache = shared and c or nil })
      assert(s:prefill(some(21, m.info.n_vocab, 9)))
      for _, mode in ipairs { "last", "none" } do
        check_against_alone(s, choices_of({ 1, 9, 150, 2, 40 }, m.info.n_vocab), mode)
      end
      s:close()
    end
  end)

  it("with logits = last, cached prefixes are reused as s:prefill reuses them (same bits, same counts)", function()
    local c = assert(kvlua.cache(m, { pages = 256, page_tokens = 16 }))
    local prefix = some(64, m.info.n_vocab, 3)
    local warm = assert(m:session { ctx = 256, cache = c })
    assert(warm:prefill(prefix, { logits = "none" }))
    local seqs, alone = {}, {}
    for i = 1, 5 do
      seqs[i] = table.move(some(3 * i, m.info.n_vocab, 50 + i), 1, 3 * i, 65, table.move(prefix, 1, 64, 1, {}))
      local s = assert(m:session { ctx = 256 }) -- cold, private: the reference
      alone[i] = assert(s:prefill(seqs[i]))
      s:close()
    end
    local ss = {}
    for i = 1, 5 do ss[i] = assert(m:session { ctx = 256, cache = c }) end
    local out = assert(kvlua.prefill_batch(ss, seqs))
    for i = 1, 5 do
      assert.is_true(same(alone[i], out[i]), "session " .. i)
      assert.equals(#seqs[i], ss[i].pos)
      local st = ss[i]:stats()
      assert.equals(64, st.reused_tokens, "reused tokens of session " .. i)
      assert.equals(#seqs[i], st.prefill_tokens)
    end
  end)

  it("real models: SmolLM2 (quantized weights) and gemma3 (sliding-window layers)", function()
    local any = false
    for _, name in ipairs { "smollm2", "gemma3" } do
      local p = models.path(name)
      if p then
        any = true
        local rm = assert(kvlua.load(p, { threads = 2 }))
        local c = assert(kvlua.cache(rm, { pages = 512 }))
        local s = assert(rm:session { ctx = 1024, cache = c })
        assert(s:prefill(some(300, rm.info.n_vocab, 11))) -- past gemma3's 512-token window with the choices
        check_against_alone(s, choices_of({ 3, 1, 5, 2, 230, 4, 2, 6 }, rm.info.n_vocab), "all")
        s:close()
        rm:close()
      end
    end
    if not any then pending("no real model available") end
  end)
end)

describe("prefill_batch on OpenCL: the same bits as each session's prefill there", function()
  it("sessions at different positions, one across passes; all and last", function()
    if #kvlua.devices() == 0 then return pending("no OpenCL device") end
    -- head size 16: the smallest the OpenCL backend takes for f16 pages
    local m = assert(kvlua.load(tiny.llama { seed = 47, n_embd = 64, n_ff = 128 }, { backend = "opencl", threads = 2 }))
    local bases, lengths = {}, {}
    for i = 1, 10 do
      bases[i] = assert(m:session { ctx = 512 })
      assert(bases[i]:prefill(some(5 + 9 * i, m.info.n_vocab, i)))
      lengths[i] = i == 4 and 150 or 1 + i % 4
    end
    check_against_alone(bases, choices_of(lengths, m.info.n_vocab), "all")
    check_against_alone(bases, choices_of(lengths, m.info.n_vocab), "last")
    for _, b in ipairs(bases) do b:close() end
    m:close()
  end)
end)

describe("prefill_batch: the guards of decode_batch", function()
  local m, m2
  setup(function()
    m = assert(kvlua.load(tiny.llama { seed = 42 }, { threads = 1 }))
    m2 = assert(kvlua.load(tiny.llama { seed = 43 }, { threads = 1 }))
  end)
  teardown(function() m:close(); m2:close() end)

  it("misuse raises before anything is evaluated", function()
    local a, b = assert(m:session { ctx = 64 }), assert(m:session { ctx = 64 })
    local o = assert(m2:session { ctx = 64 })
    local closed = assert(m:session { ctx = 64 })
    closed:close()
    local function raises(pat, ss, ids, opts)
      assert.error_matches(function() kvlua.prefill_batch(ss, ids, opts) end, pat)
      assert.equals(0, a.pos)
      assert.equals(0, b.pos)
    end
    raises("appears twice", { a, a }, { { 5 }, { 6 } })
    raises("closed session", { a, closed }, { { 5 }, { 6 } })
    raises("another model", { a, o }, { { 5 }, { 6 } })
    raises("not a session", { a, {} }, { { 5 }, { 6 } })
    raises("empty token list", { a, b }, { { 5 }, {} })
    raises("out of range", { a, b }, { { 5 }, { m.info.n_vocab } })
    raises("one array of token ids per session", { a, b }, { { 5 } })
    raises("between 1 and 4096", {}, {})
    raises("option 'logits'", { a }, { { 5 } }, { logits = "some" })
  end)

  it("context full: nil, message, and no session moved", function()
    local a, b = assert(m:session { ctx = 64 }), assert(m:session { ctx = 16 })
    local r, err = kvlua.prefill_batch({ a, b }, { some(10, m.info.n_vocab, 1), some(17, m.info.n_vocab, 2) })
    assert.is_nil(r)
    assert.matches("session 2: context full", err)
    assert.equals(0, a.pos)
    assert.equals(0, b.pos)
  end)
end)

describe("prefill_batch: all or nothing when the cache fills midway", function()
  it("nil, cache full; every session back at its position; a retry gives a cold session's bits", function()
    local m = assert(kvlua.load(tiny.llama { seed = 44 }, { threads = 1 }))
    local c = assert(kvlua.cache(m, { pages = 4, page_tokens = 16 }))
    local a, b = assert(m:session { ctx = 128, cache = c }), assert(m:session { ctx = 128, cache = c })
    assert(a:prefill(some(5, m.info.n_vocab, 1)))
    local ids_a, ids_b = some(40, m.info.n_vocab, 2), some(40, m.info.n_vocab, 3) -- 3 + 3 pages > 4
    local r, err = kvlua.prefill_batch({ a, b }, { ids_a, ids_b }, { logits = "all" })
    assert.is_nil(r)
    assert.matches("cache full", err)
    assert.equals(5, a.pos)
    assert.equals(0, b.pos)
    b:close()
    local out = assert(kvlua.prefill_batch({ a }, { ids_a }, { logits = "all" }))
    local cold = assert(m:session { ctx = 128 })
    assert(cold:prefill(some(5, m.info.n_vocab, 1)))
    assert.is_true(same(assert(cold:prefill(ids_a, { logits = "all" })), out[1]))
    m:close()
  end)
end)

describe("prefill_batch: a policy cannot act on the batch", function()
  it("a policy calling prefill_batch or rewinding a session of the batch raises; nothing moved", function()
    local m = assert(kvlua.load(tiny.llama { seed = 45 }, { threads = 1 }))
    local action
    local a, b
    local c = assert(kvlua.cache(m, { pages = 4, page_tokens = 16, policy = function(cands, need)
      if action == "batch" then kvlua.prefill_batch({ b }, { { 5 } }) end
      if action == "rewind" then a:rewind(1) end
      return { cands[1] }
    end }))
    local filler = assert(m:session { ctx = 128, cache = c })
    assert(filler:prefill(some(64, m.info.n_vocab, 9), { logits = "none" })) -- 4 sealed pages, then cached
    filler:close()
    for _, act in ipairs { "batch", "rewind" } do
      action = act
      a, b = assert(m:session { ctx = 128, cache = c }), assert(m:session { ctx = 128, cache = c })
      assert.error_matches(function()
        kvlua.prefill_batch({ a, b }, { some(3, m.info.n_vocab, 1), some(3, m.info.n_vocab, 2) })
      end, "cache policy failed")
      assert.equals(0, a.pos, act)
      assert.equals(0, b.pos, act)
      a:close(); b:close()
    end
    m:close()
  end)
end)

describe("scripts/bench-score.lua", function()
  local S = require "spec.support.scripts"
  it("--json: mc-eval's figures on generated few-shot items, the prefill rate and their ratio", function()
    local path = tiny.llama { seed = 46 }
    local r = S.run("bench-score.lua", { "--model", path, "--threads", "1", "--items", "6", "--shots", "3",
      "--batch", "4", "--prefill", "32", "--llama", "off", "--json" })
    S.assert_ok(r)
    local j = S.json_decode(r.out)
    local k = j.kvlua
    assert.equals(6, j.items)
    assert.is_true(k.correct >= 0 and k.correct <= 6 and k.correct_norm <= 6)
    -- the shared prefix is computed once: fewer tokens than one evaluation per context+choice
    assert.is_true(k.computed_tokens > 0 and k.computed_tokens < k.naive_tokens)
    assert.near(k.computed_tokens / k.engine_seconds, k.computed_tok_s, 1e-6 * k.computed_tok_s)
    assert.near(k.computed_tok_s / ((j.prefill_before + j.prefill_after) / 2), k.of_prefill, 1e-9)
    assert.near(6 / k.wall_seconds, k.items_per_s, 1e-6 * k.items_per_s)
    assert.equals(S.json_null, j.llama)
    tiny.cleanup()
  end)
end)
