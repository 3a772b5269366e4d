-- Chat prompts and replies against llama.cpp on both real models, through
-- every chat path: chat.encode, scripts/generate.lua --chat,
-- scripts/chat.lua, chat items of scripts/batch-generate.lua (which run
-- through kvlua.scheduler) and kvlua.agent.
--
-- Reference: tests/fixtures/ref_chat_{smollm2,gemma3}.lua, made by
-- scripts/ref/gen-chat-ref-fixtures.py (its header says how): the jinja2
-- render of each conversation, llama.cpp's token ids for it (one BOS where
-- the vocab adds one; special tokens parsed in the template's text, not in
-- the contents), and llama.cpp's greedy reply with the top1 - top2 margin
-- of every step, and the same margins from a float64 forward pass. Replies
-- are compared up to the first step where either is below CLEAR_MARGIN (as
-- in spec/reference_spec.lua) or they choose differently: llama.cpp's own
-- margin can be a logit off (Gemma 3 "system", step 4: llama.cpp 1.08, the
-- float64 pass 0.02). Prompts are compared id for id.
--
-- Findings (project issue "Corrections"):
--  2. every chat path tokenized the render with add_special = true, so a
--     template that writes BOS itself (Gemma 3) gave two BOS tokens, and
--     greedy Gemma 3 answered "Name three colors." with "Name\nName...".
--     Now chat.encode is the one tokenization of a chat: exactly one BOS
--     where model.vocab.add_bos asks for it.
--  6. (prompt injection) contents were tokenized with parse_special, so a
--     user message or tool result holding "<|im_end|>", "<end_of_turn>" or
--     "<bos>" became those control tokens; chat.encode keeps contents text.
-- The scripts run unchanged under spec/support/chat_spy.lua, which records
-- the ids each reply is conditioned on and the ids generated.

local kvlua = require "kvlua"
local chat = require "kvlua.chat"
local agent = require "kvlua.agent"
local models = require "support.models"

local CLEAR_MARGIN = 0.60
local BUILD = os.getenv("KVLUA_BUILD") or "build"

local function q(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local function tmpname()
  local p = os.tmpname()
  os.remove(p)
  return p
end

local function read_lines(path)
  local t = {}
  local f = io.open(path, "rb")
  if not f then return t end
  for line in f:lines() do t[#t + 1] = line end
  f:close()
  return t
end

local function ids_of(s)
  local t = {}
  for n in s:gmatch("%-?%d+") do t[#t + 1] = math.tointeger(tonumber(n)) end
  return t
end

-- Runs a script under the spy; returns its stdout and the spy's records
-- ({context =, generated =} for s:generate, {request =} for the scheduler).
local function run_script(script, args, stdin)
  local spy, outp = tmpname(), tmpname()
  local cmd = ("KVLUA_BUILD=%s KVLUA_CHAT_SPY=%s lua5.4 -l spec.support.chat_spy scripts/%s %s > %s 2>&1")
    :format(q(BUILD), q(spy), script, args, q(outp))
  if stdin then
    local inp = tmpname()
    local f = assert(io.open(inp, "wb"))
    f:write(stdin)
    f:close()
    cmd = cmd .. " < " .. q(inp)
  end
  local ok = os.execute(cmd)
  local f = io.open(outp, "rb")
  local out = f and f:read("a") or ""
  if f then f:close() end
  os.remove(outp)
  assert(ok, script .. " failed:\n" .. out)
  local records = {}
  for _, line in ipairs(read_lines(spy)) do
    local ctx, gen = line:match("^generate ([^|]*)|(.*)$")
    if ctx then
      records[#records + 1] = { context = ids_of(ctx), generated = ids_of(gen) }
    else
      records[#records + 1] = { request = ids_of(assert(line:match("^request (.*)$"))) }
    end
  end
  os.remove(spy)
  return out, records
end

-- Whether the reference's step i is a clear choice: by llama.cpp and by the
-- float64 pass, the same token.
local function clear(case, i)
  return case.greedy_margin[i] >= CLEAR_MARGIN and case.exact_margin[i] >= CLEAR_MARGIN
    and case.exact_top[i] == case.greedy[i]
end

-- got (generated ids) agrees with the reference's greedy reply up to its
-- first unclear step; the reply ends where the reference's does only if every
-- step was clear. got may lack the final end-of-generation id.
local function same_reply(case, got, what)
  for i, want in ipairs(case.greedy) do
    if not clear(case, i) then return end
    if got[i] == nil and i == #case.greedy then return end -- the EOG id, not kept
    assert.are.equal(want, got[i], ("%s: reply token %d (reference margin %.3f)"):format(what, i,
      case.greedy_margin[i]))
  end
end

local function clear_reply(case)
  for i = 1, #case.greedy do
    if not clear(case, i) then return false end
  end
  return true
end

local function same_ids(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do
    if a[i] ~= b[i] then return false end
  end
  return true
end

-- generate.lua and the agent take a system message and one user message.
local function single_turn(case)
  local m = case.messages
  if #m == 1 and m[1].role == "user" then return nil, m[1].content end
  if #m == 2 and m[1].role == "system" and m[2].role == "user" then return m[1].content, m[2].content end
end

for _, mname in ipairs{ "smollm2", "gemma3" } do
  local fx = dofile("tests/fixtures/ref_chat_" .. mname .. ".lua")
  local path = models.path(mname)
  local model
  local function get()
    if not path then return nil end
    model = model or assert(kvlua.load(path, { threads = 2, backend = "cpu" }))
    return model
  end
  local all = {}        -- every conversation of the fixture, second turns included
  for _, c in ipairs(fx.cases) do
    all[#all + 1] = c
    for k, t in ipairs(c.turns or {}) do
      t.name = c.name .. "/" .. (k + 1)
      all[#all + 1] = t
    end
  end

  describe("chat against llama.cpp on " .. mname .. " (finding 2: one BOS; finding 6: contents are text)", function()
    teardown(function()
      if model then model:close() end
    end)

    it("chat.encode gives llama.cpp's ids for every conversation", function()
      local m = get()
      if not m then return pending("model " .. mname .. " not available") end
      for _, c in ipairs(all) do
        local ids, text = chat.encode(m, c.messages, { add_generation_prompt = true })
        assert(ids, text)
        assert.are.equal(c.text, text, c.name .. ": the render")
        assert.are.same(c.ids, ids, c.name)
        if c.naive_ids then -- the render parsed whole would inject control tokens
          assert.are_not.same(c.naive_ids, ids, c.name)
        end
      end
    end)

    it("starts a prompt with one BOS exactly where the vocab adds one", function()
      local m = get()
      if not m then return pending("model " .. mname .. " not available") end
      local bos = m.vocab.bos
      assert.are.equal(fx.add_bos, m.vocab.add_bos)
      for _, c in ipairs(all) do
        local ids = assert(chat.encode(m, c.messages))
        local n = 0
        for _, id in ipairs(ids) do
          if id == bos then n = n + 1 end
        end
        if fx.add_bos then
          assert.are.equal(bos, ids[1], c.name)
          assert.are.equal(1, n, c.name .. ": BOS tokens")
        end -- (SmolLM2: no add_bos, and its BOS id is <|im_start|>, which the template writes)
      end
      -- a template that does not write BOS gets it from the vocab's flag
      if fx.add_bos then
        local ids = assert(chat.encode(m, { { role = "user", content = "hi" } }, { template = "chatml" }))
        assert.are.equal(bos, ids[1])
        assert.are_not.equal(bos, ids[2])
      end
    end)

    it("replies greedily as llama.cpp does (prompt from chat.encode)", function()
      local m = get()
      if not m then return pending("model " .. mname .. " not available") end
      for _, c in ipairs(all) do
        if c.greedy then
          local s = assert(m:session { ctx = 2048 })
          local got = {}
          for _ in s:generate { prompt = assert(chat.encode(m, c.messages)), max_tokens = fx.n_reply } do end
          for i, id in ipairs(s.generated) do got[i] = id end
          same_reply(c, got, c.name)
          s:close()
        end
      end
    end)

    it("scripts/generate.lua --chat prompts and replies as llama.cpp", function()
      if not path then return pending("model " .. mname .. " not available") end
      for _, c in ipairs(fx.cases) do
        local system, user = single_turn(c)
        if user then
          local n = c.greedy and fx.n_reply or 1
          local args = ("--model %s --threads 2 --backend cpu --chat --prompt %s --temp 0 --repeat-penalty 1 "
            .. "--max-tokens %d --json"):format(q(path), q(user), n)
          if system then args = args .. " --system " .. q(system) end
          local _, rec = run_script("generate.lua", args)
          assert.are.equal(1, #rec, c.name)
          assert.are.same(c.ids, rec[1].context, c.name .. ": prompt ids")
          if c.greedy then same_reply(c, rec[1].generated, "generate.lua " .. c.name) end
        end
      end
    end)

    it("scripts/chat.lua prompts and replies as llama.cpp, turn after turn", function()
      if not path then return pending("model " .. mname .. " not available") end
      for _, c in ipairs(fx.cases) do
        local system, user = single_turn(c)
        if c.greedy and user then
          local turns = { user }
          for _, t in ipairs(c.turns or {}) do turns[#turns + 1] = t.messages[#t.messages].content end
          local args = ("--model %s --threads 2 --backend cpu --prompt %s --temp 0 --max-tokens %d")
            :format(q(path), q(table.concat(turns, "|||")), fx.n_reply)
          if system then args = args .. " --system " .. q(system) end
          local _, rec = run_script("chat.lua", args)
          assert.are.equal(#turns, #rec, c.name)
          assert.are.same(c.ids, rec[1].context, c.name .. ": prompt ids")
          same_reply(c, rec[1].generated, "chat.lua " .. c.name)
          for k, t in ipairs(c.turns or {}) do
            -- the next turn holds our reply: llama.cpp's where every step was clear (or we chose
            -- llama.cpp's tokens past its near-ties too)
            if clear_reply(c) then assert.are.same(c.greedy, rec[1].generated, c.name .. ": the reply") end
            if same_ids(c.greedy, rec[1].generated) then
              assert.are.same(t.ids, rec[k + 1].context, t.name .. ": prompt ids")
              same_reply(t, rec[k + 1].generated, "chat.lua " .. t.name)
            end
          end
        end
      end
    end)

    it("chat items of scripts/batch-generate.lua (kvlua.scheduler) prompt and reply as llama.cpp", function()
      if not path then return pending("model " .. mname .. " not available") end
      local json = require "kvlua.json"
      local input, output = tmpname(), tmpname()
      local f = assert(io.open(input, "wb"))
      for _, c in ipairs(all) do
        f:write(json.encode { id = c.name, messages = c.messages, max_tokens = c.greedy and fx.n_reply or 1 }, "\n")
      end
      f:close()
      local _, rec = run_script("batch-generate.lua", ("--file %s --output %s --model %s --threads 2 --backend cpu "
        .. "--temp 0 --ids --no-timings --quiet --batch 3"):format(q(input), q(output), q(path)))
      local lines = read_lines(output)
      os.remove(input)
      os.remove(output)
      assert.are.equal(#all, #rec)
      assert.are.equal(#all, #lines)
      for i, c in ipairs(all) do
        assert.are.same(c.ids, rec[i].request, c.name .. ": prompt ids")
        local r = json.decode(lines[i])
        assert.are.equal(c.name, r.id)
        if c.greedy then same_reply(c, r.ids, "batch-generate " .. c.name) end
      end
    end)

    it("kvlua.agent prompts and replies as llama.cpp", function()
      local m = get()
      if not m then return pending("model " .. mname .. " not available") end
      local checked = 0
      for _, c in ipairs(fx.cases) do
        local system, user = single_turn(c)
        if system then
          local a = assert(agent.new(m, { system = system, max_tokens = c.greedy and fx.n_reply or 1, ctx = 2048 }))
          local _, info = assert(a:turn(user))
          local tokens = a.session:tokens()
          assert.are.equal(#c.ids, info.rounds[1].conversation, c.name)
          assert.are.same(c.ids, table.move(tokens, 1, #c.ids, 1, {}), c.name .. ": prompt ids")
          if c.greedy then same_reply(c, table.move(tokens, #c.ids + 1, #tokens, 1, {}), "agent " .. c.name) end
          a:close()
          checked = checked + 1
        end
      end
      assert.is_true(checked >= 2)
    end)
  end)
end
