#!/usr/bin/env lua5.4
-- scripts/perplexity.lua — perplexity of a model on a text file.
--
-- The method of llama.cpp's perplexity tool: the text is tokenized once
-- (with BOS when the vocabulary adds it), cut into non-overlapping chunks
-- of --ctx tokens; each chunk is evaluated in a fresh context (its first
-- token replaced by BOS when the vocabulary adds one) and only the second
-- half of each chunk is scored, so every scored token sees at least ctx/2
-- tokens of context. Prints the running estimate to stderr and the final
-- perplexity to stdout.
local usage = [[
usage: lua5.4 scripts/perplexity.lua --file TEXT [--model PATH] [--ctx 512] [--chunks N] [--threads N] [--json]
]]
local common = dofile((arg[0]:match("^(.*)/") or ".") .. "/common.lua")
local o = common.parse(arg, { model = "", file = "", ctx = 512, chunks = 0, threads = 0, json = false, quiet = false }, usage)
if o.file == "" then common.die(usage) end

local f, ferr = io.open(o.file, "rb")
if not f then common.die(ferr) end
local text = f:read("a")
f:close()

local model = common.load(common.model_path(o.model), o.threads)
local n_ctx = math.tointeger(o.ctx)
local tokens = model:tokenize(text, { add_special = true, parse_special = false })
local n_chunk = #tokens // n_ctx
if o.chunks > 0 then n_chunk = math.min(n_chunk, math.tointeger(o.chunks)) end
if n_chunk < 1 then common.die(string.format("text has %d tokens, fewer than one chunk of %d", #tokens, n_ctx)) end

local bos = model.vocab.add_bos and model.vocab.bos or nil
local s = assert(model:session { ctx = n_ctx })
local first = n_ctx // 2
local nll, count = 0.0, 0
local per_chunk = {}
local progress = not o.quiet
for c = 0, n_chunk - 1 do
  local batch = table.move(tokens, c * n_ctx + 1, (c + 1) * n_ctx, 1, {})
  if bos then batch[1] = bos end
  s:rewind(s.pos)
  local logits, err = s:prefill(batch, { logits = "all" })
  if not logits then common.die(err) end
  local chunk_nll = 0.0
  for j = first, n_ctx - 2 do
    -- logits row j+1 (1-based) predicts token j+2 of the chunk (1-based)
    local target = tokens[c * n_ctx + j + 2]
    chunk_nll = chunk_nll - logits:row(j + 1):logprob(target)
  end
  local n = n_ctx - 1 - first
  nll, count = nll + chunk_nll, count + n
  per_chunk[#per_chunk + 1] = math.exp(chunk_nll / n)
  if progress then
    io.stderr:write(string.format("\rchunk %d/%d  ppl %.4f", c + 1, n_chunk, math.exp(nll / count)))
  end
end
if progress then io.stderr:write("\n") end
local ppl = math.exp(nll / count)
if o.json then
  print(string.format('{"ppl":%.6f,"chunks":%d,"ctx":%d,"tokens":%d}', ppl, n_chunk, n_ctx, #tokens))
else
  print(string.format("perplexity %.4f over %d chunks of %d tokens (%d tokens in the text)", ppl, n_chunk, n_ctx, #tokens))
end
