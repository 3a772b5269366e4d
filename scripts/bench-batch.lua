#!/usr/bin/env lua5.4
-- scripts/bench-batch.lua — what batching buys: decode throughput of N
-- sessions through kvlua.decode_batch against one session decoding alone,
-- and kvlua.scheduler's latencies with a mix of long and short prompts,
-- with and without chunked prefill.
--
-- 1. Batched decode. N sessions (forks of prompts of --depth tokens, one
--    per session) decode --steps tokens in one forward pass a step; one
--    session decodes alone. The two take turns step by step, so both see
--    the same machine: compare them as a ratio. tok/s = tokens / engine
--    seconds (s:stats().itl: the monotonic time of each forward pass); the
--    wall speedup times the whole calls (kvlua.clock), Logits objects too.
-- 2. The scheduler. --requests requests, every fourth a --long prompt, the
--    others --short ones, each generating a different number of tokens
--    (--max-tokens at most, EOG ignored) with --batch sessions at once: once
--    with whole prompts prefilled in a step (prefill chunk 0), once with
--    --prefill-chunk tokens a step between decode steps. TTFT (admission to
--    first token) and ITL percentiles in engine time; with whole prompts a
--    long prompt's prefill stalls every session decoding beside it.
--
-- Prompts are fixed pseudo-random ids: the same figures' work every run.
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local LIM = 1 << 20
local p = cli.parser("What batching buys: batched decode against one session, and the scheduler's latencies.")
p:model_options()
p:list("--n", "LIST", "batch sizes of the decode comparison", "1,2,4,8,16",
  function(s) return cli.integer(s, 1, 4096) end)
p:int("--steps", "N", "decode steps per batch size", 16, 1, LIM)
p:int("--depth", "N", "prompt tokens in each session before decoding", 64, 1, LIM)
p:int("--requests", "N", "scheduler requests (every fourth is long)", 24, 1, LIM)
p:int("--long", "N", "long prompt tokens", 384, 1, LIM)
p:int("--short", "N", "short prompt tokens", 16, 1, LIM)
p:int("--max-tokens", "N", "most tokens a request generates", 24, 1, LIM)
p:int("--batch", "N", "scheduler sessions at once", 8, 1, 4096)
p:int("--prefill-chunk", "N", "prompt tokens a step in the chunked run", 64, 1, LIM)
p:flag("--json", "print the figures as one JSON object")
local o = p:parse()

local kvlua = require "kvlua"
local json = require "kvlua.json"
local scheduler = require "kvlua.scheduler"

local steps, depth = o.steps, o.depth
local n_requests, long, short = o.requests, o.long, o.short
local max_tokens, batch, chunk = o.max_tokens, o.batch, o.prefill_chunk
local sizes = o.n

local model = cli.load(o)
local n_vocab = model.info.n_vocab

-- fixed pseudo-random ids (xorshift), past the first ids (often control tokens)
local function ids(n, seed)
  local t, x = {}, seed * 2654435761 + 88172645463325252
  local low = n_vocab > 1024 and 256 or 0
  for i = 1, n do
    x = x ~ (x << 13); x = x ~ (x >> 7); x = x ~ (x << 17)
    t[i] = math.tointeger((x >> 1) % (n_vocab - low)) + low
  end
  return t
end

local function must(v, err)
  if not v then cli.die("kvlua: " .. tostring(err), 1) end
  return v
end

-- ==== 1. batched decode against one session =================================

local function last_itl(s)
  local itl = s:stats().itl
  return itl[#itl]
end

-- Sessions prefilled with a prompt each (forked for every measurement).
local function base_sessions(n)
  local cache = must(kvlua.cache(model, { pages = 4 * n * ((depth + steps * (#sizes + 1)) // 16 + 2) }))
  local bases = {}
  for i = 1, n do
    bases[i] = must(model:session { ctx = depth + steps + 1, cache = cache })
    must(bases[i]:prefill(ids(depth, i), { logits = "none" }))
  end
  return bases
end

-- tok/s of n sessions decoding together and of one decoding alone, turn by turn.
local function compare(bases, n)
  local group, feed = {}, {}
  for i = 1, n do group[i] = must(bases[i]:fork()) end
  local alone = must(bases[1]:fork())
  local next_ids = ids(steps * (n + 1), 1000 + n)
  local t_alone, t_batch, w_alone, w_batch = 0, 0, 0, 0
  for k = 1, steps do
    local base = (k - 1) * (n + 1)
    local w0 = kvlua.clock()
    must(alone:decode(next_ids[base + 1]))
    local w1 = kvlua.clock()
    t_alone, w_alone = t_alone + last_itl(alone), w_alone + (w1 - w0)
    for i = 1, n do feed[i] = next_ids[base + 1 + i] end
    w0 = kvlua.clock()
    must(kvlua.decode_batch(group, feed))
    w1 = kvlua.clock()
    t_batch, w_batch = t_batch + last_itl(group[1]), w_batch + (w1 - w0)
  end
  alone:close()
  for _, s in ipairs(group) do s:close() end
  local alone_tps, batch_tps = steps / t_alone, n * steps / t_batch
  return { n = n, alone_tps = alone_tps, batch_tps = batch_tps, speedup = batch_tps / alone_tps,
    step_ms = t_batch / steps * 1e3, wall_speedup = (n * steps / w_batch) / (steps / w_alone) }
end

local widest = 0
for _, n in ipairs(sizes) do widest = math.max(widest, n) end
local bases = base_sessions(widest)
local rows = {}
for _, n in ipairs(sizes) do rows[#rows + 1] = compare(bases, n) end
for _, s in ipairs(bases) do s:close() end

-- ==== 2. the scheduler, long and short prompts ================================

local function requests()
  local list = {}
  for i = 1, n_requests do
    local is_long = i % 4 == 0
    list[i] = { prompt = ids(is_long and long or short, 5000 + i), long = is_long, ignore_eog = true,
      max_tokens = 1 + (i * 7) % max_tokens }
  end
  return list
end

local function ms_percentiles(xs, ps)
  local t = {}
  for _, p in ipairs(ps) do t["p" .. p] = (cli.percentile(xs, p) or 0) * 1e3 end
  return t
end

local function schedule(prefill_chunk)
  local list, k = requests(), 0
  local sch = scheduler.new(model, { batch = batch, prefill_chunk = prefill_chunk })
  local ttft, ttft_short, ttft_long, itl, tokens = {}, {}, {}, {}, 0
  sch:run(function()
    k = k + 1
    return list[k]
  end, function(r)
    if r.finish_reason:find("^error") then cli.die("scheduler: " .. r.finish_reason, 1) end
    ttft[#ttft + 1] = r.ttft
    local side = r.request.long and ttft_long or ttft_short
    side[#side + 1] = r.ttft
    table.move(r.itl, 1, #r.itl, #itl + 1, itl)
    tokens = tokens + #r.ids
  end)
  return { prefill_chunk = prefill_chunk, ttft_ms = ms_percentiles(ttft, { 50, 90 }),
    ttft_short_ms = ms_percentiles(ttft_short, { 50, 90 }), ttft_long_ms = ms_percentiles(ttft_long, { 50, 90 }),
    itl_ms = ms_percentiles(itl, { 50, 90, 99 }), itl_max_ms = (cli.percentile(itl, 100) or 0) * 1e3,
    tokens = tokens, seconds = sch.clock, tokens_per_s = tokens / sch.clock, steps = sch.steps }
end

local runs = { schedule(0), schedule(chunk) }

-- ==== report =================================================================

local result = {
  model = model.info.name, threads = model.info.threads,
  decode = { depth = depth, steps = steps, rows = rows },
  scheduler = { requests = n_requests, long = long, short = short, max_tokens = max_tokens, batch = batch,
    runs = runs },
}
if o.json then
  cli.print(json.encode(result))
  cli.exit(0)
end

cli.print(string.format("%s, %d threads; engine time, ratios within this run\n", result.model, result.threads))
cli.print(string.format("batched decode: %d steps after %d-token prompts", steps, depth))
cli.print(string.format("%4s  %12s  %12s  %8s  %9s  %13s", "N", "alone tok/s", "batch tok/s", "speedup", "step ms",
  "wall speedup"))
for _, r in ipairs(rows) do
  cli.print(string.format("%4d  %12.1f  %12.1f  %7.2fx  %9.1f  %12.2fx", r.n, r.alone_tps, r.batch_tps, r.speedup,
    r.step_ms, r.wall_speedup))
end
cli.print("(wall: the calls' whole time, with the Logits objects the binding makes)")
cli.print(string.format("\nscheduler: %d requests (every 4th %d tokens, the others %d), batch %d, up to %d tokens each",
  n_requests, long, short, batch, max_tokens))
cli.print(string.format("%-14s  %9s %9s %9s %9s  %8s %8s %8s %8s  %7s", "prefill chunk", "TTFT p50", "p90",
  "short p90", "long p50", "ITL p50", "p90", "p99", "max", "tok/s"))
for _, r in ipairs(runs) do
  cli.print(string.format("%-14s  %9.0f %9.0f %9.0f %9.0f  %8.1f %8.1f %8.1f %8.1f  %7.1f",
    r.prefill_chunk == 0 and "whole prompts" or tostring(r.prefill_chunk), r.ttft_ms.p50, r.ttft_ms.p90,
    r.ttft_short_ms.p90, r.ttft_long_ms.p50, r.itl_ms.p50, r.itl_ms.p90, r.itl_ms.p99, r.itl_max_ms, r.tokens_per_s))
end
cli.print("(milliseconds of engine time)")
cli.exit(0)
