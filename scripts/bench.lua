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
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

-- each --kv entry: a type for K and V, "K/V" (e.g. q8_0/q4_0), or
-- "K/V" with per-layer lists joined by + ("q4_0+0=f16+1=f16/q4_0")
local function kv_pair(spec)
  local k, v = spec:match("^([^/]+)/([^/]+)$")
  k, v = k or spec, v or spec
  local kt, vt = cli.kv_types((k:gsub("%+", ","))), cli.kv_types((v:gsub("%+", ",")))
  if not kt or not vt then return nil, "a K/V type (f16, f32, q8_0, q4_0), a pair K/V, or per layer q4_0+0=f16" end
  return { spec = spec, k = kt, v = vt }
end

local function positive(lo, hi)
  return function(s) return cli.integer(s, lo, hi) end
end

local p = cli.parser("Prefill and decode speed of one model on this machine.")
p:model_options { backend = false }
p:list("--backend", "LIST", "backends measured taking turns: auto, cpu, opencl (e.g. cpu,opencl)", "auto",
  function(s)
    if s == "auto" or s == "cpu" or s == "opencl" then return s end
    return nil, "one of auto, cpu, opencl"
  end)
p:int("--device", "N", "OpenCL device, as kvlua.devices() numbers them (from 1)", 1, 1, 1024)
p:int("--reps", "N", "repetitions (figures are medians)", 3, 1, 1000)
p:int("--decode", "N", "tokens decoded at each depth", 64, 1, 1 << 20)
p:list("--prefill", "LIST", "prompt lengths prefilled", "128,512", positive(1, cli.MAX_CTX // 2))
p:list("--depth", "LIST", "context depths decoded at", "16,512,1792", positive(1, cli.MAX_CTX // 2))
p:list("--kv", "LIST", "K/V storage types, each measured (f16, q8_0, q4_0, f32, K/V pairs like q8_0/q4_0)",
  "f16", kv_pair)
p:str("--plot", "FILE", "write a PNG of tok/s against depth and prompt length", nil, true)
p:flag("--json", "print the figures as one JSON object")
local o = p:parse()

local json = require "kvlua.json"

local kv_types = {}
for i, kv in ipairs(o.kv) do kv_types[i] = kv.spec end
local kv_by_spec = {}
for _, kv in ipairs(o.kv) do kv_by_spec[kv.spec] = kv end
local function kv_pair_of(spec)
  return kv_by_spec[spec].k, kv_by_spec[spec].v
end

-- Lua has no wall clock finer than a second: timings come from the
-- session's stats, taken with a monotonic clock around each forward pass.

local backends, models = {}, {}
for _, b in ipairs(o.backend) do
  backends[#backends + 1] = b
  models[b] = cli.load { model = o.model, threads = o.threads, backend = b, device = o.device }
end
local model = models[backends[1]]
local n_vocab = model.info.n_vocab
for _, kv in ipairs(o.kv) do
  cli.check_kv(model, kv.k, "--kv")
  cli.check_kv(model, kv.v, "--kv")
end
local depths, prefills = o.depth, o.prefill
local max_depth = 0
for _, d in ipairs(depths) do max_depth = math.max(max_depth, d) end
for _, p in ipairs(prefills) do max_depth = math.max(max_depth, p) end
local ctx = max_depth + o.decode + 16

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
    local toks = ids(o.decode, d + 2)
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
    local kt, vt = kv_pair_of(kv)
    local s, err = models[b]:session { ctx = ctx, ktype = kt, vtype = vt }
    if not s then cli.die(err) end
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
  for k, v in pairs(t) do out[tostring(k)] = cli.median(v) end
  return out
end

local function summary(m)
  return { model = model.info.name, arch = model.info.arch, threads = m.info.threads,
    backend = m.info.backend, device = m.info.device,
    kv_bytes = m.kv_bytes, kv_type = m.kv, ctx = ctx, peak_rss = cli.peak_rss(),
    itl_ms = { p50 = cli.percentile(m.itl, 50) * 1e3, p90 = cli.percentile(m.itl, 90) * 1e3,
      p99 = cli.percentile(m.itl, 99) * 1e3 },
    prefill_tps = medians(m.prefill), ttft_ms = medians(m.ttft_ms), decode_tps = medians(m.decode) }
end

local function keys(t)
  local k = {}
  for key in pairs(t) do k[#k + 1] = key end
  table.sort(k, function(a, b) return tonumber(a) < tonumber(b) end)
  return k
end

local function print_table(out)
  cli.print(string.format("model %s (%s) on %s (%s), %d threads, KV %.1f MiB (%s) at ctx %d, peak RSS %.1f MiB",
    out.model, out.arch, out.backend, out.device, out.threads, out.kv_bytes / 2 ^ 20, out.kv_type, ctx,
    (out.peak_rss or 0) / 2 ^ 20))
  for _, k in ipairs(keys(out.prefill_tps)) do
    cli.print(string.format("prefill %5s tokens: %8.1f tok/s  (TTFT %.1f ms)", k, out.prefill_tps[k], out.ttft_ms[k]))
  end
  for _, k in ipairs(keys(out.decode_tps)) do
    cli.print(string.format("decode at depth %5s: %8.1f tok/s", k, out.decode_tps[k]))
  end
  cli.print(string.format("ITL p50 %.2f ms, p90 %.2f ms, p99 %.2f ms", out.itl_ms.p50, out.itl_ms.p90, out.itl_ms.p99))
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
  if not ok then cli.die("cannot write the plot: " .. err) end
end

local outs = {}
for i, m in ipairs(runs) do outs[i] = summary(m) end
if o.plot then plot(o.plot, outs) end

if o.json then
  if #outs == 1 then
    cli.print(json.encode(outs[1]))
  else
    local by = {}
    if #backends > 1 then
      for _, out in ipairs(outs) do by[out.backend .. "/" .. out.kv_type] = out end
      cli.print(json.encode { by_backend_kv = by })
    else
      for _, out in ipairs(outs) do by[out.kv_type] = out end
      cli.print(json.encode { by_kv = by })
    end
  end
else
  for i, out in ipairs(outs) do
    if i > 1 then cli.print("") end
    print_table(out)
  end
  if o.plot then cli.print("plot written to " .. o.plot) end
end
cli.exit(0)
