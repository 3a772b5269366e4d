-- kvlua.chat against jinja2 renderings of the real templates
-- (tests/fixtures/chat_*.lua, made by scripts/ref/gen-chat-fixtures.py).
-- Every case runs through a fake model carrying the fixture's template, so
-- this spec needs no model; fixtures of real models also run through the
-- model itself when it is available.

local chat = require "kvlua.chat"
local models = require "support.models"

local FIXTURES = { "smollm2", "gemma3", "llama3", "mistral", "qwen2", "phi3", "phi3_small" }

local function load_fixture(name)
  return dofile("tests/fixtures/chat_" .. name .. ".lua")
end

-- A stand-in for a model: the template, plus BOS/EOS as GGUF metadata.
local function fake_model(fx, extra)
  local meta = {
    ["tokenizer.chat_template"] = fx.template,
    ["tokenizer.ggml.bos_token_id"] = 0,
    ["tokenizer.ggml.eos_token_id"] = 1,
    ["tokenizer.ggml.tokens"] = { fx.bos_token, fx.eos_token },
  }
  for k, v in pairs(extra or {}) do meta[k] = v end
  return { meta = function(_, k) return meta[k] end }
end

local function check_case(target, case)
  local out, err = chat.render(target, case.messages, { add_generation_prompt = case.add_generation_prompt })
  if case.error then
    assert.is_nil(out)
    assert.are.equal(case.error, err)
  else
    assert.are.equal(case.expected, out, err)
  end
end

local kvlua_ok, kvlua = pcall(require, "kvlua")

for _, name in ipairs(FIXTURES) do
  local fx = load_fixture(name)
  describe("chat template " .. name .. " (" .. fx.source .. ")", function()
    it("is recognized from its template string", function()
      assert.is_string(chat.detect(fx.template))
    end)

    for i, case in ipairs(fx.cases) do
      it(("renders case %d like jinja2 (fake model)"):format(i), function()
        check_case(fake_model(fx), case)
      end)
    end

    if fx.model then
      it("renders every case like jinja2 through the real model", function()
        local path = models.path(fx.model)
        if not path or not kvlua_ok or type(kvlua.load) ~= "function" then
          pending("model " .. fx.model .. " or kvlua.load not available")
          return
        end
        local model = assert(kvlua.load(path, { threads = 1 }))
        for _, case in ipairs(fx.cases) do check_case(model, case) end
        model:close()
      end)
    end
  end)
end

describe("chat.render", function()
  local user = { { role = "user", content = "hi" } }

  it("takes a template name", function()
    assert.are.equal("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", chat.render("chatml", user))
    assert.are.equal("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
      chat.render("llama3", user, { add_generation_prompt = false }))
    assert.are.equal("<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", chat.render("gemma", user))
    assert.are.equal("<s>[INST] hi [/INST]", chat.render("mistral", user))
    assert.are.equal("<|user|>\nhi<|end|>\n<|assistant|>\n", chat.render("phi3", user))
  end)

  it("takes a template string", function()
    local fx = load_fixture("qwen2")
    local case = fx.cases[1]
    assert.are.equal(case.expected, chat.render(fx.template, case.messages))
  end)

  it("defaults add_generation_prompt to true", function()
    local fx = load_fixture("smollm2")
    assert.are.equal(fx.cases[1].expected, chat.render(fake_model(fx), fx.cases[1].messages))
  end)

  it("reads a ChatML template's default system message out of the template", function()
    local fx = load_fixture("smollm2")
    local sentence = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert.is_truthy(fx.template:find(sentence, 1, true))
    local other = fx.template:gsub(sentence:gsub("%p", "%%%0"), "Be brief.\nAnd kind.")
    assert.are.equal("<|im_start|>system\nBe brief.\nAnd kind.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
      chat.render(fake_model{ template = other }, user))
    -- the same template written with \n escapes inside its string literals
    local escaped = load_fixture("qwen2").template:gsub("\n", "\\n")
    for _, case in ipairs(load_fixture("qwen2").cases) do
      assert.are.equal(case.expected, chat.render(escaped, case.messages,
        { add_generation_prompt = case.add_generation_prompt }))
    end
  end)

  it("takes BOS/EOS overrides", function()
    assert.are.equal("[BOS][INST] hi [/INST]", chat.render("mistral", user, { bos_token = "[BOS]" }))
  end)

  it("falls back on the architecture when the model has no template", function()
    local m = { meta = function(_, k) if k == "general.architecture" then return "gemma3" end end }
    assert.are.equal("<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", chat.render(m, user))
  end)

  it("returns nil, message for an unknown template", function()
    local out, err = chat.render("no-such-template", user)
    assert.is_nil(out)
    assert.matches("unknown chat template", err)
    out, err = chat.render("{% for m in messages %}<<{{ m.content }}>>{% endfor %}", user)
    assert.is_nil(out)
    assert.is_string(err)
    out, err = chat.render({ meta = function() return nil end }, user)
    assert.is_nil(out)
    assert.is_string(err)
  end)

  it("returns nil, message when the template rejects the conversation", function()
    local out, err = chat.render("mistral", { { role = "system", content = "s" }, { role = "user", content = "u" } })
    assert.is_nil(out)
    assert.matches("alternate", err)
  end)

  it("raises on malformed arguments", function()
    assert.has_error(function() chat.render(42, user) end)
    assert.has_error(function() chat.render("chatml", "hi") end)
    assert.has_error(function() chat.render("chatml", { "hi" }) end)
    assert.has_error(function() chat.render("chatml", { { role = "user" } }) end)
    assert.has_error(function() chat.render("chatml", { { role = 1, content = "x" } }) end)
    assert.has_error(function() chat.render("chatml", { x = { role = "user", content = "x" } }) end)
    assert.has_error(function() chat.render("chatml", user, { add_generation_prompt = "yes" }) end)
    assert.has_error(function() chat.render("chatml", user, "opts") end)
  end)
end)

describe("chat.register", function()
  local user = { { role = "user", content = "hi" } }

  it("adds a template usable by name and by detection", function()
    chat.register("brackets", function(messages, opts, ctx)
      local out = {}
      for _, m in ipairs(messages) do out[#out + 1] = "[" .. m.role .. "]" .. m.content end
      if opts.add_generation_prompt then out[#out + 1] = "[assistant]" end
      return table.concat(out)
    end, { detect = function(t) return t:find("[assistant]", 1, true) ~= nil end })
    assert.are.equal("[user]hi[assistant]", chat.render("brackets", user))
    local m = { meta = function(_, k)
      if k == "tokenizer.chat_template" then return "{% for m in messages %}[{{m.role}}]{{m.content}}{% endfor %}[assistant]" end
    end }
    assert.are.equal("[user]hi", chat.render(m, user, { add_generation_prompt = false }))
    assert.are.equal("brackets", chat.names()[1])
  end)

  it("lets a renderer fail with nil, message", function()
    chat.register("refuses", function() return nil, "nope" end)
    local out, err = chat.render("refuses", user)
    assert.is_nil(out)
    assert.are.equal("nope", err)
  end)

  it("raises on bad arguments", function()
    assert.has_error(function() chat.register("", function() end) end)
    assert.has_error(function() chat.register("x", "not a function") end)
    assert.has_error(function() chat.register("x", function() end, { detect = 1 }) end)
  end)
end)
