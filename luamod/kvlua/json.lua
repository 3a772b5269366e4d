-- kvlua.json — JSON text to Lua values and back, for the scripts' JSON and
-- JSONL files and for tool calls in kvlua.agent.
--
--   local json = require "kvlua.json"
--   json.encode{ id = 3, text = "hi", tokens = { 1, 2 } } --> {"id":3,"text":"hi","tokens":[1,2]}
--   local v, err = json.decode('{"a": [1, 2.5, null]}')  --> { a = { 1, 2.5, json.null } }
--
-- Decoding: objects and arrays become tables; arrays carry a metatable
-- (json.is_array(t) is true), so an empty array encodes back as [].
-- null becomes json.null (a sentinel: a nil would drop the key or end the
-- array). Numbers read as Lua's tonumber reads them: a literal without a
-- fraction or exponent is an integer when it fits 64 bits, else a float
-- (-9223372036854775809 is -2^63 as a float); a magnitude past the
-- largest double is an infinity (1e400 is math.huge), as Python reads it.
-- The text must be UTF-8 (RFC 8259): invalid UTF-8 in a string is
-- refused; a \u escape of a lone surrogate (which Python keeps as is)
-- becomes U+FFFD, so every decoded string is valid UTF-8. Containers nest
-- 200 deep at most. Bad text returns nil, "message at byte N". The spec
-- fuzzes all this against Python's json module.
--
-- Encoding: a table is an array when its keys are exactly 1..#t (or it
-- carries json.array's metatable), else an object whose keys (strings or
-- numbers) are written in sorted order, so equal values give equal text.
-- Floats use the shortest %.Ng that reads back the same number; NaN and
-- infinities, functions, cycles and nesting past 200 levels raise
-- (misuse). Strings are written as UTF-8; each maximal invalid sequence of
-- bytes becomes one U+FFFD (Unicode's recommended practice, as Python's
-- bytes.decode("utf-8", "replace")), so the output is always valid JSON.
-- opts.indent = "  " pretty-prints.

local M = {}

M.null = setmetatable({}, { __name = "json.null", __tostring = function() return "null" end })

local ARRAY = { __name = "json.array" }

-- Arrays and objects nest at most this deep, in both directions.
local MAX_DEPTH = 200

--- json.array(t) -> t marked as an array (so {} encodes as []).
function M.array(t)
  return setmetatable(t or {}, ARRAY)
end

function M.is_array(t)
  return getmetatable(t) == ARRAY
end

-- ==== encoding ==============================================================

local ESCAPES = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f",
                  ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t" }

-- A UTF-8 sequence's length and the range of its second byte, by lead
-- byte (Unicode's table 3-7: no overlong forms, no surrogates, nothing
-- past U+10FFFF); the bytes after the second are 80..BF.
local function utf8_lead(b)
  if b < 0x80 then return 1 end
  if b >= 0xC2 and b <= 0xDF then return 2, 0x80, 0xBF end
  if b == 0xE0 then return 3, 0xA0, 0xBF end
  if b == 0xED then return 3, 0x80, 0x9F end
  if b >= 0xE1 and b <= 0xEF then return 3, 0x80, 0xBF end
  if b == 0xF0 then return 4, 0x90, 0xBF end
  if b >= 0xF1 and b <= 0xF3 then return 4, 0x80, 0xBF end
  if b == 0xF4 then return 4, 0x80, 0x8F end
  return 0
end

--- json.replace_invalid_utf8(s) -> s with each maximal invalid subpart
--- (a lead byte and the continuation bytes that fit it, or one stray
--- byte) replaced by U+FFFD; valid UTF-8 comes back unchanged. This is
--- what encode does to strings.
function M.replace_invalid_utf8(s)
  if utf8.len(s) then return s end
  local out, i, start = {}, 1, 1
  while i <= #s do
    local len, lo, hi = utf8_lead(s:byte(i))
    local k = 0 -- bytes from i that begin a valid sequence
    if len > 0 then
      k = 1
      local c = s:byte(i + 1)
      if len > 1 and c and c >= lo and c <= hi then
        k = 2
        while k < len do
          c = s:byte(i + k)
          if not c or c < 0x80 or c > 0xBF then break end
          k = k + 1
        end
      end
    end
    if len > 0 and k == len then
      i = i + len
    else
      out[#out + 1] = s:sub(start, i - 1)
      out[#out + 1] = "\u{FFFD}"
      i = i + math.max(k, 1)
      start = i
    end
  end
  out[#out + 1] = s:sub(start)
  return table.concat(out)
end

local function encode_string(s)
  s = M.replace_invalid_utf8(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    return ESCAPES[c] or string.format("\\u%04x", c:byte())
  end) .. '"'
end

local function encode_number(x)
  if math.type(x) == "integer" then return tostring(x) end
  if x ~= x or x == math.huge or x == -math.huge then
    error("json.encode: " .. tostring(x) .. " has no JSON form", 0)
  end
  if x == math.floor(x) and math.abs(x) < 2 ^ 53 then return string.format("%d", x) end
  for digits = 14, 17 do
    local s = string.format("%." .. digits .. "g", x)
    if tonumber(s) == x then return s end
  end
  return string.format("%.17g", x)
end

local function is_sequence(t)
  if getmetatable(t) == ARRAY then return true end
  local n = #t
  if n == 0 then return false end
  local count = 0
  for _ in pairs(t) do count = count + 1 end
  return count == n
end

local function sorted_keys(t)
  local keys = {}
  for k in pairs(t) do
    local kt = type(k)
    if kt ~= "string" and kt ~= "number" then
      error("json.encode: an object key must be a string or a number, not a " .. kt, 0)
    end
    keys[#keys + 1] = k
  end
  table.sort(keys, function(a, b)
    if type(a) == type(b) then return a < b end
    return type(a) == "number"
  end)
  return keys
end

local encode_value

local function encode_table(t, indent, depth, seen)
  if seen[t] then error("json.encode: a table contains itself", 0) end
  if depth >= MAX_DEPTH then error("json.encode: tables nest deeper than " .. MAX_DEPTH .. " levels", 0) end
  seen[t] = true
  local nl, pad, sep = "", "", ":"
  if indent then
    nl, pad, sep = "\n", string.rep(indent, depth + 1), ": "
  end
  local parts = {}
  local open, close
  if is_sequence(t) then
    open, close = "[", "]"
    for i = 1, #t do parts[i] = pad .. encode_value(t[i], indent, depth + 1, seen) end
  else
    open, close = "{", "}"
    for _, k in ipairs(sorted_keys(t)) do
      local key = type(k) == "string" and k or encode_number(k)
      parts[#parts + 1] = pad .. encode_string(key) .. sep .. encode_value(t[k], indent, depth + 1, seen)
    end
  end
  seen[t] = nil
  if #parts == 0 then return open .. close end
  local tail = indent and (nl .. string.rep(indent, depth)) or ""
  return open .. nl .. table.concat(parts, "," .. nl) .. tail .. close
end

function encode_value(v, indent, depth, seen)
  local tv = type(v)
  if v == nil or v == M.null then return "null"
  elseif tv == "boolean" then return tostring(v)
  elseif tv == "number" then return encode_number(v)
  elseif tv == "string" then return encode_string(v)
  elseif tv == "table" then return encode_table(v, indent, depth, seen)
  end
  error("json.encode: a " .. tv .. " has no JSON form", 0)
end

--- json.encode(value [, {indent = "  "}]) -> string (raises on values JSON cannot hold)
function M.encode(v, opts)
  if opts ~= nil and type(opts) ~= "table" then error("json.encode: options must be a table", 2) end
  local ok, out = pcall(encode_value, v, opts and opts.indent, 0, {})
  if not ok then error(out, 2) end
  return out
end

-- ==== decoding ==============================================================

local function fail(msg, pos)
  error({ msg = msg .. " at byte " .. pos }, 0)
end

local function skip_ws(s, pos)
  return s:find("[^ \t\r\n]", pos) or #s + 1
end

local UNESCAPE = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }

local function read_hex4(s, pos)
  local hex = s:match("^%x%x%x%x", pos)
  if not hex then fail("\\u needs four hex digits", pos) end
  return tonumber(hex, 16)
end

-- Returns the string starting at the quote at pos, and the position after it.
-- Raw bytes must be valid UTF-8; only U+0000..U+001F must be escaped
-- (a raw DEL is text).
local function read_string(s, pos)
  local out = {}
  local i = pos + 1
  while true do
    local j = s:find('[\0-\31"\\]', i)
    if not j then fail("unterminated string", pos) end
    local raw = s:sub(i, j - 1)
    local ok, bad = utf8.len(raw)
    if not ok then fail("invalid UTF-8 in a string", i + bad - 1) end
    out[#out + 1] = raw
    local c = s:sub(j, j)
    if c == '"' then return table.concat(out), j + 1 end
    if c ~= "\\" then fail("control character in a string", j) end
    local e = s:sub(j + 1, j + 1)
    if UNESCAPE[e] then
      out[#out + 1] = UNESCAPE[e]
      i = j + 2
    elseif e == "u" then
      local cp = read_hex4(s, j + 2)
      i = j + 6
      if cp >= 0xD800 and cp <= 0xDBFF and s:sub(i, i + 1) == "\\u" then
        local lo = read_hex4(s, i + 2)
        if lo >= 0xDC00 and lo <= 0xDFFF then
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
          i = i + 6
        end
      end
      if cp >= 0xD800 and cp <= 0xDFFF then cp = 0xFFFD end -- a lone surrogate
      out[#out + 1] = utf8.char(cp)
    else
      fail("bad escape \\" .. e, j)
    end
  end
end

-- -?int frac? exp?, where int has no leading zero (RFC 8259).
local function read_number(s, pos)
  local int = s:match("^-?%d+", pos)
  if not int or int:match("^-?0%d") then fail("bad number", pos) end
  local p = pos + #int
  local frac = s:match("^%.%d+", p) or ""
  p = p + #frac
  local exp = s:match("^[eE][-+]?%d+", p) or ""
  p = p + #exp
  -- an integer when it fits 64 bits, else a float (which may be +-inf)
  return tonumber(int .. frac .. exp), p
end

local read_value

-- Reads the ','-separated items of an array or object up to `close`;
-- item(pos) reads one item and returns the position after it.
local function read_items(s, pos, close, item)
  pos = skip_ws(s, pos + 1)
  if s:sub(pos, pos) == close then return pos + 1 end
  while true do
    pos = skip_ws(s, item(pos))
    local c = s:sub(pos, pos)
    if c == close then return pos + 1 end
    if c ~= "," then fail("',' or '" .. close .. "' expected", pos) end
    pos = pos + 1
  end
end

local function read_array(s, pos, depth)
  local t = M.array {}
  local after = read_items(s, pos, "]", function(p)
    t[#t + 1], p = read_value(s, p, depth + 1)
    return p
  end)
  return t, after
end

local function read_object(s, pos, depth)
  local t = {}
  local after = read_items(s, pos, "}", function(p)
    p = skip_ws(s, p)
    if s:sub(p, p) ~= '"' then fail("a string key expected", p) end
    local k
    k, p = read_string(s, p)
    p = skip_ws(s, p)
    if s:sub(p, p) ~= ":" then fail("':' expected", p) end
    t[k], p = read_value(s, p + 1, depth + 1)
    return p
  end)
  return t, after
end

local LITERALS = { ["true"] = true, ["false"] = false }

function read_value(s, pos, depth)
  pos = skip_ws(s, pos)
  local c = s:sub(pos, pos)
  if (c == "{" or c == "[") and depth >= MAX_DEPTH then
    fail("nesting deeper than " .. MAX_DEPTH .. " levels", pos)
  end
  if c == "{" then return read_object(s, pos, depth)
  elseif c == "[" then return read_array(s, pos, depth)
  elseif c == '"' then return read_string(s, pos)
  elseif c == "" then fail("unexpected end of text", pos)
  end
  for lit, v in pairs(LITERALS) do
    if s:sub(pos, pos + #lit - 1) == lit then return v, pos + #lit end
  end
  if s:sub(pos, pos + 3) == "null" then return M.null, pos + 4 end
  if c:match("[-%d]") then return read_number(s, pos) end
  if c:match("^[\33-\126]$") then fail("unexpected character '" .. c .. "'", pos) end
  fail(string.format("unexpected byte 0x%02x", c:byte()), pos)
end

-- read_value under pcall: value, next_pos | nil, message; an error that
-- is not a JSON one (a bug) is raised again
local function protected_read(s, pos)
  local ok, v, after = pcall(read_value, s, pos, 0)
  if ok then return v, after end
  if type(v) == "table" then return nil, v.msg end
  error(v, 0)
end

--- json.decode(text) -> value | nil, "message at byte N"
function M.decode(s)
  if type(s) ~= "string" then error("json.decode: string expected, got " .. type(s), 2) end
  local v, pos = protected_read(s, 1)
  if v == nil then return nil, pos end
  pos = skip_ws(s, pos)
  if pos <= #s then return nil, "trailing text at byte " .. pos end
  return v
end

--- json.decode_prefix(text [, pos]) -> value, next_pos | nil, message
--- Reads one value starting at pos (default 1) and says where it ended:
--- for a value embedded in other text, like a tool call's arguments.
function M.decode_prefix(s, pos)
  if type(s) ~= "string" then error("json.decode_prefix: string expected, got " .. type(s), 2) end
  return protected_read(s, pos or 1)
end

--- json.key_order(text, value) -> { [object] = { key, ... } }
--- value is json.decode(text); each of its objects (tables) maps to its keys
--- in the order they appear in text, each key once (a repeated key keeps its
--- first place; its value, json.decode's, is the last one's, as in Python's
--- json.loads). A second pass over the text, walking the value alongside it.
function M.key_order(text, value)
  local order = {}
  local pos = 1
  local function ws() pos = text:find("[^ \t\r\n]", pos) or #text + 1 end
  local walk
  -- val: the value decoded from the text at pos; for an earlier occurrence
  -- of a repeated key, the last one's value (or nil where the shapes differ):
  -- walked for its length, what it records is recorded over by the walk of
  -- the last occurrence, which comes after it and visits all that value
  function walk(val)
    if type(val) ~= "table" then val = nil end
    ws()
    local c = text:sub(pos, pos)
    if c == "{" then
      pos = pos + 1
      local keys = {}
      ws()
      if text:sub(pos, pos) == "}" then
        pos = pos + 1
        if val then order[val] = keys end
        return
      end
      while true do
        ws()
        local k, nxt = M.decode_prefix(text, pos)
        pos = nxt
        ws()
        pos = pos + 1 -- :
        local seen = false
        for _, e in ipairs(keys) do seen = seen or e == k end
        if not seen then keys[#keys + 1] = k end
        walk(val and val[k])
        ws()
        local d = text:sub(pos, pos)
        pos = pos + 1
        if d == "}" then break end
      end
      if val then order[val] = keys end
    elseif c == "[" then
      pos = pos + 1
      ws()
      if text:sub(pos, pos) == "]" then pos = pos + 1; return end
      local idx = 1
      while true do
        walk(val and val[idx])
        idx = idx + 1
        ws()
        local d = text:sub(pos, pos)
        pos = pos + 1
        if d == "]" then break end
      end
    else
      local _, nxt = M.decode_prefix(text, pos)
      pos = nxt
    end
  end
  walk(value)
  return order
end

return M
