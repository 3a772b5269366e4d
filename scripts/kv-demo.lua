#!/usr/bin/env lua5.4
-- scripts/kv-demo.lua — why the second token is faster.
--
-- Generates N tokens twice from the same prompt:
--   cached:     prefill the prompt once (the first token: TTFT), then one
--               decode step per token, each reading the K/V of every
--               earlier position from the cache;
--   recomputed: no cache kept between tokens: for every token the session
--               is emptied and the prompt plus all tokens so far are
--               prefilled again.
-- Both runs process the same token sequence (the greedy continuation of
-- the cached run), so only the way of computing differs. Prints the time
-- of every token and the running total for both; --plot FILE draws both
-- curves (cumulative time, time per token) into a PNG.
--
-- Times are the engine's own (monotonic clock around each forward pass).
local usage = [[
usage: lua5.4 scripts/kv-demo.lua [options]
  --model PATH      GGUF file (default: SmolLM2-135M-Instruct, fetched and cached)
  --prompt TEXT     the prompt (default: a sentence about the Lua language)
  --tokens N        tokens to generate (default 64)
  --threads N       CPU threads (default: physical cores)
  --plot FILE       write a PNG of both curves (e.g. docs/kv-demo.png)
  --json            print the figures as one JSON object
]]
local common = dofile((arg[0]:match("^(.*)/") or ".") .. "/common.lua")
local o = common.parse(arg, {
  model = "", prompt = "Lua is a lightweight scripting language designed in Brazil in 1993. Its main ideas are",
  tokens = 64, threads = 0, plot = "", json = false,
}, usage)

local json = require "kvlua.json"
local n = math.tointeger(o.tokens)
if not n or n < 2 then common.die("option --tokens needs an integer of at least 2") end

local model = common.load(common.model_path(o.model), o.threads, o.backend, o.device)
local prompt = model:tokenize(o.prompt, { add_special = true })
local s = assert(model:session { ctx = #prompt + n + 8 })

-- Engine seconds of the session's last forward pass.
local function last_prefill(before)
  return s:stats().prefill_seconds - before
end
local function last_decode()
  local itl = s:stats().itl
  return itl[#itl]
end

-- warm-up: page the weights in
assert(s:prefill(prompt, { logits = "none" }))
s:rewind(s.pos)

-- ==== cached: prefill once, then decode ======================================

local function run_cached()
  local times, ids = {}, {}
  local before = s:stats().prefill_seconds
  local logits = assert(s:prefill(prompt))
  times[1] = last_prefill(before)
  ids[1] = logits:argmax()
  for k = 2, n do
    logits = assert(s:decode(ids[k - 1]))
    times[k] = last_decode()
    ids[k] = logits:argmax()
  end
  s:rewind(s.pos)
  return times, ids
end

-- ==== recomputed: the whole prefix again for every token =====================

local function run_recomputed(follow)
  local times, agree = {}, 0
  local seq = table.move(prompt, 1, #prompt, 1, {})
  for k = 1, n do
    s:rewind(s.pos)
    local before = s:stats().prefill_seconds
    local logits = assert(s:prefill(seq))
    times[k] = last_prefill(before)
    if logits:argmax() == follow[k] then agree = agree + 1 end
    seq[#seq + 1] = follow[k]
  end
  s:rewind(s.pos)
  return times, agree
end

local cached, ids = run_cached()
local recomputed, agree = run_recomputed(ids)

local function cumulative(t)
  local c, sum = {}, 0
  for i, v in ipairs(t) do
    sum = sum + v
    c[i] = sum
  end
  return c
end
local cum_c, cum_r = cumulative(cached), cumulative(recomputed)

-- ==== report =================================================================

local function ms(t)
  local out = {}
  for i, v in ipairs(t) do out[i] = v * 1e3 end
  return out
end

local result = {
  model = model.info.name, threads = model.info.threads, prompt_tokens = #prompt, tokens = n,
  text = model:detokenize(ids), same_argmax = agree, -- tokens where the recomputed argmax agrees
  cached = { ttft_ms = cached[1] * 1e3, decode_ms_mean = (cum_c[n] - cached[1]) / (n - 1) * 1e3,
    per_token_ms = ms(cached), cumulative_s = cum_c, total_s = cum_c[n] },
  recomputed = { ttft_ms = recomputed[1] * 1e3, last_ms = recomputed[n] * 1e3,
    per_token_ms = ms(recomputed), cumulative_s = cum_r, total_s = cum_r[n] },
  speedup = cum_r[n] / cum_c[n],
}

local function plot(path)
  local p = require "kvlua.plot"
  local fig = p.figure { width = 1100, height = 480, cols = 2, title = "Why the second token is faster: the KV cache",
    subtitle = string.format("%s, %d-token prompt, %d tokens generated greedily, %d threads (scripts/kv-demo.lua)",
      model.info.name, #prompt, n, model.info.threads) }
  local function points(t, scale)
    local pts = {}
    for i, v in ipairs(t) do pts[i] = { i, v * scale } end
    return pts
  end
  local left = fig:panel { title = "Time to generate the first k tokens", xlabel = "tokens generated (k)",
    ylabel = "seconds", xmin = 0 }
  left:line { points = points(cum_r, 1), color = "orange", label = "recomputing the prefix every token" }
  left:line { points = points(cum_c, 1), color = "blue", label = "with the KV cache" }
  left:vline { x = 1.5, label = "token 1: prefill (TTFT) | decode ->" }
  local right = fig:panel { title = "Time per token", xlabel = "token index", ylabel = "milliseconds", xmin = 0 }
  right:line { points = points(recomputed, 1e3), color = "orange", label = "recompute: prefill of prompt + k-1 tokens" }
  right:line { points = points(cached, 1e3), color = "blue", label = "cache: one decode step per token" }
  right:vline { x = 1.5, label = "token 1: prefill (TTFT) | decode ->" }
  local ok, err = fig:save(path)
  if not ok then common.die("cannot write the plot: " .. err) end
end

if o.plot ~= "" then plot(o.plot) end

if o.json then
  print(json.encode(result))
else
  print(string.format("model %s, %d threads; prompt %d tokens, %d tokens generated (greedy)",
    result.model, result.threads, #prompt, n))
  print(string.format("%5s  %-7s  %12s %12s  %12s %12s", "token", "phase", "cached ms", "total s",
    "recompute ms", "total s"))
  for k = 1, n do
    print(string.format("%5d  %-7s  %12.1f %12.3f  %12.1f %12.3f", k, k == 1 and "prefill" or "decode",
      cached[k] * 1e3, cum_c[k], recomputed[k] * 1e3, cum_r[k]))
  end
  print(string.format("TTFT %.1f ms (both); then %.1f ms per token with the cache, %.1f ms for the last "
    .. "token without; %d tokens in %.2f s vs %.2f s (%.1fx)", result.cached.ttft_ms, result.cached.decode_ms_mean,
    result.recomputed.last_ms, n, cum_c[n], cum_r[n], result.speedup))
  if o.plot ~= "" then print("plot written to " .. o.plot) end
end
