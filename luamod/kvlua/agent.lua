-- kvlua.agent — a multi-turn agent: a conversation kept in one session's
-- KV cache, and tools written as Lua functions that the model calls.
--
--   local agent = require "kvlua.agent"
--   local tools = agent.registry()
--   tools:add{ name = "add", description = "Adds two numbers.",
--              parameters = { { name = "a", type = "number" }, { name = "b", type = "number" } },
--              fn = function(args) return args.a + args.b end,
--              example = { user = "What is 2 plus 3?", arguments = { a = 2, b = 3 }, answer = "2 plus 3 is 5." } }
--   local a = agent.new(model, { tools = tools, system = "You are a helpful assistant." })
--   local reply, info = a:turn("What is 17 plus 25?")
--   print(reply, info.ttft, info.prefilled, #info.tool_calls)
--
-- A turn: the user's message joins the conversation; then, until the
-- model answers without calling a tool (at most max_tool_calls calls):
--   1. the conversation is rendered with the chat template (kvlua.chat)
--      and tokenized; the session keeps the longest common token prefix
--      with what it holds (rewinding what differs) and prefills only the
--      rest, so a turn costs its new tokens, not the whole conversation;
--   2. the model generates a reply; the protocol parses it;
--   3. a tool call runs the tool (in a coroutine of its own): its result,
--      or "error: ..." when the call cannot be read, names no tool, has
--      wrong arguments (or numbers past a double, 1e999), or the tool
--      raises, yields or returns what has no text, goes back to the model
--      as a message (cut at max_result_bytes) and the loop goes on.
-- info.ttft is the first prefill of the turn in engine seconds (the time
-- to the first token); info.rounds has one entry per generation.
--
-- Tools: name ([%w_]+), description, parameters (an ordered array of
-- { name =, type = "string"|"number"|"integer"|"boolean", description =,
-- optional = true }), fn(args) -> result (a string of valid UTF-8, a
-- finite number, a boolean, nil for "null", or a table written as JSON;
-- anything else is an error result), and optionally example = { user =,
-- arguments =, answer = [, result =] }: one worked exchange the protocol
-- shows the model before the conversation (in its own call and result
-- format; agent.new{examples = false}: none). An "integer" argument
-- may be written 2.0 (an integer for JSON Schema); a "number" is finite.
--
-- Protocols (opts.protocol; by default "hermes" when the model's chat
-- template has a tool-call format, else "text"):
--
--   "text" — for any chat template; a small model follows it after a
--   worked example. The system message lists the tools; the model calls
--   one by answering with a message that is a JSON object naming the tool
--   and giving its arguments, and nothing else:
--       {"tool": "weather", "city": "Paris"}
--   The result comes back as a user message
--       RESULT weather: sunny, 22 C
--   (or "RESULT weather: error: <message>"), and the model answers.
--   A reply that does not start with '{' is the answer of the turn.
--
--   "hermes" — the format of chat templates that write <tool_call> (Qwen
--   2.5, Hermes): tools as JSON signatures inside <tools></tools> in the
--   system message, calls as
--       <tool_call>
--       {"name": "weather", "arguments": {"city": "Paris"}}
--       </tool_call>
--   and results as a user message <tool_response>...</tool_response>, as
--   those templates render a "tool" message.
--
-- Constrained (agent.new{constrain =}, on by default where kvlua.grammar
-- is): every reply is generated under a grammar of the registry that
-- allows free text that does not read as a call, or one call that names a
-- registered tool and has valid arguments ("grammars of a message" below).
--
-- Errors: misuse (bad tool definitions, wrong argument types) raises; a
-- conversation that no longer fits the context, or a failed forward pass,
-- makes a:turn return nil, message.

local kvlua = require "kvlua"
local chat = require "kvlua.chat"
local json = require "kvlua.json"

local M = {}

-- ==== the tool registry ======================================================

local TYPES = { string = true, number = true, integer = true, boolean = true }

local Registry = {}
Registry.__index = Registry

--- agent.registry() -> an empty tool registry
function M.registry()
  return setmetatable({ list = {}, by_name = {} }, Registry)
end

local function check_tool(t)
  if type(t) ~= "table" then error("tool: a table expected", 3) end
  if type(t.name) ~= "string" or not t.name:match("^[%w_]+$") then
    error("tool: name must be a string of letters, digits and '_'", 3)
  end
  if type(t.fn) ~= "function" then error("tool " .. t.name .. ": fn must be a function", 3) end
  if t.description ~= nil and type(t.description) ~= "string" then
    error("tool " .. t.name .. ": description must be a string", 3)
  end
  for i, p in ipairs(t.parameters or {}) do
    if type(p) ~= "table" or type(p.name) ~= "string" or not TYPES[p.type] then
      error(string.format("tool %s: parameter %d needs a name and a type (string, number, integer, boolean)",
        t.name, i), 3)
    end
  end
end

--- registry:add{ name =, description =, parameters = {...}, fn =, example = } -> registry
function Registry:add(t)
  check_tool(t)
  if self.by_name[t.name] then error("tool " .. t.name .. " is already registered", 2) end
  local tool = { name = t.name, description = t.description or "", parameters = t.parameters or {}, fn = t.fn,
    example = t.example }
  self.list[#self.list + 1] = tool
  self.by_name[t.name] = tool
  return self
end

function Registry:get(name)
  return self.by_name[name]
end

-- Arguments checked against the tool's parameters: args | nil, message.
local function check_args(tool, args)
  if type(args) ~= "table" or json.is_array(args) then return nil, "arguments must be a JSON object" end
  local known = {}
  for _, p in ipairs(tool.parameters) do
    known[p.name] = true
    local v = args[p.name]
    if v == nil or v == json.null then
      if not p.optional then return nil, "missing argument '" .. p.name .. "'" end
      args[p.name] = nil
    elseif p.type == "integer" then
      -- 2.0 is an integer, as JSON Schema counts it
      local i = type(v) == "number" and math.tointeger(v)
      if not i then return nil, string.format("argument '%s' must be an integer", p.name) end
      args[p.name] = i
    elseif p.type == "number" and type(v) == "number" then
      if v ~= v or v == math.huge or v == -math.huge then
        return nil, string.format("argument '%s' must be a finite number", p.name)
      end
    elseif type(v) ~= p.type then
      return nil, string.format("argument '%s' must be a %s", p.name, p.type)
    end
  end
  for k in pairs(args) do
    if not known[k] then return nil, "unknown argument '" .. tostring(k) .. "'" end
  end
  return args
end

-- Whether a value holds a string that is not valid UTF-8 (v is acyclic).
local function has_invalid_utf8(v)
  if type(v) == "string" then return not utf8.len(v) end
  if type(v) == "table" then
    for k, x in pairs(v) do
      if has_invalid_utf8(k) or has_invalid_utf8(x) then return true end
    end
  end
  return false
end

-- The message of json.encode's error, without its prefix.
local function encode_error(err)
  return (tostring(err):gsub("^[^:\n]+:%d+: ", ""):gsub("^json%.encode: ", ""))
end

-- The text of a tool's result: true, text | false, what is wrong with it.
-- A string must be valid UTF-8 (it goes into the conversation as is), a
-- number finite; a table is written as JSON; nil is "null".
local function result_text(v)
  local tv = type(v)
  if tv == "string" then
    local ok, bad = utf8.len(v)
    if not ok then return false, "the tool's result is not valid UTF-8 (byte " .. bad .. ")" end
    return true, v
  elseif v == nil then
    return true, "null"
  elseif tv == "boolean" then
    return true, tostring(v)
  elseif tv == "number" then
    if v ~= v or v == math.huge or v == -math.huge then
      return false, "the tool returned " .. tostring(v) .. ", a number JSON cannot hold"
    end
    return true, tostring(v)
  elseif tv ~= "table" then
    return false, "the tool returned a " .. tv .. ", not a string, number, boolean or table"
  end
  local ok, text = pcall(json.encode, v)
  if not ok then return false, "the tool's result cannot be written as JSON: " .. encode_error(text) end
  if has_invalid_utf8(v) then return false, "the tool's result holds a string that is not valid UTF-8" end
  return true, text
end

-- fn(args) in a coroutine of its own, so that a tool that yields cannot
-- suspend the turn: true, value | false, message.
local function run_tool(fn, args)
  local co = coroutine.create(fn)
  local ok, v = coroutine.resume(co, args)
  if ok and coroutine.status(co) == "suspended" then
    coroutine.close(co)
    return false, "the tool yielded instead of returning its result"
  end
  if ok then return true, v end
  local sok, msg = pcall(tostring, v)
  if not sok then return false, "the tool raised an error that cannot be written as text" end
  -- the message without the "file:line:" position Lua adds
  return false, json.replace_invalid_utf8((msg:gsub("^[^:\n]+:%d+: ", "")))
end

--- registry:check(name, arguments) -> arguments | nil, message: whether a
--- call names a registered tool and its arguments fit that tool's
--- parameters (the arguments as the tool will get them: an integer written
--- 2.0 becomes 2, a null optional one goes); runs nothing.
function Registry:check(name, args)
  local tool = self.by_name[name]
  if not tool then
    local names = {}
    for i, t in ipairs(self.list) do names[i] = t.name end
    return nil, string.format("no tool named '%s' (the tools: %s)", tostring(name), table.concat(names, ", "))
  end
  return check_args(tool, args)
end

--- registry:call(name, arguments) -> ok, text: runs a tool, never raises;
--- a missing tool, bad arguments, an error raised by the tool (or a
--- yield) and a result that cannot be text give false, "<message>".
function Registry:call(name, args)
  local checked, err = self:check(name, args)
  if not checked then return false, err end
  local ok, v = run_tool(self.by_name[name].fn, checked)
  if not ok then return false, v end
  return result_text(v)
end

-- ==== grammars of a message ===================================================
-- Constrained generation (agent.new{constrain = true}): each assistant
-- message is drawn under a GBNF grammar (kvlua.grammar) that allows free
-- text that does not read as a call, or one call whose JSON names a
-- registered tool and gives arguments of that tool's parameters, ended
-- where the protocol ends a call. The JSON is narrower than JSON: nothing
-- or one space between tokens, the arguments in the order of the
-- parameters (a protocol's grammar lists the rest), strings of at most
-- max_string characters and the escapes \" \\ \/ \b \f \n \r \t, integers
-- of at most 16 digits, numbers with at most 16 digits before and after
-- the point and a 2-digit exponent (always finite). So a call, which
-- starts the message, has a longest text, call_bytes, and call_bytes
-- tokens always finish it (every token the grammar allows holds at least
-- one byte; control tokens are never allowed, so "<tool_call>" is text:
-- one token where the vocabulary has it as a user-defined token, as
-- Qwen's does, else spelled in pieces).

local G_WS = 1 -- bytes of the `ws` rule at most
local G_VALUE = { -- parameter type -> rule, its longest text (k: max_string)
  string = { "str", function(k) return 2 + 4 * k end },
  integer = { "int", function() return 17 end },
  number = { "num", function() return 38 end },
  boolean = { "bool", function() return 5 end },
}

local function g_rules(max_string)
  return table.concat({
    'ws ::= " "?',
    'str ::= "\\"" char{0,' .. max_string .. '} "\\""',
    [==[char ::= [^"\\\x00-\x1F\x7F] | "\\" ["\\/bfnrt]]==],
    'int ::= "-"? ( "0" | [1-9] [0-9]{0,15} )',
    'num ::= int ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,2} )?',
    'bool ::= "true" | "false"',
  }, "\n")
end

-- A GBNF literal of the bytes of s (valid UTF-8).
local function g_lit(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    if c == '"' or c == "\\" then return "\\" .. c end
    return string.format("\\x%02X", c:byte())
  end) .. '"'
end

-- "key" ws ":" ws value of a parameter: GBNF, longest text.
local function g_pair(p, max_string)
  local key = json.encode(p.name)
  local v = G_VALUE[p.type]
  return g_lit(key) .. ' ws ":" ws ' .. v[1], #key + 1 + 2 * G_WS + v[2](max_string)
end

-- Free text that never contains `word`: one rule a prefix of it matched so
-- far (the automaton of Knuth, Morris and Pratt), any state may end. Rules
-- named <name>-0 .. <name>-(n-1); returns them as text.
local function g_text_without(name, word)
  local n = #word
  local function next_state(k, c) -- the longest prefix of word that ends word[1..k] .. c
    local t = word:sub(1, k) .. c
    for m = math.min(#t, n), 1, -1 do
      if t:sub(-m) == word:sub(1, m) then return m end
    end
    return 0
  end
  local chars = {}
  for i = 1, n do chars[word:sub(i, i)] = true end
  local rules = {}
  for k = 0, n - 1 do
    local alts, except = {}, {}
    for c in pairs(chars) do
      local m = next_state(k, c)
      if m ~= 0 then except[#except + 1] = c end
      if m ~= 0 and m < n then alts[#alts + 1] = g_lit(c) .. " " .. name .. "-" .. m end
    end
    table.sort(alts)
    table.sort(except)
    local class = "[^" .. table.concat(except):gsub("[%]%[%-%^\\]", "\\%0") .. "]"
    alts[#alts + 1] = class .. " " .. name .. "-0"
    rules[#rules + 1] = name .. "-" .. k .. " ::= ( " .. table.concat(alts, " | ") .. " )?"
  end
  return table.concat(rules, "\n")
end

-- ==== protocols ==============================================================
-- A protocol: system_prompt(registry) -> text added to the system message;
-- examples(registry) -> messages shown before the conversation;
-- parse(reply) -> call {name =, arguments =} | nil (an answer) | nil, err
-- (a call that cannot be read); result(call, ok, text) -> message;
-- stop -> stop strings for the generation (keep_stop: the one to put back
-- at the end of a reply it stopped).

local function signature(tool)
  local params = {}
  for _, p in ipairs(tool.parameters) do
    params[#params + 1] = string.format('"%s": %s%s', p.name, p.type, p.optional and " (optional)" or "")
  end
  return string.format("- %s: %s Arguments: {%s}", tool.name, tool.description, table.concat(params, ", "))
end

-- call_start: how a call begins (a reply that is a prefix of it may still become one)
local text = { name = "text", stop = { "\nRESULT" }, call_start = "{" }

-- {"tool": "<name>", "<arg>": value, ...} with "tool" first and the
-- arguments in the order of the tool's parameters.
function text.format_call(tool, args)
  local parts = { '"tool": ' .. json.encode(tool.name) }
  for _, p in ipairs(tool.parameters) do
    if args[p.name] ~= nil then parts[#parts + 1] = json.encode(p.name) .. ": " .. json.encode(args[p.name]) end
  end
  return "{" .. table.concat(parts, ", ") .. "}"
end

function text.system_prompt(registry)
  local lines = { "You can use tools. To use one, reply with only a JSON object: \"tool\" is the tool's name,"
    .. " the other keys are its arguments. The result comes back in a message starting with RESULT;"
    .. " then answer the user with it.", "", "Tools:" }
  for _, tool in ipairs(registry.list) do lines[#lines + 1] = signature(tool) end
  return table.concat(lines, "\n")
end

function text.result(call, ok, result)
  return { role = "user", content = "RESULT " .. call.name .. ": " .. (ok and result or ("error: " .. result)) }
end

function text.parse(reply)
  local body = reply:match("^%s*(.-)%s*$")
  if body:sub(1, 1) ~= "{" then return nil end
  local v, after = json.decode_prefix(body, 1)
  if v == nil then return nil, "the tool call is not a JSON object: " .. after end
  if type(v) ~= "table" or type(v.tool) ~= "string" then
    return nil, 'the tool call needs a "tool" key naming the tool'
  end
  local args = {}
  for k, val in pairs(v) do
    if k ~= "tool" then args[k] = val end
  end
  return { name = v.tool, arguments = args }
end

-- The worked examples of a protocol: each tool's example as a user
-- question, the call, its result and the answer.
local function worked_examples(protocol, registry)
  local msgs = {}
  for _, tool in ipairs(registry.list) do
    local ex = tool.example
    if ex then
      local result = ex.result
      if result == nil then
        local ok, v = registry:call(tool.name, json.decode(json.encode(ex.arguments)))
        result = ok and v or ("error: " .. v)
      else
        local ok, v = result_text(result)
        if not ok then error("tool " .. tool.name .. ": example result: " .. v, 4) end
        result = v
      end
      msgs[#msgs + 1] = { role = "user", content = ex.user }
      msgs[#msgs + 1] = { role = "assistant", content = protocol.format_call(tool, ex.arguments) }
      msgs[#msgs + 1] = protocol.result({ name = tool.name }, true, result)
      msgs[#msgs + 1] = { role = "assistant", content = ex.answer }
    end
  end
  return msgs
end

function text.examples(registry) return worked_examples(text, registry) end

-- The grammar of a message: a call {"tool": "<name>", "<arg>": value, ...}
-- (the arguments in the order of the parameters, optional ones left out
-- or not), or free text whose first character after any whitespace is not
-- '{'. Returns GBNF text and a call's longest text in bytes.
function text.grammar(registry, max_string)
  local rules, names, longest = {}, {}, 0
  for i, tool in ipairs(registry.list) do
    local name = json.encode(tool.name)
    local parts, bytes = { g_lit(name) }, #name
    for _, p in ipairs(tool.parameters) do
      local pair, pb = g_pair(p, max_string)
      local item = 'ws "," ws ' .. pair
      parts[#parts + 1] = p.optional and ("( " .. item .. " )?") or item
      bytes = bytes + 2 * G_WS + 1 + pb
    end
    names[i] = "tool-" .. i
    rules[i] = names[i] .. " ::= " .. table.concat(parts, " ")
    longest = math.max(longest, bytes)
  end
  local call_bytes = 1 + G_WS + #'"tool"' + G_WS + 1 + G_WS + longest + G_WS + 1
  return table.concat({
    "root ::= call | text",
    'call ::= "{" ws "\\"tool\\"" ws ":" ws ( ' .. table.concat(names, " | ") .. ' ) ws "}"',
    "text ::= [ \\t\\n\\x0B\\x0C\\r]* ( [^{ \\t\\n\\x0B\\x0C\\r] .* )?",
    table.concat(rules, "\n"),
    g_rules(max_string),
  }, "\n"), call_bytes
end

-- keep_stop: the stop string closes a call and belongs to the reply
local hermes = { name = "hermes", stop = { "</tool_call>" }, keep_stop = "</tool_call>", call_start = "<tool_call>" }

local JSON_TYPES = { string = "string", number = "number", integer = "integer", boolean = "boolean" }

function hermes.system_prompt(registry)
  local sigs = {}
  for _, tool in ipairs(registry.list) do
    local props, required = {}, json.array {}
    for _, p in ipairs(tool.parameters) do
      props[p.name] = { type = JSON_TYPES[p.type], description = p.description }
      if not p.optional then required[#required + 1] = p.name end
    end
    sigs[#sigs + 1] = json.encode { type = "function", ["function"] = { name = tool.name,
      description = tool.description, parameters = { type = "object", properties = props, required = required } } }
  end
  return "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    .. "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    .. table.concat(sigs, "\n") .. "\n</tools>\n\n"
    .. "For each function call, return a json object with function name and arguments within "
    .. "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    .. '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
end

-- <tool_call>\n{"name": "<name>", "arguments": {"<arg>": value, ...}}\n</tool_call>
-- with the arguments in the order of the tool's parameters.
function hermes.format_call(tool, args)
  local parts = {}
  for _, p in ipairs(tool.parameters) do
    if args[p.name] ~= nil then parts[#parts + 1] = json.encode(p.name) .. ": " .. json.encode(args[p.name]) end
  end
  return string.format('<tool_call>\n{"name": %s, "arguments": {%s}}\n</tool_call>', json.encode(tool.name),
    table.concat(parts, ", "))
end

function hermes.examples(registry) return worked_examples(hermes, registry) end

-- The grammar of a message: a call <tool_call> {"name": "<name>",
-- "arguments": {...}} </tool_call> (a newline or nothing inside the tags;
-- the arguments in the order of the parameters, optional ones left out or
-- not), or free text that nowhere holds "<tool_call>" (hermes.parse reads
-- a call anywhere). Returns GBNF text and a call's longest text in bytes.
function hermes.grammar(registry, max_string)
  local rules, names, longest = {}, {}, 0
  for i, tool in ipairs(registry.list) do
    local ps, pairs_, sizes, first_required = tool.parameters, {}, 0, nil
    for j, p in ipairs(ps) do
      local pb
      pairs_[j], pb = g_pair(p, max_string)
      sizes = sizes + pb
      if not p.optional and not first_required then first_required = j end
    end
    -- the arguments: one alternative for each parameter that can come first
    local args, args_bytes = '"{" ws "}"', 2 + G_WS
    if #ps > 0 then
      local alts = {}
      for k = 1, first_required or #ps do
        local seq = { pairs_[k] }
        for j = k + 1, #ps do
          local item = 'ws "," ws ' .. pairs_[j]
          seq[#seq + 1] = ps[j].optional and ("( " .. item .. " )?") or item
        end
        alts[k] = table.concat(seq, " ")
      end
      args = '"{" ws ( ' .. table.concat(alts, " | ") .. (first_required and " )" or " )?") .. ' ws "}"'
      args_bytes = 2 + 2 * G_WS + sizes + (#ps - 1) * (2 * G_WS + 1)
    end
    local name = json.encode(tool.name)
    names[i] = "tool-" .. i
    rules[i] = names[i] .. " ::= " .. g_lit(name) .. ' ws "," ws ' .. g_lit('"arguments"') .. ' ws ":" ws ' .. args
    longest = math.max(longest, #name + 4 * G_WS + 1 + #'"arguments"' + 1 + args_bytes)
  end
  local call_bytes = #"<tool_call>\n" + 1 + G_WS + #'"name"' + G_WS + 1 + G_WS + longest + G_WS + 1
    + #"\n</tool_call>"
  return table.concat({
    "root ::= call | text-0",
    'call ::= "<tool_call>" "\\n"? "{" ws "\\"name\\"" ws ":" ws ( ' .. table.concat(names, " | ")
      .. ' ) ws "}" "\\n"? "</tool_call>"',
    g_text_without("text", "<tool_call>"),
    table.concat(rules, "\n"),
    g_rules(max_string),
  }, "\n"), call_bytes
end

function hermes.parse(reply)
  local at = reply:find("<tool_call>", 1, true)
  if not at then return nil end
  local body = reply:sub(at + #"<tool_call>"):gsub("</tool_call>.*$", "")
  local v, err = json.decode(body)
  if v == nil then return nil, "the tool call is not a JSON object: " .. err end
  if type(v) ~= "table" or type(v.name) ~= "string" then return nil, 'the tool call needs a "name"' end
  local args = v.arguments
  if args == nil or args == json.null then args = {} end
  return { name = v.name, arguments = args }
end

function hermes.result(_, ok, result)
  return { role = "user", content = "<tool_response>\n" .. (ok and result or ("error: " .. result)) .. "\n</tool_response>" }
end

M.protocols = { text = text, hermes = hermes }

--- agent.protocol_for(model) -> "hermes" when the model's chat template
--- writes <tool_call>, else "text"
function M.protocol_for(model)
  local template = model.meta and model:meta("tokenizer.chat_template")
  if type(template) == "string" and template:find("<tool_call>", 1, true) then return "hermes" end
  return "text"
end

-- ==== the conversation's cache ===============================================

--- agent.common_prefix(a, b) -> how many leading ids arrays a and b share
function M.common_prefix(a, b)
  local n = 0
  while n < #a and n < #b and a[n + 1] == b[n + 1] do n = n + 1 end
  return n
end

local Agent = {}
Agent.__index = Agent

--- agent.new(model, { tools =, system =, protocol =, template =, sampler =, max_tokens = 256,
---                    max_tool_calls = 4, max_result_bytes = 4096, ctx = 4096, session =, on_piece =,
---                    on_tool =, examples = true, constrain =, max_string = 128 })
--- -> agent | nil, err. template: a kvlua.chat template name to use instead
--- of the model's own; session: a session to hold the conversation (else
--- one of ctx tokens is opened, and closed by a:close()); on_piece(text)
--- streams the replies; on_tool(call, ok, result) sees each call;
--- max_result_bytes: a longer tool result (or error) goes to the model cut
--- there, with a line saying so; examples = false leaves the tools' worked
--- examples out of the conversation.
--- constrain: every reply is generated under the protocol's grammar (see
--- "grammars of a message"): free text, or a call that names a tool and
--- has valid arguments. Default: true when there are tools, kvlua has
--- kvlua.grammar and the protocol has a grammar. A free-text reply still
--- ends at max_tokens (or up to 3 tokens later, to finish a character
--- split over byte tokens); a call, which starts the reply, may run past
--- it, up to a.call_bytes tokens (the bytes of its longest text), so that
--- it is never cut. max_string: the characters of a string argument at
--- most, under constrain.
function M.new(model, opts)
  opts = opts or {}
  if type(opts) ~= "table" then error("agent.new: options must be a table", 2) end
  local max_result = opts.max_result_bytes or 4096
  if math.type(max_result) ~= "integer" or max_result < 1 then
    error("agent.new: max_result_bytes must be a positive integer", 2)
  end
  local max_tokens = opts.max_tokens or 256
  if math.type(max_tokens) ~= "integer" or max_tokens < 1 then
    error("agent.new: max_tokens must be a positive integer", 2)
  end
  local max_string = opts.max_string or 128
  if math.type(max_string) ~= "integer" or max_string < 1 or max_string > 4096 then
    error("agent.new: max_string must be an integer in 1..4096", 2)
  end
  local registry = opts.tools or M.registry()
  local pname = opts.protocol or M.protocol_for(model)
  local protocol = type(pname) == "table" and pname or M.protocols[pname]
  if not protocol then error("agent.new: unknown protocol '" .. tostring(pname) .. "'", 2) end
  local constrain = opts.constrain
  if constrain == nil then
    constrain = #registry.list > 0 and kvlua.grammar ~= nil and protocol.grammar ~= nil
  elseif constrain and (#registry.list == 0 or not kvlua.grammar or not protocol.grammar) then
    error("agent.new: constrain needs tools, kvlua.grammar and a protocol with a grammar", 2)
  end
  local gstart, call_bytes
  if constrain then
    local text
    text, call_bytes = protocol.grammar(registry, max_string)
    local g, gerr = kvlua.grammar(text)
    if g then gstart, gerr = g:state(model) end
    if not gstart then return nil, "agent.new: the tools' grammar: " .. tostring(gerr) end
  end
  local s, owns = opts.session, false
  if not s then
    owns = true
    local err
    s, err = model:session { ctx = opts.ctx or 4096 }
    if not s then return nil, err end
  end
  local system = opts.system or "You are a helpful assistant."
  if #registry.list > 0 then system = system .. "\n\n" .. protocol.system_prompt(registry) end
  local messages = { { role = "system", content = system } }
  if #registry.list > 0 and opts.examples ~= false then
    for _, m in ipairs(protocol.examples(registry)) do messages[#messages + 1] = m end
  end
  local v = model.vocab
  local eog = v.eot and model:is_eog(v.eot) and v.eot or (v.eos and model:is_eog(v.eos) and v.eos) or nil
  return setmetatable({ model = model, session = s, owns_session = owns, template = opts.template or model,
    tools = registry, protocol = protocol, messages = messages, start = #messages,
    sampler = opts.sampler, max_tokens = max_tokens, max_tool_calls = opts.max_tool_calls or 4,
    max_result_bytes = max_result, on_piece = opts.on_piece, on_tool = opts.on_tool, turns = {},
    constrain = constrain and true or false, grammar_start = gstart, call_bytes = call_bytes, eog = eog,
    reply_tokens = constrain and math.max(max_tokens + 3, call_bytes + 1) or max_tokens }, Agent)
end

--- a:reset(): back to the conversation's start (system message and worked
--- examples), for a new conversation; the session keeps what they share.
function Agent:reset()
  for i = #self.messages, self.start + 1, -1 do self.messages[i] = nil end
end

-- Brings the session to the rendered conversation plus the generation
-- prompt, prefilling only the tokens it lacks. Returns
-- {conversation =, reused =, prefilled =, seconds =} | nil, err.
function Agent:sync()
  local s = self.session
  local template = self.template ~= self.model and self.template or nil
  local ids, err = chat.encode(self.model, self.messages, { add_generation_prompt = true, template = template })
  if not ids then return nil, "chat template: " .. err end
  if #ids + self.reply_tokens > s.ctx then
    return nil, string.format("the conversation (%d tokens) and a reply (%d) no longer fit the context (%d)",
      #ids, self.reply_tokens, s.ctx)
  end
  local have = s:tokens()
  local keep = M.common_prefix(have, ids)
  if keep == #ids then keep = keep - 1 end -- run the last token again for fresh logits
  s:rewind(#have - keep)
  local before = s:stats().prefill_seconds
  local ok, perr = s:prefill(table.move(ids, keep + 1, #ids, 1, {}))
  if not ok then return nil, perr end
  return { conversation = #ids, reused = keep, prefilled = #ids - keep, seconds = s:stats().prefill_seconds - before }
end

-- The sampler of a constrained reply: the user's sampler (or greedy) on
-- the logits the grammar allows. A token the grammar refuses (a sampler
-- that ignores its logits) is an error. From max_tokens on, where the
-- grammar can end and the reply is not the start of a call (free text;
-- a text cut in a character goes on to its end), it ends the reply with
-- an end-of-generation token.
local function constrained(agent)
  local gstate, sampler, n = agent.grammar_start:clone(), agent.sampler, 0
  local start, head = agent.protocol.call_start or "", "" -- the reply's first bytes
  local w = {}
  function w:sample(l)
    if self.err then return nil, self.err end
    if n >= agent.max_tokens and agent.eog and gstate:can_end()
      and not (#head < #start and start:sub(1, #head) == head) then
      return agent.eog
    end
    local work = l:clone()
    local left, allowed = gstate:mask(work)
    if left == nil then return nil, "grammar: " .. tostring(allowed) end
    if left == 0 then return nil, "grammar: no token of the vocabulary is allowed here" end
    if sampler then return sampler:sample(work) end
    return work:argmax()
  end
  function w:accept(id)
    local ok, err = gstate:accept(id)
    if not ok then self.err = "the sampler picked a token the grammar refuses (" .. tostring(err) .. ")" end
    n = n + 1
    if #head < #start then head = head .. agent.model:piece(id, false) end
    if sampler and sampler.accept then sampler:accept(id) end
  end
  return w
end

-- One generation from the synced session: the reply's text | nil, err.
function Agent:generate()
  local pieces = {}
  local sampler = self.sampler
  if self.constrain then sampler = constrained(self) end
  for piece in self.session:generate { max_tokens = self.reply_tokens, sampler = sampler,
                                       stop = self.protocol.stop } do
    pieces[#pieces + 1] = piece
    if self.on_piece then self.on_piece(piece) end
  end
  if self.constrain and sampler.err then return nil, sampler.err end
  local reason = self.session.finish_reason
  if reason:match("^error") then return nil, reason:gsub("^error: ", "") end
  local reply = table.concat(pieces)
  if reason == "stop" and self.protocol.keep_stop then reply = reply .. self.protocol.keep_stop end
  return reply
end

-- A tool's text cut to at most max bytes, on a character boundary, and a
-- line saying so.
local function cap(text, max)
  if #text <= max then return text end
  local cut = max
  while cut > 0 and text:byte(cut + 1) & 0xC0 == 0x80 do cut = cut - 1 end
  return string.format("%s\n[cut: the first %d of %d bytes]", text:sub(1, cut), cut, #text)
end

-- Why a parsed call's arguments cannot be used: they hold what JSON
-- cannot (a number past the largest double, as {"x": 1e999} reads as
-- inf; from a custom protocol, anything); nil when they can.
local function unusable(args)
  local ok, err = pcall(json.encode, args)
  if not ok then return "the call's arguments cannot be used: " .. encode_error(err) end
end

--- a:turn(user_text) -> reply, info | nil, err
--- After max_tool_calls calls the next reply ends the turn, call or not.
--- A reply's bytes that are not valid UTF-8 (a generation cut in the
--- middle of a character) become U+FFFD, so the conversation stays text.
--- info = { ttft =, prefilled =, reused =, conversation =, tool_calls = {{name=, arguments=, ok=, result=}},
---          rounds = {{prefilled=, reused=, conversation=, seconds=}} }
function Agent:turn(user)
  if type(user) ~= "string" then error("agent:turn: the user's message must be a string", 2) end
  if not utf8.len(user) then error("agent:turn: the user's message must be valid UTF-8", 2) end
  self.messages[#self.messages + 1] = { role = "user", content = user }
  local info = { tool_calls = {}, rounds = {} }
  while true do
    local round, err = self:sync()
    if not round then return nil, err end
    info.rounds[#info.rounds + 1] = round
    if #info.rounds == 1 then
      info.ttft, info.prefilled, info.reused, info.conversation = round.seconds, round.prefilled, round.reused,
        round.conversation
    end
    local reply
    reply, err = self:generate()
    if not reply then return nil, err end
    reply = json.replace_invalid_utf8(reply)
    self.messages[#self.messages + 1] = { role = "assistant", content = reply }
    local call, perr = self.protocol.parse(reply)
    if not call and not perr then
      self.turns[#self.turns + 1] = info
      return reply, info
    end
    if #info.tool_calls >= self.max_tool_calls then
      self.turns[#self.turns + 1] = info
      return reply, info
    end
    local ok, result
    local bad = call and unusable(call.arguments)
    if not call then
      call, ok, result = { name = "?" }, false, perr
    elseif bad then
      call, ok, result = { name = call.name }, false, bad -- the record stays writable as JSON
    else
      ok, result = self.tools:call(call.name, call.arguments)
    end
    result = cap(result, self.max_result_bytes)
    info.tool_calls[#info.tool_calls + 1] = { name = call.name, arguments = call.arguments, ok = ok, result = result }
    if self.on_tool then self.on_tool(call, ok, result) end
    self.messages[#self.messages + 1] = self.protocol.result(call, ok, result)
  end
end

--- a:close(): closes the session when the agent opened it
function Agent:close()
  if self.session and self.owns_session then self.session:close() end
  self.session = nil
end

return M
