-- samplers.lua — samplers for specs whose choices are known in advance.
--
--   local script = require("spec.support.samplers").script
--   local sm = script{ 260, 261, 2 }   -- returns 260, then 261, then 2, then nil, "script ended"
--   sm.accepted                        -- the ids passed to sm:accept
--   local spell, replies = require("spec.support.samplers").speller(2)
--   spell("hi", 2)                     -- scripts the byte tokens of "hi", then 2
--   replies("a", "b")                  -- spell("a", 2, "b", 2)
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

--- speller(eos) -> spell, replies: samplers for a tiny model with a byte
--- vocabulary (spec.support.tiny_models, vocab = "bytes").
--- spell(...) scripts its arguments, one byte token per byte, and `eos` for an
--- argument equal to eos; replies(...) spells the texts, each ended by eos.
function M.speller(eos)
  local tiny = require "spec.support.tiny_models"
  local function spell(...)
    local ids = {}
    for _, part in ipairs { ... } do
      if part == eos then
        ids[#ids + 1] = eos
      else
        for i = 1, #part do ids[#ids + 1] = tiny.id(part:byte(i)) end
      end
    end
    return M.script(ids)
  end
  local function replies(...)
    local parts = {}
    for _, text in ipairs { ... } do
      parts[#parts + 1] = text
      parts[#parts + 1] = eos
    end
    return spell(table.unpack(parts))
  end
  return spell, replies
end

return M
