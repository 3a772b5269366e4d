-- kvlua.json_schema: a JSON schema as a GBNF grammar.
--
-- The grammar is read back by spec/support/gbnf.lua (a GBNF reader written
-- for the specs, apart from the engine's grammar code), which matches
-- strings against it and draws random strings from it. Two checks:
--   sound     every string drawn from the grammar is valid JSON that the
--             schema accepts, by Python's jsonschema (one python process per
--             schema; pending without it), formats checked as RFC 3339 /
--             ISO dates and UUIDs;
--   complete  hand-written instances are matched or refused as the schema
--             says (and integer ranges number by number, by arithmetic).
-- Where the module has the engine's grammar (kvlua.grammar), every match is
-- asked of it too and must agree, and generation under json_schema runs end
-- to end (tiny model and SmolLM2), its outputs validated the same way.
-- Unsupported keywords give nil, a message naming them.
local json_schema = require "kvlua.json_schema"
local json = require "kvlua.json"
local gbnf = require "spec.support.gbnf"
local files = require "spec.support.files"
local generate = require("spec.support.generation").text

-- The engine's grammar (kvlua.grammar), when the module has it, and a
-- tiny model whose vocabulary its states need.
local kvlua = require "kvlua"
local tiny = require "spec.support.tiny_models"
local engine_model
local function engine()
  if not kvlua.grammar then return nil end
  if not engine_model then engine_model = assert(kvlua.load(tiny.llama { vocab = "bytes", seed = 9 }, { threads = 1 })) end
  return engine_model
end
teardown(function()
  if engine_model then engine_model:close() end
  tiny.cleanup()
end)

-- The schema's grammar, read by the spec's reader; with the engine's
-- grammar at hand, every g:match asks both and checks they agree.
local function grammar(schema)
  local text, err = json_schema.to_gbnf(schema)
  assert(text, err)
  local g = gbnf.parse(text)
  local m = engine()
  if m then
    local eg = assert(kvlua.grammar(text))
    local read = g.match
    g.match = function(self, str)
      local r = read(self, str)
      local st = eg:state(m)
      local e = (st:accept_text(str) and st:can_end()) and true or false
      assert.equals(r, e, "the engine's grammar and the spec's reader agree on " .. str)
      return r
    end
  end
  return g, text
end

-- ==== Python's jsonschema ======================================================

local PY = [[
import json, sys, re, uuid, datetime
import jsonschema
def is_date(s):
    if not isinstance(s, str): return True
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", s): return False
    datetime.date.fromisoformat(s); return True
def is_time(s):
    if not isinstance(s, str): return True
    m = re.fullmatch(r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?(Z|[+-]\d{2}:\d{2})", s)
    if not m: return False
    datetime.time.fromisoformat(s.replace("Z", "+00:00")); return True
def is_date_time(s):
    if not isinstance(s, str): return True
    d, sep, t = s.partition("T")
    return sep == "T" and is_date(d) and is_time(t)
def is_uuid(s):
    if not isinstance(s, str): return True
    if not re.fullmatch(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}", s): return False
    uuid.UUID(s); return True
fc = jsonschema.FormatChecker([])
for name, fn in (("date", is_date), ("time", is_time), ("date-time", is_date_time), ("uuid", is_uuid)):
    fc.checks(name, raises=(ValueError,))(fn)
job = json.load(open(sys.argv[1]))
cls = jsonschema.validators.validator_for(job["schema"])
v = cls(job["schema"], format_checker=fc)
for text in job["instances"]:
    try:
        inst = json.loads(text)
        errs = sorted(e.message for e in v.iter_errors(inst))
        print(json.dumps(errs[0] if errs else None))
    except Exception as e:
        print(json.dumps("not JSON: %s" % e))
]]

local has_python = os.execute("python3 -c 'import jsonschema' >/dev/null 2>&1")

-- The messages of Python's jsonschema for each instance (nil: valid).
local function validate(schema_text, instances)
  local script = files.write_temp(PY)
  local job = files.write_temp(json.encode { schema = json.decode(schema_text), instances = json.array(instances) })
  local p = assert(io.popen("python3 " .. script .. " " .. job))
  local out = {}
  for line in p:lines() do
    local v = json.decode(line)
    out[#out + 1] = v ~= json.null and v or false
  end
  p:close()
  os.remove(script)
  os.remove(job)
  assert.equals(#instances, #out, "python answered every instance")
  return out
end

-- Draws n strings from the schema's grammar and has Python validate them.
local function check_sound(schema_text, n, seed)
  local g = grammar(schema_text)
  local rng = gbnf.rng(seed or 1)
  local drawn = {}
  for k = 1, n do
    drawn[k] = g:sample(rng)
    assert.is_true(g:match(drawn[k]), "the reader matches what it drew: " .. drawn[k])
  end
  local res = validate(schema_text, drawn)
  for k, msg in ipairs(res) do
    assert.is_false(msg, ("drawn %d: %s\n%s"):format(k, drawn[k], tostring(msg)))
  end
  return drawn
end

local function sound(name, schema_text, n)
  it("sound: " .. name, function()
    if not has_python then return pending("python3 with jsonschema not available (pip install jsonschema)") end
    check_sound(schema_text, n or 40)
  end)
end

-- ==== schemas ==================================================================

local TOOL = [[{"type": "object", "properties": {
  "name": {"const": "get_weather"},
  "arguments": {"type": "object", "properties": {
    "location": {"type": "string", "minLength": 1, "maxLength": 40, "description": "a city"},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "hourly": {"type": "boolean"}},
    "required": ["location"], "additionalProperties": false}},
  "required": ["name", "arguments"]}]]

local TOOLS = [[{"oneOf": [
  {"type": "object", "properties": {"tool": {"const": "search"}, "query": {"type": "string"}}, "required": ["tool", "query"]},
  {"type": "object", "properties": {"tool": {"const": "calc"}, "expr": {"type": "string", "pattern": "^[0-9+*/() -]{1,20}$"}},
   "required": ["tool", "expr"]},
  {"type": "null"}]}]]

local TREE = [[{"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer", "minimum": -5, "maximum": 5},
    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
    "required": ["value"]}},
  "$ref": "#/$defs/node"}]]

local PATTERNS = [[{"type": "object", "properties": {
  "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
  "has_abc": {"type": "string", "pattern": "ab+c"},
  "hex": {"type": "string", "pattern": "^(foo|bar)?[0-9a-f]{2,4}$"},
  "mail": {"type": "string", "pattern": "^\\w+@\\w+\\.com$"},
  "nospace": {"type": "string", "pattern": "^[^\\s]{1,5}$"},
  "quote": {"type": "string", "pattern": "^\"[\\\\/]+\"$"},
  "any": {"type": "string", "pattern": "^.{3}x*?$"},
  "ws": {"type": "string", "pattern": "^\\s\\S(?:a|\\.|\\x41|\\u00e9)$"}},
  "required": ["code", "has_abc", "hex", "mail", "nospace", "quote", "any", "ws"]}]]

local FORMATS = [[{"type": "array", "prefixItems": [
  {"type": "string", "format": "date"}, {"type": "string", "format": "time"},
  {"type": "string", "format": "date-time"}, {"type": "string", "format": "uuid"}], "items": false}]]

local NUMBERS = [[{"type": "object", "properties": {
  "a": {"type": "integer", "minimum": -17, "exclusiveMaximum": 1234},
  "b": {"type": "integer", "exclusiveMinimum": 99},
  "c": {"type": "integer", "maximum": -12},
  "d": {"type": "number", "minimum": -2.5, "maximum": 10},
  "e": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
  "f": {"type": "number", "exclusiveMinimum": -7.5},
  "g": {"type": "number", "maximum": -3},
  "h": {"type": "integer", "minimum": 5.5, "maximum": 5.9e1},
  "i": {"type": "number"}, "j": {"type": "integer"}},
  "required": ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]}]]

local ARRAYS = [[{"type": "object", "properties": {
  "two_to_four": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
  "at_least_one": {"type": "array", "items": {"type": "boolean"}, "minItems": 1},
  "tuple_rest": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "null"}], "items": {"type": "integer"}, "maxItems": 4},
  "empty": {"type": "array", "maxItems": 0},
  "unique1": {"type": "array", "uniqueItems": true, "maxItems": 1},
  "anything": {"type": "array"}},
  "required": ["two_to_four", "at_least_one", "tuple_rest", "empty", "unique1", "anything"]}]]

local DRAFT7 = [[{"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {
  "tuple": {"type": "array", "items": [{"type": "integer"}, {"type": "boolean"}]},
  "e": {"type": "number", "exclusiveMinimum": 0.5, "maximum": 2}}, "required": ["tuple", "e"]}]]

local MISC = [[{"type": "object", "properties": {
  "maybe": {"type": ["string", "null"], "maxLength": 3},
  "mixed": {"enum": ["x", 1, 2.5, null, true, {"k": [1, "é"]}, [1, 2], "quo\"te"]},
  "fixed": {"const": {"a": [1, {"b": null}]}},
  "either": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 2}, {"$ref": "#/$defs/pt"}]},
  "free": {"type": "object"}, "whatever": {}, "yes": true,
  "strict": {"type": "object", "additionalProperties": false},
  "map": {"type": "object", "additionalProperties": {"type": "integer"}},
  "known_and_more": {"type": "object", "properties": {"a": {"type": "string"}, "ab": {"type": "string"}},
    "additionalProperties": {"type": "boolean"}}},
  "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}}}]]

local OPTIONAL = [[{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
  "c": {"type": "boolean"}, "d": {"type": "null"}}, "additionalProperties": {"type": "string", "maxLength": 2}}]]

-- ==== soundness ================================================================

describe("json_schema.to_gbnf: every string of the grammar is valid (Python's jsonschema)", function()
  sound("a tool call (const name, bounded string, enum, integer range, no extra keys)", TOOL)
  sound("oneOf told apart by a const property, and null", TOOLS)
  sound("a recursive tree through $ref/$defs", TREE)
  sound("string patterns (anchored or not, classes, groups, escapes, lazy)", PATTERNS, 60)
  sound("formats date, time, date-time, uuid", FORMATS, 60)
  sound("integer and number ranges (exclusive, one-sided, fractional bounds)", NUMBERS, 60)
  sound("arrays: minItems/maxItems, prefixItems, items false", ARRAYS)
  sound("draft 7: items as an array", DRAFT7)
  sound("types arrays, enum, const, anyOf, free objects, additionalProperties", MISC, 60)
  sound("optional properties only, then additional ones", OPTIONAL, 60)
  sound("true (any value)", "true", 60)
end)

-- ==== completeness ===============================================================

describe("json_schema.to_gbnf: what the grammar matches", function()
  it("a tool call: the instances a model would write, and not the invalid ones", function()
    local g = grammar(TOOL)
    for _, s in ipairs {
      '{"name": "get_weather", "arguments": {"location": "Paris"}}',
      '{"name":"get_weather","arguments":{"location":"Paris","unit":"celsius","days":3,"hourly":true}}',
      '{\n  "name": "get_weather",\n  "arguments": {\n    "location": "S\\u00e3o Paulo", "days": 14\n  }\n}',
      '{"name": "get_weather", "arguments": {"location": "\\"q\\"", "hourly": false}}',
    } do assert.is_true(g:match(s), s) end
    for _, s in ipairs {
      '{"name": "get_weather", "arguments": {}}', -- location required
      '{"name": "get_weather", "arguments": {"location": ""}}', -- minLength 1
      '{"name": "get_weather", "arguments": {"location": "P", "days": 15}}',
      '{"name": "get_weather", "arguments": {"location": "P", "days": 0}}',
      '{"name": "get_weather", "arguments": {"location": "P", "unit": "kelvin"}}',
      '{"name": "get_weather", "arguments": {"location": "P", "wind": 1}}', -- no extra keys
      '{"name": "other", "arguments": {"location": "P"}}',
      '{"name": "get_weather", "arguments": {"location": "P"}} ', -- nothing after the value
      '{"name": "get_weather", "arguments": {"location": "P",}}',
      '{"name": "get_weather", "arguments": {"location": "P"}, "x": 1}',
      '{"name": "get_weather", "arguments": {"location": "\x01"}}', -- a raw control character
      '{"name": "get_weather",' .. (" "):rep(30) .. '"arguments": {"location": "P"}}', -- bounded whitespace
    } do assert.is_false(g:match(s), s) end
  end)

  it("properties: the required ones first in the text's order, then the optional ones", function()
    local g = grammar('{"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "integer"},'
      .. ' "m": {"type": "integer"}}, "required": ["m", "z"]}')
    assert.is_true(g:match('{"z": 1, "m": 2}'))
    assert.is_true(g:match('{"z": 1, "m": 2, "a": 3}'))
    assert.is_false(g:match('{"m": 2, "z": 1}'))
    assert.is_false(g:match('{"a": 3, "z": 1, "m": 2}'))
    -- a Lua table has no key order: required in `required` order, optional ones by name
    g = grammar { type = "object", properties = { z = { type = "integer" }, a = { type = "integer" },
      b = { type = "integer" }, m = { type = "integer" } }, required = { "m", "z" } }
    assert.is_true(g:match('{"m": 2, "z": 1, "a": 3, "b": 4}'))
    assert.is_true(g:match('{"m": 2, "z": 1, "b": 4}'))
    assert.is_false(g:match('{"z": 1, "m": 2}'))
    assert.is_false(g:match('{"m": 2, "z": 1, "b": 4, "a": 3}'))
  end)

  it("a repeated key in the schema text: the last value, in the first place (as Python's json.loads)", function()
    -- Python: json.loads(text)["properties"] == {"b": {...}, "c": {...}}, in that order
    local g = grammar('{"type": "object", "properties": {"a": {"type": "string"}},'
      .. ' "required": ["b", "c"], "properties": {"b": {"type": "integer"}, "c": {"type": "integer"}}}')
    assert.is_true(g:match('{"b": 1, "c": 2}'))
    assert.is_false(g:match('{"c": 2, "b": 1}'))
    assert.is_false(g:match('{"a": "x", "b": 1, "c": 2}'))
  end)

  it("optional properties only: any in order, each once, commas right, then extra keys", function()
    local g = grammar(OPTIONAL)
    for _, s in ipairs { "{}", '{"a": 1}', '{"b": "x"}', '{"d": null}', '{"a": 1, "c": true}', '{"b": "", "c": false, "d": null}',
      '{"a": 1, "b": "x", "c": true, "d": null}', '{"zz": "ok"}', '{"c": true, "zz": "ok", "y": ""}' } do
      assert.is_true(g:match(s), s)
    end
    for _, s in ipairs { '{"b": "x", "a": 1}', '{"a": 1 "b": "x"}', '{, "a": 1}', '{"a": 1,}', '{"a": 1, "a": 2}',
      '{"zz": "long"}', '{"zz": "ok", "a": 1}', '{"a": "ok"}' } do
      assert.is_false(g:match(s), s)
    end
  end)

  it("additional keys never repeat a listed one (a trie of the names)", function()
    local g = grammar(MISC)
    local function obj(inner) return '{"known_and_more": {' .. inner .. '}}' end
    for _, s in ipairs { '"a": "x", "b": true', '"ab": "x", "abc": true', '"a": "x", "": false', '"aa": true',
      '"b": true, "ba": false', '"abb": true' } do
      assert.is_true(g:match(obj(s)), s)
    end
    for _, s in ipairs { '"a": "x", "a": true', '"ab": true', '"a": true', '"a": "x", "ab": true', '"a\\u0062c": true' } do
      assert.is_false(g:match(obj(s)), s)
    end
  end)

  it("integer ranges, number by number (arithmetic is the reference)", function()
    for _, r in ipairs {
      { -17, 1233 }, { 0, 150 }, { 7, 7 }, { -100, -3 }, { 95, 105 }, { 37, nil }, { nil, -12 }, { 1, 9 }, { 10, 99 },
      { -1, 0 }, { 0, 0 }, { 999, 1001 }, { nil, 120 }, { -250, nil },
    } do
      local lo, hi = r[1], r[2]
      local s = { type = "integer" }
      s.minimum, s.maximum = lo, hi
      local g = grammar(s)
      for n = (lo or hi) - 300, (hi or lo) + 300 do
        local want = (lo == nil or n >= lo) and (hi == nil or n <= hi)
        assert.equals(want, g:match(tostring(n)), ("%s in [%s, %s]"):format(n, tostring(lo), tostring(hi)))
      end
      assert.is_false(g:match("0" .. tostring(math.abs(lo or hi) + 1)), "no leading zero")
      assert.is_false(g:match("-0"))
      assert.is_false(g:match("1.0"))
    end
    -- exclusive bounds and fractional bounds round inwards
    local g = grammar('{"type": "integer", "exclusiveMinimum": 9.5, "exclusiveMaximum": 12}')
    for n = 0, 20 do assert.equals(n >= 10 and n <= 11, g:match(tostring(n)), n) end
  end)

  it("number ranges: integers, and fractions whose whole unit lies within", function()
    local g = grammar('{"type": "number", "minimum": -2.5, "maximum": 10}')
    for _, s in ipairs { "0", "10", "-2", "9.999", "-1.5", "-0.25", "3.05" } do assert.is_true(g:match(s), s) end
    for _, s in ipairs { "11", "-3", "10.5", "-2.6", "1e1", "-0", "01.5" } do assert.is_false(g:match(s), s) end
    g = grammar('{"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}')
    assert.is_true(g:match("0.5"))
    for _, s in ipairs { "0", "1", "1.5", "-0.5" } do assert.is_false(g:match(s), s) end
  end)

  it("patterns: anchors, unanchored search, JSON escapes inside the string", function()
    local g = grammar(PATTERNS)
    local good = { code = "AB-123", has_abc = "xxabbbcyy", hex = "foo0f", mail = "a_1@b.com", nospace = "a!b",
      quote = '\\"\\\\/\\"', any = "é?bxx", ws = "\\tQé" }
    local function inst(over)
      local parts = {}
      for _, k in ipairs { "code", "has_abc", "hex", "mail", "nospace", "quote", "any", "ws" } do
        parts[#parts + 1] = ('"%s": "%s"'):format(k, over[k] or good[k])
      end
      return "{" .. table.concat(parts, ", ") .. "}"
    end
    assert.is_true(g:match(inst {}))
    for k, v in pairs { code = "ab-123", has_abc = "ac", hex = "foo0", mail = "a@b.org", nospace = "a b", quote = '\\"\\"',
      any = "ab", ws = "  a" } do
      assert.is_false(g:match(inst { [k] = v }), k .. " = " .. v)
    end
    assert.is_true(g:match(inst { hex = "ab12" }))
    assert.is_true(g:match(inst { has_abc = "abc" }))
  end)

  it("oneOf with a discriminating const, anyOf, enum and const values as JSON text", function()
    local g = grammar(TOOLS)
    assert.is_true(g:match('{"tool": "search", "query": "x"}'))
    assert.is_true(g:match('{"tool": "calc", "expr": "(1+2)*3"}'))
    assert.is_true(g:match("null"))
    assert.is_false(g:match('{"tool": "calc", "query": "x"}'))
    g = grammar(MISC)
    for _, s in ipairs { '{"mixed": 2.5}', '{"mixed": {"k":[1,"é"]}}', '{"mixed": "quo\\"te"}', '{"fixed": {"a":[1,{"b":null}]}}',
      '{"either": 3}', '{"either": "ab"}', '{"either": {"x": 1.5, "y": -2}}', '{"maybe": null}', '{"maybe": "abc"}' } do
      assert.is_true(g:match(s), s)
    end
    for _, s in ipairs { '{"mixed": 3}', '{"fixed": {"a":[1]}}', '{"either": -1}', '{"maybe": "abcd"}', '{"strict": {"a": 1}}' } do
      assert.is_false(g:match(s), s)
    end
  end)
end)

-- ==== refusals ===================================================================

describe("json_schema.to_gbnf: what it does not support is refused by name", function()
  for _, case in ipairs {
    { '{"type": "integer", "multipleOf": 3}', "unsupported keyword 'multipleOf'" },
    { '{"not": {"type": "string"}}', "unsupported keyword 'not'" },
    { '{"allOf": [{"type": "string"}]}', "unsupported keyword 'allOf'" },
    { '{"type": "object", "patternProperties": {"^a": {}}}', "unsupported keyword 'patternProperties'" },
    { '{"type": "object", "minProperties": 1}', "unsupported keyword 'minProperties'" },
    { '{"if": {}, "then": {}}', "unsupported keyword " },
    { '{"type": "array", "uniqueItems": true}', "unsupported keyword 'uniqueItems'" },
    { '{"type": "array", "contains": {}}', "unsupported keyword 'contains'" },
    { '{"type": "string", "format": "email"}', "unsupported format 'email'" },
    { '{"type": "string", "pattern": "^(a)\\\\1$"}', "unsupported escape \\1" },
    { '{"type": "string", "pattern": "^(?=a)"}', "group syntax (?=" },
    { '{"type": "string", "pattern": "a^b"}', "^ is supported only" },
    { '{"type": "string", "pattern": "\\\\bword"}', "unsupported escape \\b" },
    { '{"$ref": "https://example.com/s.json"}', "only references inside the schema" },
    { '{"$ref": "#/$defs/missing"}', "leads nowhere" },
    { '{"type": "string", "minimum": 3}', "'minimum' does not apply to type string" },
    { '{"type": "integer", "nullable": true}', "unsupported keyword 'nullable'" },
    { '{"oneOf": [{"type": "integer"}, {"type": "number"}]}', "oneOf branches 0 and 1 may accept the same value" },
    { '{"type": "string", "pattern": "^a+$", "maxLength": 3}', "only one of pattern, format" },
    { '{"enum": [1, 2], "minimum": 2}', "'minimum' beside enum/const" },
    { '{"type": "integer", "minimum": 1e16}', "minimum: bounds of 1e+15 or more" },
    { '{"type": "integer", "minimum": 5, "maximum": 4}', "no integer lies within" },
    { '{"type": "wat"}', "unknown type 'wat'" },
    { "false", "the schema false allows no value" },
    { '{"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}', "#/properties/a: unsupported format" },
    { '{"type": ', "the schema is not JSON" },
  } do
    it(case[1], function()
      local text, err = json_schema.to_gbnf(case[1])
      assert.is_nil(text)
      assert.is_truthy(err:find(case[2], 1, true), err)
      assert.is_truthy(err:find("^json_schema: "), err)
    end)
  end

  it("misuse raises", function()
    assert.has_error(function() json_schema.to_gbnf(42) end,
      "json_schema.to_gbnf: a schema (table or JSON text) expected, got number")
  end)
end)

-- ==== end to end =================================================================

describe("generation under a JSON schema (kvlua.grammar)", function()
  local sampling = require "kvlua.sampling"
  local models = require "spec.support.models"

  -- Everything bounded (enums, ranges, maxLength, maxItems; whitespace is),
  -- so a finished generation ends on EOG, whatever the weights.
  local BOUNDED = [[{"type": "object", "properties": {
    "name": {"enum": ["search", "calc"]},
    "n": {"type": "integer", "minimum": -50, "maximum": 500},
    "tag": {"type": "string", "maxLength": 6},
    "ok": {"type": "boolean"},
    "when": {"type": "string", "format": "date"},
    "list": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
    "required": ["name", "n"]}]]

  local function need()
    if not kvlua.grammar then return "this build has no kvlua.grammar" end
    if not has_python then return "python3 with jsonschema not available (pip install jsonschema)" end
  end

  -- Generates once per sampler and validates every text with Python.
  local function run(m, prompt, schema_text, samplers, max_tokens, via_stage)
    local texts = {}
    for i, sampler in ipairs(samplers) do
      local s = assert(m:session { ctx = 4096 })
      local opts = { prompt = prompt, max_tokens = max_tokens, sampler = sampler }
      if via_stage then
        opts.sampler = sampling.chain { assert(sampling.json_schema(m, schema_text)), table.unpack(sampler.stages) }
      else
        opts.json_schema = schema_text
      end
      local text, why = generate(s, opts)
      assert.equals("eog", why, "run " .. i .. ": " .. text)
      texts[i] = text
      s:close()
    end
    for i, msg in ipairs(validate(schema_text, texts)) do
      assert.is_false(msg, ("run %d: %s\n%s"):format(i, texts[i], tostring(msg)))
    end
    return texts
  end

  local function samplers(seeds, temp)
    local out = { sampling.from_opts { temp = 0 } }
    for _, seed in ipairs(seeds) do out[#out + 1] = sampling.from_opts { temp = temp, seed = seed, top_k = 0, top_p = 1, min_p = 0 } end
    return out
  end

  it("tiny model: s:generate{json_schema =}, greedy and 8 seeds, and as a sampling stage", function()
    local why = need()
    if why then return pending(why) end
    local m = engine()
    local texts = run(m, { 1 }, BOUNDED, samplers({ 1, 2, 3, 4, 5, 6, 7, 8 }, 1.0), 1500)
    assert.is_true(#texts == 9)
    run(m, { 1 }, BOUNDED, samplers({ 11, 12, 13 }, 1.0), 1500, true)
    run(m, { 1 }, TOOLS:gsub('"query": {"type": "string"}', '"query": {"type": "string", "maxLength": 8}'),
      samplers({ 21, 22, 23 }, 1.0), 1500)
  end)

  it("SmolLM2: a tool call, greedy and 3 seeds", function()
    local why = need()
    if why then return pending(why) end
    local path = models.path("smollm2")
    if not path then return pending("SmolLM2 not available") end
    local m = assert(kvlua.load(path, { threads = 2 }))
    local prompt = m:tokenize("Call the weather tool for Paris as JSON.\n", { add_special = true, parse_special = false })
    local schema = TOOL:gsub('"minLength": 1, "maxLength": 40', '"minLength": 1, "maxLength": 12')
    local texts = run(m, prompt, schema, samplers({ 1, 2, 3 }, 0.8), 300)
    m:close()
    assert.equals(4, #texts)
  end)

  it("batch-generate: an item's json_schema (and one it cannot honour fails alone)", function()
    local why = need()
    if why then return pending(why) end
    local S = require "spec.support.scripts"
    local path = tiny.llama { vocab = "bytes", seed = 9 }
    local lines = {}
    for k = 1, 4 do
      lines[k] = json.encode { id = "j" .. k, prompt = "Hi", json_schema = json.decode(BOUNDED), seed = k, temp = 1.0,
        top_k = 0, top_p = 1, min_p = 0 }
    end
    lines[5] = '{"id": "bad", "prompt": "Hi", "json_schema": {"type": "string", "format": "email"}}'
    lines[6] = '{"id": "plain", "prompt": "Hi", "max_tokens": 3}'
    local input = files.write_temp(table.concat(lines, "\n") .. "\n")
    local r = S.run("batch-generate.lua", { "--model", path, "--file", input, "--max-tokens", "1500", "--ctx", "2048",
      "--quiet", "--no-timings", "--batch", "3" })
    assert.equals(1, r.rc, S.explain(r))
    local out = S.jsonl_lines(r.out)
    assert.equals(6, #out)
    local texts = {}
    for k = 1, 4 do
      assert.equals("eog", out[k].finish_reason)
      texts[k] = out[k].text
    end
    for k, msg in ipairs(validate(BOUNDED, texts)) do assert.is_false(msg, texts[k] .. "\n" .. tostring(msg)) end
    assert.equals("json_schema: #: unsupported format 'email' (supported: date, time, date-time, uuid)", out[5].error)
    assert.equals("length", out[6].finish_reason)
  end)

  it("a schema it cannot honour ends s:generate at once, naming it; misuse raises", function()
    if not kvlua.grammar then return pending("this build has no kvlua.grammar") end
    local m = engine()
    local s = assert(m:session { ctx = 64 })
    local n = 0
    for _ in s:generate { prompt = { 1 }, json_schema = '{"type": "integer", "multipleOf": 2}' } do n = n + 1 end
    assert.equals(0, n)
    assert.equals("error: json_schema: #: unsupported keyword 'multipleOf'", s.finish_reason)
    local st, err = sampling.json_schema(m, { type = "string", format = "email" })
    assert.is_nil(st)
    assert.equals("json_schema: #: unsupported format 'email' (supported: date, time, date-time, uuid)", err)
    assert.has_error(function() s:generate { json_schema = 3 } end,
      "generate: json_schema must be a JSON schema (table or JSON text)")
    assert.has_error(function() s:generate { json_schema = {}, grammar = 'root ::= "x"' } end,
      "generate: give grammar or json_schema, not both")
    assert.has_error(function() sampling.json_schema(m, 3) end,
      "sampling.json_schema: a JSON schema (table or JSON text) expected")
  end)
end)
