-- Findings of an outside audit of the API (hostile files, misuse,
-- finalizers, coroutines), one describe per finding, each written to fail
-- before its fix:
--
--   1  finalizers and metamethods that close an object in the middle of
--      one of its method calls (a use after free before)
--   3  no stale logits after prefill{logits = "none"}
--   4  FIFOs and paths or keys with NUL bytes
--   5  the context is checked before the logits are allocated
--   6  vocabularies that do not match token_embd; context_length = 0
--   7  one live generate iterator per session
--   8  a session after model:close() stays fully usable; the model does not
--   9  numbers past 32 bits in arguments and messages
--   10 smaller ones (empty prompts, chat templates, samplers, perplexity,
--      threads, reclaiming dropped sessions)
--   11 a model file truncated on disk after loading
--
-- Everything runs on tiny random-weight models written to temporary
-- files; the two findings that would hang or kill the process before their
-- fix (a FIFO, SIGBUS) run in a child lua5.4.
local kvlua = require "kvlua"
local sampling = require "kvlua.sampling"
local chat = require "kvlua.chat"
local eval = require "kvlua.eval"
local W = require "spec.support.gguf_writer"
local tiny = require "spec.support.tiny_models"
local run_child = require "spec.support.child"
local child, shell_quote = run_child.run, run_child.quote

-- ==== helpers ================================================================

-- Largest |a[i] - b[i]| of two single-row Logits.
local function max_diff(a, b)
  local ta, tb = a:totable(), b:totable()
  assert.equals(#ta, #tb)
  local d = 0
  for i = 1, #ta do d = math.max(d, math.abs(ta[i] - tb[i])) end
  return d
end

-- Runs f with the collector stepping at nearly every allocation (so a
-- finalizer can run inside any allocation of a C method), then restores
-- Lua's defaults.
local function under_gc_pressure(f)
  collectgarbage("incremental", 1, 1000)
  local ok, err = pcall(f)
  collectgarbage("incremental", 200, 100)
  if not ok then error(err, 0) end
end

local path -- a tiny llama, 512 tokens of vocabulary
setup(function()
  path = tiny.llama { n_vocab = 512, seed = 21 }
end)
teardown(function()
  tiny.cleanup()
end)

local function load(p)
  return assert(kvlua.load(p or path, { threads = 1 }))
end

-- ==== 1: closing an object in the middle of its own method call ==============

describe("an object closed in the middle of one of its method calls (finding 1)", function()
  -- The audit's sketch, in a child lua5.4 (a small heap keeps the
  -- collector's cycles short, and a use after free cannot take busted
  -- down): with the collector stepping at every allocation, each round
  -- opens an object, drops a sentinel whose finalizer closes it, calls a
  -- method and checks the result. Rounds differ in the heap they leave, so
  -- the finalizer lands at different points of the call. Prints the rounds
  -- in which it ran inside the call ("hits") and the wrong results.
  local function finalizer_rounds(model_path, open, call, same)
    local out, rc = child(([[
      local kvlua = require 'kvlua'
      local P = %q
      local open = function() %s end
      local call = function(obj) %s end
      local same = function(...) %s end
      local ref, ref_target = open()
      local want = call(ref)
      ref_target:close()
      collectgarbage()
      collectgarbage('incremental', 1, 1000)
      local hits, bad, keep = 0, 0, {}
      for i = 1, 30 do
        local obj, target = open()
        keep[i] = {}
        for k = 1, i * 13 do keep[i][k] = {} end
        local in_call, hit = false, false
        setmetatable({}, { __gc = function() hit = hit or in_call; target:close() end })
        in_call = true
        local got = call(obj)
        in_call = false
        if hit then hits = hits + 1 end
        if not same(got, want) then bad = bad + 1 end
      end
      print('hits ' .. hits .. ' bad ' .. bad)
    ]]):format(model_path, open, call, same), 120)
    assert.equals(0, rc, out)
    local hits, bad = out:match("^hits (%d+) bad (%d+)\n$")
    assert(hits, out)
    assert.equals(0, tonumber(bad))
    assert.is_true(tonumber(hits) > 0, "the finalizer never ran inside the call")
  end

  local same_table = [[
    local got, want = ...
    if #got ~= #want then return false end
    for i = 1, #want do if got[i] ~= want[i] then return false end end
    return true]]

  it("a finalizer closing the model during m:meta (a large array) finds nothing freed", function()
    finalizer_rounds(path, "local m = assert(kvlua.load(P, { threads = 1 })) return m, m",
      "return obj:meta('tokenizer.ggml.tokens')", same_table)
  end)

  it("... during m:tensors()", function()
    finalizer_rounds(path, "local m = assert(kvlua.load(P, { threads = 1 })) return m, m", [[
      local tensors, names = obj:tensors(), {}
      for i, t in ipairs(tensors) do names[i] = t.name .. t.type .. t.bytes .. t.offset end
      return names]], same_table)
  end)

  it("a finalizer closing a session of a closed model during s:prefill{logits = \"all\"}", function()
    finalizer_rounds(path, [[
      local m = assert(kvlua.load(P, { threads = 1 }))
      local s = assert(m:session { ctx = 64 })
      m:close() -- the session alone keeps the model
      ids, opts = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 }, { logits = 'all' } -- built before the sentinel
      return s, s]], "return obj:prefill(ids, opts):row(10):totable()", [[
      local got, want = ...
      for i = 1, #want do if math.abs(got[i] - want[i]) > 1e-5 then return false end end
      return #got == #want]])
  end)

  it("a metamethod of the options closing the model during m:tokenize", function()
    local m = load()
    local want = m:tokenize("t5t6", { add_special = true })
    local opts = setmetatable({}, { __index = function() m:close() end })
    assert.same(want, m:tokenize("t5t6", opts))
    assert.has_error(function() m:tokenize("t5") end, "attempt to use a closed model")
  end)

  it("a metamethod of the ids closing the session and its model during s:prefill", function()
    local m = load()
    local ref = assert(m:session { ctx = 16 })
    local want = assert(ref:prefill({ 5, 6, 7 }))
    local s = assert(m:session { ctx = 16 })
    local ids = setmetatable({}, {
      __len = function() return 3 end,
      __index = function(_, i)
        if i == 2 then m:close(); s:close() end
        return 4 + i
      end,
    })
    local got = assert(s:prefill(ids))
    assert.is_true(max_diff(want, got) <= 1e-6)
    assert.has_error(function() s:decode(5) end, "attempt to use a closed session")
  end)

  it("a metamethod of the ids closing the model during m:detokenize", function()
    local m = load()
    local want = m:detokenize({ 5, 6, 7 })
    local ids = setmetatable({}, {
      __len = function() return 3 end,
      __index = function(_, i) if i == 3 then m:close() end return 4 + i end,
    })
    assert.equals(want, m:detokenize(ids))
  end)

  it("an error raised inside a method leaves the object idle: close() frees at once", function()
    local statm = io.open("/proc/self/statm")
    if not statm then pending("needs /proc/self/statm") return end
    statm:close()
    if (os.getenv("LD_PRELOAD") or ""):find("asan") then pending("AddressSanitizer keeps freed memory") return end
    local function vm_bytes() -- the cache is big enough to be mapped and unmapped on its own
      local f = assert(io.open("/proc/self/statm"))
      local pages = f:read("n")
      f:close()
      return pages * 4096
    end
    local m = load()
    local s = assert(m:session { ctx = 1 << 20 }) -- 128 MB of cache
    assert.has_error(function() s:prefill({ 5, "x" }) end)
    assert.has_error(function() s:rewind(-1) end)
    local before = vm_bytes()
    s:close()
    assert.is_true(before - vm_bytes() > 100e6, "the cache was not freed by close()")
  end)
end)

-- ==== 3: logits after prefill{logits = "none"} ==================================

describe("s:prefill(ids, {logits = \"none\"}) (finding 3)", function()
  it("leaves no logits behind: s:logits() returns nil and says why", function()
    local m = load()
    local s = assert(m:session { ctx = 32 })
    assert(s:prefill({ 5, 6 }))
    assert.is_true(s:prefill({ 7, 8 }, { logits = "none" }))
    local l, err = s:logits()
    assert.is_nil(l)
    assert.matches("logits = \"none\"", err, 1, true)
  end)

  it("s:generate{} afterwards starts from the logits of the last token", function()
    local m = load()
    local ref = assert(m:session { ctx = 32 })
    local want = assert(ref:prefill({ 5, 6, 7, 8 }))
    local s = assert(m:session { ctx = 32 })
    assert(s:prefill({ 5, 6 }))
    assert(s:prefill({ 7, 8 }, { logits = "none" }))
    local seen
    local sampler = { sample = function(_, l) seen = seen or l:clone() return l:argmax() end }
    for _ in s:generate { sampler = sampler, max_tokens = 2, ignore_eog = true } do end
    assert.is_true(max_diff(want, seen) <= 1e-5)
    assert.equals(5, s.pos) -- and went on from there (the last token is not fed back)
  end)

  it("and so does s:generate{} after s:rewind", function()
    local m = load()
    local ref = assert(m:session { ctx = 32 })
    local want = assert(ref:prefill({ 5, 6, 7 }))
    local s = assert(m:session { ctx = 32 })
    assert(s:prefill({ 5, 6, 7, 8 }))
    s:rewind(1)
    assert.is_nil(s:logits())
    local seen
    local sampler = { sample = function(_, l) seen = seen or l:clone() return l:argmax() end }
    for _ in s:generate { sampler = sampler, max_tokens = 1, ignore_eog = true } do end
    assert.is_true(max_diff(want, seen) <= 1e-5)
  end)
end)

-- ==== 4: FIFOs, NUL bytes ========================================================

describe("paths and keys (finding 4)", function()
  it("kvlua.load on a FIFO returns nil, message at once", function()
    local fifo = os.tmpname()
    os.remove(fifo)
    assert(os.execute("mkfifo " .. shell_quote(fifo)))
    local out, rc = child(("local kvlua = require 'kvlua'; print(kvlua.load(%q))"):format(fifo), 20)
    os.remove(fifo)
    assert.equals(0, rc, out)
    assert.matches("^nil\t.*not a regular file", out)
  end)

  it("a path with a NUL byte raises instead of loading the part before it", function()
    assert.has_error(function() kvlua.load(path .. "\0junk") end,
      "bad argument #1 to 'load' (contains a NUL byte)")
  end)

  it("a metadata key with a NUL byte raises", function()
    local m = load()
    assert.equals("tiny-llama", m:meta("general.name"))
    assert.has_error(function() m:meta("general.name\0junk") end)
  end)

  it("string options with a NUL byte raise", function()
    local m = load()
    assert.has_error(function() m:session { ktype = "f16\0x" } end, "option 'ktype' contains a NUL byte")
    assert.has_error(function() kvlua.load(path, { backend = "cpu\0" }) end)
  end)
end)

-- ==== 5: the context before the logits ========================================

describe("prefill of more ids than the context holds (finding 5)", function()
  it("returns nil, \"context full\" before allocating logits for them", function()
    -- 1M positions x 49152 logits would be 196 GB
    local m = assert(kvlua.load(tiny.llama { n_vocab = 49152, n_embd = 32, n_layer = 1, seed = 2 }, { threads = 1 }))
    local s = assert(m:session { ctx = 64 })
    local ids = {}
    for i = 1, 1000000 do ids[i] = 5 end
    local l, err = s:prefill(ids, { logits = "all" })
    assert.is_nil(l)
    assert.equals("context full: 0 tokens in session + 1000000 new > n_ctx 64", err)
    assert.equals(0, s.pos)
  end)
end)

-- ==== 6: files that do not add up ===========================================

describe("model files (finding 6)", function()
  it("a vocabulary smaller than token_embd's rows is refused at load", function()
    local tokens, tt, scores = { "<unk>", "<s>", "</s>" }, { 2, 3, 3 }, { 0, 0, 0 }
    for i = 4, 60 do tokens[i], tt[i], scores[i] = "t" .. i, 1, -i end
    local p = tiny.write(W.tiny_llama {
      n_layer = 1, n_embd = 32, n_head = 4, n_ff = 64, n_vocab = 64, meta = {
        { "tokenizer.ggml.tokens", "array", { "string", tokens } },
        { "tokenizer.ggml.token_type", "array", { "i32", tt } },
        { "tokenizer.ggml.scores", "array", { "f32", scores } },
      },
    }:bytes())
    local m, err = kvlua.load(p, { threads = 1 })
    assert.is_nil(m)
    assert.equals("vocabulary has 60 tokens but token_embd.weight has 64 rows", err)
  end)

  it("context_length = 0 is refused at load, naming the key", function()
    local m, err = kvlua.load(tiny.llama { meta = { { "llama.context_length", "u32", 0 } } }, { threads = 1 })
    assert.is_nil(m)
    assert.equals("llama.context_length is 0 (the model's context must be positive)", err)
  end)
end)

-- ==== 7: one live generate iterator per session ==============================

describe("two s:generate iterators on one session (finding 7)", function()
  it("the older one raises when called after the newer one started", function()
    local m = load()
    local s = assert(m:session { ctx = 64 })
    assert(s:prefill({ 1, 5 }))
    local a = s:generate { max_tokens = 8, ignore_eog = true }
    a()
    local b = s:generate { max_tokens = 8, ignore_eog = true }
    assert.has_error(function() a() end,
      "generate: this iterator was replaced by a newer s:generate on the same session")
    while b() do end -- the newer one runs to its end
    assert.equals("length", s.finish_reason)
    assert.equals(8, #s.generated)
  end)

  it("an iterator raises when the session moved under it", function()
    local m = load()
    local s = assert(m:session { ctx = 64 })
    assert(s:prefill({ 1, 5 }))
    local a = s:generate { max_tokens = 8, ignore_eog = true }
    a()
    local at = s.pos
    assert(s:decode(7))
    assert.has_error(function() a() end,
      ("generate: the session moved under this iterator (at %d, left at %d)"):format(at + 1, at))
  end)

  it("a finished iterator does not block the next one", function()
    local m = load()
    local s = assert(m:session { ctx = 64 })
    for _ in s:generate { prompt = { 1, 5 }, max_tokens = 3, ignore_eog = true } do end
    for _ in s:generate { max_tokens = 3, ignore_eog = true } do end
    assert.equals("length", s.finish_reason)
  end)
end)

-- ==== 8: sessions after model:close() ========================================

describe("after model:close() (finding 8)", function()
  it("a session prefills, decodes and generates (text prompts too); the model raises", function()
    local m = assert(kvlua.load(tiny.llama { vocab = "bytes", seed = 9 }, { threads = 1 }))
    local ref = assert(m:session { ctx = 64 })
    for _ in ref:generate { prompt = "Hi", max_tokens = 4, ignore_eog = true } do end
    local s = assert(m:session { ctx = 64 })
    m:close()
    local text = {}
    for piece in s:generate { prompt = "Hi", max_tokens = 4, ignore_eog = true } do text[#text + 1] = piece end
    assert.equals("length", s.finish_reason)
    assert.same(ref.generated, s.generated)
    assert(s:decode(5))
    assert.has_error(function() m:tokenize("Hi") end, "attempt to use a closed model")
  end)

  it("chat.render(closed_model) raises instead of reporting no template", function()
    local m = load()
    m:close()
    assert.has_error(function() chat.render(m, { { role = "user", content = "Hi" } }) end,
      "attempt to use a closed model")
  end)
end)

-- ==== 9: numbers past 32 bits ==================================================

describe("integers past 2^31 in arguments (finding 9)", function()
  it("are reported as they were given", function()
    local m = load()
    local s = assert(m:session { ctx = 16 })
    assert.has_error(function() s:decode(2 ^ 32 | 0) end, "token id 4294967296 out of range [0, 512)")
    assert.has_error(function() s:prefill({ 5, 2 ^ 32 | 0 }) end,
      "token id 4294967296 at index 2 out of range [0, 512)")
    assert.has_error(function() m:piece(2 ^ 32 | 0) end, "token id 4294967296 out of range [0, 512)")
    assert.has_error(function() m:session { ctx = 1e12 } end,
      "option 'ctx' out of range: 1000000000000 (1..16777216)")
  end)

  it("model:kv_bytes raises rather than wrapping past 2^63", function()
    local m = load()
    local per_token = m:kv_bytes { ctx = 1, page_tokens = 1 }
    assert.equals(per_token * 1000, m:kv_bytes { ctx = 1000, page_tokens = 1 })
    assert.has_error(function() m:kv_bytes { ctx = math.maxinteger } end)
    assert.has_error(function() m:kv_bytes { ctx = 1 << 40, batch = 1 << 30 } end)
    assert.equals(per_token * (1 << 40), m:kv_bytes { ctx = 1 << 40, page_tokens = 1 })
    assert.equals(per_token * 16, m:kv_bytes { ctx = 1 }) -- pages of 16 positions by default
  end)
end)

-- ==== 10: the smaller ones =======================================================

describe("smaller findings (10)", function()
  it("an empty prompt continues the session (and raises clearly on an empty one)", function()
    local m = assert(kvlua.load(tiny.llama { vocab = "bytes", seed = 9 }, { threads = 1 }))
    local a = assert(m:session { ctx = 64 })
    assert(a:prefill({ 1, 5 }))
    for _ in a:generate { prompt = "", max_tokens = 3, ignore_eog = true } do end
    local b = assert(m:session { ctx = 64 })
    assert(b:prefill({ 1, 5 }))
    for _ in b:generate { max_tokens = 3, ignore_eog = true } do end
    assert.same(b.generated, a.generated)
    local empty = assert(m:session { ctx = 64 })
    assert.has_error(function() empty:generate { prompt = {} } end,
      "generate: nothing to continue from (the prompt is empty and so is the session)")
  end)

  it("chat.render refuses invalid UTF-8 with every template", function()
    for _, name in ipairs { "chatml", "llama3", "gemma", "mistral", "phi3" } do
      assert.has_error(function() chat.render(name, { { role = "user", content = "a\xffb" } }) end,
        "chat.render: message 1: content is not valid UTF-8")
    end
  end)

  it("a detect function that raises does not break rendering", function()
    chat.register("audit-broken", function() return "x" end, { detect = function() error("boom") end })
    local out = chat.render("{{ '<|im_start|>' }}", { { role = "user", content = "Hi" } })
    assert.equals("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", out)
    local none, err = chat.render("{% nothing %}", { { role = "user", content = "Hi" } })
    assert.is_nil(none)
    assert.truthy(err:find("detect of 'audit-broken' raised: ", 1, true), err)
    assert.truthy(err:find("boom", 1, true), err)
  end)

  it("samplers refuse infinite parameters at construction", function()
    assert.has_error(function() sampling.temperature(math.huge) end)
    assert.has_error(function() sampling.penalties { repeat_ = math.huge } end)
    assert.has_error(function() sampling.penalties { freq = -math.huge } end)
    assert.has_error(function() sampling.from_opts { temp = math.huge } end)
  end)

  it("a tiny temperature samples the argmax instead of failing", function()
    local l = kvlua.logits { 1.0, 3.0, 2.0, -5.0 }
    for _, t in ipairs { 1e-40, 1e-300, 5e-324 } do
      local id, err = sampling.chain { sampling.temperature(t), sampling.dist { seed = 1 } }:sample(l)
      assert.equals(1, id, tostring(err))
    end
  end)

  it("a chain that masks every token fails instead of returning id 0", function()
    local l = kvlua.logits { 1.0, 3.0, 2.0 }
    local mask_all = function(x) x:keep_top_k(1); x:set(1, -math.huge) end
    for _, last in ipairs { {}, { sampling.greedy() }, { sampling.dist { seed = 1 } } } do
      local id, err = sampling.chain { mask_all, table.unpack(last) }:sample(l)
      assert.is_nil(id)
      assert.matches("no candidates", err)
    end
  end)

  it("eval.perplexity refuses chunks = 0", function()
    local m = load()
    assert.has_error(function() eval.perplexity(m, { 1, 2, 3, 4, 5, 6, 7, 8 }, { ctx = 4, chunks = 0 }) end,
      "perplexity: chunks must be a positive integer")
  end)

  it("threads beyond the engine's limit raise instead of being capped", function()
    assert.has_error(function() kvlua.load(path, { threads = 1000 }) end,
      "option 'threads' out of range: 1000 (1..256, or 0 for the physical cores)")
  end)

  it("sessions dropped without close() are reclaimed as new ones open", function()
    local m = load()
    local dropped = setmetatable({}, { __mode = "v" })
    collectgarbage()
    collectgarbage("incremental", 200, 100)
    for i = 1, 40 do
      dropped[i] = assert(m:session { ctx = 16384 }) -- 2 MB of cache each, a small userdata to Lua
    end
    local alive = 0
    for i = 1, 40 do if dropped[i] then alive = alive + 1 end end
    assert.is_true(alive < 20, ("%d of 40 dropped sessions still alive"):format(alive))
  end)
end)

-- ==== 11: the file changes on disk ===========================================

describe("a model file truncated on disk after loading (finding 11)", function()
  it("makes the next eval return nil, message instead of faulting (SIGBUS)", function()
    local p = tiny.llama { n_vocab = 512, seed = 5 }
    local out, rc = child(([[
      local kvlua = require 'kvlua'
      local m = assert(kvlua.load(%q, { threads = 1 }))
      local s = assert(m:session { ctx = 16 })
      assert(s:prefill({ 1, 5 }))
      io.open(%q, 'wb'):close()
      print(s:decode(6))
      print(s:prefill({ 7 }, { logits = 'none' }))
    ]]):format(p, p), 30)
    assert.equals(0, rc, out)
    local want = "nil\tmodel file changed on disk: %d+ bytes at load, 0 now %(truncated%); load it again"
    assert.matches("^" .. want .. "\n" .. want .. "\n$", out)
  end)
end)
