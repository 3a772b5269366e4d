#!/usr/bin/env lua5.4
-- scripts/generate.lua — prompt in, streamed text out.
local usage = [[
usage: lua5.4 scripts/generate.lua [options]
  --model PATH       GGUF file (default: SmolLM2-135M-Instruct, fetched and cached)
  --prompt TEXT      the prompt (default: a short instruction)
  --chat             wrap the prompt in the model's chat template (user turn)
  --system TEXT      system message (with --chat)
  --max-tokens N     tokens to generate at most (default 128)
  --temp T           temperature; 0 = greedy (default 0.7)
  --top-k K          (default 40)   --top-p P (default 0.95)   --min-p P (default 0.05)
  --repeat-penalty R (default 1.1)
  --seed N           sampling seed (default 42)
  --ctx N            context size (default 2048)
  --threads N        CPU threads (default: physical cores)
  --stats            print TTFT and decode speed to stderr
  --json             print one JSON object instead of streaming: text, prompt_tokens, tokens,
                     finish_reason, ttft, tokens_per_s
]]
local common = dofile((arg[0]:match("^(.*)/") or ".") .. "/common.lua")
local o = common.parse(arg, {
  model = "", prompt = "Write a short poem about the sea.", chat = false, system = "",
  ["max-tokens"] = 128, temp = 0.7, ["top-k"] = 40, ["top-p"] = 0.95, ["min-p"] = 0.05,
  ["repeat-penalty"] = 1.1, seed = 42, ctx = 2048, threads = 0, stats = false,
  json = false,
}, usage)

local sampling = require "kvlua.sampling"
local model = common.load(common.model_path(o.model), o.threads, o.backend, o.device)

local text = o.prompt
if o.chat then
  local chat = require "kvlua.chat"
  local messages = {}
  if o.system ~= "" then messages[#messages + 1] = { role = "system", content = o.system } end
  messages[#messages + 1] = { role = "user", content = o.prompt }
  local rendered, err = chat.render(model, messages, { add_generation_prompt = true })
  if not rendered then common.die("chat template: " .. err) end
  text = rendered
end

local ids = model:tokenize(text, { add_special = true, parse_special = o.chat })
local s, err = model:session { ctx = math.tointeger(o.ctx) }
if not s then common.die(err) end

local sampler = sampling.from_opts {
  temp = o.temp, top_k = math.tointeger(o["top-k"]), top_p = o["top-p"], min_p = o["min-p"],
  repeat_penalty = o["repeat-penalty"], seed = math.tointeger(o.seed),
}
local pieces = {}
if not o.chat and not o.json then io.write(text) end
for piece in s:generate { prompt = ids, max_tokens = math.tointeger(o["max-tokens"]), sampler = sampler } do
  if o.json then
    pieces[#pieces + 1] = piece
  else
    io.write(piece)
    io.flush()
  end
end
if not o.json then
  io.write("\n")
  io.flush()
end
if s.finish_reason and s.finish_reason:match("^error") then common.die(s.finish_reason) end
local st = s:stats()
local total = 0
for _, t in ipairs(st.itl) do total = total + t end
if o.json then
  local json = require "kvlua.json"
  print(json.encode { text = table.concat(pieces), prompt_tokens = #ids, tokens = #s.generated - (s.finish_reason == "eog" and 1 or 0),
    finish_reason = s.finish_reason, ttft = st.ttft or json.null,
    tokens_per_s = st.decode_tokens > 0 and st.decode_tokens / total or json.null })
end
if o.stats then
  io.stderr:write(string.format("prompt %d tokens, TTFT %.1f ms; %d tokens decoded at %.1f tok/s; finish: %s\n",
    st.prefill_tokens, (st.ttft or 0) * 1e3, st.decode_tokens,
    st.decode_tokens > 0 and st.decode_tokens / total or 0, s.finish_reason))
end
s:close()
model:close()
