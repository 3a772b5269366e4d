#!/usr/bin/env lua5.4
-- scripts/chat-bench.lua — what prefix reuse buys a chat: a scripted
-- multi-turn conversation, run twice.
--
-- A system prompt holding a long document, then short questions about it.
-- Each turn renders the whole conversation with the chat template (as an
-- application that keeps no state would), opens a NEW session and
-- prefills all of it, then generates a greedy reply. With a shared cache
-- (kvlua.cache) the earlier turns' pages, the generated replies' included,
-- are reused and only the new tokens are computed; without one every turn
-- prefills the whole history. Prints TTFT per turn for both, the tokens
-- reused, and checks that both runs produced the same replies (reuse is
-- exact). --json prints the figures as one JSON object.
local usage = [[
usage: lua5.4 scripts/chat-bench.lua [--model PATH] [--turns N] [--words N] [--max-tokens N]
                                     [--threads N] [--json]
]]
local common = dofile((arg[0]:match("^(.*)/") or ".") .. "/common.lua")
local o = common.parse(arg, { model = "", turns = 5, words = 1150, ["max-tokens"] = 48, threads = 0, json = false },
  usage)

local kvlua = require "kvlua"
local chat = require "kvlua.chat"
local model = common.load(common.model_path(o.model), o.threads, o.backend, o.device)
local turns, max_tokens = math.tointeger(o.turns), math.tointeger(o["max-tokens"])
if not turns or turns < 1 then common.die("--turns must be a positive integer") end

-- The document (--words pseudo-random words) and one short question a turn.
local lorem = { "the", "river", "carried", "boats", "of", "grain", "past", "old", "mills", "and", "quiet",
  "towns", "where", "people", "kept", "records", "of", "every", "harvest", "season", "storm", "market" }
local function document()
  local w, x = {}, 7919
  for i = 1, math.tointeger(o.words) do
    x = (x * 1103515245 + 12345) % 2147483648
    w[i] = lorem[x % #lorem + 1]
  end
  return table.concat(w, " ")
end
local questions = { "What is the document about?", "Which places does it name?", "What did the people keep?",
  "Is there a storm in it?", "Summarize it in five words.", "What carried the grain?", "Name one season." }
local function user_message(t) return questions[(t - 1) % #questions + 1] end

local function run(cache)
  local messages = { { role = "system", content = "You are a concise assistant. The document:\n" .. document() } }
  local out = { ttft = {}, prompt = {}, reused = {}, replies = {} }
  for t = 1, turns do
    messages[#messages + 1] = { role = "user", content = user_message(t) }
    local text = assert(chat.render(model, messages, { add_generation_prompt = true }))
    local ids = model:tokenize(text, { add_special = true, parse_special = true })
    local s = assert(model:session { ctx = 4096, cache = cache })
    local l = assert(s:prefill(ids))
    local reply = {}
    for _ = 1, max_tokens do
      local id = l:argmax()
      if model:is_eog(id) then break end
      reply[#reply + 1] = id
      l = assert(s:decode(id))
    end
    local st = s:stats()
    out.ttft[t], out.prompt[t], out.reused[t] = st.ttft, #ids, st.reused_tokens
    out.replies[t] = model:detokenize(reply)
    messages[#messages + 1] = { role = "assistant", content = out.replies[t] }
    s:close()
  end
  return out
end

local cold = run(nil) -- each session with its own private pool: nothing to reuse
local cache = assert(kvlua.cache(model, { bytes = 256 << 20 }))
local warm = run(cache)

local same = true
for t = 1, turns do same = same and cold.replies[t] == warm.replies[t] end
local last = turns
local speedup = cold.ttft[last] / warm.ttft[last]

if o.json then
  local function arr(t, f)
    local r = {}
    for i = 1, #t do r[i] = (f or "%d"):format(t[i]) end
    return "[" .. table.concat(r, ",") .. "]"
  end
  print(('{"model":"%s","turns":%d,"prompt_tokens":%s,"reused_tokens":%s,"ttft_ms_cold":%s,"ttft_ms_reuse":%s,'
    .. '"last_turn_speedup":%.2f,"same_replies":%s}'):format(model.info.name, turns, arr(cold.prompt), arr(warm.reused),
    arr((function() local r = {} for i, v in ipairs(cold.ttft) do r[i] = v * 1e3 end return r end)(), "%.2f"),
    arr((function() local r = {} for i, v in ipairs(warm.ttft) do r[i] = v * 1e3 end return r end)(), "%.2f"),
    speedup, tostring(same)))
else
  print(("%-5s %8s %8s %14s %14s %8s"):format("turn", "prompt", "reused", "TTFT cold ms", "TTFT reuse ms", "ratio"))
  for t = 1, turns do
    print(("%-5d %8d %8d %14.1f %14.1f %7.1fx"):format(t, cold.prompt[t], warm.reused[t], cold.ttft[t] * 1e3,
      warm.ttft[t] * 1e3, cold.ttft[t] / warm.ttft[t]))
  end
  print(("last turn: %d tokens of history, TTFT %.1fx lower with reuse; replies identical: %s"):format(
    cold.prompt[last], speedup, tostring(same)))
end
if not same then os.exit(1) end
