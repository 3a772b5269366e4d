-- Sessions: one token sequence over a model, with its own KV cache.
--
--   local s = model:session{ ctx = 256 }
--   local l = s:prefill(ids)                    -- Logits of the last position
--   local all = s:prefill(ids, {logits="all"})  -- one row per position
--   l = s:decode(id)                            -- one more token
--   s.pos, s:tokens(), s:rewind(n), s:stats(), s:close()
--
-- Misuse (wrong types, ids out of range, a closed session) raises; a
-- failure of the world (context full, NaN logits from a corrupted model, a
-- file the engine cannot run) returns nil, message and leaves the session
-- as it was. Most examples run on tiny random-weight llama models written
-- to temporary files; a few on the real SmolLM2 (pending when unavailable).
local kvlua = require "kvlua"
local W = require "spec.support.gguf_writer"
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"

-- ==== helpers ================================================================

-- Largest |a[i] - b[i]| over two single-row Logits of the same size.
local function max_diff(a, b)
  assert.equals(a.n, b.n)
  local ta, tb = a:totable(), b:totable()
  local d = 0
  for i = 1, #ta do d = math.max(d, math.abs(ta[i] - tb[i])) end
  return d
end

local function assert_close(a, b, tol, what)
  local d = max_diff(a, b)
  assert(d <= tol, string.format("%s: logits differ by %.3g (tolerance %g)", what or "logits", d, tol))
end

-- Deterministic token ids in [3, n) (no specials).
local some_ids = require("spec.support.ids").some

local function copy(t) return table.move(t, 1, #t, 1, {}) end

-- Prefill and decode take different code paths for the same tokens (a
-- multi-token matrix tile versus a one-row dot; attention blocked over
-- several query rows versus one): the integer sums of the quantized dot
-- products are the same but the float accumulation order is not. A
-- last-bit difference can flip the 8-bit rounding of an activation, and in
-- a deep quantized model that grows to the model's own quantization noise
-- (measured on SmolLM2 Q4_1: RMS 0.1-0.6 over the vocabulary, the size of
-- llama.cpp's own distance from an exact float64 pass). Float (F32) models
-- are held to 1e-3 above; quantized ones to that noise, plus the same
-- choice wherever the choice is clear.
local QUANT_TOL = 2e-2 -- one-layer tiny models
local REAL_RMS = 1.0
local CLEAR_MARGIN = 0.6

local function rms_diff(a, b)
  local ta, tb = a:totable(), b:totable()
  local sq = 0
  for i = 1, #ta do sq = sq + (ta[i] - tb[i]) ^ 2 end
  return math.sqrt(sq / #ta)
end

local path -- the default tiny model: 2 layers, 64 tokens, n_ctx_train 512
local model

setup(function()
  path = tiny.llama{ seed = 3 }
  model = assert(kvlua.load(path, { threads = 1 }))
end)

teardown(function()
  if model then model:close() end
  tiny.cleanup()
end)

-- ==== prefill and decode =====================================================

describe("s:prefill(ids)", function()
  it("returns the Logits of the last position, one score per vocabulary entry", function()
    local s = assert(model:session { ctx = 64 })
    local l = assert(s:prefill({ 1, 5, 6, 7 }))
    assert.equals(model.info.n_vocab, l.n)
    assert.equals(1, l.rows)
    assert.equals(4, s.pos)
    s:close()
  end)

  it("with logits = \"all\" returns one row per token; the last row is the \"last\" logits", function()
    local ids = some_ids(20, 64, 1)
    local s1 = assert(model:session { ctx = 64 })
    local s2 = assert(model:session { ctx = 64 })
    local all = assert(s1:prefill(ids, { logits = "all" }))
    local last = assert(s2:prefill(ids))
    assert.equals(#ids, all.rows)
    assert.equals(model.info.n_vocab, all.n)
    assert.same(last:totable(), all:row(#ids):totable())
    s1:close()
    s2:close()
  end)

  it("in one call equals the same tokens decoded one at a time (within 1e-3)", function()
    local ids = some_ids(40, 64, 2)
    local a = assert(model:session { ctx = 64 })
    local b = assert(model:session { ctx = 64 })
    local all = assert(a:prefill(ids, { logits = "all" }))
    for i, id in ipairs(ids) do
      local l = assert(b:decode(id))
      assert_close(all:row(i), l, 1e-3, "position " .. i)
    end
    assert.same(a:tokens(), b:tokens())
    a:close()
    b:close()
  end)

  it("is chunked internally: 300 tokens in one call equal 300 decodes", function()
    local ids = some_ids(300, 64, 3)
    local a = assert(model:session { ctx = 320 })
    local b = assert(model:session { ctx = 320 })
    local all = assert(a:prefill(ids, { logits = "all" }))
    assert.equals(300, all.rows)
    for i, id in ipairs(ids) do
      local l = assert(b:decode(id))
      if i % 37 == 0 or i == 1 or i == 128 or i == 129 or i == 300 then
        assert_close(all:row(i), l, 1e-3, "position " .. i)
      end
    end
    a:close()
    b:close()
  end)

  for _, q in ipairs { "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1" } do
    it("on a " .. q .. " model too: 40 tokens in one call equal 40 decodes (kernel rounding only)", function()
      -- quantized matrices take other kernels for many tokens than for one
      local m = assert(kvlua.load(tiny.llama_quant {
        qtype = q, seed = 3, n_layer = 1, n_embd = 192, n_head = 3, n_head_kv = 1, n_ff = 128,
      }, { threads = 2 }))
      local ids = {}
      for i = 1, 40 do ids[i] = 3 + (i * 7) % 60 end
      local a = assert(m:session { ctx = 64 })
      local b = assert(m:session { ctx = 64 })
      local all = assert(a:prefill(ids, { logits = "all" }))
      for i, id in ipairs(ids) do
        assert_close(all:row(i), assert(b:decode(id)), QUANT_TOL, q .. " position " .. i)
      end
      a:close()
      b:close()
      m:close()
    end)
  end

  it("continues a session: prefill after prefill equals one prefill of both", function()
    local ids = some_ids(30, 64, 4)
    local a = assert(model:session { ctx = 64 })
    local b = assert(model:session { ctx = 64 })
    a:prefill(table.move(ids, 1, 10, 1, {}))
    local la = assert(a:prefill(table.move(ids, 11, 30, 1, {})))
    local lb = assert(b:prefill(ids))
    assert_close(la, lb, 1e-3)
    assert.equals(30, a.pos)
    a:close()
    b:close()
  end)
end)

describe("s.pos and s:tokens()", function()
  it("track every prefilled and decoded token, in order", function()
    local s = assert(model:session { ctx = 64 })
    assert.equals(0, s.pos)
    assert.same({}, s:tokens())
    s:prefill({ 1, 10, 11 })
    s:decode(12)
    s:prefill({ 13, 14 }, { logits = "all" })
    s:decode(15)
    assert.equals(7, s.pos)
    assert.same({ 1, 10, 11, 12, 13, 14, 15 }, s:tokens())
  end)

  it("s.pos is read-only", function()
    local s = assert(model:session { ctx = 64 })
    assert.has_error(function() s.pos = 3 end)
  end)
end)

describe("s:rewind(n)", function()
  it("drops the last n tokens; decoding them again gives the same logits", function()
    local s = assert(model:session { ctx = 64 })
    s:prefill({ 1, 20, 21, 22 })
    local before = {}
    for i, id in ipairs({ 30, 31, 32 }) do before[i] = assert(s:decode(id)):totable() end
    assert.equals(7, s.pos)
    s:rewind(3)
    assert.equals(4, s.pos)
    assert.same({ 1, 20, 21, 22 }, s:tokens())
    for i, id in ipairs({ 30, 31, 32 }) do
      local again = assert(s:decode(id)):totable()
      for k = 1, #again do
        assert(math.abs(again[k] - before[i][k]) <= 1e-5, "decode " .. i .. " after rewind differs")
      end
    end
  end)

  it("rewinding to 0 and prefilling again equals a fresh session", function()
    local ids = some_ids(12, 64, 5)
    local s = assert(model:session { ctx = 64 })
    s:prefill(some_ids(25, 64, 6))
    s:rewind(s.pos)
    assert.equals(0, s.pos)
    local l = assert(s:prefill(ids))
    local f = assert(model:session { ctx = 64 })
    assert_close(l, assert(f:prefill(ids)), 1e-5)
  end)

  it("raises on a negative or non-integer count", function()
    local s = assert(model:session { ctx = 64 })
    s:prefill({ 1, 2 })
    assert.has_error(function() s:rewind(-1) end)
    assert.has_error(function() s:rewind("one") end)
    assert.has_error(function() s:rewind(0.5) end)
    assert.equals(2, s.pos)
  end)
end)

-- ==== context full ============================================================

describe("a prompt longer than the context", function()
  it("returns nil and \"context full\" with the numbers, and leaves the session unchanged", function()
    local s = assert(model:session { ctx = 16 })
    s:prefill({ 1, 5, 6, 7 })
    local l, err = s:prefill(some_ids(13, 64, 7))
    assert.is_nil(l)
    assert.is_string(err)
    assert.matches("context full", err, 1, true)
    assert.matches("4", err, 1, true)  -- tokens in the session
    assert.matches("13", err, 1, true) -- tokens asked for
    assert.matches("16", err, 1, true) -- the context size
    assert.equals(4, s.pos)
    assert.same({ 1, 5, 6, 7 }, s:tokens())
  end)

  it("leaves the session usable: a prefill that fits gives the logits of a fresh session", function()
    local s = assert(model:session { ctx = 16 })
    s:prefill({ 1, 5, 6, 7 })
    assert.is_nil((s:prefill(some_ids(20, 64, 8))))
    assert.is_nil((s:prefill(some_ids(13, 64, 9), { logits = "all" })))
    local l = assert(s:prefill({ 8, 9, 10 }))
    local f = assert(model:session { ctx = 16 })
    local lf = assert(f:prefill({ 1, 5, 6, 7, 8, 9, 10 }))
    assert_close(l, lf, 1e-5)
    assert.same({ 1, 5, 6, 7, 8, 9, 10 }, s:tokens())
  end)

  it("fills exactly to ctx, then a decode returns nil, \"context full\"", function()
    local s = assert(model:session { ctx = 8 })
    assert(s:prefill(some_ids(7, 64, 10)))
    assert(s:decode(3))
    assert.equals(8, s.pos)
    local l, err = s:decode(4)
    assert.is_nil(l)
    assert.matches("context full", err, 1, true)
    assert.equals(8, s.pos)
  end)

  it("a prompt longer than a fresh session's context fails the same way", function()
    local s = assert(model:session { ctx = 32 })
    local l, err = s:prefill(some_ids(33, 64, 11))
    assert.is_nil(l)
    assert.matches("context full", err, 1, true)
    assert.matches("33", err, 1, true)
    assert.matches("32", err, 1, true)
    assert.equals(0, s.pos)
    assert.same({}, s:tokens())
  end)
end)

-- ==== misuse raises =============================================================

describe("misuse", function()
  local s
  before_each(function()
    s = assert(model:session { ctx = 32 })
    s:prefill({ 1, 2, 3 })
  end)
  after_each(function() s:close() end)

  it("raises on token ids out of range", function()
    local n = model.info.n_vocab
    assert.has_error(function() s:decode(n) end)
    assert.has_error(function() s:decode(-1) end)
    assert.has_error(function() s:prefill({ 1, n }) end)
    assert.has_error(function() s:prefill({ -5 }) end)
    assert.equals(3, s.pos)
  end)

  it("raises on ids that are not integers", function()
    assert.has_error(function() s:decode(1.5) end)
    assert.has_error(function() s:decode("seven") end)
    assert.has_error(function() s:decode(nil) end)
    assert.has_error(function() s:prefill({ 1, 2.5 }) end)
    assert.has_error(function() s:prefill({ 1, "x" }) end)
    assert.has_error(function() s:prefill({ 1, {} }) end)
    assert.equals(3, s.pos)
  end)

  it("raises on an empty table or something that is not a table", function()
    assert.has_error(function() s:prefill({}) end)
    assert.has_error(function() s:prefill("1 2 3") end)
    assert.has_error(function() s:prefill(42) end)
    assert.has_error(function() s:prefill() end)
    assert.equals(3, s.pos)
  end)

  it("raises on bad prefill options", function()
    assert.has_error(function() s:prefill({ 4 }, { logits = "some" }) end)
    assert.has_error(function() s:prefill({ 4 }, { logits = 1 }) end)
    assert.has_error(function() s:prefill({ 4 }, "all") end)
    assert.equals(3, s.pos)
  end)

  it("raises on bad session options", function()
    assert.has_error(function() model:session { ctx = 0 } end)
    assert.has_error(function() model:session { ctx = -4 } end)
    assert.has_error(function() model:session { ctx = "big" } end)
    assert.has_error(function() model:session { ctx = 1.5 } end)
    assert.has_error(function() model:session(12) end)
  end)

  it("raises on a method called without its session", function()
    assert.has_error(function() s.prefill({ 1 }) end)
    assert.has_error(function() s.decode(1) end)
    assert.has_error(function() s.stats() end)
  end)
end)

describe("a closed session", function()
  it("raises on every use; close is idempotent", function()
    local s = assert(model:session { ctx = 32 })
    s:prefill({ 1, 2 })
    s:close()
    s:close()
    assert.has_error(function() s:prefill({ 1 }) end)
    assert.has_error(function() s:decode(1) end)
    assert.has_error(function() return s.pos end)
    assert.has_error(function() s:tokens() end)
    assert.has_error(function() s:rewind(1) end)
    assert.has_error(function() s:stats() end)
  end)

  it("closes at the end of a to-be-closed variable", function()
    local ref
    do
      local s <close> = assert(model:session { ctx = 32 })
      ref = s
      s:prefill({ 1 })
    end
    assert.has_error(function() ref:decode(1) end)
  end)
end)

-- ==== stats =====================================================================

describe("s:stats()", function()
  it("has no ttft and no latencies before anything ran", function()
    local s = assert(model:session { ctx = 32 })
    local st = s:stats()
    assert.is_nil(st.ttft)
    assert.same({}, st.itl)
    assert.equals(0, st.prefill_tokens)
    assert.equals(0, st.decode_tokens)
  end)

  it("reports TTFT after the first prefill and one latency per decode", function()
    local s = assert(model:session { ctx = 32 })
    s:prefill({ 1, 2, 3, 4, 5 })
    local st = s:stats()
    assert.is_number(st.ttft)
    assert.is_true(st.ttft >= 0)
    assert.equals(5, st.prefill_tokens)
    assert.equals(0, st.decode_tokens)
    local ttft = st.ttft
    for id = 6, 9 do s:decode(id) end
    s:prefill({ 10, 11 })
    st = s:stats()
    assert.equals(ttft, st.ttft) -- the first prefill's, not the latest
    assert.equals(4, #st.itl)
    for _, t in ipairs(st.itl) do
      assert.is_number(t)
      assert.is_true(t >= 0)
    end
    assert.equals(7, st.prefill_tokens)
    assert.equals(4, st.decode_tokens)
  end)

  it("counts nothing for a failed prefill", function()
    local s = assert(model:session { ctx = 8 })
    s:prefill({ 1, 2 })
    assert.is_nil((s:prefill(some_ids(10, 64, 12))))
    assert.equals(2, s:stats().prefill_tokens)
  end)

  it("reports the bytes of the KV pages it holds, equal to model:kv_bytes for as many tokens", function()
    for _, n in ipairs { 8, 100, 200 } do
      local s = assert(model:session { ctx = 512 })
      assert.equals(0, s:stats().kv_bytes) -- pages are taken as tokens arrive
      assert(s:prefill(some_ids(n, 64, n), { logits = "none" }))
      local st = s:stats()
      assert.is_true(st.kv_bytes > 0)
      assert.equals(model:kv_bytes { ctx = n }, st.kv_bytes)
      s:close()
    end
  end)
end)

-- ==== threads ===================================================================

describe("thread count", function()
  it("does not change the logits: threads = 1 and threads = 2 agree within 1e-4", function()
    local m2 = assert(kvlua.load(path, { threads = 2 }))
    local ids = some_ids(150, 64, 13)
    local a = assert(model:session { ctx = 200 })
    local b = assert(m2:session { ctx = 200 })
    local la = assert(a:prefill(ids, { logits = "all" }))
    local lb = assert(b:prefill(ids, { logits = "all" }))
    for _, i in ipairs { 1, 64, 128, 150 } do
      assert_close(la:row(i), lb:row(i), 1e-4, "prefill row " .. i)
    end
    for _, id in ipairs { 7, 8, 9 } do
      assert_close(assert(a:decode(id)), assert(b:decode(id)), 1e-4, "decode " .. id)
    end
    b:close()
    m2:close()
  end)
end)

-- ==== the model keeps living under a session =====================================

describe("lifetimes", function()
  it("a session keeps its model alive; s.model is that model", function()
    local m = assert(kvlua.load(path, { threads = 1 }))
    local s = assert(m:session { ctx = 16 })
    assert.equals(m, s.model)
    m = nil -- luacheck: ignore
    collectgarbage()
    collectgarbage()
    assert(s:prefill({ 1, 2, 3 }))
    s.model:close()
    assert(s:decode(4)) -- the engine model is freed only after the session
    s:close()
  end)
end)

-- ==== failures of the world: corrupted or unsupported files =====================

describe("a model whose weights contain NaN", function()
  it("prefill and decode return nil and a message, never logits", function()
    local bytes, w = tiny.llama_bytes { seed = 4 }
    for k = 0, 31 do bytes = tiny.poke_f32(bytes, w, "output_norm.weight", k, 0 / 0) end
    local m = assert(kvlua.load(tiny.write(bytes), { threads = 1 }))
    local s = assert(m:session { ctx = 16 })
    local l, err = s:prefill({ 1, 2, 3 })
    assert.is_nil(l)
    assert.is_string(err)
    assert.equals(0, s.pos)
    l, err = s:decode(5)
    assert.is_nil(l)
    assert.is_string(err)
    l, err = s:prefill({ 1, 2, 3 }, { logits = "all" })
    assert.is_nil(l)
    assert.is_string(err)
    s:close()
    m:close()
  end)

  it("an Inf in one output weight poisons one logit: still nil, message", function()
    local bytes, w = tiny.llama_bytes { seed = 4 }
    bytes = tiny.poke_f32(bytes, w, "output.weight", 32 * 10 + 3, math.huge) -- row 10 (token 10)
    local m = assert(kvlua.load(tiny.write(bytes), { threads = 1 }))
    local s = assert(m:session { ctx = 16 })
    local l, err = s:prefill({ 1, 2, 3 })
    assert.is_nil(l)
    assert.is_string(err)
    s:close()
    m:close()
  end)

  it("a NaN reached only through one token fails that step and leaves the session as it was", function()
    local bytes, w = tiny.llama_bytes { seed = 4 }
    for k = 0, 31 do bytes = tiny.poke_f32(bytes, w, "token_embd.weight", 32 * 9 + k, 0 / 0) end -- token 9
    local p = tiny.write(bytes)
    local m = assert(kvlua.load(p, { threads = 1 }))
    local s = assert(m:session { ctx = 16 })
    assert(s:prefill({ 1, 5, 6 }))
    local l, err = s:decode(9)
    assert.is_nil(l)
    assert.is_string(err)
    assert.equals(3, s.pos)
    assert.same({ 1, 5, 6 }, s:tokens())
    -- token 9 sits in the middle: its NaN must reach the last position's logits
    l, err = s:prefill({ 7, 9, 8 })
    assert.is_nil(l, "a prefill through a NaN position returned logits")
    assert.is_string(err)
    assert.equals(3, s.pos)
    -- the session goes on as if the failed steps never happened
    local after = assert(s:decode(7))
    local f = assert(m:session { ctx = 16 })
    assert_close(after, assert(f:prefill({ 1, 5, 6, 7 })), 1e-5)
    s:close()
    f:close()
    m:close()
  end)

  it("generate ends with an error and yields no token", function()
    local bytes, w = tiny.llama_bytes { seed = 4 }
    for k = 0, 31 do bytes = tiny.poke_f32(bytes, w, "output_norm.weight", k, 0 / 0) end
    local m = assert(kvlua.load(tiny.write(bytes), { threads = 1 }))
    local s = assert(m:session { ctx = 16 })
    local pieces = {}
    for piece in s:generate { prompt = { 1, 2 }, max_tokens = 4 } do pieces[#pieces + 1] = piece end
    assert.same({}, pieces)
    assert.matches("^error", s.finish_reason)
    assert.is_true(s.generated == nil or #s.generated == 0)
    s:close()
    m:close()
  end)
end)

describe("files the engine cannot run", function()
  it("an unsupported architecture: kvlua.load returns nil and a message naming it", function()
    local bytes = tiny.llama_bytes { meta = { { "general.architecture", "string", "mamba" } } }
    local m, err = kvlua.load(tiny.write(bytes), { threads = 1 })
    assert.is_nil(m)
    assert.is_string(err)
    assert.matches("mamba", err, 1, true)
  end)

  it("an unsupported tensor type: nil and a message naming the tensor and its type", function()
    local bytes, w = tiny.llama_bytes {}
    bytes = tiny.set_type(bytes, w, "blk.0.attn_q.weight", W.types.I32.id) -- same size as F32
    local m, err = kvlua.load(tiny.write(bytes), { threads = 1 })
    assert.is_nil(m)
    assert.is_string(err)
    assert.matches("blk.0.attn_q.weight", err, 1, true)
    assert.matches("I32", err, 1, true)
  end)

  it("a vocabulary-only file loads and tokenizes, but model:session returns nil, message", function()
    local m, err = kvlua.load(tiny.vocab_only(), { threads = 1 })
    assert.is_nil(err)
    assert.is_not_nil(m)
    local ids = m:tokenize("Hi!", { add_special = false })
    assert.is_true(#ids > 0)
    assert.equals("Hi!", m:detokenize(ids))
    local s, serr = m:session { ctx = 16 }
    assert.is_nil(s)
    assert.is_string(serr)
    m:close()
  end)
end)

-- ==== the real model =================================================================

describe("sessions on SmolLM2-135M-Instruct", function()
  local real
  setup(function()
    local p = models.path("smollm2")
    real = p and assert(kvlua.load(p, { threads = 2 })) or nil
  end)
  teardown(function()
    if real then real:close() end
  end)

  it("prefill returns Logits over the whole vocabulary; \"all\" ends with the same row", function()
    if not real then return pending("smollm2 not available") end
    local ids = real:tokenize("The capital of France is")
    local s = assert(real:session { ctx = 64 })
    local l = assert(s:prefill(ids))
    assert.equals(49152, l.n)
    local a = assert(real:session { ctx = 64 })
    local all = assert(a:prefill(ids, { logits = "all" }))
    assert.equals(#ids, all.rows)
    assert_close(all:row(#ids), l, 1e-3)
    s:close()
    a:close()
  end)

  it("prefill of a prompt equals decoding it token by token (up to kernel rounding)", function()
    if not real then return pending("smollm2 not available") end
    local ids = real:tokenize("Once upon a time, in a small village by the sea, there lived")
    local a = assert(real:session { ctx = 64 })
    local b = assert(real:session { ctx = 64 })
    local all = assert(a:prefill(ids, { logits = "all" }))
    for i, id in ipairs(ids) do
      local l = assert(b:decode(id))
      local row = all:row(i)
      local d = rms_diff(row, l)
      assert(d <= REAL_RMS, string.format("position %d: RMS difference %.3g (tolerance %g)", i, d, REAL_RMS))
      local _, v = row:topk(2)
      if v[1] - v[2] >= CLEAR_MARGIN then assert.equals(row:argmax(), l:argmax(), "position " .. i) end
    end
    a:close()
    b:close()
  end)

  it("rewinding and decoding again reproduces the logits", function()
    if not real then return pending("smollm2 not available") end
    local ids = real:tokenize("One, two, three,")
    local s = assert(real:session { ctx = 64 })
    local l = assert(s:prefill(ids))
    local first = l:argmax()
    local d1 = assert(s:decode(first)):totable()
    s:rewind(1)
    assert.equals(#ids, s.pos)
    local d2 = assert(s:decode(first)):totable()
    for k = 1, #d1, 97 do assert(math.abs(d1[k] - d2[k]) <= 1e-4) end
    s:close()
  end)

  it("context full on the real model: nil, message; the session is unchanged", function()
    if not real then return pending("smollm2 not available") end
    local s = assert(real:session { ctx = 8 })
    local ids = real:tokenize("a b c d e f g h i j k l")
    assert.is_true(#ids > 8)
    local l, err = s:prefill(ids)
    assert.is_nil(l)
    assert.matches("context full", err, 1, true)
    assert.equals(0, s.pos)
    assert(s:prefill({ 1, 2 }))
    s:close()
  end)

  it("threads = 1 and threads = 2 agree within 1e-4", function()
    if not real then return pending("smollm2 not available") end
    local m1 = assert(kvlua.load(models.path("smollm2"), { threads = 1 }))
    local ids = real:tokenize("Counting with threads:")
    local a = assert(real:session { ctx = 32 })
    local b = assert(m1:session { ctx = 32 })
    assert_close(assert(a:prefill(ids)), assert(b:prefill(ids)), 1e-4, "prefill")
    assert_close(assert(a:decode(42)), assert(b:decode(42)), 1e-4, "decode")
    b:close()
    m1:close()
    a:close()
  end)

  it("s:stats().kv_bytes equals model:kv_bytes for the same ctx", function()
    if not real then return pending("smollm2 not available") end
    local s = assert(real:session { ctx = 1000 })
    assert(s:prefill(some_ids(100, 1000, 5), { logits = "none" }))
    -- 100 tokens in pages of 16: 7 pages of K and V, 30 layers, 3 KV heads, 64 f16 values
    assert.equals(2 * 30 * 3 * 64 * 2 * 112, s:stats().kv_bytes)
    assert.equals(real:kv_bytes { ctx = 100 }, s:stats().kv_bytes)
    s:close()
  end)
end)

-- ==== KV cache storage types ========================================================

describe("model:session{ ktype =, vtype = } (the private cache's storage)", function()
  -- head size 32 (128 / 4 heads), so Q8_0 blocks fit
  local m32
  setup(function()
    m32 = assert(kvlua.load(tiny.llama { seed = 9, n_embd = 128, n_head = 4, n_head_kv = 2 }, { threads = 1 }))
  end)
  teardown(function() if m32 then m32:close() end end)

  local ids = some_ids(40, 64, 77)

  it("q8_0: about half the bytes of f16, as model:kv_bytes says", function()
    local f = assert(m32:session { ctx = 100 })
    local q = assert(m32:session { ctx = 100, ktype = "q8_0", vtype = "q8_0" })
    local mixed = assert(m32:session { ctx = 100, ktype = "f16", vtype = "q8_0" })
    for _, s in ipairs { f, q, mixed } do assert(s:prefill(ids, { logits = "none" })) end
    -- per stored row of 32 values: f16 64 bytes, q8_0 34 (32 int8 + an f16 scale)
    assert.equals(f:stats().kv_bytes * 34 // 64, q:stats().kv_bytes)
    assert.equals(f:stats().kv_bytes * (64 + 34) // 128, mixed:stats().kv_bytes)
    assert.equals(m32:kv_bytes { ctx = 40, ktype = "q8_0", vtype = "q8_0" }, q:stats().kv_bytes)
    assert.equals(m32:kv_bytes { ctx = 40, vtype = "q8_0" }, mixed:stats().kv_bytes)
    f:close(); q:close(); mixed:close()
  end)

  it("q8_0 logits stay near the f16 ones, and are not the same numbers", function()
    local f = assert(m32:session { ctx = 64 })
    local q = assert(m32:session { ctx = 64, ktype = "q8_0", vtype = "q8_0" })
    local lf, lq = assert(f:prefill(ids)), assert(q:prefill(ids))
    local d = max_diff(lf, lq)
    assert.is_true(d > 0, "q8_0 cache gave bit-identical logits: not used?")
    assert.is_true(rms_diff(lf, lq) < 0.05 * math.max(1, math.abs(lf:get(lf:argmax()))),
      string.format("rms %.4g", rms_diff(lf, lq)))
    f:close(); q:close()
  end)

  it("q8_0: decode steps agree with one prefill of the same tokens", function()
    local a = assert(m32:session { ctx = 64, ktype = "q8_0", vtype = "q8_0" })
    local b = assert(m32:session { ctx = 64, ktype = "q8_0", vtype = "q8_0" })
    local all = assert(a:prefill(ids, { logits = "all" }))
    local l
    for i = 1, #ids do l = assert(b:decode(ids[i])) end
    assert_close(all:row(#ids), l, 1e-3, "last row")
    a:close(); b:close()
  end)

  it("refuses q8_0 for a head size that is not a multiple of 32, naming the reason", function()
    local s, err = model:session { ctx = 16, ktype = "q8_0" } -- head size 8
    assert.is_nil(s)
    assert.matches("multiple of 32", err)
  end)

  it("q4_0: 18 bytes per 32 values, logits near the f16 ones; refused for head sizes not a multiple of 32", function()
    local f = assert(m32:session { ctx = 64 })
    local q = assert(m32:session { ctx = 64, ktype = "q4_0", vtype = "q4_0" })
    local ids = some_ids(40, 64, 78)
    local lf, lq = assert(f:prefill(ids)), assert(q:prefill(ids))
    assert.equals(f:stats().kv_bytes * 18 // 64, q:stats().kv_bytes)
    assert.equals(m32:kv_bytes { ctx = 40, ktype = "q4_0", vtype = "q4_0" }, q:stats().kv_bytes)
    assert.is_true(max_diff(lf, lq) > 0)
    assert_close(lf, lq, 0.5, "q4_0 vs f16")
    local s, err = model:session { ctx = 16, vtype = "q4_0" } -- head size 8
    assert.is_nil(s)
    assert.matches("Q4_0 needs a head size that is a multiple of 32", err)
  end)

  it("raises on an unknown type name or a non-string", function()
    assert.has_error(function() m32:session { ctx = 16, ktype = "q9" } end)
    assert.has_error(function() m32:session { ctx = 16, vtype = 8 } end)
  end)
end)
