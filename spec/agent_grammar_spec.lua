-- kvlua.agent's constrained generation (constrain = true): each assistant
-- message is drawn under a grammar built from the tool registry, so it is
-- free text or a call that names a registered tool and has valid
-- arguments, in both protocols. One describe per point:
--
--   grammar 1  the text protocol's grammar: calls {"tool": ..., args} with
--              each tool's parameters (types, optional ones, their order),
--              free text that does not start (after whitespace) with '{'
--   grammar 2  the hermes grammar: <tool_call> {"name":, "arguments": {}}
--              </tool_call>, free text that nowhere holds "<tool_call>"
--   grammar 3  a call's longest text is a.call_bytes, and a call is never
--              cut: a reply may pass max_tokens to finish its call, while
--              free text still ends at max_tokens
--   grammar 4  random replies of tiny random-weight models over many seeds
--              (a sampler that draws among the tokens the grammar leaves,
--              and one on the model's own logits): every message is free
--              text or a call that parses and validates, by a checker of
--              this file, not the agent's parser
--   grammar 5  <tool_call> as a special token: a user-defined token (as in
--              Qwen's vocabulary) is text the grammar allows whole; a
--              control token is never allowed, and the marker is spelled
--   grammar 6  a sampler that ignores the grammar makes the turn fail with
--              a message, never a silent bad call
--   grammar 7  options: constrain defaults to on with tools, off without;
--              constrain = false keeps the free path; examples = false;
--              a:reset() starts a new conversation on the cached prefix
--   grammar 8  SmolLM2 (pending when missing): a few turns, greedy and
--              constrained, call the right tool with valid arguments
local kvlua = require "kvlua"
local agent = require "kvlua.agent"
local json = require "kvlua.json"
local sampling = require "kvlua.sampling"
local tiny = require "spec.support.tiny_models"
local W = require "spec.support.gguf_writer"
local script = require("spec.support.samplers").script
local models = require "spec.support.models"

local EOS = 2

-- ==== the tools, and an independent check of calls =============================

-- name -> parameters, as registered; the checker below reads this table.
local TOOLS = {
  { name = "add", parameters = { { name = "a", type = "number" }, { name = "b", type = "integer" } } },
  { name = "weather", parameters = { { name = "city", type = "string" },
    { name = "days", type = "integer", optional = true }, { name = "metric", type = "boolean", optional = true } } },
  { name = "now", parameters = {} },
  { name = "note", parameters = { { name = "text", type = "string", optional = true },
    { name = "tag", type = "string", optional = true } } },
}

local function registry(only)
  local reg = agent.registry()
  for _, t in ipairs(TOOLS) do
    if not only or only[t.name] then
      reg:add { name = t.name, description = "The " .. t.name .. " tool.", parameters = t.parameters,
        fn = function() return "done" end }
    end
  end
  return reg
end

local TYPE_OK = {
  string = function(v) return type(v) == "string" and utf8.len(v) ~= nil end,
  integer = function(v) return math.type(v) == "integer" or (math.type(v) == "float" and v == math.floor(v)) end,
  number = function(v) return type(v) == "number" and v == v and v ~= math.huge and v ~= -math.huge end,
  boolean = function(v) return type(v) == "boolean" end,
}

-- Whether name and args (a decoded JSON object) are a valid call of TOOLS:
-- true | false, why.
local function valid_call(name, args)
  for _, t in ipairs(TOOLS) do
    if t.name == name then
      if type(args) ~= "table" then return false, "arguments not an object" end
      local known = {}
      for _, p in ipairs(t.parameters) do
        known[p.name] = true
        local v = args[p.name]
        if v == nil then
          if not p.optional then return false, "missing " .. p.name end
        elseif not TYPE_OK[p.type](v) then
          return false, p.name .. " is not a " .. p.type
        end
      end
      for k in pairs(args) do
        if not known[k] then return false, "unknown argument " .. tostring(k) end
      end
      return true
    end
  end
  return false, "no tool " .. tostring(name)
end

-- Classifies one assistant message: "text" | "call" | nil, why (neither).
local CHECK = {
  text = function(msg)
    local body = msg:match("^%s*(.-)%s*$")
    if body:sub(1, 1) ~= "{" then return "text" end
    local v, err = json.decode(body)
    if v == nil then return nil, "a call that is not JSON: " .. err end
    if type(v) ~= "table" or type(v.tool) ~= "string" then return nil, "no \"tool\" key" end
    local args = {}
    for k, x in pairs(v) do
      if k ~= "tool" then args[k] = x end
    end
    local ok, why = valid_call(v.tool, args)
    if not ok then return nil, why end
    return "call"
  end,
  hermes = function(msg)
    if not msg:find("<tool_call>", 1, true) then return "text" end
    local body = msg:match("^<tool_call>\n?(.-)\n?</tool_call>$")
    if not body then return nil, "a call that is not <tool_call>...</tool_call>" end
    local v, err = json.decode(body)
    if v == nil then return nil, "a call that is not JSON: " .. err end
    if type(v) ~= "table" or type(v.name) ~= "string" then return nil, "no \"name\"" end
    local keys = 0
    for _ in pairs(v) do keys = keys + 1 end
    if keys ~= 2 or v.arguments == nil then return nil, "keys other than name and arguments" end
    local ok, why = valid_call(v.name, v.arguments)
    if not ok then return nil, why end
    return "call"
  end,
}

-- ==== samplers ==================================================================

-- The id of the token whose piece is one byte b in the tiny bytes vocabulary.
local function byte_id(b) return tiny.id(b) end

-- A sampler that draws uniformly among the tokens left finite (those the
-- grammar allows), and at the start of a reply, with probability p_call,
-- spells `marker` (the start of a call) while the grammar allows it; so
-- random replies are calls about as often as text. It keeps each reply's
-- text and token count (a reply ends at EOS, or at "</tool_call>").
local function explorer(model, seed, marker, p_call)
  local x = seed * 7919 + 17
  local function rand()
    x = (x * 1103515245 + 12345) % 2147483648
    return x / 2147483648
  end
  local s = { reply = "", n = 0, replies = {}, lengths = {} }
  local following
  function s:sample(l)
    if self.n == 0 then following = rand() < p_call end
    local row = l:totable()
    if following and #self.reply < #marker and marker:sub(1, #self.reply) == self.reply then
      local id = byte_id(marker:byte(#self.reply + 1))
      if row[id + 1] > -math.huge then return id end
    end
    local allowed = {}
    for i, v in ipairs(row) do
      if v > -math.huge then allowed[#allowed + 1] = i - 1 end
    end
    assert(#allowed > 0, "no token allowed")
    return allowed[1 + math.floor(rand() * #allowed)]
  end
  function s:accept(id)
    if id == EOS then
      self.replies[#self.replies + 1], self.lengths[#self.lengths + 1] = self.reply, self.n
      self.reply, self.n = "", 0
      return
    end
    self.n = self.n + 1
    self.reply = self.reply .. model:piece(id, false)
    if self.reply:sub(-#"</tool_call>") == "</tool_call>" then
      self.replies[#self.replies + 1], self.lengths[#self.lengths + 1] = self.reply, self.n
      self.reply, self.n = "", 0
    end
  end
  return s
end

local models_by_seed = {}
local function tiny_model(seed)
  if not models_by_seed[seed] then
    models_by_seed[seed] = assert(kvlua.load(tiny.llama { vocab = "bytes", seed = seed }, { threads = 1 }))
  end
  return models_by_seed[seed]
end

teardown(function()
  for _, m in pairs(models_by_seed) do m:close() end
  tiny.cleanup()
end)

-- A grammar state of the agent's grammar, fed text: "end" (a whole
-- message), "prefix" (a message may go on from it) or "refused".
local function feed(model, protocol, reg, text, max_string)
  local g = assert(kvlua.grammar((agent.protocols[protocol].grammar(reg, max_string or 16))))
  local st = g:state(model)
  if not st:accept_text(text) then return "refused" end
  return st:can_end() and "end" or "prefix"
end

-- ==== grammar 1 ===================================================================

describe("grammar 1: the text protocol's grammar", function()
  local model, reg
  setup(function()
    model, reg = tiny_model(4), registry()
  end)

  it("allows each tool's calls with its parameters' types, optional ones left out or not", function()
    for _, t in ipairs {
      '{"tool": "add", "a": 2, "b": 3}', '{"tool":"add","a":-2.5e10,"b":0}', '{"tool": "add", "a": 0.125, "b": -7}',
      '{"tool": "weather", "city": "Paris"}', '{"tool": "weather", "city": "S\\u00e3o", "days": 3}',
      '{"tool": "weather", "city": "São Paulo", "metric": true}',
      '{"tool": "weather", "city": "a\\"b", "days": 1, "metric": false}',
      '{"tool": "now"}', '{"tool": "note"}', '{"tool": "note", "tag": "x"}', '{"tool": "note", "text": "", "tag": "y"}',
    } do
      -- \u escapes are left out of the grammar: those texts are refused (narrower, never wider)
      local want = t:find("\\u", 1, true) and "refused" or "end"
      assert.equals(want, feed(model, "text", reg, t), t)
    end
  end)

  it("refuses calls of unknown tools, missing, unknown or mistyped arguments, and text after the call", function()
    for _, t in ipairs {
      '{"tool": "nope"}', '{"tool": "add", "a": 2}', '{"tool": "add", "a": 2, "b": 3, "c": 4}',
      '{"tool": "add", "a": "2", "b": 3}', '{"tool": "add", "a": 2, "b": 3.5}', '{"tool": "add", "a": 1e999, "b": 1}',
      '{"tool": "weather", "city": 7}', '{"tool": "weather", "city": "x", "metric": 1}', '{"tool": "now", "x": 1}',
      '{"tool": "note", "tag": "x", "text": "y"}', -- the order of the parameters
      '{"tool": "now"} and more', '{"name": "now"}', '  {"tool": "now"}', '\n{',
      '{"tool": "weather", "city": "' .. string.rep("x", 17) .. '"}', -- max_string 16
    } do
      assert.equals("refused", feed(model, "text", reg, t), t)
    end
  end)

  it("allows any free text whose first character after whitespace is not '{'", function()
    for _, t in ipairs { "", "   ", "Hello {\"tool\": \"now\"}", " It is sunny.\n\n{", "\t- a\n- b", "é{" } do
      assert.equals("end", feed(model, "text", reg, t), t)
    end
  end)
end)

-- ==== grammar 2 ===================================================================

describe("grammar 2: the hermes grammar", function()
  local model, reg
  setup(function()
    model, reg = tiny_model(4), registry()
  end)

  it("allows <tool_call> JSON with a tool's name and arguments, with or without newlines inside the tags", function()
    for _, t in ipairs {
      '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
      '<tool_call>{"name":"now","arguments":{}}</tool_call>',
      '<tool_call>{"name": "note", "arguments": {}}</tool_call>',
      '<tool_call>{"name": "note", "arguments": {"tag": "t"}}</tool_call>',
      '<tool_call>\n{"name": "weather", "arguments": {"city": "Rome", "metric": false}}</tool_call>',
    } do
      assert.equals("end", feed(model, "hermes", reg, t), t)
    end
  end)

  it("refuses bad calls and any text holding <tool_call>", function()
    for _, t in ipairs {
      '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', '<tool_call>{"name": "now"}</tool_call>',
      '<tool_call>{"name": "weather", "arguments": {"metric": true}}</tool_call>',
      '<tool_call>{"name": "note", "arguments": {"tag": "t", "text": "x"}}</tool_call>',
      '<tool_call>{"arguments": {}, "name": "now"}</tool_call>',
      'Let me check. <tool_call>', 'x<<tool_call>', '<<tool_call>', 'a\n<tool_call>\n',
    } do
      assert.equals("refused", feed(model, "hermes", reg, t), t)
    end
  end)

  it("allows free text up to, but not into, the marker", function()
    for _, t in ipairs { "", "It is 5.", "<tool_call", "a <tool_cal", "</tool_call>", "<<tool_cal <tool_call x",
      "<t<to<too" } do
      assert.equals("end", feed(model, "hermes", reg, t), t)
    end
  end)
end)

-- ==== grammar 3 ===================================================================

describe("grammar 3: a call's longest text, and calls never cut", function()
  it("a.call_bytes is the length of the longest call the grammar allows", function()
    local model = tiny_model(4)
    local reg = registry { weather = true, add = true }
    -- hand-built longest calls: a space wherever one may go, max_string
    -- characters of 4 bytes, numbers with every digit they may have
    local city = '"' .. string.rep("😀", 5) .. '"'
    local days = "-1234567890123456"
    local a = "-1234567890123456.1234567890123456e-99"
    local longest = {
      text = { '{ "tool" : "weather" , "city" : ' .. city .. ' , "days" : ' .. days .. ' , "metric" : false }',
        '{ "tool" : "add" , "a" : ' .. a .. ' , "b" : ' .. days .. ' }' },
      hermes = { '<tool_call>\n{ "name" : "weather" , "arguments" : { "city" : ' .. city .. ' , "days" : ' .. days
        .. ' , "metric" : false } }\n</tool_call>',
        '<tool_call>\n{ "name" : "add" , "arguments" : { "a" : ' .. a .. ' , "b" : ' .. days .. ' } }\n</tool_call>' },
    }
    for protocol, calls in pairs(longest) do
      local ag = assert(agent.new(model, { tools = reg, template = "chatml", protocol = protocol, max_string = 5,
        ctx = 1024 }))
      assert.equals("end", feed(model, protocol, reg, calls[1], 5))
      assert.equals("end", feed(model, protocol, reg, calls[2], 5))
      assert.equals(math.max(#calls[1], #calls[2]), ag.call_bytes, protocol)
      ag:close()
    end
  end)

  it("finishes every call it starts past max_tokens, and ends free text at max_tokens", function()
    for _, protocol in ipairs { "text", "hermes" } do
      local marker = protocol == "text" and "{" or "<tool_call>"
      for seed = 1, 6 do
        local model = tiny_model(4)
        -- every reply a call (p_call 1), then every reply text (p_call 0)
        for _, p_call in ipairs { 1, 0 } do
          local sm = explorer(model, seed, marker, p_call)
          local a = assert(agent.new(model, { tools = registry(), template = "chatml", protocol = protocol,
            sampler = sm, max_tokens = 3, max_string = 8, max_tool_calls = 2, ctx = 4096, examples = false }))
          local first = #a.messages
          local reply, info = a:turn("Go.")
          assert.is_truthy(reply, info)
          for i = first + 1, #a.messages do
            local m = a.messages[i]
            if m.role == "assistant" then
              local kind, why = CHECK[protocol](m.content)
              assert.is_truthy(kind, ("seed %d: %q: %s"):format(seed, m.content, tostring(why)))
              assert.equals(p_call == 1 and "call" or "text", kind, m.content)
            end
          end
          for _, c in ipairs(info.tool_calls) do assert.is_true(c.ok, c.result) end
          if p_call == 0 then
            assert.is_true(#sm.lengths > 0)
            -- 3 tokens, or up to 3 more to finish a character split over byte tokens
            for _, n in ipairs(sm.lengths) do assert.is_true(n <= 6, "a free-text reply of " .. n .. " tokens") end
          else
            assert.equals(2, #info.tool_calls)
          end
          a:close()
        end
      end
    end
  end)
end)

-- ==== grammar 4 ===================================================================

describe("grammar 4: random replies of tiny random models are free text or valid calls", function()
  local function run(protocol, model_seed, seed, sampler_of)
    local model = tiny_model(model_seed)
    local sm = sampler_of(model, seed)
    local a = assert(agent.new(model, { tools = registry(), template = "chatml", protocol = protocol, sampler = sm,
      max_tokens = 24, max_string = 12, max_tool_calls = 3, ctx = 4096 }))
    local counts = { text = 0, call = 0 }
    for _, user in ipairs { "What is 2 plus 3?", "Weather in Rome?" } do
      local first = #a.messages
      local reply, info = a:turn(user)
      assert.is_truthy(reply, info)
      for i = first + 1, #a.messages do
        local m = a.messages[i]
        if m.role == "assistant" then
          local kind, why = CHECK[protocol](m.content)
          assert.is_truthy(kind, ("%s, model %d, seed %d: %q: %s"):format(protocol, model_seed, seed, m.content,
            tostring(why)))
          counts[kind] = counts[kind] + 1
        end
      end
      for _, c in ipairs(info.tool_calls) do assert.is_true(c.ok, c.result) end
    end
    a:close()
    return counts
  end

  for _, protocol in ipairs { "text", "hermes" } do
    it("in the " .. protocol .. " protocol, drawing among the allowed tokens (40 seeds, 2 models)", function()
      local marker = protocol == "text" and "{" or "<tool_call>"
      local total = { text = 0, call = 0 }
      for _, model_seed in ipairs { 4, 7 } do
        for seed = 1, 20 do
          local c = run(protocol, model_seed, seed, function(model, s) return explorer(model, s, marker, 0.5) end)
          total.text, total.call = total.text + c.text, total.call + c.call
        end
      end
      -- both branches were exercised
      assert.is_true(total.call >= 20, "calls: " .. total.call)
      assert.is_true(total.text >= 20, "texts: " .. total.text)
    end)

    it("in the " .. protocol .. " protocol, sampling the model's logits (temperature 2, 20 seeds)", function()
      for seed = 1, 20 do
        run(protocol, 7, seed, function(_, s) return sampling.from_opts { temp = 2.0, seed = s } end)
      end
    end)
  end
end)

-- ==== grammar 5 ===================================================================

-- A tiny model whose vocabulary has "<tool_call>" and "</tool_call>" as
-- tokens of type tt (4: user-defined, 3: control) after the bytes
-- vocabulary; returns the model and the two ids.
local function marker_model(tt)
  local tokens, types = tiny.byte_vocab()
  tokens[#tokens + 1], types[#types + 1] = "<tool_call>", tt
  tokens[#tokens + 1], types[#types + 1] = "</tool_call>", tt
  local w = W.tiny_llama { n_layer = 2, n_embd = 32, n_head = 4, n_head_kv = 2, n_ff = 64, n_vocab = #tokens,
    tokens = tokens, token_type = types, seed = 5, n_ctx = 512 }
  local m = assert(kvlua.load(tiny.write(w:bytes()), { threads = 1 }))
  return m, #tokens - 2, #tokens - 1
end

-- The allowed ids of a state, as a set.
local function allowed_set(model, st)
  local l = model:session { ctx = 16 }
  local logits = assert(l:prefill { 1 })
  local work = logits:clone()
  st:mask(work)
  local set = {}
  for i, v in ipairs(work:totable()) do
    if v > -math.huge then set[i - 1] = true end
  end
  l:close()
  return set
end

describe("grammar 5: <tool_call> as a special token", function()
  it("a user-defined <tool_call> token (as Qwen's) is allowed whole where a call starts; the call parses", function()
    local model, open_id, close_id = marker_model(4)
    local reg = registry { add = true }
    local g = assert(kvlua.grammar((agent.protocols.hermes.grammar(reg, 8))))
    local set = allowed_set(model, g:state(model))
    assert.is_true(set[open_id])
    assert.is_true(set[byte_id(("<"):byte())])
    -- after it, only the call's JSON (or a newline)
    local st = g:state(model)
    assert.is_true(st:accept(open_id))
    set = allowed_set(model, st)
    assert.is_nil(set[close_id])
    assert.is_nil(set[open_id])
    assert.is_true(set[byte_id(("{"):byte())])
    assert.is_true(set[byte_id(("\n"):byte())])
    -- a reply through the two marker tokens
    local body = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    local ids = { open_id }
    for i = 1, #body do ids[#ids + 1] = byte_id(body:byte(i)) end
    ids[#ids + 1] = close_id
    for _, c in ipairs { ("3."):byte(1, -1) } do ids[#ids + 1] = byte_id(c) end
    ids[#ids + 1] = EOS
    local a = assert(agent.new(model, { tools = reg, template = "chatml", protocol = "hermes", sampler = script(ids),
      ctx = 2048, examples = false }))
    local reply, info = a:turn("1 + 2?")
    assert.equals("3.", reply)
    assert.same({ { name = "add", arguments = { a = 1, b = 2 }, ok = true, result = "done" } }, info.tool_calls)
    a:close()
    model:close()
  end)

  it("a control <tool_call> token is never allowed: the marker is spelled in bytes", function()
    local model, open_id, close_id = marker_model(3)
    local reg = registry { add = true }
    local g = assert(kvlua.grammar((agent.protocols.hermes.grammar(reg, 8))))
    local set = allowed_set(model, g:state(model))
    assert.is_nil(set[open_id])
    assert.is_nil(set[close_id])
    assert.is_true(set[byte_id(("<"):byte())])
    -- random replies still give valid calls
    for seed = 1, 5 do
      local a = assert(agent.new(model, { tools = reg, template = "chatml", protocol = "hermes", max_tokens = 8,
        sampler = explorer(model, seed, "<tool_call>", 1), ctx = 2048, examples = false, max_tool_calls = 1 }))
      local _, info = a:turn("Go.")
      assert.equals(1, #info.tool_calls)
      assert.is_true(info.tool_calls[1].ok, info.tool_calls[1].result)
      a:close()
    end
    model:close()
  end)
end)

-- ==== grammar 6 ===================================================================

local function spell(text)
  local ids = {}
  for i = 1, #text do ids[#ids + 1] = byte_id(text:byte(i)) end
  ids[#ids + 1] = EOS
  return ids
end

describe("grammar 6: a sampler that ignores the grammar", function()
  it("makes the turn return nil and a message, not a bad call", function()
    local model = tiny_model(4)
    local a = assert(agent.new(model, { tools = registry(), template = "chatml", ctx = 2048,
      sampler = script(spell('{"tool": "add", "a": }')) }))
    local calls = 0
    a.on_tool = function() calls = calls + 1 end
    local reply, err = a:turn("Add.")
    assert.is_nil(reply)
    assert.matches("the sampler picked a token the grammar refuses", err)
    assert.equals(0, calls)
    a:close()
  end)
end)

-- ==== grammar 7 ===================================================================

describe("grammar 7: options", function()
  it("constrain is on by default with tools, off without; constrain = true without tools raises", function()
    local model = tiny_model(4)
    local a = assert(agent.new(model, { tools = registry(), template = "chatml", ctx = 1024 }))
    assert.is_true(a.constrain)
    a:close()
    a = assert(agent.new(model, { template = "chatml", ctx = 1024 }))
    assert.is_false(a.constrain)
    a:close()
    assert.has_error(function() agent.new(model, { constrain = true, template = "chatml" }) end,
      "agent.new: constrain needs tools, kvlua.grammar and a protocol with a grammar")
    assert.has_error(function() agent.new(model, { tools = registry(), max_string = 0 }) end)
  end)

  it("constrain = false generates freely: a call the grammar refuses reaches the model as an error", function()
    local model = tiny_model(4)
    local ids = spell('{"tool": "add", "a": "2", "b": 1}')
    for _, id in ipairs(spell("No.")) do ids[#ids + 1] = id end
    local a = assert(agent.new(model, { tools = registry(), template = "chatml", ctx = 2048, constrain = false,
      sampler = script(ids) }))
    local reply, info = a:turn("Add.")
    assert.equals("No.", reply)
    assert.same({ { name = "add", arguments = { a = "2", b = 1 }, ok = false,
      result = "argument 'a' must be a number" } }, info.tool_calls)
    a:close()
  end)

  it("examples = false leaves the worked examples out; the hermes examples are written as its calls", function()
    local model = tiny_model(4)
    local reg = agent.registry():add { name = "add", parameters = { { name = "a", type = "number" },
      { name = "b", type = "number" } }, fn = function(x) return x.a + x.b end,
      example = { user = "What is 2 plus 3?", arguments = { a = 2, b = 3 }, answer = "5." } }
    local a = assert(agent.new(model, { tools = reg, template = "chatml", protocol = "hermes", ctx = 2048 }))
    assert.same({
      { role = "user", content = "What is 2 plus 3?" },
      { role = "assistant", content = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' },
      { role = "user", content = "<tool_response>\n5\n</tool_response>" },
      { role = "assistant", content = "5." },
    }, { table.unpack(a.messages, 2) })
    -- the example's call is one the grammar allows
    assert.equals("end", feed(model, "hermes", reg, a.messages[3].content))
    a:close()
    for _, protocol in ipairs { "text", "hermes" } do
      a = assert(agent.new(model, { tools = reg, template = "chatml", protocol = protocol, ctx = 2048,
        examples = false }))
      assert.equals(1, #a.messages)
      a:close()
    end
  end)

  it("a:reset() goes back to the system message and examples; the next turn reuses their tokens", function()
    local model = tiny_model(4)
    local ids = spell("Hi.")
    for _, id in ipairs(spell("Yo.")) do ids[#ids + 1] = id end
    local a = assert(agent.new(model, { tools = registry(), template = "chatml", ctx = 2048, sampler = script(ids) }))
    local start = #a.messages
    local _, first = a:turn("Hello")
    a:reset()
    assert.equals(start, #a.messages)
    local _, second = a:turn("Hello")
    assert.equals(start + 2, #a.messages)
    assert.equals(first.conversation, second.conversation)
    assert.is_true(second.reused >= first.conversation - #"Hello<|im_end|>\n<|im_start|>assistant\n" - 1)
    a:close()
  end)
end)

-- ==== grammar 8 ===================================================================

describe("grammar 8: SmolLM2, constrained, through scripts/agent.lua --tool-turns", function()
  local S = require "spec.support.scripts"
  local function run(lines, extra)
    local path = os.tmpname()
    local f = assert(io.open(path, "w"))
    f:write(table.concat(lines, "\n"), "\n")
    f:close()
    local args = { "--tool-turns", path, "--json", "--max-tokens", "32", "--max-calls", "1" }
    for _, a in ipairs(extra or {}) do args[#args + 1] = a end
    local r = S.run("agent.lua", args)
    os.remove(path)
    S.assert_ok(r)
    return S.json_decode(r.out), r
  end

  it("with worked examples: greedy turns call the right tool with the arguments the question gives", function()
    if not models.path("smollm2") then return pending("smollm2 not available") end
    local j, r = run { "weather What is the weather in Paris?", "weather Is it raining in London?",
      "add How much is 7 plus 8?" }
    assert.is_true(j.constrain)
    local want = { { "weather", { city = "Paris" } }, { "weather", { city = "London" } }, { "add", { a = 7, b = 8 } } }
    for i, w in ipairs(want) do
      local c = j.turns[i].tool_calls[1]
      assert.is_truthy(c, S.explain(r))
      assert.equals(w[1], c.name)
      assert.same(w[2], c.arguments)
      assert.is_true(c.ok)
    end
  end)

  it("in both protocols, with and without examples, every call made names a tool and has valid arguments", function()
    if not models.path("smollm2") then return pending("smollm2 not available") end
    local lines = { "weather Is it cold in Oslo?", "add What is 2 plus 2?",
      "weather Check the weather for Rome, please." }
    for _, extra in ipairs { { "--no-examples" }, { "--protocol", "hermes" },
                             { "--protocol", "hermes", "--no-examples" } } do
      local j = run(lines, extra)
      for _, t in ipairs(j.turns) do
        for _, c in ipairs(t.tool_calls) do
          local tool = c.name == "add" and { a = "number", b = "number" } or c.name == "weather" and { city = "string" }
          assert.is_truthy(tool, c.name)
          for k, v in pairs(c.arguments) do assert.equals(tool[k], type(v), k) end
          for k in pairs(tool) do assert.is_not_nil(c.arguments[k], k) end
        end
      end
    end
  end)
end)
