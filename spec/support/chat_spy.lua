-- Watches a script's generations, for spec/chat_ref_spec.lua:
--
--   KVLUA_CHAT_SPY=out.txt lua5.4 -l spec.support.chat_spy scripts/chat.lua ...
--
-- (run from the repository root). Before the script starts it wraps
-- s:generate and kvlua.scheduler, and appends one line per generation to
-- the file $KVLUA_CHAT_SPY:
--   "generate <context ids> | <generated ids>"   s:generate: the session's
--       tokens plus the prompt it was given (what the reply is conditioned
--       on), then s.generated (end-of-generation id included) once the
--       iterator ends
--   "request <prompt ids>"                        a request a scheduler runs
-- The script itself runs unchanged: the wrappers only read.
local build = os.getenv("KVLUA_BUILD") or "build"
package.path = "luamod/?.lua;luamod/?/init.lua;" .. package.path
package.cpath = build .. "/?.so;" .. package.cpath

local out = assert(os.getenv("KVLUA_CHAT_SPY"), "KVLUA_CHAT_SPY: no output file")
local function record(line)
  local f = assert(io.open(out, "ab"))
  f:write(line, "\n")
  f:close()
end

require "kvlua"
local methods = debug.getregistry()["kvlua.Session"].__methods
local generate = methods.generate
methods.generate = function(s, opts)
  local context = s:tokens()
  if opts and type(opts.prompt) == "table" then table.move(opts.prompt, 1, #opts.prompt, #context + 1, context) end
  local it = generate(s, opts)
  local done = false
  return function(...)
    local piece = it(...)
    if piece == nil and not done then
      done = true
      record("generate " .. table.concat(context, " ") .. " | " .. table.concat(s.generated or {}, " "))
    end
    return piece
  end
end

local scheduler = require "kvlua.scheduler"
local new = scheduler.new
scheduler.new = function(...)
  local sch = new(...)
  local run = sch.run
  sch.run = function(self, next_request, sink)
    return run(self, function()
      local req = next_request()
      if req and type(req.prompt) == "table" then record("request " .. table.concat(req.prompt, " ")) end
      return req
    end, sink)
  end
  return sch
end
