-- generation.lua — a session's generation collected as one text.
--
--   local generate = require("spec.support.generation").text
--   local text, why = generate(s, { prompt = "Hi", max_tokens = 8 })  -- why: s.finish_reason
local M = {}

--- text(s, opts) -> the pieces of s:generate(opts) concatenated, s.finish_reason
function M.text(s, opts)
  local out = {}
  for piece in s:generate(opts) do out[#out + 1] = piece end
  return table.concat(out), s.finish_reason
end

return M
