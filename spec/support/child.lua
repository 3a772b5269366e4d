-- child.lua — running code in a separate lua5.4 process, for specs whose
-- subject could hang or kill the process that runs it.
--
--   local child = require "spec.support.child"
--   child.quote("it's")                    --> 'it'\''s' (one sh word)
--   local out, rc = child.run(code, 30)    -- a Lua chunk under `timeout 30`:
--                                          -- stdout and stderr, exit status
--
-- The child finds the module as busted does: $KVLUA_BUILD (default build)
-- and luamod/.
local M = {}

function M.quote(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

function M.run(code, seconds)
  local build = os.getenv("KVLUA_BUILD") or "build"
  local prelude = ("package.cpath = %q .. '/?.so;' .. package.cpath; package.path = 'luamod/?.lua;' .. package.path; ")
    :format(build)
  local cmd = ("timeout %d lua5.4 -e %s 2>&1 </dev/null"):format(seconds or 30, M.quote(prelude .. code))
  local p = assert(io.popen(cmd, "r"))
  local out = p:read("a")
  local _, _, rc = p:close()
  return out, rc
end

return M
