#!/usr/bin/env lua5.4
-- scripts/bench-score.lua — multiple-choice scoring throughput, side by side:
-- kvlua's mc-eval (shared prefixes from the cache, choices on forks, rows of
-- many sessions in each forward pass through kvlua.prefill_batch) against
-- llama.cpp scoring one request per context+choice (llama-cpp-python, as
-- lm-evaluation-harness's llama.cpp backend does), and the same model's
-- prefill tok/s in the same run.
--
-- Items are generated here: few-shot arithmetic questions, --shots solved
-- examples shared by every item, then the item's question, with --choices
-- numbers to choose from (one right). Both engines score the same token
-- ids (kvlua's tokenization), so their accuracies must be equal.
--
-- Figures: items/s (items / wall time of the scoring loop), computed tok/s
-- (mc-eval: tokens the engine computed / engine seconds; llama.cpp: tokens
-- evaluated / scoring seconds), prefill tok/s (one session prefilling
-- --prefill tokens of the items' text, logits of the last row; median of 3,
-- before and after mc-eval), and their ratio. llama.cpp scores the first
-- --llama-items items (it is slow: every request from scratch); the accuracies
-- of both on those items are compared. The llama.cpp side needs
-- python3 with llama_cpp (pip install llama-cpp-python); --llama off, or a
-- python without it, leaves that side out.
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local p = cli.parser("Multiple-choice scoring throughput: mc-eval against per-request llama.cpp scoring.")
p:model_options()
p:int("--items", "N", "generated items", 64, 1, 1 << 20)
p:int("--shots", "N", "solved examples shared by every item", 5, 0, 64)
p:int("--choices", "N", "choices per item", 4, 2, 8)
p:int("--batch", "N", "mc-eval's --batch (items in flight together)", 32, 1, 65536)
p:int("--prefill", "N", "tokens of the prefill measurement", 512, 16, 1 << 16)
p:int("--seed", "N", "item generator seed", 1, 0, 1 << 30)
p:int("--llama-items", "N", "items llama.cpp scores (the first N; 0: all)", 16, 0, 1 << 20)
p:choice("--llama", { "auto", "off" }, "score with llama.cpp too (auto: when python3 imports llama_cpp)", "auto")
p:str("--mc-eval", "PATH", "the mc-eval script to time (another version's, to compare)", nil, true)
p:str("--python", "PATH", "python interpreter for the llama.cpp side", "python3", true)
p:flag("--json", "print the figures as one JSON object")
local o = p:parse()

local kvlua = require "kvlua"
local json = require "kvlua.json"

local function shell_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local function write_file(path, text)
  local f = assert(io.open(path, "wb"))
  assert(f:write(text))
  assert(f:close())
end

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

-- ==== items ==================================================================

local seed = o.seed * 2654435761 + 12345
local function rand(n) -- 1..n (an LCG: the same items every run)
  seed = (seed * 6364136223846793005 + 1442695040888963407) & 0x7fffffffffffffff
  return 1 + (seed >> 33) % n
end

local function question() -- sums a small model mostly gets right: wide margins between the choices
  local a, b = rand(30), rand(9)
  return string.format("Question: What is %d plus %d?\nAnswer:", a, b), a + b
end

local shots = {}
for i = 1, o.shots do
  local q, r = question()
  shots[i] = q .. " " .. r .. "\n\n"
end
local prefix = "Answer each question with a number.\n\n" .. table.concat(shots)

local items = {}
for i = 1, o.items do
  local q, r = question()
  local values, seen = { r }, { [r] = true }
  local deltas = { 1, -1, 2, -2, 10, -10, 3, 5, -3, 7 }
  for _, d in ipairs(deltas) do
    if #values == o.choices then break end
    local v = r + d * (rand(2) == 1 and 1 or rand(3))
    if not seen[v] then values[#values + 1], seen[v] = v, true end
  end
  for k = #values, 2, -1 do -- shuffle
    local j = rand(k)
    values[k], values[j] = values[j], values[k]
  end
  local choices, answer = {}, nil
  for k, v in ipairs(values) do
    choices[k] = " " .. v
    if v == r then answer = k - 1 end
  end
  items[i] = { id = "q" .. i, context = prefix .. q, choices = choices, answer = answer }
end

local items_path = os.tmpname()
do
  local lines = {}
  for i, it in ipairs(items) do
    lines[i] = json.encode { id = it.id, context = it.context, choices = json.array(it.choices), answer = it.answer }
  end
  write_file(items_path, table.concat(lines, "\n") .. "\n")
end

-- ==== prefill tok/s of the same model ========================================

o.model = cli.model_path(o.model)
local model = cli.load(o)
local text_ids = {}
while #text_ids < o.prefill do
  for _, it in ipairs(items) do
    for _, id in ipairs(model:tokenize(it.context, { add_special = false })) do text_ids[#text_ids + 1] = id end
    if #text_ids >= o.prefill then break end
  end
end
text_ids = table.move(text_ids, 1, o.prefill, 1, {})

local function prefill_rate()
  local rates = {}
  for r = 1, 3 do
    local s = assert(model:session { ctx = o.prefill })
    local t0 = kvlua.clock()
    assert(s:prefill(text_ids))
    rates[r] = o.prefill / (kvlua.clock() - t0)
    s:close()
  end
  table.sort(rates)
  return rates[2]
end

-- ==== the run ================================================================

local figures = { items = o.items, shots = o.shots, choices = o.choices, model = model.info.name,
  threads = model.info.threads }
figures.prefill_before = prefill_rate()

local out_path = os.tmpname()
local argv = { "lua5.4", o.mc_eval or root .. "/scripts/mc-eval.lua", "--file", items_path, "--out", out_path, "--json", "--quiet",
  "--batch", tostring(o.batch), "--model", o.model, "--threads", tostring(model.info.threads) }
if o.backend then argv[#argv + 1], argv[#argv + 2] = "--backend", o.backend end
if o.device then argv[#argv + 1], argv[#argv + 2] = "--device", tostring(o.device) end
for k, a in ipairs(argv) do argv[k] = shell_quote(a) end
local pipe = assert(io.popen(table.concat(argv, " ")))
local mc_text = pipe:read("a")
pipe:close()
local ok, mc = pcall(json.decode, mc_text)
if not ok or type(mc) ~= "table" or not mc.prefill_tokens then cli.die("mc-eval failed: " .. mc_text, 1) end
local records = {}
for line in (read_file(out_path) or ""):gmatch("[^\n]+") do records[#records + 1] = json.decode(line) end
os.remove(out_path)

figures.prefill_after = prefill_rate()
local prefill = (figures.prefill_before + figures.prefill_after) / 2
local computed = mc.prefill_tokens.computed
figures.kvlua = { correct = mc.correct, correct_norm = mc.correct_norm, accuracy = mc.accuracy,
  naive_tokens = mc.prefill_tokens.naive, computed_tokens = computed, engine_seconds = mc.seconds,
  wall_seconds = mc.wall_seconds, items_per_s = o.items / (mc.wall_seconds or mc.seconds), computed_tok_s = computed / mc.seconds,
  computed_tok_s_wall = computed / (mc.wall_seconds or mc.seconds) } -- (an mc-eval without wall_seconds: engine time)
figures.kvlua.of_prefill = figures.kvlua.computed_tok_s / prefill

-- ==== llama.cpp ==============================================================

local function llama_side()
  if o.llama == "off" then return nil, "off" end
  local py = shell_quote(o.python)
  if not os.execute(py .. " -c 'import llama_cpp' >/dev/null 2>&1") then
    return nil, o.python .. " cannot import llama_cpp (pip install llama-cpp-python)"
  end
  local job = { model = o.model, threads = model.info.threads, items = {} }
  local longest, n = 0, o.llama_items > 0 and math.min(o.llama_items, #items) or #items
  for i = 1, n do
    local it = items[i]
    local ctx = model:tokenize(it.context, { add_special = true, parse_special = false })
    local choices, chars = {}, {}
    for k, c in ipairs(it.choices) do
      choices[k] = json.array(model:tokenize(c, { add_special = false, parse_special = false }))
      chars[k] = utf8.len(c)
      longest = math.max(longest, #ctx + #choices[k])
    end
    job.items[i] = { context = json.array(ctx), choices = json.array(choices), chars = json.array(chars),
      answer = it.answer }
  end
  job.items = json.array(job.items)
  job.ctx = longest + 16
  local inp, outp = os.tmpname(), os.tmpname()
  write_file(inp, json.encode(job))
  local okrun = os.execute(table.concat({ py, shell_quote(root .. "/scripts/ref/llama_score.py"), shell_quote(inp),
    shell_quote(outp) }, " "))
  local text = read_file(outp)
  os.remove(inp)
  os.remove(outp)
  local okj, r = pcall(json.decode, text or "")
  if not okrun or not okj or type(r) ~= "table" or not r.seconds then return nil, "llama_score.py failed" end
  -- kvlua on the same items: predictions, accuracy, the largest score difference
  local differ, kc, kcn, maxdiff = 0, 0, 0, 0
  for i, pred in ipairs(r.predicted) do
    local rec = records[i]
    if rec.predicted ~= pred then differ = differ + 1 end
    if rec.correct then kc = kc + 1 end
    if rec.correct_norm then kcn = kcn + 1 end
    for k, x in ipairs(r.scores[i]) do maxdiff = math.max(maxdiff, math.abs(x - rec.scores[k])) end
  end
  return { items = n, correct = r.correct, correct_norm = r.correct_norm, tokens = r.tokens, seconds = r.seconds,
    items_per_s = n / r.seconds, tok_s = r.tokens / r.seconds, predictions_differ = differ,
    kvlua_correct = kc, kvlua_correct_norm = kcn, max_score_difference = maxdiff }
end
local llama, why = llama_side()
figures.llama = llama or json.null
if llama then figures.speedup_items = figures.kvlua.items_per_s / llama.items_per_s end

-- ==== report ===================================================================

if o.json then
  cli.stdout:write(json.encode(figures), "\n")
else
  local k = figures.kvlua
  cli.print(string.format("%d items, %d shots, %d choices; %s, %d threads", o.items, o.shots, o.choices,
    model.info.name, model.info.threads))
  cli.print(string.format("prefill: %.0f tok/s (before %.0f, after mc-eval %.0f)", prefill,
    figures.prefill_before, figures.prefill_after))
  cli.print(string.format("kvlua mc-eval: %.2f items/s; %d tokens computed of %d naive, %.0f tok/s engine time "
    .. "(%.0f%% of prefill), %.0f tok/s wall; accuracy %d/%d (norm %d/%d)", k.items_per_s, k.computed_tokens,
    k.naive_tokens, k.computed_tok_s, 100 * k.of_prefill, k.computed_tok_s_wall, k.correct, o.items, k.correct_norm,
    o.items))
  if llama then
    cli.print(string.format("llama.cpp per request (first %d items): %.3f items/s; %d tokens, %.0f tok/s; accuracy "
      .. "%d/%d (norm %d/%d), kvlua on them %d/%d (norm %d/%d); %d predictions differ; scores differ by %.2g at most",
      llama.items, llama.items_per_s, llama.tokens, llama.tok_s, llama.correct, llama.items, llama.correct_norm,
      llama.items, llama.kvlua_correct, llama.items, llama.kvlua_correct_norm, llama.items, llama.predictions_differ,
      llama.max_score_difference))
    cli.print(string.format("kvlua / llama.cpp: %.1fx items/s", figures.speedup_items))
  else
    cli.print("llama.cpp: skipped (" .. why .. ")")
  end
end
model:close()
os.remove(items_path)
cli.exit(0)
