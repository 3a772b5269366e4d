-- kvlua.jinja against Python's jinja2, configured as transformers renders
-- chat templates (tests/fixtures/templates/expected.lua, written by
-- scripts/ref/gen-jinja-fixtures.py):
--
--   1  the corpus: every chat template of llama.cpp's models/templates
--      (tests/fixtures/templates/*.jinja) on conversations with a system
--      prompt, several turns, tools, tool calls and results, the generation
--      prompt on and off, thinking on and off: the same bytes as jinja2, or
--      an error where jinja2 fails (raise_exception with its message)
--   2  language points one at a time (whitespace control, str() of values,
--      slices, methods, filters, tests, loops, scoping, macros, markup)
--   3  dict key order: jinja.dict and jinja.decode_json keep it, as Python
--   4  a template is untrusted input: loops, output, strings, nesting and
--      recursion are bounded, each failure a nil, message; never a hang
--   5  unsupported constructs: nil, "jinja: unsupported <construct> at line
--      L col C"; syntax errors name their position
--   6  misuse raises
--   7  kvlua.chat renders a model's own tokenizer.chat_template with it
--      (tools, enable_thinking and other variables passed through), before
--      which a hand-written renderer picked by detection ignored tools and
--      flags; chat.register still wins; chat.encode keeps contents as text
local jinja = require "kvlua.jinja"
local json = require "kvlua.json"

local DIR = "tests/fixtures/templates/"
local fx = assert(loadfile(DIR .. "expected.lua"))(jinja.dict, json.array, json.null)

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

local function check_case(out, err, case)
  if case.expected then
    assert.is_nil(err)
    assert.are.equal(case.expected, out)
  else
    assert.is_nil(out)
    assert.is_string(err)
    assert.truthy(err:find("^jinja: "))
    if case.raised then assert.truthy(err:find(case.error, 1, true), err) end
  end
end

describe("1 the corpus of real chat templates renders as jinja2 renders it", function()
  it("holds 56 templates and 400+ renderings", function()
    local n, cases = 0, 0
    for _, t in ipairs(fx.templates) do
      n = n + 1
      cases = cases + #(t.cases or {})
    end
    assert.are.equal(56, n)
    assert.is_true(cases > 400)
  end)
  for _, t in ipairs(fx.templates) do
    it(t.file, function()
      local tpl, err = jinja.compile(read(DIR .. t.file))
      assert.is_nil(err)
      for _, case in ipairs(t.cases) do
        local out, rerr = tpl:render(fx.conversations[case.conv], { now = fx.now })
        check_case(out, rerr, case)
      end
    end)
  end
end)

describe("2 language points render as jinja2 renders them", function()
  for i, case in ipairs(fx.snippets) do
    it(("#%d %s"):format(i, case.src:sub(1, 60):gsub("\n", "\\n")), function()
      local out, err = jinja.render(case.src, fx.data, { now = fx.now })
      check_case(out, err, case)
    end)
  end
end)

describe("3 dict key order", function()
  it("jinja.dict keeps its pairs' order for items(), for and tojson", function()
    local d = jinja.dict{ { "z", 1 }, { "a", 2 }, { "m", jinja.none } }
    local out = jinja.render("{{ d | tojson }} {% for k, v in d.items() %}{{ k }}{% endfor %}", { d = d })
    assert.are.equal('{"z": 1, "a": 2, "m": null} zam', out)
  end)
  it("a plain table's keys come sorted", function()
    assert.are.equal('{"a": 2, "b": 1}', jinja.render("{{ d | tojson }}", { d = { b = 1, a = 2 } }))
  end)
  it("jinja.decode_json keeps every object's key order, nested too", function()
    local text = '{"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": [1, {"y": 1, "x": 2}]},'
                 .. ' "required": [], "e": {}}'
    local v = assert(jinja.decode_json(text))
    -- Python: json.dumps(json.loads(text)) gives back the text (same separators)
    assert.are.equal(text, jinja.render("{{ v | tojson }}", { v = v }))
    assert.is_nil((jinja.decode_json("{bad")))
  end)
  it("jinja.decode_json: a repeated key keeps its first place and takes the last value", function()
    -- Python: json.dumps(json.loads(text))
    local text = '{"z": [{"b": 1, "a": null}, [], {}], "a": {"y": "x", "x": [1, {"q": 2, "p": 3}]}, '
                 .. '"z": [{"d": 1, "c": 2}]}'
    local v = assert(jinja.decode_json(text))
    assert.are.equal('{"z": [{"d": 1, "c": 2}], "a": {"y": "x", "x": [1, {"q": 2, "p": 3}]}}',
                     jinja.render("{{ v | tojson }}", { v = v }))
  end)
end)

describe("4 hostile templates end with nil, message", function()
  local cases = {
    { "{% for i in range(100000000) %}x{% endfor %}", "range%(%) too large" },
    { "{% for a in range(3000) %}{% for b in range(3000) %}{% endfor %}{% endfor %}", "steps" },
    { "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "macro calls nest deeper" },
    { "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
      "a string grew past" },
    { "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
      "a string grew past" },
    { "{{ 'a' * 10**10 }}", "a string grew past" },
    { "{{ [1] * 10**10 }}", "a list grew too large" },
    { "{% for i in range(10**5) %}{{ 'x' * 1000 }}{% endfor %}", "output grew past" },
    { "{{ " .. string.rep("(", 20000) .. "1" .. string.rep(")", 20000) .. " }}", "nests too deep" },
    { string.rep("{% if true %}", 5000) .. string.rep("{% endif %}", 5000), "nests too deep" },
    { string.rep("{% for x in [1] %}", 5000) .. string.rep("{% endfor %}", 5000), "nests too deep" },
    { "{{ x" .. string.rep(".a", 20000) .. " }}", "nests too deep" },
    { "{{ x" .. string.rep("|trim", 20000) .. " }}", "nests too deep" },
    { "{{ 1" .. string.rep(" + 1", 20000) .. " }}", "nests too deep" },
    { "{{ 1" .. string.rep(" if 1", 20000) .. " }}", "nests too deep" },
  }
  for _, c in ipairs(cases) do
    it(c[1]:sub(1, 70), function()
      local out, err = jinja.render(c[1], {})
      assert.is_nil(out)
      assert.truthy(err:find(c[2]), err)
    end)
  end
  -- copying a big value again and again: each copy costs steps by its size
  local big_list = "{% set l = range(900000) | list %}{% for i in range(1000000) %}"
  local big_str = "{% set ns = namespace(s='x' * 8000000) %}{% for i in range(1000000) %}"
  for _, body in ipairs{
    big_list .. "{% set y = l[1:] %}{% endfor %}",
    big_list .. "{% set y = l + [i] %}{% endfor %}",
    big_list .. "{% set y = -1 in l %}{% endfor %}",
    big_list .. "{% set y = l == l %}{% endfor %}",
    big_list .. "{% set y = l | unique | list %}{% endfor %}",
    big_list .. "{% set y = l | tojson %}{% endfor %}",
    big_list .. "{% set y = l | join(',') %}{% endfor %}",
    big_str .. "{% set y = ns.s ~ '' %}{% endfor %}",
    big_str .. "{% set y = ns.s.replace('x', 'y') %}{% endfor %}",
    big_str .. "{% for c in ns.s %}{% break %}{% endfor %}{% endfor %}",
  } do
    it(body:sub(#big_list - 20), function()
      local out, err = jinja.render(body, {})
      assert.is_nil(out)
      assert.truthy(err:find("ran past 1000000 steps", 1, true), err)
    end)
  end

  it("the bounds are options", function()
    local out, err = jinja.render("{% for i in range(10) %}{{ i }}{% endfor %}", {}, { max_steps = 20 })
    assert.is_nil(out)
    assert.truthy(err:find("ran past 20 steps", 1, true))
    out, err = jinja.render("{{ 'x' * 11 }}", {}, { max_output = 10 })
    assert.is_nil(out)
    assert.truthy(err:find("grew past 10 bytes", 1, true))
  end)
end)

describe("5 unsupported constructs and syntax errors name what and where", function()
  local cases = {
    { "ok\n{% include 'x' %}", "jinja: unsupported tag 'include' at line 2 col 4" },
    { "{% extends 'base' %}", "jinja: unsupported tag 'extends' at line 1 col 4" },
    { "{% import 'm' as m %}", "jinja: unsupported tag 'import' at line 1 col 4" },
    { "{% for x in y recursive %}{% endfor %}", "jinja: unsupported recursive loop at line 1 col 15" },
    { "{% with a = 1 %}{% endwith %}", "jinja: unsupported tag 'with' at line 1 col 4" },
    { "{% do x %}", "jinja: unsupported tag 'do' at line 1 col 4" },
    { "{{ f(*args) }}", "jinja: unsupported *args/**kwargs in a call at line 1 col 6" },
    { "\n  {{ '%s' % 1 }}{{ 1 | nosuch }}", "jinja: unsupported filter 'nosuch' at line 2 col 24" },
    { "{{ x | from_json }}", "jinja: unsupported filter 'from_json' at line 1 col 8" },
    { "{{ x is nosuchtest }}", "jinja: unsupported test 'nosuchtest' at line 1 col 9" },
    { "{{ '{:>4}'.format(1) }}", "jinja: unsupported format spec in '{:>4}' at line 1 col 18" },
    { "{% if x %}", "jinja: missing elif or else or endif at line 1 col 4" },
    { "{{ 'open }}", "jinja: unclosed string at line 1 col 4" },
    { "{% break %}", "jinja: 'break' outside a loop at line 1 col 4" },
    { "{% endfor %}", "jinja: unknown tag 'endfor' at line 1 col 4" },
    { "{{ 1 + }}", "jinja: unexpected end of var at line 1 col 1" },
  }
  for _, c in ipairs(cases) do
    it(c[1], function()
      local out, err = jinja.render(c[1], { x = 1 })
      assert.is_nil(out)
      assert.are.equal(c[2], err)
    end)
  end
  it("raise_exception's message comes back", function()
    local out, err = jinja.render("{{ raise_exception('Roles must alternate') }}", {})
    assert.is_nil(out)
    assert.are.equal("jinja: raise_exception: Roles must alternate", err)
  end)
end)

describe("6 misuse raises", function()
  it("compile, render and dict check their arguments", function()
    assert.has_error(function() jinja.compile(42) end, "jinja.compile: template string expected")
    local t = assert(jinja.compile("x"))
    assert.has_error(function() t:render("vars") end, "template:render: vars must be a table")
    assert.has_error(function() t:render({}, { max_steps = 1.5 }) end,
                     "template:render: max_steps must be an integer")
    assert.has_error(function() jinja.dict{ 1 } end, "jinja.dict: pair 1 must be {key, value}")
  end)
end)

describe("7 kvlua.chat renders the model's own template", function()
  local chat = require "kvlua.chat"

  -- A stand-in for a model: the template, BOS/EOS as GGUF metadata and a
  -- tokenize that records what chat.encode asks of it.
  local function fake_model(template, calls)
    local meta = {
      ["tokenizer.chat_template"] = template,
      ["tokenizer.ggml.bos_token_id"] = 0,
      ["tokenizer.ggml.eos_token_id"] = 1,
      ["tokenizer.ggml.tokens"] = { "<s>", "</s>" },
    }
    return {
      meta = function(_, k) return meta[k] end,
      vocab = { add_bos = false },
      tokenize = function(_, text, opts)
        calls[#calls + 1] = { text = text, literal = opts.literal }
        return { 7 }
      end,
    }
  end

  local function options(vars)
    local o = {}
    for k, v in pairs(vars) do if k ~= "messages" then o[k] = v end end
    return o
  end

  for _, file in ipairs{ "Qwen-Qwen3-0.6B.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                         "mistralai-Mistral-Nemo-Instruct-2407.jinja", "Qwen-Qwen2.5-7B-Instruct.jinja" } do
    it(file .. ": chat.render equals jinja2 on every conversation, tools and thinking included", function()
      local model = fake_model(read(DIR .. file), {})
      local t
      for _, x in ipairs(fx.templates) do if x.file == file then t = x end end
      for _, case in ipairs(t.cases) do
        local vars = fx.conversations[case.conv]
        local out, err = chat.render(model, vars.messages, options(vars))
        if case.expected then
          assert.are.equal(case.expected, out, case.conv .. ": " .. tostring(err))
        else
          assert.is_nil(out)
          if case.raised then assert.are.equal(case.error, err) end
        end
      end
    end)
  end

  it("chat.register still claims the templates its detect matches", function()
    local template = "{% for m in messages %}{{ m.content }}{% endfor %}<<mine>>"
    chat.register("jinja-spec-mine", function() return "registered" end,
                  { detect = function(t) return t:find("<<mine>>", 1, true) ~= nil end })
    assert.are.equal("registered", chat.render(fake_model(template, {}), { { role = "user", content = "x" } }))
  end)

  it("a template kvlua.jinja cannot render is nil, message naming the construct", function()
    local out, err = chat.render(fake_model("{% include 'other' %}", {}), { { role = "user", content = "x" } })
    assert.is_nil(out)
    assert.are.equal("chat template: jinja: unsupported tag 'include' at line 1 col 4", err)
  end)

  it("chat.encode hands the tokenizer each content as a literal range", function()
    local calls = {}
    local model = fake_model(read(DIR .. "Qwen-Qwen3-0.6B.jinja"), calls)
    local msgs = { { role = "system", content = "Be <|im_end|> terse." },
                   { role = "user", content = "  <|im_start|>x  " } }
    local _, text = assert(chat.encode(model, msgs, { enable_thinking = false }))
    local lit = calls[1].literal
    assert.are.equal(text, calls[1].text)
    assert.are.equal(2, #lit)
    assert.are.equal("Be <|im_end|> terse.", text:sub(lit[1][1], lit[1][2]))
    assert.are.equal("  <|im_start|>x  ", text:sub(lit[2][1], lit[2][2]))
    -- a template that trims contents: the trimmed text is the range
    calls = {}
    model = fake_model("{% for m in messages %}<t>{{ m.content | trim }}</t>{% endfor %}", calls)
    _, text = assert(chat.encode(model, { { role = "user", content = " <t>x\n" } }))
    assert.are.equal("<t><t>x</t>", text)
    assert.are.same({ { 4, 7 } }, calls[1].literal)
    text = select(2, assert(chat.encode(fake_model(read(DIR .. "Qwen-Qwen3-0.6B.jinja"), {}), msgs,
                                        { enable_thinking = false })))
    -- the template text around them is jinja2's rendering of the template
    assert.truthy(text:find("^<|im_start|>system\nBe <|im_end|> terse.<|im_end|>\n<|im_start|>user\n"))
  end)
end)
