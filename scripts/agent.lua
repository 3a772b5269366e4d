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
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local p = cli.parser("A chat agent with tools, the example of kvlua.agent.")
p:model_options()
p:str("--script", "FILE", "user turns, one per line (non-interactive)", nil, true)
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

local next_user = user_turns() -- reads --script before the model loads
local model = cli.load(o)
local a, err = agent.new(model, {
  tools = tools, system = o.system, protocol = o.protocol,
  sampler = sampling.from_opts { temp = o.temp, seed = o.seed, repeat_penalty = o.repeat_penalty },
  max_tokens = o.max_tokens, max_tool_calls = o.max_calls, ctx = o.ctx,
  on_piece = not o.json and function(piece)
    cli.stdout:write(piece)
    cli.stdout:flush()
  end or nil,
  on_tool = not o.json and function(call, ok, result)
    cli.stdout:write(string.format("\n  [tool %s %s -> %s%s]\n", call.name,
      call.arguments and json.encode(call.arguments) or "", ok and "" or "error: ", result))
  end or nil,
})
if not a then cli.die(err, 1) end

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
