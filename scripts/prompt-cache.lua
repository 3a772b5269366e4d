#!/usr/bin/env lua5.4
-- scripts/prompt-cache.lua — compute a long system prompt's KV cache once,
-- keep it in a file, and answer questions from it in other processes.
--
--   lua5.4 scripts/prompt-cache.lua --save sys.kv --system-file manual.txt [--key-file K]
--   lua5.4 scripts/prompt-cache.lua --load sys.kv --system-file manual.txt --question "..." [--compare]
--
-- --save renders the system message with the model's chat template,
-- prefills it and writes the session (s:save; with --key-file, a 32-byte
-- key file, encrypted). --load restores it (kvlua.restore), renders the
-- whole conversation, prefills only what follows the saved prefix and
-- answers greedily; it prints the TTFT (restore + the question's prefill)
-- and, with --compare, the TTFT of a cold prefill of the same conversation
-- and whether both answers are the same (restoring is exact). --json
-- prints the figures as one JSON object.
local usage = [[
usage: lua5.4 scripts/prompt-cache.lua (--save FILE | --load FILE) [--system TEXT | --system-file PATH]
                                       [--question TEXT] [--max-tokens N] [--key-file PATH] [--compare]
                                       [--model PATH] [--threads N] [--json]
]]
local common = dofile((arg[0]:match("^(.*)/") or ".") .. "/common.lua")
local o = common.parse(arg, { model = "", threads = 0, save = "", load = "", system = "", ["system-file"] = "",
  question = "", ["max-tokens"] = 48, ["key-file"] = "", compare = false, json = false }, usage)

local kvlua = require "kvlua"
local chat = require "kvlua.chat"
local json = require "kvlua.json"

if (o.save == "") == (o.load == "") then common.die("give exactly one of --save FILE and --load FILE\n" .. usage) end
local system = o.system
if o["system-file"] ~= "" then
  local f, err = io.open(o["system-file"], "rb")
  if not f then common.die("cannot read --system-file: " .. err) end
  system = f:read("a")
  f:close()
end
if system == "" then common.die("give the system prompt (--system or --system-file)") end
local key
if o["key-file"] ~= "" then
  local f, err = io.open(o["key-file"], "rb")
  if not f then common.die("cannot read --key-file: " .. err) end
  key = f:read("a")
  f:close()
  if #key ~= 32 then common.die("--key-file must hold exactly 32 bytes (it holds " .. #key .. ")") end
end

local model = common.load(common.model_path(o.model), o.threads)
local ctx = 4096

local function ids_of(messages, gen)
  local text, err = chat.render(model, messages, { add_generation_prompt = gen })
  if not text then common.die("chat template: " .. err) end
  return model:tokenize(text, { add_special = true, parse_special = true })
end

local function common_prefix(a, b)
  local n = 0
  while n < #a and n < #b and a[n + 1] == b[n + 1] do n = n + 1 end
  return n
end

local function answer(s, logits)
  local out = {}
  for _ = 1, math.tointeger(o["max-tokens"]) do
    local id = logits:argmax()
    if model:is_eog(id) then break end
    out[#out + 1] = id
    logits = assert(s:decode(id))
  end
  return model:detokenize(out)
end

local sys_msg = { role = "system", content = system }

if o.save ~= "" then
  local ids = ids_of({ sys_msg }, false)
  local s = assert(model:session { ctx = ctx })
  local ok, err = s:prefill(ids, { logits = "none" })
  if not ok then common.die(err) end
  ok, err = s:save(o.save, { key = key })
  if not ok then common.die(err) end
  local st = s:stats()
  if o.json then
    print(json.encode { saved = o.save, tokens = #ids, prefill_ms = st.prefill_seconds * 1e3, kv_bytes = st.kv_bytes })
  else
    print(("saved %d tokens of system prompt to %s (prefill %.1f ms, %.1f MiB of K/V)"):format(#ids, o.save,
      st.prefill_seconds * 1e3, st.kv_bytes / 2 ^ 20))
  end
  os.exit(0)
end

if o.question == "" then common.die("--load needs --question TEXT") end
local ids = ids_of({ sys_msg, { role = "user", content = o.question } }, true)

-- with the file: restore, then prefill what follows the saved prefix
local t0 = os.clock()
local s, err = kvlua.restore(model, o.load, { key = key, ctx = ctx })
if not s then common.die("restore: " .. err) end
local restore_cpu = os.clock() - t0
local keep = common_prefix(s:tokens(), ids)
if keep == #ids then keep = keep - 1 end
s:rewind(s.pos - keep)
local logits = assert(s:prefill(table.move(ids, keep + 1, #ids, 1, {})))
local ttft = restore_cpu + s:stats().prefill_seconds
local text = answer(s, logits)
local out = { question = o.question, answer = text, prompt_tokens = #ids, from_file = keep,
  ttft_ms = ttft * 1e3 }

if o.compare then -- a cold prefill of the whole conversation
  local c = assert(model:session { ctx = ctx })
  local l = assert(c:prefill(ids))
  out.ttft_cold_ms = c:stats().prefill_seconds * 1e3
  out.same_answer = answer(c, l) == text
end

if o.json then
  print(json.encode(out))
else
  print(text)
  io.stderr:write(("%d prompt tokens, %d from the file; TTFT %.1f ms (restore + %d new tokens)%s\n"):format(#ids, keep,
    out.ttft_ms, #ids - keep, out.ttft_cold_ms and (", %.1f ms cold; same answer: %s"):format(out.ttft_cold_ms,
      tostring(out.same_answer)) or ""))
end
