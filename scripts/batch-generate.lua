#!/usr/bin/env lua5.4
-- scripts/batch-generate.lua — JSONL prompts in, JSONL generations out.
--
-- Each input line is one JSON object:
--   {"id": "q1", "prompt": "Once upon a time"}                 raw text
--   {"id": "q2", "messages": [{"role": "user", "content": "Hi"}]}   chat (the model's template)
-- with optional per-item sampling: temp, top_k, top_p, min_p, repeat_penalty,
-- seed, max_tokens, stop (a string or an array of strings), logprobs (K,
-- as --logprobs; null or absent: the command line's), json_schema (a JSON
-- schema the text must follow: kvlua.json_schema; an object has no key
-- order here, so required properties come in "required" order, optional
-- ones by name), grammar (GBNF text the text must follow: kvlua.grammar;
-- not with json_schema). Options the
-- line leaves out come from the command line; the default seed of an item
-- is --seed plus its line number, so a sampled item gives the same text
-- whichever shard or batch runs it.
--
-- Each output line, in input order:
--   {"id": ..., "text": ..., "tokens": N, "prompt_tokens": N, "finish_reason": "eog"|"length"|"stop",
--    "ttft": seconds, "tokens_per_s": ...}
-- An item with a grammar may also end with "finish_reason": "grammar" and
-- "grammar_error": why (no token allowed, or max_tokens before the grammar
-- could end; its text is what the grammar took so far).
-- With logprobs (--logprobs K or the item's "logprobs": K), the line also
-- carries "logprobs" in the OpenAI completions shape, one entry per token:
--   {"tokens": [text...], "token_logprobs": [model log-prob...],
--    "top_logprobs": [{text: log-prob, ...} (the K best and the token)...],
--    "text_offset": [character offset from the prompt's start...], "token_ids": [...],
--    "sampler_logprobs": [log-prob under the sampler's distribution...],
--    "top_token_ids": [[the K best ids]...]}
-- (see kvlua.logprobs; a stop string's last tokens are listed too).
-- or, for an item that could not run (malformed JSON, no prompt, a bad
-- option or grammar, a prompt longer than the context):
--   {"id": ..., "line": N, "finish_reason": "error", "error": "message"}
-- (id is the item's "id", else its line number). Such items are also
-- reported on stderr with their line numbers; the others still run.
--
-- The items run through kvlua.scheduler: --batch sessions decode together,
-- new items are admitted as others finish, and prompts are prefilled in
-- chunks of --prefill-chunk tokens between decode steps.
--
-- Exit status: 0 when every item ran, 1 when some items failed or the
-- output could not be written, 2 when the run could not start (bad option,
-- missing model or input, empty file).
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local p = cli.parser("JSONL prompts in, JSONL generations out.")
p:str("--file", "PATH", 'input JSONL (one object per line: "prompt" or "messages", options)', nil, true)
p:str("--output", "PATH", "output JSONL (default: stdout)", nil, true)
p:model_options()
p:str("--shard", "i/n", "run only shard i of n (0-based, by line ranges; see README)", nil, true)
p:int("--batch", "N", "sessions generating together", 4, 1, 4096)
p:int("--prefill-chunk", "N", "prompt tokens prefilled per step, between decode steps; 0 = whole prompts",
  128, 0, cli.MAX_CTX)
p:int("--max-tokens", "N", "tokens per item at most", 128, 0, cli.MAX_CTX)
p:sampling_options { temp = 0.0, top_k = 40, top_p = 0.95, min_p = 0.05, repeat_penalty = 1.0, seed = 42 }
p:ctx_option(0, "prompt + max tokens")
p:kv("--kv", "K/V storage: f16, q8_0, q4_0, f32, or per layer 'q8_0,0=f16'", "f16")
p:flag("--ids", 'add the generated token ids ("ids") to each output line')
p:int("--logprobs", "K", 'add "logprobs" (OpenAI completions shape) with the K best alternatives per token',
  nil, 0, 1000)
p:flag("--no-timings", "leave ttft and tokens_per_s out (byte-identical outputs run to run)")
p:flag("--quiet", "no progress on stderr")
p:flag("--json", "print the run's summary as one JSON object on stdout (needs --output)")
local o = p:parse()

local json = require "kvlua.json"
local kvlua = require "kvlua"
local chat = require "kvlua.chat"
local sampling = require "kvlua.sampling"
local scheduler = require "kvlua.scheduler"
local progress = require "kvlua.progress"
local logprobs = require "kvlua.logprobs"

-- ==== options ================================================================

if not o.file then cli.die("missing --file PROMPTS.jsonl (--help lists the options)") end
if o.json and not o.output then
  cli.die("--json prints the summary on stdout: give --output PATH for the generations")
end
local shard = cli.shard(o.shard)
local batch, chunk, ctx = o.batch, o.prefill_chunk, o.ctx
local reader = cli.jsonl_input(o.file, "--file PROMPTS.jsonl", shard,
  function(line, msg) io.stderr:write(string.format("%s:%d: %s\n", o.file, line, msg)) end)

local model = cli.load(o)
cli.check_kv(model, o.kv, "--kv")
local out = cli.output(o.output)

-- ==== items → requests ======================================================

local SAMPLING_KEYS = { temp = "number", top_k = "integer", top_p = "number", min_p = "number",
  repeat_penalty = "number", seed = "integer", max_tokens = "integer", logprobs = "integer" }

-- A per-item option, type-checked (a finite number; max_tokens within the
-- engine's context); the command line's value when absent.
local function item_opt(item, key, default)
  local v = item[key]
  if v == nil or v == json.null then return default end
  local want = SAMPLING_KEYS[key]
  if type(v) ~= "number" or (want == "integer" and math.type(v) ~= "integer") or v ~= v
      or v == math.huge or v == -math.huge then
    error(string.format("%s must be %s", key, want == "integer" and "an integer" or "a finite number"), 0)
  end
  if key == "max_tokens" and (v < 0 or v > cli.MAX_CTX) then
    error(string.format("max_tokens must be in 0..%d", cli.MAX_CTX), 0)
  end
  if key == "logprobs" and (v < 0 or v > 1000) then error("logprobs must be in 0..1000", 0) end
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
    local ids, rerr = chat.encode(model, item.messages, { add_generation_prompt = true })
    if not ids then error("chat template: " .. rerr, 0) end
    return ids
  end
  error('the item needs "prompt" (a string) or "messages" (an array)', 0)
end

-- The scheduler request of one line (with .error when it cannot run).
local function request(line, item, bad)
  local id, id_err = cli.item_id(item, line)
  local req = { line = line, id = id }
  if not item then
    req.error = bad
    return req
  end
  if id_err then
    req.error = id_err
    io.stderr:write(string.format("%s:%d: %s\n", o.file, line, req.error))
    return req
  end
  local ok, e = pcall(function()
    req.prompt = item_prompt(item)
    req.max_tokens = item_opt(item, "max_tokens", o.max_tokens)
    req.stop = item_stop(item)
    if ctx == 0 and #req.prompt + req.max_tokens + 1 > cli.MAX_CTX then
      error(string.format("the prompt (%d tokens) and max_tokens (%d) need more than the largest context, %d tokens",
        #req.prompt, req.max_tokens, cli.MAX_CTX), 0)
    end
    req.logprobs = item_opt(item, "logprobs", o.logprobs)
    if req.logprobs then -- (text_offset counts from the prompt's start, as OpenAI's)
      req.prompt_text = type(item.prompt) == "string" and item.prompt
        or chat.render(model, item.messages, { add_generation_prompt = true })
    end
    req.sampler = sampling.from_opts {
      temp = item_opt(item, "temp", o.temp), top_k = item_opt(item, "top_k", o.top_k),
      top_p = item_opt(item, "top_p", o.top_p), min_p = item_opt(item, "min_p", o.min_p),
      repeat_penalty = item_opt(item, "repeat_penalty", o.repeat_penalty),
      seed = item_opt(item, "seed", o.seed + line),
    }
    if item.json_schema ~= nil and item.json_schema ~= json.null then
      local t = type(item.json_schema)
      if t ~= "table" and t ~= "string" and t ~= "boolean" then error("json_schema must be a JSON schema", 0) end
      local st, serr = sampling.json_schema(model, item.json_schema)
      if not st then error(serr, 0) end
      req.sampler = sampling.chain { st, table.unpack(req.sampler.stages) }
    end
    if item.grammar ~= nil and item.grammar ~= json.null then
      if type(item.grammar) ~= "string" then error("grammar must be GBNF text (a string)", 0) end
      if item.json_schema ~= nil and item.json_schema ~= json.null then
        error("give grammar or json_schema, not both", 0)
      end
      local g, gerr = kvlua.grammar(item.grammar)
      if not g then error("grammar: " .. gerr, 0) end
      req.grammar = g -- (the scheduler masks before the sampler and ends with "grammar")
    end
  end)
  if not ok then
    req.error = tostring(e):gsub("^[^\n:]*%.lua:%d+: ", "") -- (a module's position: not the item's business)
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
    finish_reason = r.finish_reason, grammar_error = r.grammar_error }
  if o.ids then rec.ids = json.array(r.ids) end
  if r.logprobs then
    rec.logprobs = logprobs.openai(r.logprobs, { null = json.null, array = json.array, prompt = req.prompt_text })
  end
  if not o.no_timings then
    rec.ttft = r.ttft
    rec.tokens_per_s = r.tokens_per_s
  end
  return rec
end

-- ==== the run =================================================================

local total = reader:count_items()
if total == 0 and not shard then
  cli.die(o.file .. ": no items (only blank lines; one JSON object per line expected)")
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
  out:write(json.encode(rec), "\n")
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
out:close()

local summary = {
  file = o.file, shard = shard and (shard.index .. "/" .. shard.count) or json.null,
  lines = { first = reader.first, last = math.max(reader.first - 1, reader.last) },
  items = stats.items, failed = stats.failed, tokens = stats.tokens,
  prefill_tokens = sch.prefill_tokens, decode_steps = sch.steps, seconds = sch.clock,
  tokens_per_s = sch.clock > 0 and stats.tokens / sch.clock or json.null,
  batch = batch, prefill_chunk = chunk,
  ttft_ms = { p50 = (cli.percentile(stats.ttft, 50) or 0) * 1e3, p90 = (cli.percentile(stats.ttft, 90) or 0) * 1e3 },
  itl_ms = { p50 = (cli.percentile(stats.itl, 50) or 0) * 1e3, p90 = (cli.percentile(stats.itl, 90) or 0) * 1e3,
    p99 = (cli.percentile(stats.itl, 99) or 0) * 1e3 },
  model = model.info.name, threads = model.info.threads,
}
bar:finish(string.format("%d items (%d failed), %d tokens in %.2f s of engine time (%.1f tok/s); "
  .. "TTFT p50 %.0f ms, ITL p50 %.1f ms p90 %.1f ms", stats.items, stats.failed, stats.tokens, sch.clock,
  sch.clock > 0 and stats.tokens / sch.clock or 0, summary.ttft_ms.p50, summary.itl_ms.p50, summary.itl_ms.p90))
if total == 0 then
  io.stderr:write(string.format("%s: shard %s has no items (lines %d..%d)\n", o.file, o.shard, reader.first, reader.last))
end
if o.json then cli.stdout:write(json.encode(summary), "\n") end
cli.exit(stats.failed > 0 and 1 or 0)
