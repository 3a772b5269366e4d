-- Model objects: loading real GGUF files, model.info, metadata, tensors,
-- and the rules for misuse (raises) versus a failing world (nil, message).
local kvlua = require "kvlua"
local models = require "spec.support.models"

describe("kvlua module", function()
  it("has a version", function()
    assert.equals("0.1.0", kvlua.version)
  end)

  it("lists devices as an array of tables", function()
    local devs = kvlua.devices()
    assert.is_table(devs)
    for i, d in ipairs(devs) do
      assert.equals(i, d.index)
      assert.is_string(d.name)
      assert.is_string(d.type)
      assert.is_number(d.memory)
    end
  end)
end)

describe("kvlua.load", function()
  it("returns nil and a message for a missing file", function()
    local m, err = kvlua.load("/nonexistent/dir/model.gguf")
    assert.is_nil(m)
    assert.is_string(err)
    assert.matches("model.gguf", err, 1, true)
  end)

  it("raises on misuse", function()
    assert.has_error(function() kvlua.load() end)
    assert.has_error(function() kvlua.load({}) end)
    assert.has_error(function() kvlua.load("x.gguf", 5) end)
    assert.has_error(function() kvlua.load("x.gguf", { backend = "quantum" }) end)
    assert.has_error(function() kvlua.load("x.gguf", { threads = "many" }) end)
  end)
end)

local function with_model(name, fn)
  local path = models.path(name)
  if not path then
    pending(name .. " model not available")
    return
  end
  local m = assert(kvlua.load(path, { threads = 2 }))
  fn(m)
  m:close()
end

describe("SmolLM2-135M-Instruct (Q4_1)", function()
  it("reports its architecture", function()
    with_model("smollm2", function(m)
      local info = m.info
      assert.equals("llama", info.arch)
      assert.equals(30, info.n_layer)
      assert.equals(9, info.n_head)
      assert.equals(3, info.n_head_kv)
      assert.equals(576, info.n_embd)
      assert.equals(64, info.head_dim) -- derived: n_embd / n_head
      assert.equals(49152, info.n_vocab)
      assert.is_nil(info.sliding_window)
      assert.equals(3, info.file_type) -- MOSTLY_Q4_1
      assert.equals("cpu", info.backend)
      assert.is_true(info.n_params > 130e6 and info.n_params < 140e6)
    end)
  end)

  it("exposes raw metadata and tensors", function()
    with_model("smollm2", function(m)
      assert.equals("llama", m:meta("general.architecture"))
      assert.equals(30, m:meta("llama.block_count"))
      assert.is_nil(m:meta("no.such.key"))
      local toks = m:meta("tokenizer.ggml.tokens")
      assert.equals(49152, #toks)
      local ts = m:tensors()
      assert.equals(272, #ts)
      local byname = {}
      for _, t in ipairs(ts) do byname[t.name] = t end
      local q = byname["blk.0.attn_q.weight"]
      assert.equals("Q4_1", q.type)
      assert.same({ 576, 576 }, q.shape)
      assert.equals(576 * 576 / 32 * 20, q.bytes)
    end)
  end)

  it("computes KV cache sizes with GQA", function()
    with_model("smollm2", function(m)
      -- 2 (K,V) x 30 layers x 3 KV heads x 64 dims x 2 bytes per token,
      -- in pages of 16 tokens (1000 -> 1008) unless page_tokens says otherwise
      assert.equals(2 * 30 * 3 * 64 * 2 * 1008, m:kv_bytes { ctx = 1000 })
      assert.equals(2 * 30 * 3 * 64 * 2 * 1000, m:kv_bytes { ctx = 1000, page_tokens = 8 })
      assert.equals(2 * 2 * 30 * 3 * 64 * 2 * 1008, m:kv_bytes { ctx = 1000, batch = 2 })
      assert.has_error(function() m:kv_bytes { ktype = "f8" } end)
    end)
  end)

  it("has a vocabulary table", function()
    with_model("smollm2", function(m)
      assert.equals(49152, m.vocab.n)
      assert.equals(1, m.vocab.bos)
      assert.equals(2, m.vocab.eos)
    end)
  end)
end)

describe("Gemma 3 270M (Q4_K_M)", function()
  it("reports its architecture and sliding window", function()
    with_model("gemma3", function(m)
      local info = m.info
      assert.equals("gemma3", info.arch)
      assert.equals(18, info.n_layer)
      assert.equals(640, info.n_embd)
      assert.equals(4, info.n_head)
      assert.equals(1, info.n_head_kv)
      assert.equals(256, info.head_dim)
      assert.equals(512, info.sliding_window)
      assert.equals(262144, info.n_vocab)
    end)
  end)
end)

describe("closing", function()
  it("is idempotent and makes later use raise", function()
    with_model("smollm2", function(m)
      m:close()
      m:close()
      assert.has_error(function() return m.info end)
      assert.has_error(function() m:meta("general.name") end)
      assert.has_error(function() m:tokenize("x") end)
      assert.has_error(function() m:session() end)
    end)
  end)

  it("works with to-be-closed variables", function()
    local path = models.path("smollm2")
    if not path then return pending("no model") end
    local ref
    do
      local m <close> = assert(kvlua.load(path))
      ref = m
      assert.equals("llama", m.info.arch)
    end
    assert.has_error(function() return ref.info end)
  end)

  it("keeps the model alive while a session uses it", function()
    local path = models.path("smollm2")
    if not path then return pending("no model") end
    local m = assert(kvlua.load(path, { threads = 2 }))
    local s = assert(m:session { ctx = 64 })
    m = nil
    collectgarbage()
    collectgarbage()
    local logits = assert(s:prefill({ 1, 2, 3 }))
    assert.equals(49152, logits.n)
    -- closing the model while a session is open: the session still works
    local m2 = s.model
    m2:close()
    assert.is_not_nil(s:decode(5))
    s:close()
    s:close()
    assert.has_error(function() s:decode(5) end)
  end)
end)
