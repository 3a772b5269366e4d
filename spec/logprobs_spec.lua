-- Log-probabilities of generated tokens: s:generate{logprobs = k}, the
-- scheduler's request.logprobs and batch-generate's --logprobs K / item
-- "logprobs" (the OpenAI completions shape).
--
-- Every figure is checked against a replay: the generated ids fed again
-- with prefill/decode to a fresh session, and the Logits of each position
-- asked directly (Logits:logprob, Logits:topk); the sampler's
-- distribution is rebuilt from those Logits with the Logits primitives the
-- stages stand for (keep_top_k, keep_top_p, keep_min_p, scale). Equality
-- is bit for bit. Tiny random-weight models, and SmolLM2 (pending when
-- unavailable).
local kvlua = require "kvlua"
local sampling = require "kvlua.sampling"
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"
local S = require "spec.support.scripts"
local files = require "spec.support.files"

-- The Logits of each generated position: logits[i] is what ids[i] was
-- picked from (prompt, then each id but the last fed back).
local function replay(m, prompt, ids)
  local s = assert(m:session { ctx = #prompt + #ids + 1 })
  local out = { assert(s:prefill(prompt)) }
  for i = 1, #ids - 1 do out[i + 1] = assert(s:decode(ids[i])) end
  s:close()
  return out
end

-- The reference record of ids[i]: raw log-prob, top k (ids, log-probs), and
-- the log-prob under final(l) (a Logits) when final is given.
local function reference(l, id, k, final)
  local ids = l:topk(k)
  local top = {}
  for j, t in ipairs(ids) do top[j] = { id = t, logprob = l:logprob(t) } end
  return { raw = l:logprob(id), top = top, final = final and final(l:clone()):logprob(id) }
end

-- Compares records with the replay, bit for bit (== on doubles).
local function check(m, prompt, ids, recs, k, final, piece)
  assert.equals(#ids, #recs)
  local ls = replay(m, prompt, ids)
  for i, r in ipairs(recs) do
    local want = reference(ls[i], ids[i], k, final)
    assert.equals(ids[i], r.id, "id " .. i)
    assert.is_true(want.raw == r.raw_logprob, ("raw_logprob %d: %s vs %s"):format(i, want.raw, r.raw_logprob))
    if final then
      assert.is_true(want.final == r.logprob, ("logprob %d: %s vs %s"):format(i, want.final, r.logprob))
    end
    assert.equals(#want.top, #r.top)
    for j, t in ipairs(want.top) do
      assert.equals(t.id, r.top[j].id)
      assert.is_true(t.logprob == r.top[j].logprob, ("top %d.%d"):format(i, j))
      if piece then assert.equals(piece(t.id), r.top[j].text) end
    end
    if piece then assert.equals(piece(ids[i]), r.text) end
  end
end

-- What sampling.from_opts{temp = t, top_k = k, top_p = p, min_p = mp}
-- draws from (penalties at 1.0 and typical 1.0 change nothing; min_keep 0).
local function from_opts_final(t, k, p, mp)
  return function(l)
    l:keep_top_k(k)
    assert(l:keep_top_p(p, 0))
    l:keep_min_p(mp, 0)
    l:scale(1 / t, l:get(l:argmax()))
    return l
  end
end

local function untouched(l) return l end

describe("s:generate{logprobs = k}", function()
  local m
  setup(function() m = assert(kvlua.load(tiny.llama { vocab = "bytes", seed = 9 }, { threads = 1 })) end)
  teardown(function()
    m:close()
    tiny.cleanup()
  end)
  local PROMPT = { 1, tiny.id("▁Hello") }
  local function piece(id) return m:piece(id, false) end

  it("records every token with the log-probs of a replay, under a sampled chain (several seeds)", function()
    for seed = 1, 3 do
      local s = assert(m:session { ctx = 64 })
      local yielded = {}
      for _, recs in s:generate { prompt = PROMPT, max_tokens = 12, logprobs = 4, ignore_eog = true,
        sampler = sampling.from_opts { temp = 0.7, top_k = 30, top_p = 0.9, min_p = 0.02, seed = seed } } do
        for _, r in ipairs(recs) do yielded[#yielded + 1] = r end
      end
      assert.equals(12, #s.generated)
      check(m, PROMPT, s.generated, s.logprobs, 4, from_opts_final(0.7, 30, 0.9, 0.02), piece)
      -- the pieces' records are s.logprobs' (the ones held at the end aside)
      for i, r in ipairs(yielded) do assert.equals(s.logprobs[i], r) end
      s:close()
    end
  end)

  it("without a sampler: the pick is the argmax and both log-probs are the model's", function()
    local s = assert(m:session { ctx = 64 })
    for _ in s:generate { prompt = PROMPT, max_tokens = 6, logprobs = 2, ignore_eog = true } do end
    check(m, PROMPT, s.generated, s.logprobs, 2, untouched, piece)
    local ls = replay(m, PROMPT, s.generated)
    for i, id in ipairs(s.generated) do assert.equals(ls[i]:argmax(), id) end
  end)

  it("temperature 0 draws from a point mass (log-prob 0); a stage alone as the sampler", function()
    local s = assert(m:session { ctx = 64 })
    for _ in s:generate { prompt = PROMPT, max_tokens = 4, logprobs = 0, ignore_eog = true,
      sampler = sampling.chain { sampling.temperature(0), sampling.dist { seed = 1 } } } do end
    for _, r in ipairs(s.logprobs) do
      assert.equals(0, r.logprob)
      assert.same({}, r.top)
    end
    check(m, PROMPT, s.generated, s.logprobs, 0)
    s = assert(m:session { ctx = 64 })
    for _ in s:generate { prompt = PROMPT, max_tokens = 4, logprobs = 1, ignore_eog = true,
      sampler = sampling.top_k(3) } do end
    check(m, PROMPT, s.generated, s.logprobs, 1, function(l) return l:keep_top_k(3) end)
  end)

  it("a sampler that keeps no .final: logprob is nil, the rest is there", function()
    local script = require("spec.support.samplers").script
    local ids = { tiny.id("!"), tiny.id("▁world"), tiny.id(65) }
    local s = assert(m:session { ctx = 64 })
    local text = {}
    for p in s:generate { prompt = PROMPT, max_tokens = 3, logprobs = 3, sampler = script(ids) } do text[#text + 1] = p end
    assert.equals("! worldA", table.concat(text))
    for _, r in ipairs(s.logprobs) do assert.is_nil(r.logprob) end
    check(m, PROMPT, ids, s.logprobs, 3, nil, piece)
  end)

  it("under a grammar: logprob is over the tokens the grammar allows, raw_logprob over all", function()
    if not kvlua.grammar then return pending("this build has no kvlua.grammar") end
    local text = 'root ::= "{" [a-z]{1,6} ("," [0-9])? "}"'
    for _, sampler in ipairs { false, sampling.from_opts { temp = 0.9, seed = 5, top_k = 0, top_p = 1, min_p = 0 } } do
      local s = assert(m:session { ctx = 64 })
      for _ in s:generate { prompt = PROMPT, max_tokens = 20, logprobs = 2, grammar = text, sampler = sampler or nil } do end
      local st = assert(kvlua.grammar(text)):state(m)
      local masked = function(l) -- the grammar's mask as the pick saw it, then the chain's temperature
        assert(st:mask(l))
        if sampler then l:scale(1 / 0.9, l:get(l:argmax())) end
        return l
      end
      local ls = replay(m, PROMPT, s.generated)
      check(m, PROMPT, s.generated, s.logprobs, 2, nil, piece)
      for i, id in ipairs(s.generated) do
        local want = masked(ls[i]:clone()):logprob(id)
        assert.is_true(want == s.logprobs[i].logprob, ("logprob %d: %s vs %s"):format(i, want, s.logprobs[i].logprob))
        assert.is_true(s.logprobs[i].logprob >= s.logprobs[i].raw_logprob)
        assert(st:accept(id))
      end
    end
  end)

  it("is off by default and checks its option", function()
    local s = assert(m:session { ctx = 64 })
    for p, extra in s:generate { prompt = PROMPT, max_tokens = 2 } do assert.is_nil(extra) end
    assert.is_nil(s.logprobs)
    assert.has_error(function() s:generate { logprobs = -1 } end,
      "generate: logprobs must be a non-negative integer (alternatives per token)")
    assert.has_error(function() s:generate { logprobs = 1.5 } end,
      "generate: logprobs must be a non-negative integer (alternatives per token)")
  end)
end)

describe("scheduler requests with logprobs", function()
  local scheduler = require "kvlua.scheduler"
  it("each result's records equal a replay's, whatever the batch", function()
    local m = assert(kvlua.load(tiny.llama { seed = 31 }, { threads = 1 }))
    local prompts = { { 1, 5, 9 }, { 1, 7 }, { 1, 11, 12, 13, 14 } }
    local results = {}
    local sch = scheduler.new(m, { batch = 3, prefill_chunk = 2 })
    local k = 0
    sch:run(function()
      k = k + 1
      if prompts[k] then
        return { prompt = prompts[k], max_tokens = 5, logprobs = 3, ignore_eog = true,
          sampler = k ~= 2 and sampling.from_opts { temp = 0.9, top_k = 20, top_p = 0.95, min_p = 0.05, seed = k } or nil }
      end
    end, function(r) results[r.index] = r end)
    for i, r in ipairs(results) do
      assert.equals(5, #r.ids)
      check(m, prompts[i], r.ids, r.logprobs, 3, i == 2 and untouched or from_opts_final(0.9, 20, 0.95, 0.05))
    end
    assert.has_error(function()
      scheduler.new(m):run(function() if not k then return nil end k = nil return { prompt = { 1 }, logprobs = "3" } end,
        function() end)
    end, "scheduler: a request's logprobs must be a non-negative integer")
    m:close()
  end)
end)

describe("batch-generate --logprobs K", function()
  it("writes the OpenAI completions shape, the figures a replay gives (SmolLM2)", function()
    local path = models.path("smollm2")
    if not path then return pending("SmolLM2 not available") end
    local input = files.write_temp('{"id": "a", "prompt": "The capital of France is", "max_tokens": 6}\n'
      .. '{"id": "b", "prompt": "1, 2, 3,", "max_tokens": 5, "temp": 0.8, "seed": 7, "logprobs": 1}\n'
      .. '{"id": "c", "prompt": "Hi", "max_tokens": 2, "logprobs": 0}\n')
    local r = S.run("batch-generate.lua", { "--model", path, "--file", input, "--logprobs", "3", "--ids",
      "--quiet", "--no-timings", "--batch", "2" })
    S.assert_ok(r)
    local lines = S.jsonl_lines(r.out)
    assert.equals(3, #lines)
    local m = assert(kvlua.load(path, { threads = 2 }))
    local ks = { 3, 1, 0 }
    for i, line in ipairs(lines) do
      local lp = line.logprobs
      local n = #line.ids
      assert.equals(line.tokens, n)
      for _, key in ipairs { "tokens", "token_logprobs", "top_logprobs", "text_offset", "token_ids",
        "sampler_logprobs", "top_token_ids" } do
        assert.equals(n, #lp[key], key)
      end
      assert.same(line.ids, lp.token_ids)
      local prompt = m:tokenize(({ "The capital of France is", "1, 2, 3,", "Hi" })[i],
        { add_special = true, parse_special = false })
      local ls = replay(m, prompt, line.ids)
      local ptext = ({ "The capital of France is", "1, 2, 3,", "Hi" })[i]
      local offset = utf8.len(ptext) -- text_offset counts characters from the prompt's start
      for t, id in ipairs(line.ids) do
        local l = ls[t]
        local text = m:piece(id, false)
        assert.equals(text, lp.tokens[t])
        assert.equals(offset, lp.text_offset[t])
        if utf8.len(ptext .. line.text) and utf8.len(text) then -- the token's text is found at its offset
          local at = utf8.offset(ptext .. line.text, lp.text_offset[t] + 1)
          assert.equals(text, (ptext .. line.text):sub(at, at + #text - 1))
        end
        offset = offset + select(2, text:gsub("[^\128-\191]", ""))
        assert.is_true(l:logprob(id) == lp.token_logprobs[t], "token_logprobs " .. t)
        local final = i == 2 and from_opts_final(0.8, 40, 0.95, 0.05)(l:clone()):logprob(id) or l:logprob(id)
        assert.is_true(final == lp.sampler_logprobs[t], "sampler_logprobs " .. t)
        local top_ids = l:topk(ks[i])
        assert.same(top_ids, lp.top_token_ids[t])
        local want = { [text] = l:logprob(id) }
        for _, a in ipairs(top_ids) do want[m:piece(a, false)] = l:logprob(a) end
        assert.same(want, lp.top_logprobs[t])
      end
      assert.equals(line.text, table.concat(lp.tokens))
    end
    m:close()
  end)

  it("refuses a bad item logprobs (the item fails, the others run)", function()
    local path = tiny.llama { seed = 2, vocab = "bytes" }
    local input = files.write_temp('{"id": "a", "prompt": "Hi", "logprobs": -1}\n{"id": "b", "prompt": "Hi", "logprobs": 2}\n')
    local r = S.run("batch-generate.lua", { "--model", path, "--file", input, "--max-tokens", "2", "--quiet" })
    assert.equals(1, r.rc)
    local lines = S.jsonl_lines(r.out)
    assert.equals("logprobs must be in 0..1000", lines[1].error)
    assert.equals(2, #lines[2].logprobs.tokens)
    tiny.cleanup()
  end)
end)
