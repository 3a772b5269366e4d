#!/usr/bin/env lua5.4
-- scripts/mc-eval.lua — multiple-choice accuracy by log-likelihood.
--
-- Each input line is one JSON object:
--   {"id": "paris", "context": "Question: What is the capital of France?\nAnswer:",
--    "choices": [" Berlin", " Paris", " Rome"], "answer": 1}
-- "answer" is the 0-based index of the right choice; "id" is optional (the
-- line number stands in). The context is tokenized with the model's
-- special tokens (BOS where the model adds one), each choice WITHOUT them,
-- and the choice's tokens are appended to the context's: the choice text is
-- used as given, so write the space that separates it from the context
-- into the choice (" Paris" after "Answer:"), as lm-evaluation-harness does.
--
-- A choice's score is the summed log-probability of its tokens given the
-- context and the choice tokens before them. The prediction is the choice
-- with the highest score (the first of equal ones), and three scores are
-- compared, as lm-evaluation-harness (0.4, lm_eval/api/task.py) does for
-- its metrics:
--   accuracy            acc:      the summed log-probability
--   accuracy_norm       acc_norm: divided by the choice's length in
--                       characters (Unicode code points; Python's len(choice))
--   accuracy_per_token  divided by the choice's token count (this script's
--                       earlier accuracy_norm; it depends on the tokenizer)
-- lm-eval counts a choice without its target delimiter (the " " it puts
-- before "Paris"); here the choice is counted as the item writes it, with
-- its leading space.
--
-- Sharing. The items of a batch (--batch N) are prefilled first, each in a
-- session drawn from one kvlua.cache, so a context prefix that earlier items
-- already computed (whole pages of it) is reused; then every choice is
-- scored on a s:fork() of its item's session: the fork shares the context's
-- pages and prefills only the choice. The first choice token's log-prob
-- comes from the context's last logits; the choice's last token is never fed
-- (nothing after it is scored), so a one-token choice needs no fork at all.
-- Batching. The first context of a batch is prefilled alone (so that the
-- prefix it shares with the others is cached), the others together in one
-- kvlua.prefill_batch; the forks of every choice of the batch go through
-- kvlua.prefill_batch too, about 128 choice tokens (one forward pass) at a
-- time: many tiny prefills become a few passes of many rows.
-- --no-cache scores every choice from scratch instead: a fresh session
-- without a cache prefills the context and the choice in one call and reads
-- every row. That is the scorer the saving is counted against:
--   naive    = sum over choices of (context tokens + choice tokens - 1)
--   computed = tokens the engine computed (s:stats(): prefill_tokens - reused_tokens)
--   saved    = naive - computed
--
-- Determinism: the scores are the same bits with and without the cache, for
-- any --batch, thread count and shard: the engine computes a position's
-- logits with the same arithmetic whatever the rows beside it, the split of
-- the ids into calls and whether its prefix was reused or forked.
--
-- Output: a summary on stdout (--json: as one JSON object), and with
-- --out FILE one line per item in input order:
--   {"id":, "answer":, "predicted":, "correct":, "predicted_norm":, "correct_norm":,
--    "predicted_per_token":, "correct_per_token":, "scores": [summed log-prob per choice],
--    "scores_norm": [per character], "scores_per_token": [per token], "tokens": [choice tokens],
--    "chars": [choice characters]}
-- or {"id":, "line":, "error": "message"} for an item that could not be
-- scored (malformed JSON, no choices, an answer out of range, a failing
-- prefill); such items are reported on stderr with their line numbers and
-- left out of the accuracy. --merge F1 F2 ... reads such files (the shards
-- of a run, in any order) and prints the summary of the whole.
--
-- Exit status: 0 when every item was scored, 1 when some were skipped (or
-- none could be) or the output could not be written, 2 when the run could
-- not start (bad option, missing model or input, empty file).
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local p = cli.parser("Multiple-choice accuracy by log-likelihood.")
p:str("--file", "PATH", 'items, one JSON object a line: {"context":, "choices": [...], "answer": 0-based index, "id":}',
  nil, true)
p:model_options()
p:str("--out", "PATH", "per-item results (JSONL: id, scores, predicted, correct, ...)", nil, true)
p:int("--batch", "N", "items whose contexts are in flight together", 8, 1, 65536)
p:flag("--no-cache", "score every choice from scratch (no shared cache, no forks): the same scores")
p:str("--shard", "i/n", "score only shard i of n (0-based, by line ranges; see README)", nil, true)
p:flag("--quiet", "no progress on stderr")
p:flag("--json", "print the summary as one JSON object on stdout")
p.ap:option("--merge", "print the summary of these per-item files of --out (the shards of a run)")
  :args("+"):argname("FILE")
local o = p:parse()

local json = require "kvlua.json"
local jsonl = require "kvlua.jsonl"
local progress = require "kvlua.progress"

local PAGE_TOKENS = 16 -- the cache's page size (tokens)

-- ==== summaries ==============================================================

local function fraction(n, d)
  return d > 0 and n / d or json.null
end

-- The accuracy part of a summary, from per-item records (those of --out).
-- The accuracy part of a summary, from per-item records (those of --out);
-- nil, message for a record without the fields of a scored item.
local function tally(records)
  local t = { total = 0, correct = 0, correct_norm = 0, correct_per_token = 0, skipped = 0 }
  for _, r in ipairs(records) do
    if r.error then
      t.skipped = t.skipped + 1
    elseif type(r.correct) ~= "boolean" or type(r.correct_norm) ~= "boolean"
        or type(r.correct_per_token) ~= "boolean" then
      return nil, "a record without correct, correct_norm and correct_per_token (not mc-eval's --out)"
    else
      t.total = t.total + 1
      if r.correct then t.correct = t.correct + 1 end
      if r.correct_norm then t.correct_norm = t.correct_norm + 1 end
      if r.correct_per_token then t.correct_per_token = t.correct_per_token + 1 end
    end
  end
  t.accuracy, t.accuracy_norm = fraction(t.correct, t.total), fraction(t.correct_norm, t.total)
  t.accuracy_per_token = fraction(t.correct_per_token, t.total)
  return t
end

local function accuracy_line(t)
  local function pct(x) return x == json.null and "n/a" or string.format("%.1f%%", 100 * x) end
  return string.format("accuracy %d/%d = %s (acc_norm, per character: %d/%d = %s; per token: %d/%d = %s)%s",
    t.correct, t.total, pct(t.accuracy), t.correct_norm, t.total, pct(t.accuracy_norm), t.correct_per_token,
    t.total, pct(t.accuracy_per_token), t.skipped > 0 and string.format("; %d items skipped", t.skipped) or "")
end

local function report(summary, text)
  cli.stdout:write(o.json and json.encode(summary) or text, "\n")
end

-- --merge: the summary of per-item files.
if o.merge then
  local records = {}
  for _, path in ipairs(o.merge) do
    local reader, err = jsonl.open(cli.input_file(path)) -- (an empty shard's file is empty)
    if not reader then cli.die("cannot read " .. err) end
    for line, rec, bad in reader:items() do
      if not rec then cli.die(string.format("%s:%d: %s", path, line, bad)) end
      records[#records + 1] = rec
    end
  end
  local t, terr = tally(records)
  if not t then cli.die(terr) end
  t.files = json.array(o.merge)
  report(t, accuracy_line(t))
  cli.exit(t.total > 0 and 0 or 1)
end

-- ==== options ================================================================

if not o.file then cli.die("missing --file ITEMS.jsonl (--help lists the options)") end
local batch = o.batch
local shard = cli.shard(o.shard)

local function complain(line, msg)
  io.stderr:write(string.format("%s:%d: %s\n", o.file, line, msg))
end
local reader = cli.jsonl_input(o.file, "--file ITEMS.jsonl", shard, complain)
if reader:count_items() == 0 and not shard then
  cli.die(o.file .. ": no items (only blank lines; one JSON object per line expected)")
end

local model = cli.load(o)
local out = o.out and cli.output(o.out)

-- ==== items → tasks ==========================================================

-- The context size an item's sessions need: its context and its longest choice.
local function session_ctx(t)
  local longest = 0
  for _, c in ipairs(t.choices) do longest = math.max(longest, #c) end
  return #t.context + longest
end

-- The task of a well-formed item: {line, id, context = ids, choices = {ids...}, answer = 1-based},
-- or raises a message.
local function task_of(line, item)
  local id, id_err = cli.item_id(item, line)
  if id_err then error(id_err, 0) end
  if type(item.context) ~= "string" then error('the item needs "context" (a string)', 0) end
  local choices = item.choices
  if type(choices) ~= "table" or not json.is_array(choices) or #choices == 0 then
    error('the item needs "choices" (a non-empty array of strings)', 0)
  end
  local answer = item.answer
  if math.type(answer) ~= "integer" or answer < 0 or answer >= #choices then
    local ok, shown = pcall(json.encode, answer) -- (1e400 has no JSON form)
    error(string.format('"answer" must be a 0-based index below %d (the number of choices), not %s',
      #choices, ok and shown or tostring(answer)), 0)
  end
  local t = { line = line, id = id, answer = answer + 1, choices = {}, chars = {},
    context = model:tokenize(item.context, { add_special = true, parse_special = false }) }
  if #t.context == 0 then error("the context has no tokens", 0) end
  for k, c in ipairs(choices) do
    if type(c) ~= "string" then error(string.format("choice %d is not a string", k - 1), 0) end
    t.chars[k] = utf8.len(c)
    if not t.chars[k] then error(string.format("choice %d is not valid UTF-8", k - 1), 0) end
    t.choices[k] = model:tokenize(c, { add_special = false, parse_special = false })
    if #t.choices[k] == 0 then error(string.format("choice %d has no tokens", k - 1), 0) end
  end
  if session_ctx(t) > cli.MAX_CTX then
    error(string.format("the context and the longest choice need more than the largest context, %d tokens",
      cli.MAX_CTX), 0)
  end
  return t
end

-- Every line of the shard, in order: tasks, or {line =, id =, error =}.
local function read_tasks()
  local tasks = {}
  for line, item, bad in reader:items() do
    local ok, t = true, nil
    if item then ok, t = pcall(task_of, line, item) end
    if not item or not ok then
      local msg = item and tostring(t) or bad
      if item then complain(line, msg) end -- (the reader reported malformed lines)
      t = { line = line, id = cli.item_id(item, line), error = msg }
    end
    tasks[#tasks + 1] = t
  end
  return tasks
end

-- ==== scoring ================================================================

local kvlua = require "kvlua"
local counts = { naive = 0, computed = 0, reused = 0, seconds = 0 }

-- A task that failed while scoring (a prefill or fork that failed): reported, skipped.
local function fail(t, msg)
  t.error = tostring(msg)
  complain(t.line, t.error)
end

-- Adds a session's prefill work to the counts and closes it.
local function retire(s)
  local st = s:stats()
  counts.computed = counts.computed + st.prefill_tokens - st.reused_tokens
  counts.reused = counts.reused + st.reused_tokens
  counts.seconds = counts.seconds + st.prefill_seconds
  s:close()
end

-- Log-probs of a choice's tokens: the first from the context's last logits,
-- the others from prefilling the choice (but its last token) into s, which
-- holds the context. Returns the array, or nil, message.
local function choice_logprobs(ctx_logits, s, choice)
  local lp = { ctx_logits:logprob(choice[1]) }
  if #choice > 1 then
    local l, perr = s:prefill(table.move(choice, 1, #choice - 1, 1, {}), { logits = "all" })
    if not l then return nil, perr end
    for j = 2, #choice do lp[j] = l:logprob(choice[j], j - 1) end
  end
  return lp
end

-- A session from the cache holding t's context, and its last logits; or nil, message.
local function context_session(t, cache)
  local s, serr = model:session { ctx = session_ctx(t), cache = cache }
  if not s then return nil, serr end
  local l, perr = s:prefill(t.context)
  if not l then
    retire(s)
    return nil, perr
  end
  return s, l
end

local function naive_tokens(t)
  local n = 0
  for _, c in ipairs(t.choices) do n = n + #t.context + #c - 1 end
  return n
end

-- --no-cache: every choice in a fresh session of its own, context and
-- choice (but its last token) in one prefill. Sets t.logprobs or t.error.
local function score_from_scratch(t)
  t.logprobs = {}
  local n = #t.context
  for k, choice in ipairs(t.choices) do
    local ids = table.move(choice, 1, #choice - 1, n + 1, table.move(t.context, 1, n, 1, {}))
    local s, serr = model:session { ctx = session_ctx(t) }
    if not s then return fail(t, serr) end
    local l, perr = s:prefill(ids, { logits = "all" })
    retire(s)
    if not l then return fail(t, perr) end
    local lp = {}
    for j = 1, #choice do lp[j] = l:logprob(choice[j], n + j - 1) end
    t.logprobs[k] = lp
  end
end

local WAVE_ROWS = 128 -- choice tokens of the forks in flight together (the engine's rows per pass)

-- The contexts of the batch, each in a session from the cache: the first
-- alone (so that a prefix the others share is cached), the others in one
-- kvlua.prefill_batch, each reusing what the cache holds (or one by one
-- when the batch fails, so that the failing item is the one reported).
-- Returns held[i] = {s =, l = last logits} for the tasks that started.
local function prefill_contexts(tasks, cache)
  local held, rest, ss, ids = {}, {}, {}, {}
  for i, t in ipairs(tasks) do
    if i == 1 then
      local s, l = context_session(t, cache)
      if s then held[i] = { s = s, l = l } else fail(t, l) end
    else
      local s, serr = model:session { ctx = session_ctx(t), cache = cache }
      if s then
        rest[#rest + 1], ss[#ss + 1], ids[#ids + 1] = i, s, t.context
      else
        fail(t, serr)
      end
    end
  end
  local ls = #ss > 0 and kvlua.prefill_batch(ss, ids) or nil
  for j, i in ipairs(rest) do
    local l, perr = ls and ls[j], nil
    if not l then l, perr = ss[j]:prefill(tasks[i].context) end
    if l then
      held[i] = { s = ss[j], l = l }
    else
      retire(ss[j])
      fail(tasks[i], perr)
    end
  end
  return held
end

-- Scores jobs {t =, k =, h =} (choices of more than one token) on forks of
-- their items' sessions, WAVE_ROWS choice tokens at a time through
-- kvlua.prefill_batch (one by one when a wave fails).
local function score_forks(jobs)
  local first = 1
  while first <= #jobs do
    local wave, forks, ids, rows = {}, {}, {}, 0
    for j = first, #jobs do
      local job, n = jobs[j], #jobs[j].t.choices[jobs[j].k] - 1
      if #wave > 0 and rows + n > WAVE_ROWS then break end
      first, rows = j + 1, rows + n
      if not job.t.error then
        local f, ferr = job.h.s:fork()
        if f then
          wave[#wave + 1], forks[#forks + 1] = job, f
          ids[#ids + 1] = table.move(job.t.choices[job.k], 1, n, 1, {})
        else
          fail(job.t, ferr)
        end
      end
    end
    local ls = #forks > 0 and kvlua.prefill_batch(forks, ids, { logits = "all" }) or nil
    for j, job in ipairs(wave) do
      local t, choice = job.t, job.t.choices[job.k]
      local l, perr = ls and ls[j], nil
      if not l and not t.error then l, perr = forks[j]:prefill(ids[j], { logits = "all" }) end
      if l then
        local lp = { job.h.l:logprob(choice[1]) }
        for r = 2, #choice do lp[r] = l:logprob(choice[r], r - 1) end
        t.logprobs[job.k] = lp
      elseif not t.error then
        fail(t, perr)
      end
      retire(forks[j])
    end
  end
end

-- The batch's contexts prefilled from the cache, then each choice on a fork
-- (the choices of every item of the batch together).
local function score_shared(tasks, cache)
  local held, jobs = prefill_contexts(tasks, cache), {}
  for i, t in ipairs(tasks) do
    local h = held[i]
    if h then
      t.logprobs = {}
      for k, choice in ipairs(t.choices) do
        if #choice == 1 then
          t.logprobs[k] = choice_logprobs(h.l, h.s, choice)
        else
          jobs[#jobs + 1] = { t = t, k = k, h = h }
        end
      end
    end
  end
  score_forks(jobs)
  for i in pairs(held) do retire(held[i].s) end
end

-- Pages one item holds at most: its context, and a fork for each choice.
local function item_pages(t)
  local n = #t.context
  local pages = (n + PAGE_TOKENS - 1) // PAGE_TOKENS
  for _, c in ipairs(t.choices) do pages = pages + (n + #c + PAGE_TOKENS - 1) // PAGE_TOKENS - n // PAGE_TOKENS end
  return pages
end

-- A cache for batches of these tasks: twice what the largest batch holds,
-- so the pages of earlier items stay at hand for reuse.
local function make_cache(tasks)
  local widest = 1
  for i = 1, #tasks, batch do
    local need = 0
    for j = i, math.min(i + batch - 1, #tasks) do
      if not tasks[j].error then need = need + item_pages(tasks[j]) end
    end
    widest = math.max(widest, need)
  end
  local cache, cerr = kvlua.cache(model, { pages = 2 * widest, page_tokens = PAGE_TOKENS })
  if not cache then cli.die("kvlua.cache: " .. cerr, 1) end
  return cache
end

-- ==== results ================================================================

local function argmax(xs)
  local best = 1
  for k = 2, #xs do if xs[k] > xs[best] then best = k end end
  return best
end

-- The output record of a scored (or failed) task.
local function record(t)
  if t.error then return { id = t.id, line = t.line, error = t.error } end
  local scores, norm, per_token, tokens = {}, {}, {}, {}
  for k, lp in ipairs(t.logprobs) do
    local sum = 0
    for _, x in ipairs(lp) do sum = sum + x end
    scores[k], norm[k], per_token[k], tokens[k] = sum, sum / t.chars[k], sum / #lp, #lp
  end
  local p, pn, pt = argmax(scores), argmax(norm), argmax(per_token)
  return { id = t.id, answer = t.answer - 1, predicted = p - 1, correct = p == t.answer,
    predicted_norm = pn - 1, correct_norm = pn == t.answer,
    predicted_per_token = pt - 1, correct_per_token = pt == t.answer,
    scores = json.array(scores), scores_norm = json.array(norm), scores_per_token = json.array(per_token),
    tokens = json.array(tokens), chars = json.array(t.chars) }
end

-- ==== the run ================================================================

local tasks = read_tasks()
local cache = not o.no_cache and make_cache(tasks) or nil
local bar = progress.new { total = #tasks, label = "items", mode = o.quiet and "off" or nil }
local records = {}
local t_start = kvlua.clock()
for i = 1, #tasks, batch do
  local group = {}
  for j = i, math.min(i + batch - 1, #tasks) do
    local t = tasks[j]
    if not t.error then
      counts.naive = counts.naive + naive_tokens(t)
      group[#group + 1] = t
    end
  end
  if cache then
    score_shared(group, cache)
  else
    for _, t in ipairs(group) do score_from_scratch(t) end
  end
  for j = i, math.min(i + batch - 1, #tasks) do
    local t = tasks[j]
    records[j] = record(t)
    if out then out:write(json.encode(records[j]), "\n") end
  end
  bar:update(#records)
end
local wall = kvlua.clock() - t_start
if out then out:close() end

local summary = tally(records)
local saved = counts.naive - counts.computed
summary.prefill_tokens = { naive = counts.naive, computed = counts.computed, reused = counts.reused,
  saved = saved, saved_fraction = fraction(saved, counts.naive) }
summary.file = o.file
summary.shard = shard and (shard.index .. "/" .. shard.count) or json.null
summary.lines = { first = reader.first, last = math.max(reader.first - 1, reader.last) }
summary.batch, summary.cache = batch, cache ~= nil
summary.seconds = counts.seconds
summary.wall_seconds = wall -- the scoring loop: tokenizing aside, forks, Lua, writing --out
summary.model, summary.threads = model.info.name, model.info.threads
bar:finish(nil)
if #tasks == 0 then
  io.stderr:write(string.format("%s: shard %s has no items (lines %d..%d)\n", o.file, o.shard, reader.first, reader.last))
end
report(summary, string.format("%s\nprefill tokens: %d computed, %d for a from-scratch scorer: %d saved (%s)"
  .. "; %d reused from the cache; %.2f s of engine time", accuracy_line(summary), counts.computed,
  counts.naive, saved, counts.naive > 0 and string.format("%.1f%%", 100 * saved / counts.naive) or "n/a",
  counts.reused, counts.seconds))
cli.exit((summary.skipped > 0 or (summary.total == 0 and #tasks > 0)) and 1 or 0)
