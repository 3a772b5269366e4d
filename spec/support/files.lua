-- files.lua — temporary files for specs.
--
--   local files = require "spec.support.files"
--   local path = files.write_temp("text")   -- a new temporary file holding text
--   files.read(path) --> its bytes
--   files.write(path, s)                     -- replaces path's bytes with s
local M = {}

function M.write_temp(text)
  local path = os.tmpname()
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
  return path
end

function M.read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

function M.write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

return M
