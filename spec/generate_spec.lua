-- s:generate{...}: the token loop of a session, streamed as text pieces.
--
--   for piece in s:generate{ prompt = "Hello", max_tokens = 64,
--                            sampler = sampling.from_opts{temp = 0.8, seed = 1},
--                            stop = {"\n\n"} } do
--     io.write(piece)
--   end
--   print(s.finish_reason, #s.generated)  -- "eog" | "length" | "stop" | "error: ..."
--
-- Pieces are whole UTF-8 characters and never part of a stop string. Most
-- examples drive a tiny model with a scripted sampler (a table whose
-- :sample returns the ids of a script), so what is generated is known in
-- advance; the rest run on the real SmolLM2 (pending when unavailable).
local kvlua = require "kvlua"
local sampling = require "kvlua.sampling"
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"

-- ==== helpers ================================================================

-- A sampler that returns the ids of a script, one per call (then nil, err).
local script = require("spec.support.samplers").script

-- Ids that spell a text one byte per token (the tiny vocabulary's byte tokens).
local function bytes_of(text)
  local t = {}
  for i = 1, #text do t[i] = tiny.id(text:byte(i)) end
  return t
end

local function collect(iter)
  local pieces = {}
  for piece in iter do pieces[#pieces + 1] = piece end
  return pieces, table.concat(pieces)
end

local W = { Hello = tiny.id("▁Hello"), world = tiny.id("▁world"), bang = tiny.id("!"),
  ST = tiny.id("ST"), OP = tiny.id("OP"), STOP = tiny.id("▁STOP"), e_acute = tiny.id("é") }
local EOS = 2

local model
setup(function()
  model = assert(kvlua.load(tiny.llama { vocab = "bytes", seed = 9 }, { threads = 1 }))
end)
teardown(function()
  if model then model:close() end
  tiny.cleanup()
end)

local function session(ctx)
  local s = assert(model:session { ctx = ctx or 64 })
  assert(s:prefill({ 1, W.Hello }))
  return s
end

-- ==== the loop ===============================================================

describe("s:generate", function()
  it("streams the pieces of the sampled tokens and records their ids in s.generated", function()
    local s = session()
    local ids = { W.Hello, W.world, W.bang }
    local pieces, text = collect(s:generate { sampler = script(ids), max_tokens = 3 })
    assert.equals(" Hello world!", text)
    assert.same(ids, s.generated)
    assert.equals("length", s.finish_reason)
    assert.is_true(#pieces >= 1)
  end)

  it("tells the sampler every accepted id, and calls on_token for each", function()
    local s = session()
    local sm = script({ W.world, W.bang })
    local seen = {}
    collect(s:generate { sampler = sm, max_tokens = 2, on_token = function(id) seen[#seen + 1] = id end })
    assert.same({ W.world, W.bang }, sm.accepted)
    assert.same({ W.world, W.bang }, seen)
  end)

  it("feeds each generated token back into the session", function()
    local s = session()
    collect(s:generate { sampler = script({ W.world, W.bang, W.Hello }), max_tokens = 3 })
    local toks = s:tokens()
    assert.same({ 1, W.Hello, W.world, W.bang }, table.move(toks, 1, 4, 1, {}))
  end)

  it("with no sampler is greedy: the same ids as an argmax loop written by hand", function()
    local s = session()
    collect(s:generate { max_tokens = 12, ignore_eog = true })
    local h = session()
    local logits = h:logits()
    local want = {}
    for i = 1, 12 do
      want[i] = logits:argmax()
      logits = assert(h:decode(want[i]))
    end
    assert.same(want, s.generated)
  end)

  it("takes a prompt as ids or as text (BOS added when the session is empty)", function()
    local a = assert(model:session { ctx = 64 })
    collect(a:generate { prompt = { 1, W.Hello }, sampler = script({ W.world }), max_tokens = 1 })
    assert.same({ 1, W.Hello }, table.move(a:tokens(), 1, 2, 1, {}))
    local b = assert(model:session { ctx = 64 })
    collect(b:generate { prompt = "Hi", sampler = script({ W.world }), max_tokens = 1 })
    local want = model:tokenize("Hi", { add_special = true })
    assert.equals(1, want[1])
    assert.same(want, table.move(b:tokens(), 1, #want, 1, {}))
  end)

  it("without a prompt continues from the session's last logits", function()
    local a = session()
    collect(a:generate { max_tokens = 6, ignore_eog = true })
    local b = assert(model:session { ctx = 64 })
    collect(b:generate { prompt = { 1, W.Hello }, max_tokens = 6, ignore_eog = true })
    assert.same(b.generated, a.generated)
  end)
end)

describe("finish reasons", function()
  it("\"length\": max_tokens ids at most", function()
    for _, n in ipairs { 1, 4, 9 } do
      local s = session()
      collect(s:generate { max_tokens = n, ignore_eog = true })
      assert.equals("length", s.finish_reason)
      assert.equals(n, #s.generated)
    end
  end)

  it("\"length\" at once for max_tokens = 0", function()
    local s = session()
    local pieces = collect(s:generate { max_tokens = 0 })
    assert.same({}, pieces)
    assert.equals("length", s.finish_reason)
  end)

  it("\"eog\": an end-of-generation token ends the loop and is not printed", function()
    local s = session()
    local _, text = collect(s:generate { sampler = script({ W.world, EOS, W.bang }), max_tokens = 8 })
    assert.equals(" world", text)
    assert.equals("eog", s.finish_reason)
    assert.same({ W.world, EOS }, s.generated)
  end)

  it("ignore_eog keeps going past it", function()
    local s = session()
    collect(s:generate { sampler = script({ W.world, EOS, W.bang }), max_tokens = 3, ignore_eog = true })
    assert.equals("length", s.finish_reason)
    assert.same({ W.world, EOS, W.bang }, s.generated)
  end)

  it("\"error: ...\" when the sampler fails, never a made-up id", function()
    local s = session()
    local _, text = collect(s:generate { sampler = script({ W.world }), max_tokens = 5 })
    assert.equals(" world", text)
    assert.matches("^error: script ended", s.finish_reason)
    assert.same({ W.world }, s.generated)
  end)

  it("\"error: context full ...\" when the prompt does not fit; nothing is generated", function()
    local s = assert(model:session { ctx = 4 })
    local pieces = collect(s:generate { prompt = { 1, 10, 11, 12, 13, 14 }, max_tokens = 3 })
    assert.same({}, pieces)
    assert.matches("^error: context full", s.finish_reason)
    assert.equals(0, s.pos)
  end)

  it("\"error: context full ...\" when the context runs out mid-way; the text so far is kept", function()
    local s = assert(model:session { ctx = 4 })
    local ids = { W.Hello, W.world, W.bang, W.Hello, W.world }
    local _, text = collect(s:generate { prompt = { 1 }, sampler = script(ids), max_tokens = 5 })
    assert.matches("^error: context full", s.finish_reason)
    assert.equals(4, s.pos)
    assert.equals(" Hello world!", text:sub(1, 13))
  end)
end)

-- ==== stop strings ==============================================================

describe("stop strings", function()
  it("end generation before the stop text, which never appears in the output", function()
    local s = session()
    local ids = { W.Hello, W.ST, W.OP, W.world }
    local pieces, text = collect(s:generate { sampler = script(ids), stop = { "STOP" }, max_tokens = 10 })
    assert.equals(" Hello", text)
    assert.equals("stop", s.finish_reason)
    for _, p in ipairs(pieces) do assert.is_nil(p:find("ST", 1, true)) end
  end)

  it("match inside one token as well as across tokens", function()
    local s = session()
    local _, text = collect(s:generate { sampler = script({ W.world, W.STOP, W.bang }), stop = { "STOP" } })
    assert.equals(" world ", text)
    assert.equals("stop", s.finish_reason)
  end)

  it("hold back a possible start of a stop string, and release it when it does not complete", function()
    local s = session()
    local pieces, text = collect(s:generate {
      sampler = script({ W.world, W.ST, W.bang, W.Hello }), stop = { "STOP" }, max_tokens = 4 })
    assert.equals(" worldST! Hello", text)
    assert.equals("length", s.finish_reason)
    -- "ST" is never the end of a piece while "OP" could still follow
    for i = 1, #pieces - 1 do assert.is_nil(pieces[i]:find("ST$")) end
  end)

  it("the first of several stop strings to match wins", function()
    local s = session()
    local _, text = collect(s:generate {
      sampler = script({ W.Hello, W.world, W.bang }), stop = { "!", "world" }, max_tokens = 5 })
    assert.equals(" Hello ", text)
    assert.equals("stop", s.finish_reason)
  end)

  it("a stop string right at the start gives no text at all", function()
    local s = session()
    local pieces = collect(s:generate { sampler = script({ W.bang, W.world }), stop = { "!" } })
    assert.same({}, pieces)
    assert.equals("stop", s.finish_reason)
  end)
end)

-- ==== UTF-8 ===================================================================

describe("pieces", function()
  it("are whole UTF-8 characters even when tokens are single bytes", function()
    local text = "é→ü 中文 🙂!"
    local s = session()
    local pieces, out = collect(s:generate { sampler = script(bytes_of(text)), max_tokens = #text })
    assert.equals(text, out)
    for _, p in ipairs(pieces) do
      assert.is_not_nil(utf8.len(p), string.format("piece %q is not valid UTF-8", p))
    end
  end)

  it("concatenated equal the pieces of the generated ids", function()
    local s = session()
    local ids = { W.Hello, W.e_acute }
    for _, id in ipairs(bytes_of("→x")) do ids[#ids + 1] = id end
    local _, out = collect(s:generate { sampler = script(ids), max_tokens = #ids })
    local want = {}
    for i, id in ipairs(s.generated) do want[i] = model:piece(id, false) end
    assert.equals(table.concat(want), out)
  end)

  it("flush an incomplete character at the end instead of dropping it", function()
    local s = session()
    local ids = { W.world, tiny.id(0xE2), tiny.id(0x86) } -- first 2 bytes of "→"
    local _, out = collect(s:generate { sampler = script(ids), max_tokens = 3 })
    assert.equals(" world\xE2\x86", out)
  end)
end)

-- ==== sampling ==================================================================

describe("seeded sampling", function()
  local function run(seed)
    local s = session()
    local sm = sampling.from_opts { temp = 1.0, top_k = 0, top_p = 1.0, min_p = 0, seed = seed }
    local _, text = collect(s:generate { sampler = sm, max_tokens = 16, ignore_eog = true })
    return text, s.generated
  end

  it("the same seed gives the same text", function()
    local a, ia = run(7)
    local b, ib = run(7)
    assert.equals(a, b)
    assert.same(ia, ib)
  end)

  it("different seeds usually give different text", function()
    local base = run(1)
    local differ = 0
    for seed = 2, 5 do
      if run(seed) ~= base then differ = differ + 1 end
    end
    assert.is_true(differ >= 3, "only " .. differ .. " of 4 other seeds changed the text")
  end)
end)

-- ==== misuse =====================================================================

describe("misuse raises", function()
  it("options that are not a table", function()
    local s = session()
    assert.has_error(function() s:generate("Hello") end)
    assert.has_error(function() s:generate(5) end)
  end)

  it("max_tokens that is not an integer", function()
    local s = session()
    assert.has_error(function() s:generate { max_tokens = "8" } end)
    assert.has_error(function() s:generate { max_tokens = 2.5 } end)
    assert.has_error(function() s:generate { max_tokens = {} } end)
  end)

  it("stop that is not an array of non-empty strings", function()
    local s = session()
    assert.has_error(function() s:generate { stop = "\n" } end)
    assert.has_error(function() s:generate { stop = { "\n", 5 } } end)
    assert.has_error(function() s:generate { stop = { "" } } end)
  end)

  it("a sampler that is not a sampler object", function()
    local s = session()
    assert.has_error(function() s:generate { sampler = "greedy" } end)
    assert.has_error(function() s:generate { sampler = 1 } end)
  end)

  it("a prompt that is neither text nor an array of ids", function()
    local s = session()
    assert.has_error(function() s:generate { prompt = 5 } end)
    assert.has_error(function() s:generate { prompt = true } end)
    assert.has_error(function() s:generate { prompt = { "a", "b" } } end)
  end)

  it("an on_token that is not a function (at the latest on the first step)", function()
    local s = session()
    assert.has_error(function()
      for _ in s:generate { on_token = 5, max_tokens = 2 } do end
    end)
  end)

  it("an empty session and no prompt (a rewound one continues: see audit_spec)", function()
    local s = assert(model:session { ctx = 16 })
    assert.has_error(function() s:generate { max_tokens = 2 } end, "generate: nothing to continue from (the prompt is empty and so is the session)")
    assert.has_error(function() s:generate { prompt = {}, max_tokens = 2 } end)
  end)

  it("a prompt with ids out of range", function()
    local s = assert(model:session { ctx = 16 })
    assert.has_error(function() s:generate { prompt = { 1, model.info.n_vocab } } end)
  end)

  it("a closed session", function()
    local s = session()
    s:close()
    assert.has_error(function() s:generate { prompt = { 1 } } end)
    assert.has_error(function() s:generate { prompt = "Hi" } end)
  end)
end)

-- ==== the real model ===============================================================

describe("generate on SmolLM2-135M-Instruct", function()
  local real
  local prompt = "The three primary colors are"
  setup(function()
    local p = models.path("smollm2")
    real = p and assert(kvlua.load(p, { threads = 2 })) or nil
  end)
  teardown(function()
    if real then real:close() end
  end)

  local function greedy(n, stop)
    local s = assert(real:session { ctx = 128 })
    local pieces, text = collect(s:generate { prompt = prompt, max_tokens = n, stop = stop })
    local out = { pieces = pieces, text = text, ids = s.generated, reason = s.finish_reason }
    s:close()
    return out
  end

  it("greedy generation equals the argmax loop done by hand", function()
    if not real then return pending("smollm2 not available") end
    local g = greedy(16)
    local s = assert(real:session { ctx = 128 })
    local logits = assert(s:prefill(real:tokenize(prompt, { add_special = true, parse_special = true })))
    local want = {}
    for i = 1, #g.ids do
      want[i] = logits:argmax()
      if real:is_eog(want[i]) then break end
      logits = assert(s:decode(want[i]))
    end
    assert.same(want, g.ids)
    s:close()
  end)

  it("respects max_tokens, and its pieces are UTF-8 that detokenize to the same text", function()
    if not real then return pending("smollm2 not available") end
    local g = greedy(12)
    assert.equals("length", g.reason)
    assert.equals(12, #g.ids)
    for _, p in ipairs(g.pieces) do
      assert.is_not_nil(utf8.len(p), string.format("piece %q is not valid UTF-8", p))
    end
    assert.equals(real:detokenize(g.ids), g.text)
  end)

  it("stops before a stop string seen in a first run; it never appears", function()
    if not real then return pending("smollm2 not available") end
    local first = greedy(16)
    -- a word from the middle of the first run's text
    local words = {}
    for w in first.text:gmatch("%a%a%a+") do words[#words + 1] = w end
    assert.is_true(#words >= 2, "first run: " .. first.text)
    local stop = words[2]
    local at = first.text:find(stop, 1, true)
    local g = greedy(16, { stop })
    assert.equals("stop", g.reason)
    assert.equals(first.text:sub(1, at - 1), g.text)
    assert.is_nil(g.text:find(stop, 1, true))
  end)

  it("seeded sampling: same seed same text; different seeds usually differ", function()
    if not real then return pending("smollm2 not available") end
    local function run(seed)
      local s = assert(real:session { ctx = 128 })
      local sm = sampling.from_opts { temp = 1.0, seed = seed }
      local _, text = collect(s:generate { prompt = "Write a word:", max_tokens = 10, sampler = sm })
      s:close()
      return text
    end
    assert.equals(run(11), run(11))
    local base, differ = run(1), 0
    for seed = 2, 4 do
      if run(seed) ~= base then differ = differ + 1 end
    end
    assert.is_true(differ >= 2, "only " .. differ .. " of 3 other seeds changed the text")
  end)
end)
