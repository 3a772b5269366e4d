-- kvlua.scheduler: many requests generating together on a tiny random
-- model. The reference for every result is the same request run alone
-- through s:generate (kvlua.generate) on a fresh session; scripted
-- samplers (tables whose :sample returns the ids of a script) make the
-- finish reasons known in advance.
local kvlua = require "kvlua"
local scheduler = require "kvlua.scheduler"
local tiny = require "spec.support.tiny_models"
local script = require("spec.support.samplers").script

local W = { Hello = tiny.id("▁Hello"), world = tiny.id("▁world"), bang = tiny.id("!"),
  ST = tiny.id("ST"), OP = tiny.id("OP") }
local EOS = 2

local model
setup(function()
  model = assert(kvlua.load(tiny.llama { vocab = "bytes", seed = 9 }, { threads = 1 }))
end)
teardown(function()
  if model then model:close() end
  tiny.cleanup()
end)

-- Prompts of different lengths, made of byte tokens after BOS.
local function prompt(text)
  local ids = { 1 }
  for i = 1, #text do ids[#ids + 1] = tiny.id(text:byte(i)) end
  return ids
end

local TEXTS = { "a", "the quick brown fox", "hi", "jumps over the lazy dog again", "xyz", "lorem ipsum" }

-- The greedy generation of a request alone, through s:generate.
local function alone(ids, max_tokens)
  local s = assert(model:session { ctx = #ids + max_tokens + 1 })
  local pieces = {}
  for piece in s:generate { prompt = ids, max_tokens = max_tokens, ignore_eog = true } do pieces[#pieces + 1] = piece end
  local gen = s.generated
  s:close()
  return table.concat(pieces), gen
end

-- Runs requests through a scheduler; returns the results in sink order and the scheduler.
local function run(requests, opts)
  local sch = scheduler.new(model, opts)
  local k, results = 0, {}
  sch:run(function()
    k = k + 1
    return requests[k]
  end, function(r) results[#results + 1] = r end)
  return results, sch
end

describe("scheduler", function()
  it("gives every request the text it gets alone, in request order, with and without prefill chunks", function()
    local reqs = {}
    for i, t in ipairs(TEXTS) do
      reqs[i] = { prompt = prompt(t), max_tokens = 2 + (i * 5) % 9, ignore_eog = true, tag = i }
    end
    for _, chunk in ipairs { 0, 3 } do
      local results = run(reqs, { batch = 3, prefill_chunk = chunk })
      assert.equals(#reqs, #results)
      for i, r in ipairs(results) do
        assert.equals(i, r.index)
        assert.equals(i, r.request.tag)
        local text, ids = alone(reqs[i].prompt, reqs[i].max_tokens)
        assert.equals(text, r.text, "request " .. i .. ", chunk " .. chunk)
        assert.same(ids, r.ids)
        assert.equals("length", r.finish_reason)
        assert.equals(#reqs[i].prompt, r.prompt_tokens)
        assert.is_true(r.ttft >= 0 and r.kv_bytes > 0)
        assert.equals(#r.ids - 1, #r.itl)
      end
    end
  end)

  it("decodes all active sessions through one decode_step call per step, never more than batch", function()
    local sizes = {}
    local reqs = {}
    for i, t in ipairs(TEXTS) do reqs[i] = { prompt = prompt(t), max_tokens = 4, ignore_eog = true } end
    local results = run(reqs, { batch = 4, decode_step = function(sessions, ids)
      sizes[#sizes + 1] = #sessions
      assert.equals(#sessions, #ids)
      return scheduler.decode_step(sessions, ids)
    end })
    assert.equals(6, #results)
    -- 4 admitted together: 3 decode steps of 4 (the 4th token needs no decode);
    -- then the last 2: 3 steps of 2
    assert.same({ 4, 4, 4, 2, 2, 2 }, sizes)
  end)

  it("with prefill chunks, a long prompt is prefilled while the others keep decoding", function()
    local long = prompt(string.rep("long prompt ", 4)) -- 49 tokens
    local function sizes_with(chunk)
      local sizes = {}
      run({ { prompt = prompt("a"), max_tokens = 12, ignore_eog = true },
            { prompt = long, max_tokens = 2, ignore_eog = true } },
        { batch = 2, prefill_chunk = chunk, decode_step = function(sessions, ids)
          sizes[#sizes + 1] = #sessions
          return scheduler.decode_step(sessions, ids)
        end })
      return sizes
    end
    -- whole prompts: both are prefilled before the first decode step
    assert.same({ 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1 }, sizes_with(0))
    -- chunks of 8: step 1 prefills "a" (2 tokens; the long prompt's first
    -- piece of 8 does not fit the 6 left), steps 2-8 the long prompt's
    -- pieces 8+8+8+8+8+8+1: its first token comes at step 8
    local sizes = sizes_with(8)
    assert.same({ 1, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1 }, sizes)
  end)

  it("cuts each prompt into pieces from its own start, whatever its neighbours", function()
    -- a model whose sessions log the size of every prefill call
    local log
    local logging = setmetatable({
      session = function(_, o)
        local s = assert(model:session(o))
        local mine = {}
        log[#log + 1] = mine
        return setmetatable({}, { __index = function(_, k)
          if k == "prefill" then
            return function(_, ids, opts)
              mine[#mine + 1] = #ids
              return s:prefill(ids, opts)
            end
          end
          local v = s[k]
          if type(v) == "function" then return function(_, ...) return v(s, ...) end end
          return v
        end })
      end,
    }, { __index = function(_, k) return function(_, ...) return model[k](model, ...) end end })
    local long = prompt(string.rep("z", 20)) -- 21 tokens
    for _, first in ipairs { "a", "abcde", string.rep("q", 13) } do
      log = {}
      local sch = scheduler.new(logging, { batch = 2, prefill_chunk = 8 })
      local reqs, k = { { prompt = prompt(first), max_tokens = 3 }, { prompt = long, max_tokens = 3 } }, 0
      sch:run(function() k = k + 1 return reqs[k] end, function() end)
      assert.same({ 8, 8, 5 }, log[2], "after a prompt of " .. #first + 1 .. " tokens")
    end
  end)

  it("finishes on EOG (not in the ids or text), stop strings and max_tokens", function()
    local results = run({
      { prompt = prompt("a"), sampler = script { W.Hello, W.world, EOS, W.bang } },
      { prompt = prompt("b"), sampler = script { W.Hello, W.ST, W.OP, W.world }, stop = { "STOP" } },
      { prompt = prompt("c"), sampler = script { W.Hello, W.world, W.bang }, max_tokens = 2 },
    }, { batch = 3 })
    assert.same({ "eog", "stop", "length" }, { results[1].finish_reason, results[2].finish_reason,
      results[3].finish_reason })
    assert.equals(" Hello world", results[1].text)
    assert.same({ W.Hello, W.world }, results[1].ids)
    assert.equals(" Hello", results[2].text)
    assert.equals(" Hello world", results[3].text)
  end)

  it("a request that cannot run finishes with an error in its place; the others run", function()
    local results = run({
      { prompt = prompt("a"), max_tokens = 2 },
      { prompt = {} },
      { error = "malformed line" },
      { prompt = prompt(string.rep("x", 40)), max_tokens = 2 },
      { prompt = prompt("b"), sampler = script { W.Hello } , max_tokens = 3 },
      { prompt = prompt("c"), max_tokens = 2 },
    }, { batch = 2, ctx = 24 })
    local reasons = {}
    for i, r in ipairs(results) do reasons[i] = r.finish_reason end
    assert.equals("length", reasons[1])
    assert.matches("^error: the request has no prompt tokens", reasons[2])
    assert.equals("error: malformed line", reasons[3])
    assert.matches("^error: the prompt %(41 tokens%) does not fit the context %(24%)", reasons[4])
    assert.equals("error: script ended", reasons[5])
    assert.same({ W.Hello }, results[5].ids)
    assert.equals("length", reasons[6])
  end)

  it("a failed decode ends that request with its message; the others go on", function()
    local results = run({
      { prompt = prompt("a"), max_tokens = 5, ignore_eog = true },
      { prompt = prompt("b"), max_tokens = 5, ignore_eog = true },
    }, { batch = 2, decode_step = function(sessions, ids)
      local logits, errors, seconds = scheduler.decode_step(sessions, ids)
      if sessions[2] and sessions[2].pos >= 4 then logits[2], errors[2] = nil, "device lost" end
      return logits, errors, seconds
    end })
    assert.equals("length", results[1].finish_reason)
    assert.equals(5, #results[1].ids)
    assert.equals("error: device lost", results[2].finish_reason)
  end)

  it("raises on bad options", function()
    assert.has_error(function() scheduler.new(model, { batch = 0 }) end)
    assert.has_error(function() scheduler.new(model, { prefill_chunk = -1 }) end)
    assert.has_error(function() scheduler.new(model, { decode_step = 3 }) end)
    assert.has_error(function() scheduler.new(model, 5) end)
    assert.has_error(function() scheduler.new(model):run(nil, print) end)
  end)
end)
