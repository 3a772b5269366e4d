-- kvlua.chat — chat templates as Lua functions.
--
--   local chat = require "kvlua.chat"
--   local prompt, err = chat.render(model, {
--     { role = "system", content = "You are terse." },
--     { role = "user",   content = "Hello!" },
--   }, { add_generation_prompt = true })
--   local ids, err = chat.encode(model, messages)   -- the prompt's token ids
--
-- model_or_name is a model (anything with a :meta method; its GGUF
-- tokenizer.chat_template is rendered by kvlua.jinja, as transformers'
-- jinja2 renders it), a template name ("chatml", "llama3", "gemma",
-- "mistral", "phi3", or one registered with chat.register), or a Jinja
-- template string (matched by the detectors to a renderer by name).
-- The rendered text already holds the BOS text where the template writes
-- one (Llama 3, Gemma, Mistral, Phi-3). chat.encode is the one way every
-- chat path of kvlua tokenizes a conversation:
--   * the template's own text (roles included) is parsed for special
--     tokens, the contents of the messages are not: a user message or a
--     tool result holding "<|im_end|>" or "<end_of_turn>" is that text, not
--     the control token (it cannot close its turn or open another);
--   * the ids start with exactly one BOS when the vocabulary adds one
--     (model.vocab.add_bos), whether the template writes it or not; with
--     no add_bos, a BOS is there only if the template writes it.
-- For contents that hold no special-token text the ids are llama.cpp's for
-- the rendered text (llama_tokenize with parse_special, BOS added only when
-- the render lacks it): tests/fixtures/ref_chat_*.lua.
--
-- A model's own template: every option but template becomes a template
-- variable (tools, enable_thinking, documents, ...), with messages,
-- add_generation_prompt, bos_token and eos_token (the model's, or the
-- options'). A renderer registered with chat.register whose detect claims
-- the template goes first; a template kvlua.jinja cannot render is
-- nil, message (the construct and its line and column).
--
-- The hand-written renderers are the fallbacks: for a model without a
-- template (by general.architecture) and for names and template strings.
-- Each reproduces one family of templates as Hugging Face's jinja2 renders
-- them, and reads the few things that vary inside a family from the
-- template string itself (the default system prompt of ChatML templates
-- such as SmolLM2's or Qwen2's; whether a Phi-3 template writes BOS,
-- system turns or a trailing EOS).
-- The specs check every renderer against jinja2's output on the real
-- templates (tests/fixtures/chat_*.lua).
--
-- Errors: malformed arguments raise (roles and contents must be valid
-- UTF-8, as for jinja2, whatever the renderer; a closed model raises); a
-- template with no matching renderer, or a conversation the template
-- itself rejects (e.g. roles that do not alternate), returns nil, message.
-- A detect function that raises counts as "no match" for that template;
-- its error is named if no template matches.

local M = {}

-- ---------------------------------------------------------------------------
-- Helpers
-- ---------------------------------------------------------------------------

-- Python's str.strip() (what Jinja's |trim does): Unicode whitespace.
local WS = {}
for _, cp in ipairs{ 0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1D, 0x1E, 0x1F, 0x20,
                     0x85, 0xA0, 0x1680, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000 } do
  WS[utf8.char(cp)] = true
end
for cp = 0x2000, 0x200A do WS[utf8.char(cp)] = true end

local function trim(s)
  local chars = {}
  for _, cp in utf8.codes(s, true) do chars[#chars + 1] = utf8.char(cp) end
  local i, j = 1, #chars
  while i <= j and WS[chars[i]] do i = i + 1 end
  while j >= i and WS[chars[j]] do j = j - 1 end
  return table.concat(chars, "", i, j)
end

-- Decodes the escapes of a Jinja string literal body (quote is ' or ").
local ESC = { n = "\n", t = "\t", r = "\r", ["\\"] = "\\", ["'"] = "'", ['"'] = '"' }
local function unescape(s)
  return (s:gsub("\\(.)", function(c) return ESC[c] or ("\\" .. c) end))
end

local ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."

-- ---------------------------------------------------------------------------
-- Built-in renderers: fn(messages, opts, ctx) -> parts | nil, err
--   opts.add_generation_prompt (boolean); ctx.template (string or nil),
--   ctx.bos(), ctx.eos() (token texts). parts is an array of strings
--   (template text) and tables { text = s } (a message's content as the
--   template writes it: never parsed for special tokens).
-- ---------------------------------------------------------------------------

local function lit(s) return { text = s } end

-- The default system message of a ChatML template: the text of a literal
-- '<|im_start|>system\n...<|im_end|>' emitted when the first message is not
-- a system message (SmolLM2, Qwen2 and similar). nil if there is none.
local function chatml_default_system(template)
  if not template then return nil end
  local guard = template:find("messages%[0%]%[['\"]role['\"]%]%s*!=%s*['\"]system['\"]")
  if not guard then return nil end
  local rest = template:sub(guard)
  for _, q in ipairs{ "'", '"' } do
    -- {{ '<|im_start|>system\n ... <|im_end|>\n' }} with either a real
    -- newline or a \n escape after "system"
    local body = rest:match("{{%-?%s*" .. q .. "<|im_start|>system(.-)" .. q .. "%s*%-?}}")
    if body then
      body = unescape(body)
      local text = body:match("^\n(.-)<|im_end|>")
      if text then return text end
    end
  end
  return nil
end

local function render_chatml(messages, opts, ctx)
  local out = {}
  local default = chatml_default_system(ctx.template)
  if default and #messages > 0 and messages[1].role ~= "system" then
    out[#out + 1] = "<|im_start|>system\n" .. default .. "<|im_end|>\n"
  end
  for _, m in ipairs(messages) do
    table.move({ "<|im_start|>", m.role, "\n", lit(m.content), "<|im_end|>\n" }, 1, 5, #out + 1, out)
  end
  if opts.add_generation_prompt then out[#out + 1] = "<|im_start|>assistant\n" end
  return out
end

local function render_llama3(messages, opts, ctx)
  local out = {}
  for i, m in ipairs(messages) do
    if i == 1 then out[#out + 1] = ctx.bos() end
    table.move({ "<|start_header_id|>", m.role, "<|end_header_id|>\n\n", lit(trim(m.content)), "<|eot_id|>" },
      1, 5, #out + 1, out)
  end
  if opts.add_generation_prompt then out[#out + 1] = "<|start_header_id|>assistant<|end_header_id|>\n\n" end
  return out
end

-- Gemma 3: the system message becomes a prefix of the first user turn;
-- "assistant" is "model"; contents are trimmed. Gemma 1/2 templates (no
-- first_user_prefix) reject a system message and write no BOS.
local function render_gemma(messages, opts, ctx)
  local gemma3 = ctx.template == nil or ctx.template:find("first_user_prefix", 1, true) ~= nil
  local out = {}
  local prefix, first = nil, 1
  if gemma3 then
    out[1] = ctx.bos()
    if messages[1] and messages[1].role == "system" then
      prefix, first = messages[1].content, 2
    end
  elseif messages[1] and messages[1].role == "system" then
    return nil, "System role not supported"
  end
  local k = 0
  for i = first, #messages do
    local m = messages[i]
    if (m.role == "user") ~= (k % 2 == 0) then return nil, ALTERNATE end
    out[#out + 1] = "<start_of_turn>"
    out[#out + 1] = m.role == "assistant" and "model" or m.role
    out[#out + 1] = "\n"
    if k == 0 and prefix then table.move({ lit(prefix), "\n\n" }, 1, 2, #out + 1, out) end
    table.move({ lit(trim(m.content)), "<end_of_turn>\n" }, 1, 2, #out + 1, out)
    k = k + 1
  end
  if opts.add_generation_prompt then out[#out + 1] = "<start_of_turn>model\n" end
  return out
end

-- Mistral v0.1/v0.2 ([INST] ... [/INST]): user/assistant only, alternating;
-- the prompt needs no generation suffix.
local function render_mistral(messages, opts, ctx)
  local out = { ctx.bos() }
  for i, m in ipairs(messages) do
    if (m.role == "user") ~= ((i - 1) % 2 == 0) then return nil, ALTERNATE end
    if m.role == "user" then
      table.move({ "[INST] ", lit(m.content), " [/INST]" }, 1, 3, #out + 1, out)
    elseif m.role == "assistant" then
      table.move({ lit(m.content), ctx.eos() }, 1, 2, #out + 1, out)
    else
      return nil, "Only user and assistant roles are supported!"
    end
  end
  return out
end

-- Phi-3. Two shapes: the generic one writes '<|role|>\n...<|end|>\n' for
-- every message (Phi-3-small/-vision/-3.5), the Phi-3-mini one writes user
-- and assistant turns only, each user turn followed by '<|assistant|>\n'.
local function render_phi3(messages, opts, ctx)
  local t = ctx.template or ""
  local generic = ctx.template == nil
    or t:find("'<|' + message['role'] + '|>'", 1, true) ~= nil
    or t:find("<|system|>", 1, true) ~= nil
  local out = {}
  if t:find("^%s*{{%-?%s*bos_token%s*%-?}}") then out[1] = ctx.bos() end
  if generic then
    for _, m in ipairs(messages) do
      table.move({ "<|", m.role, "|>\n", lit(m.content), "<|end|>\n" }, 1, 5, #out + 1, out)
    end
    local last_is_assistant = #messages > 0 and messages[#messages].role == "assistant"
    local agp = opts.add_generation_prompt
    if t:find("messages[-1]['role'] != 'assistant'", 1, true) then agp = agp and not last_is_assistant end
    if agp then
      out[#out + 1] = "<|assistant|>\n"
    elseif t:find("{%%%-?%s*else%s*%-?%%}{{%-?%s*eos_token%s*%-?}}") then
      out[#out + 1] = ctx.eos()
    end
  else
    for _, m in ipairs(messages) do
      if m.role == "user" then
        table.move({ "<|user|>\n", lit(m.content), "<|end|>\n<|assistant|>\n" }, 1, 3, #out + 1, out)
      elseif m.role == "assistant" then
        table.move({ lit(m.content), "<|end|>\n" }, 1, 2, #out + 1, out)
      end
    end
  end
  return out
end

-- ---------------------------------------------------------------------------
-- Registry
-- ---------------------------------------------------------------------------

-- Ordered: user registrations are tried first (latest first), then the
-- built-ins in this order.
local registry = {}  -- name -> {fn=, detect=, builtin=}
local order = {}     -- names, most recently registered first

local function add(name, fn, detect, builtin)
  if registry[name] then
    for i, n in ipairs(order) do
      if n == name then table.remove(order, i) break end
    end
  end
  registry[name] = { fn = fn, detect = detect, builtin = builtin, defaults = {} }
  if builtin then order[#order + 1] = name else table.insert(order, 1, name) end
end

local function has(s) return function(t) return t:find(s, 1, true) ~= nil end end

add("chatml", render_chatml, has("<|im_start|>"), true)
add("llama3", render_llama3, has("<|start_header_id|>"), true)
add("gemma", render_gemma, has("<start_of_turn>"), true)
add("mistral", render_mistral, has("[INST]"), true)
add("phi3", render_phi3, function(t)
  return t:find("<|end|>", 1, true) ~= nil
     and (t:find("<|user|>", 1, true) ~= nil or t:find("'<|' + message['role'] + '|>'", 1, true) ~= nil)
end, true)
registry.chatml.defaults = { bos = "", eos = "<|im_end|>" }
registry.llama3.defaults = { bos = "<|begin_of_text|>", eos = "<|eot_id|>" }
registry.gemma.defaults = { bos = "<bos>", eos = "<eos>" }
registry.mistral.defaults = { bos = "<s>", eos = "</s>" }
registry.phi3.defaults = { bos = "<s>", eos = "<|endoftext|>" }

-- Aliases accepted as names.
local ALIASES = { smollm = "chatml", smollm2 = "chatml", qwen = "chatml", qwen2 = "chatml",
                  ["llama-3"] = "llama3", gemma3 = "gemma", ["gemma-3"] = "gemma",
                  ["phi-3"] = "phi3" }

-- A model's own template, through kvlua.jinja. The contents of the messages
-- are located in the text exactly: a second rendering with each content
-- replaced by a marker must give the same text once the markers are
-- replaced back; when a template transforms contents so that it does not,
-- each content (or its trimmed text) is searched in order instead.
local jinja_cache = { source = nil, template = nil }
local MARK_OPEN, MARK_CLOSE = "\u{F8F0}", "\u{F8F1}"

local function render_jinja(messages, opts, ctx)
  local jinja = require "kvlua.jinja"
  if jinja_cache.source ~= ctx.template then
    local t, err = jinja.compile(ctx.template)
    if not t then return nil, "chat template: " .. err end
    jinja_cache.source, jinja_cache.template = ctx.template, t
  end
  local tpl = jinja_cache.template
  local vars = {}
  for k, v in pairs(ctx.opts) do
    if type(k) == "string" and k ~= "template" then vars[k] = v end
  end
  vars.add_generation_prompt = opts.add_generation_prompt
  vars.bos_token, vars.eos_token = ctx.bos(), ctx.eos()
  local function render(msgs)
    vars.messages = msgs
    local text, err = tpl:render(vars)
    if not text then return nil, (err:gsub("^jinja: raise_exception: ", "")) end
    return text
  end
  local text, err = render(messages)
  if not text then return nil, err end

  local marked, contents = {}, {}
  for i, m in ipairs(messages) do
    local c = setmetatable({}, getmetatable(m)) -- an ordered dict stays one
    for k, v in pairs(m) do c[k] = v end
    if m.content ~= "" and not m.content:find(MARK_OPEN, 1, true) then
      c.content = MARK_OPEN .. i .. MARK_CLOSE
      contents[i] = m.content
    end
    marked[i] = c
  end
  local parts = {}
  local mtext = render(marked)
  if mtext then
    local at = 1
    for a, i, b in mtext:gmatch("()" .. MARK_OPEN .. "(%d+)" .. MARK_CLOSE .. "()") do
      local c = contents[tonumber(i)]
      if not c then parts = nil break end
      if a > at then parts[#parts + 1] = mtext:sub(at, a - 1) end
      parts[#parts + 1] = { text = c }
      at = b
    end
    if parts then
      if at <= #mtext then parts[#parts + 1] = mtext:sub(at) end
      local whole = {}
      for j, p in ipairs(parts) do whole[j] = type(p) == "table" and p.text or p end
      if table.concat(whole) == text then return parts end
    end
  end
  parts = {}
  local at = 1
  for _, m in ipairs(messages) do
    local c = m.content
    local a, b
    if c ~= "" then a, b = text:find(c, at, true) end
    if not a and trim(c) ~= "" then a, b = text:find(trim(c), at, true) end
    if a then
      if a > at then parts[#parts + 1] = text:sub(at, a - 1) end
      parts[#parts + 1] = { text = text:sub(a, b) }
      at = b + 1
    end
  end
  if at <= #text then parts[#parts + 1] = text:sub(at) end
  return parts
end
local JINJA = { fn = render_jinja, defaults = {} }

-- The name of a renderer registered with chat.register whose detect
-- claims the template, or nil.
local function registered_for(template)
  for _, n in ipairs(order) do
    local e = registry[n]
    if not e.builtin and e.detect then
      local ok, match = pcall(e.detect, template)
      if ok and match then return n end
    end
  end
end

-- Renderer for a model with no chat template, from general.architecture.
local ARCH = { gemma = "gemma", gemma2 = "gemma", gemma3 = "gemma", gemma3n = "gemma",
               phi3 = "phi3", qwen2 = "chatml", qwen3 = "chatml" }

--- chat.register(name, fn [, {detect = function(template_string) -> bool}])
--- fn(messages, opts, ctx) -> string | parts | nil, err, where ctx.template
--- is the model's template string (or nil) and ctx.bos() / ctx.eos() give
--- the model's BOS / EOS token texts. parts: an array of strings (template
--- text) and { text = s } tables (message contents, which chat.encode
--- never parses for special tokens); a plain string is all template text.
function M.register(name, fn, opts)
  if type(name) ~= "string" or name == "" then error("chat.register: name must be a non-empty string", 2) end
  if type(fn) ~= "function" then error("chat.register: fn must be a function", 2) end
  if opts ~= nil and type(opts) ~= "table" then error("chat.register: options must be a table", 2) end
  local detect = opts and opts.detect
  if detect ~= nil and type(detect) ~= "function" then error("chat.register: detect must be a function", 2) end
  add(name, fn, detect, false)
end

--- chat.detect(template_string) -> name | nil [, errors of detectors that raised]
function M.detect(template)
  if type(template) ~= "string" then error("chat.detect: template string expected", 2) end
  local failed
  for _, name in ipairs(order) do
    local d = registry[name].detect
    if d then
      local ok, match = pcall(d, template)
      if ok and match then return name end
      if not ok then
        failed = failed or {}
        failed[#failed + 1] = ("detect of '%s' raised: %s"):format(name, tostring(match))
      end
    end
  end
  return nil, failed and table.concat(failed, "; ")
end

-- "unknown chat template (...)" with the errors of detectors that raised.
local function no_match(what, failed)
  return "unknown chat template (" .. what .. ")" .. (failed and ("; " .. failed) or "")
end

--- chat.names() -> array of known template names (lookup order)
function M.names()
  local t = {}
  for i, n in ipairs(order) do t[i] = n end
  return t
end

-- ---------------------------------------------------------------------------
-- Rendering
-- ---------------------------------------------------------------------------

-- fname: "chat.render" or "chat.encode", for messages; errors name the
-- caller of that function (level 4: check_messages < prepare < fname).
local function check_messages(messages, fname)
  if type(messages) ~= "table" then error(fname .. ": messages must be an array", 4) end
  local n = #messages
  for k in pairs(messages) do
    if math.type(k) ~= "integer" or k < 1 or k > n then
      error(fname .. ": messages must be an array (bad key " .. tostring(k) .. ")", 4)
    end
  end
  for i, m in ipairs(messages) do
    if type(m) ~= "table" then error(("%s: message %d must be a table"):format(fname, i), 4) end
    if type(m.role) ~= "string" then error(("%s: message %d: role must be a string"):format(fname, i), 4) end
    if type(m.content) ~= "string" then error(("%s: message %d: content must be a string"):format(fname, i), 4) end
    for _, k in ipairs{ "role", "content" } do
      if not utf8.len(m[k]) then error(("%s: message %d: %s is not valid UTF-8"):format(fname, i, k), 4) end
    end
  end
end

local function meta(model, key)
  return model:meta(key) -- a closed model raises
end

-- Text of the special token `which` ("bos"/"eos") of a model: through
-- model.vocab + model:token_text when it has them, else through the GGUF
-- metadata (token id and token table).
local token_cache = setmetatable({}, { __mode = "k" })
local function model_token(model, which)
  local c = token_cache[model]
  if not c then c = {} token_cache[model] = c end
  if c[which] ~= nil then return c[which] or nil end
  local text
  local okv, vocab = pcall(function() return model.vocab end)
  if okv and type(vocab) == "table" and math.type(vocab[which]) == "integer" then
    local okt, t = pcall(function() return model:token_text(vocab[which]) end)
    if okt and type(t) == "string" then text = t end
  end
  if text == nil then
    local id = meta(model, "tokenizer.ggml." .. which .. "_token_id")
    if type(id) == "table" then id = id[1] end
    if math.type(id) == "integer" then
      local tokens = meta(model, "tokenizer.ggml.tokens")
      if type(tokens) == "table" and type(tokens[id + 1]) == "string" then text = tokens[id + 1] end
    end
  end
  c[which] = text or false
  return text
end

-- Checks the options and messages and picks the renderer; returns
-- entry, ctx, add_generation_prompt | nil, err. Errors name fname's caller.
-- token_model: where BOS/EOS texts come from when model_or_name is a name.
local function prepare(fname, model_or_name, messages, opts, token_model)
  if opts ~= nil and type(opts) ~= "table" then error(fname .. ": options must be a table", 3) end
  opts = opts or {}
  check_messages(messages, fname)
  local agp = opts.add_generation_prompt
  if agp == nil then agp = true end
  if type(agp) ~= "boolean" then error(fname .. ": add_generation_prompt must be a boolean", 3) end
  for _, k in ipairs{ "bos_token", "eos_token" } do
    if opts[k] ~= nil and type(opts[k]) ~= "string" then error(fname .. ": " .. k .. " must be a string", 3) end
  end

  local name, template, model
  local t = type(model_or_name)
  if t == "string" then
    local s = ALIASES[model_or_name] or model_or_name
    if registry[s] then
      name = s
    elseif model_or_name:find("{[{%%]") then
      template = model_or_name
      local failed
      name, failed = M.detect(template)
      if not name then return nil, no_match("no registered template matches it", failed) end
    else
      return nil, ("unknown chat template '%s'"):format(model_or_name)
    end
  elseif (t == "table" or t == "userdata") and type(model_or_name.meta) == "function" then
    model = model_or_name
    template = meta(model, "tokenizer.chat_template")
    if type(template) == "string" and template ~= "" then
      name = registered_for(template) or "jinja"
    else
      template = nil
      local arch = meta(model, "general.architecture")
      name = type(arch) == "string" and ARCH[arch] or nil
      if not name then
        return nil, "the model has no chat template (tokenizer.chat_template); pass a template name"
      end
    end
  else
    error(fname .. ": model or template name expected, got " .. t, 3)
  end

  local entry = name == "jinja" and JINJA or registry[name]
  token_model = model or token_model
  local function token(which, key)
    return function()
      if opts[key] ~= nil then return opts[key] end
      if token_model then
        local v = model_token(token_model, which)
        if v then return v end
      end
      return entry.defaults[which] or ""
    end
  end
  return entry, { name = name, template = template, model = model, opts = opts,
                  bos = token("bos", "bos_token"), eos = token("eos", "eos_token") }, agp
end

-- Runs the renderer; returns text, spans (the {i, j} byte ranges of the
-- message contents in text) | nil, err. Raises (level 3) on a bad result.
local function run(entry, ctx, messages, agp)
  local out, err = entry.fn(messages, { add_generation_prompt = agp }, ctx)
  if out == nil then return nil, err or ("chat template '" .. ctx.name .. "' failed") end
  if type(out) == "string" then return out, {} end
  local bad = ("chat template '%s' returned a %s, not a string or an array of parts"):format(ctx.name, type(out))
  if type(out) ~= "table" then error(bad, 3) end
  local text, spans, at = {}, {}, 1
  for i, p in ipairs(out) do
    local lit = type(p) == "table"
    local s = lit and p.text or p
    if type(s) ~= "string" then
      error(("chat template '%s': part %d is not a string or { text = string }"):format(ctx.name, i), 3)
    end
    if lit and #s > 0 then spans[#spans + 1] = { at, at + #s - 1 } end
    text[i], at = s, at + #s
  end
  return table.concat(text), spans
end

--- chat.render(model_or_name, messages [, {add_generation_prompt=true,
---             bos_token=, eos_token=}]) -> string | nil, err
function M.render(model_or_name, messages, opts)
  local entry, ctx, agp = prepare("chat.render", model_or_name, messages, opts)
  if not entry then return nil, ctx end
  local text, err = run(entry, ctx, messages, agp)
  if not text then return nil, err end
  return text
end

--- chat.encode(model, messages [, {add_generation_prompt=true, template=,
---             bos_token=, eos_token=}]) -> ids, text | nil, err
--- The prompt's token ids (0-based) and the rendered text. template: a
--- template name or string to render with instead of the model's own (BOS
--- and EOS texts still the model's).
--- Contents are tokenized as text, the template's text with its special
--- tokens; one BOS first when model.vocab.add_bos (see the header).
function M.encode(model, messages, opts)
  local t = type(model)
  if (t ~= "table" and t ~= "userdata") or type(model.tokenize) ~= "function" then
    error("chat.encode: model expected, got " .. t, 2)
  end
  if opts ~= nil and type(opts) ~= "table" then error("chat.encode: options must be a table", 2) end
  local target = opts and opts.template
  if target == nil then target = model end
  if type(target) ~= "string" and target ~= model then
    error("chat.encode: template must be a template name or string", 2)
  end
  local entry, ctx, agp = prepare("chat.encode", target, messages, opts, model)
  if not entry then return nil, ctx end
  local text, spans = run(entry, ctx, messages, agp)
  if not text then return nil, spans end
  local ids, err = model:tokenize(text, { add_special = false, parse_special = true, literal = spans })
  if not ids then return nil, err end
  local vocab = model.vocab
  if vocab and vocab.add_bos and vocab.bos and ids[1] ~= vocab.bos then table.insert(ids, 1, vocab.bos) end
  return ids, text
end

return M
