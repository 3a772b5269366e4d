#!/usr/bin/env lua5.4
-- scripts/batch-generate.lua — JSONL prompts in, JSONL generations out.
--
-- Each input line is one JSON object:
--   {"id": "q1", "prompt": "Once upon a time"}                 raw text
--   {"id": "q2", "messages": [{"role": "user", "content": "Hi"}]}   chat (the model's template)
-- with optional per-item sampling: temp, top_k, top_p, min_p, repeat_penalty,
-- seed, max_tokens, stop (a string or an array of strings). Options the
-- line leaves out come from the command line; the default seed of an item
-- is --seed plus its line number, so a sampled item gives the same text
-- whichever shard or batch runs it.
--
-- Each output line, in input order:
--   {"id": ..., "text": ..., "tokens": N, "prompt_tokens": N, "finish_reason": "eog"|"length"|"stop",
--    "ttft": seconds, "tokens_per_s": ...}
-- or, for an item that could not run (malformed JSON, no prompt, a bad
-- option, a prompt longer than the context):
--   {"id": ..., "line": N, "finish_reason": "error", "error": "message"}
-- (id is the item's "id", else its line number). Such items are also
-- reported on stderr with their line numbers; the others still run.
--
-- The items run through kvlua.scheduler: --batch sessions decode together,
-- new items are admitted as others finish, and prompts are prefilled in
-- chunks of --prefill-chunk tokens between decode steps.
--
-- Exit status: 0 when every item ran, 1 when some items failed, 2 when
-- the run could not start (bad option, missing model or input, empty file).
local usage = [[
usage: lua5.4 scripts/batch-generate.lua --file PROMPTS.jsonl [options]
  --file PATH          input JSONL (one object per line: "prompt" or "messages", options)
  --output PATH        output JSONL (default: stdout)
  --model PATH         GGUF file (default: SmolLM2-135M-Instruct, fetched and cached)
  --shard i/n          run only shard i of n (0-based, by line ranges; see README)
  --batch N            sessions generating together (default 4)
  --prefill-chunk N    prompt tokens prefilled per step, between decode steps; 0 = whole prompts (default 128)
  --max-tokens N       (default 128)     --temp T (default 0: greedy)
  --top-k K (40)  --top-p P (0.95)  --min-p P (0.05)  --repeat-penalty R (1.0)  --seed N (42)
  --ctx N              context per session (default: prompt + max tokens)
  --kv TYPE            K/V storage: f16 (default), q8_0, f32
  --threads N          CPU threads (default: physical cores)
  --ids                add the generated token ids ("ids") to each output line
  --no-timings         leave ttft and tokens_per_s out (byte-identical outputs run to run)
  --quiet              no progress on stderr
  --json               print the run's summary as one JSON object on stdout (needs --output)
]]
local common = dofile((arg[0]:match("^(.*)/") or ".") .. "/common.lua")
local o = common.parse(arg, {
  file = "", output = "", model = "", shard = "", batch = 4, ["prefill-chunk"] = 128,
  ["max-tokens"] = 128, temp = 0.0, ["top-k"] = 40, ["top-p"] = 0.95, ["min-p"] = 0.05,
  ["repeat-penalty"] = 1.0, seed = 42, ctx = 0, kv = "f16", threads = 0, ids = false,
  ["no-timings"] = false, quiet = false, json = false,
}, usage)

local json = require "kvlua.json"
local jsonl = require "kvlua.jsonl"
local chat = require "kvlua.chat"
local sampling = require "kvlua.sampling"
local scheduler = require "kvlua.scheduler"
local progress = require "kvlua.progress"

-- ==== options ================================================================

local function positive_int(name)
  local v = math.tointeger(o[name])
  if not v or v < 0 then common.die("option --" .. name .. " needs a non-negative integer\n" .. usage) end
  return v
end

if o.file == "" and o._[1] then o.file = o._[1] end
if o.file == "" then common.die("missing --file PROMPTS.jsonl\n" .. usage) end
if o.json and o.output == "" then
  common.die("--json prints the summary on stdout: give --output PATH for the generations")
end
local shard = common.shard(o.shard)
local batch, chunk = positive_int("batch"), positive_int("prefill-chunk")
if batch < 1 then common.die("option --batch needs at least 1") end
local ctx = positive_int("ctx")
local reader = common.jsonl_input(o.file, "--file PROMPTS.jsonl", shard,
  function(line, msg) io.stderr:write(string.format("%s:%d: %s\n", o.file, line, msg)) end)

local model = common.load(common.model_path(o.model), o.threads, o.backend, o.device)

local out, err = io.stdout, nil
if o.output ~= "" then
  out, err = io.open(o.output, "wb")
  if not out then common.die("cannot write " .. err) end
end

-- ==== items → requests ======================================================

local SAMPLING_KEYS = { temp = "number", top_k = "integer", top_p = "number", min_p = "number",
  repeat_penalty = "number", seed = "integer", max_tokens = "integer" }

-- A per-item option, type-checked; the command line's value when absent.
local function item_opt(item, key, default)
  local v = item[key]
  if v == nil or v == json.null then return default end
  local want = SAMPLING_KEYS[key]
  if type(v) ~= "number" or (want == "integer" and math.type(v) ~= "integer") then
    error(string.format("%s must be %s", key, want == "integer" and "an integer" or "a number"), 0)
  end
  return v
end

local function item_stop(item)
  local stop = item.stop
  if stop == nil or stop == json.null then return {} end
  if type(stop) == "string" then stop = { stop } end
  if type(stop) ~= "table" then error("stop must be a string or an array of strings", 0) end
  for _, s in ipairs(stop) do
    if type(s) ~= "string" or s == "" then error("stop must hold non-empty strings", 0) end
  end
  return stop
end

local function item_prompt(item)
  if type(item.prompt) == "string" then
    return model:tokenize(item.prompt, { add_special = true, parse_special = false })
  elseif type(item.messages) == "table" then
    for _, m in ipairs(item.messages) do
      if type(m) ~= "table" or type(m.role) ~= "string" or type(m.content) ~= "string" then
        error("messages must be objects with string role and content", 0)
      end
    end
    local text, rerr = chat.render(model, item.messages, { add_generation_prompt = true })
    if not text then error("chat template: " .. rerr, 0) end
    return model:tokenize(text, { add_special = true, parse_special = true })
  end
  error('the item needs "prompt" (a string) or "messages" (an array)', 0)
end

-- The scheduler request of one line (with .error when it cannot run).
local function request(line, item, bad)
  local req = { line = line, id = item and item.id ~= json.null and item.id or line }
  if not item then
    req.error = bad
    return req
  end
  local ok, e = pcall(function()
    req.prompt = item_prompt(item)
    req.max_tokens = item_opt(item, "max_tokens", math.tointeger(o["max-tokens"]))
    req.stop = item_stop(item)
    req.sampler = sampling.from_opts {
      temp = item_opt(item, "temp", o.temp), top_k = item_opt(item, "top_k", math.tointeger(o["top-k"])),
      top_p = item_opt(item, "top_p", o["top-p"]), min_p = item_opt(item, "min_p", o["min-p"]),
      repeat_penalty = item_opt(item, "repeat_penalty", o["repeat-penalty"]),
      seed = item_opt(item, "seed", math.tointeger(o.seed) + line),
    }
  end)
  if not ok then
    req.error = tostring(e)
    io.stderr:write(string.format("%s:%d: %s\n", o.file, line, req.error))
  end
  return req
end

-- ==== results → output lines ==================================================

local function record(r)
  local req = r.request
  local reason, msg = r.finish_reason:match("^(error): (.*)$")
  if reason then
    return { id = req.id, line = req.line, finish_reason = "error", error = msg }
  end
  local rec = { id = req.id, text = r.text, tokens = #r.ids, prompt_tokens = r.prompt_tokens,
    finish_reason = r.finish_reason }
  if o.ids then rec.ids = json.array(r.ids) end
  if not o["no-timings"] then
    rec.ttft = r.ttft
    rec.tokens_per_s = r.tokens_per_s
  end
  return rec
end

-- ==== the run =================================================================

local total = reader:count_items()
if total == 0 and not shard then
  common.die(o.file .. ": no items (only blank lines; one JSON object per line expected)")
end
local bar = progress.new { total = total, label = "items", mode = o.quiet and "off" or nil }
local sch = scheduler.new(model, { batch = batch, prefill_chunk = chunk, ctx = ctx > 0 and ctx or nil,
  ktype = o.kv, vtype = o.kv })

local items = reader:items()
local stats = { items = 0, failed = 0, tokens = 0, ttft = {}, itl = {} }

local function next_request()
  local line, item, bad = items()
  if line then return request(line, item, bad) end
end

local function sink(r)
  local rec = record(r)
  jsonl.write(out, rec)
  stats.items = stats.items + 1
  if rec.error then
    stats.failed = stats.failed + 1
    if not r.request.error then
      io.stderr:write(string.format("%s:%d: %s\n", o.file, r.request.line, rec.error))
    end
  else
    stats.tokens = stats.tokens + rec.tokens
    if r.ttft then stats.ttft[#stats.ttft + 1] = r.ttft end
    table.move(r.itl, 1, #r.itl, #stats.itl + 1, stats.itl)
  end
  bar:update(stats.items, sch.clock > 0 and string.format("%.1f tok/s", stats.tokens / sch.clock) or nil)
end

sch:run(next_request, sink)
out:flush()
if out ~= io.stdout then out:close() end

local summary = {
  file = o.file, shard = shard and (shard.index .. "/" .. shard.count) or json.null,
  lines = { first = reader.first, last = math.max(reader.first - 1, reader.last) },
  items = stats.items, failed = stats.failed, tokens = stats.tokens,
  prefill_tokens = sch.prefill_tokens, decode_steps = sch.steps, seconds = sch.clock,
  tokens_per_s = sch.clock > 0 and stats.tokens / sch.clock or json.null,
  batch = batch, prefill_chunk = chunk,
  ttft_ms = { p50 = (common.percentile(stats.ttft, 50) or 0) * 1e3, p90 = (common.percentile(stats.ttft, 90) or 0) * 1e3 },
  itl_ms = { p50 = (common.percentile(stats.itl, 50) or 0) * 1e3, p90 = (common.percentile(stats.itl, 90) or 0) * 1e3,
    p99 = (common.percentile(stats.itl, 99) or 0) * 1e3 },
  model = model.info.name, threads = model.info.threads,
}
bar:finish(string.format("%d items (%d failed), %d tokens in %.2f s of engine time (%.1f tok/s); "
  .. "TTFT p50 %.0f ms, ITL p50 %.1f ms p90 %.1f ms", stats.items, stats.failed, stats.tokens, sch.clock,
  sch.clock > 0 and stats.tokens / sch.clock or 0, summary.ttft_ms.p50, summary.itl_ms.p50, summary.itl_ms.p90))
if total == 0 then
  io.stderr:write(string.format("%s: shard %s has no items (lines %d..%d)\n", o.file, o.shard, reader.first, reader.last))
end
if o.json then print(json.encode(summary)) end
os.exit(stats.failed > 0 and 1 or 0)
