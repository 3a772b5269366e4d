-- kvlua.logprobs — log-probabilities of generated tokens, for
-- s:generate{logprobs = k}, kvlua.scheduler requests and batch-generate.
--
--   local logprobs = require "kvlua.logprobs"
--   local rec = logprobs.record(logits, id, k, sampler, piece)
--   --> { id =, text =, logprob =, raw_logprob =, top = { {id =, text =, logprob =}, ... } }
--   local lp = logprobs.openai(records, {prompt = text})  -- the completions API's "logprobs" object
--
-- raw_logprob is Logits:logprob(id) of the model's logits; logprob is the
-- same over sampler.final, the Logits the sampler picked from (a
-- kvlua.sampling chain keeps it: its stages' output before the pick), or
-- the model's logits when there is no sampler; nil when the sampler keeps
-- no .final. top: the k best of the model's logits (Logits:topk, ties to
-- the lower id) with their raw log-probabilities. Nothing is recomputed
-- differently: the numbers are the Logits methods' own, bit for bit.

local M = {}

--- logprobs.record(logits, id, k, sampler, piece) -> record
--- logits: the model's single-row Logits the id was picked from; k: the
--- alternatives wanted; sampler: nil (argmax of the logits) or the object
--- whose :sample made the pick; piece(id) -> the token's bytes.
function M.record(logits, id, k, sampler, piece)
  local raw = logits:logprob(id)
  local final
  if sampler == nil then
    final = raw
  else
    local f = type(sampler) == "table" and rawget(sampler, "final") or nil
    if f ~= nil then final = f:logprob(id) end
  end
  local top = {}
  if k > 0 then
    local ids = logits:topk(k)
    for i, t in ipairs(ids) do
      top[i] = { id = t, text = piece(t), logprob = logits:logprob(t) }
    end
  end
  return { id = id, text = piece(id), logprob = final, raw_logprob = raw, top = top }
end

-- A finite number, else nil (JSON has no infinities or NaN).
local function finite(x)
  if x == nil or x ~= x or x == math.huge or x == -math.huge then return nil end
  return x
end

-- Characters of a text as OpenAI counts them: code points, a byte that is
-- no UTF-8 continuation byte starting one (so a token ending inside a
-- character counts it, and the next token does not count it again).
local function chars(text)
  local n = 0
  for i = 1, #text do
    local b = text:byte(i)
    if b < 0x80 or b >= 0xC0 then n = n + 1 end
  end
  return n
end

--- logprobs.openai(records [, {null =, array =, prompt =}]) -> the legacy
--- completions "logprobs" object: { tokens = {text...}, token_logprobs =
--- {raw...}, top_logprobs = { {[text] = raw, ...}, ... } (the k best and
--- the sampled token, as OpenAI's API writes them), text_offset = {each
--- token's character offset from the start of the prompt (opts.prompt, its
--- text; "" when not given)} } and kvlua's extras: token_ids,
--- sampler_logprobs (logprob under the sampler's distribution) and
--- top_token_ids (the k best ids, best first). opts.null (e.g. json.null)
--- stands for a missing or non-finite number; opts.array(t) marks arrays
--- (json.array, so that empty ones encode as []).
function M.openai(records, opts)
  opts = opts or {}
  local null, mark = opts.null, opts.array or function(t) return t end
  local out = { tokens = mark {}, token_logprobs = mark {}, top_logprobs = mark {}, text_offset = mark {},
    token_ids = mark {}, sampler_logprobs = mark {}, top_token_ids = mark {} }
  local offset = chars(opts.prompt or "")
  for i, r in ipairs(records) do
    out.tokens[i] = r.text
    out.token_ids[i] = r.id
    out.token_logprobs[i] = finite(r.raw_logprob) or null
    out.sampler_logprobs[i] = finite(r.logprob) or null
    out.text_offset[i] = offset
    offset = offset + chars(r.text)
    local top, ids = {}, mark {}
    for j, t in ipairs(r.top) do
      if top[t.text] == nil then top[t.text] = finite(t.logprob) or null end
      ids[j] = t.id
    end
    if top[r.text] == nil then top[r.text] = finite(r.raw_logprob) or null end
    out.top_logprobs[i] = top
    out.top_token_ids[i] = ids
  end
  return out
end

return M
