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
    { "{{ " .. string.rep("(", 100000) .. "1" .. string.rep(")", 100000) .. " }}", "nests too deep" },
    { string.rep("{% if true %}", 5000) .. string.rep("{% endif %}", 5000), "nests too deep" },
    { string.rep("{% for x in [1] %}", 5000) .. string.rep("{% endfor %}", 5000), "nests too deep" },
    { "{{ x" .. string.rep(".a", 100000) .. " }}", "nests too deep" },
  }
  for _, c in ipairs(cases) do
    it(c[1]:sub(1, 70), function()
      local out, err = jinja.render(c[1], {})
      assert.is_nil(out)
      assert.truthy(err:find(c[2]), err)
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
    { "\n  {{ '%s' % 1 }}", "jinja: unsupported % string formatting at line 2 col 11" },
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
