-- ids.lua — what many specs share: deterministic token ids and a bit-for-bit
-- comparison of Logits.
--
--   local ids = require "spec.support.ids"
--   ids.some(count, n_vocab, seed)  -- ids in [3, n_vocab) (no specials), the same every run
--   ids.same(a, b)                   -- true when two Logits hold the same bits
local M = {}

function M.some(count, n, seed)
  local t, x = {}, seed or 12345
  for i = 1, count do
    x = (x * 1103515245 + 12345) % 2147483648
    t[i] = 3 + x % (n - 3)
  end
  return t
end

function M.same(a, b)
  if a.n ~= b.n or a.rows ~= b.rows then return false end
  local ta, tb = a:totable(), b:totable()
  for i = 1, #ta do
    if ta[i] ~= tb[i] then return false, i end
  end
  return true
end

return M
