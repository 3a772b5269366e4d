-- kvlua.png and kvlua.plot: the PNG files are read back by an independent
-- decoder (Python's zlib and a few lines of chunk parsing), checksums are
-- compared with their published check values, and the font's glyphs with
-- patterns written out here.
local png = require "kvlua.png"
local plot = require "kvlua.plot"
local files = require "spec.support.files"
local read = files.read

local function python_available()
  return os.execute("python3 -c 'import zlib' >/dev/null 2>&1") == true
end

-- Decompresses a zlib stream with Python's zlib; returns the bytes.
local function python_inflate(stream)
  local src, dst = files.write_temp(stream), os.tmpname()
  local ok = os.execute(string.format(
    "python3 -c 'import sys,zlib; open(sys.argv[2],\"wb\").write(zlib.decompress(open(sys.argv[1],\"rb\").read()))' %s %s",
    src, dst))
  local out = ok and read(dst) or nil
  os.remove(src)
  os.remove(dst)
  return out
end

-- Reads a PNG with Python: checks every chunk's CRC, returns
-- "width height bitdepth colortype ncolours" and the palette indices as bytes.
local DECODER = [[
import sys, zlib, struct
d = open(sys.argv[1], "rb").read()
assert d[:8] == b"\x89PNG\r\n\x1a\n", "signature"
pos, chunks = 8, []
while pos < len(d):
    n, = struct.unpack(">I", d[pos:pos+4]); kind = d[pos+4:pos+8]; body = d[pos+8:pos+8+n]
    crc, = struct.unpack(">I", d[pos+8+n:pos+12+n])
    assert zlib.crc32(kind + body) == crc, "crc of " + kind.decode()
    chunks.append((kind, body)); pos += 12 + n
kinds = [k for k, _ in chunks]
assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND", kinds
w, h, depth, ctype, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
plte = [b for k, b in chunks if k == b"PLTE"][0]
raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
rows = [raw[y*(w+1):(y+1)*(w+1)] for y in range(h)]
assert all(r[0] == 0 for r in rows), "filter type"
open(sys.argv[2], "wb").write(b"".join(r[1:] for r in rows))
print(w, h, depth, ctype, len(plte) // 3)
]]
local function python_read_png(bytes)
  local src, dst, prog = files.write_temp(bytes), os.tmpname(), files.write_temp(DECODER)
  local p = io.popen(string.format("python3 %s %s %s 2>&1", prog, src, dst))
  local header = p:read("a")
  local ok = p:close()
  local pixels = ok and read(dst) or nil
  os.remove(src); os.remove(dst); os.remove(prog)
  return ok and header or nil, pixels or header
end

describe("png checksums", function()
  it("CRC-32 and Adler-32 give their published check values", function()
    assert.equals(0xCBF43926, png.crc32("123456789"))
    assert.equals(0x11E60398, png.adler32("Wikipedia"))
    assert.equals(0, png.crc32(""))
    assert.equals(1, png.adler32(""))
  end)
end)

describe("png.zlib", function()
  local cases = {
    empty = "",
    one = "x",
    runs = string.rep("a", 1000) .. string.rep("b", 259) .. string.rep("\0", 70000),
    periodic = string.rep("abcdefghij", 5000),
  }
  -- pseudo-random bytes with repeats at many distances (up to the 32 KiB window and beyond)
  local parts, x = {}, 7
  for i = 1, 60000 do
    x = (x * 1103515245 + 12345) % 2147483648
    parts[i] = string.char(i % 5 == 0 and (x >> 16) % 256 or 97 + (i // 4000) % 4)
  end
  cases.mixed = table.concat(parts) .. table.concat(parts, "", 1, 40000)

  it("streams inflate back to the input (Python's zlib as the reader)", function()
    if not python_available() then return pending("python3 not available") end
    for name, data in pairs(cases) do
      assert.equals(data, python_inflate(png.zlib(data)), name)
    end
  end)

  it("shrinks runs and repeats", function()
    assert.is_true(#png.zlib(cases.runs) < #cases.runs / 50)
    assert.is_true(#png.zlib(cases.periodic) < #cases.periodic / 50)
  end)
end)

describe("png.indexed", function()
  it("writes a palette PNG that reads back pixel for pixel", function()
    if not python_available() then return pending("python3 not available") end
    local w, h = 37, 11
    local pixels = {}
    for y = 0, h - 1 do
      for x = 0, w - 1 do pixels[#pixels + 1] = (x * 3 + y * 7) % 4 end
    end
    local header, got = python_read_png(png.indexed(w, h, { { 255, 255, 255 }, { 0, 0, 0 }, { 255, 0, 0 },
      { 0, 0, 255 } }, pixels))
    assert(header, got)
    assert.equals("37 11 8 3 4\n", header)
    assert.equals(string.char(table.unpack(pixels)), got)
  end)

  it("raises on bad sizes, palettes and pixel counts", function()
    assert.has_error(function() png.indexed(0, 1, { { 0, 0, 0 } }, {}) end)
    assert.has_error(function() png.indexed(1, 1, {}, { 0 }) end)
    assert.has_error(function() png.indexed(2, 2, { { 0, 0, 0 } }, { 0, 0, 0 }) end)
  end)
end)

describe("plot", function()
  it("nice_ticks steps by 1, 2 or 5 times a power of ten and covers the range", function()
    assert.same({ 0, 10, 20, 30, 40, 50, 60, 70 }, (plot.nice_ticks(0, 64, 6)))
    assert.same({ 0, 5, 10, 15, 20 }, (plot.nice_ticks(0, 16.4, 5)))
    local t, step = plot.nice_ticks(0.12, 0.61, 5)
    assert.near(0.1, step, 1e-15)
    assert.equals(7, #t)
    assert.near(0.1, t[1], 1e-12)
    assert.near(0.7, t[#t], 1e-12)
  end)

  it("draws text in the 5x7 font", function()
    local cv = plot.canvas(12, 8)
    local ink = plot.color("black")
    cv:text(0, 0, "Hi", ink)
    local rows = {}
    for y = 0, 7 do
      local row = {}
      for x = 0, 11 do row[#row + 1] = cv.px[y * 12 + x + 1] == ink and "#" or "." end
      rows[#rows + 1] = table.concat(row)
    end
    assert.same({
      "#...#...#...",
      "#...#.......",
      "#...#..##...",
      "#####...#...",
      "#...#...#...",
      "#...#...#...",
      "#...#..###..",
      "............",
    }, rows)
  end)

  it("a figure is a PNG of the requested size holding the series' colours", function()
    if not python_available() then return pending("python3 not available") end
    local fig = plot.figure { width = 300, height = 200, title = "T" }
    local ax = fig:panel { xlabel = "x", ylabel = "y" }
    ax:line { points = { { 0, 0 }, { 1, 1 }, { 2, 4 } }, color = "orange", label = "squares" }
    ax:vline { x = 1, label = "one" }
    local header, pixels = python_read_png(fig:png())
    assert(header, pixels)
    assert.equals("300 200 8 3 " .. #plot.COLORS .. "\n", header)
    assert.truthy(pixels:find(string.char(plot.color("orange")), 1, true))
    assert.truthy(pixels:find(string.char(plot.color("black")), 1, true))
  end)

  it("rejects unknown colours and malformed points", function()
    local ax = plot.figure():panel {}
    assert.has_error(function() ax:line { points = { { 0, 0 } }, color = "mauve" } end)
    assert.has_error(function() ax:line { points = { { 0 } } } end)
    assert.has_error(function() ax:line {} end)
  end)
end)
