-- kvlua.png — a small PNG encoder in plain Lua, for the scripts' plots.
--
--   local png = require "kvlua.png"
--   local bytes = png.indexed(width, height, palette, pixels)
--     palette: array of {r, g, b} (0..255), at most 256 colours
--     pixels:  width * height palette indices (0-based), row by row
--
-- An 8-bit palette image (colour type 3): signature, IHDR, PLTE, one IDAT,
-- IEND, each chunk closed by its CRC-32. The image data is a zlib stream
-- (RFC 1950: header, deflate, Adler-32) whose deflate part (RFC 1951) is
-- one block of fixed Huffman codes over a greedy LZ77 parse (hash chains,
-- 32 KiB window). Plots are mostly runs and repeated rows, which this
-- shrinks some fifty times; it is no match for zlib on photographs.
-- png.zlib, png.deflate, png.crc32 and png.adler32 are exposed for tests.

local M = {}

-- ==== checksums ==============================================================

local CRC_TABLE = {}
for n = 0, 255 do
  local c = n
  for _ = 1, 8 do
    c = (c & 1) == 1 and (0xEDB88320 ~ (c >> 1)) or (c >> 1)
  end
  CRC_TABLE[n] = c
end

--- png.crc32(s [, crc]) -> the CRC-32 (ISO-HDLC, as PNG and zlib) of s
function M.crc32(s, crc)
  crc = (crc or 0) ~ 0xFFFFFFFF
  for i = 1, #s do
    crc = CRC_TABLE[(crc ~ s:byte(i)) & 0xFF] ~ (crc >> 8)
  end
  return crc ~ 0xFFFFFFFF
end

--- png.adler32(s) -> the Adler-32 of s
function M.adler32(s)
  local a, b = 1, 0
  local i, n = 1, #s
  while i <= n do
    -- 5552 bytes keep b below 2^32 before the modulo (zlib's NMAX)
    local j = math.min(n, i + 5551)
    for k = i, j do
      a = a + s:byte(k)
      b = b + a
    end
    a, b = a % 65521, b % 65521
    i = j + 1
  end
  return (b << 16) | a
end

-- ==== deflate: fixed Huffman codes ===========================================

-- Bit writer: deflate packs bits from the least significant end of each byte.
local function bit_writer()
  local out, acc, nacc = {}, 0, 0
  local w = {}
  function w.put(value, nbits)
    acc = acc | (value << nacc)
    nacc = nacc + nbits
    while nacc >= 8 do
      out[#out + 1] = string.char(acc & 0xFF)
      acc = acc >> 8
      nacc = nacc - 8
    end
  end
  function w.finish()
    if nacc > 0 then out[#out + 1] = string.char(acc & 0xFF) end
    return table.concat(out)
  end
  return w
end

local function reverse_bits(code, n)
  local r = 0
  for _ = 1, n do
    r = (r << 1) | (code & 1)
    code = code >> 1
  end
  return r
end

-- The fixed literal/length code (RFC 1951 3.2.6), bit-reversed for the writer.
local LIT_CODE, LIT_BITS = {}, {}
for v = 0, 287 do
  local code, n
  if v <= 143 then code, n = 0x30 + v, 8
  elseif v <= 255 then code, n = 0x190 + v - 144, 9
  elseif v <= 279 then code, n = v - 256, 7
  else code, n = 0xC0 + v - 280, 8 end
  LIT_CODE[v], LIT_BITS[v] = reverse_bits(code, n), n
end

local LEN_BASE = { 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59,
                   67, 83, 99, 115, 131, 163, 195, 227, 258 }
local LEN_EXTRA = { 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0 }
local DIST_BASE = { 1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49, 65, 97, 129, 193, 257, 385, 513, 769,
                    1025, 1537, 2049, 3073, 4097, 6145, 8193, 12289, 16385, 24577 }
local DIST_EXTRA = { 0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10,
                     11, 11, 12, 12, 13, 13 }

-- length 3..258 -> index into LEN_BASE (symbol 256 + index)
local LEN_INDEX = {}
for i = 1, #LEN_BASE do
  -- 258 has its own symbol (285); symbol 284 stops at 257
  local last = (i < #LEN_BASE) and LEN_BASE[i + 1] - 1 or 258
  for len = LEN_BASE[i], last do LEN_INDEX[len] = i end
end

local function dist_index(d)
  local lo, hi = 1, #DIST_BASE
  while lo < hi do
    local mid = (lo + hi + 1) // 2
    if DIST_BASE[mid] <= d then lo = mid else hi = mid - 1 end
  end
  return lo
end

local function put_match(w, len, dist)
  local li = LEN_INDEX[len]
  local sym = 256 + li
  w.put(LIT_CODE[sym], LIT_BITS[sym])
  if LEN_EXTRA[li] > 0 then w.put(len - LEN_BASE[li], LEN_EXTRA[li]) end
  local di = dist_index(dist)
  w.put(reverse_bits(di - 1, 5), 5)
  if DIST_EXTRA[di] > 0 then w.put(dist - DIST_BASE[di], DIST_EXTRA[di]) end
end

-- ==== deflate: LZ77 ===========================================================

local WINDOW, MAX_LEN, MAX_CHAIN = 32768, 258, 16

-- Length of the common run of s at positions a < b, at most `limit`.
local function match_length(s, a, b, limit)
  local n = 0
  -- compare 8 bytes at a time while both fit
  while n + 8 <= limit and s:sub(a + n, a + n + 7) == s:sub(b + n, b + n + 7) do n = n + 8 end
  while n < limit and s:byte(a + n) == s:byte(b + n) do n = n + 1 end
  return n
end

--- png.deflate(data) -> a raw deflate stream (one final fixed-Huffman block)
function M.deflate(s)
  local w = bit_writer()
  w.put(1, 1) -- BFINAL
  w.put(1, 2) -- BTYPE 01: fixed Huffman codes
  local head, prev = {}, {} -- hash of 3 bytes -> latest position; position -> previous one
  local n = #s
  local function insert(i)
    if i + 2 <= n then
      local h = s:sub(i, i + 2)
      prev[i] = head[h]
      head[h] = i
    end
  end
  local i = 1
  while i <= n do
    local best_len, best_dist = 0, 0
    if i + 2 <= n then
      local cand = head[s:sub(i, i + 2)]
      local limit = math.min(MAX_LEN, n - i + 1)
      local tries = 0
      while cand and i - cand <= WINDOW and tries < MAX_CHAIN do
        local len = match_length(s, cand, i, limit)
        if len > best_len then
          best_len, best_dist = len, i - cand
          if len == limit then break end
        end
        cand = prev[cand]
        tries = tries + 1
      end
    end
    if best_len >= 3 then
      put_match(w, best_len, best_dist)
      for k = i, i + best_len - 1 do insert(k) end
      i = i + best_len
    else
      local b = s:byte(i)
      w.put(LIT_CODE[b], LIT_BITS[b])
      insert(i)
      i = i + 1
    end
  end
  w.put(LIT_CODE[256], LIT_BITS[256]) -- end of block
  return w.finish()
end

--- png.zlib(data) -> a zlib stream (RFC 1950) of data
function M.zlib(s)
  -- CMF 0x78: deflate, 32 KiB window; FLG 0x01 makes CMF*256+FLG a multiple of 31
  return "\x78\x01" .. M.deflate(s) .. string.pack(">I4", M.adler32(s))
end

-- ==== PNG =====================================================================

local function chunk(kind, data)
  return string.pack(">I4", #data) .. kind .. data .. string.pack(">I4", M.crc32(kind .. data))
end

--- png.indexed(width, height, palette, pixels) -> PNG file bytes
function M.indexed(width, height, palette, pixels)
  if math.type(width) ~= "integer" or math.type(height) ~= "integer" or width < 1 or height < 1 then
    error("png.indexed: width and height must be positive integers", 2)
  end
  if type(palette) ~= "table" or #palette < 1 or #palette > 256 then
    error("png.indexed: palette must hold 1 to 256 colours", 2)
  end
  if type(pixels) ~= "table" or #pixels ~= width * height then
    error(string.format("png.indexed: %d pixels expected, got %d", width * height,
      type(pixels) == "table" and #pixels or 0), 2)
  end
  local plte = {}
  for i, c in ipairs(palette) do plte[i] = string.char(c[1], c[2], c[3]) end
  local rows = {}
  for y = 0, height - 1 do
    -- filter byte 0 (none), then the row's indices; string.char takes a
    -- few thousand arguments at a time
    local parts = { "\0" }
    for x0 = 1, width, 4096 do
      local x1 = math.min(width, x0 + 4095)
      parts[#parts + 1] = string.char(table.unpack(pixels, y * width + x0, y * width + x1))
    end
    rows[#rows + 1] = table.concat(parts)
  end
  local ihdr = string.pack(">I4I4BBBBB", width, height, 8, 3, 0, 0, 0)
  return "\x89PNG\r\n\x1a\n" .. chunk("IHDR", ihdr) .. chunk("PLTE", table.concat(plte))
    .. chunk("IDAT", M.zlib(table.concat(rows))) .. chunk("IEND", "")
end

return M
