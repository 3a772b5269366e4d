-- kvlua.jinja — the Jinja subset that chat templates are written in, so a
-- GGUF file's tokenizer.chat_template renders as Hugging Face renders it.
--
--   local jinja = require "kvlua.jinja"
--   local t, err = jinja.compile(template_text)          -- nil, err on a syntax error
--   local s, err = t:render{ messages = msgs, add_generation_prompt = true }
--   local s, err = jinja.render(template_text, vars [, opts])
--
-- The environment is the one transformers builds for chat templates:
-- jinja2's ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and
-- the loopcontrols extension (break/continue), plus raise_exception(msg),
-- strftime_now(fmt) and transformers' own tojson filter (json.dumps with
-- ensure_ascii=False, indent, separators, sort_keys). A template's single
-- trailing newline is dropped, as jinja2 does.
--
-- Values. Lua strings, numbers (integer and float stay apart, as Python's
-- int and float), booleans; json.null (kvlua.json) is None; a table is a
-- list when it carries json.array's mark or its keys are exactly 1..n (an
-- empty plain table is an empty list), else a dict. A dict's keys iterate
-- (items(), tojson, for) in the order of jinja.dict's pairs when it was
-- made by jinja.dict or jinja.decode_json, else in sorted order (Python
-- keeps insertion order, which a Lua table has not kept).
--
-- Python semantics where templates lean on them: truthiness (empty
-- string, list and dict are false; so are None and undefined), str() of
-- values (True, None, 1.0, ['a']), `/` always a float, `//` floors, `in`
-- on strings, lists and dicts, `+` on strings and lists, slices with
-- negative bounds and steps, string and dict methods, loop scoping (a set
-- inside a for body stays in the iteration; namespace() is the way out).
--
-- Supported: {{ }}, {% if/elif/else %}, {% for ... in ... [if ...] %} with
-- else, loop.index/index0/revindex/revindex0/first/last/length/previtem/
-- nextitem/cycle/changed/depth, break/continue, {% set %} (names, tuples,
-- namespace attributes, block form), {% macro %} with defaults and
-- {% call %}/caller, {% filter %}, {% raw %}, {% generation %}
-- (transformers' assistant-mask tag, rendered as its body), comments and
-- whitespace control ({%- -%}, {%+ ... %}). Filters: abs, batch,
-- capitalize, center, count, d, default, dictsort, e, escape, first,
-- float, format, indent, int, items, join, last, length, list, lower,
-- map, max, min, reject, rejectattr, replace, reverse, round, safe,
-- select, selectattr, sort, string, sum, title, tojson, trim, unique,
-- upper, wordcount; map, select, reject, selectattr, rejectattr and unique
-- give generators as jinja2's do (iterable, always true, no len, no JSON);
-- safe and escape give markup, whose + escapes a plain string on its other
-- side as markupsafe's does. The % operator formats as Python's does.
-- Tests: boolean, callable, defined, divisibleby, eq, equalto, escaped,
-- even, false, float, ge, gt, in, integer, iterable, le, lower, lt,
-- mapping, ne, none, number, odd, sameas, sequence, string, true,
-- undefined, upper and ==, !=, <, <=, >, >=.
-- Globals: range, dict, namespace, raise_exception, strftime_now.
-- String methods: capitalize, count, endswith, find, format ({} and {name}
-- fields), isalnum, isalpha, isdigit, islower, isspace, isupper, join,
-- lower, lstrip, replace, rfind, rsplit, rstrip, split, splitlines,
-- startswith, strip, title, upper (case mapping beyond ASCII: Latin-1,
-- Latin Extended-A, Greek, Cyrillic); dict methods: get, items, keys, values;
-- list methods: count, index. Methods that would mutate a list or dict
-- (append, pop, update, ...) fail as the immutable sandbox makes them fail.
--
-- Not supported (compile gives nil, "jinja: unsupported <construct> at
-- line L col C"): extends/block/include/import/from, {% do %}, recursive
-- loops, {% with %}, {% autoescape %}, *args/**kwargs in calls, integer
-- literals past 64 bits; and when rendering reaches them (jinja2 too
-- refuses some only then): unknown filters and tests, format specs in
-- str.format.
--
-- A template is untrusted input (it comes from a model file): rendering
-- is bounded in steps (opts.max_steps, 1e6; a string made costs a step per
-- 64 bytes, a list copied a step per item), output and string sizes
-- (opts.max_output, 8 MiB), nesting (200) and macro call depth
-- (opts.max_depth, 64); past a bound it returns nil, message. Errors are nil, "jinja: ... at line L col C";
-- raise_exception(msg) gives nil, "jinja: raise_exception: msg".
--
-- opts.now: the time strftime_now formats (os.time() value, UTC); by
-- default the current time.

local json = require "kvlua.json"

local M = {}

M.none = json.null
local NONE = json.null

-- ==== errors ================================================================

local ERR = { __name = "jinja.error", __tostring = function(e) return e.msg end }

local function where(pos)
  if pos then return (" at line %d col %d"):format(pos[1], pos[2]) end
  return ""
end

local function fail(msg, pos)
  error(setmetatable({ msg = "jinja: " .. msg .. where(pos) }, ERR), 0)
end

-- ==== values ================================================================

local CURRENT -- the Ctx of the render under way (renders do not nest)

local UNDEF_MT = { __name = "jinja.undefined" }
local function undef(name) return setmetatable({ name = name }, UNDEF_MT) end
local function is_undef(v) return v == nil or getmetatable(v) == UNDEF_MT end

local CALLABLE = { __name = "jinja.callable" }
local function callable(fn, name) return setmetatable({ fn = fn, name = name }, CALLABLE) end
local function is_callable(v) return type(v) == "table" and getmetatable(v) == CALLABLE end

local NAMESPACE = { __name = "jinja.namespace" }
-- What map/select/reject/selectattr/rejectattr return: a Python generator,
-- iterable but with no len(), no JSON form and always true.
local GENERATOR = { __name = "jinja.generator" }
local function new_gen(t) return setmetatable({ items = t }, GENERATOR) end
local function is_gen(v) return type(v) == "table" and getmetatable(v) == GENERATOR end
-- A string marked safe (|safe, |escape): Python's markupsafe.Markup, whose
-- `+` HTML-escapes a plain string on its other side. Everything but `+`,
-- {{ }} and {% set %} sees the plain string (eval unmarks).
local MARKUP = { __name = "jinja.markup" }
local function markup(s) return setmetatable({ s = s }, MARKUP) end
local function html_escape(s)
  return (s:gsub("[&<>\"']", { ["&"] = "&amp;", ["<"] = "&lt;", [">"] = "&gt;",
                               ['"'] = "&#34;", ["'"] = "&#39;" }))
end
local function unmark(v)
  if type(v) == "table" and getmetatable(v) == MARKUP then return v.s end
  return v
end
local DICT = "jinja.dict" -- __name of an ordered dict's (per-table) metatable

local function new_list(t) return json.array(t or {}) end
-- A tuple is a list that prints as Python prints a tuple.
local TUPLE = { __name = "jinja.tuple" }
local function new_tuple(t) return setmetatable(t, TUPLE) end

--- jinja.dict(pairs) -> a dict whose keys keep the order of pairs
--- ({ {k1, v1}, {k2, v2}, ... }), as a Python dict keeps insertion order.
local function new_dict()
  return setmetatable({}, { __name = DICT, keys = {} })
end
local function dict_set(t, k, v)
  local mt = getmetatable(t)
  if mt and mt.__name == DICT and t[k] == nil then
    local keys = mt.keys
    keys[#keys + 1] = k
  end
  rawset(t, k, v)
end
function M.dict(pairs_)
  if type(pairs_) ~= "table" then error("jinja.dict: array of {key, value} pairs expected", 2) end
  local d = new_dict()
  for i, p in ipairs(pairs_) do
    if type(p) ~= "table" or p[1] == nil then error("jinja.dict: pair " .. i .. " must be {key, value}", 2) end
    dict_set(d, p[1], p[2])
  end
  return d
end

local function is_list(v)
  if type(v) ~= "table" then return false end
  local mt = getmetatable(v)
  if mt ~= nil then return mt == TUPLE or json.is_array(v) end
  -- a plain table: counted once per render (the caller's data does not
  -- change while it renders)
  local cache = CURRENT and CURRENT.listy
  if cache then
    local c = cache[v]
    if c ~= nil then return c end
  end
  local n, count = #v, 0
  local r = true
  for _ in pairs(v) do
    count = count + 1
    if count > n then r = false break end
  end
  r = r and count == n
  if cache then cache[v] = r end
  return r
end

local function is_dict(v)
  if type(v) ~= "table" then return false end
  local mt = getmetatable(v)
  if mt == nil then return not is_list(v) end
  return mt.__name == DICT
end

local function key_less(a, b)
  local ta, tb = type(a), type(b)
  if ta == tb and (ta == "string" or ta == "number") then return a < b end
  return ta < tb
end

-- The keys of a dict, in order.
local function dict_keys(t)
  local mt = getmetatable(t)
  local out, seen = {}, {}
  if mt and mt.__name == DICT then
    for _, k in ipairs(mt.keys) do
      if rawget(t, k) ~= nil and not seen[k] then out[#out + 1] = k seen[k] = true end
    end
  end
  local rest = {}
  for k in pairs(t) do if not seen[k] then rest[#rest + 1] = k end end
  if #rest > 0 then
    table.sort(rest, key_less)
    for _, k in ipairs(rest) do out[#out + 1] = k end
  end
  return out
end

local function is_string(v) return type(v) == "string" end
local function is_number(v) return type(v) == "number" end

local function truthy(v)
  if v == nil or v == false or v == NONE then return false end
  local t = type(v)
  if t == "number" then return v ~= 0 end
  if t == "string" then return v ~= "" end
  if t == "table" then
    local mt = getmetatable(v)
    if mt == UNDEF_MT then return false end
    if mt == CALLABLE or mt == NAMESPACE or mt == GENERATOR then return true end
    return next(v) ~= nil
  end
  return true
end

-- Python's float repr: the shortest digits that read back the same number,
-- positional for exponents -4..15, else d.ddde+XX.
local function float_repr(x)
  if x ~= x then return "nan" end
  if x == math.huge then return "inf" end
  if x == -math.huge then return "-inf" end
  if x == 0 then return (1 / x < 0) and "-0.0" or "0.0" end
  local s
  for p = 0, 16 do
    s = string.format("%." .. p .. "e", x)
    if tonumber(s) == x then break end
  end
  local sign, d1, rest, e = s:match("^(%-?)(%d)%.?(%d*)e([-+]%d+)$")
  e = tonumber(e)
  local digits = (d1 .. rest):gsub("0+$", "")
  if digits == "" then digits = "0" end
  if e >= -4 and e < 16 then
    local out
    if e >= 0 then
      if #digits <= e + 1 then
        out = digits .. string.rep("0", e + 1 - #digits) .. ".0"
      else
        out = digits:sub(1, e + 1) .. "." .. digits:sub(e + 2)
      end
    else
      out = "0." .. string.rep("0", -e - 1) .. digits
    end
    return sign .. out
  end
  local m = digits:sub(1, 1) .. (#digits > 1 and ("." .. digits:sub(2)) or "")
  return ("%s%se%s%02d"):format(sign, m, e < 0 and "-" or "+", math.abs(e))
end

local function num_str(x)
  if math.type(x) == "integer" then return tostring(x) end
  return float_repr(x)
end

-- Python repr of a string.
local function str_repr(s)
  local q = "'"
  if s:find("'", 1, true) and not s:find('"', 1, true) then q = '"' end
  local out = s:gsub("[%c\\'\"]", function(c)
    if c == "\\" then return "\\\\" end
    if c == q then return "\\" .. c end
    if c == "'" or c == '"' then return c end
    if c == "\n" then return "\\n" end
    if c == "\r" then return "\\r" end
    if c == "\t" then return "\\t" end
    return ("\\x%02x"):format(c:byte())
  end)
  return q .. out .. q
end

local to_str

local function repr(v, depth)
  depth = (depth or 0) + 1
  if depth > 100 then fail("value nests too deep to print") end
  if type(v) == "string" then return str_repr(v) end
  if is_list(v) then
    if CURRENT then CURRENT:charge(#v) end
    local parts = {}
    for i = 1, #v do parts[i] = repr(v[i], depth) end
    if getmetatable(v) == TUPLE then
      return "(" .. table.concat(parts, ", ") .. (#v == 1 and ",)" or ")")
    end
    return "[" .. table.concat(parts, ", ") .. "]"
  end
  if is_dict(v) then
    local parts = {}
    for _, k in ipairs(dict_keys(v)) do parts[#parts + 1] = repr(k, depth) .. ": " .. repr(v[k], depth) end
    return "{" .. table.concat(parts, ", ") .. "}"
  end
  return to_str(v)
end

-- Python's str() of a value, as {{ }} prints it.
function to_str(v)
  v = unmark(v)
  local t = type(v)
  if t == "string" then return v end
  if t == "number" then return num_str(v) end
  if t == "boolean" then return v and "True" or "False" end
  if v == NONE then return "None" end
  if is_undef(v) then return "" end
  if t == "table" then
    local mt = getmetatable(v)
    if mt == CALLABLE then return "<function " .. tostring(v.name) .. ">" end
    if mt == NAMESPACE then return "<Namespace " .. repr(v.attrs) .. ">" end
    if mt == GENERATOR then return "<generator object>" end
    return repr(v)
  end
  return tostring(v)
end

local function type_name(v)
  if v == NONE then return "NoneType" end
  if is_undef(v) then return "Undefined" end
  local t = type(v)
  if t == "string" then return "str" end
  if t == "boolean" then return "bool" end
  if t == "number" then return math.type(v) == "integer" and "int" or "float" end
  if is_callable(v) then return "function" end
  if type(v) == "table" and getmetatable(v) == NAMESPACE then return "Namespace" end
  if is_gen(v) then return "generator" end
  if is_list(v) then return "list" end
  if is_dict(v) then return "dict" end
  return t
end

-- Strings as Python sees them: code points when the text is UTF-8.
local function chars(s)
  local out = {}
  if utf8.len(s) then
    for _, c in utf8.codes(s) do out[#out + 1] = utf8.char(c) end
  else
    for i = 1, #s do out[i] = s:sub(i, i) end
  end
  return out
end
local function str_len(s) return utf8.len(s) or #s end

local function deep_eq(a, b, depth)
  if a == b then return true end
  local ta, tb = type(a), type(b)
  if ta == "boolean" and tb == "number" then return (a and 1 or 0) == b end
  if tb == "boolean" and ta == "number" then return (b and 1 or 0) == a end
  if is_undef(a) and is_undef(b) then return true end
  if ta ~= "table" or tb ~= "table" then return false end
  depth = (depth or 0) + 1
  if depth > 100 then fail("values nest too deep to compare") end
  if is_list(a) and is_list(b) then
    if #a ~= #b then return false end
    if CURRENT then CURRENT:charge(#a) end
    for i = 1, #a do if not deep_eq(a[i], b[i], depth) then return false end end
    return true
  end
  if is_dict(a) and is_dict(b) then
    local ka, kb = dict_keys(a), dict_keys(b)
    if #ka ~= #kb then return false end
    for _, k in ipairs(ka) do
      if b[k] == nil or not deep_eq(a[k], b[k], depth) then return false end
    end
    return true
  end
  return false
end

-- ==== JSON (transformers' tojson: json.dumps) ================================

local JSON_ESC = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f",
                   ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t" }

local function json_str(s, ascii)
  s = json.replace_invalid_utf8(s)
  local out = s:gsub('[%z\1-\31"\\]', function(c)
    return JSON_ESC[c] or ("\\u%04x"):format(c:byte())
  end)
  if ascii and out:find("[\128-\255]") then
    local parts = {}
    for _, c in utf8.codes(out) do
      if c < 128 then
        parts[#parts + 1] = string.char(c)
      elseif c < 0x10000 then
        parts[#parts + 1] = ("\\u%04x"):format(c)
      else
        c = c - 0x10000
        parts[#parts + 1] = ("\\u%04x\\u%04x"):format(0xD800 + (c >> 10), 0xDC00 + (c & 0x3FF))
      end
    end
    out = table.concat(parts)
  end
  return '"' .. out .. '"'
end

local function dumps(v, o, level)
  if level > 100 then fail("tojson: value nests too deep") end
  local t = type(v)
  if t == "string" then return json_str(v, o.ascii) end
  if t == "boolean" then return v and "true" or "false" end
  if v == NONE then return "null" end
  if t == "number" then
    if math.type(v) == "integer" then return tostring(v) end
    if v ~= v then return "NaN" end
    if v == math.huge then return "Infinity" end
    if v == -math.huge then return "-Infinity" end
    return float_repr(v)
  end
  if is_undef(v) or is_callable(v) or is_gen(v) or (t == "table" and getmetatable(v) == NAMESPACE) then
    fail("tojson: Object of type " .. type_name(v) .. " is not JSON serializable")
  end
  if t ~= "table" then fail("tojson: a " .. t .. " is not JSON serializable") end
  local nl, inner, close_pad = "", "", ""
  if o.indent then
    nl = "\n"
    inner = "\n" .. string.rep(o.indent, level + 1)
    close_pad = "\n" .. string.rep(o.indent, level)
  end
  local parts = {}
  if CURRENT then CURRENT:charge(type(v) == "table" and #v or 0) end
  if is_list(v) then
    if #v == 0 then return "[]" end
    for i = 1, #v do parts[i] = dumps(v[i], o, level + 1) end
    return "[" .. inner .. table.concat(parts, o.item_sep .. inner) .. close_pad .. "]"
  end
  local keys = dict_keys(v)
  if #keys == 0 then return "{}" end
  if o.sort_keys then table.sort(keys, key_less) end
  for _, k in ipairs(keys) do
    local ks
    if type(k) == "string" then ks = json_str(k, o.ascii)
    elseif type(k) == "number" then ks = '"' .. num_str(k) .. '"'
    elseif type(k) == "boolean" then ks = k and '"true"' or '"false"'
    else fail("tojson: keys must be str, int, float, bool or None") end
    parts[#parts + 1] = ks .. o.key_sep .. dumps(v[k], o, level + 1)
  end
  return "{" .. inner .. table.concat(parts, o.item_sep .. inner) .. close_pad .. "}"
end

local function tojson(v, ensure_ascii, indent, separators, sort_keys)
  local o = { ascii = truthy(ensure_ascii), sort_keys = truthy(sort_keys) }
  if indent ~= nil and not is_undef(indent) and indent ~= NONE then
    if math.type(indent) == "integer" then o.indent = string.rep(" ", math.max(indent, 0))
    elseif type(indent) == "string" then o.indent = indent
    else fail("tojson: indent must be an integer or a string") end
  end
  if separators ~= nil and not is_undef(separators) and separators ~= NONE then
    if not is_list(separators) or #separators ~= 2 or type(separators[1]) ~= "string"
        or type(separators[2]) ~= "string" then
      fail("tojson: separators must be a pair of strings")
    end
    o.item_sep, o.key_sep = separators[1], separators[2]
  else
    o.item_sep, o.key_sep = o.indent and "," or ", ", ": "
  end
  return dumps(v, o, 0)
end

--- jinja.decode_json(text) -> value | nil, err: kvlua.json.decode, but
--- objects are dicts that keep their keys' order (as Python's json.loads),
--- for tool schemas whose order a template's tojson should keep.
function M.decode_json(text)
  if type(text) ~= "string" then error("jinja.decode_json: string expected", 2) end
  local v, err = json.decode(text)
  if v == nil and err then return nil, err end
  -- Key order: json.key_order's, each object made a dict with its keys in
  -- that order (arrays keep their place, their items converted).
  local order = json.key_order(text, v)
  local function to_dict(val)
    if type(val) ~= "table" then return val end
    local keys = order[val]
    if keys then
      local d = new_dict()
      for _, k in ipairs(keys) do dict_set(d, k, to_dict(val[k])) end
      return d
    end
    for i = 1, #val do val[i] = to_dict(val[i]) end
    return val
  end
  return to_dict(v)
end

-- ==== lexer =================================================================

local OPERATORS = { "//", "**", "==", "!=", "<=", ">=",
                    "+", "-", "/", "*", "%", "~", "[", "]", "(", ")", "{", "}",
                    "<", ">", "=", ".", ":", "|", ",", ";" }

local SIMPLE_ESC = { n = "\n", t = "\t", r = "\r", ["\\"] = "\\", ["'"] = "'", ['"'] = '"',
                     a = "\a", b = "\b", f = "\f", v = "\v", ["\n"] = "" }

-- A string literal's body, with Python's unicode-escape rules.
local function unescape(body, pos)
  return (body:gsub("\\(.)([^\\]*)", function(c, rest)
    if SIMPLE_ESC[c] then return SIMPLE_ESC[c] .. rest end
    local function hex(n)
      local h = rest:sub(1, n)
      if #h < n or not h:match("^%x+$") then fail("bad \\" .. c .. " escape in a string", pos) end
      local cp = tonumber(h, 16)
      if cp > 0x10FFFF then fail("bad \\" .. c .. " escape in a string", pos) end
      return utf8.char(cp) .. rest:sub(n + 1)
    end
    if c == "x" then return hex(2) end
    if c == "u" then return hex(4) end
    if c == "U" then return hex(8) end
    if c:match("[0-7]") then
      local oct = (c .. rest):match("^[0-7][0-7]?[0-7]?")
      return utf8.char(tonumber(oct, 8)) .. (c .. rest):sub(#oct + 1)
    end
    return "\\" .. c .. rest
  end))
end

-- Splits source into a token list: { t = "text", v = s } and tag tokens
-- block_begin ... block_end / var_begin ... var_end with expression
-- tokens { t = "name"|"string"|"integer"|"float"|"op", v = ..., pos = {l, c} }.
local function lex(src)
  src = src:gsub("\r\n?", "\n")
  if src:sub(-1) == "\n" then src = src:sub(1, -2) end
  -- line starts, for positions
  local line_starts = { 1 }
  for i in src:gmatch("()\n") do line_starts[#line_starts + 1] = i + 1 end
  local function pos_of(i)
    local lo, hi = 1, #line_starts
    while lo < hi do
      local mid = (lo + hi + 1) // 2
      if line_starts[mid] <= i then lo = mid else hi = mid - 1 end
    end
    return { lo, i - line_starts[lo] + 1 }
  end

  -- First pass: raw chunks (text, and tags with their strip flags).
  local chunks = {}
  local i, n = 1, #src
  while i <= n do
    local s = src:find("{[{%%#]", i)
    if not s then
      chunks[#chunks + 1] = { kind = "text", v = src:sub(i) }
      break
    end
    chunks[#chunks + 1] = { kind = "text", v = src:sub(i, s - 1) }
    local kind = ({ ["{"] = "var", ["%"] = "block", ["#"] = "comment" })[src:sub(s + 1, s + 1)]
    local tag = { kind = kind, pos = pos_of(s) }
    local j = s + 2
    local sign = src:sub(j, j)
    if sign == "-" then tag.open_minus = true j = j + 1
    elseif sign == "+" and kind ~= "var" then tag.open_plus = true j = j + 1 end
    if kind == "comment" then
      local e = src:find("#}", j, true)
      if not e then fail("unclosed comment", tag.pos) end
      if src:sub(e - 1, e - 1) == "-" and e - 1 >= j then tag.close_minus = true end
      i = e + 2
    else
      local close = kind == "var" and "}}" or "%}"
      local toks = {}
      local k = j
      local braces = 0 -- open { of dict literals: their } does not close the tag
      while true do
        k = src:find("[^ \t\n]", k)
        if not k then fail("unclosed " .. (kind == "var" and "{{" or "{%"), tag.pos) end
        local c = src:sub(k, k)
        local at_close = braces == 0 or kind ~= "var"
        if at_close and src:sub(k, k + 1) == close then i = k + 2 break end
        if at_close and (c == "-" or (c == "+" and kind == "block")) and src:sub(k + 1, k + 2) == close then
          if c == "-" then tag.close_minus = true else tag.close_plus = true end
          i = k + 3
          break
        end
        local p = pos_of(k)
        if c:match("[%a_]") then
          local w = src:match("^[%w_]+", k)
          toks[#toks + 1] = { t = "name", v = w, pos = p }
          k = k + #w
        elseif c:match("%d") then
          local num = src:match("^%d[%d_]*%.%d[%d_]*[eE][-+]?%d+", k) or src:match("^%d[%d_]*[eE][-+]?%d+", k)
                      or src:match("^%d[%d_]*%.%d[%d_]*", k) or src:match("^%d[%d_]*", k)
          local clean = num:gsub("_", "")
          if clean:find("[.eE]") then
            toks[#toks + 1] = { t = "float", v = tonumber(clean) + 0.0, pos = p }
          else
            local v = math.tointeger(tonumber(clean))
            if not v then fail("integer literal too large", p) end
            toks[#toks + 1] = { t = "integer", v = v, pos = p }
          end
          k = k + #num
        elseif c == "'" or c == '"' then
          local e = k + 1
          while true do
            local q = src:find("[\\" .. c .. "]", e)
            if not q then fail("unclosed string", p) end
            if src:sub(q, q) == "\\" then e = q + 2 else e = q break end
          end
          toks[#toks + 1] = { t = "string", v = unescape(src:sub(k + 1, e - 1), p), pos = p }
          k = e + 1
        else
          local op
          for _, o in ipairs(OPERATORS) do
            if src:sub(k, k + #o - 1) == o then op = o break end
          end
          if not op then fail("unexpected character '" .. c .. "'", p) end
          toks[#toks + 1] = { t = "op", v = op, pos = p }
          if op == "{" then braces = braces + 1 elseif op == "}" and braces > 0 then braces = braces - 1 end
          k = k + #op
        end
      end
      tag.toks = toks
      -- {% raw %}: everything up to {% endraw %} is text
      if kind == "block" and #toks == 1 and toks[1].v == "raw" and toks[1].t == "name" then
        local a, b, m1, m2 = src:find("{%%(%-?)%s*endraw%s*(%-?)%%}", i)
        if not a then fail("missing endraw", tag.pos) end
        local body = src:sub(i, a - 1)
        if tag.close_minus then body = body:gsub("^%s+", "") end
        if m1 == "-" then body = body:gsub("%s+$", "") end
        tag.kind = "raw"
        tag.body = body
        tag.close_minus = m2 == "-"
        i = b + 1
      end
    end
    chunks[#chunks + 1] = tag
  end

  -- Second pass: whitespace control on the text between tags, in jinja2's
  -- order: what the previous tag's end consumes (-%} all whitespace;
  -- trim_blocks one newline after a block or comment), then what the next
  -- tag's start strips (-: all whitespace; lstrip_blocks: spaces and tabs
  -- from the start of its line, for a block or comment tag without +).
  local out = {}
  local prev
  for idx, c in ipairs(chunks) do
    if c.kind == "text" then
      local text = c.v
      local line_starting = prev == nil
      if prev then
        if prev.close_minus then
          local ws = text:match("^%s*")
          text = text:sub(#ws + 1)
          line_starting = ws:sub(-1) == "\n"
        elseif prev.kind ~= "var" and not prev.close_plus and text:sub(1, 1) == "\n" then
          text = text:sub(2)
          line_starting = true
        end
      end
      local nxt = chunks[idx + 1]
      if nxt then
        if nxt.open_minus then
          text = text:gsub("%s+$", "")
        elseif nxt.kind ~= "var" and not nxt.open_plus then
          local l_pos = 1
          local last_nl = text:match(".*()\n")
          if last_nl then l_pos = last_nl + 1 end
          if (last_nl or line_starting) and not text:find("[^ \t]", l_pos) then
            text = text:sub(1, l_pos - 1)
          end
        end
      end
      if text ~= "" then out[#out + 1] = { t = "text", v = text } end
    else
      prev = c
      if c.kind == "raw" then
        if c.body ~= "" then out[#out + 1] = { t = "text", v = c.body } end
      elseif c.kind ~= "comment" then
        local b = c.kind == "var" and "var" or "block"
        out[#out + 1] = { t = b .. "_begin", pos = c.pos }
        for _, tk in ipairs(c.toks) do out[#out + 1] = tk end
        out[#out + 1] = { t = b .. "_end", pos = c.pos }
      end
    end
  end
  out[#out + 1] = { t = "eof" }
  return out
end

-- ==== parser ================================================================

local FILTERS, TESTS -- defined below; the parser checks names against them

local Parser = {}
Parser.__index = Parser

function Parser:peek(k) return self.toks[self.i + (k or 0)] end
function Parser:next()
  local t = self.toks[self.i]
  self.i = self.i + 1
  return t
end
function Parser:pos()
  local t = self.toks[self.i]
  return t.pos or (self.toks[self.i - 1] or {}).pos
end
function Parser:is(t, v)
  local tk = self.toks[self.i]
  return tk.t == t and (v == nil or tk.v == v)
end
function Parser:is_name(v) return self:is("name", v) end
function Parser:is_op(v) return self:is("op", v) end
function Parser:accept(t, v)
  if self:is(t, v) then return self:next() end
end
function Parser:expect(t, v)
  local tk = self.toks[self.i]
  if tk.t == t and (v == nil or tk.v == v) then return self:next() end
  local got = tk.v ~= nil and ("'" .. tostring(tk.v) .. "'") or tk.t
  fail(("expected %s, got %s"):format(v and ("'" .. v .. "'") or t, got), self:pos())
end
function Parser:enter()
  self.depth = self.depth + 1
  if self.depth > 200 then fail("template nests too deep", self:pos()) end
end
function Parser:leave(n) self.depth = self.depth - (n or 1) end

local parse_expr

function Parser:primary()
  local tk = self:peek()
  local pos = tk.pos
  if tk.t == "name" then
    self:next()
    local v = tk.v
    if v == "true" or v == "True" then return { "lit", true, pos = pos } end
    if v == "false" or v == "False" then return { "lit", false, pos = pos } end
    if v == "none" or v == "None" then return { "lit", NONE, pos = pos } end
    return { "name", v, pos = pos }
  elseif tk.t == "string" then
    self:next()
    local s = tk.v
    while self:is("string") do s = s .. self:next().v end
    return { "lit", s, pos = pos }
  elseif tk.t == "integer" or tk.t == "float" then
    self:next()
    return { "lit", tk.v, pos = pos }
  elseif tk.t == "op" and tk.v == "(" then
    self:next()
    self:enter()
    if self:accept("op", ")") then self:leave() return { "list", {}, pos = pos, tuple = true } end
    local e = self:tuple_expr(true)
    self:expect("op", ")")
    self:leave()
    return e
  elseif tk.t == "op" and tk.v == "[" then
    self:next()
    self:enter()
    local items = {}
    while not self:is_op("]") do
      if #items > 0 then self:expect("op", ",") end
      if self:is_op("]") then break end
      items[#items + 1] = parse_expr(self)
    end
    self:expect("op", "]")
    self:leave()
    return { "list", items, pos = pos }
  elseif tk.t == "op" and tk.v == "{" then
    self:next()
    self:enter()
    local items = {}
    while not self:is_op("}") do
      if #items > 0 then self:expect("op", ",") end
      if self:is_op("}") then break end
      local k = parse_expr(self)
      self:expect("op", ":")
      items[#items + 1] = { k, parse_expr(self) }
    end
    self:expect("op", "}")
    self:leave()
    return { "dict", items, pos = pos }
  end
  fail("unexpected " .. (tk.v ~= nil and ("'" .. tostring(tk.v) .. "'") or ("end of " .. tk.t:gsub("_.*", ""))),
       pos or self:pos())
end

-- expr [, expr ...]: a tuple when there is a comma (explicit: in parens).
function Parser:tuple_expr(explicit, simple)
  local pos = self:pos()
  local items = {}
  local comma = false
  while true do
    if #items > 0 then
      if not self:accept("op", ",") then break end
      comma = true
      if self:is_op(")") or self:is("block_end") or self:is_name("in") or self:is_op("=") then break end
    end
    items[#items + 1] = simple and self:primary() or parse_expr(self)
  end
  if not comma and #items == 1 then return items[1] end
  return { "list", items, pos = pos, tuple = true }
end

function Parser:call_args()
  local args, kwargs = {}, {}
  self:expect("op", "(")
  self:enter()
  while not self:is_op(")") do
    if #args > 0 or next(kwargs) then self:expect("op", ",") end
    if self:is_op(")") then break end
    if self:is_op("*") or self:is_op("**") then
      fail("unsupported *args/**kwargs in a call", self:pos())
    end
    if self:is("name") and self:peek(1).t == "op" and self:peek(1).v == "=" then
      local name = self:next().v
      self:next()
      kwargs[#kwargs + 1] = { name, parse_expr(self) }
    else
      if #kwargs > 0 then fail("positional argument after a keyword argument", self:pos()) end
      args[#args + 1] = parse_expr(self)
    end
  end
  self:expect("op", ")")
  self:leave()
  return args, kwargs
end

function Parser:subscript(node)
  local pos = self:pos()
  self:next() -- [
  self:enter()
  local parts, colon = { nil, nil, nil }, 0
  local idx = 1
  while not self:is_op("]") do
    if self:accept("op", ":") then
      colon = colon + 1
      idx = idx + 1
      if colon > 2 then fail("bad slice", pos) end
    else
      if parts[idx] then fail("bad subscript", self:pos()) end
      parts[idx] = parse_expr(self)
    end
  end
  self:expect("op", "]")
  self:leave()
  if colon == 0 then
    if not parts[1] then fail("empty subscript", pos) end
    return { "item", node, parts[1], pos = pos }
  end
  return { "slice", node, parts[1], parts[2], parts[3], pos = pos }
end

-- Loops that wrap a node in a new one (a.b.c, x|f|g, a + b + c) count
-- each level as nesting, so no AST (and no evaluation) nests past 200.
function Parser:postfix(node)
  local n = 0
  while true do
    self:enter()
    n = n + 1
    if self:is_op(".") then
      local pos = self:next().pos
      local tk = self:next()
      if tk.t == "name" then
        node = { "attr", node, tk.v, pos = pos }
      elseif tk.t == "integer" then
        node = { "item", node, { "lit", tk.v }, pos = pos }
      else
        fail("expected an attribute name after '.'", pos)
      end
    elseif self:is_op("[") then
      node = self:subscript(node)
    elseif self:is_op("(") then
      local pos = self:pos()
      local args, kwargs = self:call_args()
      node = { "call", node, args, kwargs, pos = pos }
    else
      self:leave(n)
      return node
    end
  end
end

function Parser:filter_name()
  local tk = self:expect("name")
  local name = tk.v
  while self:is_op(".") and self:peek(1).t == "name" do
    self:next()
    name = name .. "." .. self:next().v
  end
  return name, tk.pos
end

function Parser:filters(node)
  local n = 0
  while true do
    self:enter()
    n = n + 1
    if self:is_op("|") then
      self:next()
      local name, pos = self:filter_name()
      local args, kwargs = {}, {}
      if self:is_op("(") then args, kwargs = self:call_args() end
      node = { "filter", node, name, args, kwargs, pos = pos }
    elseif self:is_name("is") then
      self:next()
      local negate = self:accept("name", "not") ~= nil
      local name, pos = self:filter_name()
      local args, kwargs = {}, {}
      if self:is_op("(") then
        args, kwargs = self:call_args()
      else
        local tk = self:peek()
        local starts = tk.t == "string" or tk.t == "integer" or tk.t == "float"
          or (tk.t == "op" and (tk.v == "[" or tk.v == "{" or tk.v == "("))
          or (tk.t == "name" and tk.v ~= "else" and tk.v ~= "or" and tk.v ~= "and"
              and tk.v ~= "if" and tk.v ~= "is" and tk.v ~= "in" and tk.v ~= "not")
        if starts then args = { self:postfix(self:primary()) } end
      end
      node = { "test", node, name, args, kwargs, negate, pos = pos }
    elseif self:is_op("(") then
      local pos = self:pos()
      local args, kwargs = self:call_args()
      node = { "call", node, args, kwargs, pos = pos }
    else
      self:leave(n)
      return node
    end
  end
end

function Parser:unary(with_filter)
  local pos = self:pos()
  local node
  if self:is_op("-") or self:is_op("+") then
    local op = self:next().v
    self:enter()
    node = { "neg", self:unary(false), op, pos = pos }
    self:leave()
  else
    node = self:postfix(self:primary())
  end
  if with_filter ~= false then node = self:filters(node) end
  return node
end

function Parser:pow()
  local left = self:unary()
  local n = 0
  while self:is_op("**") do
    self:enter()
    n = n + 1
    local pos = self:next().pos
    left = { "bin", "**", left, self:unary(), pos = pos }
  end
  self:leave(n)
  return left
end

function Parser:math2()
  local left = self:pow()
  local n = 0
  while self:is_op("*") or self:is_op("/") or self:is_op("//") or self:is_op("%") do
    self:enter()
    n = n + 1
    local tk = self:next()
    left = { "bin", tk.v, left, self:pow(), pos = tk.pos }
  end
  self:leave(n)
  return left
end

function Parser:concat()
  local first = self:math2()
  if not self:is_op("~") then return first end
  local parts = { first }
  local pos = self:pos()
  while self:accept("op", "~") do parts[#parts + 1] = self:math2() end
  return { "concat", parts, pos = pos }
end

function Parser:math1()
  local left = self:concat()
  local n = 0
  while self:is_op("+") or self:is_op("-") do
    self:enter()
    n = n + 1
    local tk = self:next()
    left = { "bin", tk.v, left, self:concat(), pos = tk.pos }
  end
  self:leave(n)
  return left
end

local CMP = { ["=="] = true, ["!="] = true, ["<"] = true, [">"] = true, ["<="] = true, [">="] = true }

function Parser:compare()
  local first = self:math1()
  local ops = {}
  while true do
    local tk = self:peek()
    if tk.t == "op" and CMP[tk.v] then
      self:next()
      ops[#ops + 1] = { tk.v, self:math1(), pos = tk.pos }
    elseif tk.t == "name" and tk.v == "in" then
      self:next()
      ops[#ops + 1] = { "in", self:math1(), pos = tk.pos }
    elseif tk.t == "name" and tk.v == "not" and self:peek(1).t == "name" and self:peek(1).v == "in" then
      self:next() self:next()
      ops[#ops + 1] = { "notin", self:math1(), pos = tk.pos }
    else
      break
    end
  end
  if #ops == 0 then return first end
  return { "compare", first, ops, pos = ops[1].pos }
end

function Parser:not_expr()
  if self:is_name("not") then
    local pos = self:next().pos
    self:enter()
    local e = self:not_expr()
    self:leave()
    return { "not", e, pos = pos }
  end
  return self:compare()
end

-- operand (op operand)*, left-associative, for the keyword op ("and",
-- "or"); each nested node counts toward the depth limit.
local function keyword_chain(self, op, operand)
  local left = operand(self)
  local n = 0
  while self:is_name(op) do
    self:enter()
    n = n + 1
    local pos = self:next().pos
    left = { op, left, operand(self), pos = pos }
  end
  self:leave(n)
  return left
end

function Parser:and_expr() return keyword_chain(self, "and", Parser.not_expr) end

function Parser:or_expr() return keyword_chain(self, "or", Parser.and_expr) end

function parse_expr(self, no_cond)
  self:enter()
  local e = self:or_expr()
  if not no_cond then
    local n = 0
    while self:is_name("if") do
      self:enter()
      n = n + 1
      local pos = self:next().pos
      local cond = self:or_expr()
      local other
      if self:accept("name", "else") then other = parse_expr(self, true) end
      e = { "cond", cond, e, other, pos = pos }
    end
    self:leave(n)
  end
  self:leave()
  return e
end

-- Assignment targets: name, name.attr, or a tuple of names.
function Parser:target(for_loop)
  local pos = self:pos()
  local names = {}
  repeat
    if #names > 0 and (self:is_name("in") or self:is_op("=")) then break end
    local tk = self:expect("name")
    if self:is_op(".") and not for_loop then
      self:next()
      local attr = self:expect("name").v
      if #names > 0 then fail("bad assignment target", pos) end
      return { "nsattr", tk.v, attr, pos = pos }
    end
    names[#names + 1] = tk.v
  until not self:accept("op", ",")
  if #names == 1 then return { "name", names[1], pos = pos } end
  return { "names", names, pos = pos }
end

local UNSUPPORTED_TAGS = { extends = true, block = true, include = true, import = true, from = true,
                           ["do"] = true, with = true, autoescape = true, trans = true, pluralize = true }

-- Parses the body up to one of the end tags (block names); returns the
-- node list and the name of the end tag found (its tokens not consumed).
function Parser:body(ends)
  local nodes = {}
  self:enter()
  while true do
    local tk = self:peek()
    if tk.t == "eof" then
      if ends then fail("missing " .. table.concat(ends, " or "), self.open_pos) end
      break
    elseif tk.t == "text" then
      self:next()
      nodes[#nodes + 1] = { "text", tk.v }
    elseif tk.t == "var_begin" then
      self:next()
      local e = parse_expr(self)
      self:expect("var_end")
      nodes[#nodes + 1] = { "out", e, pos = tk.pos }
    else -- block_begin
      local name = self:peek(1)
      if name.t ~= "name" then fail("expected a tag name", name.pos or tk.pos) end
      if ends then
        for _, e in ipairs(ends) do
          if name.v == e then self:leave() return nodes, e end
        end
      end
      self:next()
      self:next()
      nodes[#nodes + 1] = self:statement(name.v, name.pos)
    end
  end
  self:leave()
  return nodes
end

-- Consumes {% name %} (block_begin, name, block_end).
function Parser:end_tag(name)
  self:expect("block_begin")
  self:expect("name", name)
  self:expect("block_end")
end

function Parser:statement(name, pos)
  local saved_open = self.open_pos
  self.open_pos = pos
  local node
  if name == "if" then
    local branches = { { parse_expr(self) } }
    self:expect("block_end")
    local else_body
    while true do
      local body, e = self:body({ "elif", "else", "endif" })
      if else_body then else_body = body else branches[#branches][2] = body end
      self:next() self:next()
      if e == "elif" then
        if else_body then fail("elif after else", self:pos()) end
        branches[#branches + 1] = { parse_expr(self) }
        self:expect("block_end")
      elseif e == "else" then
        if else_body then fail("two else branches", self:pos()) end
        self:expect("block_end")
        else_body = {}
      else
        self:expect("block_end")
        break
      end
    end
    node = { "if", branches, else_body, pos = pos }
  elseif name == "for" then
    local target = self:target(true)
    self:expect("name", "in")
    local iter = self:tuple_expr(false, false)
    if iter[1] == "cond" then -- `for x in xs if c`: the if is the loop filter
      -- parse_expr took `xs if c` as a conditional with no else
      if iter[4] ~= nil then fail("unexpected else in a for loop", pos) end
      iter = { "filtered", iter[3], iter[2] }
    end
    local cond
    if iter[1] == "filtered" then cond = iter[3] iter = iter[2] end
    if self:is_name("recursive") then fail("unsupported recursive loop", self:pos()) end
    self:expect("block_end")
    local body, e = self:body({ "else", "endfor" })
    local else_body
    self:next() self:next()
    self:expect("block_end")
    if e == "else" then
      else_body = self:body({ "endfor" })
      self:end_tag("endfor")
    end
    node = { "for", target, iter, cond, body, else_body, pos = pos }
  elseif name == "set" then
    local target = self:target(false)
    if self:accept("op", "=") then
      local e = self:tuple_expr(false)
      self:expect("block_end")
      node = { "set", target, e, pos = pos }
    else
      local filters = {}
      while self:accept("op", "|") do
        local fname, fpos = self:filter_name()
        local args, kwargs = {}, {}
        if self:is_op("(") then args, kwargs = self:call_args() end
        filters[#filters + 1] = { fname, args, kwargs, pos = fpos }
      end
      self:expect("block_end")
      local body = self:body({ "endset" })
      self:end_tag("endset")
      node = { "setblock", target, body, filters, pos = pos }
    end
  elseif name == "macro" then
    local mname = self:expect("name").v
    local params, defaults = {}, {}
    self:expect("op", "(")
    while not self:is_op(")") do
      if #params > 0 then self:expect("op", ",") end
      if self:is_op(")") then break end
      local p = self:expect("name").v
      params[#params + 1] = p
      if self:accept("op", "=") then defaults[#params] = parse_expr(self) end
    end
    self:expect("op", ")")
    self:expect("block_end")
    local body = self:body({ "endmacro" })
    self:end_tag("endmacro")
    node = { "macro", mname, params, defaults, body, pos = pos }
  elseif name == "call" then
    local params, defaults = {}, {}
    if self:accept("op", "(") then
      while not self:is_op(")") do
        if #params > 0 then self:expect("op", ",") end
        params[#params + 1] = self:expect("name").v
        if self:accept("op", "=") then defaults[#params] = parse_expr(self) end
      end
      self:expect("op", ")")
    end
    local call = parse_expr(self)
    if call[1] ~= "call" then fail("expected a macro call", pos) end
    self:expect("block_end")
    local body = self:body({ "endcall" })
    self:end_tag("endcall")
    node = { "callblock", call, params, defaults, body, pos = pos }
  elseif name == "filter" then
    local filters = {}
    repeat
      local fname, fpos = self:filter_name()
      local args, kwargs = {}, {}
      if self:is_op("(") then args, kwargs = self:call_args() end
      filters[#filters + 1] = { fname, args, kwargs, pos = fpos }
    until not self:accept("op", "|")
    self:expect("block_end")
    local body = self:body({ "endfilter" })
    self:end_tag("endfilter")
    node = { "filterblock", filters, body, pos = pos }
  elseif name == "generation" then
    self:expect("block_end")
    local body = self:body({ "endgeneration" })
    self:end_tag("endgeneration")
    node = { "group", body }
  elseif name == "break" or name == "continue" then
    if (self.loops or 0) == 0 then fail("'" .. name .. "' outside a loop", pos) end
    self:expect("block_end")
    node = { name, pos = pos }
  elseif UNSUPPORTED_TAGS[name] then
    fail("unsupported tag '" .. name .. "'", pos)
  else
    fail("unknown tag '" .. name .. "'", pos)
  end
  self.open_pos = saved_open
  return node
end

-- Counts loop nesting for break/continue checks.
local body_orig = Parser.statement
function Parser:statement(name, pos)
  if name == "for" then
    self.loops = (self.loops or 0) + 1 -- a syntax error ends the parse: no need to restore
    local node = body_orig(self, name, pos)
    self.loops = self.loops - 1
    return node
  elseif name == "macro" or name == "call" then
    local saved = self.loops
    self.loops = 0
    local node = body_orig(self, name, pos)
    self.loops = saved
    return node
  end
  return body_orig(self, name, pos)
end

-- ==== evaluator =============================================================

local Ctx = {}
Ctx.__index = Ctx

function Ctx:step(pos)
  local s = self.steps + 1
  self.steps = s
  if s > self.max_steps then fail("template ran past " .. self.max_steps .. " steps", pos) end
end

-- Work proportional to the data: a string made costs a step per 64 bytes,
-- a list made a step per item, so copying big values in a loop ends too.
function Ctx:charge(n, pos)
  local s = self.steps + n
  self.steps = s
  if s > self.max_steps then fail("template ran past " .. self.max_steps .. " steps", pos) end
end

function Ctx:check_size(s, pos)
  if #s > self.max_output then fail("a string grew past " .. self.max_output .. " bytes", pos) end
  self:charge(#s // 64, pos)
  return s
end

local function lookup(scope, name)
  while scope do
    local v = scope.vars[name]
    if v ~= nil then return v end
    scope = scope.parent
  end
end

local function new_scope(parent) return { vars = {}, parent = parent } end

local eval, exec

-- Iteration: a Lua array of the items `for` walks (dict keys for a dict,
-- characters for a string).
local function iter_items(v, pos)
  if is_undef(v) then return {} end
  if type(v) == "string" then
    if CURRENT then CURRENT:charge(#v, pos) end
    return chars(v)
  end
  if is_list(v) then return v end
  if is_gen(v) then return v.items end
  if is_dict(v) then return dict_keys(v) end
  if type(v) == "table" and getmetatable(v) == NAMESPACE then return dict_keys(v.attrs) end
  fail("'" .. type_name(v) .. "' object is not iterable", pos)
end

local function length(v, pos)
  if is_undef(v) then return 0 end
  if type(v) == "string" then return str_len(v) end
  if is_list(v) then return #v end
  if is_dict(v) then return #dict_keys(v) end
  fail("object of type '" .. type_name(v) .. "' has no len()", pos)
end

local STR_METHODS, DICT_METHODS, LIST_METHODS
local MUTATORS = { append = true, pop = true, extend = true, insert = true, remove = true, clear = true,
                   sort = true, reverse = true, update = true, setdefault = true, popitem = true }

local function get_attr(ctx, obj, name, pos)
  if is_undef(obj) then
    fail("'" .. tostring(obj and obj.name or "value") .. "' is undefined", pos)
  end
  if name:sub(1, 1) == "_" then return undef(name) end
  if type(obj) == "string" then
    local m = STR_METHODS[name]
    if m then return callable(function(args, kwargs, p) return m(ctx, obj, args, kwargs, p) end, name) end
    return undef(name)
  end
  if type(obj) == "table" then
    local mt = getmetatable(obj)
    if mt == NAMESPACE then
      local v = obj.attrs[name]
      if v == nil then return undef(name) end
      return v
    end
    if mt == CALLABLE or obj == NONE then return undef(name) end
    if is_list(obj) then
      local m = LIST_METHODS[name]
      if m then return callable(function(args, kwargs, p) return m(ctx, obj, args, kwargs, p) end, name) end
      if MUTATORS[name] then
        return callable(function(_, _, p)
          fail("access to attribute '" .. name .. "' of 'list' object is unsafe", p)
        end, name)
      end
      return undef(name)
    end
    local m = DICT_METHODS[name]
    if m then return callable(function(args, kwargs, p) return m(ctx, obj, args, kwargs, p) end, name) end
    if MUTATORS[name] then
      return callable(function(_, _, p)
        fail("access to attribute '" .. name .. "' of 'dict' object is unsafe", p)
      end, name)
    end
    local v = obj[name]
    if v == nil then return undef(name) end
    return v
  end
  return undef(name)
end

local function norm_index(i, n)
  if i < 0 then i = i + n end
  return i
end

local function get_item(ctx, obj, key, pos)
  if is_undef(obj) then
    fail("'" .. tostring(obj and obj.name or "value") .. "' is undefined", pos)
  end
  if type(obj) == "string" then
    if math.type(key) == "integer" then
      local cs = chars(obj)
      local i = norm_index(key, #cs)
      return cs[i + 1] or undef()
    end
    return undef()
  end
  if type(obj) == "table" and obj ~= NONE and not is_callable(obj) then
    if getmetatable(obj) == NAMESPACE then
      local v = type(key) == "string" and obj.attrs[key]
      if v == nil then return undef() end
      return v
    end
    if is_list(obj) then
      if type(key) == "number" and key == math.floor(key) then
        local i = norm_index(math.tointeger(key), #obj)
        local v = obj[i + 1]
        if v == nil or i < 0 then return undef() end
        return v
      end
      if type(key) == "string" then return get_attr(ctx, obj, key, pos) end
      return undef()
    end
    if key == nil or key ~= key then return undef() end
    local v = obj[key]
    if v == nil and math.type(key) == "float" and key == math.floor(key) then v = obj[math.tointeger(key)] end
    if v == nil then
      if type(key) == "string" then return get_attr(ctx, obj, key, pos) end
      return undef()
    end
    return v
  end
  return undef()
end

local function slice_of(ctx, obj, a, b, c, pos)
  local items, as_string
  if type(obj) == "string" then items, as_string = chars(obj), true
  elseif is_list(obj) then items = obj
  elseif is_undef(obj) then fail("'" .. tostring(obj and obj.name or "value") .. "' is undefined", pos)
  else fail("'" .. type_name(obj) .. "' object is not subscriptable", pos) end
  local n = #items
  local function int(v, what)
    if v == nil or v == NONE or is_undef(v) then return nil end
    if math.type(v) ~= "integer" then fail("slice " .. what .. " must be an integer", pos) end
    return v
  end
  local step = int(c, "step") or 1
  if step == 0 then fail("slice step cannot be zero", pos) end
  local start, stop = int(a, "start"), int(b, "stop")
  local out = {}
  if step > 0 then
    start = start and (start < 0 and math.max(start + n, 0) or math.min(start, n)) or 0
    stop = stop and (stop < 0 and math.max(stop + n, 0) or math.min(stop, n)) or n
    local i = start
    while i < stop do out[#out + 1] = items[i + 1] i = i + step end
  else
    start = start and (start < 0 and math.max(start + n, -1) or math.min(start, n - 1)) or n - 1
    stop = stop and (stop < 0 and math.max(stop + n, -1) or math.min(stop, n - 1)) or -1
    local i = start
    while i > stop do out[#out + 1] = items[i + 1] i = i + step end
  end
  ctx:charge(#out + 1, pos)
  if as_string then return table.concat(out) end
  return new_list(out)
end

local function contains(container, item, pos)
  if type(container) == "string" then
    if type(item) ~= "string" then fail("'in <string>' requires string as left operand", pos) end
    return container:find(item, 1, true) ~= nil
  end
  if is_list(container) then
    if CURRENT then CURRENT:charge(#container, pos) end
    for i = 1, #container do if deep_eq(container[i], item) then return true end end
    return false
  end
  if is_dict(container) then
    if item == nil or is_undef(item) or item == NONE then return false end
    return container[item] ~= nil
  end
  if is_undef(container) then return false end
  if is_gen(container) then return contains(container.items, item, pos) end
  fail("argument of type '" .. type_name(container) .. "' is not iterable", pos)
end

local compare
function compare(op, a, b, pos)
  if op == "==" then return deep_eq(a, b) end
  if op == "!=" then return not deep_eq(a, b) end
  if op == "in" then return contains(b, a, pos) end
  if op == "notin" then return not contains(b, a, pos) end
  if is_list(a) and is_list(b) then
    for i = 1, math.min(#a, #b) do
      if not deep_eq(a[i], b[i]) then return compare(op, a[i], b[i], pos) end
    end
    return compare(op, #a, #b, pos)
  end
  local ta, tb = type(a), type(b)
  if ta == "boolean" then a = a and 1 or 0 ta = "number" end
  if tb == "boolean" then b = b and 1 or 0 tb = "number" end
  if not ((ta == "number" and tb == "number") or (ta == "string" and tb == "string")) then
    fail(("'%s' not supported between instances of '%s' and '%s'"):format(op, type_name(a), type_name(b)), pos)
  end
  if op == "<" then return a < b end
  if op == ">" then return a > b end
  if op == "<=" then return a <= b end
  return a >= b
end

local function to_num(v, op, other, pos)
  if type(v) == "number" then return v end
  if type(v) == "boolean" then return v and 1 or 0 end
  if is_undef(v) then fail("'" .. tostring(v and v.name or "value") .. "' is undefined", pos) end
  fail(("unsupported operand type(s) for %s: '%s' and '%s'"):format(op, type_name(v), type_name(other)), pos)
end

-- Python's printf-style `fmt % args`: %s %r %d %i %f %F %e %E %g %G %x %X
-- %o %c %%, flags, width, precision; %(key)s with a mapping. args: a tuple
-- gives the arguments, anything else is the one argument.
local function percent_format(ctx, fmt, args, pos)
  local mapping = is_dict(args) and args or nil
  local list = getmetatable(args) == TUPLE and args or { args }
  local out, i, used = {}, 1, 0
  while true do
    local a = fmt:find("%", i, true)
    if not a then
      out[#out + 1] = fmt:sub(i)
      break
    end
    out[#out + 1] = fmt:sub(i, a - 1)
    local j = a + 1
    local key
    if fmt:sub(j, j) == "(" then
      local close = fmt:find(")", j, true)
      if not close then fail("incomplete format key", pos) end
      key, j = fmt:sub(j + 1, close - 1), close + 1
    end
    local flags, width, dot, prec, conv = fmt:match("^([-+ #0]*)(%d*)(%.?)(%d*)(.)", j)
    if not flags then fail("incomplete format", pos) end
    j = j + #flags + #width + #dot + #prec + 1
    if conv == "%" then
      out[#out + 1] = "%"
    else
      local v
      if key then
        if not mapping then fail("format requires a mapping", pos) end
        v = mapping[key]
        if v == nil then fail("format: no key '" .. key .. "'", pos) end
      else
        used = used + 1
        v = list[used]
        if v == nil then fail("not enough arguments for format string", pos) end
      end
      out[#out + 1] = ctx:format_one(flags, width, dot, prec, conv, v, pos)
    end
    i = j
  end
  if not mapping and used < #list then fail("not all arguments converted during string formatting", pos) end
  return ctx:check_size(table.concat(out), pos)
end

function Ctx:format_one(flags, width, dot, prec, conv, v, pos)
  local spec = "%" .. flags .. width .. dot .. prec
  if #width > 4 or #prec > 4 then fail("format width too large", pos) end
  if conv == "s" or conv == "r" then
    local str = conv == "s" and to_str(v) or repr(v)
    if dot == "." then str = table.concat(chars(str), "", 1, math.min(tonumber(prec ~= "" and prec or 0), str_len(str))) end
    local pad = (tonumber(width) or 0) - str_len(str)
    if pad <= 0 then return str end
    if flags:find("-", 1, true) then return str .. string.rep(" ", pad) end
    return string.rep(" ", pad) .. str
  end
  if type(v) == "boolean" then v = v and 1 or 0 end
  if type(v) ~= "number" then fail("%" .. conv .. " format: a number is required, not " .. type_name(v), pos) end
  if conv == "d" or conv == "i" or conv == "x" or conv == "X" or conv == "o" or conv == "c" then
    local iv = math.tointeger(v >= 0 and math.floor(v) or math.ceil(v))
    if not iv then fail("%" .. conv .. " format: number too large", pos) end
    if conv == "c" then return utf8.char(iv) end
    return string.format(spec .. (conv == "i" and "d" or conv), iv)
  end
  if conv == "f" or conv == "F" or conv == "e" or conv == "E" or conv == "g" or conv == "G" then
    return string.format(spec .. conv, v + 0.0)
  end
  fail("unsupported format character '" .. conv .. "'", pos)
end

local function arith(ctx, op, a, b, pos)
  if op == "+" then
    if type(a) == "string" and type(b) == "string" then return ctx:check_size(a .. b, pos) end
    if is_list(a) and is_list(b) then
      local out = {}
      for i = 1, #a do out[i] = a[i] end
      for i = 1, #b do out[#out + 1] = b[i] end
      ctx:charge(#out + 1, pos)
      if getmetatable(a) == TUPLE and getmetatable(b) == TUPLE then return new_tuple(out) end
      return new_list(out)
    end
  end
  if op == "*" then
    local s, n
    if type(a) == "string" and math.type(b) == "integer" then s, n = a, b end
    if type(b) == "string" and math.type(a) == "integer" then s, n = b, a end
    if s then
      if n <= 0 then return "" end
      if #s * n > ctx.max_output then fail("a string grew past " .. ctx.max_output .. " bytes", pos) end
      return ctx:check_size(s:rep(n), pos)
    end
    local l
    if is_list(a) and math.type(b) == "integer" then l, n = a, b end
    if is_list(b) and math.type(a) == "integer" then l, n = b, a end
    if l then
      if #l * math.max(n, 0) > ctx.max_steps then fail("a list grew too large", pos) end
      ctx:charge(#l * math.max(n, 0), pos)
      local out = {}
      for _ = 1, n do for i = 1, #l do out[#out + 1] = l[i] end end
      return new_list(out)
    end
  end
  if op == "%" and type(a) == "string" then return percent_format(ctx, a, b, pos) end
  local x, y = to_num(a, op, b, pos), to_num(b, op, a, pos)
  if op == "+" then return x + y end
  if op == "-" then return x - y end
  if op == "*" then return x * y end
  if op == "/" then
    if y == 0 then fail("division by zero", pos) end
    return x / y
  end
  if op == "//" then
    if y == 0 then fail("integer division or modulo by zero", pos) end
    return x // y
  end
  if op == "%" then
    if y == 0 then fail("integer division or modulo by zero", pos) end
    return x % y
  end
  if op == "**" then
    if math.type(x) == "integer" and math.type(y) == "integer" and y >= 0 then
      local r = 1
      for _ = 1, y do
        r = r * x
        if math.abs(r) > 2 ^ 62 then fail("integer power too large", pos) end
      end
      return r
    end
    return x ^ y
  end
  fail("unknown operator " .. op, pos)
end

local function eval_args(ctx, scope, args, kwargs)
  local a, kw = {}, {}
  for i, e in ipairs(args) do a[i] = eval(ctx, scope, e) end
  a.n = #args
  for _, p in ipairs(kwargs) do kw[p[1]] = eval(ctx, scope, p[2]) end
  return a, kw
end

-- Binds positional and keyword arguments to parameter names; returns
-- the values in parameter order (nil where neither gave one).
local function bind(fname, names, args, kwargs, pos)
  local out = {}
  local n = args.n or #args
  if n > #names then fail(fname .. "() takes at most " .. #names .. " arguments (" .. n .. " given)", pos) end
  for i = 1, n do out[i] = args[i] end
  for k, v in pairs(kwargs) do
    local found
    for i, name in ipairs(names) do
      if name == k then found = i break end
    end
    if not found then fail(fname .. "() got an unexpected keyword argument '" .. k .. "'", pos) end
    if found <= n then fail(fname .. "() got multiple values for argument '" .. k .. "'", pos) end
    out[found] = v
  end
  return out
end

local function call_value(ctx, f, args, kwargs, pos)
  if not is_callable(f) then
    if is_undef(f) then fail("'" .. tostring(f and f.name or "value") .. "' is undefined", pos) end
    fail("'" .. type_name(f) .. "' object is not callable", pos)
  end
  ctx:step(pos)
  return f.fn(args, kwargs, pos)
end

local eval_raw

-- The value of an expression, a markup string as its plain string.
function eval(ctx, scope, e)
  return unmark(eval_raw(ctx, scope, e))
end

function eval_raw(ctx, scope, e)
  ctx:step(e.pos)
  local k = e[1]
  if k == "lit" then return e[2]
  elseif k == "name" then
    local v = lookup(scope, e[2])
    if v == nil then v = ctx.globals[e[2]] end
    if v == nil then return undef(e[2]) end
    return v
  elseif k == "attr" then
    return get_attr(ctx, eval(ctx, scope, e[2]), e[3], e.pos)
  elseif k == "item" then
    return get_item(ctx, eval(ctx, scope, e[2]), eval(ctx, scope, e[3]), e.pos)
  elseif k == "slice" then
    local obj = eval(ctx, scope, e[2])
    local a = e[3] and eval(ctx, scope, e[3])
    local b = e[4] and eval(ctx, scope, e[4])
    local c = e[5] and eval(ctx, scope, e[5])
    return slice_of(ctx, obj, a, b, c, e.pos)
  elseif k == "call" then
    local f = eval(ctx, scope, e[2])
    local args, kwargs = eval_args(ctx, scope, e[3], e[4])
    return call_value(ctx, f, args, kwargs, e.pos)
  elseif k == "filter" then
    local v = eval(ctx, scope, e[2])
    local args, kwargs = eval_args(ctx, scope, e[4], e[5])
    local f = FILTERS[e[3]]
    if not f then fail("unsupported filter '" .. e[3] .. "'", e.pos) end
    if e[3] == "safe" then return markup(to_str(eval(ctx, scope, e[2]))) end
    if e[3] == "escape" or e[3] == "e" then
      local v = eval_raw(ctx, scope, e[2])
      if getmetatable(v) == MARKUP then return v end
      return markup(html_escape(to_str(v)))
    end
    return f(ctx, v, args, kwargs, e.pos, scope)
  elseif k == "test" then
    local v = eval(ctx, scope, e[2])
    local args, kwargs = eval_args(ctx, scope, e[4], e[5])
    local t = TESTS[e[3]]
    if not t then fail("unsupported test '" .. e[3] .. "'", e.pos) end
    local r = t(ctx, v, args, kwargs, e.pos)
    if e[6] then return not r end
    return r
  elseif k == "bin" then
    if e[2] == "+" then
      local a, b = eval_raw(ctx, scope, e[3]), eval_raw(ctx, scope, e[4])
      local ma, mb = getmetatable(a) == MARKUP, getmetatable(b) == MARKUP
      if ma or mb then
        a, b = unmark(a), unmark(b)
        if type(a) == "string" and type(b) == "string" then
          if not ma then a = html_escape(a) end
          if not mb then b = html_escape(b) end
          return markup(ctx:check_size(a .. b, e.pos))
        end
      end
      return arith(ctx, "+", a, b, e.pos)
    end
    return arith(ctx, e[2], eval(ctx, scope, e[3]), eval(ctx, scope, e[4]), e.pos)
  elseif k == "neg" then
    local v = eval(ctx, scope, e[2])
    local x = to_num(v, "unary " .. e[3], v, e.pos)
    if e[3] == "-" then return -x end
    return x
  elseif k == "concat" then
    local parts = {}
    local size = 0
    for i, p in ipairs(e[2]) do
      parts[i] = to_str(eval(ctx, scope, p))
      size = size + #parts[i]
      if size > ctx.max_output then fail("a string grew past " .. ctx.max_output .. " bytes", e.pos) end
    end
    ctx:charge(size // 64, e.pos)
    return table.concat(parts)
  elseif k == "compare" then
    local left = eval(ctx, scope, e[2])
    for _, op in ipairs(e[3]) do
      local right = eval(ctx, scope, op[2])
      if not compare(op[1], left, right, op.pos) then return false end
      left = right
    end
    return true
  elseif k == "and" then
    local a = eval(ctx, scope, e[2])
    if not truthy(a) then return a end
    return eval(ctx, scope, e[3])
  elseif k == "or" then
    local a = eval(ctx, scope, e[2])
    if truthy(a) then return a end
    return eval(ctx, scope, e[3])
  elseif k == "not" then
    return not truthy(eval(ctx, scope, e[2]))
  elseif k == "cond" then
    if truthy(eval(ctx, scope, e[2])) then return eval(ctx, scope, e[3]) end
    if e[4] then return eval(ctx, scope, e[4]) end
    return undef()
  elseif k == "list" then
    local out = {}
    for i, x in ipairs(e[2]) do out[i] = eval(ctx, scope, x) end
    if e.tuple then return new_tuple(out) end
    return new_list(out)
  elseif k == "dict" then
    local d = new_dict()
    for _, p in ipairs(e[2]) do
      local key = eval(ctx, scope, p[1])
      if is_undef(key) or type(key) == "table" then fail("unhashable dict key", e.pos) end
      dict_set(d, key, eval(ctx, scope, p[2]))
    end
    return d
  end
  fail("unsupported expression '" .. tostring(k) .. "'", e.pos)
end

local BREAK, CONTINUE = {}, {}

local function emit(ctx, out, s, pos)
  if s == "" then return end
  ctx.size = ctx.size + #s
  if ctx.size > ctx.max_output then fail("output grew past " .. ctx.max_output .. " bytes", pos) end
  out[#out + 1] = s
end

local function assign(ctx, scope, target, value, pos)
  if target[1] == "name" then
    scope.vars[target[2]] = value
  elseif target[1] == "names" then
    local items = iter_items(value, pos)
    if #items ~= #target[2] then
      fail(("cannot unpack %d values into %d names"):format(#items, #target[2]), pos)
    end
    for i, n in ipairs(target[2]) do scope.vars[n] = items[i] end
  else -- nsattr
    local ns = lookup(scope, target[2])
    if ns == nil then ns = ctx.globals[target[2]] end
    if type(ns) ~= "table" or getmetatable(ns) ~= NAMESPACE then
      fail("can only set attributes on a namespace", pos)
    end
    ns.attrs[target[3]] = value
  end
end

local function make_macro(ctx, def_scope, name, params, defaults, body, pos)
  return callable(function(args, kwargs, cpos)
    local caller = kwargs.caller
    kwargs.caller = nil
    -- extra positional arguments are varargs, unknown keywords kwargs
    local n = args.n or #args
    local extra = {}
    for i = #params + 1, n do extra[#extra + 1] = args[i] end
    local known = { n = math.min(n, #params) }
    for i = 1, known.n do known[i] = args[i] end
    local kw, extra_kw = {}, new_dict()
    local kw_names = {}
    for k in pairs(kwargs) do kw_names[#kw_names + 1] = k end
    table.sort(kw_names)
    for _, k in ipairs(kw_names) do
      local is_param = false
      for _, p in ipairs(params) do if p == k then is_param = true break end end
      if is_param then kw[k] = kwargs[k] else dict_set(extra_kw, k, kwargs[k]) end
    end
    local bound = bind(name, params, known, kw, cpos)
    ctx.depth = ctx.depth + 1
    if ctx.depth > ctx.max_depth then fail("macro calls nest deeper than " .. ctx.max_depth, cpos) end
    local s = new_scope(def_scope)
    for i, p in ipairs(params) do
      local v = bound[i]
      if v == nil then
        if defaults[i] then v = eval(ctx, s, defaults[i]) else v = undef(p) end
      end
      s.vars[p] = v
    end
    if caller then s.vars.caller = caller end
    s.vars.varargs = new_tuple(extra)
    s.vars.kwargs = extra_kw
    local out = {}
    local saved = ctx.size
    exec(ctx, s, body, out)
    ctx.size = saved
    ctx.depth = ctx.depth - 1
    return table.concat(out)
  end, name)
end

local function apply_filters(ctx, scope, v, filters)
  for _, f in ipairs(filters) do
    local fn = FILTERS[f[1]]
    if not fn then fail("unsupported filter '" .. f[1] .. "'", f.pos) end
    local args, kwargs = eval_args(ctx, scope, f[2], f[3])
    v = fn(ctx, v, args, kwargs, f.pos, scope)
  end
  return v
end

-- Runs a node list, appending strings to out; returns BREAK or CONTINUE
-- when one of those ends the list early.
function exec(ctx, scope, nodes, out)
  for _, node in ipairs(nodes) do
    local k = node[1]
    if k == "text" then
      emit(ctx, out, node[2])
    elseif k == "out" then
      local s = to_str(eval_raw(ctx, scope, node[2]))
      ctx:charge(#s // 64, node.pos)
      emit(ctx, out, s, node.pos)
    elseif k == "if" then
      local ran = false
      for _, br in ipairs(node[2]) do
        if truthy(eval(ctx, scope, br[1])) then
          local r = exec(ctx, scope, br[2], out)
          if r then return r end
          ran = true
          break
        end
      end
      if not ran and node[3] then
        local r = exec(ctx, scope, node[3], out)
        if r then return r end
      end
    elseif k == "for" then
      local target, cond, body = node[2], node[4], node[5]
      local src = iter_items(eval(ctx, scope, node[3]), node.pos)
      local items = src
      if cond then
        items = {}
        for i = 1, #src do
          local s = new_scope(scope)
          assign(ctx, s, target, src[i], node.pos)
          if truthy(eval(ctx, s, cond)) then items[#items + 1] = src[i] end
        end
      end
      local n = #items
      local loop = new_dict()
      local changed_last
      for i = 1, n do
        ctx:step(node.pos)
        local s = new_scope(scope)
        local item = items[i]
        assign(ctx, s, target, item, node.pos)
        loop.index, loop.index0 = i, i - 1
        loop.revindex, loop.revindex0 = n - i + 1, n - i
        loop.first, loop.last, loop.length = i == 1, i == n, n
        loop.depth, loop.depth0 = 1, 0
        loop.previtem = i > 1 and items[i - 1] or undef("previtem")
        loop.nextitem = i < n and items[i + 1] or undef("nextitem")
        loop.changed = callable(function(args)
          local key = new_list{ table.unpack(args, 1, args.n or #args) }
          if changed_last ~= nil and deep_eq(changed_last, key) then return false end
          changed_last = key
          return true
        end, "changed")
        loop.cycle = callable(function(args)
          if (args.n or #args) == 0 then fail("no items for cycling given", node.pos) end
          return args[(i - 1) % (args.n or #args) + 1]
        end, "cycle")
        s.vars.loop = loop
        local r = exec(ctx, s, body, out)
        if r == BREAK then break end
      end
      if n == 0 and node[6] then
        local r = exec(ctx, new_scope(scope), node[6], out)
        if r then return r end
      end
    elseif k == "set" then
      assign(ctx, scope, node[2], eval_raw(ctx, scope, node[3]), node.pos)
    elseif k == "setblock" then
      local buf = {}
      local saved = ctx.size
      exec(ctx, new_scope(scope), node[3], buf)
      ctx.size = saved
      assign(ctx, scope, node[2], apply_filters(ctx, scope, table.concat(buf), node[4]), node.pos)
    elseif k == "macro" then
      scope.vars[node[2]] = make_macro(ctx, scope, node[2], node[3], node[4], node[5], node.pos)
    elseif k == "callblock" then
      local call = node[2]
      local caller = make_macro(ctx, scope, "caller", node[3], node[4], node[5], node.pos)
      local f = eval(ctx, scope, call[2])
      local args, kwargs = eval_args(ctx, scope, call[3], call[4])
      kwargs.caller = caller
      emit(ctx, out, to_str(call_value(ctx, f, args, kwargs, node.pos)), node.pos)
    elseif k == "filterblock" then
      local buf = {}
      local saved = ctx.size
      exec(ctx, new_scope(scope), node[3], buf)
      ctx.size = saved
      emit(ctx, out, to_str(apply_filters(ctx, scope, table.concat(buf), node[2])), node.pos)
    elseif k == "group" then
      local r = exec(ctx, scope, node[2], out)
      if r then return r end
    elseif k == "break" then
      return BREAK
    elseif k == "continue" then
      return CONTINUE
    end
  end
end

-- ==== filters ===============================================================

local function arg(args, kwargs, i, name, default)
  local v = args[i]
  if v == nil then v = kwargs[name] end
  if v == nil then return default end
  return v
end

local function str_arg(v, fname, pos)
  if is_undef(v) then return "" end
  return to_str(v)
end

local function py_strip(s, chars_, left, right)
  local set
  if chars_ == nil or chars_ == NONE or is_undef(chars_) then
    set = "%s"
  else
    set = chars_:gsub("[%^%]%-%%%[]", "%%%0")
    if set == "" then return s end
    set = "[" .. set .. "]"
  end
  if left then s = s:gsub("^" .. set .. "+", "") end
  if right then s = s:gsub(set .. "+$", "") end
  return s
end

local function split(s, sep, maxsplit, pos)
  local out = {}
  maxsplit = (maxsplit == nil or maxsplit == NONE) and -1 or maxsplit
  if sep == nil or sep == NONE or is_undef(sep) then
    local rest = s:gsub("^%s+", "")
    while rest ~= "" do
      if maxsplit >= 0 and #out >= maxsplit then
        out[#out + 1] = rest
        break
      end
      local w, after = rest:match("^(%S+)(.*)$")
      out[#out + 1] = w
      rest = after:gsub("^%s+", "")
    end
    return new_list(out)
  end
  if type(sep) ~= "string" then fail("split: separator must be a string", pos) end
  if sep == "" then fail("empty separator", pos) end
  local i = 1
  while true do
    if maxsplit >= 0 and #out >= maxsplit then break end
    local a, b = s:find(sep, i, true)
    if not a then break end
    out[#out + 1] = s:sub(i, a - 1)
    i = b + 1
  end
  out[#out + 1] = s:sub(i)
  return new_list(out)
end


-- Python's str.upper/lower beyond ASCII, for Latin-1, Latin Extended-A,
-- Greek and Cyrillic (ß upper-cases to SS); other scripts keep their case.
local UP, LO = {}, {}
local function pair(lower, upper) UP[lower] = upper LO[upper] = lower end
for cp = 0xE0, 0xFE do if cp ~= 0xF7 then pair(cp, cp - 0x20) end end
pair(0xFF, 0x178)
for cp = 0x100, 0x137, 2 do pair(cp + 1, cp) end
for cp = 0x139, 0x148, 2 do pair(cp + 1, cp) end
for cp = 0x14A, 0x177, 2 do pair(cp + 1, cp) end
for cp = 0x179, 0x17E, 2 do pair(cp + 1, cp) end
for cp = 0x3B1, 0x3C9 do if cp ~= 0x3C2 then pair(cp, cp - 0x20) end end
pair(0x3AC, 0x386) pair(0x3AD, 0x388) pair(0x3AE, 0x389) pair(0x3AF, 0x38A)
pair(0x3CC, 0x38C) pair(0x3CD, 0x38E) pair(0x3CE, 0x38F)
for cp = 0x430, 0x44F do pair(cp, cp - 0x20) end
for cp = 0x450, 0x45F do pair(cp, cp - 0x50) end
UP[0x3C2] = 0x3A3 -- final sigma
UP[0xB5] = 0x39C  -- micro sign

local function map_case(s, ascii, map, extra)
  if not s:find("[\128-\255]") or not utf8.len(s) then return ascii(s) end
  local out = {}
  for _, cp in utf8.codes(s) do
    if cp < 128 then out[#out + 1] = ascii(string.char(cp))
    elseif extra and extra[cp] then out[#out + 1] = extra[cp]
    else out[#out + 1] = utf8.char(map[cp] or cp) end
  end
  return table.concat(out)
end
local SHARP_S = { [0xDF] = "SS" }
local function u_upper(s) return map_case(s, string.upper, UP, SHARP_S) end
local function u_lower(s) return map_case(s, string.lower, LO) end
local function is_letter(c)
  if #c == 1 then return c:find("%a") ~= nil end
  local cp = utf8.codepoint(c)
  return cp >= 0xC0 and cp ~= 0xD7 and cp ~= 0xF7
end

local function title(s)
  -- Python's str.title: a letter after a non-letter is upper, others lower
  local out, prev_letter = {}, false
  for i, c in ipairs(chars(s)) do
    local letter = is_letter(c)
    out[i] = letter and (prev_letter and u_lower(c) or u_upper(c)) or c
    prev_letter = letter
  end
  return table.concat(out)
end

local function capitalize(s)
  local cs = chars(s)
  if #cs == 0 then return "" end
  return u_upper(cs[1]) .. u_lower(table.concat(cs, "", 2))
end

local function replace(ctx, s, old, new, count, pos)
  if type(old) ~= "string" or type(new) ~= "string" then fail("replace: arguments must be strings", pos) end
  count = (count == nil or count == NONE) and -1 or count
  if math.type(count) ~= "integer" then fail("replace: count must be an integer", pos) end
  local done = 0
  if old == "" then
    ctx:charge(#s, pos)
    local cs = chars(s)
    local out = {}
    for j, c in ipairs(cs) do
      if count < 0 or done < count then out[#out + 1] = new done = done + 1 end
      out[#out + 1] = c
      if j == #cs then break end
    end
    if count < 0 or done < count then out[#out + 1] = new end
    return ctx:check_size(table.concat(out), pos)
  end
  local pat = old:gsub("%W", "%%%0")
  local n = select(2, s:gsub(pat, ""))
  if count >= 0 and n > count then n = count end
  if #s + n * (#new - #old) > ctx.max_output then
    fail("a string grew past " .. ctx.max_output .. " bytes", pos)
  end
  ctx:charge(#s // 64 + n, pos)
  return ctx:check_size((s:gsub(pat, (new:gsub("%%", "%%%%")), count >= 0 and count or nil)), pos)
end

local function want_str(v, what, pos)
  if type(v) ~= "string" then fail(what .. " must be a string, not '" .. type_name(v) .. "'", pos) end
  return v
end

local function affix_test(s, arg_, fname, fn, pos)
  if is_list(arg_) then
    for i = 1, #arg_ do if fn(s, want_str(arg_[i], fname .. " argument", pos)) then return true end end
    return false
  end
  return fn(s, want_str(arg_, fname .. " argument", pos))
end

-- Python's str.format with {} / {0} / {name} fields and {{ }} escapes.
local function str_format(ctx, s, args, kwargs, pos)
  local auto = 0
  local out = s:gsub("(%b{})", function(field)
    local inner = field:sub(2, -2)
    if inner:find("[!:]") then fail("unsupported format spec in '" .. field .. "'", pos) end
    local v
    if inner == "" then
      auto = auto + 1
      v = args[auto]
    elseif inner:match("^%d+$") then
      v = args[tonumber(inner) + 1]
    else
      v = kwargs[inner]
    end
    if v == nil then fail("format: no value for field '" .. field .. "'", pos) end
    return to_str(v)
  end)
  return ctx:check_size(out, pos)
end

STR_METHODS = {
  strip = function(_, s, a) return py_strip(s, a[1], true, true) end,
  lstrip = function(_, s, a) return py_strip(s, a[1], true, false) end,
  rstrip = function(_, s, a) return py_strip(s, a[1], false, true) end,
  split = function(_, s, a, kw, pos) return split(s, arg(a, kw, 1, "sep"), arg(a, kw, 2, "maxsplit"), pos) end,
  rsplit = function(_, s, a, kw, pos)
    local maxsplit = arg(a, kw, 2, "maxsplit")
    if maxsplit ~= nil and maxsplit ~= NONE and maxsplit >= 0 then fail("unsupported rsplit with maxsplit", pos) end
    return split(s, arg(a, kw, 1, "sep"), nil, pos)
  end,
  splitlines = function(_, s)
    local out = {}
    for line in (s .. "\n"):gmatch("(.-)\r?\n") do out[#out + 1] = line end
    if s == "" or s:sub(-1) == "\n" then out[#out] = nil end
    return new_list(out)
  end,
  startswith = function(_, s, a, _, pos)
    return affix_test(s, a[1], "startswith", function(x, p) return x:sub(1, #p) == p end, pos)
  end,
  endswith = function(_, s, a, _, pos)
    return affix_test(s, a[1], "endswith", function(x, p) return p == "" or x:sub(-#p) == p end, pos)
  end,
  upper = function(_, s) return u_upper(s) end,
  lower = function(_, s) return u_lower(s) end,
  title = function(_, s) return title(s) end,
  capitalize = function(_, s) return capitalize(s) end,
  replace = function(ctx, s, a, kw, pos) return replace(ctx, s, a[1], a[2], arg(a, kw, 3, "count"), pos) end,
  find = function(_, s, a, _, pos)
    local i = s:find(want_str(a[1], "find argument", pos), 1, true)
    if not i then return -1 end
    return str_len(s:sub(1, i - 1))
  end,
  rfind = function(_, s, a, _, pos)
    local sub, last = want_str(a[1], "rfind argument", pos), nil
    local i = 1
    while true do
      local j = s:find(sub, i, true)
      if not j then break end
      last = j
      i = j + 1
    end
    if not last then return -1 end
    return str_len(s:sub(1, last - 1))
  end,
  count = function(_, s, a, _, pos)
    local sub = want_str(a[1], "count argument", pos)
    if sub == "" then return str_len(s) + 1 end
    local n, i = 0, 1
    while true do
      local _, b = s:find(sub, i, true)
      if not b then return n end
      n, i = n + 1, b + 1
    end
  end,
  join = function(ctx, s, a, _, pos)
    local parts = {}
    for i, v in ipairs(iter_items(a[1], pos)) do parts[i] = want_str(v, "join item", pos) end
    return ctx:check_size(table.concat(parts, s), pos)
  end,
  format = function(ctx, s, a, kw, pos) return str_format(ctx, s, a, kw, pos) end,
  isdigit = function(_, s) return s ~= "" and not s:find("%D") end,
  isalpha = function(_, s) return s ~= "" and not s:find("%A") end,
  isalnum = function(_, s) return s ~= "" and not s:find("%W") end,
  isspace = function(_, s) return s ~= "" and not s:find("%S") end,
  islower = function(_, s) return s:find("%l") ~= nil and not s:find("%u") end,
  isupper = function(_, s) return s:find("%u") ~= nil and not s:find("%l") end,
}

local function items_of(d)
  local out = {}
  for i, k in ipairs(dict_keys(d)) do out[i] = new_tuple{ k, d[k] } end
  return new_list(out)
end

DICT_METHODS = {
  items = function(_, d) return items_of(d) end,
  keys = function(_, d) return new_list(dict_keys(d)) end,
  values = function(_, d)
    local out = {}
    for i, k in ipairs(dict_keys(d)) do out[i] = d[k] end
    return new_list(out)
  end,
  get = function(_, d, a, kw)
    local key = a[1]
    local v = (key ~= nil and not is_undef(key) and key ~= NONE) and d[key] or nil
    if v == nil then
      v = arg(a, kw, 2, "default")
      if v == nil then return NONE end
    end
    return v
  end,
}

LIST_METHODS = {
  count = function(_, l, a)
    local n = 0
    for i = 1, #l do if deep_eq(l[i], a[1]) then n = n + 1 end end
    return n
  end,
  index = function(_, l, a, _, pos)
    for i = 1, #l do if deep_eq(l[i], a[1]) then return i - 1 end end
    fail(repr(a[1]) .. " is not in list", pos)
  end,
}

local function attr_path(ctx, v, attribute, pos)
  if type(attribute) == "number" then return get_item(ctx, v, attribute, pos) end
  for part in tostring(attribute):gmatch("[^.]+") do
    local idx = math.tointeger(tonumber(part))
    if idx then v = get_item(ctx, v, idx, pos) else v = get_item(ctx, v, part, pos) end
  end
  return v
end

local function run_test(ctx, name, v, args, pos)
  local t = TESTS[name]
  if not t then fail("unsupported test '" .. tostring(name) .. "'", pos) end
  return t(ctx, v, args, {}, pos)
end

-- select/reject/selectattr/rejectattr
local function select_items(ctx, v, args, pos, with_attr, keep)
  local out = {}
  if not truthy(v) then return new_gen(out) end
  local items = iter_items(v, pos)
  local attribute, test, targs
  local i0 = 1
  if with_attr then attribute = args[1] i0 = 2 end
  test = args[i0]
  targs = {}
  for j = i0 + 1, (args.n or #args) do targs[#targs + 1] = args[j] end
  targs.n = #targs
  for _, item in ipairs(items) do
    ctx:step(pos)
    local x = with_attr and attr_path(ctx, item, attribute, pos) or item
    local ok
    if test == nil then ok = truthy(x) else ok = run_test(ctx, test, x, targs, pos) end
    if ok == keep then out[#out + 1] = item end
  end
  return new_gen(out)
end

local function sort_key(ctx, v, attribute, case_sensitive, pos)
  if attribute ~= nil and attribute ~= NONE then v = attr_path(ctx, v, attribute, pos) end
  if type(v) == "string" and not case_sensitive then v = u_lower(v) end
  return v
end

local function sorted(ctx, items, keyf, reverse, pos)
  ctx:charge(#items * 4, pos)
  local keyed = {}
  for i, x in ipairs(items) do keyed[i] = { keyf(x), x, i } end
  table.sort(keyed, function(a, b)
    local ka, kb = a[1], b[1]
    if deep_eq(ka, kb) then return a[3] < b[3] end
    local lt = compare("<", ka, kb, pos)
    if reverse then return not lt end
    return lt
  end)
  local out = {}
  for i, k in ipairs(keyed) do out[i] = k[2] end
  return new_list(out)
end


FILTERS = {
  trim = function(_, v, a, kw) return py_strip(str_arg(v), arg(a, kw, 1, "chars"), true, true) end,
  tojson = function(ctx, v, a, kw, pos)
    return ctx:check_size(tojson(v, arg(a, kw, 1, "ensure_ascii"), arg(a, kw, 2, "indent"),
                                 arg(a, kw, 3, "separators"), arg(a, kw, 4, "sort_keys")), pos)
  end,
  length = function(_, v, _, _, pos) return length(v, pos) end,
  upper = function(_, v) return u_upper(str_arg(v)) end,
  lower = function(_, v) return u_lower(str_arg(v)) end,
  title = function(_, v)
    return (str_arg(v):gsub("([^%s%-({%[<]*)", function(w)
      local first = w:match("^[%z\1-\127\194-\244][\128-\191]*") or ""
      return u_upper(first) .. u_lower(w:sub(#first + 1))
    end))
  end,
  center = function(_, v, a, kw)
    local s = str_arg(v)
    local width = arg(a, kw, 1, "width", 80)
    local n = str_len(s)
    if math.type(width) ~= "integer" or width <= n then return s end
    local total = width - n
    local left = total // 2 + (total & width & 1)
    return string.rep(" ", left) .. s .. string.rep(" ", total - left)
  end,
  batch = function(_, v, a, kw, pos)
    local size = arg(a, kw, 1, "linecount")
    if math.type(size) ~= "integer" or size < 1 then fail("batch: linecount must be a positive integer", pos) end
    local fill = arg(a, kw, 2, "fill_with")
    local out, cur = {}, {}
    for _, x in ipairs(iter_items(v, pos)) do
      cur[#cur + 1] = x
      if #cur == size then out[#out + 1] = new_list(cur) cur = {} end
    end
    if #cur > 0 then
      if fill ~= nil then while #cur < size do cur[#cur + 1] = fill end end
      out[#out + 1] = new_list(cur)
    end
    return new_gen(out)
  end,
  capitalize = function(_, v) return capitalize(str_arg(v)) end,
  replace = function(ctx, v, a, kw, pos)
    return replace(ctx, str_arg(v), arg(a, kw, 1, "old"), arg(a, kw, 2, "new"), arg(a, kw, 3, "count"), pos)
  end,
  join = function(ctx, v, a, kw, pos)
    local sep = arg(a, kw, 1, "d", "")
    local attribute = arg(a, kw, 2, "attribute")
    local parts = {}
    local items = iter_items(v, pos)
    ctx:charge(#items, pos)
    for i, x in ipairs(items) do
      if attribute ~= nil and attribute ~= NONE then x = attr_path(ctx, x, attribute, pos) end
      parts[i] = to_str(x)
    end
    return ctx:check_size(table.concat(parts, to_str(sep)), pos)
  end,
  first = function(_, v, _, _, pos)
    local items = iter_items(v, pos)
    if items[1] == nil then return undef() end
    return items[1]
  end,
  last = function(_, v, _, _, pos)
    if is_gen(v) then fail("'generator' object is not reversible", pos) end
    if is_dict(v) then fail("'dict' object is not reversible", pos) end
    local items = iter_items(v, pos)
    if #items == 0 then return undef() end
    return items[#items]
  end,
  default = function(_, v, a, kw)
    local d = arg(a, kw, 1, "default_value", "")
    local boolean = truthy(arg(a, kw, 2, "boolean", false))
    if is_undef(v) or (boolean and not truthy(v)) then return d end
    return v
  end,
  items = function(_, v, _, _, pos)
    if is_undef(v) then return new_list() end
    if not is_dict(v) then fail("can only get item pairs from a mapping", pos) end
    return items_of(v)
  end,
  list = function(ctx, v, _, _, pos)
    local items = iter_items(v, pos)
    ctx:charge(#items, pos)
    local out = {}
    for i = 1, #items do out[i] = items[i] end
    return new_list(out)
  end,
  selectattr = function(ctx, v, a, _, pos) return select_items(ctx, v, a, pos, true, true) end,
  rejectattr = function(ctx, v, a, _, pos) return select_items(ctx, v, a, pos, true, false) end,
  select = function(ctx, v, a, _, pos) return select_items(ctx, v, a, pos, false, true) end,
  reject = function(ctx, v, a, _, pos) return select_items(ctx, v, a, pos, false, false) end,
  map = function(ctx, v, a, kw, pos, scope)
    local out = {}
    if not truthy(v) then return new_gen(out) end
    local items = iter_items(v, pos)
    if kw.attribute ~= nil then
      for i, x in ipairs(items) do
        local y = attr_path(ctx, x, kw.attribute, pos)
        if is_undef(y) and kw.default ~= nil then y = kw.default end
        out[i] = y
      end
    else
      local fname = a[1]
      local f = type(fname) == "string" and FILTERS[fname]
      if not f then fail("map: unsupported filter " .. to_str(fname), pos) end
      local fargs = {}
      for j = 2, (a.n or #a) do fargs[#fargs + 1] = a[j] end
      fargs.n = #fargs
      for i, x in ipairs(items) do
        ctx:step(pos)
        out[i] = f(ctx, x, fargs, {}, pos, scope)
      end
    end
    return new_gen(out)
  end,
  safe = function(_, v) return v end,
  string = function(ctx, v, _, _, pos) return ctx:check_size(to_str(v), pos) end,
  int = function(_, v, a, kw)
    local d = arg(a, kw, 1, "default", 0)
    if math.type(v) == "integer" then return v end
    if math.type(v) == "float" then
      if v ~= v or v == math.huge or v == -math.huge then return d end
      return math.tointeger(v >= 0 and math.floor(v) or math.ceil(v)) or d
    end
    if type(v) == "boolean" then return v and 1 or 0 end
    if type(v) == "string" then
      local s = v:gsub("^%s+", ""):gsub("%s+$", ""):gsub("_", "")
      local n = s:match("^[-+]?%d+$") and math.tointeger(tonumber(s))
      if n then return n end
      local f = tonumber(s)
      if f and s:match("^[-+]?[%d.]+[eE]?[-+]?%d*$") then
        return math.tointeger(f >= 0 and math.floor(f) or math.ceil(f)) or d
      end
    end
    return d
  end,
  float = function(_, v, a, kw)
    local d = arg(a, kw, 1, "default", 0.0)
    if type(v) == "number" then return v + 0.0 end
    if type(v) == "boolean" then return v and 1.0 or 0.0 end
    if type(v) == "string" then
      local f = tonumber((v:gsub("^%s+", ""):gsub("%s+$", "")))
      if f then return f + 0.0 end
    end
    return d
  end,
  indent = function(ctx, v, a, kw, pos)
    local width = arg(a, kw, 1, "width", 4)
    local first = truthy(arg(a, kw, 2, "first", false))
    local blank = truthy(arg(a, kw, 3, "blank", false))
    local pad = type(width) == "string" and width or string.rep(" ", math.tointeger(width) or 4)
    local s = str_arg(v)
    local lines = {}
    for line in (s .. "\n"):gmatch("(.-)\n") do lines[#lines + 1] = line end
    if s:sub(-1) == "\n" then lines[#lines] = nil end
    local out = {}
    for i, line in ipairs(lines) do
      if i == 1 then
        out[i] = (first and (blank or line ~= "")) and (pad .. line) or line
      else
        out[i] = (blank or line ~= "") and (pad .. line) or line
      end
    end
    local r = table.concat(out, "\n")
    if s:sub(-1) == "\n" then r = r .. "\n" end
    return ctx:check_size(r, pos)
  end,
  wordcount = function(_, v)
    local n = 0
    for _ in str_arg(v):gmatch("[%w_]+") do n = n + 1 end
    return n
  end,
  unique = function(ctx, v, a, kw, pos)
    local cs = truthy(arg(a, kw, 1, "case_sensitive", false))
    local attribute = arg(a, kw, 2, "attribute")
    local out, seen, hashed = {}, {}, {}
    local items = iter_items(v, pos)
    ctx:charge(#items, pos)
    for _, x in ipairs(items) do
      local key = sort_key(ctx, x, attribute, cs, pos)
      local dup = false
      if type(key) == "table" then
        for _, s in ipairs(seen) do
          ctx:step(pos)
          if deep_eq(s, key) then dup = true break end
        end
        if not dup then seen[#seen + 1] = key end
      else
        local h = math.type(key) == "float" and key == math.floor(key) and math.tointeger(key) or key
        if h == true then h = 1 elseif h == false then h = 0 end
        dup = hashed[h] ~= nil
        hashed[h] = true
      end
      if not dup then out[#out + 1] = x end
    end
    return new_gen(out)
  end,
  sort = function(ctx, v, a, kw, pos)
    local reverse = truthy(arg(a, kw, 1, "reverse", false))
    local cs = truthy(arg(a, kw, 2, "case_sensitive", false))
    local attribute = arg(a, kw, 3, "attribute")
    return sorted(ctx, iter_items(v, pos), function(x) return sort_key(ctx, x, attribute, cs, pos) end,
                  reverse, pos)
  end,
  dictsort = function(ctx, v, a, kw, pos)
    if not is_dict(v) then fail("dictsort: a dict is required", pos) end
    local cs = truthy(arg(a, kw, 1, "case_sensitive", false))
    local by = arg(a, kw, 2, "by", "key")
    local reverse = truthy(arg(a, kw, 3, "reverse", false))
    local idx = by == "value" and 2 or 1
    return sorted(ctx, items_of(v), function(p)
      local k = p[idx]
      if type(k) == "string" and not cs then k = u_lower(k) end
      return k
    end, reverse, pos)
  end,
  reverse = function(_, v, _, _, pos)
    if type(v) == "string" then
      local cs = chars(v)
      local out = {}
      for i = #cs, 1, -1 do out[#out + 1] = cs[i] end
      return table.concat(out)
    end
    local items = iter_items(v, pos)
    local out = {}
    for i = #items, 1, -1 do out[#out + 1] = items[i] end
    return new_list(out)
  end,
  abs = function(_, v, _, _, pos) return math.abs(to_num(v, "abs", v, pos)) end,
  round = function(_, v, a, kw, pos)
    local prec = arg(a, kw, 1, "precision", 0)
    local method = arg(a, kw, 2, "method", "common")
    local x = to_num(v, "round", v, pos)
    if math.type(prec) ~= "integer" then fail("round: precision must be an integer", pos) end
    if method == "floor" or method == "ceil" then
      local m = 10 ^ prec
      return math[method](x * m) / m
    end
    if method ~= "common" then fail("round: method must be common, ceil or floor", pos) end
    if math.type(x) == "integer" then return x end
    -- Python's round(): the nearest at that precision, ties to even, on
    -- the exact binary value, as C's printf rounds
    if prec < 0 or prec > 300 then fail("unsupported round precision", pos) end
    return tonumber(string.format("%." .. prec .. "f", x)) + 0.0
  end,
  sum = function(ctx, v, a, kw, pos)
    local attribute = arg(a, kw, 1, "attribute")
    local total = arg(a, kw, 2, "start", 0)
    for _, x in ipairs(iter_items(v, pos)) do
      if attribute ~= nil and attribute ~= NONE then x = attr_path(ctx, x, attribute, pos) end
      total = arith(ctx, "+", total, x, pos)
    end
    return total
  end,
  min = function(ctx, v, a, kw, pos)
    local items = sorted(ctx, iter_items(v, pos), function(x)
      return sort_key(ctx, x, arg(a, kw, 2, "attribute"), truthy(arg(a, kw, 1, "case_sensitive", false)), pos)
    end, false, pos)
    if #items == 0 then return undef() end
    return items[1]
  end,
  max = function(ctx, v, a, kw, pos)
    local items = sorted(ctx, iter_items(v, pos), function(x)
      return sort_key(ctx, x, arg(a, kw, 2, "attribute"), truthy(arg(a, kw, 1, "case_sensitive", false)), pos)
    end, false, pos)
    if #items == 0 then return undef() end
    return items[#items]
  end,
  escape = function(_, v) return html_escape(str_arg(v)) end,
  format = function(ctx, v, a, kw, pos)
    local n = a.n or #a
    if n > 0 and next(kw) then fail("format: positional and keyword arguments together", pos) end
    local args
    if next(kw) then
      args = new_dict()
      local keys = {}
      for k in pairs(kw) do keys[#keys + 1] = k end
      table.sort(keys)
      for _, k in ipairs(keys) do dict_set(args, k, kw[k]) end
    else
      args = new_tuple{ table.unpack(a, 1, n) }
    end
    return percent_format(ctx, str_arg(v), args, pos)
  end,
}
FILTERS.d = FILTERS.default
FILTERS.count = FILTERS.length
FILTERS.e = FILTERS.escape

local function cmp_test(op)
  return function(_, v, a, _, pos) return compare(op, v, a[1], pos) end
end

TESTS = {
  defined = function(_, v) return not is_undef(v) end,
  undefined = function(_, v) return is_undef(v) end,
  none = function(_, v) return v == NONE end,
  string = function(_, v) return type(v) == "string" end,
  mapping = function(_, v) return is_dict(v) end,
  iterable = function(_, v) return type(v) == "string" or is_list(v) or is_dict(v) end,
  sequence = function(_, v) return type(v) == "string" or is_list(v) or is_dict(v) end,
  number = function(_, v) return type(v) == "number" or type(v) == "boolean" end,
  integer = function(_, v) return math.type(v) == "integer" end,
  float = function(_, v) return math.type(v) == "float" end,
  boolean = function(_, v) return type(v) == "boolean" end,
  ["true"] = function(_, v) return v == true end,
  ["false"] = function(_, v) return v == false end,
  callable = function(_, v) return is_callable(v) end,
  odd = function(_, v, _, _, pos) return to_num(v, "odd", v, pos) % 2 == 1 end,
  even = function(_, v, _, _, pos) return to_num(v, "even", v, pos) % 2 == 0 end,
  divisibleby = function(_, v, a, _, pos)
    local d = to_num(a[1], "divisibleby", v, pos)
    if d == 0 then fail("integer division or modulo by zero", pos) end
    return to_num(v, "divisibleby", d, pos) % d == 0
  end,
  lower = function(_, v) return type(v) == "string" and u_lower(v) == v end,
  upper = function(_, v) return type(v) == "string" and u_upper(v) == v end,
  escaped = function() return false end,
  sameas = function(_, v, a)
    if type(v) == "table" or type(a[1]) == "table" then return rawequal(v, a[1]) end
    return v == a[1] and math.type(v) == math.type(a[1])
  end,
  ["in"] = function(_, v, a, _, pos) return contains(a[1], v, pos) end,
  eq = cmp_test("=="), ne = cmp_test("!="), lt = cmp_test("<"), le = cmp_test("<="),
  gt = cmp_test(">"), ge = cmp_test(">="),
}
TESTS.equalto = TESTS.eq
TESTS["=="] = TESTS.eq
TESTS["!="] = TESTS.ne
TESTS["<"] = TESTS.lt
TESTS["<="] = TESTS.le
TESTS[">"] = TESTS.gt
TESTS[">="] = TESTS.ge
TESTS.greaterthan = TESTS.gt
TESTS.lessthan = TESTS.lt

-- ==== globals ===============================================================

local function make_globals(ctx, opts)
  local g = {}
  g.range = callable(function(a, _, pos)
    local start, stop, step = 0, a[1], 1
    if (a.n or #a) >= 2 then start, stop = a[1], a[2] end
    if (a.n or #a) >= 3 then step = a[3] end
    for _, x in ipairs{ start, stop, step } do
      if math.type(x) ~= "integer" then fail("range() arguments must be integers", pos) end
    end
    if step == 0 then fail("range() arg 3 must not be zero", pos) end
    local n = step > 0 and (stop - start + step - 1) // step or (start - stop - step - 1) // -step
    if n > ctx.max_steps then fail("range() too large", pos) end
    local out = {}
    for i = 0, n - 1 do out[#out + 1] = start + i * step end
    return new_list(out)
  end, "range")
  g.dict = callable(function(a, kw, pos)
    if (a.n or #a) > 0 then fail("unsupported dict() with positional arguments", pos) end
    local d = new_dict()
    local keys = {}
    for k in pairs(kw) do keys[#keys + 1] = k end
    table.sort(keys)
    for _, k in ipairs(keys) do dict_set(d, k, kw[k]) end
    return d
  end, "dict")
  g.namespace = callable(function(a, kw, pos)
    local ns = setmetatable({ attrs = {} }, NAMESPACE)
    if (a.n or #a) > 0 then
      if not is_dict(a[1]) then fail("namespace() takes a mapping", pos) end
      for _, k in ipairs(dict_keys(a[1])) do ns.attrs[k] = a[1][k] end
    end
    for k, v in pairs(kw) do ns.attrs[k] = v end
    return ns
  end, "namespace")
  g.raise_exception = callable(function(a)
    error(setmetatable({ msg = "jinja: raise_exception: " .. to_str(a[1]), raised = true }, ERR), 0)
  end, "raise_exception")
  g.strftime_now = callable(function(a, _, pos)
    local f = want_str(a[1], "strftime_now format", pos)
    local ok, s = pcall(os.date, "!" .. f, opts.now or os.time())
    if not ok then fail("strftime_now: bad format", pos) end
    return s
  end, "strftime_now")
  return g
end

-- ==== API ===================================================================

local Template = {}
Template.__index = Template

local function protect(fn, ...)
  local ok, a, b = pcall(fn, ...)
  if ok then return a, b end
  if getmetatable(a) == ERR then return nil, a.msg end
  if type(a) == "string" and a:find("stack overflow", 1, true) then
    return nil, "jinja: template nests too deep"
  end
  error(a, 0)
end

--- jinja.compile(source) -> template | nil, err
function M.compile(source)
  if type(source) ~= "string" then error("jinja.compile: template string expected", 2) end
  return protect(function()
    local p = setmetatable({ toks = lex(source), i = 1, depth = 0 }, Parser)
    local nodes = p:body(nil)
    return setmetatable({ nodes = nodes, source = source }, Template)
  end)
end

--- template:render(vars [, opts]) -> string | nil, err
--- vars: the template's variables (messages, tools, add_generation_prompt,
--- bos_token, ...). opts: max_steps, max_output, max_depth, now.
function Template:render(vars, opts)
  if vars ~= nil and type(vars) ~= "table" then error("template:render: vars must be a table", 2) end
  if opts ~= nil and type(opts) ~= "table" then error("template:render: options must be a table", 2) end
  opts = opts or {}
  for _, k in ipairs{ "max_steps", "max_output", "max_depth", "now" } do
    if opts[k] ~= nil and math.type(opts[k]) ~= "integer" then
      error("template:render: " .. k .. " must be an integer", 2)
    end
  end
  local ctx = setmetatable({ steps = 0, size = 0, depth = 0, listy = setmetatable({}, { __mode = "k" }),
                             max_steps = opts.max_steps or 1000000,
                             max_output = opts.max_output or 8 * 1024 * 1024,
                             max_depth = opts.max_depth or 64 }, Ctx)
  ctx.globals = make_globals(ctx, opts)
  local root = new_scope(nil)
  for k, v in pairs(vars or {}) do
    if type(k) == "string" then root.vars[k] = v end
  end
  local body = self.nodes
  local saved = CURRENT
  CURRENT = ctx
  local a, b = protect(function()
    local out = {}
    exec(ctx, root, body, out)
    return table.concat(out)
  end)
  CURRENT = saved
  return a, b
end

--- jinja.render(source, vars [, opts]) -> string | nil, err
function M.render(source, vars, opts)
  local t, err = M.compile(source)
  if not t then return nil, err end
  return t:render(vars, opts)
end

return M
