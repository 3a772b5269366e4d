-- kvlua.progress — progress of a long run on stderr: a bar redrawn in
-- place on a terminal, plain lines (every tenth of the work) in a pipe or
-- a log file.
--
--   local progress = require "kvlua.progress"
--   local p = progress.new{ total = 120, label = "items" }
--   for i = 1, 120 do ...; p:update(i, "35.2 tok/s") end
--   p:finish("done in 12 s")
--
-- The mode is opts.mode, else $KVLUA_PROGRESS, else "bar" when stderr is a
-- terminal and "lines" otherwise; "off" prints nothing. Whether stderr is
-- a terminal is asked once, of the shell: `test -t 2` (the shell inherits
-- this process's stderr); plain Lua has no isatty.

local M = {}

local tty_cache
--- progress.stderr_is_tty() -> boolean
function M.stderr_is_tty()
  if tty_cache == nil then
    tty_cache = os.execute("test -t 2") == true
  end
  return tty_cache
end

local MODES = { bar = true, lines = true, off = true }

local Progress = {}
Progress.__index = Progress

--- progress.new{ total = N, label = "items", mode = "bar"|"lines"|"off", stream = io.stderr, width = 30 }
function M.new(opts)
  opts = opts or {}
  local mode = opts.mode or os.getenv("KVLUA_PROGRESS")
  if mode == nil or mode == "" or mode == "auto" then mode = M.stderr_is_tty() and "bar" or "lines" end
  if not MODES[mode] then error("progress: mode must be bar, lines or off, not " .. tostring(mode), 2) end
  return setmetatable({ total = opts.total or 0, label = opts.label or "items", mode = mode,
    stream = opts.stream or io.stderr, width = opts.width or 30, next_tenth = 1, last = nil }, Progress)
end

function Progress:bar_text(done, extra)
  local frac = self.total > 0 and math.min(1, done / self.total) or 1
  local fill = math.floor(frac * self.width + 0.5)
  return string.format("[%s%s] %d/%d %s %3d%%%s", string.rep("#", fill), string.rep(".", self.width - fill),
    done, self.total, self.label, math.floor(frac * 100 + 0.5), extra and extra ~= "" and ("  " .. extra) or "")
end

--- p:update(done [, extra_text])
function Progress:update(done, extra)
  if self.mode == "bar" then
    local text = self:bar_text(done, extra)
    if text ~= self.last then
      -- \r back to the start, \27[K clears what a longer line left
      self.stream:write("\r", text, "\27[K")
      self.stream:flush()
      self.last = text
    end
  elseif self.mode == "lines" and self.total > 0 then
    local tenth = done * 10 // self.total
    if tenth >= self.next_tenth and done < self.total then
      self.stream:write(string.format("progress: %d/%d %s%s\n", done, self.total, self.label,
        extra and extra ~= "" and ("  " .. extra) or ""))
      self.stream:flush()
      self.next_tenth = tenth + 1
    end
  end
end

--- p:finish([summary]): the last state, then a newline (bar) or a last line
function Progress:finish(summary)
  if self.mode == "bar" then
    if self.last then self.stream:write("\n") end
  end
  if self.mode ~= "off" and summary then self.stream:write(summary, "\n") end
  self.stream:flush()
end

return M
