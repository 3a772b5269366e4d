-- tiny_models.lua — small GGUF files for the session and generate specs,
-- written to temporary files with the Lua GGUF writer (no download):
--
--   local tiny = require "spec.support.tiny_models"
--   local path = tiny.llama{ n_vocab = 64, seed = 3 }   -- random F32 llama
--   local path = tiny.llama{ vocab = "bytes" }          -- SPM vocabulary with
--                                                       -- byte tokens and words
--   tiny.id("▁Hello")                                   -- id of a word in it
--   local bytes, w = tiny.llama_bytes{...}              -- the image and its writer
--   bytes = tiny.poke_f32(bytes, w, "output_norm.weight", 0, 0/0)
--   bytes = tiny.set_type(bytes, w, "blk.0.attn_q.weight", W.types.I32.id)
--   local path = tiny.vocab_only()                      -- tokenizer, no tensors
--   tiny.write(bytes) -> path;  tiny.cleanup()          -- temp files
local W = require "spec.support.gguf_writer"

local T = {}

local tmpfiles = {}

function T.write(bytes)
  local path = os.tmpname()
  tmpfiles[#tmpfiles + 1] = path
  return W.write_bytes(path, bytes)
end

function T.cleanup()
  for _, p in ipairs(tmpfiles) do os.remove(p) end
  tmpfiles = {}
end

-- ==== the "bytes" vocabulary ===============================================
-- ids 0..2: <unk> <s> </s>; 3..258: byte tokens <0x00>..<0xFF> (so any text
-- can be written, one UTF-8 byte per token); then a few words.

T.words = { "▁Hello", "▁world", "!", "▁STOP", "ST", "OP", "▁", "é", "\n" }

function T.byte_vocab()
  local tokens, tt = { "<unk>", "<s>", "</s>" }, { 2, 3, 3 }
  for b = 0, 255 do
    tokens[#tokens + 1] = ("<0x%02X>"):format(b)
    tt[#tt + 1] = 6
  end
  for _, w in ipairs(T.words) do
    tokens[#tokens + 1] = w
    tt[#tt + 1] = 1
  end
  return tokens, tt
end

-- Id of a token of the bytes vocabulary: a word of T.words, or one byte
-- (a number 0..255).
function T.id(word)
  if type(word) == "number" then return 3 + word end
  for i, w in ipairs(T.words) do
    if w == word then return 258 + i end
  end
  error("tiny_models: no word " .. tostring(word))
end

-- ==== models ===============================================================

-- Defaults: 2 layers, n_embd 32, 4 heads (2 KV heads), n_ff 64, 64 tokens.
-- o.vocab = "bytes" uses the bytes vocabulary; other keys go to
-- W.tiny_llama.
function T.llama_bytes(o)
  o = o or {}
  local args = {
    n_layer = 2, n_embd = 32, n_head = 4, n_head_kv = 2, n_ff = 64, n_vocab = 64,
    seed = 1, n_ctx = 512,
  }
  for k, v in pairs(o) do
    if k ~= "vocab" then args[k] = v end
  end
  if o.vocab == "bytes" then
    args.tokens, args.token_type = T.byte_vocab()
    args.n_vocab = #args.tokens
  end
  local w = W.tiny_llama(args)
  return w:bytes(), w
end

function T.llama(o)
  return T.write((T.llama_bytes(o)))
end

-- A tiny llama whose matrices (attention, FFN, output) are quantized:
-- o.qtype = "Q8_0" | "Q4_0" | "Q4_1" | "Q5_0" | "Q5_1" (default Q8_0), random blocks
-- with small power-of-two scales; embeddings and norms stay F32. Row
-- lengths must be multiples of 32: defaults n_embd 64, n_ff 128.
local function f16_pow2(e, negative) -- bits of +-2^e as an IEEE half (normal range)
  return ((e + 15) << 10) | (negative and 0x8000 or 0)
end

function T.llama_quant_bytes(o)
  o = o or {}
  local qtype = o.qtype or "Q8_0"
  local args = { n_layer = 2, n_embd = 64, n_head = 4, n_head_kv = 2, n_ff = 128, n_vocab = 64,
    seed = 1, n_ctx = 512 }
  for k, v in pairs(o) do
    if k ~= "qtype" then args[k] = v end
  end
  local src = W.tiny_llama(args) -- for its metadata and F32 tensors
  local w = W.new()
  w.kvs, w.n_kv = src.kvs, src.n_kv
  local x = (args.seed or 1) * 2654435761 % 4294967296 + 1
  local function byte()
    x = (x * 1103515245 + 12345) % 2147483648
    return (x >> 16) & 0xFF
  end
  local function blocks(n_elems)
    local out = {}
    for b = 1, n_elems // 32 do
      local e = -11 - byte() % 3 -- scale 2^-11 .. 2^-13 (Q8_0), shifted for 4/5-bit types
      local qs = {}
      if qtype == "Q8_0" then
        for i = 1, 32 do qs[i] = string.pack("<i1", byte() - 128) end
        out[b] = string.pack("<I2", f16_pow2(e)) .. table.concat(qs)
      else
        for i = 1, 16 do qs[i] = string.char(byte()) end
        local d = string.pack("<I2", f16_pow2(e + 3))
        if qtype == "Q4_0" then
          out[b] = d .. table.concat(qs)
        elseif qtype == "Q4_1" then
          out[b] = d .. string.pack("<I2", f16_pow2(e + 5, true)) .. table.concat(qs)
        elseif qtype == "Q5_0" then
          out[b] = d .. string.char(byte(), byte(), byte(), byte()) .. table.concat(qs)
        elseif qtype == "Q5_1" then
          out[b] = d .. string.pack("<I2", f16_pow2(e + 6, true)) .. string.char(byte(), byte(), byte(), byte())
            .. table.concat(qs)
        else
          error("tiny_models: qtype " .. qtype)
        end
      end
    end
    return table.concat(out)
  end
  local quantized = { attn_q = 1, attn_k = 1, attn_v = 1, attn_output = 1, ffn_gate = 1, ffn_up = 1,
    ffn_down = 1, output = 1 }
  -- re-emit every tensor of the F32 model, quantizing the matrices
  for _, info in ipairs(src.infos) do
    local name, p = string.unpack("<s8", info)
    local n_dims
    n_dims, p = string.unpack("<I4", info, p)
    local ne = {}
    for d = 1, n_dims do ne[d], p = string.unpack("<i8", info, p) end
    local base = name:match("([%w_]+)%.weight$")
    if n_dims == 2 and quantized[base] then
      w:tensor(name, qtype, ne, blocks(ne[1] * ne[2]))
    else
      local off = select(2, string.unpack("<I4i8", info, p))
      for _, d in ipairs(src.data) do
        if d[1] == off then w:tensor(name, "F32", ne, d[2]) end
      end
    end
  end
  return w:bytes(), w
end

function T.llama_quant(o)
  return T.write((T.llama_quant_bytes(o)))
end

-- A GGUF holding only a tokenizer (the bytes vocabulary), no tensors.
function T.vocab_only()
  local tokens, tt = T.byte_vocab()
  local scores = {}
  for i = 1, #tokens do scores[i] = -(i - 1) * 1.0 end
  local w = W.new()
  w:kv("general.architecture", "string", "llama")
  w:kv("general.name", "string", "vocab-only")
  w:kv("tokenizer.ggml.model", "string", "llama")
  w:arr("tokenizer.ggml.tokens", "string", tokens)
  w:arr("tokenizer.ggml.scores", "f32", scores)
  w:arr("tokenizer.ggml.token_type", "i32", tt)
  w:kv("tokenizer.ggml.bos_token_id", "u32", 1)
  w:kv("tokenizer.ggml.eos_token_id", "u32", 2)
  return T.write(w:bytes())
end

-- ==== patching a written image ============================================

-- File offsets (0-based) of a tensor's info record fields and of its data.
local function align_up(x, a) return (x + a - 1) // a * a end

local function locate(w, name)
  local at = 24 + #table.concat(w.kvs)
  local infos_len = #table.concat(w.infos)
  local data_start = align_up(at + infos_len, w.alignment)
  for _, info in ipairs(w.infos) do
    local nm, p = string.unpack("<s8", info)
    local n_dims
    n_dims, p = string.unpack("<I4", info, p)
    local type_pos = p + 8 * n_dims -- 1-based inside info
    local _, off = string.unpack("<I4i8", info, type_pos)
    if nm == name then
      return { type_at = at + type_pos - 1, data_at = data_start + off }
    end
    at = at + #info
  end
  error("tiny_models: no tensor " .. name)
end

-- Overwrites element k (0-based) of an F32 tensor with value.
function T.poke_f32(bytes, w, name, k, value)
  return W.patch(bytes, locate(w, name).data_at + 4 * k, "<f", value)
end

-- Rewrites the ggml type id of a tensor (its data stays as it is).
function T.set_type(bytes, w, name, type_id)
  return W.patch(bytes, locate(w, name).type_at, "<I4", type_id)
end

return T
