-- kvlua.generate — s:generate{...}: the token loop of a session, in Lua.
--
-- Policy lives here (sampling, stop strings, streaming text); the C core
-- runs each forward pass. Installed as the Session method `generate`.
--
--   for piece in s:generate{ prompt = "Hello", max_tokens = 64,
--                            sampler = sampling.chain{...}, stop = {"\n\n"} } do
--     io.write(piece)
--   end
--   print(s.finish_reason)
--
-- Options:
--   prompt      string (tokenized; BOS added when the session is empty) or an
--               array of ids; optional when the session was already prefilled
--   max_tokens  tokens to generate at most (default 128)
--   sampler     an object with :sample(logits) -> id | nil, err and an
--               optional :accept(id); default greedy
--   stop        array of strings; generation ends before any of them
--   ignore_eog  keep going past end-of-generation tokens (default false)
--   on_token    function(id) called for every generated id
--   on_full     function(s) called when the context is full; it may make room
--               (s:shift{ keep =, drop = } or s:rewind(n)) and generation goes
--               on; if it makes none, generation ends with "length"
--
-- The iterator yields text pieces that are always whole UTF-8 characters
-- and never part of a stop string. It ends on EOG, max_tokens, a stop
-- string or an error; the reason is in s.finish_reason ("eog", "length",
-- "stop", or "error: <message>") and the generated ids in s.generated.

local kvlua = require "kvlua"

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

return function(s, opts)
  opts = check_opts(opts)
  local model = s.model
  local max_tokens = opts.max_tokens or 128
  local stops = opts.stop or {}
  local sampler = opts.sampler
  local info = {}
  s.finish_reason = nil

  local logits
  if opts.prompt ~= nil then
    local ids = opts.prompt
    if type(ids) == "string" then
      ids = model:tokenize(ids, { add_special = s.pos == 0, parse_special = true })
    end
    local err
    logits, err = s:prefill(ids)
    if not logits then
      s.finish_reason = "error: " .. err
      return function() return nil end
    end
  else
    logits = s:logits()
    if not logits then error("generate: the session has no logits yet (pass a prompt or prefill first)", 2) end
  end

  local pending = ""   -- generated text not yet emitted
  local produced = 0
  local done = false
  local generated = {}
  s.generated = generated

  local function finish(reason)
    done = true
    s.finish_reason = reason
  end

  return function()
    while not done do
      if produced >= max_tokens then finish("length"); break end
      local id, err
      if sampler then id, err = sampler:sample(logits) else id = logits:argmax() end
      if not id then finish("error: " .. tostring(err)); break end
      if sampler and sampler.accept then sampler:accept(id) end
      produced = produced + 1
      generated[#generated + 1] = id
      if opts.on_token then opts.on_token(id) end
      if model:is_eog(id) and not opts.ignore_eog then finish("eog"); break end
      pending = pending .. model:piece(id, false)
      -- stop strings
      for _, stop in ipairs(stops) do
        local at = pending:find(stop, 1, true)
        if at then
          local out = pending:sub(1, at - 1)
          pending = ""
          finish("stop")
          if out ~= "" then return out end
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
      end
      local emit = kvlua.utf8_complete(pending)
      emit = math.min(emit, #pending - held_back(pending, stops))
      if emit > 0 then
        local out = pending:sub(1, emit)
        pending = pending:sub(emit + 1)
        return out
      end
    end
    if pending ~= "" then
      local out = pending
      pending = ""
      return out
    end
    return nil
  end
end
