-- Non-finite values on the way to attention: a NaN or Inf in the query or
-- key projections (or in what feeds them) would give NaN scores, which
-- attention's softmax treats like masked keys, so the logits would come out
-- finite and wrong. The engine checks queries and keys after RoPE and
-- fails the evaluation instead: nil, message, and the session as it was.
local kvlua = require "kvlua"
local tiny = require "spec.support.tiny_models"

local function model_with(tensor, k, value)
  local bytes, w = tiny.llama_bytes { seed = 21 }
  bytes = tiny.poke_f32(bytes, w, tensor, k, value)
  return assert(kvlua.load(tiny.write(bytes), { threads = 1 }))
end

describe("non-finite queries and keys", function()
  for _, case in ipairs {
    { "blk.0.attn_q.weight", 0 / 0, "NaN in attn_q" },
    { "blk.0.attn_k.weight", 0 / 0, "NaN in attn_k" },
    { "blk.0.attn_q.weight", math.huge, "Inf in attn_q" },
    { "blk.0.attn_k.weight", -math.huge, "-Inf in attn_k" },
    { "blk.0.attn_norm.weight", math.huge, "Inf in the norm that feeds them" },
  } do
    it(case[3] .. ": nil, message; the session stays as it was", function()
      local m = model_with(case[1], 3, case[2])
      local s = assert(m:session { ctx = 32 })
      local l, err = s:prefill({ 5, 6, 7 })
      assert.is_nil(l)
      assert.matches("non%-finite", err)
      assert.equals(0, s.pos)
      l, err = s:decode(5)
      assert.is_nil(l)
      assert.equals(0, s.pos)
      m:close()
    end)
  end
end)
