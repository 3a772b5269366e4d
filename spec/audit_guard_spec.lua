-- Findings of an audit of the binding's guards around user code (eviction
-- policies, generate iterators) and of a few argument checks, one describe
-- per finding, each written to fail before its fix:
--
--   1  an eviction policy that changes the evaluation that called it
--      (rewinds or closes its session, forks, evaluates, pins, clears, saves,
--      runs decode_batch, collects garbage, yields) made the evaluation write
--      K/V rows through page -1: a crash, heap corruption on OpenCL, or
--      success with a wrong pos. Now every call that would change a session
--      or cache of the model raises while a policy runs, the pool itself
--      takes, pins and evicts nothing meanwhile, and the pages a policy
--      names are checked again once it returns. Fuzzed on the CPU and, when
--      kvlua.devices() lists one, on an OpenCL device.
--   2  a s:generate iterator kept sampling from stale logits when the
--      session moved and came back to the same pos (s:rewind(1); s:decode(x))
--   3  kvlua.devices() numbered devices from 1, kvlua.load{device=} from 0
--   4  cache:pin / unpin / lookup took token ids outside the vocabulary
--   5  model:meta_keys() listed a key with a NUL byte that model:meta refuses
--
-- Everything runs on tiny random-weight models written to temporary files.
-- The cases of finding 1 could crash the process before the fix, so they
-- run in a child lua5.4 (a crash fails one test instead of the run).
local kvlua = require "kvlua"
local W = require "spec.support.gguf_writer"
local tiny = require "spec.support.tiny_models"
local child = require "spec.support.child"
local some_ids = require("spec.support.ids").some

-- ==== 1: eviction policies ======================================================

-- The child's half: a model, a cache whose policy runs what the test asks
-- for, and the checks that the pages are right afterwards. Its arguments
-- come first as a table `ARGS` { path =, backend = }.
local HARNESS = [=[
local kvlua = require "kvlua"
local ids_support = require "spec.support.ids"
local some_ids, same = ids_support.some, ids_support.same
local CTX, PT = 48, 4

local failures = {}
local function fail(what) failures[#failures + 1] = what end
local function check(ok, what) if not ok then fail(what) end end

local function load() return assert(kvlua.load(ARGS.path, { backend = ARGS.backend, threads = 1 })) end
local ref = load() -- the reference: cold sessions on a model no policy touches

local function is_open(s) return s ~= nil and not tostring(s):find("closed", 1, true) end

-- Every page of s holds what a cold prefill of its tokens computes, and the
-- cache's sealed pages do too; stats add up.
local function verify(c, s, tag)
  if not is_open(s) or s.pos == 0 then return end
  local t = s:tokens()
  local cold = assert(ref:session { ctx = CTX })
  local lc = assert(cold:prefill(t))
  -- the cache's pages: a fork emptied and prefilled again reuses them
  local f = s:fork()
  if f then
    f:rewind(f.pos)
    local lw, err = f:prefill(t)
    if lw then check(same(lw, lc), tag .. ": a prefill reusing the cache's pages differs from a cold one")
    else check(err:find("cache full", 1, true), tag .. ": " .. tostring(err)) end
    f:close()
  end
  -- the session's own pages: the next token from them and from the cold ones
  local a, err = s:decode(7)
  local b = assert(cold:decode(7))
  if a then check(same(a, b), tag .. ": the session's next logits differ from a cold session's")
  else check(err:find("cache full", 1, true), tag .. ": " .. tostring(err)) end
  cold:close()
end

local function stats_ok(c, tag)
  local ok, st = pcall(c.stats, c)
  if not ok then return end -- closed by the test
  check(st.used >= 0 and st.cached >= 0 and st.free >= 0 and st.used + st.cached + st.free == st.pages,
    ("%s: stats do not add up (used %d cached %d free %d pages %d)"):format(tag, st.used, st.cached, st.free, st.pages))
end

-- Runs f(...) and checks what an evaluation may do to its session: on
-- success pos moved by `moved`, on nil, message or a raise it stayed.
local function eval_checked(s, moved, tag, f, ...)
  local before = is_open(s) and s.pos
  local r = table.pack(pcall(f, ...))
  if before and is_open(s) then
    if r[1] and r[2] then
      check(s.pos == before + moved, ("%s: success with pos %d, expected %d"):format(tag, s.pos, before + moved))
    else
      check(s.pos == before, ("%s: a failed evaluation moved pos %d -> %d"):format(tag, before, s.pos))
    end
  end
  return table.unpack(r, 1, r.n)
end

local TMP = os.tmpname()

-- What a policy may try. Those in MUST_RAISE change a session or cache of
-- the model: each must raise.
local MUST_RAISE = {
  rewind = true, fork = true, pin = true, unpin = true, prefill = true, decode = true, decode_batch = true,
  clear = true, save = true, cache_save = true, shift = true, session = true, restore = true, generate = true,
  yield = true,
}
local ACTIONS = {
  "rewind", "fork", "pin", "unpin", "prefill", "decode", "decode_batch", "clear", "save", "cache_save", "shift",
  "session", "restore", "generate", "yield", "close", "close_other", "collect", "close_model", "close_cache",
  "read",
}

-- w: the world { m =, c =, s = the evaluating session, others = {...} }
local function act(w, name)
  local s, o = w.s, w.others[1] or w.s
  if name == "rewind" then return s:rewind(w.rewind_n or s.pos)
  elseif name == "fork" then return s:fork()
  elseif name == "pin" then return w.c:pin(s:tokens())
  elseif name == "unpin" then return w.c:unpin(s:tokens())
  elseif name == "prefill" then return o:prefill({ 5, 6, 7 })
  elseif name == "decode" then return s:decode(9)
  elseif name == "decode_batch" then return kvlua.decode_batch({ s, o ~= s and o or nil }, { 3, 4 })
  elseif name == "clear" then return w.c:clear()
  elseif name == "save" then return s:save(TMP)
  elseif name == "cache_save" then return w.c:save(TMP)
  elseif name == "shift" then return s:shift { keep = 0, drop = 1 }
  elseif name == "session" then return w.m:session { ctx = CTX, cache = w.c }
  elseif name == "restore" then return kvlua.restore(w.m, TMP, { cache = w.c })
  elseif name == "generate" then return o:generate { prompt = { 5 }, max_tokens = 2 }()
  elseif name == "yield" then return coroutine.yield(1)
  elseif name == "close" then return s:close()
  elseif name == "close_other" then return o:close()
  elseif name == "collect" then
    for i = #w.others, 1, -1 do
      if w.others[i] ~= s then table.remove(w.others, i) break end
    end
    return collectgarbage()
  elseif name == "close_model" then return w.m:close()
  elseif name == "close_cache" then return w.c:close()
  elseif name == "read" then
    local _ = s:tokens(), s.pos, s:stats(), pcall(w.c.stats, w.c), pcall(w.c.lookup, w.c, { 5, 6 })
    return true
  end
  error("no action " .. name)
end

local function try(w, name, tag)
  local ok, err = pcall(act, w, name)
  if MUST_RAISE[name] then
    check(not ok, tag .. ": " .. name .. " inside the policy did not raise")
    -- the scenarios give valid arguments: the error must be the guard's
    if w.strict and not ok and name ~= "yield" then
      check(tostring(err):find("eviction policy", 1, true), tag .. ": " .. name .. " raised " .. tostring(err))
    end
  end
end
]=]

local function run(body, seconds)
  local out, rc = child.run(("ARGS = { path = %q, backend = %q }\n"):format(body.path, body.backend)
    .. HARNESS .. body.code, seconds or 120)
  return out, rc
end

-- The policy of every case: runs the actions the case lists (once), then
-- answers with the oldest candidates.
local SCENARIO = [=[
local w = { others = {}, strict = true }
local todo
w.m = load()
w.c = assert(kvlua.cache(w.m, { pages = 8, page_tokens = PT, policy = function(cands, need)
  local list = todo
  if not BATCH then todo = nil end -- in a batch: at every call (each session's pages)
  for _, name in ipairs(list or {}) do try(w, name, "policy") end
  local out = {}
  for i = 1, need do out[i] = cands[i] end
  return out
end }))
local filler = assert(w.m:session { ctx = CTX, cache = w.c })
assert(filler:prefill(some_ids(32, 64, 1), { logits = "none" })) -- 8 cached pages, none free
filler:close()
w.s = assert(w.m:session { ctx = CTX, cache = w.c })
w.others[1] = assert(w.m:session { ctx = CTX, cache = w.c })
assert(w.s:prefill(some_ids(6, 64, 2))) -- pages of its own the actions could take away
if not BATCH then
  todo = ACTION_LIST
  local ids = some_ids(10, 64, 3)
  local r = table.pack(eval_checked(w.s, #ids, "prefill", w.s.prefill, w.s, ids))
  check(r[1] and r[2], "the prefill failed: " .. tostring(r[2]) .. " " .. tostring(r[3]))
  check(todo == nil, "the policy was not called")
else
  -- the actions inside a decode_batch of both sessions (each needs a page)
  assert(w.s:prefill(some_ids(6, 64, 3))) -- to pos 12: its next token needs a page
  todo = ACTION_LIST
  local r = table.pack(eval_checked(w.s, 1, "decode_batch", kvlua.decode_batch, { w.s, w.others[1] }, { 11, 12 }))
  check(r[1] and r[2], "decode_batch failed: " .. tostring(r[2]) .. " " .. tostring(r[3]))
  todo = nil
end
for _, s in ipairs { w.s, w.others[1] } do verify(w.c, s, "after") end
stats_ok(w.c, "after")
os.remove(TMP)
print(#failures == 0 and "DONE" or ("FAILED\n" .. table.concat(failures, "\n")))
]=]

local function scenario(path, backend, actions, batch)
  local list = {}
  for i, a in ipairs(actions) do list[i] = ("%q"):format(a) end
  local code = SCENARIO:gsub("ACTION_LIST", "{ " .. table.concat(list, ", ") .. " }")
  code = "local BATCH = " .. tostring(batch or false) .. "\n" .. code
  return run({ path = path, backend = backend, code = code })
end

-- The fuzzer: seeds first..last, each a fresh cache and random sessions
-- doing random things while the policy does random things and answers
-- anything from the right pages to garbage, through metamethods too.
local FUZZ = [=[
local m
CALLS = 0
for seed = FIRST, LAST do
  math.randomseed(seed)
  local R = math.random
  if not m or tostring(m):find("closed", 1, true) then m = load() end
  local w = { m = m, others = {} }
  local fuzzing = true
  local function pick() return #w.others > 0 and w.others[R(#w.others)] or nil end
  local function answer(cands, need)
    local k = R(12)
    if k == 1 then error("policy error " .. seed) end
    if k == 2 then return nil end
    if k == 3 then return "garbage" end
    if k == 4 then return { 99999 } end
    if k == 5 and #cands > 0 then return { cands[1], cands[1] } end
    if k == 6 then return {} end
    local out = {}
    for i = 1, math.min(need, #cands) do out[i] = R(2) == 1 and cands[i] or cands[i].id end
    if k == 7 then -- reads through metamethods that act again
      return setmetatable({}, {
        __len = function() try(w, ACTIONS[R(#ACTIONS)], "policy __len"); return #out end,
        __index = function(_, i)
          try(w, ACTIONS[R(#ACTIONS)], "policy __index")
          local v = out[i]
          if type(v) == "table" then
            return setmetatable({}, { __index = function(_, key)
              try(w, ACTIONS[R(#ACTIONS)], "policy id __index")
              return v[key]
            end })
          end
          return v
        end,
      })
    end
    return out
  end
  w.c = assert(kvlua.cache(m, { pages = 4 + R(0, 6), page_tokens = PT, policy = function(cands, need)
    if fuzzing then
      CALLS = CALLS + 1
      for _ = 1, R(0, 3) do try(w, ACTIONS[R(#ACTIONS)], "seed " .. seed .. " policy") end
      return answer(cands, need)
    end
    local out = {}
    for i = 1, need do out[i] = cands[i] end
    return out
  end }))
  for step = 1, 40 do
    local tag = ("seed %d step %d"):format(seed, step)
    local s = pick()
    w.s = s
    w.rewind_n = R(2) == 1 and R(1, 6) or nil
    local k = R(12)
    local in_co = R(3) == 1
    local function call(moved, f, ...)
      if in_co then
        local args = table.pack(...)
        return eval_checked(s, moved, tag, function() return coroutine.wrap(f)(table.unpack(args, 1, args.n)) end)
      end
      return eval_checked(s, moved, tag, f, ...)
    end
    if k == 1 or not s then
      local ok, ns = pcall(m.session, m, { ctx = CTX, cache = w.c })
      if ok and ns then w.others[#w.others + 1] = ns end
    elseif k == 2 or k == 11 then -- pages that go to the cache: a session that prefills and goes
      local ok, ns = pcall(m.session, m, { ctx = CTX, cache = w.c })
      if ok and ns then
        w.s = ns
        pcall(ns.prefill, ns, some_ids(R(4, 16), 64, R(1, 4)))
        ns:close()
      end
    elseif k == 12 then
      s:close()
    elseif not is_open(s) then
      for i, x in ipairs(w.others) do if x == s then table.remove(w.others, i) break end end
    elseif k <= 5 then
      local n = R(1, 9)
      if s.pos + n <= CTX then call(n, s.prefill, s, some_ids(n, 64, R(1000))) end
    elseif k == 6 then
      if s.pos < CTX then call(1, s.decode, s, R(3, 63)) end
    elseif k == 7 then
      local t, ids = {}, {}
      for _, x in ipairs(w.others) do
        if is_open(x) and x.pos < CTX and #t < 3 then t[#t + 1] = x; ids[#ids + 1] = R(3, 63) end
      end
      if #t > 0 then
        local before = {}
        for i, x in ipairs(t) do before[i] = x.pos end
        local ok, rows = pcall(kvlua.decode_batch, t, ids)
        for i, x in ipairs(t) do
          if is_open(x) then
            local want = (ok and rows) and before[i] + 1 or before[i]
            check(x.pos == want, ("%s: decode_batch left pos %d, expected %d"):format(tag, x.pos, want))
          end
        end
      end
    elseif k == 8 then
      local ok, f = pcall(s.fork, s)
      if ok and f then w.others[#w.others + 1] = f end
    elseif k == 9 then
      pcall(s.rewind, s, R(0, 6))
    else
      if s.pos < CTX - 3 then
        pcall(function() for _ in s:generate { prompt = { R(3, 63) }, max_tokens = 2 } do end end)
      end
    end
    stats_ok(w.c, tag)
  end
  fuzzing = false
  for _, s in ipairs(w.others) do verify(w.c, s, "seed " .. seed) end
  for _, s in ipairs(w.others) do if is_open(s) then s:close() end end
  w.others = {}
  collectgarbage()
  stats_ok(w.c, "seed " .. seed .. " end")
  local ok, st = pcall(w.c.stats, w.c)
  if ok then check(st.used == 0, ("seed %d: %d pages still used with every session closed"):format(seed, st.used)) end
  pcall(w.c.close, w.c)
end
os.remove(TMP)
print("policy calls: " .. CALLS)
print(#failures == 0 and "DONE" or ("FAILED\n" .. table.concat(failures, "\n", 1, math.min(#failures, 20))))
]=]

local function fuzz(path, backend, first, last)
  local code = FUZZ:gsub("FIRST", tostring(first)):gsub("LAST", tostring(last))
  return run({ path = path, backend = backend, code = code }, 600)
end

local function assert_done(out, rc)
  assert(out:find("DONE", 1, true) and rc == 0, ("child (exit %s):\n%s"):format(tostring(rc), out:sub(-3000)))
end

describe("1: nothing an eviction policy does can change the evaluation that called it", function()
  local path
  -- head size 16: the smallest OpenCL takes for f16 pages
  setup(function() path = tiny.llama { seed = 21, n_embd = 64, n_ff = 128 } end)
  teardown(tiny.cleanup)

  it("a policy that rewinds the evaluating session raises there; the prefill succeeds with its pos", function()
    assert_done(scenario(path, "cpu", { "rewind" }))
  end)

  it("a policy that closes the evaluating session: the close waits for the evaluation", function()
    local out, rc = run({ path = path, backend = "cpu", code = [=[
      local w = { others = {} }
      w.m = load()
      local closed_inside
      w.c = assert(kvlua.cache(w.m, { pages = 8, page_tokens = PT, policy = function(cands, need)
        w.s:close()
        closed_inside = tostring(w.s)
        return table.move(cands, 1, need, 1, {})
      end }))
      local filler = assert(w.m:session { ctx = CTX, cache = w.c })
      assert(filler:prefill(some_ids(32, 64, 1), { logits = "none" }))
      filler:close()
      w.s = assert(w.m:session { ctx = CTX, cache = w.c })
      local l = w.s:prefill(some_ids(10, 64, 2))
      check(l ~= nil, "the prefill failed")
      check(closed_inside:find("closed", 1, true), "not closed inside: " .. tostring(closed_inside))
      check(not is_open(w.s), "open afterwards")
      check(w.c:stats().used == 0, "pages still used after the deferred close")
      print(#failures == 0 and "DONE" or table.concat(failures, "\n"))
    ]=] })
    assert_done(out, rc)
  end)

  for _, a in ipairs { "fork", "prefill", "decode", "decode_batch", "pin", "unpin", "clear", "save", "cache_save",
                       "shift", "session", "restore", "generate", "yield" } do
    it("a policy that tries " .. a .. " gets an error; the evaluation and the pages are right", function()
      assert_done(scenario(path, "cpu", { a }))
    end)
  end

  it("closing the model, the cache, other sessions and collecting garbage inside a policy breaks nothing", function()
    assert_done(scenario(path, "cpu", { "close_other", "collect", "close_model", "close_cache", "read" }))
  end)

  it("inside a decode_batch, a policy cannot rewind or decode any session of the batch", function()
    assert_done(scenario(path, "cpu", { "rewind", "decode", "close_other", "collect" }, true))
  end)

  it("a yield in a policy of an evaluation inside a coroutine is an error, not a crash", function()
    local out, rc = run({ path = path, backend = "cpu", code = [=[
      local m = load()
      local c = assert(kvlua.cache(m, { pages = 8, page_tokens = PT, policy = function(cands, need)
        coroutine.yield("from the policy")
        return { cands[1] }
      end }))
      local filler = assert(m:session { ctx = CTX, cache = c })
      assert(filler:prefill(some_ids(32, 64, 1), { logits = "none" }))
      filler:close()
      local s = assert(m:session { ctx = CTX, cache = c })
      local co = coroutine.create(function() return s:prefill(some_ids(10, 64, 2)) end)
      local ok, err = coroutine.resume(co)
      check(not ok and tostring(err):find("yield across a C%-call boundary"), "resume gave " .. tostring(err))
      check(s.pos == 0, "pos moved")
      print(#failures == 0 and "DONE" or table.concat(failures, "\n"))
    ]=] })
    assert_done(out, rc)
  end)

  for i = 0, 5 do
    it(("random policies and sessions on the CPU, seeds %d..%d"):format(50 * i + 1, 50 * i + 50), function()
      assert_done(fuzz(path, "cpu", 50 * i + 1, 50 * i + 50))
    end)
  end

  local opencl = #kvlua.devices() > 0 and it or pending
  opencl("OpenCL: the programs are built here, not under a child's time limit", function()
    -- a first load on a device builds its programs (minutes on a busy
    -- machine); the children then find them in the program cache
    assert(kvlua.load(path, { backend = "opencl", threads = 1 })):close()
  end)
  for i = 0, 1 do
    opencl(("random policies and sessions on OpenCL, seeds %d..%d"):format(1000 + 50 * i + 1, 1000 + 50 * i + 50),
      function()
        assert_done(fuzz(path, "opencl", 1000 + 50 * i + 1, 1000 + 50 * i + 50))
      end)
  end
end)

-- ==== 2: generate iterators and sessions that come back to the same pos ==========

describe("2: a generate iterator raises when its session moved, even back to the same pos", function()
  local m
  setup(function() m = assert(kvlua.load(tiny.llama { seed = 22 }, { threads = 1 })) end)
  teardown(function() m:close(); tiny.cleanup() end)

  local moved = "generate: the session moved under this iterator"

  it("s:rewind(1); s:decode(x) between two steps", function()
    local s = assert(m:session { ctx = 64 })
    local step = s:generate { prompt = { 1, 5 }, max_tokens = 8, ignore_eog = true }
    step()
    local at = s.pos
    s:rewind(1)
    assert(s:decode(7))
    assert.equals(at, s.pos)
    assert.has_error(function() step() end, ("%s (at %d, left at %d)"):format(moved, at, at))
  end)

  it("a shift and then a prefill of as many tokens as it dropped", function()
    local s = assert(m:session { ctx = 64 })
    local step = s:generate { prompt = some_ids(10, 64, 3), max_tokens = 8, ignore_eog = true }
    step()
    local at = s.pos
    assert(s:shift { keep = 2, drop = 3 })
    assert(s:prefill { 4, 5, 6 })
    assert.equals(at, s.pos)
    assert.has_error(function() step() end, ("%s (at %d, left at %d)"):format(moved, at, at))
  end)

  it("a rewind and a decode_batch step", function()
    local s, other = assert(m:session { ctx = 64 }), assert(m:session { ctx = 64 })
    assert(other:prefill { 1, 2 })
    local step = s:generate { prompt = { 1, 5 }, max_tokens = 8, ignore_eog = true }
    step()
    local at = s.pos
    s:rewind(1)
    assert(kvlua.decode_batch({ s, other }, { 7, 8 }))
    assert.equals(at, s.pos)
    assert.has_error(function() step() end, ("%s (at %d, left at %d)"):format(moved, at, at))
  end)

  it("its own steps, and what on_full does, are not moves: the iterator runs to the end", function()
    local s = assert(m:session { ctx = 16 })
    local n = 0
    for _ in s:generate { prompt = some_ids(8, 64, 4), max_tokens = 20, ignore_eog = true,
                          on_full = function(x) assert(x:shift { keep = 1, drop = 4 }) end } do
      n = n + 1
    end
    assert.equals("length", s.finish_reason)
    assert.equals(20, #s.generated)
  end)
end)

-- ==== 3: one base for device numbers ==============================================

describe("3: devices are numbered from 1 everywhere", function()
  local path
  setup(function() path = tiny.llama { seed = 23, n_embd = 64, n_ff = 128 } end)
  teardown(tiny.cleanup)

  local devices = kvlua.devices()
  local with_device = #devices > 0 and it or pending

  with_device("device = i loads kvlua.devices()[i], whose index is i; info.device_index says i", function()
    for i, d in ipairs(devices) do
      assert.equals(i, d.index)
      local m = assert(kvlua.load(path, { backend = "opencl", device = i, threads = 1 }))
      assert.equals(d.name, m.info.device)
      assert.equals(i, m.info.device_index)
      assert.same(devices[m.info.device_index], d)
      m:close()
    end
  end)

  with_device("a device outside 1..#kvlua.devices() is nil, a message naming the range", function()
    for _, i in ipairs { 0, -1, #devices + 1 } do
      local m, err = kvlua.load(path, { backend = "opencl", device = i })
      assert.is_nil(m)
      assert.equals(("no OpenCL device %d (kvlua.devices() lists %d: give 1 to %d)"):format(i, #devices, #devices),
        err)
    end
  end)

  it("the CPU backend takes no device: any number is ignored", function()
    local m = assert(kvlua.load(path, { backend = "cpu", device = 0, threads = 1 }))
    assert.equals("cpu", m.info.backend)
    assert.is_nil(m.info.device_index)
    m:close()
  end)
end)

-- ==== 4: token ids of pin / unpin / lookup ========================================

describe("4: cache:pin, unpin and lookup check token ids as every other call does", function()
  local m, c
  setup(function()
    m = assert(kvlua.load(tiny.llama { seed = 24 }, { threads = 1 }))
    c = assert(kvlua.cache(m, { pages = 16, page_tokens = 4 }))
  end)
  teardown(function() c:close(); m:close(); tiny.cleanup() end)

  for _, method in ipairs { "pin", "unpin", "lookup" } do
    it(method .. " raises for an id outside [0, n_vocab), naming the index, as s:prefill does", function()
      local n = m.info.n_vocab
      local ids = { 1, 2, 3, n }
      local s = assert(m:session { ctx = 16, cache = c })
      local _, want = pcall(s.prefill, s, ids)
      assert.matches(("token id %d at index 4 out of range %%[0, %d%%)"):format(n, n), want)
      assert.has_error(function() c[method](c, ids) end, (want:gsub("^.-: ", "", 1)))
      assert.has_error(function() c[method](c, { 1, -1 }) end)
      assert.has_error(function() c[method](c, { 1, 2.5 }) end)
      s:close()
    end)
  end

  it("ids in range still pin and look up", function()
    local ids = some_ids(8, m.info.n_vocab, 5)
    assert.is_true(c:pin(ids))
    assert.same({ cached = 0, tokens = 8, reason = "never seen" }, c:lookup(ids))
    assert.is_true(c:unpin(ids))
  end)
end)

-- ==== 5: metadata keys with a NUL byte ============================================

describe("5: every key model:meta_keys() lists reads back with model:meta()", function()
  teardown(tiny.cleanup)

  it("a key with a NUL byte is not listed (meta refuses such keys)", function()
    local w = W.tiny_llama { n_layer = 1, n_embd = 32, n_head = 4, n_head_kv = 2, n_ff = 64, n_vocab = 64, seed = 6 }
    w:kv("general.odd\0key", "string", "hidden")
    w:kv("general.plain", "string", "seen")
    local m = assert(kvlua.load(tiny.write(w:bytes()), { threads = 1 }))
    local keys = m:meta_keys()
    local listed = {}
    for _, k in ipairs(keys) do
      listed[k] = true
      assert.is_false(k:find("\0", 1, true) ~= nil, "a listed key with a NUL byte")
      assert.is_not_nil(m:meta(k), k)
    end
    assert.is_true(listed["general.plain"])
    assert.equals("seen", m:meta("general.plain"))
    assert.has_error(function() m:meta("general.odd\0key") end)
    m:close()
  end)
end)
