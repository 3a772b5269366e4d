#!/usr/bin/env lua5.4
-- scripts/chat.lua — chat with a model, reusing the KV cache across turns.
--
-- Interactive by default: type a message; /quit or EOF (Ctrl-D) quits, an
-- empty line is skipped, Ctrl-C during a reply stops that reply (the
-- part written so far stays in the conversation) and gives the prompt back.
-- Plain Lua has no signal handler: lua5.4 turns the first SIGINT into the
-- error "interrupted!" (caught here) and then restores SIGINT's default
-- action, so a second Ctrl-C in the same run ends the program.
-- With --prompt, answers that message and exits (for scripts and tests;
-- several --prompt turns can be given separated by "|||").
-- Each turn renders the whole conversation with the model's chat template,
-- keeps the longest common token prefix with what the session already
-- holds (so earlier turns are not prefilled again) and prefills the rest.
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local p = cli.parser("Chat with a model, reusing the KV cache across turns (/quit or EOF quits; "
  .. "Ctrl-C stops a reply).")
p:model_options()
p:str("--system", "TEXT", "system message", "")
p:str("--prompt", "TEXT", "answer these turns (separated by '|||') and exit, instead of reading stdin", nil, true)
p:int("--max-tokens", "N", "tokens per reply at most", 256, 1, cli.MAX_CTX)
p:sampling_options { temp = 0.7, top_k = 40, top_p = 0.95, min_p = 0.05, seed = 42 }
p:ctx_option(4096)
p:flag("--stats", "print each turn's prompt tokens and the tokens reused from the cache to stderr")
local o = p:parse()

local chat = require "kvlua.chat"
local model = cli.load(o)
local s, serr = model:session { ctx = o.ctx }
if not s then cli.die(serr) end
local sampler = cli.sampler(o)
local out = cli.stdout

local messages = {}
if o.system ~= "" then messages[1] = { role = "system", content = o.system } end

-- Number of leading ids a and b share.
local function common_prefix(a, b)
  local n = 0
  while n < #a and n < #b and a[n + 1] == b[n + 1] do n = n + 1 end
  return n
end

-- One turn: the reply streamed to stdout. A Ctrl-C while it is generated
-- (the interpreter raises "interrupted!" at the next instruction) ends the
-- reply there; returns true when that happened.
local function turn(user)
  messages[#messages + 1] = { role = "user", content = user }
  local ids, err = chat.encode(model, messages, { add_generation_prompt = true })
  if not ids then cli.die("chat template: " .. err, 1) end
  local have = s:tokens()
  local keep = common_prefix(have, ids)
  if keep == #ids then keep = keep - 1 end -- re-run one token to get fresh logits
  s:rewind(#have - keep)
  local reused = keep
  local rest = table.move(ids, keep + 1, #ids, 1, {})
  local reply = {}
  local ok, e = pcall(function()
    for piece in s:generate { prompt = rest, max_tokens = o.max_tokens, sampler = sampler } do
      out:write(piece)
      out:flush()
      reply[#reply + 1] = piece
    end
  end)
  local interrupted = not ok and tostring(e):find("interrupted!", 1, true) ~= nil
  if not ok and not interrupted then error(e, 0) end
  out:write(interrupted and " [stopped]\n" or "\n")
  if not interrupted and s.finish_reason:match("^error") then cli.die(s.finish_reason, 1) end
  messages[#messages + 1] = { role = "assistant", content = table.concat(reply) }
  if o.stats then
    io.stderr:write(string.format("[%d prompt tokens, %d reused from the cache, finish: %s]\n",
      #ids, reused, interrupted and "interrupted" or s.finish_reason))
  end
  return interrupted
end

if o.prompt then
  for user in (o.prompt .. "|||"):gmatch("(.-)|||") do
    if user ~= "" then turn(user) end
  end
else
  while true do
    out:write("> ")
    out:flush()
    local ok, line = pcall(io.read, "l")
    if not ok then -- Ctrl-C at the prompt: a fresh prompt
      out:write("\n")
    elseif not line or line == "/quit" then
      break
    elseif line:find("%S") then
      turn(line)
    end
  end
end
s:close()
model:close()
cli.exit(0)
