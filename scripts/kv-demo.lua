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
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local p = cli.parser("Why the second token is faster: generation with the KV cache against recomputing the prefix.")
p:model_options()
p:str("--prompt", "TEXT", "the prompt (default: a sentence about the Lua language)",
  nil, true)
p:int("--tokens", "N", "tokens to generate", 64, 2, 1 << 16)
p:str("--plot", "FILE", "write a PNG of both curves (e.g. docs/kv-demo.png)", nil, true)
p:flag("--json", "print the figures as one JSON object")
local o = p:parse()
o.prompt = o.prompt or "Lua is a lightweight scripting language designed in Brazil in 1993. Its main ideas are"

local kvlua = require "kvlua"
local json = require "kvlua.json"
local n = o.tokens

local model = cli.load(o)
local prompt = model:tokenize(o.prompt, { add_special = true })
-- The session draws its pages from a cache without prefix reuse: otherwise
-- the recomputed run, which rewinds and prefills the same tokens again,
-- would get every full page of them back from the cache instead of
-- computing it (and the baseline would not be one).
local ctx = #prompt + n + 8
local cache, cerr = kvlua.cache(model, { pages = (ctx + 15) // 16 + 2, page_tokens = 16, prefix = false })
if not cache then cli.die(cerr, 1) end
local s, serr = model:session { ctx = ctx, cache = cache }
if not s then cli.die(serr, 1) end

-- v, or exit 1 with the message of a failed forward pass.
local function must(v, err)
  if not v then cli.die(err, 1) end
  return v
end

-- Engine seconds of the session's last forward pass.
local function last_prefill(before)
  return s:stats().prefill_seconds - before
end
local function last_decode()
  local itl = s:stats().itl
  return itl[#itl]
end

-- warm-up: page the weights in
must(s:prefill(prompt, { logits = "none" }))
s:rewind(s.pos)

-- ==== cached: prefill once, then decode ======================================

local function run_cached()
  local times, ids = {}, {}
  local before = s:stats().prefill_seconds
  local logits = must(s:prefill(prompt))
  times[1] = last_prefill(before)
  ids[1] = logits:argmax()
  for k = 2, n do
    logits = must(s:decode(ids[k - 1]))
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
    local logits = must(s:prefill(seq))
    times[k] = last_prefill(before)
    if logits:argmax() == follow[k] then agree = agree + 1 end
    seq[#seq + 1] = follow[k]
  end
  s:rewind(s.pos)
  return times, agree
end

local reused_before = s:stats().reused_tokens
local cached, ids = run_cached()
local recomputed, agree = run_recomputed(ids)
-- every position computed in both runs: none taken from the cache
local reused = s:stats().reused_tokens - reused_before
if reused ~= 0 then cli.die(string.format("%d tokens were reused from the cache: not a recomputation", reused), 1) end

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
  reused_tokens = reused, -- positions taken from the cache instead of computed (0)
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
  if not ok then cli.die("cannot write the plot: " .. err, 1) end
end

if o.plot then plot(o.plot) end

if o.json then
  cli.print(json.encode(result))
else
  cli.print(string.format("model %s, %d threads; prompt %d tokens, %d tokens generated (greedy)",
    result.model, result.threads, #prompt, n))
  cli.print(string.format("%5s  %-7s  %12s %12s  %12s %12s", "token", "phase", "cached ms", "total s",
    "recompute ms", "total s"))
  for k = 1, n do
    cli.print(string.format("%5d  %-7s  %12.1f %12.3f  %12.1f %12.3f", k, k == 1 and "prefill" or "decode",
      cached[k] * 1e3, cum_c[k], recomputed[k] * 1e3, cum_r[k]))
  end
  cli.print(string.format("TTFT %.1f ms (both); then %.1f ms per token with the cache, %.1f ms for the last "
    .. "token without; %d tokens in %.2f s vs %.2f s (%.1fx)", result.cached.ttft_ms, result.cached.decode_ms_mean,
    result.recomputed.last_ms, n, cum_c[n], cum_r[n], result.speedup))
  if o.plot then cli.print("plot written to " .. o.plot) end
end
cli.exit(0)
