#!/usr/bin/env lua5.4
-- scripts/generate.lua — prompt in, streamed text out.
--
-- Without --chat the prompt is continued as text (the default prompt is the
-- start of a sentence); with --chat it is the user's turn of the model's
-- chat template and only the reply is printed. --json prints one object
-- instead: text, prompt_tokens, tokens, finish_reason ("eog", "length", or
-- "ctx" when the context filled), ttft, tokens_per_s.
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local PROMPT = "The sea at dawn was calm, and"
local CHAT_PROMPT = "Write a short poem about the sea."

local p = cli.parser("Prompt in, streamed text out.")
p:model_options()
p:str("--prompt", "TEXT", "the prompt (default: '" .. PROMPT .. "'; with --chat '" .. CHAT_PROMPT .. "')", nil, true)
p:flag("--chat", "wrap the prompt in the model's chat template (user turn); print only the reply")
p:str("--system", "TEXT", "system message (with --chat)", "")
p:int("--max-tokens", "N", "tokens to generate at most", 128, 1, cli.MAX_CTX)
p:sampling_options { temp = 0.7, top_k = 40, top_p = 0.95, min_p = 0.05, repeat_penalty = 1.1, seed = 42 }
p:ctx_option(2048)
p:flag("--stats", "print TTFT and decode speed to stderr")
p:flag("--json", "print one JSON object instead of streaming: text, prompt_tokens, tokens, finish_reason, "
  .. "ttft, tokens_per_s")
local o = p:parse()
o.prompt = o.prompt or (o.chat and CHAT_PROMPT or PROMPT)

local model = cli.load(o)

local text, ids = o.prompt, nil
if o.chat then
  local chat = require "kvlua.chat"
  local messages = {}
  if o.system ~= "" then messages[#messages + 1] = { role = "system", content = o.system } end
  messages[#messages + 1] = { role = "user", content = o.prompt }
  local err
  ids, err = chat.encode(model, messages, { add_generation_prompt = true }) -- one BOS, contents as text
  if not ids then cli.die("chat template: " .. err) end
else
  ids = model:tokenize(text, { add_special = true, parse_special = false })
end
if #ids >= o.ctx then
  cli.die(string.format("the prompt is %d tokens: it leaves no room in --ctx %d", #ids, o.ctx))
end
local s, err = model:session { ctx = o.ctx }
if not s then cli.die(err) end

local out = cli.stdout
local pieces = {}
local full = false -- the context filled before --max-tokens
if not o.chat and not o.json then out:write(text) end
for piece in s:generate { prompt = ids, max_tokens = o.max_tokens, sampler = cli.sampler(o),
                          on_full = function() full = true end } do
  if o.json then
    pieces[#pieces + 1] = piece
  else
    out:write(piece)
    out:flush()
  end
end
if not o.json then out:write("\n") end
if s.finish_reason:match("^error") then cli.die(s.finish_reason, 1) end
local reason = full and "ctx" or s.finish_reason
local st = s:stats()
local total = 0
for _, t in ipairs(st.itl) do total = total + t end
if o.json then
  local json = require "kvlua.json"
  out:write(json.encode { text = table.concat(pieces), prompt_tokens = #ids,
    tokens = #s.generated - (reason == "eog" and 1 or 0),
    finish_reason = reason, ttft = st.ttft or json.null,
    tokens_per_s = st.decode_tokens > 0 and st.decode_tokens / total or json.null }, "\n")
end
if o.stats then
  io.stderr:write(string.format("prompt %d tokens, TTFT %.1f ms; %d tokens decoded at %.1f tok/s; finish: %s\n",
    st.prefill_tokens, (st.ttft or 0) * 1e3, st.decode_tokens,
    st.decode_tokens > 0 and st.decode_tokens / total or 0, reason))
end
s:close()
model:close()
cli.exit(0)
