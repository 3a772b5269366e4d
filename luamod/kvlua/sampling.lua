-- kvlua.sampling — composable sampler chains over Logits.
--
-- A chain is a list of stages applied in the order written to a clone of
-- the Logits (the one passed in is never modified). Filtering stages mask
-- tokens to -inf; a selecting stage (dist, greedy) picks the id and ends the
-- chain. A chain with no selector ends with greedy (argmax of what is left).
-- Every per-token loop over the vocabulary is a C method of the Logits
-- (keep_top_k, keep_top_p, ...); this file only holds policy.
--
--   local sampling = require "kvlua.sampling"
--   local s = sampling.chain{
--     sampling.penalties{last_n = 64, repeat_ = 1.1, freq = 0, presence = 0},
--     sampling.top_k(40), sampling.top_p(0.95), sampling.min_p(0.05),
--     sampling.typical(1.0), sampling.temperature(0.8), sampling.dist{seed = 42},
--   }
--   local id, err = s:sample(logits)   -- nil, "non-finite logits" on NaN/+inf
--   sampling.grammar(model, 'root ::= "yes" | "no"')  -- a stage, in any position
--   s:accept(id)                       -- history for penalties
--
--   sampling.from_opts{temp=, top_k=, top_p=, min_p=, typical=,
--                      repeat_penalty=, repeat_last_n=, freq=, presence=, seed=}
--     builds llama.cpp's default order: penalties, top_k, typical, top_p,
--     min_p, temperature, dist.
--
-- Semantics follow llama.cpp's samplers (top_k <= 0 and p >= 1 are no-ops,
-- temperature 0 keeps only the argmax); ties go to the lower token id. A
-- stage may also be a plain function(logits) -> nil (continue) | id
-- (select) | nil, err (fail), or a table with :apply(logits) and optionally
-- :accept(id) / :reset().
--
-- Randomness: xoshiro256** on Lua 5.4 64-bit integers, seeded through
-- splitmix64, so a seed gives the same stream on every platform.
-- Misuse (wrong option types or ranges) raises; bad logits return nil, err.

local M = {}

-- ---------------------------------------------------------------------------
-- Random numbers: xoshiro256** (Blackman & Vigna), 64-bit wrapping integers
-- ---------------------------------------------------------------------------

local Rng = {}
Rng.__index = Rng

local function rotl(x, k)
  return (x << k) | (x >> (64 - k))
end

local function splitmix64(state)
  state = state + 0x9e3779b97f4a7c15
  local z = state
  z = (z ~ (z >> 30)) * 0xbf58476d1ce4e5b9
  z = (z ~ (z >> 27)) * 0x94d049bb133111eb
  return state, z ~ (z >> 31)
end

local function random_seed()
  -- Not reproducible on purpose: time, CPU clock and a fresh table address.
  local addr = tonumber(tostring({}):match("0x(%x+)") or "0", 16) or 0
  return (os.time() * 1000003) ~ math.floor(os.clock() * 1e9) ~ addr
end

--- sampling.rng(seed) -> generator with :next() (64-bit integer) and
--- :random() (float in [0, 1)). seed: integer; nil picks a random one.
function M.rng(seed)
  if seed == nil then seed = random_seed() end
  if math.type(seed) ~= "integer" then
    error("sampling.rng: seed must be an integer", 2)
  end
  local st = seed
  local s = {}
  for i = 1, 4 do st, s[i] = splitmix64(st) end
  return setmetatable({ s = s, seed = seed }, Rng)
end

function Rng:next()
  local s = self.s
  local result = rotl(s[2] * 5, 7) * 9
  local t = s[2] << 17
  s[3] = s[3] ~ s[1]
  s[4] = s[4] ~ s[2]
  s[2] = s[2] ~ s[3]
  s[1] = s[1] ~ s[4]
  s[3] = s[3] ~ t
  s[4] = rotl(s[4], 45)
  return result
end

-- 53 random bits -> [0, 1)
function Rng:random()
  return (self:next() >> 11) * (1.0 / 9007199254740992.0)
end

-- ---------------------------------------------------------------------------
-- Option checks (misuse raises, at the caller's level)
-- ---------------------------------------------------------------------------

local function check_int(v, what, lo)
  if math.type(v) ~= "integer" then
    error(("sampling: %s must be an integer, got %s"):format(what, type(v) == "number" and tostring(v) or type(v)), 3)
  end
  if lo and v < lo then error(("sampling: %s must be >= %d"):format(what, lo), 3) end
  return v
end

local function check_num(v, what, lo, hi)
  if type(v) ~= "number" or v ~= v or v == math.huge or v == -math.huge then
    error(("sampling: %s must be a finite number, got %s"):format(what, type(v) == "number" and tostring(v) or type(v)), 3)
  end
  if (lo and v < lo) or (hi and v > hi) then
    error(("sampling: %s must be in [%s, %s], got %s"):format(what, tostring(lo), tostring(hi or "inf"), tostring(v)), 3)
  end
  return v
end

local function opt_min_keep(v)
  if v == nil then return 1 end
  return check_int(v, "min_keep", 0)
end

local function is_logits(l)
  local mt = getmetatable(l)
  return type(l) == "userdata" and type(mt) == "table" and mt.__name == "kvlua.Logits"
end

-- ---------------------------------------------------------------------------
-- Stages
-- ---------------------------------------------------------------------------

local Stage = {}
Stage.__index = Stage

local function stage(name, fields)
  fields.name = name
  return setmetatable(fields, Stage)
end

-- A stage on its own is a one-stage sampler (its .final as a chain's).
function Stage:sample(l)
  local c = M.chain{ self }
  local id, err = c:sample(l)
  self.final = c.final
  return id, err
end
function Stage:accept(id) end
function Stage:reset() end
function Stage:__tostring() return "sampling." .. self.name end

-- The argmax of what is left, unless every token is masked (-inf; the
-- argmax over nothing would be id 0).
local function best(l)
  local id = l:argmax()
  if l:get(id) == -math.huge then return nil, "no candidates: the sampling chain masked every token" end
  return id
end

--- greedy(): select the argmax (lowest id among equal maxima).
function M.greedy()
  return stage("greedy", {
    selects = true,
    apply = function(_, l) return best(l) end,
  })
end

--- top_k(k): keep the k best tokens (k <= 0: no-op).
function M.top_k(k)
  check_int(k, "top_k")
  return stage("top_k", {
    mutates = true,
    apply = function(_, l) l:keep_top_k(k) end,
  })
end

-- A filter stage over probabilities, run by the Logits method `method`
-- (which answers nil, message for non-finite logits).
local function p_filter(name, method)
  return function(p, min_keep)
    check_num(p, name, 0, 1)
    min_keep = opt_min_keep(min_keep)
    return stage(name, {
      mutates = true,
      apply = function(_, l)
        local ok, err = l[method](l, p, min_keep)
        if not ok then return nil, err end
      end,
    })
  end
end

--- top_p(p [, min_keep=1]): nucleus sampling (p >= 1: no-op).
M.top_p = p_filter("top_p", "keep_top_p")

--- min_p(p [, min_keep=1]): keep tokens with prob >= p * max prob (p <= 0: no-op).
function M.min_p(p, min_keep)
  check_num(p, "min_p", 0, 1)
  min_keep = opt_min_keep(min_keep)
  return stage("min_p", {
    mutates = true,
    apply = function(_, l) l:keep_min_p(p, min_keep) end,
  })
end

--- typical(p [, min_keep=1]): locally typical sampling (p >= 1: no-op).
M.typical = p_filter("typical", "keep_typical")

--- temperature(t): divide logits by t; t == 0 keeps only the argmax.
--- Computed as (x - max) / t, the same distribution as x / t, so a tiny t
--- tends to the argmax instead of overflowing.
function M.temperature(t)
  check_num(t, "temperature", 0)
  return stage("temperature", {
    mutates = t ~= 1,
    apply = function(_, l)
      if t == 0 or 1 / t == math.huge then
        l:keep_top_k(1)
      elseif t ~= 1 then
        local max = l:get(l:argmax())
        if max > -math.huge then l:scale(1 / t, max) end
      end
    end,
  })
end

--- penalties{last_n=64, repeat_=1.0, freq=0, presence=0}
--- Repetition (repeat_, also spelled repeat_penalty or ["repeat"]),
--- frequency and presence penalties over the last last_n accepted ids
--- (last_n = 0 disables, -1 means the whole history).
function M.penalties(opts)
  if opts == nil then opts = {} end
  if type(opts) ~= "table" then error("sampling.penalties: options must be a table", 2) end
  local last_n = opts.last_n == nil and 64 or check_int(opts.last_n, "last_n", -1)
  local rp = opts.repeat_
  if rp == nil then rp = opts.repeat_penalty end
  if rp == nil then rp = opts["repeat"] end
  if rp == nil then rp = 1.0 end
  check_num(rp, "repeat penalty")
  if rp <= 0 then error("sampling: repeat penalty must be > 0", 2) end
  local freq = opts.freq == nil and 0 or check_num(opts.freq, "freq")
  local presence = opts.presence == nil and 0 or check_num(opts.presence, "presence")
  local st = stage("penalties", {
    mutates = true,
    history = {},
    last_n = last_n,
  })
  local noop = last_n == 0 or (rp == 1 and freq == 0 and presence == 0)
  function st:apply(l)
    if noop or #self.history == 0 then return end
    l:penalize(self.history, rp, freq, presence)
  end
  function st:accept(id)
    if last_n == 0 then return end
    local h = self.history
    h[#h + 1] = id
    if last_n > 0 and #h > last_n then table.remove(h, 1) end
  end
  function st:reset() self.history = {} end
  return st
end

--- dist{seed=} or dist(seed): sample from the softmax of what is left.
function M.dist(opts)
  local seed
  if type(opts) == "table" then
    seed = opts.seed
  elseif opts ~= nil then
    seed = opts
  end
  if seed ~= nil then check_int(seed, "seed") end
  local st = stage("dist", { selects = true, seed = seed })
  st.rng = M.rng(seed)
  function st:apply(l)
    return l:softmax_sample(self.rng:random())
  end
  function st:reset() self.rng = M.rng(self.seed) end
  return st
end

--- grammar(model, gbnf [, {root=}]) or grammar(gbnf [, {model=, root=}])
--- -> stage | nil, err. A GBNF grammar (llama.cpp's dialect, compiled by
--- kvlua.grammar: a bad one is nil, "line L, column C: ...") as a stage:
--- it masks every token the grammar refuses after the text accepted so far
--- (end-of-generation tokens only where the grammar can end), and
--- chain:accept(id) advances it. The mask needs the model's vocabulary:
--- give the model, or bind it later with stage:bind(model) (s:generate
--- binds its session's model). When nothing is left the chain's sample
--- returns nil, "grammar: ..." (s:generate ends with finish_reason
--- "grammar"). Its accept raises for a token the grammar refuses: feed it
--- generated tokens only, not a prompt.
function M.grammar(a, b, c)
  local model, text, opts
  if type(a) == "string" then text, opts = a, b else model, text, opts = a, b, c end
  if type(text) ~= "string" then error("sampling.grammar: GBNF text expected", 2) end
  if opts == nil then opts = {} end
  if type(opts) ~= "table" then error("sampling.grammar: options must be a table", 2) end
  model = model or opts.model
  local g, err = require("kvlua").grammar(text, { root = opts.root })
  if not g then return nil, err end
  local st = stage("grammar", { mutates = true, grammar = g })
  function st:bind(m)
    self.model = m
    local state, e = g:state(m)
    if not state then error("sampling.grammar: " .. e, 2) end
    self.state = state
    return self
  end
  function st:apply(l)
    if not self.state then
      return nil, "grammar: the stage has no model (sampling.grammar(model, text) or stage:bind(model))"
    end
    local left, allowed = self.state:mask(l)
    if left == nil then return nil, allowed end
    if left == 0 then
      if allowed == 0 then
        return nil, "grammar: no token of the vocabulary is allowed here (the grammar cannot go on with this vocabulary)"
      end
      return nil, ("grammar: the %d tokens the grammar allows here were all removed by earlier stages"):format(allowed)
    end
  end
  function st:accept(id)
    if not self.state then return end
    local ok, e = self.state:accept(id)
    if not ok then error("sampling.grammar: " .. e, 3) end
  end
  function st:reset()
    if self.model then self.state = g:state(self.model) end
  end
  if model ~= nil then st:bind(model) end
  return st
end

-- ---------------------------------------------------------------------------
-- Chains
-- ---------------------------------------------------------------------------

local Chain = {}
Chain.__index = Chain


local function as_stage(v, i)
  if type(v) == "function" then
    return stage("function", { mutates = true, apply = function(_, l) return v(l) end })
  end
  if type(v) == "table" and type(v.apply) == "function" then return v end
  error(("sampling.chain: stage %d must be a sampling stage, a table with :apply or a function"):format(i), 3)
end

--- chain{stage, ...} -> sampler with :sample(logits), :accept(id), :reset()
function M.chain(stages)
  if type(stages) ~= "table" then error("sampling.chain: array of stages expected", 2) end
  local list = {}
  for i, v in ipairs(stages) do list[i] = as_stage(v, i) end
  return setmetatable({ stages = list }, Chain)
end

--- s:sample(logits) -> id | nil, err. The Logits passed in is not modified.
--- After a pick, s.final is the Logits the pick was made from (what the
--- stages before the selecting one left; the one passed in when none
--- changed it): its log-softmax is the distribution dist drew from, and
--- generate{logprobs =} reports the pick's log-probability under it.
function Chain:sample(l)
  self.final = nil
  if not is_logits(l) then error("sampler:sample: Logits expected, got " .. type(l), 2) end
  if l.rows ~= 1 then error("sampler:sample: single-row Logits expected (use l:row(i))", 2) end
  if l:has_nonfinite() then return nil, "non-finite logits" end
  local work = l
  for _, st in ipairs(self.stages) do
    if st.mutates ~= false and not st.selects then
      if work == l then work = l:clone() end
    end
    local r, err = st:apply(work)
    if err ~= nil then return nil, err end
    if r ~= nil then
      if math.type(r) ~= "integer" or r < 0 or r >= l.n then
        return nil, ("sampling stage %s returned a bad id %s"):format(st.name or "?", tostring(r))
      end
      self.final = work
      return r
    end
  end
  local id, err = best(work)
  if id then self.final = work end
  return id, err
end

--- s:accept(id): record a generated (or prompt) token for penalty stages.
function Chain:accept(id)
  if math.type(id) ~= "integer" or id < 0 then
    error("sampler:accept: token id (non-negative integer) expected", 2)
  end
  for _, st in ipairs(self.stages) do
    if st.accept then st:accept(id) end
  end
end

--- s:reset(): forget history and restart random streams from their seeds.
function Chain:reset()
  for _, st in ipairs(self.stages) do
    if st.reset then st:reset() end
  end
end

function Chain:__tostring()
  local names = {}
  for i, st in ipairs(self.stages) do names[i] = st.name or "?" end
  return "sampling.chain{" .. table.concat(names, ", ") .. "}"
end

-- ---------------------------------------------------------------------------
-- llama.cpp-style options
-- ---------------------------------------------------------------------------

--- from_opts{temp=0.8, top_k=40, top_p=0.95, min_p=0.05, typical=1.0,
---           repeat_penalty=1.0, repeat_last_n=64, freq=0, presence=0,
---           min_keep=0, seed=nil}
--- llama.cpp's defaults and order: penalties, top_k, typical, top_p, min_p,
--- temperature, dist. temp <= 0 is greedy.
function M.from_opts(o)
  if o == nil then o = {} end
  if type(o) ~= "table" then error("sampling.from_opts: options must be a table", 2) end
  local function get(k, d) if o[k] == nil then return d end return o[k] end
  local temp = get("temp", get("temperature", 0.8))
  check_num(temp, "temp")
  local min_keep = get("min_keep", 0)
  if temp <= 0 then
    return M.chain{
      M.penalties{ last_n = get("repeat_last_n", 64), repeat_ = get("repeat_penalty", 1.0),
                   freq = get("freq", 0), presence = get("presence", 0) },
      M.greedy(),
    }
  end
  return M.chain{
    M.penalties{ last_n = get("repeat_last_n", 64), repeat_ = get("repeat_penalty", 1.0),
                 freq = get("freq", 0), presence = get("presence", 0) },
    M.top_k(get("top_k", 40)),
    M.typical(get("typical", 1.0), min_keep),
    M.top_p(get("top_p", 0.95), min_keep),
    M.min_p(get("min_p", 0.05), min_keep),
    M.temperature(temp),
    M.dist{ seed = get("seed", nil) },
  }
end

--- json_schema(model, schema) or json_schema(schema [, {model=}])
--- -> stage | nil, err: sampling.grammar of the GBNF kvlua.json_schema
--- writes for a JSON schema (a table or JSON text); an unsupported keyword
--- gives nil, "json_schema: <where>: ..." naming it.
function M.json_schema(a, b, c)
  local model, schema, opts
  if type(a) == "userdata" then model, schema, opts = a, b, c else schema, opts = a, b end
  if type(schema) ~= "table" and type(schema) ~= "string" and type(schema) ~= "boolean" then
    error("sampling.json_schema: a JSON schema (table or JSON text) expected", 2)
  end
  if opts ~= nil and type(opts) ~= "table" then error("sampling.json_schema: options must be a table", 2) end
  local text, err = require("kvlua.json_schema").to_gbnf(schema)
  if not text then return nil, err end
  local o = { model = opts and opts.model }
  if model ~= nil then return M.grammar(model, text, o) end
  return M.grammar(text, o)
end

return M
