-- samplers.lua — samplers for specs whose choices are known in advance.
--
--   local script = require("spec.support.samplers").script
--   local sm = script{ 260, 261, 2 }   -- returns 260, then 261, then 2, then nil, "script ended"
--   sm.accepted                        -- the ids passed to sm:accept
local M = {}

--- script(ids) -> a sampler returning the ids one per :sample call
function M.script(ids)
  local i = 0
  return {
    accepted = {},
    sample = function(_, logits)
      assert(logits.n > 0)
      i = i + 1
      if ids[i] == nil then return nil, "script ended" end
      return ids[i]
    end,
    accept = function(self, id) self.accepted[#self.accepted + 1] = id end,
  }
end

return M
