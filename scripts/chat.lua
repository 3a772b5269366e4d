#!/usr/bin/env lua5.4
-- scripts/chat.lua — chat with a model, reusing the KV cache across turns.
--
-- Interactive by default (type a message, an empty line or EOF quits);
-- with --prompt, answers that one message and exits (for scripts and
-- tests; several --prompt turns can be given separated by "|||").
-- Each turn renders the whole conversation with the model's chat template,
-- keeps the longest common token prefix with what the session already
-- holds (so earlier turns are not prefilled again) and prefills the rest.
local usage = [[
usage: lua5.4 scripts/chat.lua [--model PATH] [--system TEXT] [--prompt TEXT] [--max-tokens N]
                               [--temp T] [--seed N] [--ctx N] [--threads N] [--stats]
]]
local common = dofile((arg[0]:match("^(.*)/") or ".") .. "/common.lua")
local o = common.parse(arg, {
  model = "", system = "", prompt = "", ["max-tokens"] = 256, temp = 0.7, seed = 42,
  ["top-k"] = 40, ["top-p"] = 0.95, ["min-p"] = 0.05, ctx = 4096, threads = 0, stats = false,
}, usage)

local chat = require "kvlua.chat"
local sampling = require "kvlua.sampling"
local model = common.load(common.model_path(o.model), o.threads, o.backend, o.device)
local s = assert(model:session { ctx = math.tointeger(o.ctx) })
local sampler = sampling.from_opts {
  temp = o.temp, top_k = math.tointeger(o["top-k"]), top_p = o["top-p"], min_p = o["min-p"],
  seed = math.tointeger(o.seed),
}

local messages = {}
if o.system ~= "" then messages[1] = { role = "system", content = o.system } end

-- Number of leading ids a and b share.
local function common_prefix(a, b)
  local n = 0
  while n < #a and n < #b and a[n + 1] == b[n + 1] do n = n + 1 end
  return n
end

local function turn(user)
  messages[#messages + 1] = { role = "user", content = user }
  local text, err = chat.render(model, messages, { add_generation_prompt = true })
  if not text then common.die("chat template: " .. err) end
  local ids = model:tokenize(text, { add_special = true, parse_special = true })
  local have = s:tokens()
  local keep = common_prefix(have, ids)
  if keep == #ids then keep = keep - 1 end -- re-run one token to get fresh logits
  s:rewind(#have - keep)
  local reused = keep
  local rest = table.move(ids, keep + 1, #ids, 1, {})
  local reply = {}
  for piece in s:generate { prompt = rest, max_tokens = math.tointeger(o["max-tokens"]), sampler = sampler } do
    io.write(piece)
    io.flush()
    reply[#reply + 1] = piece
  end
  io.write("\n")
  if s.finish_reason:match("^error") then common.die(s.finish_reason) end
  messages[#messages + 1] = { role = "assistant", content = table.concat(reply) }
  if o.stats then
    local st = s:stats()
    io.stderr:write(string.format("[%d prompt tokens, %d reused from the cache, finish: %s]\n",
      #ids, reused, s.finish_reason))
    _ = st
  end
end

if o.prompt ~= "" then
  for user in (o.prompt .. "|||"):gmatch("(.-)|||") do
    if user ~= "" then turn(user) end
  end
else
  while true do
    io.write("> ")
    io.flush()
    local line = io.read("l")
    if not line or line == "" then break end
    turn(line)
  end
end
