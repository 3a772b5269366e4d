-- kvlua.eval — evaluation helpers built on sessions.
--
--   local eval = require "kvlua.eval"
--   local r = eval.perplexity(model, ids, { ctx = 512, batch = 128 })
--   print(r.ppl, r.count, #r.chunks)
--
-- perplexity() follows llama.cpp's perplexity tool: ids (the whole text,
-- tokenized with add_special) are cut into non-overlapping chunks of ctx
-- tokens; each chunk is evaluated from an empty context, its first token
-- replaced by BOS when the vocabulary adds one, and only the second half is
-- scored (positions ctx/2 .. ctx-2 predicting the next token), so every
-- scored token sees at least ctx/2 tokens of context.
local M = {}

-- opts: ctx (512), batch (tokens per forward pass, bounds the logits
-- buffer; 128), chunks (at most this many; all by default), session (reuse
-- one of at least ctx tokens), ktype / vtype (the K/V storage of the session
-- it opens: a name or a per-layer table, as model:session takes),
-- progress = function(chunk, n_chunk, ppl_so_far).
-- Returns {ppl=, nll=, count=, chunks={{nll=, ppl=, ppl_cumulative=}, ...}}
-- or nil, message.
function M.perplexity(model, ids, opts)
  opts = opts or {}
  local n_ctx = opts.ctx or 512
  local n_batch = opts.batch or 128
  if math.type(n_ctx) ~= "integer" or n_ctx < 4 then error("perplexity: ctx must be an integer >= 4", 2) end
  if math.type(n_batch) ~= "integer" or n_batch < 1 then error("perplexity: batch must be a positive integer", 2) end
  if opts.chunks ~= nil and (math.type(opts.chunks) ~= "integer" or opts.chunks < 1) then
    error("perplexity: chunks must be a positive integer", 2)
  end
  local n_chunk = #ids // n_ctx
  if opts.chunks then n_chunk = math.min(n_chunk, opts.chunks) end
  if n_chunk < 1 then
    return nil, string.format("perplexity: %d tokens, fewer than one chunk of %d", #ids, n_ctx)
  end
  local bos = model.vocab.add_bos and model.vocab.bos or nil
  local s = opts.session
  if not s then
    local err
    s, err = model:session { ctx = n_ctx, ktype = opts.ktype, vtype = opts.vtype }
    if not s then return nil, err end
  end
  local first = n_ctx // 2
  local nll, count, chunks = 0.0, 0, {}
  for c = 0, n_chunk - 1 do
    local batch = table.move(ids, c * n_ctx + 1, (c + 1) * n_ctx, 1, {})
    if bos then batch[1] = bos end
    s:rewind(s.pos)
    local chunk_nll = 0.0
    for b0 = 0, n_ctx - 1, n_batch do
      local sub = table.move(batch, b0 + 1, math.min(b0 + n_batch, n_ctx), 1, {})
      local logits, err = s:prefill(sub, { logits = b0 + #sub > first and "all" or "none" })
      if not logits then return nil, err end
      for r = 1, #sub do
        local j = b0 + r - 1 -- position in the chunk (0-based); its logits predict j+1
        if j >= first and j <= n_ctx - 2 then
          chunk_nll = chunk_nll - logits:logprob(ids[c * n_ctx + j + 2], r)
        end
      end
    end
    local n = n_ctx - 1 - first
    nll, count = nll + chunk_nll, count + n
    chunks[#chunks + 1] = { nll = chunk_nll, ppl = math.exp(chunk_nll / n), ppl_cumulative = math.exp(nll / count) }
    if opts.progress then opts.progress(c + 1, n_chunk, math.exp(nll / count)) end
  end
  if not opts.session then s:close() end
  return { ppl = math.exp(nll / count), nll = nll, count = count, chunks = chunks, ctx = n_ctx }
end

return M
