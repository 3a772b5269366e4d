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
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local p = cli.parser("What prefix reuse buys a chat: a scripted multi-turn conversation, run twice.")
p:model_options()
p:int("--turns", "N", "questions asked", 5, 1, 1000)
p:int("--words", "N", "words of the document in the system prompt", 1150, 1, 1 << 20)
p:int("--max-tokens", "N", "tokens per reply at most", 48, 1, cli.MAX_CTX)
p:flag("--json", "print the figures as one JSON object")
local o = p:parse()

local kvlua = require "kvlua"
local chat = require "kvlua.chat"
local model = cli.load(o)
local turns, max_tokens = o.turns, o.max_tokens

-- The document (--words pseudo-random words) and one short question a turn.
local lorem = { "the", "river", "carried", "boats", "of", "grain", "past", "old", "mills", "and", "quiet",
  "towns", "where", "people", "kept", "records", "of", "every", "harvest", "season", "storm", "market" }
local function document()
  local w, x = {}, 7919
  for i = 1, o.words do
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
    local ids, terr = chat.encode(model, messages, { add_generation_prompt = true })
    if not ids then cli.die("chat template: " .. terr, 1) end
    local s, serr = model:session { ctx = math.min(cli.MAX_CTX, #ids + max_tokens + 1), cache = cache }
    if not s then cli.die(serr, 1) end
    local l, perr = s:prefill(ids)
    if not l then cli.die(perr, 1) end
    local reply = {}
    for _ = 1, max_tokens do
      local id = l:argmax()
      if model:is_eog(id) then break end
      reply[#reply + 1] = id
      l, perr = s:decode(id)
      if not l then cli.die(perr, 1) end
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
local cache, cerr = kvlua.cache(model, { bytes = 256 << 20 })
if not cache then cli.die(cerr, 1) end
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
  cli.print(('{"model":"%s","turns":%d,"prompt_tokens":%s,"reused_tokens":%s,"ttft_ms_cold":%s,"ttft_ms_reuse":%s,'
    .. '"last_turn_speedup":%.2f,"same_replies":%s}'):format(model.info.name, turns, arr(cold.prompt), arr(warm.reused),
    arr((function() local r = {} for i, v in ipairs(cold.ttft) do r[i] = v * 1e3 end return r end)(), "%.2f"),
    arr((function() local r = {} for i, v in ipairs(warm.ttft) do r[i] = v * 1e3 end return r end)(), "%.2f"),
    speedup, tostring(same)))
else
  cli.print(("%-5s %8s %8s %14s %14s %8s"):format("turn", "prompt", "reused", "TTFT cold ms", "TTFT reuse ms", "ratio"))
  for t = 1, turns do
    cli.print(("%-5d %8d %8d %14.1f %14.1f %7.1fx"):format(t, cold.prompt[t], warm.reused[t], cold.ttft[t] * 1e3,
      warm.ttft[t] * 1e3, cold.ttft[t] / warm.ttft[t]))
  end
  cli.print(("last turn: %d tokens of history, TTFT %.1fx lower with reuse; replies identical: %s"):format(
    cold.prompt[last], speedup, tostring(same)))
end
cli.exit(same and 0 or 1)
