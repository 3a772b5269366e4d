-- Findings of an audit of kvlua.json and of kvlua.agent's tool calls, one
-- describe per finding, each written to fail before its fix:
--
--   json 1  a raw DEL (0x7f) in a string was refused (RFC 8259 asks only
--           U+0000..U+001F to be escaped)
--   json 2  an integer literal past 64 bits read as math.mininteger
--           (-9223372036854775809) instead of a float, as tonumber reads it
--   json 3  invalid UTF-8 in a string (stray bytes, overlong forms, encoded
--           surrogates, past U+10FFFF) was accepted and passed through
--   json 4  nesting: a document 201 deep was refused or not depending on
--           its innermost value; encoding a deep table raised "stack
--           overflow" rather than a message
--   json 5  encode replaced each byte of an invalid sequence by its own
--           U+FFFD; now one U+FFFD a maximal invalid subpart, as Python's
--           bytes.decode("utf-8", "replace") and the Unicode standard do
--   json 6  decode and encode fuzzed against Python's json module: same
--           verdict and equal values for several thousand documents
--   agent 1 model output {"tool": "echo", "x": 1e999}: inf reached the tool,
--           and a:turn raised when it went into JSON (a tool returning its
--           arguments, the script's report)
--   agent 2 a tool returning a cyclic table (or one holding NaN or a
--           function) made a:turn raise; a string in it that is not UTF-8
--           went to the model as U+FFFD
--   agent 3 a tool result or a model reply that is not valid UTF-8 made
--           the next render raise (chat.render refuses it), and so every
--           later turn; a user message too, after joining the conversation
--   agent 4 a tool returning a function, a userdata, NaN or infinity gave
--           "function: 0x..." or "-nan" to the model as a success
--   agent 5 a tool that yields: "attempt to yield from outside a
--           coroutine", or, inside a coroutine, the turn itself suspended
--   agent 6 a tool raising an error object whose __tostring raises made
--           a:turn raise; an error message that is not UTF-8 went as is
--   agent 7 a huge result went to the model whole (a turn that no longer
--           fits the context); now cut at max_result_bytes, saying so
--   agent 8 argument types: an integer parameter refused 2.0 (an integer
--           for JSON Schema); a number parameter took an infinity
--   agent 9 a call naming an unknown tool now lists the tools
--
-- The agent runs on a tiny random model whose replies come from a
-- scripted sampler (byte tokens spelling a text, then EOS), as in
-- spec/agent_spec.lua.
local kvlua = require "kvlua"
local agent = require "kvlua.agent"
local json = require "kvlua.json"
local tiny = require "spec.support.tiny_models"
local files = require "spec.support.files"

-- ==== a reference: Python's json module ========================================
-- One python3 process reads a batch of jobs, one a line, "KIND HEX":
--   D: the bytes are a JSON text; print its value's canonical form (types
--      kept: i:<int64>, f:<%.17g>), or REFUSE
--   E: the same with numbers by value only (n:), for encode round trips
--   R: print the hex of bytes.decode("utf-8", "replace")
-- The text is decoded from UTF-8 strictly first (as RFC 8259 asks), and
-- NaN / Infinity are refused (Python accepts them by default). A lone
-- surrogate from a \u escape, which Python keeps, is written U+FFFD.

local PYTHON = [[
import sys, json, math, re
if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)
SURROGATE = re.compile("[\ud800-\udfff]")
def fix(s):
    return SURROGATE.sub("\ufffd", s)
def refuse(name):
    raise ValueError("constant " + name)
def pairs(ps):
    d = {}
    for k, v in ps:
        d[fix(k)] = v
    return d
def as_float(i):
    try:
        return float(i)
    except OverflowError:
        return math.inf if i > 0 else -math.inf
def canon(v, typed):
    if v is None: return "null"
    if v is True: return "true"
    if v is False: return "false"
    if isinstance(v, int):
        if -2**63 <= v < 2**63: return ("i:%d" if typed else "n:%d") % v
        v = as_float(v)
    if isinstance(v, float):
        if typed: return "f:%.17g" % v
        if v.is_integer() and -2**63 <= v < 2**63: return "n:%d" % int(v)
        return "n:%.17g" % v
    if isinstance(v, str): return "s:" + fix(v).encode("utf-8").hex()
    if isinstance(v, list): return "[" + ",".join(canon(x, typed) for x in v) + "]"
    items = sorted((k.encode("utf-8").hex(), canon(x, typed)) for k, x in v.items())
    return "{" + ",".join(k + "=" + x for k, x in items) + "}"
for line in sys.stdin:
    kind, _, h = line.strip().partition(" ")
    data = bytes.fromhex(h)
    if kind == "R":
        print(data.decode("utf-8", "replace").encode("utf-8").hex())
        continue
    try:
        v = json.loads(data.decode("utf-8"), parse_constant=refuse, object_pairs_hook=pairs)
        print(canon(v, kind == "D"))
    except (ValueError, RecursionError):
        print("REFUSE")
]]

local function have_python()
  return os.execute("python3 -c 'import json' >/dev/null 2>&1") == true
end

-- fn(...) raises an error whose message contains text.
local function raises(text, fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok, "no error")
  assert.truthy(tostring(err):find(text, 1, true), tostring(err))
end

local function hex(s)
  return (s:gsub(".", function(c) return string.format("%02x", c:byte()) end))
end

-- python(jobs) -> one answer a job; jobs = { {kind, bytes}, ... }
local function python(jobs)
  local lines = {}
  for i, j in ipairs(jobs) do lines[i] = j[1] .. " " .. hex(j[2]) end
  local prog, input = files.write_temp(PYTHON), files.write_temp(table.concat(lines, "\n") .. "\n")
  local p = assert(io.popen("python3 " .. prog .. " < " .. input))
  local out = {}
  for l in p:lines() do out[#out + 1] = l end
  p:close()
  os.remove(prog)
  os.remove(input)
  assert(#out == #jobs, "python answered " .. #out .. " of " .. #jobs .. " jobs")
  return out
end

-- {hex key, canonical value} pairs as an object's canonical form: sorted
-- by key, as Python sorts its (key, value) tuples.
local function object_text(pairs_)
  table.sort(pairs_, function(a, b) return a[1] < b[1] end)
  local parts = {}
  for i, p in ipairs(pairs_) do parts[i] = p[1] .. "=" .. p[2] end
  return "{" .. table.concat(parts, ",") .. "}"
end

-- The canonical form of a decoded value, as the Python side writes it.
local function canon(v, typed)
  if v == json.null then return "null" end
  if type(v) == "boolean" then return tostring(v) end
  if type(v) == "number" then
    if typed then return math.type(v) == "integer" and ("i:%d"):format(v) or ("f:%.17g"):format(v) end
    local i = math.tointeger(v)
    return i and ("n:%d"):format(i) or ("n:%.17g"):format(v)
  end
  if type(v) == "string" then return "s:" .. hex(v) end
  assert(type(v) == "table", type(v))
  local parts = {}
  if json.is_array(v) then
    for i = 1, #v do parts[i] = canon(v[i], typed) end
    return "[" .. table.concat(parts, ",") .. "]"
  end
  for k, x in pairs(v) do parts[#parts + 1] = { hex(k), canon(x, typed) } end
  return object_text(parts)
end

-- ==== random JSON texts ===========================================================

local R = math.random

local function pick(t) return t[R(#t)] end

local function ws() return pick { "", "", "", " ", "\n", "\t", "\r\n  " } end

local function digits(n, lead)
  local t = { lead and tostring(R(1, 9)) or tostring(R(0, 9)) }
  for i = 2, n do t[i] = tostring(R(0, 9)) end
  return table.concat(t)
end

local NUMBERS = { "-9223372036854775808", "-9223372036854775809", "9223372036854775807", "9223372036854775808",
  "18446744073709551616", "1e400", "-1e400", "1E+308", "1e-400", "-1e-400", "-0", "-0.0", "0e0", "0.0e-0",
  "4.9e-324", "2.4703282292062327e-324", "1.7976931348623157e308", "1.7976931348623158e308",
  "1.7976931348623159e308", "123456789012345678901234567890", "0.1", "2.2250738585072011e-308",
  "1" .. string.rep("0", 400), "-" .. string.rep("9", 320) .. ".5" }

local function number()
  local r = R(6)
  if r == 1 then return pick(NUMBERS) end
  if r == 2 then return tostring(R(-1000, 1000)) end
  local int = R(4) == 1 and "0" or digits(R(1, 25), true)
  local frac = R(3) == 1 and ("." .. digits(R(1, 20))) or ""
  local exp = R(3) == 1 and (pick { "e", "E" } .. pick { "", "+", "-" } .. digits(R(1, 3))) or ""
  return (R(2) == 1 and "-" or "") .. int .. frac .. exp
end

-- A random code point, surrogates excluded.
local function codepoint()
  local r = R(4)
  if r == 1 then return R(0x20, 0x7f) end
  if r == 2 then return R(0x80, 0x7ff) end
  if r == 3 then
    local cp = R(0x800, 0xfffd)
    return (cp >= 0xd800 and cp <= 0xdfff) and 0xfffd or cp
  end
  return pick { R(0x10000, 0x10ffff), 0x10ffff, 0xffff, 0xfeff, 0x10000 }
end

local function u_escape(cp)
  local h = ("%04x"):format(cp)
  return "\\u" .. (R(2) == 1 and h:upper() or h)
end

local function string_text()
  local parts = { '"' }
  for _ = 1, R(0, 8) do
    local r = R(10)
    if r <= 3 then
      parts[#parts + 1] = utf8.char(codepoint()):gsub('["\\]', "\\%0")
    elseif r == 4 then
      parts[#parts + 1] = pick { '\\"', "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t", "\127" }
    elseif r == 5 then
      parts[#parts + 1] = u_escape(R(0, 0xffff))                             -- lone surrogates too
    elseif r == 6 then
      local c = R(0x10000, 0x10ffff) - 0x10000                                -- a pair
      parts[#parts + 1] = u_escape(0xd800 + (c >> 10)) .. u_escape(0xdc00 + (c & 0x3ff))
    elseif r == 7 then
      parts[#parts + 1] = u_escape(R(0xd800, 0xdbff)) .. pick { "x", u_escape(R(0, 0xd7ff)), u_escape(R(0xd800, 0xdbff)) }
    else
      parts[#parts + 1] = pick { "a", "key", " ", "é", "日本", "😀" }
    end
  end
  parts[#parts + 1] = '"'
  return table.concat(parts)
end

local function value_text(depth)
  local r = R(depth > 4 and 6 or 9)
  if r <= 2 then return number() end
  if r <= 4 then return string_text() end
  if r == 5 then return pick { "true", "false", "null" } end
  if r == 6 then return pick { "[]", "{}", "[" .. ws() .. "]", "{" .. ws() .. "}" } end
  local items = {}
  if r <= 8 then
    for i = 1, R(1, 5) do items[i] = ws() .. value_text(depth + 1) .. ws() end
    return "[" .. table.concat(items, ",") .. "]"
  end
  for i = 1, R(1, 5) do items[i] = ws() .. string_text() .. ws() .. ":" .. ws() .. value_text(depth + 1) .. ws() end
  return "{" .. table.concat(items, ",") .. "}"
end

local INVALID_UTF8 = { "\x80", "\xbf", "\xc0\x80", "\xc1\xbf", "\xe0\x80\x80", "\xe0\x9f\xbf", "\xed\xa0\x80",
  "\xed\xbf\xbf", "\xf0\x80\x80\x80", "\xf4\x90\x80\x80", "\xf5\x80\x80\x80", "\xf8\x88\x80\x80\x80", "\xfe", "\xff",
  "\xc3", "\xe2\x82", "\xf0\x9f\x98", "\xc3\xc3" }

local SYNTAX = { '"', "\\", "{", "}", "[", "]", ",", ":", " ", "0", "1", "-", "+", ".", "e", "E", "u", "n", "t",
  "\0", "\31", "\127" }

local function mutate(s)
  for _ = 1, R(1, 3) do
    local i = R(1, #s + 1)
    local r = R(6)
    local byte = R(2) == 1 and pick(SYNTAX) or string.char(R(0, 255))
    if r == 1 then s = s:sub(1, i - 1) .. s:sub(i + 1)                         -- delete
    elseif r == 2 then s = s:sub(1, i - 1) .. byte .. s:sub(i)                  -- insert
    elseif r == 3 then s = s:sub(1, i - 1) .. byte .. s:sub(i + 1)              -- replace
    elseif r == 4 then s = s:sub(1, i - 1)                                      -- truncate
    elseif r == 5 then s = s:sub(1, i - 1) .. pick(INVALID_UTF8) .. s:sub(i)    -- invalid UTF-8
    else
      local j = R(i, #s + 1)
      s = s:sub(1, j) .. s:sub(i, j) .. s:sub(j + 1)                            -- duplicate a span
    end
  end
  return s
end

local function random_bytes()
  local t = {}
  for i = 1, R(0, 12) do t[i] = R(2) == 1 and pick(SYNTAX) or string.char(R(0, 255)) end
  return table.concat(t)
end

-- The documents of the decode fuzz: valid ones, mutations, random bytes,
-- strings with invalid UTF-8 inside, nesting up to the limit.
local function documents(n)
  local docs = {}
  for _ = 1, n do
    local r = R(10)
    local doc = ws() .. value_text(0) .. ws()
    if r <= 4 then docs[#docs + 1] = doc
    elseif r <= 8 then docs[#docs + 1] = mutate(doc)
    elseif r == 9 then docs[#docs + 1] = random_bytes()
    else docs[#docs + 1] = '["' .. pick(INVALID_UTF8) .. '", ' .. doc .. "]"
    end
  end
  for _, d in ipairs { 1, 2, 50, 199, 200 } do
    docs[#docs + 1] = string.rep("[", d) .. "1" .. string.rep("]", d)
    docs[#docs + 1] = string.rep('{"a":', d) .. "1" .. string.rep("}", d)
  end
  return docs
end

-- ==== json findings ===============================================================

describe("json 1: a raw DEL in a string", function()
  it("is text (RFC 8259 asks only U+0000..U+001F to be escaped)", function()
    assert.equals("a\127b", json.decode('"a\127b"'))
    assert.is_nil(json.decode('"a\31b"'))
  end)
end)

describe("json 2: integers past 64 bits", function()
  it("read as floats, as Lua's tonumber reads them", function()
    local cases = {
      { "-9223372036854775809", -9223372036854775809.0 },
      { "9223372036854775808", 2.0 ^ 63 },
      { "-9223372036854775808", math.mininteger },
      { "9223372036854775807", math.maxinteger },
      { "18446744073709551617", 2.0 ^ 64 },
      { "-0", 0 },
      { "1e400", math.huge }, -- as Python's json: float("inf")
      { "-1" .. string.rep("0", 400), -math.huge },
      { "1e-400", 0.0 },
    }
    for _, c in ipairs(cases) do
      local v = json.decode(c[1])
      assert.equals(math.type(c[2]), math.type(v), c[1])
      assert.equals(c[2], v, c[1])
    end
    local z = json.decode("-1e-400")
    assert.equals("float", math.type(z))
    assert.equals(-math.huge, 1 / z) -- -0.0
  end)

  it("an infinity read from text cannot be written back: encode raises", function()
    raises("json.encode: inf has no JSON form", json.encode, json.decode("[1e400]"))
  end)
end)

describe("json 3: invalid UTF-8", function()
  it("is refused in strings with the byte where it starts", function()
    for _, bad in ipairs(INVALID_UTF8) do
      local v, err = json.decode('["ok", "ab' .. bad .. '"]')
      assert.is_nil(v, hex(bad))
      assert.equals("invalid UTF-8 in a string at byte 11", err, hex(bad))
    end
    -- the largest code point and a noncharacter are valid
    assert.equals("\u{10FFFF}\u{FFFF}", json.decode('"\u{10FFFF}\u{FFFF}"'))
  end)

  it("outside strings is an unexpected byte, named in hex (the message stays UTF-8)", function()
    assert.same({ nil, "unexpected byte 0xff at byte 2" }, { json.decode("[\xff]") })
    assert.same({ nil, "unexpected byte 0xef at byte 1" }, { json.decode("\xef\xbb\xbf{}") }) -- a BOM, as Python
  end)

  it("a lone surrogate escape becomes U+FFFD, so decoded strings are always UTF-8", function()
    assert.equals("\u{FFFD}x", json.decode('"\\ud800x"'))
    assert.equals("\u{FFFD}\u{FFFD}", json.decode('"\\udc00\\ud800"'))
    assert.equals("\u{FFFD}A", json.decode('"\\ud800\\u0041"'))
    assert.equals("\u{1F600}", json.decode('"\\uD83D\\uDE00"'))
  end)
end)

describe("json 4: nesting", function()
  it("200 levels decode, 201 are refused whatever is inside", function()
    assert.is_table(json.decode(string.rep("[", 200) .. string.rep("]", 200)))
    assert.is_table(json.decode(string.rep("[", 200) .. "1" .. string.rep("]", 200)))
    for _, inner in ipairs { "", "1", "{}" } do
      local v, err = json.decode(string.rep("[", 201) .. inner .. string.rep("]", 201))
      assert.is_nil(v)
      assert.equals("nesting deeper than 200 levels at byte 201", err)
    end
    local v, err = json.decode(string.rep('{"a":', 100000))
    assert.is_nil(v)
    assert.equals("nesting deeper than 200 levels at byte 1001", err)
  end)

  it("encoding a table nested deeper than 200 raises a message, not a stack overflow", function()
    local deep = {}
    local t = deep
    for _ = 1, 100000 do
      t[1] = {}
      t = t[1]
    end
    raises("json.encode: tables nest deeper than 200 levels", json.encode, deep)
  end)
end)

describe("json 5: invalid UTF-8 on encode", function()
  it("becomes one U+FFFD per maximal invalid subpart", function()
    local F = "\u{FFFD}"
    assert.equals('"a' .. F .. 'b"', json.encode("a\xe2\x82b"))           -- a cut 3-byte sequence: one
    assert.equals('"' .. F .. F .. F .. '"', json.encode("\xed\xa0\x80"))  -- an encoded surrogate: three
    assert.equals('"' .. F .. F .. '"', json.encode("\xc0\x80"))           -- overlong: two
    assert.equals('"x' .. F .. '"', json.encode("x\xf0\x9f\x98"))
    assert.equals("é😀", json.replace_invalid_utf8("é😀"))
  end)
end)

describe("json 6: fuzzed against Python's json", function()
  it("decode: the same verdict and equal values", function()
    if not have_python() then return pending("python3 not available") end
    math.randomseed(20261203)
    local docs = documents(4000)
    local jobs = {}
    for i, d in ipairs(docs) do jobs[i] = { "D", d } end
    local want = python(jobs)
    local bad, accepted = {}, 0
    for i, d in ipairs(docs) do
      local ok, v, err = pcall(json.decode, d)
      local got
      if not ok then got = "RAISED " .. tostring(v)
      elseif v == nil then
        got = "REFUSE"
        if not err:match(" at byte %d+$") then got = "REFUSE without a byte: " .. err end
      else got = canon(v, true) end
      if got ~= want[i] then bad[#bad + 1] = ("%s\n  lua:    %s\n  python: %s"):format(hex(d), got, want[i]) end
      if want[i] ~= "REFUSE" then accepted = accepted + 1 end
    end
    assert.is_true(accepted > 1000 and accepted < #docs - 1000) -- both verdicts are exercised
    assert.equals(0, #bad, table.concat(bad, "\n", 1, math.min(#bad, 5)))
  end)

  it("encode: Python reads back the value, invalid UTF-8 replaced as bytes.decode('utf-8', 'replace') does",
    function()
      if not have_python() then return pending("python3 not available") end
      math.randomseed(42)
      local strings = {}
      local function rstring()
        local t = {}
        for i = 1, R(0, 10) do
          local r = R(4)
          t[i] = r == 1 and string.char(R(0, 255)) or r == 2 and pick(INVALID_UTF8) or utf8.char(codepoint())
        end
        return table.concat(t)
      end
      local function record(s)
        strings[#strings + 1] = s
        return s
      end
      local function value(depth)
        local r = R(depth > 3 and 6 or 8)
        if r == 1 then return R(2) == 1 and math.random(math.mininteger, math.maxinteger) or R(-100, 100) end
        if r == 2 then
          local x = string.unpack("<d", string.pack("<i8", math.random(math.mininteger, math.maxinteger)))
          if x ~= x or x == math.huge or x == -math.huge then x = R() end
          return R(2) == 1 and x or R() * 10 ^ R(-5, 5)
        end
        if r <= 4 then return record(rstring()) end
        if r == 5 then return pick { true, false, json.null } end
        if r == 6 then return pick { json.array {}, {} } end
        local t = {}
        if r == 7 then
          for i = 1, R(1, 4) do t[i] = value(depth + 1) end
          return R(2) == 1 and json.array(t) or t
        end
        for i = 1, R(1, 4) do t[record("k" .. i .. rstring())] = value(depth + 1) end
        return t
      end
      local values = {}
      for i = 1, 1500 do values[i] = value(0) end
      local jobs = {}
      for i, v in ipairs(values) do
        jobs[i] = { "E", json.encode(v, i % 3 == 0 and { indent = "  " } or nil) }
      end
      for _, s in ipairs(strings) do jobs[#jobs + 1] = { "R", s } end
      local out = python(jobs)
      local replaced = {}
      for i, s in ipairs(strings) do replaced[s] = out[#values + i] end
      -- the value the text should hold: the generated one with each string replaced
      local function expect(v)
        if type(v) == "string" then return "s:" .. replaced[v] end
        if type(v) ~= "table" or v == json.null then return canon(v, false) end
        local parts = {}
        if json.is_array(v) or #v > 0 then
          for i = 1, #v do parts[i] = expect(v[i]) end
          return "[" .. table.concat(parts, ",") .. "]"
        end
        for k, x in pairs(v) do parts[#parts + 1] = { replaced[k], expect(x) } end
        return object_text(parts)
      end
      local bad = {}
      for i, v in ipairs(values) do
        local want = expect(v)
        if out[i] ~= want then bad[#bad + 1] = ("%s\n  python: %s\n  want:   %s"):format(jobs[i][2], out[i], want) end
      end
      assert.equals(0, #bad, table.concat(bad, "\n", 1, math.min(#bad, 5)))
    end)
end)

-- ==== agent findings ==============================================================

local EOS = 2

local model
setup(function()
  model = assert(kvlua.load(tiny.llama { vocab = "bytes", seed = 4 }, { threads = 1 }))
end)
teardown(function()
  if model then model:close() end
  tiny.cleanup()
end)

-- spell(...): a sampler spelling its arguments, one byte token a byte, EOS
-- for EOS; replies(...): the texts, each ended by EOS.
local spell, replies = require("spec.support.samplers").speller(EOS)

-- A registry of one tool: name, fn, parameters.
local function tool(name, fn, parameters)
  return agent.registry():add { name = name, fn = fn, parameters = parameters or {} }
end

local function new_agent(reg, sampler, opts)
  -- scripted replies, some no grammar would allow: the unconstrained path
  local o = { tools = reg, template = "chatml", sampler = sampler, max_tokens = 512, ctx = 4096, constrain = false }
  for k, v in pairs(opts or {}) do o[k] = v end
  return assert(agent.new(model, o))
end

-- The RESULT messages of the text protocol, in order.
local function results(a)
  local out = {}
  for _, m in ipairs(a.messages) do
    if m.role == "user" and m.content:find("^RESULT ") then out[#out + 1] = m.content end
  end
  return out
end

local ECHO_X = { { name = "x", type = "number", optional = true } }

describe("agent 1: a number past the largest double in a call", function()
  it("goes back to the model as an error, and the loop goes on", function()
    local seen = {}
    local reg = tool("echo", function(args)
      seen[#seen + 1] = args.x
      return args
    end, ECHO_X)
    local a = new_agent(reg, replies('{"tool":"echo","x":1e999}', '{"tool":"echo","x":-1' .. string.rep("0", 400) .. "}",
      '{"tool":"echo","x":1.5}', "Done."))
    local reply, info = a:turn("Echo.")
    assert.equals("Done.", reply)
    assert.same({ 1.5 }, seen) -- the tool never saw an infinity
    assert.same({ "RESULT echo: error: the call's arguments cannot be used: inf has no JSON form",
      "RESULT echo: error: the call's arguments cannot be used: -inf has no JSON form",
      'RESULT echo: {"x":1.5}' }, results(a))
    assert.same({ name = "echo", ok = false,
      result = "the call's arguments cannot be used: inf has no JSON form" }, info.tool_calls[1])
    -- the turn's record and the conversation stay writable as JSON
    assert.is_string(json.encode { info.tool_calls, a.messages })
    a:close()
  end)

  it("the same in the hermes format", function()
    local a = new_agent(tool("echo", function(args) return args end, ECHO_X),
      spell('<tool_call>\n{"name": "echo", "arguments": {"x": 1e400}}\n</tool_call>', "No.", EOS),
      { protocol = "hermes" })
    local reply = a:turn("Echo.")
    assert.equals("No.", reply)
    assert.equals("<tool_response>\nerror: the call's arguments cannot be used: inf has no JSON form\n</tool_response>",
      a.messages[#a.messages - 1].content)
    a:close()
  end)
end)

describe("agent 2: a result that cannot be written as JSON", function()
  it("a cyclic table goes back to the model as an error, and the loop goes on", function()
    local a = new_agent(tool("loop", function()
      local t = {}
      t.self = t
      return t
    end), replies('{"tool": "loop"}', "Sorry."))
    local reply, info = a:turn("Go.")
    assert.equals("Sorry.", reply)
    assert.is_false(info.tool_calls[1].ok)
    assert.same({ "RESULT loop: error: the tool's result cannot be written as JSON: a table contains itself" }, results(a))
    a:close()
  end)

  it("so do tables holding NaN, a function, or a string that is not UTF-8", function()
    local cases = {
      { { x = 0 / 0 }, "the tool's result cannot be written as JSON: " .. tostring(0 / 0) .. " has no JSON form" },
      { { f = print }, "the tool's result cannot be written as JSON: a function has no JSON form" },
      { { "ok", { s = "a\xffb" } }, "the tool's result holds a string that is not valid UTF-8" },
      { { ["k\xc3"] = 1 }, "the tool's result holds a string that is not valid UTF-8" },
    }
    for _, c in ipairs(cases) do
      local reg = tool("t", function() return c[1] end)
      assert.same({ false, c[2] }, { reg:call("t", {}) })
    end
  end)
end)

describe("agent 3: text that is not valid UTF-8", function()
  it("a tool's result: an error to the model", function()
    local a = new_agent(tool("bytes", function() return "ab\xff" end), replies('{"tool": "bytes"}', "Hm.", "Bye."))
    assert.equals("Hm.", a:turn("Read."))
    assert.same({ "RESULT bytes: error: the tool's result is not valid UTF-8 (byte 3)" }, results(a))
    assert.equals("Bye.", a:turn("Again.")) -- the next turn renders
    a:close()
  end)

  it("a model's reply (a generation cut in a character): kept with U+FFFD, and the next turn renders", function()
    local a = new_agent(tool("t", function() return "x" end), replies("bad \xf0\x9f reply", '{"tool": "t"} \xff', "ok",
      "last"))
    assert.equals("bad \u{FFFD} reply", a:turn("One."))
    assert.equals("ok", a:turn("Two."))
    assert.same({ "RESULT t: x" }, results(a))
    assert.equals("last", a:turn("Three."))
    a:close()
  end)

  it("a user's message: raises (misuse) before joining the conversation", function()
    local a = new_agent(tool("t", function() return "x" end), replies("fine"))
    local n = #a.messages
    assert.has_error(function() a:turn("caf\xe9") end, "agent:turn: the user's message must be valid UTF-8")
    assert.equals(n, #a.messages)
    assert.equals("fine", a:turn("café"))
    a:close()
  end)
end)

describe("agent 4: results that have no text", function()
  it("a function, a userdata, a coroutine, NaN or an infinity is an error; nil is null", function()
    local cases = {
      { print, "the tool returned a function, not a string, number, boolean or table" },
      { io.stdout, "the tool returned a userdata, not a string, number, boolean or table" },
      { coroutine.create(print), "the tool returned a thread, not a string, number, boolean or table" },
      { 0 / 0, "the tool returned " .. tostring(0 / 0) .. ", a number JSON cannot hold" },
      { -math.huge, "the tool returned -inf, a number JSON cannot hold" },
    }
    for _, c in ipairs(cases) do
      local reg = tool("t", function() return c[1] end)
      assert.same({ false, c[2] }, { reg:call("t", {}) })
    end
    assert.same({ true, "null" }, { tool("t", function() end):call("t", {}) })
    assert.same({ true, "null" }, { tool("t", function() return nil end):call("t", {}) })
    assert.same({ true, "2.5" }, { tool("t", function() return 2.5 end):call("t", {}) })
    assert.same({ true, "false" }, { tool("t", function() return false end):call("t", {}) })
  end)

  it("in a turn, the model reads the error and the loop goes on", function()
    local a = new_agent(tool("fn", function() return print end), replies('{"tool": "fn"}', "Ok."))
    local reply, info = a:turn("Go.")
    assert.equals("Ok.", reply)
    assert.same({ name = "fn", arguments = {}, ok = false,
      result = "the tool returned a function, not a string, number, boolean or table" }, info.tool_calls[1])
    a:close()
  end)
end)

describe("agent 5: a tool that yields", function()
  local closed
  local function yielding()
    return tool("y", function()
      local guard <close> = setmetatable({}, { __close = function() closed = true end })
      coroutine.yield("suspend me")
      return "never"
    end)
  end

  it("is an error to the model, outside a coroutine", function()
    closed = false
    local a = new_agent(yielding(), replies('{"tool": "y"}', "Ok."))
    assert.equals("Ok.", a:turn("Go."))
    assert.same({ "RESULT y: error: the tool yielded instead of returning its result" }, results(a))
    assert.is_true(closed) -- its to-be-closed variables were closed
    a:close()
  end)

  it("does not suspend a turn running in a coroutine", function()
    local a = new_agent(yielding(), replies('{"tool": "y"}', "Ok."))
    local co = coroutine.wrap(function() return "returned", a:turn("Go.") end)
    local first, reply = co()
    assert.equals("returned", first)
    assert.equals("Ok.", reply)
    assert.same({ "RESULT y: error: the tool yielded instead of returning its result" }, results(a))
    a:close()
  end)
end)

describe("agent 6: errors raised by a tool", function()
  it("an error object whose __tostring raises: an error to the model", function()
    local bad = setmetatable({}, { __tostring = function() error("no text") end })
    local a = new_agent(tool("t", function() error(bad) end), replies('{"tool": "t"}', "Ok."))
    assert.equals("Ok.", a:turn("Go."))
    assert.same({ "RESULT t: error: the tool raised an error that cannot be written as text" }, results(a))
    a:close()
  end)

  it("a message that is not UTF-8 gets U+FFFD; a non-string error its tostring", function()
    assert.same({ false, "bad \u{FFFD} input" }, { tool("t", function() error("bad \xff input") end):call("t", {}) })
    assert.same({ false, "42" }, { tool("t", function() error(42) end):call("t", {}) })
    assert.same({ false, "nil" }, { tool("t", function() error() end):call("t", {}) })
  end)
end)

describe("agent 7: a huge result", function()
  it("is cut at max_result_bytes on a character boundary, and says so", function()
    local big = string.rep("é", 100) -- 200 bytes
    local a = new_agent(tool("big", function() return big end), replies('{"tool": "big"}', "Long."),
      { max_result_bytes = 101 })
    local reply, info = a:turn("Go.")
    assert.equals("Long.", reply)
    local want = string.rep("é", 50) .. "\n[cut: the first 100 of 200 bytes]"
    assert.same({ name = "big", arguments = {}, ok = true, result = want }, info.tool_calls[1])
    assert.same({ "RESULT big: " .. want }, results(a))
    a:close()
  end)

  it("an error message is cut the same way", function()
    local a = new_agent(tool("e", function() error(string.rep("x", 50), 0) end), replies('{"tool": "e"}', "Ok."),
      { max_result_bytes = 10 })
    a:turn("Go.")
    assert.same({ "RESULT e: error: xxxxxxxxxx\n[cut: the first 10 of 50 bytes]" }, results(a))
    a:close()
  end)

  it("max_result_bytes must be a positive integer", function()
    for _, bad in ipairs { 0, -1, 1.5, "10" } do
      assert.has_error(function() agent.new(model, { max_result_bytes = bad }) end,
        "agent.new: max_result_bytes must be a positive integer")
    end
  end)
end)

describe("agent 8: argument types", function()
  local got
  local reg = agent.registry():add {
    name = "f", fn = function(args) got = args return "ok" end,
    parameters = { { name = "n", type = "integer", optional = true }, { name = "x", type = "number", optional = true },
      { name = "s", type = "string", optional = true }, { name = "b", type = "boolean", optional = true } },
  }

  it("an integer parameter takes an integral float as an integer (JSON Schema counts 2.0 as an integer)", function()
    assert.same({ true, "ok" }, { reg:call("f", { n = 2.0 }) })
    assert.equals("integer", math.type(got.n))
    assert.equals(2, got.n)
  end)

  it("refuses, naming the argument, what does not fit the declared type", function()
    local cases = {
      { { n = 2.5 }, "argument 'n' must be an integer" },
      { { n = 2.0 ^ 63 }, "argument 'n' must be an integer" },
      { { n = "2" }, "argument 'n' must be an integer" },
      { { x = math.huge }, "argument 'x' must be a finite number" },
      { { x = 0 / 0 }, "argument 'x' must be a finite number" },
      { { x = "1" }, "argument 'x' must be a number" },
      { { s = 1 }, "argument 's' must be a string" },
      { { s = { "a" } }, "argument 's' must be a string" },
      { { b = "true" }, "argument 'b' must be a boolean" },
      { { z = 1 }, "unknown argument 'z'" },
    }
    for _, c in ipairs(cases) do
      got = nil
      assert.same({ false, c[2] }, { reg:call("f", c[1]) })
      assert.is_nil(got) -- the tool did not run
    end
  end)

  it("in a turn: the model reads which argument is wrong", function()
    local a = new_agent(reg, replies('{"tool": "f", "n": 1.5, "s": "x"}', '{"tool": "f", "n": 3.0}', "Ok."))
    assert.equals("Ok.", a:turn("Go."))
    assert.same({ "RESULT f: error: argument 'n' must be an integer", "RESULT f: ok" }, results(a))
    assert.equals("integer", math.type(got.n))
    a:close()
  end)
end)

describe("agent 9: a call naming an unknown tool", function()
  it("is an error that lists the tools", function()
    local a = new_agent(tool("t", function() return "x" end), replies('{"tool": "nope"}', "Ok."))
    assert.equals("Ok.", a:turn("Go."))
    assert.same({ "RESULT nope: error: no tool named 'nope' (the tools: t)" }, results(a))
    a:close()
  end)
end)
