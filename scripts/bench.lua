#!/usr/bin/env lua5.4
-- scripts/bench.lua — prefill and decode speed of one model on this machine.
--
-- Measures, with the same token ids every run (a fixed pseudo-random
-- sequence): prefill tok/s for 128- and 512-token prompts (TTFT = time to
-- the first logits), decode tok/s after a context of 16, 512 and 1792
-- tokens, inter-token latency percentiles, peak RSS and KV-cache bytes.
-- Figures are medians over --reps repetitions. Compare against llama.cpp
-- with scripts/bench-compare.sh (side by side, interleaved).
--
-- --kv f16,q8_0 measures each K/V storage type in its own session, the
-- types taking turns inside every repetition (so they share the machine's
-- state); --json then prints {"by_kv": {"f16": {...}, "q8_0": {...}}}.
-- --backend cpu,opencl loads the model once per backend and measures them
-- the same way, taking turns inside every repetition (a side-by-side
-- comparison in one run); --json then keys by "backend/kv".
-- --plot FILE draws decode tok/s against depth and prefill tok/s against
-- prompt length, one line per storage type, into a PNG.
local usage = [[
usage: lua5.4 scripts/bench.lua [--model PATH] [--threads N] [--reps N]
                                [--decode N] [--prefill 128,512] [--depth 16,512,1792]
                                [--kv f16|q8_0|q4_0|f32|q8_0/q4_0|f16,q8_0] [--backend cpu|opencl|cpu,opencl]
                                [--device N] [--plot FILE] [--json]
]]
local common = dofile((arg[0]:match("^(.*)/") or ".") .. "/common.lua")
local o = common.parse(arg, {
  model = "", threads = 0, reps = 3, decode = 64, prefill = "128,512", depth = "16,512,1792", json = false,
  kv = "f16", plot = "", backend = "auto", device = 0,
}, usage)

local json = require "kvlua.json"

local function list(s)
  local t = {}
  for n in s:gmatch("%d+") do t[#t + 1] = math.tointeger(tonumber(n)) end
  return t
end

-- each --kv entry: a type for K and V, "K/V" (e.g. q8_0/q4_0), or
-- "K/V" with per-layer lists joined by + ("q4_0+0=f16+1=f16/q4_0")
local kv_types = {}
for t in o.kv:gmatch("[^,%s]+") do kv_types[#kv_types + 1] = t end
if #kv_types == 0 then common.die("option --kv needs a type (f16, q8_0, q4_0, f32)") end
local function kv_pair(spec)
  local k, v = spec:match("^([^/]+)/([^/]+)$")
  k, v = k or spec, v or spec
  return common.kv_types((k:gsub("%+", ","))), common.kv_types((v:gsub("%+", ",")))
end

-- Lua has no wall clock finer than a second: timings come from the
-- session's stats, taken with a monotonic clock around each forward pass.

local backends, models = {}, {}
for b in o.backend:gmatch("[^,%s]+") do
  backends[#backends + 1] = b
  models[b] = common.load(common.model_path(o.model), o.threads, b, o.device)
end
if #backends == 0 then common.die("option --backend needs a name (cpu, opencl)") end
local model = models[backends[1]]
local n_vocab = model.info.n_vocab
local depths, prefills = list(o.depth), list(o.prefill)
local max_depth = 0
for _, d in ipairs(depths) do max_depth = math.max(max_depth, d) end
for _, p in ipairs(prefills) do max_depth = math.max(max_depth, p) end
local ctx = max_depth + math.tointeger(o.decode) + 16

-- fixed pseudo-random ids (xorshift), the same in every run
local function ids(n, seed)
  local t, x = {}, seed or 88172645463325252
  for i = 1, n do
    x = x ~ (x << 13); x = x ~ (x >> 7); x = x ~ (x << 17)
    -- skip the first ids (often control tokens) when the vocabulary is large
    local low = n_vocab > 1024 and 256 or 0
    t[i] = math.tointeger((x >> 1) % (n_vocab - low)) + low
  end
  return t
end

-- ==== one repetition on one session ===========================================

local function push(t, k, v)
  t[k] = t[k] or {}
  table.insert(t[k], v)
end

-- New ids every repetition: the session's cache would reuse the pages of ids
-- it has seen (prefix reuse), and this measures cold prefill.
local function measure(s, m, rep)
  for _, p in ipairs(prefills) do
    s:rewind(s.pos)
    local t0 = s:stats().prefill_seconds
    assert(s:prefill(ids(p, p + 7919 * rep)))
    local dt = s:stats().prefill_seconds - t0
    push(m.prefill, p, p / dt)
    push(m.ttft_ms, p, dt * 1e3)
  end
  for _, d in ipairs(depths) do
    s:rewind(s.pos)
    assert(s:prefill(ids(d, d + 1)))
    local before = #s:stats().itl
    local toks = ids(math.tointeger(o.decode), d + 2)
    for i = 1, #toks do assert(s:decode(toks[i])) end
    local itl = s:stats().itl
    local sum = 0
    for i = before + 1, #itl do
      sum = sum + itl[i]
      if d == depths[1] then m.itl[#m.itl + 1] = itl[i] end
    end
    push(m.decode, d, (#itl - before) / sum)
  end
end

local runs = {}
for _, b in ipairs(backends) do
  for _, kv in ipairs(kv_types) do
    local kt, vt = kv_pair(kv)
    local s, err = models[b]:session { ctx = ctx, ktype = kt, vtype = vt }
    if not s then common.die(err) end
    runs[#runs + 1] = { kv = kv, s = s, prefill = {}, decode = {}, ttft_ms = {}, itl = {}, info = models[b].info,
      kv_bytes = model:kv_bytes { ctx = ctx, ktype = kt, vtype = vt } }
    -- warm-up (page in the weights)
    s:prefill(ids(32, 7))
    s:rewind(s.pos)
  end
end
for rep = 1, o.reps do
  for _, m in ipairs(runs) do measure(m.s, m, rep) end
end

-- ==== report ===================================================================

local function medians(t)
  local out = {}
  for k, v in pairs(t) do out[tostring(k)] = common.median(v) end
  return out
end

local function summary(m)
  return { model = model.info.name, arch = model.info.arch, threads = m.info.threads,
    backend = m.info.backend, device = m.info.device,
    kv_bytes = m.kv_bytes, kv_type = m.kv, ctx = ctx, peak_rss = common.peak_rss(),
    itl_ms = { p50 = common.percentile(m.itl, 50) * 1e3, p90 = common.percentile(m.itl, 90) * 1e3,
      p99 = common.percentile(m.itl, 99) * 1e3 },
    prefill_tps = medians(m.prefill), ttft_ms = medians(m.ttft_ms), decode_tps = medians(m.decode) }
end

local function keys(t)
  local k = {}
  for key in pairs(t) do k[#k + 1] = key end
  table.sort(k, function(a, b) return tonumber(a) < tonumber(b) end)
  return k
end

local function print_table(out)
  print(string.format("model %s (%s) on %s (%s), %d threads, KV %.1f MiB (%s) at ctx %d, peak RSS %.1f MiB",
    out.model, out.arch, out.backend, out.device, out.threads, out.kv_bytes / 2 ^ 20, out.kv_type, ctx,
    (out.peak_rss or 0) / 2 ^ 20))
  for _, k in ipairs(keys(out.prefill_tps)) do
    print(string.format("prefill %5s tokens: %8.1f tok/s  (TTFT %.1f ms)", k, out.prefill_tps[k], out.ttft_ms[k]))
  end
  for _, k in ipairs(keys(out.decode_tps)) do
    print(string.format("decode at depth %5s: %8.1f tok/s", k, out.decode_tps[k]))
  end
  print(string.format("ITL p50 %.2f ms, p90 %.2f ms, p99 %.2f ms", out.itl_ms.p50, out.itl_ms.p90, out.itl_ms.p99))
end

local PLOT_COLORS = { "blue", "orange", "green", "purple", "red", "brown" }

local function plot(path, outs)
  local p = require "kvlua.plot"
  local fig = p.figure { width = 1100, height = 460, cols = 2, title = "Speed against context depth",
    subtitle = string.format("%s, %d threads, median of %d runs (scripts/bench.lua)", model.info.name,
      model.info.threads, o.reps) }
  local dec = fig:panel { title = "Decode", xlabel = "depth (tokens already in the cache)", ylabel = "tokens/s" }
  local pre = fig:panel { title = "Prefill", xlabel = "prompt length (tokens)", ylabel = "tokens/s" }
  for i, out in ipairs(outs) do
    local color = PLOT_COLORS[(i - 1) % #PLOT_COLORS + 1]
    local function points(t)
      local pts = {}
      for _, k in ipairs(keys(t)) do pts[#pts + 1] = { tonumber(k), t[k] } end
      return pts
    end
    local label = (#backends > 1 and out.backend .. ", " or "") .. "K/V " .. out.kv_type
    dec:line { points = points(out.decode_tps), color = color, label = label, marker = true }
    pre:line { points = points(out.prefill_tps), color = color, label = label, marker = true }
  end
  local ok, err = fig:save(path)
  if not ok then common.die("cannot write the plot: " .. err) end
end

local outs = {}
for i, m in ipairs(runs) do outs[i] = summary(m) end
if o.plot ~= "" then plot(o.plot, outs) end

if o.json then
  if #outs == 1 then
    print(json.encode(outs[1]))
  else
    local by = {}
    if #backends > 1 then
      for _, out in ipairs(outs) do by[out.backend .. "/" .. out.kv_type] = out end
      print(json.encode { by_backend_kv = by })
    else
      for _, out in ipairs(outs) do by[out.kv_type] = out end
      print(json.encode { by_kv = by })
    end
  end
else
  for i, out in ipairs(outs) do
    if i > 1 then print("") end
    print_table(out)
  end
  if o.plot ~= "" then print("plot written to " .. o.plot) end
end
