-- grammar_batch_spec.lua — constrained generation past s:generate's own
-- sampler: findings of an audit, one describe each.
--   1. generate{grammar =} (and json_schema =) took whatever a sampler of one's
--      own returned: a sampler that ignores the mask wrote text outside the
--      grammar (the accept result was ignored). Now such a pick ends the
--      generation with finish_reason "grammar" and s.grammar_error naming it,
--      before the token is counted or shown.
local kvlua = require "kvlua"
local tiny = require "spec.support.tiny_models"

local function generate(s, opts)
  local out = {}
  for piece in s:generate(opts) do out[#out + 1] = piece end
  return table.concat(out), s.finish_reason
end

-- A sampler that ignores its Logits: the listed byte tokens, in order.
local function scripted(bytes)
  local sm = { accepted = {} }
  local i = 0
  function sm:sample()
    i = i + 1
    return tiny.id(bytes:byte(i))
  end
  function sm:accept(id) self.accepted[#self.accepted + 1] = id end
  return sm
end

describe("1. a sampler that ignores the grammar's mask never writes outside it", function()
  local m
  setup(function() m = assert(kvlua.load(tiny.llama{ vocab = "bytes", seed = 3 }, { backend = "cpu" })) end)
  teardown(function() m:close(); tiny.cleanup() end)

  it("grammar =: the refused pick ends with finish_reason \"grammar\"", function()
    local s = m:session{ ctx = 64 }
    local sm = scripted("ab!cd")
    local text, why = generate(s, { prompt = "Hello", grammar = 'root ::= [a-z]+', max_tokens = 5, sampler = sm })
    assert.equal("ab", text)
    assert.equal("grammar", why)
    assert.truthy(s.grammar_error:find("^grammar: the sampler chose token " .. tiny.id(0x21)), s.grammar_error)
    assert.same({ tiny.id(0x61), tiny.id(0x62) }, s.generated)
    assert.same({ tiny.id(0x61), tiny.id(0x62) }, sm.accepted) -- the refused token is not accepted either
    s:close()
  end)

  it("json_schema =: the same", function()
    local s = m:session{ ctx = 64 }
    local text, why = generate(s, { prompt = "Hello", json_schema = { type = "boolean" }, max_tokens = 5,
                                    sampler = scripted("tx") })
    assert.equal("t", text)
    assert.equal("grammar", why)
    assert.truthy(s.grammar_error:find("^grammar: the sampler chose token " .. tiny.id(0x78)), s.grammar_error)
    s:close()
  end)

  it("a sampler that keeps to the grammar is unaffected", function()
    local s = m:session{ ctx = 64 }
    local text, why = generate(s, { prompt = "Hello", grammar = 'root ::= [a-z]+', max_tokens = 3,
                                    sampler = scripted("abc") })
    assert.equal("abc", text)
    assert.equal("length", why)
    s:close()
  end)
end)
