-- Agreement with the reference implementation (llama.cpp) on the real
-- models: tokens, last-position logits, greedy continuations, perplexity.
-- Expected values are fixtures made by scripts/ref/gen-fixtures.py from
-- llama.cpp on the same GGUF files (tests/fixtures/ref_*.lua).
local kvlua = require "kvlua"
local eval = require "kvlua.eval"
local models = require "spec.support.models"

-- Tolerances, and the evidence for them. Both real models are quantized
-- (Q4_1 / Q4_K_M) and every engine quantizes activations to 8 bits on the
-- fly, so logits carry rounding noise that depends on the exact kernels:
-- two builds of llama.cpp itself (llama-cpp-python 0.3.36 and xllamacpp)
-- differ by up to ~0.5 in top logits on these prompts, and llama.cpp
-- differs from an exact float64 forward pass over the same dequantized
-- weights (the fixtures' exact_top_*, scripts/ref/np_llama.py) by up to
-- 0.54 (SmolLM2) and 1.09 (Gemma 3). llama.cpp does not repeat its own
-- greedy continuations either once its arithmetic changes a little
-- (scripts/ref/selfcheck.py, SmolLM2 / Gemma 3, of 12): the same version
-- built for an AVX-512 CPU instead of the AVX2 one that recorded the
-- fixtures 5 / 9, flash attention off 4 / 6, micro-batches of 32 tokens
-- 10 / 11. A fixed 0.05 bound, or identical continuations past a near-tie,
-- would test the rounding of one particular build, not correctness. So:
--  * accuracy: over all prompts, the RMS error of our top-10 logits against
--    the float64 pass is at most ACCURACY_RATIO x llama.cpp's own RMS error;
--  * agreement: the RMS difference from llama.cpp's top-10 logits is at most
--    AGREE_RMS, and no single top-10 logit is further than AGREE_MAX;
--  * decisions: wherever llama.cpp's choice is clear (its top-1 beats the
--    runner-up by at least CLEAR_MARGIN, well above the noise, and for greedy
--    steps the float64 pass agrees with as large a margin) we choose the
--    same token: the last prompt position, every step of the 32-token
--    greedy continuation (teacher-forced on the reference's tokens), and the
--    free-running greedy continuation up to the reference's first near-tie.
local ACCURACY_RATIO = 1.10
local AGREE_RMS = 0.40
local AGREE_MAX = 1.00
local CLEAR_MARGIN = 0.60
local PPL_REL_TOL = 0.005

-- Whether the reference's greedy step i is a clear choice: llama.cpp's margin
-- alone is not enough (its 8-bit activations move logits by up to ~0.7 on
-- Gemma 3: french step 27 has 0.653 there, 0.164 in the float64 pass), so
-- where the fixture has the float64 pass's margins (exact_greedy_*,
-- scripts/ref/add-exact-greedy.py) that pass must also clear CLEAR_MARGIN with
-- the same top-1, as in spec/chat_ref_spec.lua.
local function clear_step(p, i)
  if p.greedy_margin[i] < CLEAR_MARGIN then return false end
  if not p.exact_greedy_margin then return true end
  return p.exact_greedy_margin[i] >= CLEAR_MARGIN and p.exact_greedy_top[i] == p.greedy[i]
end

local function fixture(name)
  return dofile("tests/fixtures/" .. name .. ".lua")
end

-- Every check runs on the CPU engine and, where an OpenCL device exists, on
-- the OpenCL backend with the same bounds: its matrix products multiply
-- float activations (on GPUs) or 8-bit ones quantized as the CPU's (the
-- 32-element formats on x86 CPU drivers), in other orders, so its logits
-- are other rounding of the same computation and must be as close to the
-- float64 pass and to llama.cpp as the CPU's are.
local backends = { "cpu" }
if #kvlua.devices() > 0 and os.getenv("KVLUA_NO_OPENCL") ~= "1" then backends[2] = "opencl" end

local loaded = {}
local function model(name, backend)
  local key = name .. "/" .. backend
  if loaded[key] == nil then
    local path = models.path(name)
    loaded[key] = path and assert(kvlua.load(path, { threads = 2, backend = backend })) or false
  end
  return loaded[key] or nil
end

-- Last-position logits of every fixture prompt (computed once per model).
local last = {}
local function last_logits(key, m, lg)
  if not last[key] then
    last[key] = {}
    for i, p in ipairs(lg.prompts) do
      local s = assert(m:session { ctx = lg.n_ctx })
      last[key][i] = assert(s:prefill(p.ids))
      s:close()
    end
  end
  return last[key]
end

for _, name in ipairs { "smollm2", "gemma3" } do
  for _, backend in ipairs(backends) do
    local key = name .. "/" .. backend
    local function model_here() return model(name, backend) end
    describe("reference agreement on " .. name .. " (" .. backend .. ")", function()
      local toks = fixture("ref_tokens_" .. name)
      local lg = fixture("ref_logits_" .. name)
      local ppl = fixture("ref_ppl_" .. name)

      it("tokenizes every fixture string exactly as llama.cpp", function()
        local m = model_here()
        if not m then return pending("model not available") end
        if backend ~= "cpu" then return pending("the tokenizer does not depend on the backend") end
        assert.is_true(#toks.cases >= 30)
        for i, c in ipairs(toks.cases) do
          local ids = m:tokenize(c.text, { add_special = c.add_special, parse_special = c.parse_special })
          assert.same(c.ids, ids, string.format("case %d: %q", i, c.text))
          if c.detok then
            assert.equals(c.detok, m:detokenize(c.ids, { unparse_special = true }), "detokenize case " .. i)
          end
        end
      end)

      it("is at least as close to an exact float64 forward pass as llama.cpp", function()
        local m = model_here()
        if not m then return pending("model not available") end
        assert.is_true(#lg.prompts >= 8)
        local ours, ref_err, n = 0, 0, 0
        for i, p in ipairs(lg.prompts) do
          local l = last_logits(key, m, lg)[i]
          local ref = {}
          for k = 1, #p.top_ids do ref[p.top_ids[k]] = p.top_logits[k] end
          for k = 1, 10 do
            local id, exact = p.exact_top_ids[k], p.exact_top_logits[k]
            if ref[id] then
              ours = ours + (l:get(id) - exact) ^ 2
              ref_err = ref_err + (ref[id] - exact) ^ 2
              n = n + 1
            end
          end
        end
        ours, ref_err = math.sqrt(ours / n), math.sqrt(ref_err / n)
        assert(ours <= ACCURACY_RATIO * ref_err, string.format(
          "RMS error vs float64: kvlua %.4f, llama.cpp %.4f (%d logits)", ours, ref_err, n))
      end)

      -- The CPU engine rounds activations to 8 bits as llama.cpp does and is
      -- held to llama.cpp's logits; OpenCL does not round them, so it is held
      -- to the float64 pass with the same bounds (llama.cpp itself is up to
      -- 1.09 away from that pass on Gemma 3: its rounding is not the target).
      it("agrees with " .. (backend == "cpu" and "llama.cpp's" or "the float64 pass's")
          .. " top-10 logits and llama.cpp's clear top-1 choices", function()
        local m = model_here()
        if not m then return pending("model not available") end
        local sq, n = 0, 0
        for i, p in ipairs(lg.prompts) do
          local l = last_logits(key, m, lg)[i]
          local ids, want = p.top_ids, p.top_logits
          if backend ~= "cpu" then ids, want = p.exact_top_ids, p.exact_top_logits end
          for k = 1, 10 do
            local d = math.abs(l:get(ids[k]) - want[k])
            assert(d <= AGREE_MAX, string.format("%s: id %d (rank %d): %.4f vs %.4f", p.name, ids[k], k,
              l:get(ids[k]), want[k]))
            sq, n = sq + d * d, n + 1
          end
          if p.top_logits[1] - p.top_logits[2] >= CLEAR_MARGIN then
            assert.equals(p.top_ids[1], l:argmax(), p.name .. ": top-1")
          end
          if p.exact_top_logits and p.exact_top_logits[1] - p.exact_top_logits[2] >= CLEAR_MARGIN then
            assert.equals(p.exact_top_ids[1], l:argmax(), p.name .. ": top-1 of the float64 pass")
          end
          -- our top 10 are near the top for llama.cpp or for the float64 pass
          local ids = l:topk(10)
          local near = {}
          for k = 1, 20 do
            near[p.top_ids[k]] = true
            if p.exact_top_ids then near[p.exact_top_ids[k]] = true end
          end
          for k = 1, 10 do
            assert(near[ids[k]], string.format("%s: our rank-%d id %d is in neither llama.cpp's nor the float64 top 20",
              p.name, k, ids[k]))
          end
        end
        local rms = math.sqrt(sq / n)
        assert(rms <= AGREE_RMS, string.format("RMS difference %.4f over %d logits", rms, n))
      end)

      it("makes llama.cpp's clear greedy choices (teacher-forced, 32 steps)", function()
        local m = model_here()
        if not m then return pending("model not available") end
        local steps, checked = 0, 0
        for _, p in ipairs(lg.prompts) do
          local s = assert(m:session { ctx = lg.n_ctx })
          local logits = assert(s:prefill(p.ids))
          for i = 1, #p.greedy do
            steps = steps + 1
            if clear_step(p, i) then
              checked = checked + 1
              assert.equals(p.greedy[i], logits:argmax(), string.format(
                "%s step %d (reference margin %.3f, float64 %.3f)", p.name, i, p.greedy_margin[i],
                p.exact_greedy_margin and p.exact_greedy_margin[i] or 0 / 0))
            end
            if i < #p.greedy then logits = assert(s:decode(p.greedy[i])) end
          end
          s:close()
        end
        assert.is_true(checked >= steps // 2, "most steps are clear choices")
      end)

      it("continues greedily with llama.cpp's tokens up to its first near-tie", function()
        local m = model_here()
        if not m then return pending("model not available") end
        for _, p in ipairs(lg.prompts) do
          local s = assert(m:session { ctx = lg.n_ctx })
          local logits = assert(s:prefill(p.ids))
          for i = 1, #p.greedy do
            if not clear_step(p, i) then break end
            local id = logits:argmax()
            assert.equals(p.greedy[i], id, string.format("%s step %d", p.name, i))
            if i < #p.greedy then logits = assert(s:decode(id)) end
          end
          s:close()
        end
      end)

      it("matches the reference perplexity within 0.5% on the whole text", function()
        local m = model_here()
        if not m then return pending("model not available") end
        -- OpenCL (measured on PoCL: SmolLM2 17.03, Gemma 3 11.33 against
        -- llama.cpp's 17.12 and 11.53: lower, its activations are not rounded)
        -- takes minutes on a CPU driver: not part of the suite
        if backend ~= "cpu" then return pending("perplexity on OpenCL: too slow for the suite on a CPU driver") end
        local f = assert(io.open(ppl.text, "rb"))
        local text = f:read("a")
        f:close()
        local tokens = m:tokenize(text, { add_special = true })
        assert.equals(ppl.n_tokens, #tokens)
        local r = assert(eval.perplexity(m, tokens, { ctx = ppl.n_ctx }))
        local got, want, chunks = r.ppl, ppl.ppl, #r.chunks
        assert.equals(ppl.n_chunks, chunks)
        assert(math.abs(got - want) / want <= PPL_REL_TOL,
          string.format("perplexity %.4f, reference %.4f (%d chunks of %d)", got, want, chunks, ppl.n_ctx))
      end)
    end)
  end
end
