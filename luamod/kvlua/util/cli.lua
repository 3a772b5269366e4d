-- kvlua.util.cli — what the command-line scripts (scripts/*.lua, installed
-- as kvlua-generate, kvlua-chat, ...) share: their options, each defined
-- once with argparse (its --help line, default and allowed range), checked
-- before anything runs, and small helpers (the default model, output that
-- must be written).
--
--   local cli = require "kvlua.util.cli"
--   local p = cli.parser("Prompt in, streamed text out.")
--   p:model_options()                       -- --model --threads --backend --device
--   p:sampling_options { temp = 0.7, seed = 42 }
--   p:int("--max-tokens", "N", "tokens to generate at most", 128, 1, cli.MAX_CTX)
--   local o = p:parse()                     -- o.max_tokens, o.temp, ...
--
-- A bad option value exits 2 with one line naming the option and what it
-- takes; an unknown option or a stray argument exits 2 with the usage.
-- Option names become fields with "-" turned into "_" (--max-tokens ->
-- o.max_tokens); a flag not given is nil.

local argparse = require "argparse"

local M = {}

-- the engine's limits (kvlua.load's threads, model:session's ctx)
M.MAX_THREADS = 256
M.MAX_CTX = 1 << 24
M.MAX_INT = (1 << 31) - 1
M.KV_TYPES = { "f16", "f32", "q8_0", "q4_0" }

-- the checkout's root when the script runs from one (the folder above the
-- script's folder); elsewhere a folder that holds none of ours
M.root = ((arg and arg[0] and arg[0]:match("^(.*)/[^/]*$")) or ".") .. "/.."
M.prog = (arg and arg[0] and arg[0]:match("[^/]*$")) or "kvlua"

--- cli.die(message [, status]): the message on stderr, exit status (2).
function M.die(msg, code)
  io.stderr:write(M.prog, ": ", tostring(msg), "\n")
  os.exit(code or 2)
end

-- ==== value checks =============================================================

local function fmt(x)
  if math.type(x) == "integer" and x >= 1 << 20 and x & (x - 1) == 0 then
    local e = 0
    while 1 << e < x do e = e + 1 end
    return "2^" .. e
  end
  return tostring(x)
end

local function range_text(lo, hi)
  if hi == nil or hi == math.huge then return ">= " .. fmt(lo) end
  return fmt(lo) .. ".." .. fmt(hi)
end

--- cli.integer(s, lo, hi) -> integer | nil, "what it takes": s as an
--- integer in [lo, hi] ("1e3" and "0x10" count; "2.5", "1e400" do not).
function M.integer(s, lo, hi)
  local n = math.tointeger(tonumber(s))
  if not n or n < lo or n > hi then return nil, "an integer in " .. range_text(lo, hi) end
  return n
end

--- cli.number(s, lo, hi) -> number | nil, "what it takes": a finite number
--- in [lo, hi] (hi nil: no upper bound).
function M.number(s, lo, hi)
  local n = tonumber(s)
  if not n or n ~= n or n == math.huge or n == -math.huge or n < lo or (hi and n > hi) then
    return nil, "a finite number in " .. range_text(lo, hi)
  end
  return n
end

--- cli.kv_types(s) -> "q8_0" | { default = "q4_0", [0] = "f16", ... } | nil, "what it takes":
--- K/V storage from the command line: a type, or a default then 0-based
--- layer=type items ("q4_0,0=f16,1=f16"), the form model:session{ ktype = } takes.
function M.kv_types(spec)
  local known = {}
  for _, t in ipairs(M.KV_TYPES) do known[t] = true end
  local want = "a K/V type (" .. table.concat(M.KV_TYPES, ", ") .. ") or a list 'TYPE,LAYER=TYPE,...'"
  if type(spec) ~= "string" then return nil, want end
  if not spec:find(",", 1, true) then
    local t = spec:match("^%s*(.-)%s*$")
    if not known[t] then return nil, want end
    return t
  end
  local t = {}
  for item in (spec .. ","):gmatch("([^,]*),") do
    local layer, ty = item:match("^%s*(%d+)%s*=%s*(%S+)%s*$")
    local plain = item:match("^%s*(.-)%s*$")
    if layer then
      layer = math.tointeger(tonumber(layer))
      if not layer or layer > 65535 or not known[ty] or t[layer] then return nil, want end
      t[layer] = ty
    elseif not t.default and next(t) == nil and known[plain] then
      t.default = plain
    else
      return nil, want
    end
  end
  return t
end

--- cli.kv_text(types): the command-line form of cli.kv_types's value.
function M.kv_text(t)
  if type(t) ~= "table" then return t end
  local layers = {}
  for k in pairs(t) do if k ~= "default" then layers[#layers + 1] = k end end
  table.sort(layers)
  local parts = { t.default }
  for _, l in ipairs(layers) do parts[#parts + 1] = l .. "=" .. t[l] end
  return table.concat(parts, ",")
end

-- ==== the parser ===============================================================

local Parser = {}
Parser.__index = Parser

--- cli.parser(description [, epilog]) -> parser: argparse's, with the helpers below.
function M.parser(description, epilog)
  local ap = argparse(M.prog, description, epilog)
  ap:help_max_width(100)
  ap:usage_max_width(100)
  local usage = ap.get_usage
  ap.get_usage = function(self) return (usage(self):gsub("^Usage:", "usage:")) end
  ap:argument("stray"):args("*"):hidden(true) -- named in the error below, not argparse's "too many arguments"
  return setmetatable({ ap = ap, bad = {} }, Parser)
end

local function described(desc, default)
  if default == nil or default == "" then return desc end
  return string.format("%s (default: %s)", desc, tostring(default))
end

-- An option whose value check(s) -> value | nil, "what it takes"; a failed
-- check is a one-line error naming the option.
function Parser:option(name, argname, desc, default, check)
  local p = self
  local o = self.ap:option(name, described(desc, default)):argname(argname)
  if default ~= nil then o:init(default) end
  if check then
    o:convert(function(s)
      local v, want = check(s)
      if v == nil then
        local msg = string.format("option %s takes %s, not '%s'", name, want, s)
        p.bad[msg] = true
        return nil, msg
      end
      return v
    end)
  end
  return o
end

function Parser:int(name, argname, desc, default, lo, hi)
  return self:option(name, argname, desc, default, function(s) return M.integer(s, lo, hi or M.MAX_INT) end)
end

function Parser:num(name, argname, desc, default, lo, hi)
  return self:option(name, argname, desc, default, function(s) return M.number(s, lo, hi) end)
end

-- A string option; nonempty = true refuses "".
function Parser:str(name, argname, desc, default, nonempty)
  return self:option(name, argname, desc, default, function(s)
    if nonempty and s == "" then return nil, "a non-empty text" end
    return s
  end)
end

function Parser:choice(name, choices, desc, default)
  local set = {}
  for _, c in ipairs(choices) do set[c] = true end
  return self:option(name, table.concat(choices, "|"), desc, default, function(s)
    if set[s] then return s end
    return nil, "one of " .. table.concat(choices, ", ")
  end)
end

-- A comma-separated list whose every item passes check(item) -> value | nil,
-- "what an item takes"; the option's value is the array of values.
function Parser:list(name, argname, desc, default, check)
  local parsed
  if default ~= nil then
    parsed = {}
    for item in default:gmatch("[^,]+") do parsed[#parsed + 1] = assert(check(item)) end
  end
  local o = self:option(name, argname, desc, default, function(s)
    local t = {}
    for item in (s .. ","):gmatch("([^,]*),") do
      local v, want = check(item)
      if v == nil then return nil, "a comma-separated list (each item " .. want .. ")" end
      t[#t + 1] = v
    end
    return t
  end)
  if parsed then o:init(parsed) end
  return o
end

function Parser:flag(name, desc)
  return self.ap:flag(name, desc)
end

-- K/V storage types, as cli.kv_types parses them (a default given as text stays text).
function Parser:kv(name, desc, default)
  return self:option(name, "TYPE", desc, default, M.kv_types)
end

--- p:model_options{ threads = true, backend = true }: --model, and unless
--- false, --threads, --backend and --device (kvlua.load's options).
function Parser:model_options(opts)
  opts = opts or {}
  self:str("--model", "PATH", "GGUF file (default: SmolLM2-135M-Instruct, fetched and cached)", nil, true)
  if opts.threads ~= false then
    self:int("--threads", "N", "CPU threads; 0 = the physical cores", 0, 0, M.MAX_THREADS)
  end
  if opts.backend ~= false then
    self:choice("--backend", { "auto", "cpu", "opencl" }, "where the model runs", "auto")
    self:int("--device", "N", "OpenCL device, as kvlua.devices() numbers them (from 1)", 1, 1, 1024)
  end
end

--- p:ctx_option(default [, zero_means]): --ctx N in 1..2^24 (0 too when zero_means says what it means).
function Parser:ctx_option(default, zero_means)
  local desc = "context size (tokens)" .. (zero_means and ("; 0 = " .. zero_means) or "")
  return self:int("--ctx", "N", desc, default, zero_means and 0 or 1, M.MAX_CTX)
end

local SAMPLING = {
  { "temp", "--temp", "T", "temperature; 0 = greedy", function(p, n, a, d, v) return p:num(n, a, d, v, 0, 1e6) end },
  { "top_k", "--top-k", "K", "keep the K most likely tokens; 0 = all",
    function(p, n, a, d, v) return p:int(n, a, d, v, 0) end },
  { "top_p", "--top-p", "P", "nucleus: the smallest set with probability P", function(p, n, a, d, v) return p:num(n, a, d, v, 0, 1) end },
  { "min_p", "--min-p", "P", "drop tokens below P times the top probability",
    function(p, n, a, d, v) return p:num(n, a, d, v, 0, 1) end },
  { "repeat_penalty", "--repeat-penalty", "R", "repetition penalty; 1 = none",
    function(p, n, a, d, v) return p:num(n, a, d, v, 1e-6, 1e6) end },
  { "seed", "--seed", "N", "sampling seed", function(p, n, a, d, v) return p:int(n, a, d, v, 0, math.maxinteger) end },
}

--- p:sampling_options{ temp = 0.7, top_k = 40, ... }: the sampling options
--- whose keys are given, with those defaults.
function Parser:sampling_options(defaults)
  for _, s in ipairs(SAMPLING) do
    if defaults[s[1]] ~= nil then s[5](self, s[2], s[3], s[4], defaults[s[1]]) end
  end
end

--- cli.sampler(o [, seed]): kvlua.sampling.from_opts of the parsed sampling options.
function M.sampler(o, seed)
  return require("kvlua.sampling").from_opts {
    temp = o.temp, top_k = o.top_k, top_p = o.top_p, min_p = o.min_p, repeat_penalty = o.repeat_penalty,
    seed = seed or o.seed,
  }
end

--- p:parse([argv]) -> options: every value checked; exits 2 with a message
--- (and the usage, for an unknown option or stray argument) otherwise.
function Parser:parse(argv)
  local ok, r = self.ap:pparse(argv or arg)
  if not ok then
    local msg = r:gsub("'(%-%-?%a[%w%-_]*)'", "%1")
    if self.bad[r] then M.die(msg) end
    io.stderr:write(M.prog, ": ", msg, "\n", self.ap:get_usage(), "\n")
    os.exit(2)
  end
  if r.stray[1] then
    io.stderr:write(M.prog, ": unexpected argument '", r.stray[1], "' (every value follows its --option)\n",
      self.ap:get_usage(), "\n")
    os.exit(2)
  end
  r.stray = nil
  return r
end

-- ==== models and files ===========================================================

--- cli.model_path(path [, name]): the given path, or the default model
--- fetched (and cached) by the checkout's scripts/fetch-models.sh.
function M.model_path(path, name)
  if path and path ~= "" then return path end
  local fetch = M.root .. "/scripts/fetch-models.sh"
  local f = io.open(fetch, "r")
  if not f then M.die("no --model given (the default model is fetched by a checkout's scripts/fetch-models.sh)") end
  f:close()
  local p = io.popen("'" .. fetch:gsub("'", "'\\''") .. "' " .. (name or "smollm2"))
  local out = p:read("l")
  p:close()
  if not out or out == "" then M.die("could not fetch the default model (scripts/fetch-models.sh)") end
  return out
end

--- cli.load(o [, name]): the model of the parsed options (--model, --threads,
--- --backend, --device); exits with a message when it cannot be loaded.
function M.load(o, name)
  local kvlua = require "kvlua"
  local model, err = kvlua.load(M.model_path(o.model, name), {
    threads = o.threads and o.threads > 0 and o.threads or nil, backend = o.backend, device = o.device })
  if not model then M.die("kvlua: " .. err) end
  return model
end

--- cli.input_file(path, what): path when it names a readable file (not a
--- folder), else exits 2 with a message.
function M.input_file(path, what)
  if not path or path == "" then M.die("missing " .. (what or "--file PATH")) end
  local f, err = io.open(path, "rb")
  if not f then M.die("cannot read " .. err) end
  local _, rerr = f:read(0)
  f:close()
  if rerr then M.die("cannot read " .. path .. ": " .. rerr) end
  return path
end

--- cli.read_file(path, what): the whole contents of an input file, or exit 2.
function M.read_file(path, what)
  M.input_file(path, what)
  local f = assert(io.open(path, "rb"))
  local text, err = f:read("a")
  f:close()
  if not text then M.die("cannot read " .. path .. ": " .. tostring(err)) end
  return text
end

--- cli.shard(s): nil when not given, else {index =, count =} (0 <= i < n <= 2^31); exits 2 when malformed.
function M.shard(s)
  if s == nil or s == "" then return nil end
  local shard, err = require("kvlua.jsonl").parse_shard(s)
  if not shard then M.die("option --shard: " .. err) end
  if not shard.count or shard.count > M.MAX_INT then
    M.die(string.format("option --shard: '%s' has more than %d shards", s, M.MAX_INT))
  end
  return shard
end

--- cli.jsonl_input(path, what, shard, on_error): a kvlua.jsonl reader of the
--- shard's lines; exits 2 when the file is missing, unreadable or empty.
function M.jsonl_input(path, what, shard, on_error)
  M.input_file(path, what)
  local reader, err = require("kvlua.jsonl").open(path, { shard = shard, on_error = on_error })
  if not reader then M.die("cannot read " .. err) end
  if reader.lines == 0 then M.die(path .. ": the file is empty (one JSON object per line expected)") end
  return reader
end

--- cli.check_kv(model, types, option): exits 2 when a per-layer K/V list
--- (cli.kv_types) names a layer the model does not have.
function M.check_kv(model, types, option)
  if type(types) ~= "table" then return types end
  local n = model.info.n_layer
  for layer in pairs(types) do
    if layer ~= "default" and layer >= n then
      M.die(string.format("option %s: layer %d, but the model has layers 0..%d", option, layer, n - 1))
    end
  end
  return types
end

--- cli.item_id(item, line) -> id [, message]: a JSONL item's "id" for its
--- output line: a string or a finite number; when absent the line number,
--- and when it is something else the line number and why it is refused.
function M.item_id(item, line)
  local json = require "kvlua.json"
  local id = type(item) == "table" and item.id or nil
  if id == nil or id == json.null then return line end
  if type(id) == "string" or (type(id) == "number" and id == id and id ~= math.huge and id ~= -math.huge) then
    return id
  end
  return line, '"id" must be a string or a finite number'
end

-- ==== output that must be written ==================================================

local Output = {}
Output.__index = Output

--- cli.output(path): a file to write ("" or nil: stdout) whose every write
--- is checked: a failing write, flush or close (a full disk, a closed pipe)
--- exits 1 with one line naming the file.
function M.output(path)
  if path == nil or path == "" then return setmetatable({ f = io.stdout, name = "stdout" }, Output) end
  local f, err = io.open(path, "wb")
  if not f then M.die("cannot write " .. err) end
  return setmetatable({ f = f, name = path }, Output)
end

function Output:fail(err)
  M.die(string.format("cannot write %s: %s", self.name, tostring(err)), 1)
end

function Output:write(...)
  local ok, err = self.f:write(...)
  if not ok then self:fail(err) end
  return self
end

function Output:flush()
  local ok, err = self.f:flush()
  if not ok then self:fail(err) end
end

function Output:close()
  self:flush()
  if self.f ~= io.stdout then
    local ok, err = self.f:close()
    if not ok then self:fail(err) end
  end
end

M.stdout = setmetatable({ f = io.stdout, name = "stdout" }, Output)

--- cli.print(...): print's output through cli.stdout (print flushes
--- stdout itself and drops the error, so a failed write would go unseen).
function M.print(...)
  local n = select("#", ...)
  local t = {}
  for i = 1, n do t[i] = tostring((select(i, ...))) end
  M.stdout:write(table.concat(t, "\t"), "\n")
end

--- cli.exit(status): flushes stdout (exit 1 with a message when that
--- fails, e.g. on a full disk) and exits with status.
function M.exit(code)
  M.stdout:flush()
  os.exit(code or 0)
end

-- ==== figures =====================================================================

--- cli.percentile(t, p): the p-th percentile (nearest rank) of the numbers in t, or nil if empty.
function M.percentile(t, p)
  local c = table.move(t, 1, #t, 1, {})
  table.sort(c)
  if #c == 0 then return nil end
  return c[math.max(1, math.ceil(p / 100 * #c))]
end

--- cli.median(t): the median (the mean of the middle two for an even count), or nil if empty.
function M.median(t)
  local c = table.move(t, 1, #t, 1, {})
  table.sort(c)
  if #c == 0 then return nil end
  return #c % 2 == 1 and c[(#c + 1) // 2] or (c[#c // 2] + c[#c // 2 + 1]) / 2
end

--- cli.peak_rss(): peak resident set size of this process in bytes (Linux), or nil.
function M.peak_rss()
  local f = io.open("/proc/self/status")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  local kb = s:match("VmHWM:%s*(%d+)")
  return kb and tonumber(kb) * 1024
end

return M
