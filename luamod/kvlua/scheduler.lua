-- kvlua.scheduler — many generations at once: a set of sessions that
-- decode together, new prompts admitted as others finish, and their
-- prefill cut into chunks between decode steps.
--
--   local scheduler = require "kvlua.scheduler"
--   local sch = scheduler.new(model, { batch = 8, prefill_chunk = 64 })
--   sch:run(next_request, function(result) ... end)
--
-- next_request() returns the next request, or nil when there are no more:
--   { prompt = {ids...},          -- required, not empty
--     max_tokens = 128, sampler = <:sample(logits) [, :accept(id)]> (default greedy),
--     stop = {"strings"}, ignore_eog = false,
--     logprobs = k (optional: result.logprobs, see below),
--     grammar = GBNF text or a kvlua.grammar object (optional, see below), ... }
--                                   -- other fields are the caller's
-- A request with an `error` field (a message) is not run: its result
-- finishes with "error: <message>" in its place in the order.
-- The sink receives one result per request, in request order whatever
-- order they finish in:
--   { request =, index = k (1-based), text =, ids = {generated ids, EOG excluded},
--     finish_reason = "eog"|"length"|"stop"|"grammar"|"error: ...", prompt_tokens =,
--     ttft =, itl = {seconds...}, tokens_per_s = (nil under 2 tokens), kv_bytes =,
--     logprobs = {record per id of ids} (with request.logprobs: kvlua.logprobs.record's,
--                as s:generate{logprobs = k} gives them),
--     grammar_error = message (finish_reason "grammar") }
-- A request's grammar works as s:generate{grammar =}: the logits are masked
-- (a clone) before its sampler, the sampler's pick is checked, and the
-- request finishes with "grammar" (and grammar_error) when no token is
-- allowed, when the sampler picks one the grammar refuses, or when
-- max_tokens comes before the grammar can end: never an unconstrained
-- token. A grammar that does not compile finishes it with "error: line L,
-- column C: ..." before any prefill.
--
-- One step of the loop:
--   1. admit requests while fewer than `batch` are active (each gets its
--      own session, sized to its prompt + max_tokens unless opts.ctx);
--   2. prefill: at most `prefill_chunk` prompt tokens in all (0: every
--      waiting prompt whole), in pieces cut from each prompt's start,
--      oldest request first;
--   3. sample one token for every request whose logits are ready;
--   4. decode those tokens, all sessions through ONE call of
--      decode_step(sessions, ids) (scheduler.decode_step, or opts.decode_step).
-- With chunks, a long prompt no longer stalls the requests that are
-- decoding: they get a token every step while it is prefilled piece by piece.
--
-- Times are engine seconds: the sum of the forward passes the engine timed
-- with its monotonic clock (s:stats()), which is where a run spends its
-- time; Lua's own work between passes is not counted. ttft runs from a
-- request's admission to its first token; tokens_per_s is (tokens - 1)
-- over the time from the first token to the last. In both, the passes of
-- the other requests sharing the steps count: that is what a user waits.
--
-- Errors: a request that cannot run (no prompt, a prompt longer than the
-- context, a forward pass that fails) finishes with finish_reason
-- "error: ..." and the others go on. Misuse (bad options) raises.

local kvlua = require "kvlua"
local logprobs = require "kvlua.logprobs"

local M = {}

-- ==== decoding many sessions =================================================

--- scheduler.decode_step(sessions, ids) -> logits, errors, seconds
--- Feeds ids[i] to sessions[i] in ONE forward pass (kvlua.decode_batch: the
--- weights are read once per step; each row is the bits a lone s:decode
--- gives, so results do not depend on the batch). logits[i] is its Logits,
--- or errors[i] a message; seconds is the engine time the step took. When
--- the batch as a whole fails (a session full, say), each session is
--- decoded on its own so only the failing ones get an error.
function M.decode_step(sessions, ids)
  local logits, errors, seconds = {}, {}, 0
  if #sessions == 0 then return logits, errors, 0 end
  local all_sessions = true -- (wrappers of sessions, as tests use, go one by one)
  for _, s in ipairs(sessions) do
    local mt = getmetatable(s)
    all_sessions = all_sessions and type(mt) == "table" and mt.__name == "kvlua.Session"
  end
  local out = all_sessions and kvlua.decode_batch(sessions, ids)
  if out then
    local itl = sessions[1]:stats().itl
    return out, errors, itl[#itl]
  end
  for i, s in ipairs(sessions) do
    local l, err = s:decode(ids[i])
    if l then
      logits[i] = l
      local itl = s:stats().itl
      seconds = seconds + itl[#itl]
    else
      errors[i] = err
    end
  end
  return logits, errors, seconds
end

-- ==== one request's generation ===============================================

local Scheduler = {}
Scheduler.__index = Scheduler

local function check_opts(opts)
  if opts ~= nil and type(opts) ~= "table" then error("scheduler.new: options must be a table", 3) end
  opts = opts or {}
  for _, k in ipairs { "batch", "prefill_chunk", "ctx" } do
    if opts[k] ~= nil and (math.type(opts[k]) ~= "integer" or opts[k] < 0) then
      error("scheduler.new: " .. k .. " must be a non-negative integer", 3)
    end
  end
  if opts.batch == 0 then error("scheduler.new: batch must be at least 1", 3) end
  if opts.decode_step ~= nil and type(opts.decode_step) ~= "function" then
    error("scheduler.new: decode_step must be a function", 3)
  end
  return opts
end

--- scheduler.new(model, {batch = 4, prefill_chunk = 0, ctx = nil, ktype =, vtype =, decode_step =})
function M.new(model, opts)
  opts = check_opts(opts)
  return setmetatable({
    model = model,
    batch = opts.batch or 4,
    prefill_chunk = opts.prefill_chunk or 0,
    ctx = opts.ctx,
    ktype = opts.ktype, vtype = opts.vtype,
    decode_step = opts.decode_step or M.decode_step,
    clock = 0,          -- engine seconds since the run began
    steps = 0, prefill_tokens = 0, decode_tokens = 0,
  }, Scheduler)
end

-- Engine seconds of the session's prefills so far.
local function prefill_seconds(s)
  return s:stats().prefill_seconds
end

function Scheduler:finish(e, reason)
  e.done = true
  e.result.finish_reason = reason
  if e.session then
    e.result.kv_bytes = e.session:stats().kv_bytes
    e.session:close()
    e.session = nil
  end
  local r = e.result
  local n = #r.ids
  if n >= 2 and r.t_last > r.t_first then r.tokens_per_s = (n - 1) / (r.t_last - r.t_first) end
  r.t_first, r.t_last = nil, nil
end

-- A new entry for request number k; opens its session.
function Scheduler:admit(req, k)
  if req.logprobs ~= nil and (math.type(req.logprobs) ~= "integer" or req.logprobs < 0) then
    error("scheduler: a request's logprobs must be a non-negative integer", 0)
  end
  if req.grammar ~= nil and type(req.grammar) ~= "string" and type(req.grammar) ~= "userdata" then
    error("scheduler: a request's grammar must be GBNF text or a kvlua.grammar object", 0)
  end
  local result = { request = req, index = k, text = "", ids = {}, itl = {}, prompt_tokens = 0,
    logprobs = req.logprobs and {} or nil }
  local e = { req = req, result = result, fed = 0, admitted = self.clock, max_tokens = req.max_tokens or 128,
    stop = req.stop or {}, sampler = req.sampler }
  local prompt = req.prompt
  if req.error then
    self:finish(e, "error: " .. req.error)
    return e
  end
  if type(prompt) ~= "table" or #prompt == 0 then
    self:finish(e, "error: the request has no prompt tokens")
    return e
  end
  if req.grammar ~= nil then
    local g, gerr = req.grammar, nil
    if type(g) == "string" then g, gerr = kvlua.grammar(g) end
    if g then g, gerr = g:state(self.model) end
    if not g then
      self:finish(e, "error: " .. gerr)
      return e
    end
    e.gstate = g
  end
  result.prompt_tokens = #prompt
  local ctx = self.ctx or (#prompt + e.max_tokens + 1)
  if #prompt + 1 > ctx then
    self:finish(e, string.format("error: the prompt (%d tokens) does not fit the context (%d)", #prompt, ctx))
    return e
  end
  local s, err = self.model:session { ctx = ctx, ktype = self.ktype, vtype = self.vtype }
  if not s then
    self:finish(e, "error: " .. err)
    return e
  end
  e.session = s
  return e
end

-- Feeds the next n prompt tokens of e; returns n.
function Scheduler:prefill_some(e, n)
  local prompt = e.req.prompt
  local chunk = table.move(prompt, e.fed + 1, e.fed + n, 1, {})
  local last = e.fed + n == #prompt
  local before = prefill_seconds(e.session)
  local out, err = e.session:prefill(chunk, { logits = last and "last" or "none" })
  self.clock = self.clock + prefill_seconds(e.session) - before
  self.prefill_tokens = self.prefill_tokens + n
  e.fed = e.fed + n
  if not out then
    self:finish(e, "error: " .. err)
  elseif last then
    e.logits = out
  end
  return n
end

-- e's pick under its grammar state: id and what the logprobs record takes
-- as the sampler (the masked Logits as .final); or nil, a message and
-- whether the grammar ended it. Greedy without logprobs checks the argmax
-- first (when the grammar takes it, it is the masked argmax too).
local function grammar_pick(e)
  local g, l = e.gstate, e.logits
  if not e.sampler and not e.req.logprobs then
    local id = l:argmax()
    if l:get(id) > -math.huge and g:allows(id) then return id end
  end
  local work = l:clone()
  local left, allowed = g:mask(work)
  if left == nil then return nil, "grammar: " .. tostring(allowed), true end
  if left == 0 then return nil, "grammar: no token of the vocabulary is allowed here", true end
  local id, err
  if e.sampler then id, err = e.sampler:sample(work) else id = work:argmax() end
  if not id then return nil, err, false end
  if not g:allows(id) then
    return nil, ("grammar: the sampler chose token %d, which the grammar refuses here"):format(id), true
  end
  local final = type(e.sampler) == "table" and rawget(e.sampler, "final") or nil
  return id, { final = final or (not e.sampler and work or nil) }
end

-- Samples e's next token; returns the id to decode, or nil when e finished.
function Scheduler:sample(e)
  local r = e.result
  local id, err
  local lp_sampler = e.sampler
  if e.gstate then
    local by_grammar
    id, err, by_grammar = grammar_pick(e)
    if id then lp_sampler, err = err, nil end
    if by_grammar then
      e.logits = nil
      r.grammar_error = err
      return self:finish(e, "grammar")
    end
    if id then
      local ok, aerr = e.gstate:accept(id)
      if not ok then error("scheduler: " .. tostring(aerr), 0) end -- allows() said yes: an engine bug
    end
  elseif e.sampler then id, err = e.sampler:sample(e.logits) else id = e.logits:argmax() end
  local logits = e.logits
  e.logits = nil
  if not id then return self:finish(e, "error: " .. tostring(err)) end
  if e.sampler and e.sampler.accept then e.sampler:accept(id) end
  if #r.ids == 0 and not r.ttft then
    r.ttft = self.clock - e.admitted
    r.t_first = self.clock
  else
    r.itl[#r.itl + 1] = self.clock - r.t_last
  end
  r.t_last = self.clock
  if self.model:is_eog(id) and not e.req.ignore_eog then return self:finish(e, "eog") end
  r.ids[#r.ids + 1] = id
  if r.logprobs then
    r.logprobs[#r.ids] = logprobs.record(logits, id, e.req.logprobs, lp_sampler,
      function(t) return self.model:piece(t, false) end)
  end
  r.text = r.text .. self.model:piece(id, false)
  for _, stop in ipairs(e.stop) do
    local at = r.text:find(stop, 1, true)
    if at then
      r.text = r.text:sub(1, at - 1)
      return self:finish(e, "stop")
    end
  end
  if #r.ids >= e.max_tokens then
    if e.gstate and not e.gstate:can_end() then
      r.grammar_error = "grammar: max_tokens reached before the grammar could end"
      return self:finish(e, "grammar")
    end
    return self:finish(e, "length")
  end
  return id
end

-- ==== the loop ===============================================================

-- 1. admission: fills free slots from the request source.
function Scheduler:fill(active, next_request)
  while #active < self.batch and not self.exhausted do
    local req = next_request()
    if req == nil then
      self.exhausted = true
    else
      self.admitted = self.admitted + 1
      active[#active + 1] = self:admit(req, self.admitted)
    end
  end
end

-- 2. prefill, oldest request first. A prompt is cut into pieces of
-- prefill_chunk tokens counted from its own start, whatever else is
-- waiting, so how a prompt is cut never depends on its neighbours: on a
-- quantized model, the logits of a prompt prefilled in different pieces
-- differ by rounding noise that can change a greedy choice. A step runs
-- pieces while they fit in its budget of prefill_chunk tokens (its first
-- piece always does).
function Scheduler:prefill_step(active)
  local chunk = self.prefill_chunk > 0 and self.prefill_chunk or math.huge
  local budget = chunk
  for _, e in ipairs(active) do
    if not e.done and e.fed < #e.req.prompt then
      local piece = math.min(chunk, #e.req.prompt - e.fed)
      if piece > budget then break end
      budget = budget - self:prefill_some(e, piece)
    end
  end
end

-- 3 and 4. sample where logits are ready, then one decode step for all.
function Scheduler:decode_all(active)
  local entries, sessions, ids = {}, {}, {}
  for _, e in ipairs(active) do
    if not e.done and e.logits then
      local id = self:sample(e)
      if id then
        entries[#entries + 1], sessions[#sessions + 1], ids[#ids + 1] = e, e.session, id
      end
    end
  end
  if #sessions == 0 then return end
  local logits, errors, seconds = self.decode_step(sessions, ids)
  self.clock = self.clock + seconds
  self.decode_tokens = self.decode_tokens + #sessions
  for i, e in ipairs(entries) do
    if logits[i] then e.logits = logits[i] else self:finish(e, "error: " .. tostring(errors[i])) end
  end
end

-- Hands finished results to the sink in request order; returns the
-- still-active entries.
function Scheduler:retire(active, sink)
  local still = {}
  for _, e in ipairs(active) do
    if e.done then self.finished[e.result.index] = e.result else still[#still + 1] = e end
  end
  while self.finished[self.delivered + 1] do
    self.delivered = self.delivered + 1
    local r = self.finished[self.delivered]
    self.finished[self.delivered] = nil
    sink(r)
  end
  return still
end

--- sch:run(next_request, sink): runs until next_request() returns nil and
--- every request finished. sink(result) is called in request order.
function Scheduler:run(next_request, sink)
  if type(next_request) ~= "function" or type(sink) ~= "function" then
    error("scheduler:run(next_request, sink): two functions expected", 2)
  end
  self.admitted, self.delivered, self.finished, self.exhausted = 0, 0, {}, false
  local active = {}
  repeat
    self:fill(active, next_request)
    self:prefill_step(active)
    self:decode_all(active)
    self.steps = self.steps + 1
    active = self:retire(active, sink)
  until #active == 0 and self.exhausted
end

return M
