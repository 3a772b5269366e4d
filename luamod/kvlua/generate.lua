-- kvlua.generate — s:generate{...}: the token loop of a session, in Lua.
--
-- Policy lives here (sampling, stop strings, streaming text); the C core
-- runs each forward pass. The module returns a function that the binding
-- calls once with the vocabulary helpers of a session (tokenize, piece,
-- is_eog: they work after model:close(), which a session survives; and
-- generation, a count every change of the session's sequence bumps); it
-- returns the Session method `generate`.
--
--   for piece in s:generate{ prompt = "Hello", max_tokens = 64,
--                            sampler = sampling.chain{...}, stop = {"\n\n"} } do
--     io.write(piece)
--   end
--   print(s.finish_reason)
--
-- Options:
--   prompt      string (tokenized; BOS added when the session is empty) or an
--               array of ids; optional (or empty) when the session already
--               holds tokens: generation continues from the last one (its
--               logits are recomputed when the session has none, e.g. after
--               prefill{logits = "none"} or s:rewind)
--   max_tokens  tokens to generate at most (default 128)
--   sampler     an object with :sample(logits) -> id | nil, err and an
--               optional :accept(id); default greedy
--   stop        array of strings; generation ends before any of them
--   ignore_eog  keep going past end-of-generation tokens (default false)
--   grammar     GBNF text (or a kvlua.grammar object): every token is drawn
--               from those the grammar allows after the text so far (applied
--               before the sampler's stages); generation ends with "grammar"
--               when none is allowed, when the sampler picks a token the
--               grammar refuses (one that ignores the mask: the token is
--               dropped), or when max_tokens comes before the grammar can
--               end (s.grammar_error says which). A bad grammar
--               ends it at once with "error: line L, column C: ..."
--   json_schema a JSON schema (table or JSON text): as grammar = the GBNF
--               kvlua.json_schema writes for it (every finished text is JSON
--               the schema accepts); one it cannot honour ends generation at
--               once with "error: json_schema: <where>: ..."
--   on_token    function(id) called for every generated id
--   on_full     function(s) called when the context is full; it may make room
--               (s:shift{ keep =, drop = } or s:rewind(n)) and generation goes
--               on; if it makes none, generation ends with "length"
--   logprobs    k (integer >= 0): log-probabilities of every generated token
--               and its k most likely alternatives (below)
--
-- The iterator yields text pieces that are always whole UTF-8 characters
-- and never part of a stop string. It ends on EOG, max_tokens, a stop
-- string, a grammar or an error; the reason is in s.finish_reason ("eog",
-- "length", "stop", "grammar", or "error: <message>") and the generated
-- ids in s.generated.
--
-- With logprobs = k, each piece comes with a second value: the records of
-- the tokens generated since the previous piece (a token whose text is held
-- back, or that has none, comes with a later piece; the last tokens, EOG or
-- a stop string's, may come with none). s.logprobs holds every record, in
-- the order of s.generated (nil without logprobs):
--   { id =, text = (the token's bytes),
--     logprob = log-softmax of the distribution the sampler picked from
--               (sampler.final: what its stages left before the pick, e.g.
--               after penalties, top-k/p and temperature; the raw logits
--               without a sampler; nil for a sampler that keeps no .final),
--     raw_logprob = log-softmax of the model's logits (Logits:logprob),
--     top = { {id =, text =, logprob = (raw)}, ... } the k best of the
--           model's logits (Logits:topk order: ties to the lower id) }
--
-- One live iterator per session: a new s:generate on the same session
-- invalidates the previous iterator, which raises when called again; so
-- does any other change of the session's sequence between two steps
-- (s:decode, s:prefill, s:rewind, s:shift, kvlua.decode_batch), even one
-- that leaves s.pos where it was.

local kvlua = require "kvlua"
local logprobs = require "kvlua.logprobs"
local json_schema = require "kvlua.json_schema"

local function check_opts(opts)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error("generate: options must be a table", 3) end
  if opts.max_tokens ~= nil and math.type(opts.max_tokens) ~= "integer" then
    error("generate: max_tokens must be an integer", 3)
  end
  if opts.stop ~= nil then
    if type(opts.stop) ~= "table" then error("generate: stop must be an array of strings", 3) end
    for _, s in ipairs(opts.stop) do
      if type(s) ~= "string" or s == "" then error("generate: stop strings must be non-empty strings", 3) end
    end
  end
  if opts.sampler ~= nil and (type(opts.sampler) ~= "table" and type(opts.sampler) ~= "userdata") then
    error("generate: sampler must be a sampler object", 3)
  end
  if opts.prompt ~= nil and type(opts.prompt) ~= "string" and type(opts.prompt) ~= "table" then
    error("generate: prompt must be a string or an array of token ids", 3)
  end
  if opts.grammar ~= nil and type(opts.grammar) ~= "string" and type(opts.grammar) ~= "userdata" then
    error("generate: grammar must be GBNF text or a kvlua.grammar object", 3)
  end
  if opts.logprobs ~= nil and (math.type(opts.logprobs) ~= "integer" or opts.logprobs < 0) then
    error("generate: logprobs must be a non-negative integer (alternatives per token)", 3)
  end
  if opts.json_schema ~= nil then
    local t = type(opts.json_schema)
    if t ~= "table" and t ~= "string" and t ~= "boolean" then
      error("generate: json_schema must be a JSON schema (table or JSON text)", 3)
    end
    if opts.grammar ~= nil then error("generate: give grammar or json_schema, not both", 3) end
  end
  return opts
end

-- Length of the longest suffix of text that is a proper prefix of a stop
-- string (that text must be held back until we know).
local function held_back(text, stops)
  local hold = 0
  for _, s in ipairs(stops) do
    for k = math.min(#s - 1, #text), 1, -1 do
      if k > hold and text:sub(-k) == s:sub(1, k) then
        hold = k
        break
      end
    end
  end
  return hold
end

-- The live iterator of each session (weak keys: a dropped session goes).
local live = setmetatable({}, { __mode = "k" })

-- The sampler with a grammar state in front: the Logits are masked first
-- (a clone: the session's stay as they are), then sampled as before.
-- Greedy without a sampler (and without logprobs, which report the masked
-- distribution) first checks the argmax: when the grammar takes it, it is
-- the argmax of the masked Logits too, and no mask is computed.
local function with_grammar(sampler, gstate, lazy)
  local w = {}
  function w:sample(l)
    if lazy then
      local id = l:argmax()
      if l:get(id) > -math.huge and gstate:allows(id) then return id end
    end
    local work = l:clone()
    local left, allowed = gstate:mask(work)
    if left == nil then return nil, "grammar: " .. tostring(allowed) end
    if left == 0 then return nil, "grammar: no token of the vocabulary is allowed here" end
    local id, err
    if sampler then id, err = sampler:sample(work) else id = work:argmax() end
    w.final = sampler and sampler.final or work
    -- a sampler of one's own may ignore the mask: its pick is checked, never
    -- taken unconstrained
    if id and not gstate:allows(id) then
      return nil, ("grammar: the sampler chose token %d, which the grammar refuses here"):format(id)
    end
    return id, err
  end
  function w:accept(id)
    local ok, err = gstate:accept(id)
    if not ok then error("generate: " .. tostring(err), 0) end -- allows() said yes: an engine bug
    if sampler and sampler.accept then sampler:accept(id) end
  end
  return w
end

local function generate(vocab, s, opts)
  opts = check_opts(opts)
  if opts.json_schema ~= nil then -- its grammar, then as grammar =
    local text, jerr = json_schema.to_gbnf(opts.json_schema)
    if not text then
      s.finish_reason = "error: " .. jerr
      return function() return nil end
    end
    local o = {}
    for k, v in pairs(opts) do o[k] = v end
    o.grammar, o.json_schema = text, nil
    opts = o
  end
  local max_tokens = opts.max_tokens or 128
  local stops = opts.stop or {}
  local sampler = opts.sampler
  local gstate
  s.grammar_error = nil
  if opts.grammar ~= nil then
    local g, gerr = opts.grammar, nil
    if type(g) == "string" then g, gerr = kvlua.grammar(g) end
    if g then g, gerr = g:state(s.model) end
    if not g then
      s.finish_reason = "error: " .. gerr
      return function() return nil end
    end
    gstate = g
    sampler = with_grammar(sampler, gstate, sampler == nil and not opts.logprobs)
  end
  s.finish_reason = nil

  local ids = opts.prompt
  if type(ids) == "string" then
    ids = vocab.tokenize(s, ids, { add_special = s.pos == 0, parse_special = true })
  end
  local logits, err
  if ids ~= nil and #ids > 0 then
    logits, err = s:prefill(ids)
  elseif s.pos == 0 then
    error("generate: nothing to continue from (the prompt is empty and so is the session)", 2)
  else
    logits = s:logits()
    if not logits then -- none kept: evaluate the last token again
      local last = s:tokens()[s.pos]
      s:rewind(1)
      logits, err = s:prefill({ last })
    end
  end
  if not logits then
    s.finish_reason = "error: " .. err
    return function() return nil end
  end

  local me = {}
  live[s] = me
  local pos = s.pos    -- where this iterator left the session
  local gen = vocab.generation(s) -- and its sequence (pos alone misses a rewind and a decode)
  local pending = ""   -- generated text not yet emitted
  local produced = 0
  local done = false
  local generated = {}
  s.generated = generated
  local lp_all, lp_new -- logprobs records: all of them, and those not yet yielded
  if opts.logprobs then lp_all, lp_new = {}, {} end
  s.logprobs = lp_all
  -- A piece, with the records since the last one when logprobs are asked.
  local function piece_out(out)
    if not lp_all then return out end
    local recs = lp_new
    lp_new = {}
    return out, recs
  end

  local function finish(reason)
    done = true
    s.finish_reason = reason
    if live[s] == me then live[s] = nil end
  end

  return function()
    if not done then
      if live[s] ~= me then
        error("generate: this iterator was replaced by a newer s:generate on the same session", 2)
      end
      if vocab.generation(s) ~= gen then
        error(("generate: the session moved under this iterator (at %d, left at %d)"):format(s.pos, pos), 2)
      end
    end
    while not done do
      if produced >= max_tokens then
        if gstate and not gstate:can_end() then
          s.grammar_error = "grammar: max_tokens reached before the grammar could end"
          finish("grammar")
        else
          finish("length")
        end
        break
      end
      local id
      if sampler then id, err = sampler:sample(logits) else id = logits:argmax() end
      if not id and gstate and tostring(err):sub(1, 8) == "grammar:" then
        s.grammar_error = err
        finish("grammar")
        break
      end
      if not id then finish("error: " .. tostring(err)); break end
      if sampler and sampler.accept then sampler:accept(id) end
      produced = produced + 1
      generated[#generated + 1] = id
      if lp_all then
        local rec = logprobs.record(logits, id, opts.logprobs, sampler, function(t) return vocab.piece(s, t, false) end)
        lp_all[#lp_all + 1] = rec
        lp_new[#lp_new + 1] = rec
      end
      if opts.on_token then opts.on_token(id) end
      if vocab.is_eog(s, id) and not opts.ignore_eog then finish("eog"); break end
      pending = pending .. vocab.piece(s, id, false)
      -- stop strings
      for _, stop in ipairs(stops) do
        local at = pending:find(stop, 1, true)
        if at then
          local out = pending:sub(1, at - 1)
          pending = ""
          finish("stop")
          if out ~= "" then return piece_out(out) end
          return nil
        end
      end
      -- feed the token back for the next step (not after the last one)
      if produced < max_tokens then
        logits, err = s:decode(id)
        if not logits and opts.on_full and s.pos >= s.ctx then
          local ok, e2 = pcall(opts.on_full, s)
          if not ok then
            err = "on_full: " .. tostring(e2)
          elseif s.pos >= s.ctx then
            finish("length")
          else
            logits, err = s:decode(id)
          end
        end
        if not logits and not done then
          finish("error: " .. err)
        end
        pos = s.pos
        gen = vocab.generation(s)
      end
      local emit = kvlua.utf8_complete(pending)
      emit = math.min(emit, #pending - held_back(pending, stops))
      if emit > 0 then
        local out = pending:sub(1, emit)
        pending = pending:sub(emit + 1)
        return piece_out(out)
      end
    end
    if pending ~= "" then
      local out = pending
      pending = ""
      return piece_out(out)
    end
    return nil
  end
end

return function(vocab)
  return function(s, opts) return generate(vocab, s, opts) end -- a tail call: error levels unchanged
end
