#!/usr/bin/env lua5.4
-- scripts/bench.lua — prefill and decode speed of one model on this machine.
--
-- Measures, with the same token ids every run (a fixed pseudo-random
-- sequence): prefill tok/s for 128- and 512-token prompts (TTFT = time to
-- the first logits), decode tok/s after a context of 16, 512 and 1792
-- tokens, inter-token latency percentiles, peak RSS and KV-cache bytes.
-- Figures are medians over --reps repetitions. Compare against llama.cpp
-- with scripts/bench-compare.sh (side by side, interleaved).
local usage = [[
usage: lua5.4 scripts/bench.lua [--model PATH] [--threads N] [--reps N]
                                [--decode N] [--prefill 128,512] [--depth 16,512,1792]
                                [--kv f16|q8_0|f32] [--json]
]]
local common = dofile((arg[0]:match("^(.*)/") or ".") .. "/common.lua")
local o = common.parse(arg, {
  model = "", threads = 0, reps = 3, decode = 64, prefill = "128,512", depth = "16,512,1792", json = false,
  kv = "f16",
}, usage)

local function list(s)
  local t = {}
  for n in s:gmatch("%d+") do t[#t + 1] = math.tointeger(tonumber(n)) end
  return t
end

-- Lua has no wall clock finer than a second: timings come from the
-- session's stats, taken with a monotonic clock around each forward pass.

local model = common.load(common.model_path(o.model), o.threads)
local n_vocab = model.info.n_vocab
local max_depth = 0
for _, d in ipairs(list(o.depth)) do max_depth = math.max(max_depth, d) end
local prefills = list(o.prefill)
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

local function median(t)
  local c = {}
  for i, v in ipairs(t) do c[i] = v end
  table.sort(c)
  if #c == 0 then return nil end
  return #c % 2 == 1 and c[(#c + 1) // 2] or (c[#c // 2] + c[#c // 2 + 1]) / 2
end

local function pct(t, p)
  local c = {}
  for i, v in ipairs(t) do c[i] = v end
  table.sort(c)
  if #c == 0 then return nil end
  return c[math.max(1, math.ceil(p / 100 * #c))]
end

local result = {
  model = model.info.name, arch = model.info.arch, file_type = model.info.file_type,
  threads = model.info.threads, n_params = model.info.n_params, reps = o.reps,
  prefill = {}, decode = {}, ttft_ms = {},
}

local s = assert(model:session { ctx = ctx, ktype = o.kv, vtype = o.kv })
result.kv_bytes = model:kv_bytes { ctx = ctx, ktype = o.kv, vtype = o.kv }
-- warm-up (page in the weights)
s:prefill(ids(32, 7))
s:rewind(s.pos)

local itl_all = {}
for rep = 1, o.reps do
  -- new ids every repetition: the session's cache would reuse the pages of
  -- ids it has seen (prefix reuse), and this measures cold prefill
  for _, p in ipairs(prefills) do
    s:rewind(s.pos)
    local t0 = s:stats().prefill_seconds
    assert(s:prefill(ids(p, p + 7919 * rep)))
    local dt = s:stats().prefill_seconds - t0
    result.prefill[p] = result.prefill[p] or {}
    table.insert(result.prefill[p], p / dt)
    result.ttft_ms[p] = result.ttft_ms[p] or {}
    table.insert(result.ttft_ms[p], dt * 1e3)
  end
  for _, d in ipairs(list(o.depth)) do
    s:rewind(s.pos)
    local logits = assert(s:prefill(ids(d, d + 1)))
    local before = #s:stats().itl
    local toks = ids(math.tointeger(o.decode), d + 2)
    for i = 1, #toks do logits = assert(s:decode(toks[i])) end
    local itl = s:stats().itl
    local sum = 0
    for i = before + 1, #itl do
      sum = sum + itl[i]
      if d == list(o.depth)[1] then itl_all[#itl_all + 1] = itl[i] end
    end
    result.decode[d] = result.decode[d] or {}
    table.insert(result.decode[d], (#itl - before) / sum)
  end
end

local out = { model = result.model, arch = result.arch, threads = result.threads,
  kv_bytes = result.kv_bytes, kv_type = o.kv, ctx = ctx, peak_rss = common.peak_rss(),
  itl_ms = { p50 = pct(itl_all, 50) * 1e3, p90 = pct(itl_all, 90) * 1e3, p99 = pct(itl_all, 99) * 1e3 } }
out.prefill_tps, out.decode_tps, out.ttft_ms = {}, {}, {}
for k, v in pairs(result.prefill) do out.prefill_tps[tostring(k)] = median(v) end
for k, v in pairs(result.ttft_ms) do out.ttft_ms[tostring(k)] = median(v) end
for k, v in pairs(result.decode) do out.decode_tps[tostring(k)] = median(v) end

local function keys(t)
  local k = {}
  for key in pairs(t) do k[#k + 1] = key end
  table.sort(k, function(a, b) return tonumber(a) < tonumber(b) end)
  return k
end

if o.json then
  local function enc(v)
    if type(v) == "table" then
      local parts = {}
      local ks = {}
      for k in pairs(v) do ks[#ks + 1] = k end
      table.sort(ks, function(a, b) return tostring(a) < tostring(b) end)
      for _, k in ipairs(ks) do parts[#parts + 1] = string.format("%q:%s", tostring(k), enc(v[k])) end
      return "{" .. table.concat(parts, ",") .. "}"
    elseif type(v) == "string" then
      return string.format("%q", v)
    elseif v == nil then
      return "null"
    else
      return string.format("%.6g", v)
    end
  end
  print(enc(out))
else
  print(string.format("model %s (%s), %d threads, KV %.1f MiB (%s) at ctx %d, peak RSS %.1f MiB",
    out.model, out.arch, out.threads, out.kv_bytes / 2 ^ 20, o.kv, ctx, (out.peak_rss or 0) / 2 ^ 20))
  for _, k in ipairs(keys(out.prefill_tps)) do
    print(string.format("prefill %5s tokens: %8.1f tok/s  (TTFT %.1f ms)", k, out.prefill_tps[k], out.ttft_ms[k]))
  end
  for _, k in ipairs(keys(out.decode_tps)) do
    print(string.format("decode at depth %5s: %8.1f tok/s", k, out.decode_tps[k]))
  end
  print(string.format("ITL p50 %.2f ms, p90 %.2f ms, p99 %.2f ms", out.itl_ms.p50, out.itl_ms.p90, out.itl_ms.p99))
end
