-- scripts.lua — running the runnable scripts as a user would (a separate
-- lua5.4 process) from the specs, and reading what they print:
--
--   local S = require "spec.support.scripts"
--   local r = S.run("generate.lua", { "--max-tokens", "4" })  -- {out=, err=, rc=, cmd=}
--   S.assert_ok(r);  S.json_decode(r.out);  S.jsonl_lines(r.out);  S.like(pattern, text, what)
--
-- The scripts find the module through KVLUA_BUILD (their first lines),
-- passed on from the environment busted runs in. json_decode is written
-- here, apart from kvlua.json, so it can check what the scripts print.
local S = {}

function S.shell_quote(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

-- Runs `lua5.4 scripts/<name> args...` with extra environment variables
-- env = {NAME = value}; returns {out=, err=, rc=}.
function S.run(name, args, env)
  local errfile = os.tmpname()
  local parts = {}
  local build = os.getenv("KVLUA_BUILD")
  if build then parts[#parts + 1] = "KVLUA_BUILD=" .. S.shell_quote(build) end
  for k, v in pairs(env or {}) do parts[#parts + 1] = k .. "=" .. S.shell_quote(v) end
  parts[#parts + 1] = "lua5.4 scripts/" .. name
  for _, a in ipairs(args or {}) do parts[#parts + 1] = S.shell_quote(a) end
  local cmd = table.concat(parts, " ") .. " 2>" .. S.shell_quote(errfile) .. " </dev/null"
  local p = assert(io.popen(cmd, "r"))
  local out = p:read("a")
  local _, _, rc = p:close()
  local f = io.open(errfile, "rb")
  local err = f and f:read("a") or ""
  if f then f:close() end
  os.remove(errfile)
  return { out = out, err = err, rc = rc, cmd = cmd }
end

function S.explain(r)
  return string.format("%s\nexit %s\nstdout: %s\nstderr: %s", r.cmd, tostring(r.rc), r.out, r.err)
end

function S.assert_ok(r)
  assert(r.rc == 0, S.explain(r))
end

-- A small JSON reader (objects, arrays, strings, numbers, true/false/null),
-- enough to check that a script prints valid JSON.
S.json_null = setmetatable({}, { __name = "null" })
function S.json_decode(s)
  local pos = 1
  local function ws() pos = s:find("[^ \t\r\n]", pos) or #s + 1 end
  local function fail(what) error(string.format("JSON: %s at byte %d of %q", what, pos, s), 0) end
  local value
  local function str()
    local out = {}
    pos = pos + 1
    while true do
      local c = s:sub(pos, pos)
      if c == "" then fail("unterminated string") end
      if c == '"' then pos = pos + 1; return table.concat(out) end
      if c == "\\" then
        local e = s:sub(pos + 1, pos + 1)
        local map = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }
        if map[e] then out[#out + 1] = map[e]; pos = pos + 2
        elseif e == "u" then out[#out + 1] = utf8.char(tonumber(s:sub(pos + 2, pos + 5), 16)); pos = pos + 6
        else fail("bad escape") end
      else
        out[#out + 1] = c
        pos = pos + 1
      end
    end
  end
  function value()
    ws()
    local c = s:sub(pos, pos)
    if c == "{" then
      local t = {}
      pos = pos + 1
      ws()
      if s:sub(pos, pos) == "}" then pos = pos + 1; return t end
      while true do
        ws()
        if s:sub(pos, pos) ~= '"' then fail("key expected") end
        local k = str()
        ws()
        if s:sub(pos, pos) ~= ":" then fail("':' expected") end
        pos = pos + 1
        t[k] = value()
        ws()
        local d = s:sub(pos, pos)
        pos = pos + 1
        if d == "}" then return t end
        if d ~= "," then fail("',' or '}' expected") end
      end
    elseif c == "[" then
      local t = {}
      pos = pos + 1
      ws()
      if s:sub(pos, pos) == "]" then pos = pos + 1; return t end
      while true do
        t[#t + 1] = value()
        ws()
        local d = s:sub(pos, pos)
        pos = pos + 1
        if d == "]" then return t end
        if d ~= "," then fail("',' or ']' expected") end
      end
    elseif c == '"' then
      return str()
    else
      for lit, v in pairs { ["true"] = true, ["false"] = false, ["null"] = S.json_null } do
        if s:sub(pos, pos + #lit - 1) == lit then pos = pos + #lit; return v end
      end
      local num = s:match("^-?%d+%.?%d*[eE]?[-+]?%d*", pos)
      if not num or num == "" then fail("value expected") end
      pos = pos + #num
      return assert(tonumber(num), "bad number " .. num)
    end
  end
  local v = value()
  ws()
  if pos <= #s then fail("trailing text") end
  return v
end

-- The values of a JSON Lines text, one per non-empty line.
function S.jsonl_lines(text)
  local t = {}
  for line in text:gmatch("[^\n]+") do t[#t + 1] = S.json_decode(line) end
  return t
end

-- assert that text matches a Lua pattern, saying what was checked
function S.like(pattern, text, what)
  assert(text:find(pattern), string.format("%s: %q does not match %q", what or "output", text, pattern))
end

function S.finite(x)
  return type(x) == "number" and x == x and x ~= math.huge and x ~= -math.huge
end

return S
