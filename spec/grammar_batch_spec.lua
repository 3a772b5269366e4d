-- grammar_batch_spec.lua — constrained generation past s:generate's own
-- sampler: findings of an audit, one describe each.
--   1. generate{grammar =} (and json_schema =) took whatever a sampler of one's
--      own returned: a sampler that ignores the mask wrote text outside the
--      grammar (the accept result was ignored). Now such a pick ends the
--      generation with finish_reason "grammar" and s.grammar_error naming it,
--      before the token is counted or shown.
--   2. kvlua.scheduler requests and batch-generate items had no grammar: a
--      request's grammar = (GBNF text or a kvlua.grammar) and an item's
--      "grammar" now constrain as generate{grammar =} does; a bad grammar is
--      that request's error (that item's error line) and the others go on.
local kvlua = require "kvlua"
local json = require "kvlua.json"
local sampling = require "kvlua.sampling"
local scheduler = require "kvlua.scheduler"
local tiny = require "spec.support.tiny_models"
local files = require "spec.support.files"

local generate = require("spec.support.generation").text

-- A sampler that ignores its Logits: the listed byte tokens, in order.
local function scripted(bytes)
  local sm = { accepted = {} }
  local i = 0
  function sm:sample()
    i = i + 1
    return tiny.id(bytes:byte(i))
  end
  function sm:accept(id) self.accepted[#self.accepted + 1] = id end
  return sm
end

describe("1. a sampler that ignores the grammar's mask never writes outside it", function()
  local m
  setup(function() m = assert(kvlua.load(tiny.llama{ vocab = "bytes", seed = 3 }, { backend = "cpu" })) end)
  teardown(function() m:close(); tiny.cleanup() end)

  it("grammar =: the refused pick ends with finish_reason \"grammar\"", function()
    local s = m:session{ ctx = 64 }
    local sm = scripted("ab!cd")
    local text, why = generate(s, { prompt = "Hello", grammar = 'root ::= [a-z]+', max_tokens = 5, sampler = sm })
    assert.equal("ab", text)
    assert.equal("grammar", why)
    assert.truthy(s.grammar_error:find("^grammar: the sampler chose token " .. tiny.id(0x21)), s.grammar_error)
    assert.same({ tiny.id(0x61), tiny.id(0x62) }, s.generated)
    assert.same({ tiny.id(0x61), tiny.id(0x62) }, sm.accepted) -- the refused token is not accepted either
    s:close()
  end)

  it("json_schema =: the same", function()
    local s = m:session{ ctx = 64 }
    local text, why = generate(s, { prompt = "Hello", json_schema = { type = "boolean" }, max_tokens = 5,
                                    sampler = scripted("tx") })
    assert.equal("t", text)
    assert.equal("grammar", why)
    assert.truthy(s.grammar_error:find("^grammar: the sampler chose token " .. tiny.id(0x78)), s.grammar_error)
    s:close()
  end)

  it("a sampler that keeps to the grammar is unaffected", function()
    local s = m:session{ ctx = 64 }
    local text, why = generate(s, { prompt = "Hello", grammar = 'root ::= [a-z]+', max_tokens = 3,
                                    sampler = scripted("abc") })
    assert.equal("abc", text)
    assert.equal("length", why)
    s:close()
  end)
end)

-- ==== 2. grammars in the scheduler and batch-generate ========================

-- Grammars whose outputs are checked here by Lua patterns, not the engine.
local LIST = 'root ::= [a-z]{1,6} ("," [a-z]{1,6}){0,3} "."\n'
local function list_ok(t)
  local body = t:match("^(.*)%.$")
  if not body then return false end
  local n = 0
  for part in (body .. ","):gmatch("([^,]*),") do
    n = n + 1
    if not part:match("^[a-z]+$") or #part > 6 then return false end
  end
  return n >= 1 and n <= 4
end
local NUMBER = 'root ::= "-"? [1-9] [0-9]{0,3}\n'
local function number_ok(t) return t:match("^%-?[1-9]%d?%d?%d?$") ~= nil end

describe("2. grammar = in scheduler requests and batch-generate items", function()
  local path, m
  setup(function()
    path = tiny.llama{ vocab = "bytes", seed = 5 }
    m = assert(kvlua.load(path, { backend = "cpu" }))
  end)
  teardown(function() m:close(); tiny.cleanup() end)

  local function run(requests, batch)
    local out, i = {}, 0
    local sch = scheduler.new(m, { batch = batch or 3 })
    sch:run(function() i = i + 1; return requests[i] end, function(r) out[#out + 1] = r end)
    return out
  end

  it("scheduler: every finished output follows its grammar (greedy and sampled, text or object)", function()
    local reqs = {}
    for k = 0, 9 do
      local g = k % 2 == 0 and LIST or assert(kvlua.grammar(NUMBER))
      reqs[#reqs + 1] = { prompt = m:tokenize("Hello"), grammar = g, max_tokens = 60, which = k % 2,
        sampler = k > 1 and sampling.chain{ sampling.temperature(1.5), sampling.dist{ seed = k } } or nil }
    end
    local out = run(reqs)
    assert.equal(#reqs, #out)
    local finished = 0
    for k, r in ipairs(out) do
      assert.truthy(r.finish_reason == "eog" or r.finish_reason == "grammar", r.finish_reason)
      if r.finish_reason == "eog" then
        finished = finished + 1
        local ok = r.request.which == 0 and list_ok(r.text) or r.request.which == 1 and number_ok(r.text)
        assert.is_true(ok, ("request %d: %q"):format(k, r.text))
      else
        assert.truthy(r.grammar_error:find("^grammar: "), r.grammar_error)
      end
    end
    assert.truthy(finished >= 7, ("only %d of %d finished"):format(finished, #out))
  end)

  it("scheduler: the same text as s:generate{grammar =} (greedy and a seed)", function()
    for _, seed in ipairs{ 0, 4 } do
      local function smp() return seed > 0 and sampling.chain{ sampling.temperature(1.2), sampling.dist{ seed = seed } } or nil end
      local r = run({ { prompt = m:tokenize("Hello"), grammar = LIST, max_tokens = 40, sampler = smp() } })[1]
      local s = m:session{ ctx = 128 }
      local parts = {}
      for p in s:generate{ prompt = "Hello", grammar = LIST, max_tokens = 40, sampler = smp() } do parts[#parts + 1] = p end
      assert.equal(table.concat(parts), r.text)
      assert.equal(s.finish_reason, r.finish_reason)
      s:close()
    end
  end)

  it("scheduler: a bad grammar is that request's error; refusals and max_tokens end with grammar", function()
    local ignoring = { sample = function() return tiny.id(0x21) end } -- "!": outside the grammar
    local out = run({
      { prompt = m:tokenize("Hi"), grammar = 'root ::= "a" | b\n' },
      { prompt = m:tokenize("Hi"), grammar = 'root ::= "abcdefgh"', max_tokens = 3 },
      { prompt = m:tokenize("Hi"), grammar = NUMBER, sampler = ignoring },
      { prompt = m:tokenize("Hi"), max_tokens = 2 },
    }, 2)
    assert.equal("error: line 1, column 16: undefined rule 'b'", out[1].finish_reason)
    assert.equal("grammar", out[2].finish_reason)
    assert.equal("abc", out[2].text)
    assert.equal("grammar: max_tokens reached before the grammar could end", out[2].grammar_error)
    assert.equal("grammar", out[3].finish_reason)
    assert.equal("", out[3].text)
    assert.truthy(out[3].grammar_error:find("^grammar: the sampler chose token " .. tiny.id(0x21)), out[3].grammar_error)
    assert.equal("length", out[4].finish_reason)
    assert.has_error(function() run({ { prompt = { 1 }, grammar = 42 } }) end,
      "scheduler: a request's grammar must be GBNF text or a kvlua.grammar object")
  end)

  it("batch-generate: grammar items, and a bad one is its own error line", function()
    local S = require "spec.support.scripts"
    local lines = {}
    for k = 1, 4 do
      lines[k] = json.encode{ id = "g" .. k, prompt = "Hi", grammar = k % 2 == 1 and LIST or NUMBER, seed = k,
        temp = 1.0, top_k = 0, top_p = 1, min_p = 0 }
    end
    lines[5] = json.encode{ id = "bad", prompt = "Hi", grammar = 'root ::= "a" | b\n' }
    lines[6] = json.encode{ id = "both", prompt = "Hi", grammar = LIST, json_schema = { type = "boolean" } }
    lines[7] = '{"id": "plain", "prompt": "Hi", "max_tokens": 3}'
    local input = files.write_temp(table.concat(lines, "\n") .. "\n")
    local r = S.run("batch-generate.lua", { "--model", path, "--file", input, "--max-tokens", "60", "--ctx", "256",
      "--quiet", "--no-timings", "--batch", "3" })
    assert.equal(1, r.rc, S.explain(r))
    local out = S.jsonl_lines(r.out)
    assert.equal(7, #out)
    local finished = 0
    for k = 1, 4 do
      assert.equal("g" .. k, out[k].id)
      if out[k].finish_reason == "eog" then
        finished = finished + 1
        assert.is_true((k % 2 == 1 and list_ok or number_ok)(out[k].text), out[k].text)
      else
        assert.equal("grammar", out[k].finish_reason)
        assert.truthy(out[k].grammar_error:find("^grammar: "), out[k].grammar_error)
      end
    end
    assert.truthy(finished >= 3, ("only %d of 4 finished"):format(finished))
    assert.equal("error", out[5].finish_reason)
    assert.equal("grammar: line 1, column 16: undefined rule 'b'", out[5].error)
    assert.equal("give grammar or json_schema, not both", out[6].error)
    assert.equal("length", out[7].finish_reason)
    assert.truthy(r.err:find(":5: grammar: line 1, column 16", 1, true), r.err)
  end)
end)
