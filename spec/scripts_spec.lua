-- The runnable scripts, run as a user would (a separate lua5.4 process):
--
--   lua5.4 scripts/generate.lua --prompt Hi --max-tokens 8 [--chat] [--stats] [--json]
--   lua5.4 scripts/chat.lua --prompt "Hi|||And?" --max-tokens 8 --stats
--   lua5.4 scripts/bench.lua --reps 1 --prefill 16 --depth 8 --decode 4 --json
--   lua5.4 scripts/perplexity.lua --file tests/data/public-domain.txt --ctx 128 --chunks 1 --json
--
-- They find the module through KVLUA_BUILD (their first lines), passed on
-- from the environment busted runs in. Each script runs on a tiny model
-- written to a temporary file (--model, no download) and, when it is
-- available, on the default model (SmolLM2, fetched and cached).
-- A bad option exits non-zero with a usage message on stderr.
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"

local S = require "spec.support.scripts"
local run, explain, assert_ok, json_decode, like, finite = S.run, S.explain, S.assert_ok, S.json_decode, S.like, S.finite

local tiny_path, small_vocab_path, real_path
setup(function()
  tiny_path = tiny.llama { seed = 2, vocab = "bytes" } -- 268 tokens
  small_vocab_path = tiny.llama { seed = 2 }          -- 64 tokens
  real_path = models.path("smollm2")
end)
teardown(function() tiny.cleanup() end)

-- Both models: the tiny one always, the real one when available.
local function each_model(fn)
  fn("tiny", tiny_path)
  if real_path then fn("smollm2", nil) end -- nil: the script's default model
end

local function model_args(path)
  return path and { "--model", path } or {}
end

local function with(args, more)
  local t = table.move(args, 1, #args, 1, {})
  return table.move(more, 1, #more, #t + 1, t)
end

-- ==== generate.lua ===========================================================

describe("scripts/generate.lua", function()
  it("prints the prompt and its continuation, and exits 0", function()
    each_model(function(name, path)
      local r = run("generate.lua", with(model_args(path), { "--max-tokens", "8", "--prompt", "Hi" }))
      assert_ok(r)
      like("^Hi", r.out, name)
      assert.is_true(#r.out > #"Hi\n", name .. ": no text generated\n" .. explain(r))
    end)
  end)

  it("--chat wraps the prompt in the chat template and prints only the reply", function()
    if not real_path then return pending("smollm2 not available") end
    local r = run("generate.lua", { "--max-tokens", "8", "--prompt", "Hi", "--chat" })
    assert_ok(r)
    assert.is_true(#r.out:gsub("%s", "") > 0, explain(r))
    assert.is_nil(r.out:find("<|im_start|>", 1, true))
    assert.is_nil(r.out:find("user", 1, true))
  end)

  it("--chat on a model without a chat template fails with a message", function()
    local r = run("generate.lua", { "--model", tiny_path, "--max-tokens", "4", "--chat" })
    assert.is_not.equals(0, r.rc)
    assert.matches("template", r.err)
  end)

  it("--stats reports TTFT and decode speed on stderr", function()
    each_model(function(name, path)
      local r = run("generate.lua", with(model_args(path), { "--max-tokens", "4", "--prompt", "Hi", "--stats" }))
      assert_ok(r)
      like("TTFT [%d.]+ ms", r.err, name)
      like("tok/s", r.err, name)
    end)
  end)

  it("--json prints one object: the text the streaming run prints, token counts, finish reason, timings", function()
    local args = { "--model", tiny_path, "--max-tokens", "6", "--prompt", "Hi", "--temp", "0" }
    local plain = run("generate.lua", args)
    assert_ok(plain)
    local r = run("generate.lua", with(args, { "--json" }))
    assert_ok(r)
    local j = json_decode(r.out)
    -- a random model's bytes are often not UTF-8: JSON carries U+FFFD for those
    if utf8.len(plain.out) then assert.equals(plain.out, "Hi" .. j.text .. "\n") end
    assert.is_true(j.prompt_tokens > 0 and j.tokens >= 1 and j.tokens <= 6)
    assert.truthy(({ eog = true, length = true })[j.finish_reason], j.finish_reason)
    if j.finish_reason == "length" then assert.equals(6, j.tokens) end
    assert.is_true(finite(j.ttft) and j.ttft > 0)
  end)

  it("a seed makes sampled text reproducible", function()
    local args = { "--model", tiny_path, "--max-tokens", "12", "--prompt", "Hi", "--temp", "1", "--seed", "5" }
    local a, b = run("generate.lua", args), run("generate.lua", args)
    assert_ok(a)
    assert.equals(a.out, b.out)
  end)
end)

-- ==== chat.lua ===============================================================

describe("scripts/chat.lua", function()
  it("answers each |||-separated turn, reusing the cached conversation", function()
    if not real_path then return pending("smollm2 not available") end
    local r = run("chat.lua", { "--prompt", "Hi|||And?", "--max-tokens", "8", "--stats" })
    assert_ok(r)
    local stats = {}
    for prompt, reused, finish in r.err:gmatch("%[(%d+) prompt tokens, (%d+) reused from the cache, finish: (%a+)%]") do
      stats[#stats + 1] = { prompt = tonumber(prompt), reused = tonumber(reused), finish = finish }
    end
    assert.equals(2, #stats, explain(r))
    assert.equals(0, stats[1].reused)
    -- the second turn re-renders the whole conversation; all of turn one stays cached
    assert.is_true(stats[2].reused > 0, explain(r))
    assert.is_true(stats[2].reused < stats[2].prompt)
    assert.is_true(stats[2].prompt > stats[1].prompt)
    assert.is_true(stats[2].reused >= stats[1].prompt - 1, explain(r))
    local lines = 0
    for _ in r.out:gmatch("[^\n]*\n") do lines = lines + 1 end
    assert.is_true(lines >= 2, explain(r))
  end)

  it("on a model without a chat template exits non-zero with a message", function()
    local r = run("chat.lua", { "--model", tiny_path, "--prompt", "Hi", "--max-tokens", "4" })
    assert.is_not.equals(0, r.rc)
    assert.matches("template", r.err)
  end)
end)

-- ==== bench.lua ==============================================================

describe("scripts/bench.lua --json", function()
  it("prints one JSON object with prefill and decode speeds", function()
    each_model(function(name, path)
      local r = run("bench.lua", with(model_args(path),
        { "--reps", "1", "--prefill", "16", "--depth", "8", "--decode", "4", "--json" }))
      assert_ok(r)
      local ok, j = pcall(json_decode, r.out)
      assert(ok, tostring(j) .. "\n" .. explain(r))
      assert.is_table(j.prefill_tps, name)
      assert.is_table(j.decode_tps, name)
      assert.is_true(finite(j.prefill_tps["16"]) and j.prefill_tps["16"] > 0, name)
      assert.is_true(finite(j.decode_tps["8"]) and j.decode_tps["8"] > 0, name)
      assert.is_true(finite(j.ttft_ms["16"]) and j.ttft_ms["16"] > 0, name)
      assert.is_true(j.kv_bytes > 0, name)
      assert.is_table(j.itl_ms, name)
    end)
  end)

  it("without --json prints a readable table", function()
    local r = run("bench.lua", { "--model", tiny_path, "--reps", "1", "--prefill", "16", "--depth", "8", "--decode", "4" })
    assert_ok(r)
    assert.matches("prefill%s+16 tokens:", r.out)
    assert.matches("decode at depth%s+8:", r.out)
  end)

  it("runs on a model with a vocabulary of fewer than 256 tokens", function()
    local r = run("bench.lua", { "--model", small_vocab_path, "--reps", "1", "--prefill", "16", "--depth", "8",
      "--decode", "4", "--json" })
    assert_ok(r)
    assert.is_table(json_decode(r.out).decode_tps)
  end)
end)

-- ==== perplexity.lua =========================================================

describe("scripts/perplexity.lua --json", function()
  it("prints a finite perplexity for one chunk", function()
    each_model(function(name, path)
      local r = run("perplexity.lua", with(model_args(path),
        { "--file", "tests/data/public-domain.txt", "--ctx", "128", "--chunks", "1", "--json" }))
      assert_ok(r)
      local ok, j = pcall(json_decode, r.out)
      assert(ok, tostring(j) .. "\n" .. explain(r))
      assert.is_true(finite(j.ppl), name)
      assert.is_true(j.ppl > 1, name)
      assert.equals(1, j.chunks)
      assert.equals(128, j.ctx)
      assert.equals(128 - 1 - 64, j.scored) -- the second half of the chunk
    end)
  end)

  it("a text too short for one chunk fails with a message", function()
    local short = os.tmpname()
    local f = assert(io.open(short, "w"))
    f:write("Too short.")
    f:close()
    local r = run("perplexity.lua", { "--model", tiny_path, "--file", short, "--ctx", "128", "--quiet" })
    os.remove(short)
    assert.is_not.equals(0, r.rc)
    assert.matches("chunk", r.err)
  end)
end)

-- ==== bad invocations =========================================================

describe("bad invocations", function()
  local scripts = { "generate.lua", "chat.lua", "bench.lua", "perplexity.lua" }

  it("an unknown option exits non-zero with a usage message", function()
    for _, s in ipairs(scripts) do
      local r = run(s, { "--no-such-option" })
      assert.is_not.equals(0, r.rc, explain(r))
      like("unknown option %-%-no%-such%-option", r.err, s)
      like("usage:", r.err, s)
    end
  end)

  it("a non-number where a number is needed exits non-zero, naming the option", function()
    local r = run("generate.lua", { "--max-tokens", "many" })
    assert.is_not.equals(0, r.rc)
    assert.matches("%-%-max%-tokens", r.err)
    r = run("bench.lua", { "--reps" })
    assert.is_not.equals(0, r.rc)
    assert.matches("%-%-reps", r.err)
  end)

  it("perplexity.lua without --file prints its usage and exits non-zero", function()
    local r = run("perplexity.lua", {})
    assert.is_not.equals(0, r.rc)
    assert.matches("usage:", r.err)
  end)

  it("a missing model file exits non-zero, naming the file", function()
    for _, s in ipairs { "generate.lua", "bench.lua" } do
      local r = run(s, { "--model", "/nonexistent/dir/none.gguf" })
      assert.is_not.equals(0, r.rc, explain(r))
      assert.matches("none.gguf", r.err, 1, true)
    end
  end)

  it("--help prints the usage and exits 0", function()
    for _, s in ipairs(scripts) do
      local r = run(s, { "--help" })
      assert_ok(r)
      like("usage:", r.out, s)
    end
  end)
end)
