-- kvlua.json_schema — a JSON schema as a GBNF grammar, for constrained
-- generation (sampling.json_schema, s:generate{json_schema =}).
--
--   local json_schema = require "kvlua.json_schema"
--   local gbnf, err = json_schema.to_gbnf('{"type": "object", "properties": {"n": {"type": "integer"}}}')
--   --> 'root ::= "{" space "\"n\"" space ":" space integer space "}"' and the rules it uses ...
--
-- The schema is a Lua table (as kvlua.json.decode gives) or JSON text. The
-- grammar is written as llama.cpp's GBNF (rules, |, groups, * + ? {m,n},
-- character classes, escapes); every string it matches is a JSON text the
-- schema accepts. It may match fewer: the choices below narrow, never widen.
--
-- Supported:
--   type (a name or an array of them), enum, const, anyOf, oneOf (branches
--   that cannot overlap: different types, different constants, or objects
--   told apart by a required property with different "const"s), $ref to
--   "#" and "#/..." pointers ($defs, definitions, anything in the document;
--   recursion is fine);
--   objects: properties, required, additionalProperties (false, true or a
--   schema). Properties come in a fixed order: the required ones first, in
--   the order of the schema text (a Lua table has none: the order of
--   `required`), then the optional ones (text order; in a table, by name).
--   With properties and no additionalProperties, only the listed ones are
--   written (as llama.cpp does); {"type": "object"} alone is any object;
--   arrays: items (a schema, or an array as in draft 4), prefixItems,
--   minItems, maxItems, uniqueItems false (or maxItems <= 1);
--   strings: minLength, maxLength, pattern (a regex subset: literals,
--   classes [a-z] [^...], escapes \d \w \s \D \W \S \. \xHH \uHHHH, `.`,
--   groups ( ) (?: ), |, * + ? {m} {m,} {m,n}, lazy forms, ^ at the start
--   and $ at the end; unanchored means "contains"), format date, time,
--   date-time, uuid (dates have days 01-28 in February: no leap years);
--   integers: minimum, maximum, exclusiveMinimum, exclusiveMaximum (numbers,
--   draft 6 on), as digit-level rules (|bound| < 10^15);
--   numbers: the same bounds, written without an exponent (integers, and
--   fractions whose last digit is not 0).
-- Annotations (title, description, default, examples, $schema, $id,
-- $comment, deprecated, readOnly, writeOnly) are ignored. Any other
-- keyword, format or construct returns nil, "json_schema: <where>: ..."
-- naming it; nothing is ignored silently.
--
-- Whitespace: none inside literals and numbers; between tokens the `space`
-- rule allows nothing, one space, or one or two newlines and up to 20
-- spaces or tabs (llama.cpp's bound, so a model cannot run away in
-- whitespace). Strings: any character but " \ and controls, or an escape;
-- \u escapes of surrogates are left out, so a string's length in the
-- grammar is its length in code points (minLength, maxLength).

local json = require "kvlua.json"

local M = {}

local MAX_BOUND = 1e15 -- integer bounds past this are refused

-- ==== errors =================================================================

local Fail = {}

local function fail(path, fmt, ...)
  error(setmetatable({ msg = ("json_schema: %s: " .. fmt):format(path, ...) }, Fail), 0)
end

-- ==== GBNF text ==============================================================

-- A code point as text inside a GBNF literal or class.
local function esc_cp(cp, in_class)
  if cp == 0x22 then return '\\"' end
  if cp == 0x5C then return "\\\\" end
  if cp == 0x0A then return "\\n" end
  if cp == 0x0D then return "\\r" end
  if cp == 0x09 then return "\\t" end
  if in_class and (cp == 0x5D or cp == 0x5B or cp == 0x2D or cp == 0x5E) then
    return "\\" .. string.char(cp)
  end
  if cp < 0x20 or cp == 0x7F then return ("\\x%02X"):format(cp) end
  if cp < 0x7F then return string.char(cp) end
  if cp <= 0xFFFF then return ("\\u%04X"):format(cp) end
  return ("\\U%08X"):format(cp)
end

-- A GBNF literal of the bytes of s (valid UTF-8).
local function lit(s)
  local out = {}
  for _, cp in utf8.codes(s) do out[#out + 1] = esc_cp(cp, false) end
  return '"' .. table.concat(out) .. '"'
end

-- A GBNF character class of ranges { {lo, hi}, ... } (negated: [^...]).
local function class(ranges, negated)
  local out = { negated and "[^" or "[" }
  for _, r in ipairs(ranges) do
    out[#out + 1] = esc_cp(r[1], true)
    if r[2] ~= r[1] then out[#out + 1] = "-" .. esc_cp(r[2], true) end
  end
  out[#out + 1] = "]"
  return table.concat(out)
end

-- x{min,max} with the shortest operator (max nil: unbounded).
local function repeat_op(min, max)
  if max == nil then
    if min == 0 then return "*" elseif min == 1 then return "+" end
    return ("{%d,}"):format(min)
  end
  if min == 0 and max == 1 then return "?" end
  if min == max then return min == 1 and "" or ("{%d}"):format(min) end
  return ("{%d,%d}"):format(min, max)
end

-- ==== built-in rules =========================================================

local HEX = "[0-9a-fA-F]"
local DAY31 = '( "0" [1-9] | [12] [0-9] | "3" [01] )'
local DAY30 = '( "0" [1-9] | [12] [0-9] | "30" )'
local DAY28 = '( "0" [1-9] | "1" [0-9] | "2" [0-8] )'

-- name -> { body, deps }
local BUILTIN = {
  space = { '( " " | "\\n"{1,2} [ \\t]{0,20} )?' },
  boolean = { '"true" | "false"' },
  null = { '"null"' },
  ["integral-part"] = { '"0" | [1-9] [0-9]{0,15}' },
  ["decimal-part"] = { "[0-9]{1,16}" },
  integer = { '"-"? integral-part', { "integral-part" } },
  number = { '"-"? integral-part ( "." decimal-part )? ( [eE] [-+]? [0-9]{1,2} )?', { "integral-part", "decimal-part" } },
  char = { '[^"\\\\\\x00-\\x1F\\x7F] | "\\\\" ( ["\\\\/bfnrt] | "u" ( [0-9a-cA-Ce-fE-F] ' .. HEX .. '{3} | [dD] [0-7] '
    .. HEX .. "{2} ) )" },
  string = { '"\\"" char* "\\""', { "char" } },
  value = { "object | array | string | number | boolean | null", { "object", "array", "string", "number", "boolean", "null" } },
  object = { '"{" space ( string space ":" space value ( "," space string space ":" space value )* )? space "}"',
    { "space", "string", "value" } },
  array = { '"[" space ( value ( "," space value )* )? space "]"', { "space", "value" } },
  uuid = { '"\\"" ' .. HEX .. '{8} "-" ' .. HEX .. '{4} "-" ' .. HEX .. '{4} "-" ' .. HEX .. '{4} "-" ' .. HEX .. '{12} "\\""' },
  date = { '[1-9] [0-9]{3} "-" ( ( "0" [13578] | "1" [02] ) "-" ' .. DAY31 .. ' | ( "0" [469] | "11" ) "-" ' .. DAY30
    .. ' | "02-" ' .. DAY28 .. " )" },
  time = { '( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{1,6} )? '
    .. '( "Z" | [+\\-] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )' },
  ["date-time"] = { 'date "T" time', { "date", "time" } },
  ["date-string"] = { '"\\"" date "\\""', { "date" } },
  ["time-string"] = { '"\\"" time "\\""', { "time" } },
  ["date-time-string"] = { '"\\"" date-time "\\""', { "date-time" } },
}

local FORMATS = { date = "date-string", time = "time-string", ["date-time"] = "date-time-string", uuid = "uuid" }

-- ==== keywords ===============================================================

local ANNOTATION = { title = true, description = true, default = true, examples = true, ["$schema"] = true,
  ["$id"] = true, ["$comment"] = true, deprecated = true, readOnly = true, writeOnly = true,
  ["$defs"] = true, definitions = true }

local KIND_KEYWORDS = {
  object = { properties = true, required = true, additionalProperties = true },
  array = { items = true, prefixItems = true, minItems = true, maxItems = true, uniqueItems = true },
  string = { minLength = true, maxLength = true, pattern = true, format = true },
  number = { minimum = true, maximum = true, exclusiveMinimum = true, exclusiveMaximum = true },
}
local GENERAL = { type = true, enum = true, const = true, anyOf = true, oneOf = true, ["$ref"] = true }

local TYPES = { null = true, boolean = true, integer = true, number = true, string = true, array = true, object = true }

local function kind_of_type(t)
  if t == "integer" then return "number" end
  return t
end

local function is_array(t)
  if type(t) ~= "table" then return false end
  if json.is_array(t) then return true end
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n == #t and (n > 0 or next(t) == nil)
end

local function sorted_keys(t)
  local ks = {}
  for k in pairs(t) do ks[#ks + 1] = k end
  table.sort(ks, function(a, b) return tostring(a) < tostring(b) end)
  return ks
end

-- ==== the converter ==========================================================

local C = {}
C.__index = C

local function new_converter(root, order)
  return setmetatable({ root = root, order = order or {}, rules = {}, names = {}, refs = {} }, C)
end

-- A fresh rule name made of [a-zA-Z0-9-] from a hint.
function C:fresh(hint)
  local base = hint:gsub("[^%w%-]+", "-"):gsub("^%-+", ""):gsub("%-+$", "")
  if base == "" then base = "r" end
  if BUILTIN[base] or base == "root" then base = base .. "-rule" end
  local name, i = base, 1
  while self.names[name] or BUILTIN[name] do
    name = base .. i
    i = i + 1
  end
  self.names[name] = true
  return name
end

function C:define(name, body)
  self.rules[#self.rules + 1] = { name, body }
  return name
end

function C:add(hint, body)
  return self:define(self:fresh(hint), body)
end

-- The name of a built-in rule, defined (with what it uses) once.
function C:builtin(name)
  if not self.names[name] then
    self.names[name] = true
    local b = BUILTIN[name]
    self:define(name, b[1])
    for _, d in ipairs(b[2] or {}) do self:builtin(d) end
  end
  return name
end

-- The keys of a schema object in the text's order when known.
function C:keys(t)
  local o = self.order[t]
  if o then return o end
  return sorted_keys(t)
end

-- Checks that every key of schema is known for the kinds in use.
local function check_keywords(schema, path)
  for k in pairs(schema) do
    if type(k) ~= "string" then fail(path, "a schema's keys must be strings") end
    local known = ANNOTATION[k] or GENERAL[k]
    if not known then
      for _, kw in pairs(KIND_KEYWORDS) do known = known or kw[k] end
    end
    if not known then fail(path, "unsupported keyword '%s'", k) end
  end
end

-- Validation keywords of schema other than those listed in allowed.
local function other_keywords(schema, allowed)
  local out = {}
  for _, k in ipairs(sorted_keys(schema)) do
    if not ANNOTATION[k] and not allowed[k] then out[#out + 1] = k end
  end
  return out
end

-- A JSON value as a GBNF literal (compact JSON text).
local function const_literal(v, path)
  local ok, text = pcall(json.encode, v)
  if not ok then fail(path, "a constant JSON cannot write (%s)", tostring(text)) end
  return lit(text)
end

-- Whether JSON value v has JSON type t (for enum filtering).
local function has_type(v, t)
  if t == "null" then return v == json.null end
  if t == "boolean" then return type(v) == "boolean" end
  if t == "integer" then return math.type(v) == "integer" or (type(v) == "number" and v == math.floor(v)) end
  if t == "number" then return type(v) == "number" end
  if t == "string" then return type(v) == "string" end
  if t == "array" then return type(v) == "table" and v ~= json.null and is_array(v) and (next(v) ~= nil or json.is_array(v)) end
  if t == "object" then return type(v) == "table" and v ~= json.null and not json.is_array(v) and (next(v) == nil or not is_array(v)) end
end

-- The types a schema allows (nil: any).
local function type_list(schema, path)
  local t = schema.type
  if t == nil then return nil end
  if type(t) == "string" then t = { t } end
  if type(t) ~= "table" or #t == 0 then fail(path, "type must be a type name or a non-empty array of them") end
  for _, name in ipairs(t) do
    if not TYPES[name] then fail(path, "unknown type '%s'", tostring(name)) end
  end
  return t
end

-- ---- entry -----------------------------------------------------------------

-- The expression (a rule name) of schema; hint names its rule.
function C:visit(schema, hint, path)
  if schema == true then return self:builtin("value") end
  if schema == false then fail(path, "the schema false allows no value") end
  if type(schema) ~= "table" or schema == json.null or (is_array(schema) and next(schema) ~= nil) then
    fail(path, "a schema must be an object or a boolean")
  end
  check_keywords(schema, path)

  if schema["$ref"] ~= nil then
    local others = other_keywords(schema, { ["$ref"] = true })
    if #others > 0 then fail(path, "'%s' beside $ref is not supported", others[1]) end
    return self:ref(schema["$ref"], path)
  end
  if schema.const ~= nil or schema.enum ~= nil then return self:constants(schema, hint, path) end
  if schema.anyOf ~= nil or schema.oneOf ~= nil then return self:union(schema, hint, path) end

  local types = type_list(schema, path)
  if types == nil then -- no type: the kinds its keywords are about (none: any value)
    types = {}
    for _, kind in ipairs { "object", "array", "string", "number" } do
      for k in pairs(KIND_KEYWORDS[kind]) do
        if schema[k] ~= nil then types[#types + 1] = kind; break end
      end
    end
    if #types == 0 then return self:builtin("value") end
  end
  -- keywords of a kind the types leave out are refused (they would be dropped)
  local kinds = {}
  for _, t in ipairs(types) do kinds[kind_of_type(t)] = true end
  for kind, kws in pairs(KIND_KEYWORDS) do
    if not kinds[kind] then
      for k in pairs(kws) do
        if schema[k] ~= nil then fail(path, "'%s' does not apply to type %s", k, table.concat(types, ", ")) end
      end
    end
  end
  if #types == 1 then return self:typed(schema, types[1], hint, path) end
  local alts = {}
  for i, t in ipairs(types) do alts[i] = self:typed(schema, t, hint .. "-" .. t, path) end
  return self:add(hint, table.concat(alts, " | "))
end

-- ---- $ref ------------------------------------------------------------------

local function unescape_pointer(s)
  return (s:gsub("%%(%x%x)", function(h) return string.char(tonumber(h, 16)) end):gsub("~1", "/"):gsub("~0", "~"))
end

function C:ref(ref, path)
  if type(ref) ~= "string" then fail(path, "$ref must be a string") end
  if self.refs[ref] then return self.refs[ref] end
  if ref:sub(1, 1) ~= "#" then fail(path, "$ref '%s': only references inside the schema (#...) are supported", ref) end
  local target = self.root
  local frag = ref:sub(2)
  if frag ~= "" then
    if frag:sub(1, 1) ~= "/" then fail(path, "$ref '%s': only JSON pointers (#/...) are supported", ref) end
    for part in (frag:sub(2) .. "/"):gmatch("(.-)/") do
      part = unescape_pointer(part)
      if type(target) ~= "table" then fail(path, "$ref '%s' leads nowhere", ref) end
      local nxt = target[part]
      if nxt == nil and part:match("^%d+$") then nxt = target[tonumber(part) + 1] end
      if nxt == nil then fail(path, "$ref '%s' leads nowhere ('%s' is missing)", ref, part) end
      target = nxt
    end
  end
  local name = self:fresh(frag == "" and "root-ref" or ("ref" .. frag))
  self.refs[ref] = name
  self:define(name, self:visit(target, name .. "-body", ref))
  return name
end

-- ---- constants ---------------------------------------------------------------

function C:constants(schema, hint, path)
  local others = other_keywords(schema, { enum = true, const = true, type = true })
  if #others > 0 then fail(path, "'%s' beside enum/const is not supported", others[1]) end
  local types = type_list(schema, path)
  local values
  if schema.const ~= nil then
    if schema.enum ~= nil then fail(path, "enum beside const is not supported") end
    values = { schema.const }
  else
    if type(schema.enum) ~= "table" or not is_array(schema.enum) then fail(path, "enum must be an array") end
    values = schema.enum
  end
  local alts = {}
  for _, v in ipairs(values) do
    local ok = types == nil
    for _, t in ipairs(types or {}) do ok = ok or has_type(v, t) end
    if ok then alts[#alts + 1] = const_literal(v, path) end
  end
  if #alts == 0 then fail(path, "no value of enum/const has the schema's type") end
  return self:add(hint, table.concat(alts, " | "))
end

-- ---- anyOf / oneOf -----------------------------------------------------------

-- The JSON kinds a branch can produce ("number" covers integer), or nil
-- when it cannot tell (a $ref, a nested union).
local function branch_kinds(b)
  if type(b) ~= "table" then return nil end
  local ks = {}
  if b.const ~= nil or b.enum ~= nil then
    for _, v in ipairs(b.const ~= nil and { b.const } or b.enum) do
      for _, t in ipairs { "null", "boolean", "number", "string", "array", "object" } do
        if has_type(v, t) then ks[t] = true end
      end
    end
    return ks
  end
  if b["$ref"] or b.anyOf or b.oneOf then return nil end
  local t = b.type
  if t == nil then
    for _, kind in ipairs { "object", "array", "string", "number" } do
      for k in pairs(KIND_KEYWORDS[kind]) do
        if b[k] ~= nil then ks[kind] = true end
      end
    end
    if next(ks) == nil then return nil end
    return ks
  end
  if type(t) == "string" then t = { t } end
  for _, name in ipairs(t) do ks[kind_of_type(name)] = true end
  return ks
end

-- The value of a constant required property: the discriminator of an object branch.
local function discriminators(b)
  local out = {}
  if type(b) ~= "table" or type(b.properties) ~= "table" or type(b.required) ~= "table" then return out end
  for _, name in ipairs(b.required) do
    local p = b.properties[name]
    if type(p) == "table" and p.const ~= nil and (type(p.const) == "string" or type(p.const) == "number"
        or type(p.const) == "boolean") then
      out[name] = p.const
    end
  end
  return out
end

-- Whether two oneOf branches can never accept the same value.
local function disjoint(a, b)
  local ka, kb = branch_kinds(a), branch_kinds(b)
  if ka and kb then
    local shared = false
    for k in pairs(ka) do shared = shared or kb[k] end
    if not shared then return true end
  end
  if (a.const ~= nil or a.enum ~= nil) and (b.const ~= nil or b.enum ~= nil) then
    local ta = {}
    for _, v in ipairs(a.const ~= nil and { a.const } or a.enum) do ta[json.encode(v)] = true end
    for _, v in ipairs(b.const ~= nil and { b.const } or b.enum) do
      if ta[json.encode(v)] then return false end
    end
    return true -- (1 and 1.0 both write as 1: one text, one key)
  end
  local da, db = discriminators(a), discriminators(b)
  for name, v in pairs(da) do
    if db[name] ~= nil and db[name] ~= v then return true end
  end
  return false
end

function C:union(schema, hint, path)
  local key = schema.anyOf ~= nil and "anyOf" or "oneOf"
  if schema.anyOf ~= nil and schema.oneOf ~= nil then fail(path, "anyOf beside oneOf is not supported") end
  local others = other_keywords(schema, { [key] = true })
  if #others > 0 then fail(path, "'%s' beside %s is not supported", others[1], key) end
  local branches = schema[key]
  if type(branches) ~= "table" or not is_array(branches) or #branches == 0 then
    fail(path, "%s must be a non-empty array of schemas", key)
  end
  if key == "oneOf" then
    for i = 1, #branches do
      for j = i + 1, #branches do
        if not disjoint(branches[i], branches[j]) then
          fail(path, "oneOf branches %d and %d may accept the same value (exactly one must): use anyOf, "
            .. "or tell them apart by type, by constants or by a required property's const", i - 1, j - 1)
        end
      end
    end
  end
  local alts = {}
  for i, b in ipairs(branches) do
    alts[i] = self:visit(b, hint .. "-" .. (i - 1), ("%s/%s/%d"):format(path, key, i - 1))
  end
  return self:add(hint, table.concat(alts, " | "))
end

-- ---- typed schemas -----------------------------------------------------------

function C:typed(schema, t, hint, path)
  if t == "null" or t == "boolean" then return self:builtin(t) end
  if t == "string" then return self:string(schema, hint, path) end
  if t == "integer" or t == "number" then return self:number(schema, t, hint, path) end
  if t == "array" then return self:array(schema, hint, path) end
  return self:object(schema, hint, path)
end

local function check_count(v, what, path)
  if v == nil then return nil end
  if math.type(v) ~= "integer" and not (type(v) == "number" and v == math.floor(v) and v >= 0 and v < 2^31) then
    fail(path, "%s must be a non-negative integer", what)
  end
  v = math.tointeger(v)
  if v < 0 then fail(path, "%s must be a non-negative integer", what) end
  return v
end

-- strings
function C:string(schema, hint, path)
  local min, max = check_count(schema.minLength, "minLength", path), check_count(schema.maxLength, "maxLength", path)
  local n = (schema.pattern ~= nil and 1 or 0) + (schema.format ~= nil and 1 or 0) + ((min or max) and 1 or 0)
  if n > 1 then fail(path, "only one of pattern, format and minLength/maxLength is supported on a string") end
  if schema.pattern ~= nil then
    if type(schema.pattern) ~= "string" then fail(path, "pattern must be a string") end
    return self:add(hint, self:pattern(schema.pattern, hint, path .. "/pattern"))
  end
  if schema.format ~= nil then
    local f = FORMATS[schema.format]
    if not f then fail(path, "unsupported format '%s' (supported: date, time, date-time, uuid)", tostring(schema.format)) end
    return self:builtin(f)
  end
  if min or max then
    if max and min and max < min then fail(path, "maxLength is below minLength") end
    return self:add(hint, '"\\"" ' .. self:builtin("char") .. repeat_op(min or 0, max) .. ' "\\""')
  end
  return self:builtin("string")
end

-- ---- integer and number ranges ----------------------------------------------

-- Digit-level GBNF of the decimal numerals (no sign, no leading zero) of
-- the integers in [lo, hi] (hi nil: no bound; lo >= 0).
local function same_length(lo, hi)
  -- lo, hi: digit strings of one length, lo <= hi
  if lo == "" then return "" end
  local a, b = lo:sub(1, 1), hi:sub(1, 1)
  local lrest, hrest = lo:sub(2), hi:sub(2)
  local n = #lrest
  if a == b then
    local rest = same_length(lrest, hrest)
    if rest == "" then return lit(a) end
    return lit(a) .. (rest:find("|", 1, true) and " ( " .. rest .. " )" or " " .. rest)
  end
  local alts = {}
  local zeros, nines = ("0"):rep(n), ("9"):rep(n)
  local first, last = a:byte(), b:byte()
  -- the first digit a with lrest .. 9s (whole when lrest is all zeros)
  if lrest ~= zeros then
    alts[#alts + 1] = lit(a) .. " (" .. same_length(lrest, nines) .. ")"
    first = first + 1
  end
  local tail_whole = hrest == nines
  local mid_hi = tail_whole and last or last - 1
  if first <= mid_hi then
    local cls = first == mid_hi and ("[%s]"):format(string.char(first))
      or ("[%s-%s]"):format(string.char(first), string.char(mid_hi))
    alts[#alts + 1] = cls .. (n > 0 and " [0-9]" .. repeat_op(n, n) or "")
  end
  if not tail_whole then
    alts[#alts + 1] = lit(b) .. " (" .. same_length(zeros, hrest) .. ")"
  end
  return table.concat(alts, " | ")
end

local MAX_DIGITS = 16

local function uint_range(lo, hi)
  local alts = {}
  local ls = ("%d"):format(lo)
  local top = hi and #("%d"):format(hi) or MAX_DIGITS
  for len = #ls, top do
    local from = len == #ls and ls or ("1" .. ("0"):rep(len - 1))
    local to = (hi and len == top) and ("%d"):format(hi) or ("9"):rep(len)
    if not hi and len > #ls then -- every longer numeral at once
      alts[#alts + 1] = "[1-9] [0-9]" .. repeat_op(len - 1, MAX_DIGITS - 1)
      break
    end
    alts[#alts + 1] = "( " .. same_length(from, to) .. " )"
  end
  return "( " .. table.concat(alts, " | ") .. " )"
end

-- Integers in [lo, hi] (either nil: unbounded), signed.
local function int_range(lo, hi)
  local alts = {}
  if hi == nil or hi >= 0 then alts[#alts + 1] = uint_range(math.max(lo or 0, 0), hi) end
  if lo == nil or lo < 0 then
    local mlo = (hi ~= nil and hi < 0) and -hi or 1
    alts[#alts + 1] = '"-" ' .. uint_range(mlo, lo and -lo or nil)
  end
  return table.concat(alts, " | ")
end

local function bound(schema, key, path)
  local v = schema[key]
  if v == nil then return nil end
  if type(v) ~= "number" or v ~= v then
    fail(path, "%s must be a number%s", key, type(v) == "boolean" and " (draft 4's boolean form is not supported)" or "")
  end
  if math.abs(v) >= MAX_BOUND then fail(path, "%s: bounds of %g or more are not supported", key, MAX_BOUND) end
  return v
end

-- The integer bounds [L, H] of a schema's minimum/maximum (exclusive too).
local function int_bounds(schema, path)
  local lo, hi
  local v = bound(schema, "minimum", path)
  if v then lo = math.ceil(v) end
  v = bound(schema, "exclusiveMinimum", path)
  if v then lo = math.max(lo or -math.huge, math.floor(v) + 1) end
  v = bound(schema, "maximum", path)
  if v then hi = math.floor(v) end
  v = bound(schema, "exclusiveMaximum", path)
  if v then hi = math.min(hi or math.huge, math.ceil(v) - 1) end
  return lo and math.tointeger(lo), hi and math.tointeger(hi)
end

function C:number(schema, t, hint, path)
  local has = false
  for k in pairs(KIND_KEYWORDS.number) do has = has or schema[k] ~= nil end
  if not has then return self:builtin(t) end
  local lo, hi = int_bounds(schema, path)
  if t == "integer" then
    if lo and hi and lo > hi then fail(path, "no integer lies within the bounds") end
    return self:add(hint, int_range(lo, hi))
  end
  -- numbers: the integers within, and i.f (f with a last digit not 0, so
  -- strictly between i and i + 1) where that whole open interval lies
  -- within the bounds, inclusive or not: (i, i+1) within (m, M) or [m, M]
  -- iff ceil(m) <= i <= floor(M) - 1; -j.f likewise over (-j-1, -j)
  local alts = {}
  if not (lo and hi and lo > hi) then alts[#alts + 1] = int_range(lo, hi) end
  local m, mx = schema.minimum, schema.maximum
  if schema.exclusiveMinimum ~= nil then m = math.max(m or -math.huge, schema.exclusiveMinimum) end
  if schema.exclusiveMaximum ~= nil then mx = math.min(mx or math.huge, schema.exclusiveMaximum) end
  local frac = ' "." [0-9]{0,15} [1-9]'
  local plo, phi = math.max(m and math.tointeger(math.ceil(m)) or 0, 0), mx and math.tointeger(math.floor(mx)) - 1
  if phi == nil or plo <= phi then alts[#alts + 1] = uint_range(plo, phi) .. frac end
  local nlo, nhi = math.max(mx and math.tointeger(math.ceil(-mx)) or 0, 0), m and math.tointeger(math.floor(-m)) - 1
  if nhi == nil or nlo <= nhi then alts[#alts + 1] = '"-" ' .. uint_range(nlo, nhi) .. frac end
  if #alts == 0 then fail(path, "no number written without an exponent lies within the bounds") end
  return self:add(hint, "( " .. table.concat(alts, " ) | ( ") .. " )")
end

-- ---- arrays ------------------------------------------------------------------

function C:array(schema, hint, path)
  local min, max = check_count(schema.minItems, "minItems", path) or 0, check_count(schema.maxItems, "maxItems", path)
  if max and max < min then fail(path, "maxItems is below minItems") end
  if schema.uniqueItems ~= nil and schema.uniqueItems ~= false and not (max and max <= 1) then
    fail(path, "unsupported keyword 'uniqueItems' (true, with more than one item)")
  end
  local prefix, items = schema.prefixItems, schema.items
  if type(items) == "table" and is_array(items) and next(items) ~= nil then -- draft 4 tuple
    if prefix ~= nil then fail(path, "items as an array beside prefixItems") end
    prefix, items = items, nil
  end
  local parts = {}
  local n = 0
  if prefix ~= nil then
    if type(prefix) ~= "table" or not is_array(prefix) then fail(path, "prefixItems must be an array of schemas") end
    n = #prefix
    if max and max < n then fail(path, "maxItems below the number of prefixItems is not supported") end
    for i, p in ipairs(prefix) do
      parts[#parts + 1] = self:visit(p, hint .. "-" .. (i - 1), ("%s/prefixItems/%d"):format(path, i - 1))
    end
  end
  local item
  if items == false then
    if min > n then fail(path, "minItems above the prefixItems with items false") end
  elseif items ~= nil then
    item = self:visit(items, hint .. "-item", path .. "/items")
  elseif prefix == nil or min > n then
    item = self:builtin("value")
  end
  local sp = self:builtin("space")
  local body = '"[" ' .. sp .. " "
  if n > 0 then body = body .. table.concat(parts, ' "," ' .. sp .. " ") end
  if item then
    local rmin, rmax = math.max(min - n, 0), max and max - n
    if rmax ~= 0 then
      if n > 0 then
        body = body .. ' ( "," ' .. sp .. " " .. item .. " )" .. repeat_op(rmin, rmax)
      elseif rmin == 0 then
        local more = rmax == nil and "*" or repeat_op(0, rmax - 1)
        body = body .. "( " .. item .. (rmax == 1 and "" or ' ( "," ' .. sp .. " " .. item .. " )" .. more) .. " )?"
      else
        body = body .. item .. (rmax == 1 and "" or ' ( "," ' .. sp .. " " .. item .. " )" .. repeat_op(rmin - 1, rmax and rmax - 1))
      end
    end
  end
  return self:add(hint, body .. " " .. sp .. ' "]"')
end

-- ---- objects -------------------------------------------------------------------

-- GBNF of JSON string keys (no escapes) other than the strings of names.
function C:other_keys(names, hint)
  local trie = { children = {}, keys = {} }
  for _, s in ipairs(names) do
    local node = trie
    for _, cp in utf8.codes(s) do
      local c = node.children[cp]
      if not c then
        c = { children = {}, keys = {} }
        node.children[cp] = c
        node.keys[#node.keys + 1] = cp
      end
      node = c
    end
    node.terminal = true
  end
  local kc = self:add(hint .. "-char", '[^"\\\\\\x00-\\x1F\\x7F]')
  local function visit(node)
    local alts = {}
    table.sort(node.keys)
    local excluded = { { 0x22, 0x22 }, { 0x5C, 0x5C }, { 0x00, 0x1F }, { 0x7F, 0x7F } }
    for _, cp in ipairs(node.keys) do
      alts[#alts + 1] = lit(utf8.char(cp)) .. " ( " .. visit(node.children[cp]) .. " )"
      excluded[#excluded + 1] = { cp, cp }
    end
    alts[#alts + 1] = class(excluded, true) .. " " .. kc .. "*"
    local body = table.concat(alts, " | ")
    if not node.terminal then body = "( " .. body .. " )?" end
    return body
  end
  return self:add(hint, '"\\"" ( ' .. visit(trie) .. ' ) "\\""')
end

function C:object(schema, hint, path)
  local props = schema.properties
  local extra = schema.additionalProperties
  local required = schema.required
  if props ~= nil and (type(props) ~= "table" or (is_array(props) and next(props) ~= nil)) then
    fail(path, "properties must be an object")
  end
  if required ~= nil and (type(required) ~= "table" or not is_array(required)) then
    fail(path, "required must be an array of names")
  end
  if props == nil and required == nil and (extra == nil or extra == true) then
    return self:builtin("object")
  end
  props = props or {}
  local req = {}
  for _, name in ipairs(required or {}) do
    if type(name) ~= "string" then fail(path, "required must be an array of names") end
    req[name] = true
  end
  -- the order: required (text order, else `required`), then optional
  local names = {}
  local listed = {}
  for _, k in ipairs(self:keys(props)) do listed[#listed + 1] = k end
  local req_order = {}
  if self.order[props] then
    for _, k in ipairs(listed) do if req[k] then req_order[#req_order + 1] = k end end
    for _, k in ipairs(required or {}) do
      if props[k] == nil then req_order[#req_order + 1] = k end
    end
  else
    for _, k in ipairs(required or {}) do req_order[#req_order + 1] = k end
  end
  local seen = {}
  local reqs, opts = {}, {}
  for _, k in ipairs(req_order) do
    if not seen[k] then
      seen[k] = true
      reqs[#reqs + 1] = k
    end
  end
  for _, k in ipairs(listed) do
    if not req[k] then opts[#opts + 1] = k end
  end
  local sp = self:builtin("space")
  local kv = {}
  for _, k in ipairs(reqs) do names[#names + 1] = k end
  for _, k in ipairs(opts) do names[#names + 1] = k end
  for _, k in ipairs(names) do
    local sub = props[k]
    if sub == nil then
      if extra == false then fail(path, "required property '%s' is not in properties and additionalProperties is false", k) end
      sub = (type(extra) == "table") and extra or true
    end
    local value = self:visit(sub, hint .. "-" .. k, path .. "/properties/" .. k)
    kv[k] = self:add(hint .. "-" .. k .. "-kv", const_literal(k, path) .. " " .. sp .. ' ":" ' .. sp .. " " .. value)
  end
  local extra_kv
  if extra ~= nil and extra ~= false then
    local value = extra == true and self:builtin("value")
      or self:visit(extra, hint .. "-additional", path .. "/additionalProperties")
    local key = #names == 0 and self:builtin("string") or self:other_keys(names, hint .. "-additional-key")
    extra_kv = self:add(hint .. "-additional-kv", key .. " " .. sp .. ' ":" ' .. sp .. " " .. value)
  end
  local comma = '"," ' .. sp .. " "
  local body = '"{" ' .. sp .. " "
  local reqparts = {}
  for i, k in ipairs(reqs) do reqparts[i] = kv[k] end
  body = body .. table.concat(reqparts, " " .. comma)
  -- optional ones after: each at most once, in order, then any extra ones
  local tail = {}
  if #reqs > 0 then
    for _, k in ipairs(opts) do tail[#tail + 1] = "( " .. comma .. kv[k] .. " )?" end
    if extra_kv then tail[#tail + 1] = "( " .. comma .. extra_kv .. " )*" end
    if #tail > 0 then body = body .. " " .. table.concat(tail, " ") end
  elseif #opts > 0 or extra_kv then
    -- no required one: the first present one has no comma before it
    local rest = {}
    local after = extra_kv and ("( " .. comma .. extra_kv .. " )*") or nil
    local firsts = {}
    local following = after
    for i = #opts, 1, -1 do
      local this = opts[i]
      firsts[#firsts + 1] = kv[this] .. (following and " " .. following or "")
      local piece = "( " .. comma .. kv[this] .. " )?"
      following = following and (piece .. " " .. following) or piece
      if i > 1 and #opts > 2 then -- share the chain of later options as a rule
        following = self:add(hint .. "-rest", following)
      end
    end
    rest = {}
    for i = #firsts, 1, -1 do rest[#rest + 1] = firsts[i] end
    if extra_kv then rest[#rest + 1] = extra_kv .. " " .. after end
    body = body .. "( " .. table.concat(rest, " | ") .. " )?"
  end
  return self:add(hint, body .. " " .. sp .. ' "}"')
end

-- ==== regular expressions ======================================================

-- Parses the regex subset into a tree:
--   {"alt", a, b, ...} {"seq", ...} {"rep", node, min, max}
--   {"set", ranges, negated} {"char", cp}
local function parse_regex(re, path)
  local cps = {}
  for _, cp in utf8.codes(re) do cps[#cps + 1] = cp end
  local i = 1
  local function peek() return cps[i] end
  local function bad(fmt, ...) fail(path, "pattern %q: " .. fmt, re, ...) end
  local function ch(c) return c and utf8.char(c) or "" end

  local DIGIT = { { 0x30, 0x39 } }
  local WORD = { { 0x30, 0x39 }, { 0x41, 0x5A }, { 0x5F, 0x5F }, { 0x61, 0x7A } }
  local SPACE = { { 0x09, 0x0A }, { 0x0C, 0x0D }, { 0x20, 0x20 } }

  -- an escape after "\": returns ("set", ranges, negated) or ("char", cp)
  local function escape(in_class)
    local c = cps[i]
    if not c then bad("a trailing backslash") end
    i = i + 1
    local s = ch(c)
    if s == "d" then return "set", DIGIT, false end
    if s == "D" then return "set", DIGIT, true end
    if s == "w" then return "set", WORD, false end
    if s == "W" then return "set", WORD, true end
    if s == "s" then return "set", SPACE, false end
    if s == "S" then return "set", SPACE, true end
    if s == "n" then return "char", 0x0A end
    if s == "t" then return "char", 0x09 end
    if s == "r" then return "char", 0x0D end
    if s == "f" then return "char", 0x0C end
    if s == "v" then return "char", 0x0B end
    if s == "x" or s == "u" then
      local n = s == "x" and 2 or 4
      local hex = ""
      for _ = 1, n do
        local h = cps[i]
        if not h or not ch(h):match("%x") then bad("\\%s needs %d hex digits", s, n) end
        hex = hex .. ch(h)
        i = i + 1
      end
      return "char", tonumber(hex, 16)
    end
    if s:match("[%w]") then bad("unsupported escape \\%s", s) end
    return "char", c
  end

  local function parse_class()
    -- after "["
    local negated = false
    if peek() == 0x5E then negated = true; i = i + 1 end
    local ranges = {}
    local first = true
    while true do
      local c = peek()
      if not c then bad("an unclosed [") end
      if c == 0x5D and not first then i = i + 1; break end
      first = false
      local lo
      i = i + 1
      if c == 0x5C then
        local kind, a, neg = escape(true)
        if kind == "set" then
          if neg then bad("negated escapes inside a class") end
          for _, r in ipairs(a) do ranges[#ranges + 1] = r end
          goto continue
        end
        lo = a
      elseif c == 0x5B and peek() == 0x3A then
        bad("POSIX classes [:...:]")
      else
        lo = c
      end
      if peek() == 0x2D and cps[i + 1] and cps[i + 1] ~= 0x5D then
        i = i + 1
        local h = cps[i]
        i = i + 1
        if h == 0x5C then
          local kind, a = escape(true)
          if kind ~= "char" then bad("a class escape as a range end") end
          h = a
        end
        if h < lo then bad("a range out of order") end
        ranges[#ranges + 1] = { lo, h }
      else
        ranges[#ranges + 1] = { lo, lo }
      end
      ::continue::
    end
    return { "set", ranges, negated }
  end

  local parse_alt

  local function parse_atom()
    local c = peek()
    i = i + 1
    if c == 0x28 then -- (
      if peek() == 0x3F then
        if cps[i + 1] == 0x3A then i = i + 2 else bad("group syntax (?%s", ch(cps[i + 1])) end
      end
      local node = parse_alt()
      if peek() ~= 0x29 then bad("an unclosed (") end
      i = i + 1
      return node
    elseif c == 0x5B then
      return parse_class()
    elseif c == 0x2E then
      return { "set", { { 0x0A, 0x0A }, { 0x0D, 0x0D } }, true }
    elseif c == 0x5C then
      local kind, a, neg = escape(false)
      if kind == "set" then return { "set", a, neg } end
      return { "char", a }
    elseif c == 0x5E or c == 0x24 then
      bad("%s is supported only at the pattern's start (^) or end ($)", ch(c))
    elseif c == 0x2A or c == 0x2B or c == 0x3F or c == 0x7B then
      bad("a quantifier %s with nothing before it", ch(c))
    elseif c == 0x29 then
      bad("an unmatched )")
    end
    return { "char", c }
  end

  local function number()
    local s = ""
    while peek() and peek() >= 0x30 and peek() <= 0x39 do
      s = s .. ch(peek())
      i = i + 1
    end
    return s ~= "" and tonumber(s) or nil
  end

  local function parse_seq()
    local items = {}
    while peek() and peek() ~= 0x7C and peek() ~= 0x29 do
      if peek() == 0x24 and i == #cps then break end -- the final $ (handled by the caller)
      local atom = parse_atom()
      local q = peek()
      local min, max
      if q == 0x2A then min, max = 0, nil
      elseif q == 0x2B then min, max = 1, nil
      elseif q == 0x3F then min, max = 0, 1
      elseif q == 0x7B then
        i = i + 1
        min = number()
        if not min then bad("a { without a count") end
        max = min
        if peek() == 0x2C then
          i = i + 1
          max = number()
        end
        if peek() ~= 0x7D then bad("an unclosed {") end
        if max and max < min then bad("{%d,%d} out of order", min, max) end
      end
      if min then
        i = i + 1
        if peek() == 0x3F then i = i + 1 end -- lazy: the same strings
        if peek() == 0x2B then bad("possessive quantifiers") end
        local q2 = peek()
        if q2 == 0x2A or q2 == 0x2B or (q2 == 0x7B) then bad("a quantifier after a quantifier") end
        atom = { "rep", atom, min, max }
      end
      items[#items + 1] = atom
    end
    return { "seq", table.unpack(items) }
  end

  function parse_alt()
    local alts = { parse_seq() }
    while peek() == 0x7C do
      i = i + 1
      alts[#alts + 1] = parse_seq()
    end
    if #alts == 1 then return alts[1] end
    return { "alt", table.unpack(alts) }
  end

  local start = false
  if cps[1] == 0x5E then start = true; i = 2 end
  local tree = parse_alt()
  local stop = false
  if peek() == 0x24 and i == #cps then stop = true; i = i + 1 end
  if peek() ~= nil then
    if peek() == 0x29 then bad("an unmatched )") end
    bad("unexpected %s", ch(peek()))
  end
  return tree, start, stop
end

-- The JSON text of one code point inside a string (escaped as JSON must).
local function json_char(cp)
  if cp == 0x22 then return '\\"' end
  if cp == 0x5C then return "\\\\" end
  if cp == 0x0A then return "\\n" end
  if cp == 0x0D then return "\\r" end
  if cp == 0x09 then return "\\t" end
  if cp == 0x0C then return "\\f" end
  if cp == 0x08 then return "\\b" end
  if cp < 0x20 then return ("\\u%04x"):format(cp) end
  return utf8.char(cp)
end

-- GBNF of a set of code points as JSON string text.
local function set_gbnf(ranges, negated)
  if negated then -- characters written as themselves only
    local ex = { { 0x00, 0x1F }, { 0x22, 0x22 }, { 0x5C, 0x5C }, { 0x7F, 0x7F } }
    for _, r in ipairs(ranges) do ex[#ex + 1] = r end
    return class(ex, true)
  end
  local plain, escaped = {}, {}
  for _, r in ipairs(ranges) do
    local lo, hi = r[1], r[2]
    -- cut out controls, " and \ (written as escapes)
    local cuts = { { 0x00, 0x1F }, { 0x22, 0x22 }, { 0x5C, 0x5C } }
    local pieces = { { lo, hi } }
    for _, cut in ipairs(cuts) do
      local nxt = {}
      for _, p in ipairs(pieces) do
        if p[2] < cut[1] or p[1] > cut[2] then
          nxt[#nxt + 1] = p
        else
          if p[1] < cut[1] then nxt[#nxt + 1] = { p[1], cut[1] - 1 } end
          if p[2] > cut[2] then nxt[#nxt + 1] = { cut[2] + 1, p[2] } end
          for cp = math.max(p[1], cut[1]), math.min(p[2], cut[2]) do escaped[cp] = true end
        end
      end
      pieces = nxt
    end
    for _, p in ipairs(pieces) do plain[#plain + 1] = p end
  end
  local alts = {}
  if #plain > 0 then alts[1] = class(plain, false) end
  for _, cp in ipairs(sorted_keys(escaped)) do alts[#alts + 1] = lit(json_char(cp)) end
  if #alts == 0 then return nil end
  if #alts == 1 then return alts[1] end
  return "( " .. table.concat(alts, " | ") .. " )"
end

function C:pattern(re, hint, path)
  local tree, start, stop = parse_regex(re, path)
  local function emit(node)
    local kind = node[1]
    if kind == "char" then return lit(json_char(node[2])) end
    if kind == "set" then
      local g = set_gbnf(node[2], node[3])
      if not g then fail(path, "pattern %q: a class no JSON character matches", re) end
      return g
    end
    if kind == "rep" then
      local inner = emit(node[2])
      if inner == "" then return "" end
      return "( " .. inner .. " )" .. repeat_op(node[3], node[4])
    end
    local parts = {}
    for j = 2, #node do
      local e = emit(node[j])
      if e ~= "" or kind == "alt" then parts[#parts + 1] = e == "" and '""' or e end
    end
    if kind == "seq" then return table.concat(parts, " ") end
    return "( " .. table.concat(parts, " | ") .. " )"
  end
  local body = emit(tree)
  local char = self:builtin("char")
  local out = { '"\\""' }
  if not start then out[#out + 1] = char .. "*" end
  if body ~= "" then out[#out + 1] = "( " .. body .. " )" end
  if not stop then out[#out + 1] = char .. "*" end
  out[#out + 1] = '"\\""'
  return table.concat(out, " ")
end

-- ==== JSON text with key order ===================================================

-- Decodes JSON text, recording each object's keys in text order.
local function decode_ordered(text)
  local v, err = json.decode(text)
  if err then return nil, err end
  return v, json.key_order(text, v)
end

-- ==== API ======================================================================

--- json_schema.to_gbnf(schema) -> GBNF text (start rule "root") | nil, message
--- schema: a Lua table (kvlua.json's values: json.null, json.array) or JSON text.
function M.to_gbnf(schema)
  local order
  if type(schema) == "string" then
    local v, o = decode_ordered(schema)
    if v == nil then return nil, "json_schema: the schema is not JSON: " .. tostring(o) end
    schema, order = v, o
  elseif type(schema) ~= "table" and type(schema) ~= "boolean" then
    error("json_schema.to_gbnf: a schema (table or JSON text) expected, got " .. type(schema), 2)
  end
  local c = new_converter(schema, order)
  c.names.root = true
  local ok, res = pcall(function()
    local expr = c:visit(schema, "root-value", "#")
    table.insert(c.rules, 1, { "root", expr })
  end)
  if not ok then
    if getmetatable(res) == Fail then return nil, res.msg end
    error(res, 0)
  end
  local lines = {}
  for i, r in ipairs(c.rules) do lines[i] = r[1] .. " ::= " .. r[2] end
  return table.concat(lines, "\n") .. "\n"
end

return M
