-- files.lua — temporary files for specs.
--
--   local files = require "spec.support.files"
--   local path = files.write_temp("text")   -- a new temporary file holding text
--   files.read(path) --> its bytes
--   files.write(path, s)                     -- replaces path's bytes with s
--   files.records(bytes, encrypted)          --> head, { record, ... }, tail  (kvlua session / cache files)
--   files.as_version(bytes, v)               --> a plain kvlua file as version v would have written it
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

-- A kvlua session or cache file cut into its parts: the 16 bytes of magic,
-- version and flags (and the 24-byte stream header when encrypted), the
-- records ([u32 n][n bytes] each, as stored), and what follows the last
-- (plain files: the end record and the checksum).
function M.records(bytes, encrypted)
  local off = encrypted and 16 + 24 or 16
  local recs, at = {}, off + 1
  while at <= #bytes do
    local n = string.unpack("<I4", bytes, at)
    if n == 0 and not encrypted then break end
    recs[#recs + 1] = bytes:sub(at, at + 4 + n - 1)
    at = at + 4 + n
  end
  return bytes:sub(1, off), recs, bytes:sub(at)
end

-- A plain (unencrypted) kvlua session or cache file with its version field
-- set to v and its checksum recomputed (BLAKE2b-256 of everything before the
-- end record, by coreutils' b2sum): the bytes a kvlua writing version v
-- would have written, as far as the container goes.
function M.as_version(bytes, v)
  local body = bytes:sub(1, 8) .. string.pack("<I4", v) .. bytes:sub(13, -37)
  local tmp = os.tmpname()
  M.write(tmp, body)
  local p = assert(io.popen("b2sum -l 256 " .. tmp))
  local hex = p:read("l"):match("^%x+")
  p:close()
  os.remove(tmp)
  assert(hex and #hex == 64, "b2sum failed")
  return body .. string.pack("<I4", 0) .. hex:gsub("%x%x", function(h) return string.char(tonumber(h, 16)) end)
end

return M
