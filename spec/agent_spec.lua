-- kvlua.agent: the tool registry, the two call protocols, and the turn
-- loop. The loop runs on a tiny random model whose "replies" come from a
-- scripted sampler (byte tokens spelling a text, then EOS), so the calls
-- the model makes are known; the conversation is rendered with the ChatML
-- template. The last examples run scripts/agent.lua on the real SmolLM2
-- (pending when it is not available). The scripted replies include calls
-- no grammar would allow, so these agents run unconstrained (constrain =
-- false); spec/agent_grammar_spec.lua tests the constrained path.
local kvlua = require "kvlua"
local agent = require "kvlua.agent"
local json = require "kvlua.json"
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"
local S = require "spec.support.scripts"

local EOS = 2

-- spell(...): a sampler spelling its arguments (one byte token per byte;
-- EOS for the number EOS); replies(...): the texts, each ended by EOS.
local spell, replies = require("spec.support.samplers").speller(EOS)

local function add_tool(reg)
  return reg:add {
    name = "add", description = "Adds two numbers.",
    parameters = { { name = "a", type = "number" }, { name = "b", type = "number" } },
    fn = function(args) return args.a + args.b end,
    example = { user = "What is 2 plus 3?", arguments = { a = 2, b = 3 }, answer = "5." },
  }
end

local function fail_tool(reg)
  return reg:add {
    name = "fail", description = "Always fails.", parameters = { { name = "why", type = "string", optional = true } },
    fn = function(args) error("broken: " .. (args.why or "no reason")) end,
  }
end

local model
setup(function()
  model = assert(kvlua.load(tiny.llama { vocab = "bytes", seed = 4 }, { threads = 1 }))
end)
teardown(function()
  if model then model:close() end
  tiny.cleanup()
end)

-- ==== registry ==================================================================

describe("agent.registry", function()
  it("calls a tool with checked arguments", function()
    local reg = add_tool(agent.registry())
    assert.same({ true, "7" }, { reg:call("add", { a = 3, b = 4 }) })
    assert.same({ true, "2.5" }, { reg:call("add", { a = 1, b = 1.5 }) })
  end)

  it("turns every failure into false and a message the model can read", function()
    local reg = fail_tool(add_tool(agent.registry()))
    local cases = {
      { "nope", {}, "no tool named 'nope' (the tools: add, fail)" },
      { "add", { a = 1 }, "missing argument 'b'" },
      { "add", { a = 1, b = "2" }, "argument 'b' must be a number" },
      { "add", { a = 1, b = 2, c = 3 }, "unknown argument 'c'" },
      { "add", json.array { 1, 2 }, "arguments must be a JSON object" },
      { "fail", { why = "on purpose" }, "broken: on purpose" }, -- no "file:line:" prefix
      { "fail", {}, "broken: no reason" },
    }
    for _, c in ipairs(cases) do
      local ok, msg = reg:call(c[1], c[2])
      assert.is_false(ok, c[3])
      assert.equals(c[3], msg)
    end
  end)

  it("writes table results as JSON", function()
    local reg = agent.registry():add { name = "t", fn = function() return { x = 1 } end }
    assert.same({ true, '{"x":1}' }, { reg:call("t", {}) })
  end)

  it("raises on malformed tool definitions", function()
    local reg = agent.registry()
    assert.has_error(function() reg:add { name = "bad name", fn = print } end)
    assert.has_error(function() reg:add { name = "x" } end)
    assert.has_error(function() reg:add { name = "x", fn = print, parameters = { { name = "a", type = "list" } } } end)
    add_tool(reg)
    assert.has_error(function() add_tool(reg) end) -- twice
  end)
end)

-- ==== protocols ================================================================

describe("the text protocol", function()
  local text = agent.protocols.text

  it("reads a reply that is a JSON object with a \"tool\" key as a call", function()
    assert.same({ name = "weather", arguments = { city = "Paris" } }, text.parse('{"tool": "weather", "city": "Paris"}'))
    assert.same({ name = "add", arguments = { a = 1, b = 2 } }, text.parse('  {"tool":"add","a":1,"b":2}\n'))
  end)

  it("reads any other reply as an answer", function()
    assert.is_nil(text.parse("It is sunny in Paris."))
    assert.is_nil(text.parse("The JSON {\"tool\": 1} is not at the start"))
  end)

  it("says why a call cannot be read", function()
    local call, err = text.parse('{"tool": "add", "a": }')
    assert.is_nil(call)
    assert.matches("^the tool call is not a JSON object", err)
    call, err = text.parse('{"name": "add"}')
    assert.is_nil(call)
    assert.equals('the tool call needs a "tool" key naming the tool', err)
  end)

  it("lists the tools in the system prompt and shows each tool's example", function()
    local reg = add_tool(agent.registry())
    assert.truthy(text.system_prompt(reg):find('- add: Adds two numbers. Arguments: {"a": number, "b": number}', 1, true))
    assert.same({
      { role = "user", content = "What is 2 plus 3?" },
      { role = "assistant", content = '{"tool": "add", "a": 2, "b": 3}' },
      { role = "user", content = "RESULT add: 5" },
      { role = "assistant", content = "5." },
    }, text.examples(reg))
  end)
end)

describe("the hermes protocol", function()
  local hermes = agent.protocols.hermes

  it("reads <tool_call> JSON with name and arguments", function()
    assert.same({ name = "add", arguments = { a = 1, b = 2 } },
      hermes.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'))
    assert.is_nil(hermes.parse("Just an answer."))
    local call, err = hermes.parse("<tool_call>\n{oops}\n</tool_call>")
    assert.is_nil(call)
    assert.matches("not a JSON object", err)
  end)

  it("writes the tools as JSON signatures in <tools> and results in <tool_response>", function()
    local prompt = hermes.system_prompt(add_tool(agent.registry()))
    assert.truthy(prompt:find('<tools>\n{"function":{"description":"Adds two numbers.","name":"add","parameters":'
      .. '{"properties":{"a":{"type":"number"},"b":{"type":"number"}},"required":["a","b"],"type":"object"}},'
      .. '"type":"function"}\n</tools>', 1, true))
    assert.same({ role = "user", content = "<tool_response>\n7\n</tool_response>" },
      hermes.result({ name = "add" }, true, "7"))
  end)

  it("is picked for chat templates that write <tool_call>", function()
    assert.equals("text", agent.protocol_for(model)) -- no template at all
    local fake = { meta = function() return "{% if tools %}<tool_call>{% endif %}" end }
    assert.equals("hermes", agent.protocol_for(fake))
  end)
end)

-- ==== the turn loop ==============================================================

local function new_agent(sampler, opts)
  opts = opts or {}
  local reg = fail_tool(add_tool(agent.registry()))
  local calls = {}
  local a = assert(agent.new(model, { tools = reg, template = "chatml", sampler = sampler, max_tokens = 64,
    ctx = 4096, max_tool_calls = opts.max_tool_calls, constrain = false,
    on_tool = function(call, ok, result) calls[#calls + 1] = { call.name, ok, result } end }))
  return a, calls
end

describe("agent:turn", function()
  it("runs a tool call, gives the result back to the model and returns its answer", function()
    local a, calls = new_agent(replies('{"tool": "add", "a": 2, "b": 5}', "The sum is 7."))
    local reply, info = a:turn("What is 2 plus 5?")
    assert.equals("The sum is 7.", reply)
    assert.same({ { "add", true, "7" } }, calls)
    assert.same({ { name = "add", arguments = { a = 2, b = 5 }, ok = true, result = "7" } }, info.tool_calls)
    local m = a.messages
    assert.same({ role = "user", content = "RESULT add: 7" }, m[#m - 1])
    assert.same({ role = "assistant", content = "The sum is 7." }, m[#m])
    assert.equals(2, #info.rounds)
    a:close()
  end)

  it("gives a tool's error back as its result, and the loop goes on", function()
    local a = new_agent(replies('{"tool": "fail", "why": "test"}', '{"tool": "nope"}', '{"tool": "add", "a": }',
      "Sorry."))
    local reply, info = a:turn("Break something.")
    assert.equals("Sorry.", reply)
    assert.equals(3, #info.tool_calls)
    local results = {}
    for _, m in ipairs(a.messages) do
      if m.content:find("^RESULT") then results[#results + 1] = m.content end
    end
    assert.same({ "RESULT add: 5", -- the worked example
      "RESULT fail: error: broken: test", "RESULT nope: error: no tool named 'nope' (the tools: add, fail)" },
      table.move(results, 1, 3, 1, {}))
    assert.matches("^RESULT %?: error: the tool call is not a JSON object", results[4])
    a:close()
  end)

  it("runs the hermes format through the same loop", function()
    local call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    -- generation stops at </tool_call>; the next reply follows
    local reg = add_tool(agent.registry())
    local a = assert(agent.new(model, { tools = reg, template = "chatml", protocol = "hermes", ctx = 4096,
      constrain = false,
      sampler = spell(call, "Three.", EOS) }))
    local reply, info = a:turn("1 + 2?")
    assert.equals("Three.", reply)
    assert.same({ { name = "add", arguments = { a = 1, b = 2 }, ok = true, result = "3" } }, info.tool_calls)
    local m = a.messages
    assert.same({ role = "assistant", content = call }, m[#m - 2])
    assert.same({ role = "user", content = "<tool_response>\n3\n</tool_response>" }, m[#m - 1])
    assert.truthy(m[1].content:find("<tools>", 1, true))
    a:close()
  end)

  it("stops calling tools after max_tool_calls", function()
    local call = '{"tool": "add", "a": 1, "b": 1}'
    local a = new_agent(replies(call, call, call, call), { max_tool_calls = 2 })
    local reply, info = a:turn("Loop.")
    assert.equals(call, reply)
    assert.equals(2, #info.tool_calls)
    a:close()
  end)

  it("keeps the conversation in the cache: a later turn prefills only its new tokens", function()
    local a = new_agent(replies("Hello.", '{"tool": "add", "a": 1, "b": 2}', "3.", "Bye."))
    local _, first = a:turn("Hi")
    local _, second = a:turn("Add 1 and 2.")
    local _, third = a:turn("Thanks")
    assert.equals(0, first.reused)
    assert.equals(first.conversation, first.prefilled)
    for user, info in pairs { ["Add 1 and 2."] = second, Thanks = third } do
      assert.equals(info.conversation, info.reused + info.prefilled)
      assert.is_true(info.reused > first.conversation)
      -- prefilled: the end of the last reply, the user's message and the
      -- generation prompt (one token a byte in the tiny vocabulary)
      local new = "<|im_end|>\n<|im_start|>user\n" .. user .. "<|im_end|>\n<|im_start|>assistant\n"
      assert.equals(#new, info.prefilled)
    end
    -- the session holds the rendered conversation's tokens
    local chat = require "kvlua.chat"
    local rendered = chat.render("chatml", a.messages, { add_generation_prompt = false })
    local ids = model:tokenize(rendered, { add_special = true, parse_special = true })
    local have = a.session:tokens()
    -- all but the "<|im_end|>\n" after the last reply (its EOS was sampled, never fed)
    assert.equals(#ids - #"<|im_end|>\n", #have)
    assert.equals(#have, agent.common_prefix(have, ids))
    a:close()
  end)

  it("returns nil and a message when the conversation outgrows the context", function()
    local reg = add_tool(agent.registry())
    local a = assert(agent.new(model, { tools = reg, template = "chatml", sampler = replies("x"), ctx = 300,
      max_tokens = 32 }))
    local reply, err = a:turn(string.rep("long ", 40))
    assert.is_nil(reply)
    assert.matches("no longer fit the context %(300%)", err)
    a:close()
  end)

  it("raises on misuse", function()
    local a = new_agent(replies("x"))
    assert.has_error(function() a:turn(42) end)
    assert.has_error(function() agent.new(model, { protocol = "smoke-signals" }) end)
    a:close()
  end)
end)

-- ==== scripts/agent.lua on SmolLM2 =================================================

describe("scripts/agent.lua", function()
  it("runs the example's 4 turns on SmolLM2, calling the weather tool with the parsed city", function()
    if not models.path("smollm2") then return pending("smollm2 not available") end
    local r = S.run("agent.lua", { "--script", "scripts/examples/agent-turns.txt", "--json", "--max-tokens", "48" })
    S.assert_ok(r)
    local j = S.json_decode(r.out)
    assert.equals(4, #j.turns)
    assert.equals("text", j.protocol)
    -- turn 2 asks for the weather in Paris
    local calls = j.turns[2].tool_calls
    assert.is_true(#calls >= 1, S.explain(r))
    assert.equals("weather", calls[1].name)
    assert.same({ city = "Paris" }, calls[1].arguments)
    assert.is_true(calls[1].ok)
    assert.equals("sunny, 22 C", calls[1].result)
    -- its result reached the conversation, right after the call
    local found
    for i, m in ipairs(j.messages) do
      if m.role == "user" and m.content == "RESULT weather: sunny, 22 C" then
        found = i
        assert.equals("assistant", j.messages[i - 1].role)
        assert.equals("weather", json.decode(j.messages[i - 1].content).tool)
      end
    end
    assert.truthy(found, "the tool result is not in the conversation")
    -- turn 4 prefills a fraction of the conversation: the rest comes from the cache
    local t1, t4 = j.turns[1], j.turns[4]
    assert.equals(t1.conversation, t1.prefilled)
    assert.is_true(t4.conversation > t1.conversation)
    assert.is_true(t4.prefilled * 10 < t4.conversation, S.explain(r))
    assert.equals(t4.conversation, t4.prefilled + t4.reused)
  end)

  it("without --json prints each turn's TTFT and token counts on stderr", function()
    if not models.path("smollm2") then return pending("smollm2 not available") end
    local turns = os.tmpname()
    local f = assert(io.open(turns, "w"))
    f:write("# one turn\nHello!\n")
    f:close()
    local r = S.run("agent.lua", { "--script", turns, "--max-tokens", "8" })
    os.remove(turns)
    S.assert_ok(r)
    S.like("%[turn 1: TTFT [%d.]+ ms, prefilled %d+ of %d+ tokens %(0 reused%), 0 tool calls%]", r.err)
  end)

  it("a missing or empty --script exits non-zero with a message, before loading a model", function()
    local r = S.run("agent.lua", { "--script", "/nonexistent/turns.txt", "--model", "/nonexistent/m.gguf" })
    assert.equals(2, r.rc)
    assert.matches("turns.txt", r.err, 1, true)
    local empty = os.tmpname()
    r = S.run("agent.lua", { "--script", empty, "--model", "/nonexistent/m.gguf" })
    os.remove(empty)
    assert.equals(2, r.rc)
    assert.matches("no user turns", r.err)
  end)

  it("on a model without a chat template exits non-zero with a message", function()
    local path = tiny.llama { vocab = "bytes", seed = 2 }
    local turns = os.tmpname()
    local f = assert(io.open(turns, "w"))
    f:write("Hi\n")
    f:close()
    local r = S.run("agent.lua", { "--model", path, "--script", turns })
    os.remove(turns)
    assert.is_not.equals(0, r.rc)
    assert.matches("template", r.err)
  end)
end)
