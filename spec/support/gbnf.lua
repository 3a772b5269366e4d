-- gbnf.lua — a small GBNF reader for the specs, apart from the engine's
-- grammar code: it parses llama.cpp's GBNF (rules, |, groups, literals and
-- classes with escapes, * + ? {m} {m,} {m,n}) over code points, says
-- whether a grammar matches a whole string, and draws random strings from
-- it.
--
--   local gbnf = require "spec.support.gbnf"
--   local g = gbnf.parse(text)          -- raises on what it cannot read
--   g:match('{"a": 1}')                 --> true | false
--   g:sample(rng)                       --> a string of the grammar (rng(n) -> 1..n)
local M = {}

-- ==== parsing ==================================================================

local function parse(text)
  local rules, order = {}, {}
  local cps = {}
  for _, c in utf8.codes(text) do cps[#cps + 1] = c end
  local i = 1
  local function ch(k) return cps[k] and utf8.char(cps[k]) or "" end
  local function err(msg) error(("gbnf: %s at code point %d"):format(msg, i), 2) end
  local function skip_space(newlines)
    while cps[i] do
      local c = ch(i)
      if c == " " or c == "\t" or (newlines and (c == "\n" or c == "\r")) then
        i = i + 1
      elseif c == "#" then
        while cps[i] and ch(i) ~= "\n" do i = i + 1 end
      else
        break
      end
    end
  end
  local function name()
    local s = ""
    while cps[i] and ch(i):match("[%w%-_]") do s = s .. ch(i); i = i + 1 end
    if s == "" then err("a rule name expected") end
    return s
  end
  local function hex(n)
    local s = ""
    for _ = 1, n do s = s .. ch(i); i = i + 1 end
    if not s:match("^%x+$") then err("bad hex escape") end
    return tonumber(s, 16)
  end
  local function escaped()
    -- after a backslash
    local c = ch(i)
    i = i + 1
    if c == "n" then return 10 elseif c == "r" then return 13 elseif c == "t" then return 9
    elseif c == "x" then return hex(2) elseif c == "u" then return hex(4) elseif c == "U" then return hex(8) end
    return utf8.codepoint(c)
  end

  local alternatives
  local function element()
    local c = ch(i)
    local node
    if c == '"' then
      i = i + 1
      local seq = { "seq" }
      while ch(i) ~= '"' do
        if not cps[i] then err("unclosed literal") end
        local cp
        if ch(i) == "\\" then i = i + 1; cp = escaped() else cp = cps[i]; i = i + 1 end
        seq[#seq + 1] = { "set", { { cp, cp } }, false }
      end
      i = i + 1
      node = seq
    elseif c == "[" then
      i = i + 1
      local neg = false
      if ch(i) == "^" then neg = true; i = i + 1 end
      local ranges = {}
      while ch(i) ~= "]" do
        if not cps[i] then err("unclosed class") end
        local lo
        if ch(i) == "\\" then i = i + 1; lo = escaped() else lo = cps[i]; i = i + 1 end
        local hi = lo
        if ch(i) == "-" and ch(i + 1) ~= "]" then
          i = i + 1
          if ch(i) == "\\" then i = i + 1; hi = escaped() else hi = cps[i]; i = i + 1 end
        end
        ranges[#ranges + 1] = { lo, hi }
      end
      i = i + 1
      node = { "set", ranges, neg }
    elseif c == "(" then
      i = i + 1
      skip_space(true)
      node = alternatives(true)
      if ch(i) ~= ")" then err("unclosed group") end
      i = i + 1
    elseif c == "." then
      i = i + 1
      node = { "set", {}, true }
    elseif c:match("[%w%-_]") then
      node = { "ref", name() }
    else
      err("unexpected " .. c)
    end
    -- postfix operators
    while true do
      local p = ch(i)
      if p == "*" then node = { "rep", node, 0, nil }; i = i + 1
      elseif p == "+" then node = { "rep", node, 1, nil }; i = i + 1
      elseif p == "?" then node = { "rep", node, 0, 1 }; i = i + 1
      elseif p == "{" then
        i = i + 1
        local s = ""
        while ch(i):match("%d") do s = s .. ch(i); i = i + 1 end
        local min, max = tonumber(s), nil
        if ch(i) == "," then
          i = i + 1
          s = ""
          while ch(i):match("%d") do s = s .. ch(i); i = i + 1 end
          max = tonumber(s)
        else
          max = min
        end
        if ch(i) ~= "}" then err("bad {m,n}") end
        i = i + 1
        node = { "rep", node, min, max }
      else
        break
      end
    end
    return node
  end

  local function sequence(nested)
    local seq = { "seq" }
    while true do
      skip_space(nested)
      local c = ch(i)
      if c == "" or c == "|" or c == ")" or c == "\n" or c == "\r" then break end
      seq[#seq + 1] = element()
    end
    return seq
  end

  function alternatives(nested)
    local alts = { "alt", sequence(nested) }
    while ch(i) == "|" do
      i = i + 1
      skip_space(true)
      alts[#alts + 1] = sequence(nested)
    end
    return alts
  end

  while true do
    skip_space(true)
    if not cps[i] then break end
    local n = name()
    skip_space(false)
    if ch(i) .. ch(i + 1) .. ch(i + 2) ~= "::=" then err("::= expected") end
    i = i + 3
    skip_space(true)
    if rules[n] then err("rule " .. n .. " defined twice") end
    rules[n] = alternatives(false)
    order[#order + 1] = n
  end
  return rules, order
end

-- ==== matching ===================================================================

local G = {}
G.__index = G

local function in_set(node, cp)
  local hit = false
  for _, r in ipairs(node[2]) do
    if cp >= r[1] and cp <= r[2] then hit = true; break end
  end
  if node[3] then return not hit end
  return hit
end

-- ends(node, pos) -> list of positions where a match of node from pos can end
function G:ends(node, pos)
  local kind = node[1]
  if kind == "set" then
    local cp = self.cps[pos]
    if cp and in_set(node, cp) then return { pos + 1 } end
    return {}
  end
  if kind == "ref" then
    local memo = self.memo[node[2]]
    if not memo then
      memo = {}
      self.memo[node[2]] = memo
    end
    local got = memo[pos]
    if got then return got end
    memo[pos] = {} -- (no left recursion in the grammars tested)
    local rule = self.rules[node[2]]
    if not rule then error("gbnf: undefined rule " .. node[2]) end
    got = self:ends(rule, pos)
    memo[pos] = got
    return got
  end
  if kind == "seq" then
    local cur = { [pos] = true }
    for k = 2, #node do
      local nxt = {}
      for p in pairs(cur) do
        for _, e in ipairs(self:ends(node[k], p)) do nxt[e] = true end
      end
      cur = nxt
      if next(cur) == nil then break end
    end
    local out = {}
    for p in pairs(cur) do out[#out + 1] = p end
    return out
  end
  if kind == "alt" then
    local set, out = {}, {}
    for k = 2, #node do
      for _, e in ipairs(self:ends(node[k], pos)) do
        if not set[e] then set[e] = true; out[#out + 1] = e end
      end
    end
    return out
  end
  -- rep: positions after min..max matches (unbounded: a search over
  -- (position, matches so far up to min))
  local min, max = node[3], node[4]
  local res = {}
  if max then
    local cur = { [pos] = true }
    if min == 0 then res[pos] = true end
    for count = 1, max do
      local nxt = {}
      for p in pairs(cur) do
        for _, e in ipairs(self:ends(node[2], p)) do nxt[e] = true end
      end
      if next(nxt) == nil then break end
      if count >= min then for p in pairs(nxt) do res[p] = true end end
      cur = nxt
    end
  else
    local seen = { [pos .. "/0"] = true }
    local queue = { { pos, 0 } }
    while #queue > 0 do
      local st = table.remove(queue)
      local p, c = st[1], st[2]
      if c >= min then res[p] = true end
      for _, e in ipairs(self:ends(node[2], p)) do
        local c2 = math.min(c + 1, min)
        local key = e .. "/" .. c2
        if not seen[key] then
          seen[key] = true
          queue[#queue + 1] = { e, c2 }
        end
      end
    end
  end
  local out = {}
  for p in pairs(res) do out[#out + 1] = p end
  return out
end

--- g:match(s) -> whether the grammar's root matches all of s
function G:match(s, root)
  self.cps = {}
  for _, c in utf8.codes(s) do self.cps[#self.cps + 1] = c end
  self.memo = {}
  for _, e in ipairs(self:ends({ "ref", root or "root" }, 1)) do
    if e == #self.cps + 1 then return true end
  end
  return false
end

-- ==== sampling =====================================================================

-- Characters a negated class draws from.
local POOL = {}
for c = 0x20, 0x7E do POOL[#POOL + 1] = c end
for _, c in ipairs { 0x0A, 0x09, 0xE9, 0x4E2D, 0x1F600, 0x3B1 } do POOL[#POOL + 1] = c end

function G:draw(node, rng, depth, out)
  local kind = node[1]
  if kind == "set" then
    local cands = {}
    if node[3] then
      for _, c in ipairs(POOL) do if in_set(node, c) then cands[#cands + 1] = c end end
    else
      for _, r in ipairs(node[2]) do
        for _ = 1, 3 do cands[#cands + 1] = r[1] + rng(r[2] - r[1] + 1) - 1 end
      end
    end
    assert(#cands > 0, "gbnf: an empty class")
    out[#out + 1] = utf8.char(cands[rng(#cands)])
  elseif kind == "ref" then
    self:draw(self.rules[node[2]], rng, depth + 1, out)
  elseif kind == "seq" then
    for k = 2, #node do self:draw(node[k], rng, depth, out) end
  elseif kind == "alt" then
    local n = #node - 1
    local pick = depth > self.max_depth and n or rng(n)
    self:draw(node[pick + 1], rng, depth, out)
  else
    local min, max = node[3], node[4]
    local n = min
    if depth <= self.max_depth then
      local hi = max or (min + 4)
      n = min + rng(hi - min + 1) - 1
    end
    for _ = 1, n do self:draw(node[2], rng, depth + 1, out) end
  end
end

--- g:sample(rng [, max_depth=12]) -> a string the grammar matches
function G:sample(rng, max_depth, root)
  self.max_depth = max_depth or 12
  local out = {}
  self:draw({ "ref", root or "root" }, rng, 0, out)
  return table.concat(out)
end

function M.parse(text)
  local rules, order = parse(text)
  return setmetatable({ rules = rules, order = order }, G)
end

--- gbnf.rng(seed) -> function(n) -> 1..n (a small LCG, the same everywhere)
function M.rng(seed)
  local state = seed
  return function(n)
    state = (state * 6364136223846793005 + 1442695040888963407)
    return ((state >> 33) % n) + 1
  end
end

return M
