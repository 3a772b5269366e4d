-- scripts/common.lua — shared by the runnable scripts: finds the kvlua
-- module (an installed rock, or this checkout's build), parses --options,
-- and resolves the default model.
--
--   local common = dofile((arg[0]:match("^(.*)/") or ".") .. "/common.lua")
--   local opts = common.parse(arg, { model = "", prompt = "Hello", ["max-tokens"] = 128 })

local M = {}

-- the checkout's root: the folder above this script's folder
M.root = ((arg and arg[0] and arg[0]:match("^(.*)/[^/]*$")) or ".") .. "/.."

-- Prefer this checkout's module and Lua files over an installed rock.
package.path = M.root .. "/luamod/?.lua;" .. M.root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or (M.root .. "/build")) .. "/?.so;" .. package.cpath

local function die(msg)
  io.stderr:write(msg, "\n")
  os.exit(2)
end
M.die = die

-- Parses "--name value", "--name=value" and boolean "--flag" into a table
-- seeded with defaults; the type of each default decides the conversion.
-- Unknown options and bad numbers exit with a usage message.
-- Scripts that load a model (those with --threads) also take --backend
-- auto|cpu|opencl and --device N (kvlua.load's options).
function M.parse(argv, defaults, usage)
  if defaults.threads ~= nil and defaults.backend == nil then
    defaults.backend, defaults.device = "auto", 0
  end
  local o = {}
  for k, v in pairs(defaults) do o[k] = v end
  local positional = {}
  local i = 1
  while i <= #argv do
    local a = argv[i]
    if a == "-h" or a == "--help" then
      io.stdout:write(usage or "see the script's header\n")
      if defaults.backend then io.stdout:write("  --backend auto|cpu|opencl  --device N   where the model runs\n") end
      os.exit(0)
    end
    local name, val = a:match("^%-%-([%w%-_]+)=(.*)$")
    if not name then name = a:match("^%-%-([%w%-_]+)$") end
    if name then
      local def = defaults[name]
      if def == nil then die("unknown option --" .. name .. "\n" .. (usage or "")) end
      if type(def) == "boolean" then
        o[name] = val == nil or val == "1" or val == "true"
      else
        if val == nil then
          i = i + 1
          val = argv[i]
          if val == nil then die("option --" .. name .. " needs a value") end
        end
        if type(def) == "number" then
          local n = tonumber(val)
          if not n then die("option --" .. name .. " needs a number, got '" .. val .. "'") end
          o[name] = n
        else
          o[name] = val
        end
      end
    else
      positional[#positional + 1] = a
    end
    i = i + 1
  end
  o._ = positional
  return o
end

-- Path of a model: the given path, or the default model fetched (and
-- cached) by scripts/fetch-models.sh.
function M.model_path(path, name)
  if path and path ~= "" then return path end
  local p = io.popen(M.root .. "/scripts/fetch-models.sh " .. (name or "smollm2"))
  local out = p:read("l")
  p:close()
  if not out or out == "" then die("could not fetch the default model (scripts/fetch-models.sh)") end
  return out
end

function M.load(path, threads, backend, device)
  local kvlua = require "kvlua"
  local model, err = kvlua.load(path, { threads = threads and threads > 0 and math.tointeger(threads) or nil,
    backend = backend, device = device and math.tointeger(device) or nil })
  if not model then die("kvlua: " .. err) end
  return model
end

-- The p-th percentile (nearest rank) of the numbers in t, or nil if empty.
function M.percentile(t, p)
  local c = table.move(t, 1, #t, 1, {})
  table.sort(c)
  if #c == 0 then return nil end
  return c[math.max(1, math.ceil(p / 100 * #c))]
end

-- The median of the numbers in t (the mean of the middle two for an even
-- count), or nil if empty.
function M.median(t)
  local c = table.move(t, 1, #t, 1, {})
  table.sort(c)
  if #c == 0 then return nil end
  return #c % 2 == 1 and c[(#c + 1) // 2] or (c[#c // 2] + c[#c // 2 + 1]) / 2
end

-- An input file that must exist: its path, or exit with a message.
function M.input_file(path, what)
  if not path or path == "" then die("missing " .. (what or "--file PATH")) end
  local f, err = io.open(path, "rb")
  if not f then die("cannot read " .. err) end
  f:close()
  return path
end

-- The --shard option: nil when not given, else {index =, count =}; exits
-- with a message when malformed.
function M.shard(s)
  if s == nil or s == "" then return nil end
  local shard, err = require("kvlua.jsonl").parse_shard(s)
  if not shard then die(err) end
  return shard
end

-- A JSONL input file: a kvlua.jsonl reader of the shard's lines, or exit
-- with a message when the file is missing, unreadable or empty.
function M.jsonl_input(path, what, shard, on_error)
  M.input_file(path, what)
  local reader, err = require("kvlua.jsonl").open(path, { shard = shard, on_error = on_error })
  if not reader then die("cannot read " .. err) end
  if reader.lines == 0 then die(path .. ": the file is empty (one JSON object per line expected)") end
  return reader
end

-- K/V storage types from the command line: "q8_0" -> "q8_0";
-- "q4_0,0=f16,1=f16" -> { default = "q4_0", [0] = "f16", [1] = "f16" }
-- (0-based layers), the form model:session{ ktype = } takes.
function M.kv_types(spec)
  if not spec:find(",", 1, true) then return spec end
  local t = {}
  for item in spec:gmatch("[^,]+") do
    local layer, ty = item:match("^%s*(%d+)%s*=%s*(%S+)%s*$")
    if layer then
      t[math.tointeger(tonumber(layer))] = ty
    elseif not t.default then
      t.default = item:match("^%s*(.-)%s*$")
    else
      M.die("bad K/V type list '" .. spec .. "' (a default, then layer=type items)")
    end
  end
  if not t.default then M.die("K/V type list '" .. spec .. "' needs a default type first") end
  return t
end

-- Peak resident set size of this process in bytes (Linux), or nil.
function M.peak_rss()
  local f = io.open("/proc/self/status")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  local kb = s:match("VmHWM:%s*(%d+)")
  return kb and tonumber(kb) * 1024
end

return M
