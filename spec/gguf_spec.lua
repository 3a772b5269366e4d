-- GGUF files through the Lua API: every malformation makes kvlua.load
-- return nil and a message saying what is wrong and where; a small valid
-- model exposes its metadata (model:meta) and tensors (model:tensors).
-- Files are written with spec/support/gguf_writer.lua into a temp dir.
local kvlua = require "kvlua"
local W = require "spec.support.gguf_writer"

local tmpfiles = {}
local function tmpfile(bytes)
  local path = os.tmpname()
  tmpfiles[#tmpfiles + 1] = path
  W.write_bytes(path, bytes)
  return path
end

teardown(function()
  for _, p in ipairs(tmpfiles) do os.remove(p) end
end)

local function load_fails(bytes, fragment)
  local path = tmpfile(bytes)
  local m, err = kvlua.load(path, { threads = 1 })
  if m then m:close() end
  assert.is_nil(m)
  assert.is_string(err)
  assert.matches(fragment, err, 1, true)
  return err
end

-- Expected message fragments (plain text), one per malformation in
-- gguf_writer.malformed.
local expected = {
  ["empty file"] = "empty",
  ["truncated header"] = "truncated: n_tensors needs 8 bytes, 4 left",
  ["truncated in a kv"] = "key 'tokenizer.ggml.tokens': truncated",
  ["truncated in a tensor info"] = "tensor 'b': truncated",
  ["truncated data"] = "tensor 'b': data [128, +64) runs past the end",
  ["bad magic"] = "bad magic 'GGML'",
  ["version 1"] = "unsupported version 1",
  ["n_tensors absurd"] = "n_tensors 1152921504606846976 cannot fit",
  ["n_kv absurd"] = "n_kv 1099511627776 cannot fit",
  ["string length past the end"] = "key 'bad.str': string length 100 runs past the end",
  ["string length 2^40"] = "length 1099511627776 is absurd",
  ["array count past the end"] = "key 'bad.arr': array of 1000 i32 needs 4000 bytes",
  ["string array count past the end"] = "array of 1000000 strings needs at least 8000000 bytes",
  ["unknown value type"] = "key 'bad.type': unknown value type 13",
  ["arrays nested too deep"] = "nested deeper than 8",
  ["duplicate key"] = "key 'general.name': duplicate key",
  ["duplicate tensor name"] = "tensor 'a': duplicate tensor name",
  ["n_dims 5"] = "tensor 'a': n_dims 5 not in 1..4",
  ["negative dimension"] = "tensor 'a': dimension 1 is -3",
  ["zero dimension"] = "tensor 'a': dimension 0 is 0",
  ["element count overflow"] = "tensor 'a': element count overflows",
  ["unknown tensor type"] = "tensor 'a': unknown ggml type 4",
  ["row not a multiple of the block size"] = "row length 48 is not a multiple of the Q4_0 block size 32",
  ["alignment 0"] = "'general.alignment' is 0",
  ["alignment not a power of two"] = "'general.alignment' is 48",
  ["alignment absurd"] = "'general.alignment' is 16777216",
  ["tensor offset not aligned"] = "tensor 'b': offset 8 not aligned to 32",
  ["tensors overlap"] = "tensor 'a' [0, +64) overlaps tensor 'b' at offset 32",
  ["tensor data past the end"] = "tensor 'b': data [64, +64) runs past the end",
}

describe("kvlua.load on malformed GGUF files", function()
  for _, name in ipairs(W.malformed_names) do
    it("fails on: " .. name, function()
      assert.is_string(expected[name], "no expected message for " .. name)
      load_fails(W.malformed[name](), expected[name])
    end)
  end

  it("names the file in the message", function()
    local bytes = W.malformed["tensor offset not aligned"]()
    local path = tmpfile(bytes)
    local m, err = kvlua.load(path)
    assert.is_nil(m)
    assert.matches(path, err, 1, true)
  end)

  it("fails cleanly on every truncation of a small valid file", function()
    local bytes = W.new():kv("general.architecture", "string", "llama")
      :arr("tokenizer.ggml.tokens", "string", { "a", "b" })
      :tensor("a", "F32", { 4 }):bytes()
    local path = os.tmpname()
    tmpfiles[#tmpfiles + 1] = path
    for n = 0, #bytes - 1 do
      W.write_bytes(path, bytes:sub(1, n))
      local m, err = kvlua.load(path)
      if m then m:close() end
      assert.is_nil(m, "a " .. n .. "-byte prefix loaded")
      assert.is_string(err)
    end
  end)

  it("fails on a known key with the wrong type, naming the key", function()
    local w = W.tiny_llama{
      n_layer = 1, n_embd = 8, n_head = 2, n_head_kv = 1, n_ff = 16, n_vocab = 8,
      meta = { { "llama.block_count", "string", "two" } },
    }
    load_fails(w:bytes(), "llama.block_count")
  end)
end)

describe("a small valid model", function()
  local path
  setup(function()
    local w = W.tiny_llama{
      n_layer = 2, n_embd = 16, n_head = 4, n_head_kv = 2, n_ff = 32, n_vocab = 12, seed = 7,
      meta = {
        { "test.u8", "u8", 200 }, { "test.i8", "i8", -100 }, { "test.i64", "i64", -5 },
        { "test.f64", "f64", 0.25 }, { "test.bool", "bool", true },
        { "test.ints", "array", { "i32", { 3, -1, 4 } } },
      },
    }
    path = tmpfile(w:bytes())
  end)

  it("loads", function()
    local m, err = kvlua.load(path, { threads = 1 })
    assert.is_nil(err)
    assert.is_not_nil(m)
    assert.equals("llama", m.info.arch)
    assert.equals(2, m.info.n_layer)
    assert.equals(16, m.info.n_embd)
    m:close()
  end)

  it("exposes metadata with model:meta", function()
    local m = assert(kvlua.load(path, { threads = 1 }))
    assert.equals("llama", m:meta("general.architecture"))
    assert.equals(2, m:meta("llama.block_count"))
    assert.equals(200, m:meta("test.u8"))
    assert.equals(-100, m:meta("test.i8"))
    assert.equals(-5, m:meta("test.i64"))
    assert.equals(0.25, m:meta("test.f64"))
    assert.is_true(m:meta("test.bool"))
    assert.same({ 3, -1, 4 }, m:meta("test.ints"))
    local tokens = m:meta("tokenizer.ggml.tokens")
    assert.equals(12, #tokens)
    assert.equals("<s>", tokens[2])
    assert.is_nil(m:meta("no.such.key"))
    m:close()
  end)

  it("lists tensors with model:tensors", function()
    local m = assert(kvlua.load(path, { threads = 1 }))
    local ts = m:tensors()
    assert.equals(3 + 2 * 9, #ts)
    local by = {}
    for _, t in ipairs(ts) do by[t.name] = t end
    assert.same({ 16, 12 }, by["token_embd.weight"].shape)
    assert.equals("F32", by["token_embd.weight"].type)
    assert.equals(16 * 12 * 4, by["token_embd.weight"].bytes)
    assert.same({ 16, 8 }, by["blk.1.attn_k.weight"].shape) -- n_head_kv 2 x head_dim 4
    assert.same({ 16 }, by["output_norm.weight"].shape)
    m:close()
  end)
end)
