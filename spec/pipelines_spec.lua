-- The pipeline scripts, run as a user would (separate processes):
--
--   lua5.4 scripts/batch-generate.lua --file PROMPTS.jsonl [--shard i/n] [--output F] [--json]
--   parallel lua5.4 scripts/batch-generate.lua ... --shard {}/2 ::: 0 1   (GNU parallel)
--   scripts/slurm/batch-generate.sbatch, with the variables Slurm sets
--   lua5.4 scripts/kv-demo.lua --tokens N [--plot F] [--json]
--   lua5.4 scripts/bench.lua ... --kv f16,f32 --plot F --json
--
-- Generations are checked against the same prompt run alone in this
-- process through s:generate (greedy), sharded runs against the unsharded
-- run, bytes for bytes. Most run on a tiny model; the real SmolLM2 where
-- it is available.
local kvlua = require "kvlua"
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"
local S = require "spec.support.scripts"
local files = require "spec.support.files"
local write, read = files.write_temp, files.read
local run, explain, assert_ok, json_decode, jsonl_lines = S.run, S.explain, S.assert_ok, S.json_decode, S.jsonl_lines

local tiny_path, real_path
setup(function()
  tiny_path = tiny.llama { vocab = "bytes", seed = 2 }
  real_path = models.path("smollm2")
end)
teardown(function() tiny.cleanup() end)

-- twelve raw prompts, greedy, different lengths
local PROMPTS = {}
for i = 1, 12 do
  PROMPTS[i] = string.format('{"id": "p%d", "prompt": "%s", "max_tokens": %d}', i,
    string.rep(string.char(96 + i), i), 3 + i % 5)
end
local PROMPTS_TEXT = table.concat(PROMPTS, "\n") .. "\n"

-- ==== batch-generate.lua ==========================================================

describe("scripts/batch-generate.lua", function()
  it("writes one line per item, in input order, each the text the prompt gets alone", function()
    local input = write(PROMPTS_TEXT)
    local r = run("batch-generate.lua", { "--model", tiny_path, "--file", input, "--batch", "3",
      "--prefill-chunk", "4", "--ids" })
    os.remove(input)
    assert_ok(r)
    local out = jsonl_lines(r.out)
    assert.equals(12, #out)
    local model = assert(kvlua.load(tiny_path, { threads = 1 }))
    for i, rec in ipairs(out) do
      assert.equals("p" .. i, rec.id)
      local s = assert(model:session { ctx = 64 })
      local pieces = {}
      for piece in s:generate { prompt = string.rep(string.char(96 + i), i), max_tokens = 3 + i % 5 } do
        pieces[#pieces + 1] = piece
      end
      local want_ids = s.generated
      if s.finish_reason == "eog" then table.remove(want_ids) end -- the EOS is not output
      assert.same(want_ids, rec.ids, "item " .. i)
      -- a random model's bytes are often not UTF-8: JSON carries U+FFFD for those
      local text = table.concat(pieces)
      if utf8.len(text) then assert.equals(text, rec.text, "item " .. i) end
      assert.truthy(utf8.len(rec.text))
      assert.equals(s.finish_reason, rec.finish_reason, "item " .. i)
      assert.equals(#rec.ids, rec.tokens)
      assert.is_true(rec.ttft >= 0)
      s:close()
    end
    model:close()
  end)

  -- (any prefill chunks on this float model; on a quantized one, pieces
  -- of different sizes carry rounding noise: see kvlua.scheduler)
  it("gives the same output whatever the batch size and prefill chunks", function()
    local input = write(PROMPTS_TEXT)
    local outs = {}
    for _, opts in ipairs { { "1", "0" }, { "4", "3" }, { "12", "128" } } do
      local r = run("batch-generate.lua", { "--model", tiny_path, "--file", input, "--batch", opts[1],
        "--prefill-chunk", opts[2], "--no-timings", "--quiet" })
      assert_ok(r)
      outs[#outs + 1] = r.out
    end
    os.remove(input)
    assert.equals(outs[1], outs[2])
    assert.equals(outs[1], outs[3])
  end)

  it("reports a malformed line with its line number, runs the others, and exits 1", function()
    local input = write('{"prompt": "a", "max_tokens": 2}\n{"prompt": oops}\n\n{"prompt": "b", "top_k": "x"}\n'
      .. '{"nothing": 1}\n{"prompt": "c", "max_tokens": 2}\n')
    local r = run("batch-generate.lua", { "--model", tiny_path, "--file", input, "--quiet" })
    assert.equals(1, r.rc, explain(r))
    S.like(":2: malformed JSON", r.err)
    S.like(":4: top_k must be an integer", r.err)
    S.like(':5: the item needs "prompt"', r.err)
    local out = jsonl_lines(r.out)
    assert.equals(5, #out) -- the blank line is not an item
    assert.equals("length", out[1].finish_reason)
    assert.same({ "error", 2 }, { out[2].finish_reason, out[2].line })
    assert.same({ "error", 4 }, { out[3].finish_reason, out[3].line })
    assert.same({ "error", 5 }, { out[4].finish_reason, out[4].line })
    assert.equals("length", out[5].finish_reason)
    os.remove(input)
  end)

  it("an empty file, a missing file or model, and --json without --output exit 2 with a message", function()
    local empty, blank = write(""), write("\n  \n")
    local cases = {
      { { "--model", tiny_path, "--file", empty }, "empty" },
      { { "--model", tiny_path, "--file", blank }, "no items" },
      { { "--model", tiny_path, "--file", "/nonexistent/in.jsonl" }, "in.jsonl" },
      { { "--model", "/nonexistent/none.gguf", "--file", write(PROMPTS[1]) }, "none.gguf" },
      { { "--model", tiny_path }, "missing %-%-file" },
      { { "--model", tiny_path, "--file", empty, "--json" }, "%-%-output" },
      { { "--model", tiny_path, "--file", empty, "--shard", "2/2" }, "0 <= i < n" },
    }
    for _, c in ipairs(cases) do
      local r = run("batch-generate.lua", c[1])
      assert.equals(2, r.rc, explain(r))
      assert.matches(c[2], r.err)
    end
    os.remove(empty)
    os.remove(blank)
  end)

  it("--json prints a summary; progress comes as plain lines in a pipe and as a bar on a terminal", function()
    local input, output = write(PROMPTS_TEXT), os.tmpname()
    local r = run("batch-generate.lua", { "--model", tiny_path, "--file", input, "--output", output, "--json" })
    assert_ok(r)
    local j = json_decode(r.out)
    assert.same({ 12, 0 }, { j.items, j.failed })
    assert.is_true(j.tokens > 0 and j.seconds > 0 and j.tokens_per_s > 0)
    assert.equals(12, #jsonl_lines(read(output)))
    S.like("progress: %d+/12 items", r.err)
    assert.is_nil(r.err:find("\r", 1, true))
    r = run("batch-generate.lua", { "--model", tiny_path, "--file", input, "--output", output }, { KVLUA_PROGRESS = "bar" })
    assert_ok(r)
    S.like("\r%[#+%]? ?[#.]*%] 12/12 items 100%%", r.err)
    os.remove(input)
    os.remove(output)
  end)

  it("runs chat items on SmolLM2", function()
    if not real_path then return pending("smollm2 not available") end
    local input = write('{"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 8}\n'
      .. '{"prompt": "The capital of France is", "max_tokens": 4}\n')
    local r = run("batch-generate.lua", { "--file", input, "--quiet" })
    os.remove(input)
    assert_ok(r)
    local out = jsonl_lines(r.out)
    assert.equals(2, #out)
    assert.is_true(#out[1].text > 0 and #out[2].text > 0, explain(r))
    assert.is_nil(out[1].text:find("<|im_start|>", 1, true))
    assert.truthy(out[2].text:find("Paris"), explain(r))
  end)
end)

-- ==== sharding =====================================================================

describe("sharded runs", function()
  local function unsharded(model_args, input)
    local args = { "--file", input, "--no-timings", "--quiet" }
    table.move(model_args, 1, #model_args, #args + 1, args)
    local r = run("batch-generate.lua", args)
    assert_ok(r)
    return r.out
  end

  local function shell(cmd)
    local p = io.popen(cmd .. " 2>&1")
    local out = p:read("a")
    local ok = p:close()
    return ok, out
  end

  it("2 shards with GNU parallel, merged in shard order, equal the unsharded output exactly", function()
    if not shell("parallel --version >/dev/null") then return pending("GNU parallel is not installed") end
    local function check(model_args, input)
      local dir = os.tmpname()
      os.remove(dir)
      assert(os.execute("mkdir -p " .. S.shell_quote(dir)))
      local build = os.getenv("KVLUA_BUILD")
      local quoted = {}
      for i, a in ipairs(model_args) do quoted[i] = S.shell_quote(a) end
      local cmd = string.format("%sparallel --will-cite --halt now,fail=1 lua5.4 scripts/batch-generate.lua %s"
        .. " --file %s --shard {}/2 --output %s/out.{}.jsonl --no-timings --quiet ::: 0 1"
        .. " && cat %s/out.0.jsonl %s/out.1.jsonl > %s/merged.jsonl",
        build and ("KVLUA_BUILD=" .. S.shell_quote(build) .. " ") or "",
        table.concat(quoted, " "), S.shell_quote(input), dir, dir, dir, dir)
      local ok, out = shell(cmd)
      assert(ok, cmd .. "\n" .. out)
      local merged = read(dir .. "/merged.jsonl")
      local shard0 = read(dir .. "/out.0.jsonl")
      os.execute("rm -rf " .. S.shell_quote(dir))
      assert.is_true(#shard0 > 0 and #shard0 < #merged) -- both shards did work
      assert.equals(unsharded(model_args, input), merged)
    end
    local input = write(PROMPTS_TEXT)
    check({ "--model", tiny_path }, input)
    os.remove(input)
    if real_path then check({ "--max-tokens", "8" }, "scripts/examples/prompts.jsonl") end
  end)

  it("the Slurm job array script, run as its tasks, gives the unsharded output when merged", function()
    local input = write(PROMPTS_TEXT)
    local dir = os.tmpname()
    os.remove(dir)
    local build = os.getenv("KVLUA_BUILD")
    for i = 0, 2 do
      local cmd = string.format("%sSLURM_ARRAY_TASK_ID=%d SLURM_ARRAY_TASK_MIN=0 SLURM_ARRAY_TASK_COUNT=3 "
        .. "bash scripts/slurm/batch-generate.sbatch %s %s --model %s --no-timings --quiet",
        build and ("KVLUA_BUILD=" .. S.shell_quote(build) .. " ") or "", i, S.shell_quote(input),
        S.shell_quote(dir), S.shell_quote(tiny_path))
      local ok, out = shell(cmd)
      assert(ok, cmd .. "\n" .. out)
    end
    local ok, merged = shell("cat " .. dir .. "/shard-*-of-0003.jsonl")
    assert(ok, merged)
    os.execute("rm -rf " .. S.shell_quote(dir))
    assert.equals(unsharded({ "--model", tiny_path }, input), merged)
    os.remove(input)
  end)

  it("an empty shard of a non-empty file writes nothing and exits 0", function()
    local input = write(PROMPTS[1] .. "\n")
    -- one line, two shards: line 0 goes to shard floor(0 * 2 / 1) = 0
    local r = run("batch-generate.lua", { "--model", tiny_path, "--file", input, "--shard", "1/2" })
    os.remove(input)
    assert_ok(r)
    assert.equals("", r.out)
    S.like("shard 1/2 has no items", r.err)
  end)
end)

-- ==== kv-demo.lua ===================================================================

describe("scripts/kv-demo.lua", function()
  it("--json gives per-token and cumulative times for both ways; the cached run is the faster one", function()
    local r = run("kv-demo.lua", { "--model", tiny_path, "--tokens", "6", "--json" })
    assert_ok(r)
    local j = json_decode(r.out)
    assert.equals(6, j.tokens)
    for _, side in ipairs { "cached", "recomputed" } do
      assert.equals(6, #j[side].per_token_ms)
      assert.equals(6, #j[side].cumulative_s)
      local sum = 0
      for k = 1, 6 do
        sum = sum + j[side].per_token_ms[k] / 1e3
        assert.near(sum, j[side].cumulative_s[k], 1e-9)
      end
    end
    -- both runs process the same sequence: the recomputed argmax agrees
    assert.equals(6, j.same_argmax)
  end)

  it("prints a table marking the prefill and decode steps, and writes the plot", function()
    local plot = os.tmpname()
    local r = run("kv-demo.lua", { "--model", tiny_path, "--tokens", "4", "--plot", plot })
    assert_ok(r)
    S.like("\n%s+1%s+prefill%s", r.out)
    S.like("\n%s+2%s+decode%s", r.out)
    S.like("TTFT [%d.]+ ms", r.out)
    assert.equals("\x89PNG\r\n\x1a\n", read(plot):sub(1, 8))
    os.remove(plot)
  end)

  it("--tokens under 2 exits non-zero with a message", function()
    local r = run("kv-demo.lua", { "--model", tiny_path, "--tokens", "1" })
    assert.equals(2, r.rc)
    assert.matches("%-%-tokens", r.err)
  end)
end)

-- ==== bench.lua --plot ================================================================

describe("scripts/bench.lua --kv with several types", function()
  it("measures each type and plots tok/s against depth", function()
    local plot = os.tmpname()
    local r = run("bench.lua", { "--model", tiny_path, "--reps", "1", "--prefill", "8,16", "--depth", "4,12",
      "--decode", "3", "--kv", "f16,f32", "--plot", plot, "--json" })
    assert_ok(r)
    local j = json_decode(r.out)
    for _, kv in ipairs { "f16", "f32" } do
      assert.equals(kv, j.by_kv[kv].kv_type)
      assert.is_true(S.finite(j.by_kv[kv].decode_tps["12"]))
      assert.is_true(S.finite(j.by_kv[kv].prefill_tps["16"]))
    end
    assert.is_true(j.by_kv.f32.kv_bytes > j.by_kv.f16.kv_bytes)
    assert.equals("\x89PNG\r\n\x1a\n", read(plot):sub(1, 8))
    os.remove(plot)
  end)
end)

-- ==== every new script ===============================================================

describe("the pipeline scripts", function()
  local scripts = { "batch-generate.lua", "kv-demo.lua", "agent.lua" }

  it("--help prints the usage; an unknown option exits non-zero with it", function()
    for _, s in ipairs(scripts) do
      local r = run(s, { "--help" })
      assert_ok(r)
      S.like("usage:", r.out, s)
      r = run(s, { "--no-such-option" })
      assert.is_not.equals(0, r.rc, explain(r))
      S.like("unknown option %-%-no%-such%-option", r.err, s)
    end
  end)

  it("a missing model file exits non-zero, naming the file", function()
    local input = write(PROMPTS[1])
    local turns = write("Hi\n")
    for s, extra in pairs { ["batch-generate.lua"] = { "--file", input }, ["kv-demo.lua"] = {},
                            ["agent.lua"] = { "--script", turns } } do
      local args = { "--model", "/nonexistent/dir/none.gguf" }
      table.move(extra, 1, #extra, 3, args)
      local r = run(s, args)
      assert.is_not.equals(0, r.rc, explain(r))
      assert.matches("none.gguf", r.err, 1, true)
    end
    os.remove(input)
    os.remove(turns)
  end)
end)
