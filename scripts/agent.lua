#!/usr/bin/env lua5.4
-- scripts/agent.lua — a chat agent with tools, the example of kvlua.agent.
--
-- Two example tools: `add` (adds two numbers) and `weather` (canned
-- weather of a few cities; it raises for any other city, and the error
-- goes back to the model as the tool's result). The conversation stays in
-- one session's KV cache: each turn prefills only its new tokens, and the
-- line after each reply gives that turn's TTFT and token counts.
--
-- Interactive by default (an empty line or EOF quits); --script FILE runs
-- the user turns of a file instead (one per line; blank lines and lines
-- starting with '#' are skipped), e.g. scripts/examples/agent-turns.txt.
-- --repeat-penalty defaults to 1.0 (none): SmolLM2-135M stops calling tools at 1.1.
--
-- Replies are generated under the tools' grammar (kvlua.agent's
-- constrain: free text, or a call naming a tool with valid arguments);
-- --no-constrain generates them freely, --no-examples leaves out the
-- tools' worked examples. --tool-turns FILE measures the calls: each line
-- of FILE is the tool a turn should call, then the turn (e.g.
-- scripts/examples/agent-tool-turns.txt); every turn starts a new
-- conversation, and the counts are printed (calls made, calls that parse,
-- name a tool and have valid arguments, turns whose first call is the
-- right tool).
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local p = cli.parser("A chat agent with tools, the example of kvlua.agent.")
p:model_options()
p:str("--script", "FILE", "user turns, one per line (non-interactive)", nil, true)
p:str("--tool-turns", "FILE", "lines 'TOOL user turn': count the calls of each turn, in new conversations", nil, true)
p:flag("--no-constrain", "generate replies without the tools' grammar")
p:flag("--no-examples", "leave the tools' worked examples out of the conversation")
p:str("--system", "TEXT", "system message (the tools' description is added to it)", "You are a helpful assistant.")
p:choice("--protocol", { "text", "hermes" }, "tool-call format (default: from the chat template)")
p:int("--max-tokens", "N", "tokens per reply at most", 128, 1, cli.MAX_CTX)
p:int("--max-calls", "N", "tool calls per turn at most", 4, 0, 1000)
p:sampling_options { temp = 0.0, repeat_penalty = 1.0, seed = 42 }
p:ctx_option(4096)
p:flag("--json", "print the turns (replies, tool calls, TTFT, tokens) and the conversation as JSON")
local o = p:parse()

local agent = require "kvlua.agent"
local json = require "kvlua.json"
local sampling = require "kvlua.sampling"

-- ==== the user's turns ========================================================

local function script_turns(path)
  local turns = {}
  for line in cli.read_file(path, "--script FILE"):gmatch("[^\n]+") do
    line = line:gsub("\r$", "")
    if line:find("%S") and not line:find("^%s*#") then turns[#turns + 1] = line end
  end
  if #turns == 0 then cli.die(path .. ": no user turns (one message per line expected)") end
  return turns
end

-- --tool-turns FILE: { {tool =, user =}, ... }
local function tool_turns(path)
  local turns = {}
  for line in cli.read_file(path, "--tool-turns FILE"):gmatch("[^\n]+") do
    line = line:gsub("\r$", "")
    if line:find("%S") and not line:find("^%s*#") then
      local tool, user = line:match("^%s*([%w_]+)%s+(%S.-)%s*$")
      if not tool then cli.die(path .. ": '" .. line .. "': a tool's name, then the user's turn, expected") end
      turns[#turns + 1] = { tool = tool, user = user }
    end
  end
  if #turns == 0 then cli.die(path .. ": no turns (lines 'TOOL user turn' expected)") end
  return turns
end

-- An iterator over user messages: the script's lines, or what is typed.
local function user_turns()
  if o.script then
    local turns, i = script_turns(o.script), 0
    return function()
      i = i + 1
      return turns[i]
    end
  end
  return function()
    cli.stdout:write("> ")
    cli.stdout:flush()
    local line = io.read("l")
    if line and line ~= "" then return line end
  end
end

-- ==== the tools =================================================================

local WEATHER = { Paris = "sunny, 22 C", Rome = "cloudy, 18 C", London = "rainy, 14 C", Tokyo = "clear, 25 C" }

local tools = agent.registry()
tools:add {
  name = "add", description = "Adds two numbers.",
  parameters = { { name = "a", type = "number" }, { name = "b", type = "number" } },
  fn = function(args) return args.a + args.b end,
  example = { user = "What is 2 plus 3?", arguments = { a = 2, b = 3 }, answer = "2 plus 3 is 5." },
}
tools:add {
  name = "weather", description = "Tells the weather in a city.",
  parameters = { { name = "city", type = "string" } },
  fn = function(args)
    return WEATHER[args.city] or error("no weather data for " .. args.city)
  end,
  example = { user = "What is the weather in Rome?", arguments = { city = "Rome" },
    answer = "It is cloudy in Rome, 18 C." },
}

-- ==== the loop ====================================================================

-- reads --script / --tool-turns before the model loads
if o.script and o.tool_turns then cli.die("give --script or --tool-turns, not both") end
local measured = o.tool_turns and tool_turns(o.tool_turns)
local next_user = not measured and user_turns()
if measured then
  for _, t in ipairs(measured) do
    if not tools:get(t.tool) then cli.die(o.tool_turns .. ": no tool named '" .. t.tool .. "'") end
  end
end
local model = cli.load(o)
local constrain -- nil: kvlua.agent's default (constrained where it can be)
if o.no_constrain then constrain = false end
local a, err = agent.new(model, {
  tools = tools, system = o.system, protocol = o.protocol, constrain = constrain,
  examples = not o.no_examples,
  sampler = sampling.from_opts { temp = o.temp, seed = o.seed, repeat_penalty = o.repeat_penalty },
  max_tokens = o.max_tokens, max_tool_calls = o.max_calls, ctx = o.ctx,
  on_piece = not o.json and not measured and function(piece)
    cli.stdout:write(piece)
    cli.stdout:flush()
  end or nil,
  on_tool = not o.json and not measured and function(call, ok, result)
    cli.stdout:write(string.format("\n  [tool %s %s -> %s%s]\n", call.name,
      call.arguments and json.encode(call.arguments) or "", ok and "" or "error: ", result))
  end or nil,
})
if not a then cli.die(err, 1) end

-- ==== --tool-turns: the calls of each turn, counted =============================

if measured then
  local n = { turns = #measured, turns_with_call = 0, calls = 0, parsed = 0, real_tool = 0, valid = 0,
    right_tool = 0 }
  local report = { model = model.info.name, protocol = a.protocol.name, constrain = a.constrain,
    examples = not o.no_examples, turns = {} }
  for k, t in ipairs(measured) do
    a:reset()
    local reply, info = a:turn(t.user)
    if not reply then cli.die(info, 1) end
    local first = info.tool_calls[1]
    for _, c in ipairs(info.tool_calls) do
      n.calls = n.calls + 1
      if c.name ~= "?" and c.arguments ~= nil then n.parsed = n.parsed + 1 end
      if tools:get(c.name) then n.real_tool = n.real_tool + 1 end
      -- a call that parsed keeps its arguments (as the tool got them)
      if c.arguments ~= nil and tools:check(c.name, c.arguments) then n.valid = n.valid + 1 end
    end
    if first then n.turns_with_call = n.turns_with_call + 1 end
    if first and first.name == t.tool then n.right_tool = n.right_tool + 1 end
    report.turns[k] = { user = t.user, expected = t.tool, reply = reply, tool_calls = json.array(info.tool_calls) }
    if not o.json then
      cli.stdout:write(string.format("%2d %-8s %-44s -> %s\n", k, t.tool, t.user:sub(1, 44),
        first and (first.name .. " " .. (first.arguments and json.encode(first.arguments) or "")) or "(no call)"))
      cli.stdout:flush()
    end
  end
  report.counts = n
  if o.json then
    cli.print(json.encode(report))
  else
    local function pct(x, of) return of > 0 and string.format("%d/%d (%.0f%%)", x, of, 100 * x / of) or "0/0" end
    cli.print(string.format("%s, %s protocol, %s, %s:", model.info.name, a.protocol.name,
      a.constrain and "constrained" or "unconstrained", o.no_examples and "no worked examples" or "worked examples"))
    cli.print(string.format("  turns with a call %s; calls %d: parse %s, name a tool %s, valid arguments %s",
      pct(n.turns_with_call, n.turns), n.calls, pct(n.parsed, n.calls), pct(n.real_tool, n.calls),
      pct(n.valid, n.calls)))
    cli.print(string.format("  right tool (the first call of a turn) %s", pct(n.right_tool, n.turns)))
  end
  a:close()
  cli.exit(0)
end

-- ==== the conversation ============================================================

local report = { model = model.info.name, protocol = a.protocol.name, turns = {} }
for user in next_user do
  local reply, info = a:turn(user)
  if not reply then cli.die(info, 1) end
  local k = #report.turns + 1
  report.turns[k] = { user = user, reply = reply, ttft_ms = info.ttft * 1e3, prefilled = info.prefilled,
    reused = info.reused, conversation = info.conversation, generations = #info.rounds,
    tool_calls = json.array(info.tool_calls) }
  if not o.json then
    cli.stdout:write("\n")
    io.stderr:write(string.format("[turn %d: TTFT %.1f ms, prefilled %d of %d tokens (%d reused), %d tool call%s]\n",
      k, info.ttft * 1e3, info.prefilled, info.conversation, info.reused, #info.tool_calls,
      #info.tool_calls == 1 and "" or "s"))
  end
end

if o.json then
  report.messages = a.messages
  cli.print(json.encode(report))
end
a:close()
cli.exit(0)
