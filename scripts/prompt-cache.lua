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
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local p = cli.parser("A long system prompt's KV cache computed once, kept in a file, answering in other processes.")
p:str("--save", "FILE", "prefill the system prompt and save the session to FILE", nil, true)
p:str("--load", "FILE", "restore the session from FILE and answer --question", nil, true)
p:str("--system", "TEXT", "the system prompt", nil, true)
p:str("--system-file", "PATH", "the system prompt, from a file", nil, true)
p:str("--question", "TEXT", "the user's question (with --load)", nil, true)
p:int("--max-tokens", "N", "tokens of the answer at most", 48, 1, 4000)
p:str("--key-file", "PATH", "a 32-byte key: the file is encrypted", nil, true)
p:flag("--compare", "also answer from a cold prefill, and compare")
p:model_options()
p:flag("--json", "print the figures as one JSON object")
local o = p:parse()

local kvlua = require "kvlua"
local chat = require "kvlua.chat"
local json = require "kvlua.json"

if (o.save == nil) == (o.load == nil) then cli.die("give exactly one of --save FILE and --load FILE") end
local system = o.system
if o.system_file then system = cli.read_file(o.system_file, "--system-file PATH") end
if not system or system == "" then cli.die("give the system prompt (--system or --system-file)") end
if o.load and not o.question then cli.die("--load needs --question TEXT") end
local key
if o.key_file then
  key = cli.read_file(o.key_file, "--key-file PATH")
  if #key ~= 32 then cli.die("--key-file must hold exactly 32 bytes (it holds " .. #key .. ")") end
end

local model = cli.load(o)
local ctx = 4096

local function ids_of(messages, gen)
  local ids, err = chat.encode(model, messages, { add_generation_prompt = gen })
  if not ids then cli.die("chat template: " .. err) end
  return ids
end

local function common_prefix(a, b)
  local n = 0
  while n < #a and n < #b and a[n + 1] == b[n + 1] do n = n + 1 end
  return n
end

local function answer(s, logits)
  local out = {}
  for _ = 1, o.max_tokens do
    local id = logits:argmax()
    if model:is_eog(id) then break end
    out[#out + 1] = id
    logits = assert(s:decode(id))
  end
  return model:detokenize(out)
end

local sys_msg = { role = "system", content = system }

if o.save then
  local ids = ids_of({ sys_msg }, false)
  local s = assert(model:session { ctx = ctx })
  local ok, err = s:prefill(ids, { logits = "none" })
  if not ok then cli.die(err) end
  ok, err = s:save(o.save, { key = key })
  if not ok then cli.die(err) end
  local st = s:stats()
  if o.json then
    cli.print(json.encode { saved = o.save, tokens = #ids, prefill_ms = st.prefill_seconds * 1e3, kv_bytes = st.kv_bytes })
  else
    cli.print(("saved %d tokens of system prompt to %s (prefill %.1f ms, %.1f MiB of K/V)"):format(#ids, o.save,
      st.prefill_seconds * 1e3, st.kv_bytes / 2 ^ 20))
  end
  cli.exit(0)
end

local ids = ids_of({ sys_msg, { role = "user", content = o.question } }, true)

-- with the file: restore, then prefill what follows the saved prefix
local t0 = os.clock()
local s, err = kvlua.restore(model, o.load, { key = key, ctx = ctx })
if not s then cli.die("restore: " .. err) end
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
  cli.print(json.encode(out))
else
  cli.print(text)
  io.stderr:write(("%d prompt tokens, %d from the file; TTFT %.1f ms (restore + %d new tokens)%s\n"):format(#ids, keep,
    out.ttft_ms, #ids - keep, out.ttft_cold_ms and (", %.1f ms cold; same answer: %s"):format(out.ttft_cold_ms,
      tostring(out.same_answer)) or ""))
end
cli.exit(0)
