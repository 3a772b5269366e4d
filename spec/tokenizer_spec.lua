-- The tokenizer through the Lua API: llama.cpp's own test vectors
-- (tests/data/vocab), special tokens, BOS/EOS, pieces and
-- round trips on the real models.
local kvlua = require "kvlua"
local models = require "spec.support.models"

local dir = models.vocab_dir

local function read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

-- Inputs are separated by "\n__ggml_vocab_test__\n"; .out has one line of
-- space-separated ids per input.
local function cases(name)
  local inp = read(dir .. "/ggml-vocab-" .. name .. ".gguf.inp")
  local out = read(dir .. "/ggml-vocab-" .. name .. ".gguf.out")
  if not inp or not out then return nil end
  local sep = "\n__ggml_vocab_test__\n"
  local texts, pos = {}, 1
  while pos <= #inp do
    local a, b = inp:find(sep, pos, true)
    if not a then break end
    texts[#texts + 1] = inp:sub(pos, a - 1)
    pos = b + 1
  end
  local list, i = {}, 0
  for line in (out .. (out:sub(-1) == "\n" and "" or "\n")):gmatch("([^\n]*)\n") do
    i = i + 1
    local ids = {}
    for x in line:gmatch("%S+") do ids[#ids + 1] = math.tointeger(tonumber(x)) end
    list[i] = { text = texts[i], ids = ids }
  end
  return list
end

local function valid_utf8(s)
  return utf8.len(s) ~= nil
end

-- Text the reference's clean_up_tokenization_spaces would rewrite.
local function cleaned_by(model, s)
  return model == "gpt2" and s:find(" [%?!%.,']") ~= nil
end

local files = {
  { "llama-spm", "llama" },
  { "phi-3", "llama" },
  { "gpt-2", "gpt2", clean = true },
  { "starcoder", "gpt2", clean = true },
  { "deepseek-coder", "gpt2" },
}

for _, f in ipairs(files) do
  local name, kind = f[1], f[2]
  describe("conformance " .. name, function()
    local model
    setup(function()
      model = assert(kvlua.load(dir .. "/ggml-vocab-" .. name .. ".gguf"))
    end)
    teardown(function()
      if model then model:close() end
    end)

    it("tokenizes every input to llama.cpp's ids and detokenizes back", function()
      local list = cases(name)
      assert.is_table(list, "missing conformance data for " .. name)
      assert.is_true(#list > 0)
      for i, c in ipairs(list) do
        local ids = model:tokenize(c.text, { add_special = false, parse_special = false })
        assert.same(c.ids, ids, ("case %d: %q"):format(i, c.text))
        if valid_utf8(c.text) and not (f.clean and cleaned_by(kind, c.text)) then
          assert.equals(c.text, model:detokenize(ids), ("round trip of case %d"):format(i))
        end
      end
    end)
  end)
end

describe("tokenize options", function()
  local spm, bpe
  setup(function()
    spm = assert(kvlua.load(dir .. "/ggml-vocab-llama-spm.gguf"))
    bpe = assert(kvlua.load(dir .. "/ggml-vocab-gpt-2.gguf"))
  end)
  teardown(function()
    if spm then spm:close() end
    if bpe then bpe:close() end
  end)

  -- ids from llama.cpp (scripts/ref/llama_ref.py)
  it("adds BOS by default where the vocabulary says so", function()
    assert.same({ 1, 15043, 3186 }, spm:tokenize("Hello world"))
    assert.same({ 15043, 3186 }, spm:tokenize("Hello world", { add_special = false }))
    assert.same({ 15496, 995 }, bpe:tokenize("Hello world"))
  end)

  it("recognizes special token texts only with parse_special", function()
    assert.same({ 50256, 5303, 50256 }, bpe:tokenize("<|endoftext|>hi<|endoftext|>", { parse_special = true }))
    assert.same({ 27, 91, 437, 1659, 5239, 91, 29, 5303, 27, 91, 437, 1659, 5239, 91, 29 },
      bpe:tokenize("<|endoftext|>hi<|endoftext|>"))
    assert.same({ 1, 15043, 2 }, spm:tokenize("<s>Hello</s>", { add_special = false, parse_special = true }))
  end)

  it("handles invalid UTF-8 as the reference does", function()
    assert.same({ 29871, 258 }, spm:tokenize("\xff", { add_special = false }))
    assert.same({ 64, 4210, 65 }, bpe:tokenize("a\xffb"))
  end)

  it("removes and shows special tokens on request when detokenizing", function()
    local ids = spm:tokenize("Hello")
    -- BOS takes the one leading-space strip, as in llama_detokenize
    assert.equals(" Hello", spm:detokenize(ids))
    assert.equals(" Hello", spm:detokenize(ids, { remove_special = true }))
    assert.equals("<s> Hello", spm:detokenize(ids, { unparse_special = true }))
  end)

  it("gives token pieces", function()
    assert.equals("\n", spm:piece(13))
    assert.equals(" Hello", spm:piece(15043))
    assert.equals(" world", bpe:piece(995))
  end)

  it("raises for ids out of range", function()
    assert.has_error(function() spm:detokenize({ 1, 99999 }) end)
    assert.has_error(function() spm:piece(-1) end)
  end)
end)

describe("real models", function()
  local texts = {
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nand\r\ncrlf",
    "Ünïcödé: 日本語のテキスト, Ελληνικά, русский, العربية, हिन्दी, 😀🎉",
    "code: for (int i = 0; i < n; i++) { x += a[i] * 3.14159; }",
    "numbers 1234567890 and 3.5e-10, 1,000,000",
    "<|im_start|>user\nhi<|im_end|>",
    "<start_of_turn>user\nhi<end_of_turn>",
  }

  for _, name in ipairs({ "smollm2", "gemma3" }) do
    describe(name, function()
      local model
      setup(function()
        local path = models.path(name)
        if path then model = assert(kvlua.load(path)) end
      end)
      teardown(function()
        if model then model:close() end
      end)

      it("round-trips text through tokenize and detokenize", function()
        if not model then pending("model not available") return end
        for _, t in ipairs(texts) do
          local ids = model:tokenize(t, { add_special = false })
          assert.is_true(#ids > 0)
          assert.equals(t, model:detokenize(ids))
        end
      end)

      it("keeps special tokens as one id each with parse_special", function()
        if not model then pending("model not available") return end
        local eot = name == "smollm2" and "<|im_end|>" or "<end_of_turn>"
        local ids = model:tokenize("a" .. eot .. "b", { add_special = false, parse_special = true })
        assert.equals(3, #ids)
        assert.equals(eot, model:piece(ids[2]))
        assert.equals("ab", model:detokenize(ids))
        assert.equals("a" .. eot .. "b", model:detokenize(ids, { unparse_special = true }))
      end)

      it("tokenizes a long text in one call", function()
        if not model then pending("model not available") return end
        local t = string.rep("The quick brown fox jumps over the lazy dog. ", 5000)
        local ids = model:tokenize(t, { add_special = false })
        assert.is_true(#ids > 40000)
        assert.equals(t, model:detokenize(ids))
      end)
    end)
  end
end)
