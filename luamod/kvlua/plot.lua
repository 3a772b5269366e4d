-- kvlua.plot — line charts written as PNG files, in plain Lua (no
-- gnuplot): axes with ticks, gridlines, coloured lines, markers, dashed
-- guide lines, a legend and text in a built-in bitmap font.
--
--   local plot = require "kvlua.plot"
--   local fig = plot.figure{ width = 1000, height = 420, cols = 2 }
--   local ax = fig:panel{ title = "Cumulative time", xlabel = "token", ylabel = "seconds" }
--   ax:line{ points = { {1, 0.3}, {2, 0.33}, ... }, color = "blue", label = "with the cache" }
--   ax:vline{ x = 1.5, label = "decode ->" }          -- a dashed vertical guide
--   assert(fig:save("out.png"))                        -- or fig:png() -> bytes
--
-- Panels fill the figure left to right, then top to bottom (cols per row).
-- Axes start at 0 when all values are positive, and end at "nice" tick
-- values (1, 2 or 5 times a power of ten). Colours are names:
-- plot.COLORS lists them.
--
-- Layout of one panel (pixels):
--   +-------------------------------------------+
--   | title                      ylabel above   |  top margin
--   |  tick |  plot area (grid, lines, legend)  |
--   | labels|                                   |
--   |       +-----------------------------------+
--   |          x tick labels, xlabel            |  bottom margin
--   +-------------------------------------------+

local png = require "kvlua.png"
local font = require "kvlua.font"

local M = {}

-- ==== canvas ===================================================================

M.COLORS = { "white", "black", "grey", "light", "blue", "orange", "green", "red", "purple", "brown" }
local RGB = {
  white = { 255, 255, 255 }, black = { 30, 30, 30 }, grey = { 120, 120, 120 }, light = { 225, 225, 225 },
  blue = { 31, 119, 180 }, orange = { 230, 110, 14 }, green = { 44, 160, 44 }, red = { 214, 39, 40 },
  purple = { 148, 103, 189 }, brown = { 140, 86, 75 },
}
local INDEX = {}
for i, name in ipairs(M.COLORS) do INDEX[name] = i - 1 end

local function color_index(name)
  local i = INDEX[name or "black"]
  if not i then error("plot: unknown colour '" .. tostring(name) .. "'", 3) end
  return i
end

local Canvas = {}
Canvas.__index = Canvas

--- plot.canvas(width, height) -> a white canvas: cv:set(x, y, c), cv:rect,
--- cv:line, cv:text(x, y, s, c, scale), cv:png(); c is a palette index
--- (plot.color(name)); cv.px holds the indices row by row
local function canvas(w, h)
  local px = {}
  for i = 1, w * h do px[i] = 0 end -- white
  return setmetatable({ w = w, h = h, px = px }, Canvas)
end

function Canvas:set(x, y, c)
  x, y = math.floor(x + 0.5), math.floor(y + 0.5)
  if x >= 0 and y >= 0 and x < self.w and y < self.h then self.px[y * self.w + x + 1] = c end
end

function Canvas:rect(x0, y0, x1, y1, c)
  for y = math.floor(y0), math.floor(y1) do
    for x = math.floor(x0), math.floor(x1) do self:set(x, y, c) end
  end
end

-- A line `width` pixels thick; dash = {on, off} lengths in pixels, or nil.
function Canvas:line(x0, y0, x1, y1, c, width, dash)
  local dx, dy = x1 - x0, y1 - y0
  local steps = math.max(1, math.ceil(math.max(math.abs(dx), math.abs(dy))))
  local r = ((width or 1) - 1) / 2
  for i = 0, steps do
    if not dash or i % (dash[1] + dash[2]) < dash[1] then
      local x, y = x0 + dx * i / steps, y0 + dy * i / steps
      self:rect(x - r, y - r, x + r, y + r, c)
    end
  end
end

-- Text with its top-left corner at (x, y).
function Canvas:text(x, y, s, c, scale)
  scale = scale or 1
  for i = 1, #s do
    local rows = font.glyph(s:sub(i, i))
    local gx = x + (i - 1) * font.advance * scale
    for r, row in ipairs(rows) do
      for col = 1, #row do
        if row:byte(col) == 35 then -- '#'
          local px, py = gx + (col - 1) * scale, y + (r - 1) * scale
          self:rect(px, py, px + scale - 1, py + scale - 1, c)
        end
      end
    end
  end
end

M.canvas = canvas

--- plot.color(name) -> the palette index of a colour name
function M.color(name)
  return color_index(name)
end

function Canvas:png()
  local palette = {}
  for i, name in ipairs(M.COLORS) do palette[i] = RGB[name] end
  return png.indexed(self.w, self.h, palette, self.px)
end

-- ==== axes =====================================================================

--- plot.nice_ticks(lo, hi [, target = 5]) -> ticks, step: tick values
--- covering [lo, hi] at a step of 1, 2 or 5 times a power of ten, the
--- smallest such step giving at most 1.5 * target intervals
function M.nice_ticks(lo, hi, target)
  target = target or 5
  if hi <= lo then hi = lo + 1 end
  local raw = (hi - lo) / target
  local mag = 10 ^ math.floor(math.log(raw, 10))
  local step = mag
  for _, m in ipairs { 1, 2, 5, 10 } do
    step = m * mag
    if (hi - lo) / step <= 1.5 * target then break end
  end
  local ticks = {}
  local first = math.floor(lo / step + 1e-9) * step
  local last = math.ceil(hi / step - 1e-9) * step
  for k = 0, math.floor((last - first) / step + 0.5) do ticks[#ticks + 1] = first + k * step end
  return ticks, step
end

-- Tick label text: as many decimals as the step needs.
local function tick_label(v, step)
  local decimals = math.max(0, math.ceil(-math.log(step, 10) - 1e-9))
  if math.abs(v) < step * 1e-6 then v = 0 end
  return string.format("%." .. decimals .. "f", v)
end

-- ==== panels ===================================================================

local Panel = {}
Panel.__index = Panel

--- panel:line{ points = {{x, y}, ...}, color =, label =, width = 2, marker = false, dash = false }
function Panel:line(opts)
  if type(opts) ~= "table" or type(opts.points) ~= "table" then
    error("plot: line{points = {{x, y}, ...}} expected", 2)
  end
  for i, p in ipairs(opts.points) do
    if type(p) ~= "table" or type(p[1]) ~= "number" or type(p[2]) ~= "number" then
      error("plot: point " .. i .. " is not {x, y}", 2)
    end
  end
  color_index(opts.color)
  self.series[#self.series + 1] = opts
  return self
end

--- panel:vline{ x =, label =, color = "grey" }: a dashed vertical guide
function Panel:vline(opts)
  self.guides[#self.guides + 1] = opts
  return self
end

local function bounds(self)
  local xmin, xmax, ymin, ymax = math.huge, -math.huge, math.huge, -math.huge
  for _, s in ipairs(self.series) do
    for _, p in ipairs(s.points) do
      xmin, xmax = math.min(xmin, p[1]), math.max(xmax, p[1])
      ymin, ymax = math.min(ymin, p[2]), math.max(ymax, p[2])
    end
  end
  if xmin > xmax then xmin, xmax, ymin, ymax = 0, 1, 0, 1 end
  if ymin > 0 then ymin = 0 end
  if self.xmin then xmin = self.xmin end
  if xmin > 0 and self.x_from_zero then xmin = 0 end
  return xmin, xmax, ymin, ymax
end

local MARGIN = { left = 64, right = 18, top = 44, bottom = 46 }

-- Draws the panel into the canvas region (x0, y0, w, h).
function Panel:draw(cv, x0, y0, w, h)
  local black, grey, light = color_index("black"), color_index("grey"), color_index("light")
  local xmin, xmax, ymin, ymax = bounds(self)
  -- x spans the data exactly (ticks inside it), y ends on ticks
  local xt, xstep = M.nice_ticks(xmin, xmax, self.xticks or 6)
  local inside = {}
  for _, v in ipairs(xt) do
    if v >= xmin - xstep * 1e-9 and v <= xmax + xstep * 1e-9 then inside[#inside + 1] = v end
  end
  xt = inside
  if xmax <= xmin then xmax = xmin + 1 end
  local yt, ystep = M.nice_ticks(ymin, ymax, self.yticks or 5)
  ymin, ymax = yt[1], yt[#yt]
  local L, R = x0 + MARGIN.left, x0 + w - MARGIN.right
  local T, B = y0 + MARGIN.top, y0 + h - MARGIN.bottom
  local function sx(x) return L + (x - xmin) / (xmax - xmin) * (R - L) end
  local function sy(y) return B - (y - ymin) / (ymax - ymin) * (B - T) end

  -- title and axis labels
  if self.title then cv:text(x0 + (w - font.width(self.title, 2)) / 2, y0 + 4, self.title, black, 2) end
  if self.ylabel then cv:text(x0 + 6, T - 14, self.ylabel, black) end
  if self.xlabel then cv:text((L + R - font.width(self.xlabel)) / 2, B + 24, self.xlabel, black) end

  -- grid and ticks
  for _, v in ipairs(yt) do
    local y = sy(v)
    cv:line(L, y, R, y, light)
    cv:line(L - 4, y, L, y, black)
    local s = tick_label(v, ystep)
    cv:text(L - 7 - font.width(s), y - 3, s, black)
  end
  for _, v in ipairs(xt) do
    local x = sx(v)
    cv:line(x, T, x, B, light)
    cv:line(x, B, x, B + 4, black)
    local s = tick_label(v, xstep)
    cv:text(x - font.width(s) / 2, B + 8, s, black)
  end

  -- guides, then the series, then the frame on top
  for _, g in ipairs(self.guides) do
    local x = sx(g.x)
    local c = color_index(g.color or "grey")
    cv:line(x, T, x, B, c, 1, { 4, 4 })
    if g.label then cv:text(x + 4, T + 4, g.label, c) end
  end
  for _, s in ipairs(self.series) do
    local c = color_index(s.color)
    local pts = s.points
    for i = 2, #pts do
      cv:line(sx(pts[i - 1][1]), sy(pts[i - 1][2]), sx(pts[i][1]), sy(pts[i][2]), c, s.width or 2,
        s.dash and { 6, 4 } or nil)
    end
    if s.marker or #pts == 1 then
      for _, p in ipairs(pts) do cv:rect(sx(p[1]) - 2, sy(p[2]) - 2, sx(p[1]) + 2, sy(p[2]) + 2, c) end
    end
  end
  cv:line(L, T, L, B, black)
  cv:line(L, B, R, B, black)
  cv:line(L, T, R, T, black)
  cv:line(R, T, R, B, black)
  self:draw_legend(cv, L, R, T, B, sx, sy)
end

-- How many sample points of the series' segments fall inside a box.
local function crowding(series, sx, sy, x0, y0, x1, y1)
  local n = 0
  for _, s in ipairs(series) do
    local pts = s.points
    for i = 1, #pts do
      local a, b = pts[math.max(1, i - 1)], pts[i]
      for t = 0, 1, 0.125 do
        local x, y = sx(a[1] + (b[1] - a[1]) * t), sy(a[2] + (b[2] - a[2]) * t)
        if x >= x0 and x <= x1 and y >= y0 and y <= y1 then n = n + 1 end
      end
    end
  end
  return n
end

-- The legend: a white box in the corner of the plot area the lines cross
-- least (or the one self.legend names: "left", "right", "bottom-left",
-- "bottom-right").
function Panel:draw_legend(cv, L, R, T, B, sx, sy)
  local labelled = {}
  for _, s in ipairs(self.series) do
    if s.label then labelled[#labelled + 1] = s end
  end
  if #labelled == 0 then return end
  local wmax = 0
  for _, s in ipairs(labelled) do wmax = math.max(wmax, font.width(s.label)) end
  local bw, bh = wmax + 40, #labelled * 14 + 8
  local top = T + 8 + (self.guides[1] and self.guides[1].label and 14 or 0)
  local corners = {
    left = { L + 8, top }, right = { R - bw - 8, top },
    ["bottom-left"] = { L + 8, B - bh - 8 }, ["bottom-right"] = { R - bw - 8, B - bh - 8 },
  }
  local corner = corners[self.legend or ""]
  if not corner then
    local best
    for _, name in ipairs { "left", "right", "bottom-right", "bottom-left" } do
      local c = corners[name]
      local n = crowding(self.series, sx, sy, c[1], c[2], c[1] + bw, c[2] + bh)
      if not best or n < best then best, corner = n, c end
    end
  end
  local bx, by = corner[1], corner[2]
  local grey = color_index("grey")
  cv:rect(bx, by, bx + bw, by + bh, color_index("white"))
  cv:line(bx, by, bx + bw, by, grey)
  cv:line(bx, by + bh, bx + bw, by + bh, grey)
  cv:line(bx, by, bx, by + bh, grey)
  cv:line(bx + bw, by, bx + bw, by + bh, grey)
  for i, s in ipairs(labelled) do
    local y = by + 4 + (i - 1) * 14 + 4
    cv:line(bx + 6, y, bx + 28, y, color_index(s.color), s.width or 2, s.dash and { 6, 4 } or nil)
    cv:text(bx + 34, y - 3, s.label, color_index("black"))
  end
end

-- ==== figures ==================================================================

local Figure = {}
Figure.__index = Figure

--- plot.figure{ width = 800, height = 480, cols = 1, title = nil, subtitle = nil }
function M.figure(opts)
  opts = opts or {}
  return setmetatable({ width = opts.width or 800, height = opts.height or 480, cols = opts.cols or 1,
    title = opts.title, subtitle = opts.subtitle, panels = {} }, Figure)
end

--- fig:panel{ title =, xlabel =, ylabel =, legend = nil (the emptiest corner) | "left" | "right" |
---             "bottom-left" | "bottom-right", xmin =, xticks =, yticks = } -> panel
function Figure:panel(opts)
  local p = setmetatable({ series = {}, guides = {} }, Panel)
  for k, v in pairs(opts or {}) do p[k] = v end
  self.panels[#self.panels + 1] = p
  return p
end

--- fig:png() -> the PNG file's bytes
function Figure:png()
  local cv = canvas(self.width, self.height)
  local top = 0
  if self.title then
    cv:text((self.width - font.width(self.title, 2)) / 2, 8, self.title, color_index("black"), 2)
    top = 30
  end
  if self.subtitle then
    cv:text((self.width - font.width(self.subtitle)) / 2, top + 2, self.subtitle, color_index("grey"))
    top = top + 16
  end
  local rows = math.max(1, math.ceil(#self.panels / self.cols))
  local pw, ph = self.width // self.cols, (self.height - top) // rows
  for i, p in ipairs(self.panels) do
    local c, r = (i - 1) % self.cols, (i - 1) // self.cols
    p:draw(cv, c * pw, top + r * ph, pw, ph)
  end
  return cv:png()
end

--- fig:save(path) -> true | nil, message
function Figure:save(path)
  local f, err = io.open(path, "wb")
  if not f then return nil, err end
  f:write(self:png())
  f:close()
  return true
end

return M
