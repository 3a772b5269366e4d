-- kvlua.jsonl — JSON Lines files: reading item by item with line numbers,
-- splitting a file into shards, writing records.
--
--   local jsonl = require "kvlua.jsonl"
--   local shard = assert(jsonl.parse_shard("1/4"))          -- {index = 1, count = 4}
--   local r = assert(jsonl.open("prompts.jsonl", { shard = shard }))
--   for line, item, err in r:items() do ... end             -- item nil: err says why
--   for _, e in ipairs(r.errors) do print(e.line, e.message) end
--   jsonl.write(io.stdout, { id = 1, text = "..." })
--
-- Shards split a file by line ranges. With N lines numbered k = 0..N-1,
-- line k belongs to shard floor(k * n / N) of n (shards are numbered
-- 0..n-1, as Slurm array task ids are). Each shard is one contiguous range
-- and the ranges follow each other, so writing each shard's output to its
-- own file and concatenating the files in shard order gives exactly the
-- output of the unsharded run:
--
--   cat out.0.jsonl out.1.jsonl ... > out.jsonl
--
-- Blank lines count as lines (line numbers stay the file's) but are not
-- items. A line that is not valid JSON, or whose value is not an object,
-- comes out as (line, nil, message), is recorded in r.errors and passed to
-- opts.on_error(line, message) when given; the other lines are still read.
--
-- Errors: a missing or unreadable file returns nil, message; a malformed
-- shard string returns nil, message; wrong argument types raise.

local json = require "kvlua.json"

local M = {}

--- jsonl.parse_shard("i/n") -> {index = i, count = n} | nil, message (0 <= i < n)
function M.parse_shard(s)
  if type(s) ~= "string" then error("jsonl.parse_shard: string expected", 2) end
  local i, n = s:match("^%s*(%d+)%s*/%s*(%d+)%s*$")
  i, n = tonumber(i), tonumber(n)
  if not i then return nil, "shard '" .. s .. "' is not of the form i/n (e.g. 0/4)" end
  if n < 1 or i >= n then
    return nil, "shard '" .. s .. "': need 0 <= i < n (shards are numbered from 0)"
  end
  return { index = math.tointeger(i), count = math.tointeger(n) }
end

--- jsonl.shard_range(n_lines, shard) -> first, last (1-based line numbers,
--- inclusive; first > last when the shard is empty)
function M.shard_range(n_lines, shard)
  if not shard then return 1, n_lines end
  local i, n = shard.index, shard.count
  -- the smallest k with floor(k * n / N) >= i is ceil(i * N / n)
  local first = (i * n_lines + n - 1) // n
  local next_first = ((i + 1) * n_lines + n - 1) // n
  return first + 1, next_first
end

local function count_lines(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local n = 0
  for _ in f:lines() do n = n + 1 end
  f:close()
  return n
end

local Reader = {}
Reader.__index = Reader

--- jsonl.open(path [, {shard = {index=, count=}, on_error = function(line, message)}])
--- -> reader | nil, message. reader.lines (lines in the file), reader.first
--- and reader.last (this shard's line range), reader.errors.
function M.open(path, opts)
  if type(path) ~= "string" then error("jsonl.open: path must be a string", 2) end
  opts = opts or {}
  local n, err = count_lines(path)
  if not n then return nil, err end
  local first, last = M.shard_range(n, opts.shard)
  return setmetatable({ path = path, lines = n, first = first, last = last, errors = {},
    on_error = opts.on_error }, Reader)
end

function Reader:report(line, message)
  self.errors[#self.errors + 1] = { line = line, message = message }
  if self.on_error then self.on_error(line, message) end
end

--- reader:items() -> iterator over line, object | line, nil, message
--- (this shard's non-blank lines)
function Reader:items()
  local f = assert(io.open(self.path, "rb"))
  local lines = f:lines()
  local k = 0
  return function()
    while true do
      local text = lines()
      k = k + 1
      if not text or k > self.last then
        f:close()
        return nil
      end
      if k >= self.first and text:find("%S") then
        local v, err = json.decode(text)
        if v == nil then
          err = "malformed JSON: " .. err
        elseif type(v) ~= "table" or json.is_array(v) then
          err = "expected a JSON object"
        end
        if err then
          self:report(k, err)
          return k, nil, err
        end
        return k, v
      end
    end
  end
end

--- reader:count_items() -> number of non-blank lines in this shard's range
function Reader:count_items()
  local f = assert(io.open(self.path, "rb"))
  local n, k = 0, 0
  for text in f:lines() do
    k = k + 1
    if k > self.last then break end
    if k >= self.first and text:find("%S") then n = n + 1 end
  end
  f:close()
  return n
end

--- jsonl.write(file, value): one line of JSON
function M.write(file, value)
  file:write(json.encode(value), "\n")
end

return M
