-- grammar_spec.lua — constrained generation: kvlua.grammar, its states,
-- sampling.grammar and s:generate{grammar =}.
--
-- What is covered:
--   1. bad grammars: nil and "line L, column C: ..." at build time (syntax,
--      undefined rule, left recursion, empty language, hostile sizes);
--   2. masks on the bytes vocabulary (tests/support tiny model): the tokens
--      left are exactly the ones worked out by hand here, UTF-8 split over
--      byte tokens included, EOS only where the grammar can end;
--   3. a corpus of grammars (JSON, arithmetic, lists, a Unicode class) on
--      tiny random models (many seeds) and on the real models (SmolLM2,
--      Gemma 3; greedy and sampled): every finished output is checked by a
--      checker written here, independent of the grammar engine (JSON:
--      Python's json.loads, or kvlua.json without python3; arithmetic: a
--      recursive-descent parser; lists and classes: Lua patterns and utf8);
--   4. finish_reason "grammar": max_tokens before the grammar can end, a
--      grammar the vocabulary cannot write, earlier stages leaving nothing
--      the grammar allows.
local kvlua = require "kvlua"
local sampling = require "kvlua.sampling"
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"

-- ==== the corpus and its independent checkers ===============================

local JSON = require("spec.support.files").read("tests/data/json.gbnf") -- llama.cpp's grammars/json.gbnf

-- A JSON object of a few flat fields: short enough for a random model to close.
-- (Its first version let numbers start with 0, "048": json.loads refused it.)
local JSON_SMALL = [[
root ::= "{" pair ("," pair){0,2} "}"
pair ::= "\"" [a-z]{1,4} "\":" (num | "\"" [a-z ]{0,4} "\"" | "true" | "null")
num ::= "-"? ([0-9] | [1-9] [0-9]{1,2})
]]

local ARITH = [[
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")" | "-" factor
]]

local ARITH_SMALL = [[
root ::= expr
expr ::= term (("+" | "-") term){0,2}
term ::= factor ("*" factor){0,1}
factor ::= [0-9]{1,2} | "(" [0-9] ("+" [0-9])? ")" | "-" [0-9]
]]

local LIST = [[
root ::= ("- " [a-z ]{1,12} "\n"){1,4}
]]

local UNICODE = [[
root ::= "«" [à-öø-ÿα-ω ]{1,12} "»"
]]

local function has_python()
  local p = io.popen("python3 -c 'import json; print(1)' 2>/dev/null")
  local out = p:read("a")
  p:close()
  return out:match("1") ~= nil
end
local PYTHON = has_python()

local function json_ok(text)
  if PYTHON then
    local f = os.tmpname()
    local h = assert(io.open(f, "wb"))
    h:write(text)
    h:close()
    local ok = os.execute(("python3 -c 'import json,sys; json.loads(open(sys.argv[1], encoding=\"utf-8\").read())' %s 2>/dev/null")
      :format(f))
    os.remove(f)
    return ok == true
  end
  local ok = pcall(require("kvlua.json").decode, text)
  return ok
end

-- expr := term (("+"|"-") term)*, term := factor (("*"|"/") factor)*,
-- factor := digits | "(" expr ")" | "-" factor: the whole text, nothing left.
local function arith_ok(text)
  local pos = 1
  local expr
  local function factor()
    local c = text:sub(pos, pos)
    if c == "(" then
      pos = pos + 1
      if not expr() or text:sub(pos, pos) ~= ")" then return false end
      pos = pos + 1
      return true
    elseif c == "-" then
      pos = pos + 1
      return factor()
    end
    local s, e = text:find("^%d+", pos)
    if not s then return false end
    pos = e + 1
    return true
  end
  local function term()
    if not factor() then return false end
    while text:sub(pos, pos) == "*" or text:sub(pos, pos) == "/" do
      pos = pos + 1
      if not factor() then return false end
    end
    return true
  end
  function expr()
    if not term() then return false end
    while text:sub(pos, pos) == "+" or text:sub(pos, pos) == "-" do
      pos = pos + 1
      if not term() then return false end
    end
    return true
  end
  return expr() and pos == #text + 1
end

local function list_ok(text)
  local n = 0
  for line in text:gmatch("([^\n]*)\n") do
    if not line:match("^%- [a-z ]+$") or #line - 2 > 12 then return false end
    n = n + 1
  end
  return n >= 1 and n <= 4 and text:sub(-1) == "\n" and not text:find("\n\n")
end

local function unicode_ok(text)
  if not utf8.len(text) then return false end
  local cps = {}
  for _, c in utf8.codes(text) do cps[#cps + 1] = c end
  if cps[1] ~= 0xAB or cps[#cps] ~= 0xBB or #cps < 3 or #cps > 14 then return false end
  for i = 2, #cps - 1 do
    local c = cps[i]
    if not ((c >= 0xE0 and c <= 0xF6) or (c >= 0xF8 and c <= 0xFF) or (c >= 0x3B1 and c <= 0x3C9) or c == 0x20) then
      return false
    end
  end
  return true
end

local function json_small_ok(text)
  -- the grammar's own shape, by patterns, and valid JSON
  if not text:match('^{.*}$') then return false end
  return json_ok(text)
end

-- ==== helpers ===============================================================

local generate = require("spec.support.generation").text

local function ids_set(list)
  local t = {}
  for _, id in ipairs(list) do t[id] = true end
  return t
end

local function sorted(list)
  table.sort(list)
  return list
end

-- ==== 1. bad grammars ========================================================

describe("kvlua.grammar: a bad grammar is nil and line:column at build time", function()
  local cases = {
    { "root ::= \"a\" (", "line 1, column 14: unclosed '('" },
    { "root ::= \"a\"\nroot2 ::= x\n", "line 2, column 11: undefined rule 'x'" },
    { "root ::= a\na ::= root \"x\"\n", "line 1, column 1: left recursion" },
    { "root ::= e root | \"y\"\ne ::= \"\"\n", "left recursion: rule 'root'" },
    { "root ::= \"a\" root\n", "line 1, column 1: the grammar matches no string" },
    { "root ::= [b-a]\n", "line 1, column 11: character range ends before it starts" },
    { "root ::= \"x\"{1000000}\n", "repetition count 1000000 is above the limit 4096" },
    { "start ::= \"x\"\n", "no rule named 'root'" },
  }
  for _, c in ipairs(cases) do
    it(("%q"):format(c[1]), function()
      local g, err = kvlua.grammar(c[1])
      assert.is_nil(g)
      assert.truthy(err:find(c[2], 1, true), err)
    end)
  end

  it("takes a named start rule", function()
    assert.is_nil((kvlua.grammar('start ::= "x"\n')))
    assert.truthy(kvlua.grammar('start ::= "x"\n', { root = "start" }))
  end)

  it("raises for misuse", function()
    assert.has_error(function() kvlua.grammar(nil) end)
    assert.has_error(function() kvlua.grammar("root ::= \"x\"", { root = 1 }) end)
    local g = kvlua.grammar('root ::= "x"')
    g:close()
    g:close() -- idempotent
    assert.has_error(function() g:rules() end, "attempt to use a closed grammar")
  end)

  it("expands repetitions into helper rules", function()
    local g = assert(kvlua.grammar('root ::= "a"{2,3} [0-9]*\n'))
    -- {2,3}: two copies, then one optional copy; [0-9]*: a right-recursive rule
    assert.equal("root ::= [a] [a] root-1 root-2\nroot-1 ::= [a] |\nroot-2 ::= [0-9] root-2 |\n", g:rules())
  end)
end)

-- ==== 2. masks on the bytes vocabulary ======================================

describe("grammar states on the bytes vocabulary", function()
  local m
  setup(function() m = assert(kvlua.load(tiny.llama{ vocab = "bytes" }, { backend = "cpu" })) end)
  teardown(function() m:close(); tiny.cleanup() end)

  it("allows exactly the tokens that continue the sentence", function()
    local g = assert(kvlua.grammar('root ::= "He" [lx] | "!"\n'))
    local st = g:state(m)
    -- by hand: byte tokens H and !, and the word "!" (the words "▁Hello" etc. start with a space)
    assert.same(sorted{ tiny.id(0x48), tiny.id(0x21), tiny.id("!") }, st:allowed())
    assert.is_true(st:accept(tiny.id(0x48)))
    assert.same({ tiny.id(0x65) }, st:allowed())
    local ok, err = st:accept(tiny.id(0x48))
    assert.is_nil(ok)
    assert.truthy(err:find("does not match the grammar"), err)
    assert.is_true(st:accept(tiny.id(0x65))) -- the refusal left the state as it was
    assert.same(sorted{ tiny.id(0x6C), tiny.id(0x78) }, st:allowed())
    assert.is_false(st:can_end())
    local fork = st:clone()
    assert.is_true(fork:accept(tiny.id(0x78)))
    assert.is_true(fork:can_end())
    assert.same({ 2 }, fork:allowed()) -- only </s>
    assert.is_false(st:can_end()) -- the clone moved alone
  end)

  it("masks Logits: refused tokens to -inf, the count of what is left", function()
    local g = assert(kvlua.grammar('root ::= [a-c]\n'))
    local st = g:state(m)
    local vals = {}
    for i = 1, m.vocab.n do vals[i] = i / 100 end
    local l = kvlua.logits(vals)
    l:set(tiny.id(0x62), -math.huge) -- 'b' already out
    local left, allowed = st:mask(l)
    assert.equal(2, left)
    assert.equal(3, allowed)
    for id = 0, m.vocab.n - 1 do
      if id == tiny.id(0x61) or id == tiny.id(0x63) then
        assert.equal(string.unpack("f", string.pack("f", vals[id + 1])), l:get(id))
      else
        assert.equal(-math.huge, l:get(id))
      end
    end
    assert.equal(tiny.id(0x63), l:argmax())
  end)

  it("follows a character split over byte tokens (UTF-8)", function()
    local g = assert(kvlua.grammar('root ::= [é-ë]+\n')) -- C3 A9 .. C3 AB
    local st = g:state(m)
    assert.same(sorted{ tiny.id(0xC3), tiny.id("é") }, st:allowed())
    assert.is_true(st:accept(tiny.id(0xC3)))
    assert.same(sorted{ tiny.id(0xA9), tiny.id(0xAA), tiny.id(0xAB) }, st:allowed())
    assert.is_false(st:can_end())
    assert.is_true(st:accept(tiny.id(0xAA)))
    assert.is_true(st:can_end())
    assert.same(sorted{ 2, tiny.id(0xC3), tiny.id("é") }, st:allowed())
  end)

  it("never allows BOS or unknown, and EOS only at an end", function()
    local g = assert(kvlua.grammar('root ::= "a"?\n'))
    local st = g:state(m)
    local set = ids_set(st:allowed())
    assert.is_true(set[2])
    assert.is_nil(set[1])
    assert.is_nil(set[0])
    assert.is_nil((st:accept(1)))
    assert.has_error(function() st:accept(m.vocab.n) end)
    assert.is_true(st:accept(tiny.id(0x61)))
    assert.same({ 2 }, st:allowed())
    assert.is_true(st:accept(2))
    assert.same({ 2 }, st:allowed())
  end)

  it("sampling.grammar is a stage in any position", function()
    local vals = {}
    for i = 1, m.vocab.n do vals[i] = 0 end
    vals[tiny.id(0x7A) + 1] = 5 -- 'z' is the model's favourite
    vals[tiny.id(0x79) + 1] = 3 -- then 'y'
    local l = kvlua.logits(vals)
    local g1 = assert(sampling.grammar(m, 'root ::= [xy]+'))
    assert.equal(tiny.id(0x79), sampling.chain{ g1, sampling.greedy() }:sample(l))
    local g2 = assert(sampling.grammar('root ::= [xy]+', { model = m }))
    assert.equal(tiny.id(0x79), sampling.chain{ sampling.top_k(5), g2, sampling.dist{ seed = 1 } }:sample(l))
    -- top_k(1) keeps only 'z', which the grammar refuses: nothing is left
    local g3 = assert(sampling.grammar(m, 'root ::= [xy]+'))
    local id, err = sampling.chain{ sampling.top_k(1), g3 }:sample(l)
    assert.is_nil(id)
    assert.truthy(err:find("^grammar: the 2 tokens the grammar allows here were all removed"), err)
    -- unbound: an error, not a crash
    local g4 = assert(sampling.grammar('root ::= "x"'))
    id, err = g4:sample(l)
    assert.is_nil(id)
    assert.truthy(err:find("no model"))
    local bad, msg = sampling.grammar(m, 'root ::= (')
    assert.is_nil(bad)
    assert.truthy(msg:find("line 1, column 10"), msg)
  end)
end)

-- ==== 3. the corpus on tiny random models ===================================

describe("s:generate{grammar =} on tiny random models", function()
  local m
  setup(function() m = assert(kvlua.load(tiny.llama{ vocab = "bytes", seed = 7 }, { backend = "cpu" })) end)
  teardown(function() m:close(); tiny.cleanup() end)

  local corpus = {
    { "json", JSON_SMALL, json_small_ok },
    { "arithmetic", ARITH_SMALL, arith_ok },
    { "list", LIST, list_ok },
    { "unicode", UNICODE, unicode_ok },
  }
  for _, c in ipairs(corpus) do
    it(c[1] .. ": every finished output parses (greedy and 12 seeds)", function()
      local finished = 0
      for seed = 0, 12 do
        local s = m:session{ ctx = 256 }
        local sampler = seed > 0 and sampling.chain{ sampling.temperature(1.5), sampling.dist{ seed = seed } } or nil
        local text, why = generate(s, { prompt = "Hello", grammar = c[2], max_tokens = 200, sampler = sampler })
        assert.truthy(why == "eog" or why == "grammar" or why == "length", why)
        if why == "eog" or why == "length" then
          finished = finished + 1
          assert.is_true(c[3](text), ("%s seed %d: %q"):format(c[1], seed, text))
        else
          assert.truthy(s.grammar_error:find("^grammar: "), s.grammar_error)
        end
        s:close()
      end
      assert.truthy(finished >= 8, ("only %d of 13 outputs finished"):format(finished))
    end)
  end
end)

describe("greedy generate{grammar =} checks the argmax before any mask", function()
  teardown(function() tiny.cleanup() end)

  it("gives what a full mask every token gives", function()
    local m = assert(kvlua.load(tiny.llama{ vocab = "bytes", seed = 11 }, { backend = "cpu" }))
    for _, g in ipairs{ JSON_SMALL, ARITH_SMALL, LIST, UNICODE } do
      local s = m:session{ ctx = 256 }
      local lazy = { generate(s, { prompt = "Hello", grammar = g, max_tokens = 60 }) }
      local full = { generate(s, { prompt = "Hello", max_tokens = 60,
                                    sampler = sampling.chain{ assert(sampling.grammar(m, g)), sampling.greedy() } }) }
      -- the stage ends with the chain's "error: grammar: ..." where generate{grammar =} says "grammar"
      if full[2]:find("^error: grammar: ") then full[2] = "grammar" end
      assert.same(full, lazy)
      s:close()
    end
    m:close()
  end)

  it("st:allows(id) answers without moving the state", function()
    local m = assert(kvlua.load(tiny.llama{ vocab = "bytes" }, { backend = "cpu" }))
    local st = assert(kvlua.grammar('root ::= "ab"')):state(m)
    assert.is_true(st:allows(tiny.id(0x61)))
    assert.is_false(st:allows(tiny.id(0x62)))
    assert.is_false(st:allows(2))
    assert.is_true(st:allows(tiny.id(0x61))) -- still at the start
    m:close()
  end)
end)

-- ==== 4. finish_reason "grammar" =============================================

describe("finish_reason = \"grammar\"", function()
  teardown(function() tiny.cleanup() end)

  it("when max_tokens comes before the grammar can end", function()
    local m = assert(kvlua.load(tiny.llama{ vocab = "bytes" }, { backend = "cpu" }))
    local s = m:session{ ctx = 64 }
    local text, why = generate(s, { prompt = "Hello", grammar = 'root ::= "abcdefgh"', max_tokens = 3 })
    assert.equal("grammar", why)
    assert.equal("abc", text)
    assert.equal("grammar: max_tokens reached before the grammar could end", s.grammar_error)
    -- the same length is fine for a grammar that can end there
    text, why = generate(s, { prompt = "Hello", grammar = 'root ::= "abc" "d"*', max_tokens = 3 })
    assert.equal("length", why)
    assert.equal("abc", text)
    m:close()
  end)

  it("when the vocabulary cannot write what the grammar needs", function()
    local m = assert(kvlua.load(tiny.llama{}, { backend = "cpu" })) -- tokens t3 .. t63
    local s = m:session{ ctx = 64 }
    local text, why = generate(s, { prompt = { 1, 5 }, grammar = 'root ::= "t3" "x"', max_tokens = 8 })
    assert.equal("grammar", why)
    assert.equal("t3", text)
    assert.truthy(s.grammar_error:find("no token of the vocabulary is allowed"), s.grammar_error)
    m:close()
  end)

  it("a bad grammar ends generate at once with its line and column", function()
    local m = assert(kvlua.load(tiny.llama{}, { backend = "cpu" }))
    local s = m:session{ ctx = 64 }
    local text, why = generate(s, { prompt = { 1, 5 }, grammar = 'root ::= "a" | b\n' })
    assert.equal("", text)
    assert.equal("error: line 1, column 16: undefined rule 'b'", why)
    assert.has_error(function() s:generate{ prompt = { 1 }, grammar = 42 } end)
    m:close()
  end)
end)

-- ==== 3b. the corpus on the real models =====================================

for _, name in ipairs{ "smollm2", "gemma3" } do
  local path = models.path(name)
  local d = path and describe or pending
  d("s:generate{grammar =} on " .. name .. " (greedy and sampled)", function()
    local m
    setup(function() m = assert(kvlua.load(path, { backend = "cpu" })) end)
    teardown(function() if m then m:close() end end)

    local corpus = {
      { "json", JSON, json_ok, "A JSON object describing a cat, with its name and age:\n", 96 },
      { "arithmetic", ARITH, arith_ok, "An arithmetic expression that equals 42:\n", 32 },
      { "list", LIST, list_ok, "Three fruits, as a list:\n", 48 },
      { "unicode", UNICODE, unicode_ok, "Un mot grec entre guillemets : ", 24 },
    }
    for _, c in ipairs(corpus) do
      it(c[1], function()
        for seed = 0, 3 do
          local s = m:session{ ctx = 512 }
          local sampler = seed > 0 and sampling.from_opts{ temp = 0.9, seed = seed } or nil
          local text, why = generate(s, { prompt = c[4], grammar = c[2], max_tokens = c[5], sampler = sampler })
          if why == "eog" or why == "length" then
            assert.is_true(c[3](text), ("%s %s seed %d: %q"):format(name, c[1], seed, text))
          else
            assert.equal("grammar", why, s.grammar_error)
            assert.equal("grammar: max_tokens reached before the grammar could end", s.grammar_error)
          end
          s:close()
        end
      end)
    end
  end)
end
