-- gguf_writer.lua — a pure-Lua GGUF writer (string.pack) for the specs:
-- valid files, deliberately malformed ones, and tiny llama models.
--
--   local W = require "spec.support.gguf_writer"
--
--   local w = W.new{ version = 3, alignment = 32 } -- both optional (3, 32)
--   w:kv("general.architecture", "string", "llama")
--   w:kv("llama.block_count", "u32", 2)           -- u8 i8 u16 i16 u32 i32 f32 bool
--                                                 -- string u64 i64 f64
--   w:arr("tokenizer.ggml.tokens", "string", {"a", "b"})
--   w:arr("tokenizer.ggml.token_type", "i32", {1, 1})
--   w:arr("nested", "array", { {"i32", {1, 2}}, {"string", {"x"}} })
--                                                 -- elements: {elem_type, list}
--   w:tensor("tok_embd.weight", "F32", {n_embd, n_vocab}, data)
--       -- shape is ne order (ne[1] = rows); data: a string of the tensor's
--       -- bytes, a list of numbers (F32 only), or nil for zeros
--   local bytes = w:bytes()                       -- the file image (a string)
--   w:write(path)                                 -- or write it
--
-- Layout: header, kvs, tensor infos, padding to the alignment, tensor data
-- at aligned offsets, nothing after the last tensor's bytes (a file without
-- tensors ends after its last kv). general.alignment is NOT written for
-- you: w:kv("general.alignment", "u32", 64) and pass alignment = 64 to new.
--
-- Malformations:
--   w:counts(n_tensors, n_kv)          header counts to write instead of the real ones
--   w:raw_kv(key, type_id, body)       a key, any u32 type id, a verbatim value body
--   w:raw(bytes)                       verbatim bytes counted as one kv
--   w:tensor_ex{ name=, n_dims=, ne={...}, type=id, offset=, nbytes=, data= }
--       raw dims (any count, any u64 written from a Lua integer: -1 is 2^64-1),
--       any type id, explicit offset (nil: next aligned), nbytes of data
--       (nil: none placed; data nil: zeros)
--   W.patch(bytes, at, fmt, value)     overwrite bytes at 0-based offset `at`
--   W.malformed[name]() -> bytes       one file per malformation (see the table
--                                      at the bottom; W.malformed_names lists them)
--
-- Helpers:
--   W.types                            ggml type ids and block layouts by name
--   W.tiny_llama{ n_layer=, n_embd=, n_head=, n_head_kv=, n_ff=, n_vocab=,
--                 tokens={...}, seed=1, n_ctx=128, tokenizer="llama"|"gpt2",
--                 scores=, token_type=, merges= (gpt2: default {}), bos=, eos=, tied=false,
--                 rope_base=10000, eps=1e-5, scale=0.02, version=3, meta={...} }
--       -> a writer holding a valid llama-architecture model with random F32
--       weights (deterministic in seed; norms are 1). tokens defaults to
--       n_vocab generated pieces; meta = { {key, type, value}, ... } adds or
--       overrides kvs (same key: the given one replaces the default; an
--       array is {key, "array", {elem_type, list}}).
local W = {}
W.__index = W

-- ==== value types ==========================================================

local VT = {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, bool = 7,
  string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12,
}
W.vtypes = VT

local FMT = {
  u8 = "<I1", i8 = "<i1", u16 = "<I2", i16 = "<i2", u32 = "<I4", i32 = "<i4",
  f32 = "<f", u64 = "<I8", i64 = "<i8", f64 = "<d",
}

-- ggml tensor types: id, elements per block, bytes per block.
W.types = {
  F32 = { id = 0, blck = 1, size = 4 },    F16 = { id = 1, blck = 1, size = 2 },
  Q4_0 = { id = 2, blck = 32, size = 18 }, Q4_1 = { id = 3, blck = 32, size = 20 },
  Q5_0 = { id = 6, blck = 32, size = 22 }, Q5_1 = { id = 7, blck = 32, size = 24 },
  Q8_0 = { id = 8, blck = 32, size = 34 }, Q4_K = { id = 12, blck = 256, size = 144 },
  Q5_K = { id = 13, blck = 256, size = 176 }, Q6_K = { id = 14, blck = 256, size = 210 },
  I8 = { id = 24, blck = 1, size = 1 },    I32 = { id = 26, blck = 1, size = 4 },
  BF16 = { id = 30, blck = 1, size = 2 },
}

local function pack_scalar(t, v)
  if t == "bool" then return string.pack("<I1", v and 1 or 0) end
  if t == "string" then return string.pack("<s8", v) end
  local f = FMT[t]
  if not f then error("gguf_writer: unknown value type " .. tostring(t), 3) end
  return string.pack(f, v)
end

-- Array body: element type, count, elements. Nested elements are
-- {elem_type, list}.
local function pack_array(et, list)
  local parts = { string.pack("<I4I8", assert(VT[et], et), #list) }
  for i, v in ipairs(list) do
    if et == "array" then parts[i + 1] = pack_array(v[1], v[2])
    else parts[i + 1] = pack_scalar(et, v) end
  end
  return table.concat(parts)
end
W.pack_array = pack_array

-- ==== writer ===============================================================

function W.new(opts)
  opts = opts or {}
  return setmetatable({
    version = opts.version or 3,
    alignment = opts.alignment or 32,
    kvs = {}, n_kv = 0,
    infos = {}, n_tensors = 0,
    data = {}, -- {offset, bytes}
    next = 0,  -- end of the last placed tensor
  }, W)
end

function W:counts(n_tensors, n_kv)
  self.hdr_counts = { n_tensors, n_kv }
  return self
end

function W:raw(bytes)
  self.kvs[#self.kvs + 1] = bytes
  self.n_kv = self.n_kv + 1
  return self
end

function W:raw_kv(key, type_id, body)
  return self:raw(string.pack("<s8I4", key, type_id) .. (body or ""))
end

function W:kv(key, t, v)
  return self:raw_kv(key, assert(VT[t], t), pack_scalar(t, v))
end

function W:arr(key, et, list)
  return self:raw_kv(key, VT.array, pack_array(et, list))
end

local function align_up(x, a) return (x + a - 1) // a * a end

function W:tensor_ex(t)
  local offset = t.offset or align_up(self.next, self.alignment)
  local parts = { string.pack("<s8I4", t.name, t.n_dims or #t.ne) }
  for d = 1, (t.n_dims or #t.ne) do parts[#parts + 1] = string.pack("<i8", t.ne[d] or 1) end
  parts[#parts + 1] = string.pack("<I4i8", t.type, offset)
  self.infos[#self.infos + 1] = table.concat(parts)
  self.n_tensors = self.n_tensors + 1
  local nbytes = t.nbytes or (t.data and #t.data) or 0
  if nbytes > 0 then
    local d = t.data or string.rep("\0", nbytes)
    assert(#d == nbytes, "gguf_writer: data is not nbytes long")
    self.data[#self.data + 1] = { offset, d }
    if offset + nbytes > self.next then self.next = offset + nbytes end
  end
  return self
end

-- Bytes of a tensor of that type name and shape.
function W.nbytes(tname, shape)
  local ty = assert(W.types[tname], tname)
  assert(shape[1] % ty.blck == 0, "row length is not a multiple of the block size")
  local n = shape[1] // ty.blck * ty.size
  for d = 2, #shape do n = n * shape[d] end
  return n
end

local function pack_f32(list)
  local parts, chunk = {}, 1024
  for i = 1, #list, chunk do
    local j = math.min(i + chunk - 1, #list)
    parts[#parts + 1] = string.pack("<" .. string.rep("f", j - i + 1), table.unpack(list, i, j))
  end
  return table.concat(parts)
end
W.pack_f32 = pack_f32

function W:tensor(name, tname, shape, data)
  local ty = assert(W.types[tname], tname)
  local nb = W.nbytes(tname, shape)
  if type(data) == "table" then
    assert(tname == "F32", "number lists are for F32 tensors")
    data = pack_f32(data)
  end
  data = data or string.rep("\0", nb)
  assert(#data == nb, ("gguf_writer: tensor %s needs %d bytes, got %d"):format(name, nb, #data))
  return self:tensor_ex{ name = name, ne = shape, type = ty.id, data = data }
end

function W:bytes()
  local c = self.hdr_counts
  local head = "GGUF" .. string.pack("<I4I8I8", self.version, c and c[1] or self.n_tensors,
    c and c[2] or self.n_kv)
  local out = { head, table.concat(self.kvs), table.concat(self.infos) }
  if self.n_tensors > 0 then
    local len = #out[1] + #out[2] + #out[3]
    out[4] = string.rep("\0", align_up(len, self.alignment) - len)
    table.sort(self.data, function(a, b) return a[1] < b[1] end)
    local pos, parts = 0, {}
    for _, d in ipairs(self.data) do
      if d[1] > pos then parts[#parts + 1] = string.rep("\0", d[1] - pos); pos = d[1] end
      if d[1] < pos then error("gguf_writer: tensor data overlaps (use raw bytes for that)") end
      parts[#parts + 1] = d[2]
      pos = pos + #d[2]
    end
    out[5] = table.concat(parts)
  end
  return table.concat(out)
end

function W:write(path)
  local f = assert(io.open(path, "wb"))
  assert(f:write(self:bytes()))
  assert(f:close())
  return path
end

function W.write_bytes(path, bytes)
  local f = assert(io.open(path, "wb"))
  assert(f:write(bytes))
  assert(f:close())
  return path
end

function W.patch(bytes, at, fmt, value)
  local p = string.pack(fmt, value)
  return bytes:sub(1, at) .. p .. bytes:sub(at + #p + 1)
end

-- ==== tiny llama models ======================================================

-- xorshift64*: deterministic weights without touching math.random's state.
local function rng(seed)
  local x = (seed or 1) * 0x9E3779B97F4A7C15 | 1
  return function()
    x = x ~ (x >> 12); x = x ~ (x << 25); x = x ~ (x >> 27)
    local r = (x * 0x2545F4914F6CDD1D) >> 11 -- 53 random bits
    return r / 9007199254740992.0               -- [0, 1)
  end
end

function W.tiny_llama(o)
  for _, k in ipairs{ "n_layer", "n_embd", "n_head", "n_ff", "n_vocab" } do
    assert(math.type(o[k]) == "integer" and o[k] > 0, "tiny_llama: " .. k .. " must be a positive integer")
  end
  local n_embd, n_head = o.n_embd, o.n_head
  local n_head_kv = o.n_head_kv or n_head
  assert(n_embd % n_head == 0 and n_head % n_head_kv == 0, "tiny_llama: bad head counts")
  local head_dim = n_embd // n_head
  local n_embd_kv = head_dim * n_head_kv
  local n_vocab = o.n_vocab
  local tok = o.tokenizer or "llama"
  local tokens = o.tokens
  if not tokens then
    tokens = {}
    if tok == "llama" then tokens[1], tokens[2], tokens[3] = "<unk>", "<s>", "</s>" end
    for i = #tokens + 1, n_vocab do tokens[i] = ("t%d"):format(i - 1) end
  end
  assert(#tokens == n_vocab, "tiny_llama: #tokens must equal n_vocab")

  local w = W.new{ version = o.version or 3 }
  local meta = {
    { "general.architecture", "string", "llama" },
    { "general.name", "string", o.name or "tiny-llama" },
    { "general.file_type", "u32", 0 },
    { "llama.block_count", "u32", o.n_layer },
    { "llama.context_length", "u32", o.n_ctx or 128 },
    { "llama.embedding_length", "u32", n_embd },
    { "llama.feed_forward_length", "u32", o.n_ff },
    { "llama.attention.head_count", "u32", n_head },
    { "llama.attention.head_count_kv", "u32", n_head_kv },
    { "llama.rope.dimension_count", "u32", head_dim },
    { "llama.rope.freq_base", "f32", o.rope_base or 10000.0 },
    { "llama.attention.layer_norm_rms_epsilon", "f32", o.eps or 1e-5 },
    { "llama.vocab_size", "u32", n_vocab },
    { "tokenizer.ggml.model", "string", tok },
    { "tokenizer.ggml.bos_token_id", "u32", o.bos or (tok == "llama" and 1 or 0) },
    { "tokenizer.ggml.eos_token_id", "u32", o.eos or (tok == "llama" and 2 or 0) },
  }
  local arrays = { { "tokenizer.ggml.tokens", "string", tokens } }
  local tt = o.token_type
  if not tt then
    tt = {}
    for i = 1, n_vocab do tt[i] = 1 end
    if tok == "llama" then tt[1], tt[2], tt[3] = 2, 3, 3 end
  end
  arrays[#arrays + 1] = { "tokenizer.ggml.token_type", "i32", tt }
  if tok == "llama" then
    local scores = o.scores
    if not scores then
      scores = {}
      for i = 1, n_vocab do scores[i] = -(i - 1) * 1.0 end
    end
    arrays[#arrays + 1] = { "tokenizer.ggml.scores", "f32", scores }
  end
  if o.merges or tok == "gpt2" then -- llama.cpp requires merges for gpt2 vocabularies
    arrays[#arrays + 1] = { "tokenizer.ggml.merges", "string", o.merges or {} }
  end

  local override = {}
  for _, m in ipairs(o.meta or {}) do override[m[1]] = m end
  local done = {}
  for _, m in ipairs(meta) do
    local x = override[m[1]] or m
    w:kv(x[1], x[2], x[3]); done[x[1]] = true
  end
  for _, a in ipairs(arrays) do
    local x = override[a[1]]
    if not x then
      w:arr(a[1], a[2], a[3])
    elseif x[2] == "array" then
      w:arr(x[1], x[3][1], x[3][2])
    else
      w:kv(x[1], x[2], x[3])
    end
    done[a[1]] = true
  end
  for _, m in ipairs(o.meta or {}) do
    if not done[m[1]] then
      if m[2] == "array" then w:arr(m[1], m[3][1], m[3][2]) else w:kv(m[1], m[2], m[3]) end
    end
  end

  local rand, scale = rng(o.seed), o.scale or 0.02
  local function weights(n)
    local t = {}
    for i = 1, n do t[i] = (rand() * 2 - 1) * scale end
    return t
  end
  local function ones(n)
    local t = {}
    for i = 1, n do t[i] = 1.0 end
    return t
  end
  w:tensor("token_embd.weight", "F32", { n_embd, n_vocab }, weights(n_embd * n_vocab))
  for l = 0, o.n_layer - 1 do
    local p = "blk." .. l .. "."
    w:tensor(p .. "attn_norm.weight", "F32", { n_embd }, ones(n_embd))
    w:tensor(p .. "attn_q.weight", "F32", { n_embd, n_embd }, weights(n_embd * n_embd))
    w:tensor(p .. "attn_k.weight", "F32", { n_embd, n_embd_kv }, weights(n_embd * n_embd_kv))
    w:tensor(p .. "attn_v.weight", "F32", { n_embd, n_embd_kv }, weights(n_embd * n_embd_kv))
    w:tensor(p .. "attn_output.weight", "F32", { n_embd, n_embd }, weights(n_embd * n_embd))
    w:tensor(p .. "ffn_norm.weight", "F32", { n_embd }, ones(n_embd))
    w:tensor(p .. "ffn_gate.weight", "F32", { n_embd, o.n_ff }, weights(n_embd * o.n_ff))
    w:tensor(p .. "ffn_up.weight", "F32", { n_embd, o.n_ff }, weights(n_embd * o.n_ff))
    w:tensor(p .. "ffn_down.weight", "F32", { o.n_ff, n_embd }, weights(o.n_ff * n_embd))
  end
  w:tensor("output_norm.weight", "F32", { n_embd }, ones(n_embd))
  if not o.tied then
    w:tensor("output.weight", "F32", { n_embd, n_vocab }, weights(n_embd * n_vocab))
  end
  return w
end

-- ==== malformed files ==========================================================

-- A small valid base: a few kvs and two F32 tensors "a" (16 x 2) and "b" (16).
local function base(opts)
  local w = W.new(opts)
  w:kv("general.architecture", "string", "llama")
  w:kv("general.name", "string", "bad")
  w:arr("tokenizer.ggml.tokens", "string", { "a", "b", "c" })
  return w
end

local function two_tensors(w)
  w:tensor("a", "F32", { 16, 2 })
  w:tensor("b", "F32", { 16 })
  return w
end

local function u64(x) return string.pack("<i8", x) end

local M = {}
W.malformed = M
W.malformed_names = {}
local function def(name, fn)
  M[name] = fn
  W.malformed_names[#W.malformed_names + 1] = name
end

def("empty file", function() return "" end)
def("truncated header", function() return two_tensors(base()):bytes():sub(1, 12) end)
def("truncated in a kv", function()
  local b = base():bytes()
  return b:sub(1, #b - 2)
end)
def("truncated in a tensor info", function()
  local w = two_tensors(base())
  local b = w:bytes()
  local infos_end = 24 + #table.concat(w.kvs) + #table.concat(w.infos)
  return b:sub(1, infos_end - 3)
end)
def("truncated data", function()
  local b = two_tensors(base()):bytes()
  return b:sub(1, #b - 1)
end)
def("bad magic", function() return "GGML" .. two_tensors(base()):bytes():sub(5) end)
def("version 1", function() return two_tensors(base{ version = 1 }):bytes() end)
def("n_tensors absurd", function()
  return W.patch(two_tensors(base()):bytes(), 8, "<I8", 1 << 60)
end)
def("n_kv absurd", function()
  return W.patch(two_tensors(base()):bytes(), 16, "<I8", 1 << 40)
end)
def("string length past the end", function()
  return base():raw_kv("bad.str", VT.string, u64(100) .. "short"):bytes()
end)
def("string length 2^40", function()
  return base():raw_kv("bad.str", VT.string, u64(1 << 40)):bytes()
end)
def("array count past the end", function()
  return base():raw_kv("bad.arr", VT.array, string.pack("<I4I8I4", VT.i32, 1000, 7)):bytes()
end)
def("string array count past the end", function()
  return base():raw_kv("bad.arr", VT.array, string.pack("<I4I8s8", VT.string, 1000000, "one")):bytes()
end)
def("unknown value type", function()
  return base():raw_kv("bad.type", 13, string.pack("<I4", 0)):bytes()
end)
def("arrays nested too deep", function()
  local body = string.pack("<I4I8I1", VT.u8, 1, 42)
  for _ = 1, 8 do body = string.pack("<I4I8", VT.array, 1) .. body end
  return base():raw_kv("bad.deep", VT.array, body):bytes()
end)
def("duplicate key", function()
  return two_tensors(base():kv("general.name", "string", "again")):bytes()
end)
def("duplicate tensor name", function()
  local w = base()
  w:tensor("a", "F32", { 16 })
  w:tensor("a", "F32", { 16 })
  return w:bytes()
end)
def("n_dims 5", function()
  return base():tensor_ex{ name = "a", ne = { 1, 1, 1, 1, 1 }, type = 0, nbytes = 4 }:bytes()
end)
def("negative dimension", function()
  return base():tensor_ex{ name = "a", ne = { 16, -3 }, type = 0, nbytes = 64 }:bytes()
end)
def("zero dimension", function()
  return base():tensor_ex{ name = "a", ne = { 0 }, type = 0, nbytes = 64 }:bytes()
end)
def("element count overflow", function()
  return base():tensor_ex{ name = "a", ne = { 1 << 32, 1 << 32 }, type = 0, nbytes = 64 }:bytes()
end)
def("unknown tensor type", function()
  return base():tensor_ex{ name = "a", ne = { 16 }, type = 4, nbytes = 64 }:bytes()
end)
def("row not a multiple of the block size", function()
  return base():tensor_ex{ name = "a", ne = { 48 }, type = W.types.Q4_0.id, nbytes = 64 }:bytes()
end)
def("alignment 0", function()
  return two_tensors(base():kv("general.alignment", "u32", 0)):bytes()
end)
def("alignment not a power of two", function()
  return two_tensors(base():kv("general.alignment", "u32", 48)):bytes()
end)
def("alignment absurd", function()
  return two_tensors(base():kv("general.alignment", "u32", 1 << 24)):bytes()
end)
def("tensor offset not aligned", function()
  return base():tensor_ex{ name = "a", ne = { 2 }, type = 0, offset = 0, nbytes = 8 }
    :tensor_ex{ name = "b", ne = { 2 }, type = 0, offset = 8, nbytes = 8 }:bytes()
end)
def("tensors overlap", function()
  -- "b" claims [32, 96) while "a" holds [0, 64); only a's bytes are placed
  return base():tensor_ex{ name = "a", ne = { 16 }, type = 0, offset = 0, nbytes = 64 }
    :tensor_ex{ name = "b", ne = { 16 }, type = 0, offset = 32 }
    :bytes() .. string.rep("\0", 32)
end)
def("tensor data past the end", function()
  return base():tensor_ex{ name = "a", ne = { 16 }, type = 0, offset = 0, nbytes = 64 }
    :tensor_ex{ name = "b", ne = { 16 }, type = 0, offset = 64, nbytes = 32 }:bytes()
end)

return W
