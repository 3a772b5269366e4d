-- scripts/mc-eval.lua, run as a user would (separate processes):
--
--   lua5.4 scripts/mc-eval.lua --file ITEMS.jsonl [--batch N] [--no-cache] [--shard i/n] [--out F] [--json]
--   parallel lua5.4 scripts/mc-eval.lua ... --shard {}/2 ::: 0 1   (GNU parallel), then --merge
--
-- Scores are checked against a reference scorer written here: the context
-- prefilled, then the choice fed token by token through s:decode, summing
-- l:logprob: the same bits, as the engine's logits of a position do not
-- depend on how the ids were split into calls. The runs with and without
-- the cache, and with other batches and shards, are compared byte for byte.
local kvlua = require "kvlua"
local tiny = require "spec.support.tiny_models"
local models = require "spec.support.models"
local S = require "spec.support.scripts"
local files = require "spec.support.files"
local write, read = files.write_temp, files.read
local run, explain, assert_ok, json_decode, jsonl_lines = S.run, S.explain, S.assert_ok, S.json_decode, S.jsonl_lines

local EXAMPLE = "scripts/examples/mc.jsonl"

-- Runs mc-eval.lua with --out; returns the process result and the per-item file's text.
local function mc_eval(args)
  local out = os.tmpname()
  local all = { "--out", out, "--quiet" }
  table.move(args, 1, #args, #all + 1, all)
  local r = run("mc-eval.lua", all)
  local text = read(out)
  os.remove(out)
  return r, text
end

-- An item's tokens: the context's (with the special tokens), each choice's (without).
local function item_tokens(model, item)
  local choices = {}
  for k, c in ipairs(item.choices) do choices[k] = model:tokenize(c, { add_special = false, parse_special = false }) end
  return model:tokenize(item.context, { add_special = true, parse_special = false }), choices
end

-- The reference scores of one item: summed log-probs, the context prefilled
-- once in a private session, each choice decoded after it and rewound.
local function reference_scores(model, item)
  local ctx, choices = item_tokens(model, item)
  local longest = 0
  for _, ids in ipairs(choices) do longest = math.max(longest, #ids) end
  local s = assert(model:session { ctx = #ctx + longest + 1 })
  local ctx_logits = assert(s:prefill(ctx))
  local scores, ntok = {}, {}
  for k, ids in ipairs(choices) do
    local l, sum = ctx_logits, 0
    for j, id in ipairs(ids) do
      sum = sum + l:logprob(id)
      if j < #ids then l = assert(s:decode(id)) end
    end
    s:rewind(#ids - 1)
    assert(s.pos == #ctx)
    scores[k], ntok[k] = sum, #ids
  end
  s:close()
  return scores, ntok
end

-- Items of a file, in order.
local function items_of(path)
  return jsonl_lines(read(path))
end

-- ==== the float tiny model: exact scores, bad input ===============================

-- contexts sharing a 40-byte prefix (more than two 16-token pages of byte
-- tokens), choices of 1 to 12 tokens
local PREFIX = "Answer with the word that fits best here. "
local TINY_ITEMS = {
  { context = PREFIX .. "Hello", choices = { " world", "!", " STOP" }, answer = 0 },
  { id = "two", context = PREFIX .. "Hello world", choices = { "!", " and everyone else", "?" }, answer = 1 },
  { context = PREFIX .. "Bye", choices = { " now", " for a while, friend" }, answer = 1 },
  { context = PREFIX, choices = { "a", "b", "c", "d" }, answer = 3 },
}

describe("scripts/mc-eval.lua on a float model", function()
  local tiny_path, input
  setup(function()
    tiny_path = tiny.llama { vocab = "bytes", seed = 5 }
    local lines = {}
    for i, it in ipairs(TINY_ITEMS) do
      lines[i] = string.format('{%s"context": %q, "choices": ["%s"], "answer": %d}',
        it.id and ('"id": "' .. it.id .. '", ') or "", it.context, table.concat(it.choices, '", "'), it.answer)
    end
    input = write(table.concat(lines, "\n") .. "\n")
  end)
  teardown(function()
    os.remove(input)
    tiny.cleanup()
  end)

  it("scores each choice with the reference's bits, with and without the cache", function()
    local model = assert(kvlua.load(tiny_path, { threads = 1 }))
    for _, args in ipairs { { "--batch", "4" }, { "--no-cache" } } do
      local r, text = mc_eval { "--model", tiny_path, "--file", input, table.unpack(args) }
      assert_ok(r)
      local out = jsonl_lines(text)
      assert.equals(#TINY_ITEMS, #out)
      for i, it in ipairs(TINY_ITEMS) do
        local scores, ntok = reference_scores(model, it)
        assert.equals(it.id or i, out[i].id)
        assert.same(scores, out[i].scores, "item " .. i)
        assert.same(ntok, out[i].tokens, "item " .. i)
        for k = 1, #scores do
          -- lm-eval's acc_norm: per character of the choice (Python's len), here all ASCII
          assert.equals(#it.choices[k], out[i].chars[k])
          assert.equals(scores[k] / #it.choices[k], out[i].scores_norm[k])
          assert.equals(scores[k] / ntok[k], out[i].scores_per_token[k])
        end
        assert.equals(it.answer, out[i].answer)
      end
    end
    model:close()
  end)

  it("the prediction is the best score's choice, summed, per character and per token", function()
    local r, text = mc_eval { "--model", tiny_path, "--file", input, "--json" }
    assert_ok(r)
    local j = json_decode(r.out)
    local correct, correct_norm, correct_per_token = 0, 0, 0
    for _, rec in ipairs(jsonl_lines(text)) do
      for k = 1, #rec.scores do
        assert.is_true(rec.scores[rec.predicted + 1] >= rec.scores[k])
        assert.is_true(rec.scores_norm[rec.predicted_norm + 1] >= rec.scores_norm[k])
        assert.is_true(rec.scores_per_token[rec.predicted_per_token + 1] >= rec.scores_per_token[k])
      end
      assert.equals(rec.predicted == rec.answer, rec.correct)
      assert.equals(rec.predicted_norm == rec.answer, rec.correct_norm)
      assert.equals(rec.predicted_per_token == rec.answer, rec.correct_per_token)
      if rec.correct then correct = correct + 1 end
      if rec.correct_norm then correct_norm = correct_norm + 1 end
      if rec.correct_per_token then correct_per_token = correct_per_token + 1 end
    end
    assert.same({ #TINY_ITEMS, correct, correct_norm, correct_per_token, 0 },
      { j.total, j.correct, j.correct_norm, j.correct_per_token, j.skipped })
    assert.equals(correct / #TINY_ITEMS, j.accuracy)
    assert.equals(correct_norm / #TINY_ITEMS, j.accuracy_norm)
    assert.equals(correct_per_token / #TINY_ITEMS, j.accuracy_per_token)
  end)

  -- lm-evaluation-harness 0.4 (lm_eval/api/task.py, multiple_choice):
  --   completion_len = np.array([float(len(i)) for i in choices])
  --   pred_norm = np.argmax(lls / completion_len)
  -- len of a Python str: code points ("éééé" is 4, though 8 bytes and 5 tokens here).
  it("accuracy_norm divides by the choice's characters, as lm-eval's acc_norm; per token is apart", function()
    local item = { context = PREFIX .. "Hello", choices = { "éééé", "??" } }
    local model = assert(kvlua.load(tiny_path, { threads = 1 }))
    local scores, ntok = reference_scores(model, item)
    model:close()
    local chars = { 4, 2 } -- by hand: len("éééé"), len("??")
    local function best(xs) return xs[1] >= xs[2] and 0 or 1 end
    local want_sum = best(scores)
    local want_norm = best { scores[1] / chars[1], scores[2] / chars[2] }
    local want_tok = best { scores[1] / ntok[1], scores[2] / ntok[2] }
    -- the example separates the two normalisations (this model: 5 and 3 tokens)
    assert.are_not.equal(want_norm, want_tok)
    local file = write(string.format('{"context": %q, "choices": ["éééé", "??"], "answer": %d}\n', item.context,
      want_norm))
    local r, text = mc_eval { "--model", tiny_path, "--file", file, "--json" }
    os.remove(file)
    assert_ok(r)
    local rec = jsonl_lines(text)[1]
    assert.same(chars, rec.chars)
    assert.same({ want_sum, want_norm, want_tok }, { rec.predicted, rec.predicted_norm, rec.predicted_per_token })
    assert.same({ scores[1] / 4, scores[2] / 2 }, rec.scores_norm)
    local j = json_decode(r.out)
    assert.same({ 1, 0 }, { j.accuracy_norm, j.accuracy_per_token })
  end)

  it("reports bad items with their line numbers, scores the others, and exits 1", function()
    local bad = write(table.concat({
      '{"context": "Hello", "choices": [" world", "!"], "answer": 0}',
      '{"context": oops}',
      '',
      '{"context": "x", "choices": [], "answer": 0}',
      '{"context": "x", "choices": [" a", " b"], "answer": 2}',
      '{"context": "x", "choices": [" a"], "answer": -1}',
      '{"context": "x", "choices": [" a", ""], "answer": 0}',
      '{"context": "x", "choices": [" a", 7], "answer": 0}',
      '{"choices": [" a"], "answer": 0}',
      '{"context": "x", "choices": [" a"]}',
      '[1, 2]',
      '{"context": "Hello", "choices": ["!", " world"], "answer": 1}',
    }, "\n") .. "\n")
    local r, text = mc_eval { "--model", tiny_path, "--file", bad, "--json" }
    os.remove(bad)
    assert.equals(1, r.rc, explain(r))
    S.like(":2: malformed JSON", r.err)
    S.like(':4: the item needs "choices"', r.err)
    S.like(':5: "answer" must be a 0%-based index below 2', r.err)
    S.like(':6: "answer" must be a 0%-based index below 1', r.err)
    S.like(":7: choice 1 has no tokens", r.err)
    S.like(":8: choice 1 is not a string", r.err)
    S.like(':9: the item needs "context"', r.err)
    S.like(':10: "answer" must be', r.err)
    S.like(":11: expected a JSON object", r.err)
    local out = jsonl_lines(text)
    assert.equals(11, #out) -- the blank line is not an item
    assert.is_nil(out[1].error)
    for k = 2, 10 do assert.truthy(out[k].error, "record " .. k) end
    assert.same({ 2, 2 }, { out[2].line, out[2].id })
    assert.is_nil(out[11].error)
    local j = json_decode(r.out)
    assert.same({ 2, 9 }, { j.total, j.skipped })
  end)

  it("exits 2 with a message when the run cannot start; 1 when no item could be scored", function()
    local empty, blank, one = write(""), write("\n \n"), write('{"context": "a", "choices": ["b"], "answer": 0}\n')
    local cases = {
      { { "--model", tiny_path, "--file", empty }, "empty" },
      { { "--model", tiny_path, "--file", blank }, "no items" },
      { { "--model", tiny_path, "--file", "/nonexistent/items.jsonl" }, "items.jsonl" },
      { { "--model", "/nonexistent/none.gguf", "--file", one }, "none.gguf" },
      { { "--model", tiny_path }, "missing %-%-file" },
      { { "--model", tiny_path, "--file", one, "--batch", "0" }, "%-%-batch" },
      { { "--model", tiny_path, "--file", one, "--shard", "2/2" }, "0 <= i < n" },
      { { "--merge" }, "%-%-merge" },
      { { "--merge", "/nonexistent/out.jsonl" }, "out.jsonl" },
      { { "--no-such-option" }, "unknown option %-%-no%-such%-option" },
    }
    for _, c in ipairs(cases) do
      local r = run("mc-eval.lua", c[1])
      assert.equals(2, r.rc, explain(r))
      assert.matches(c[2], r.err)
    end
    local none = write('{"context": "a", "choices": [], "answer": 0}\n')
    local r = run("mc-eval.lua", { "--model", tiny_path, "--file", none, "--json" })
    assert.equals(1, r.rc, explain(r))
    assert.equals(S.json_null, json_decode(r.out).accuracy)
    for _, p in ipairs { empty, blank, one, none } do os.remove(p) end
    r = run("mc-eval.lua", { "--help" })
    assert_ok(r)
    S.like("usage:", r.out)
  end)
end)

-- ==== SmolLM2 on the shipped example =================================================

describe("scripts/mc-eval.lua on SmolLM2 and the shipped example", function()
  local real_path = models.path("smollm2")
  local runs = {} -- name -> {r =, out = per-item text}
  local function cached_run(name, args)
    if not runs[name] then
      local all = { "--file", EXAMPLE, "--json" }
      table.move(args, 1, #args, #all + 1, all)
      local r, text = mc_eval(all)
      assert_ok(r)
      runs[name] = { r = r, j = json_decode(r.out), out = text }
    end
    return runs[name]
  end

  it("reports accuracy over every item; the scores are the reference's log-probs", function()
    if not real_path then return pending("smollm2 not available") end
    local res = cached_run("batch8", { "--batch", "8" })
    local items = items_of(EXAMPLE)
    local out = jsonl_lines(res.out)
    assert.equals(#items, res.j.total)
    assert.equals(#items, #out)
    assert.equals(res.j.correct / res.j.total, res.j.accuracy)
    -- chance is about 0.3 on these 3- and 4-choice items
    assert.is_true(res.j.accuracy >= 0.6, explain(res.r))
    assert.is_true(res.j.accuracy_norm >= 0.6, explain(res.r))
    local model = assert(kvlua.load(real_path, { threads = 2 }))
    for i, it in ipairs(items) do
      local scores, ntok = reference_scores(model, it)
      assert.equals(it.id, out[i].id)
      assert.same(ntok, out[i].tokens, it.id)
      assert.same(scores, out[i].scores, it.id)
    end
    model:close()
  end)

  it("saves at least half of a from-scratch scorer's prefill tokens by sharing", function()
    if not real_path then return pending("smollm2 not available") end
    local model = assert(kvlua.load(real_path, { threads = 1 }))
    local naive = 0
    for _, it in ipairs(items_of(EXAMPLE)) do
      local ctx, choices = item_tokens(model, it)
      for _, c in ipairs(choices) do naive = naive + #ctx + #c - 1 end
    end
    model:close()
    local p = cached_run("batch8", { "--batch", "8" }).j.prefill_tokens
    assert.equals(naive, p.naive)
    assert.equals(p.naive - p.computed, p.saved)
    assert.is_true(p.saved / p.naive >= 0.5, string.format("%d of %d saved", p.saved, p.naive))
    assert.is_true(p.reused > 0) -- the items' shared instruction, from the cache
    local scratch = cached_run("nocache", { "--no-cache", "--batch", "3" }).j.prefill_tokens
    assert.same({ naive, naive, 0, 0 }, { scratch.naive, scratch.computed, scratch.saved, scratch.reused })
  end)

  it("gives the same per-item scores, to the bit, with and without the cache and batching", function()
    if not real_path then return pending("smollm2 not available") end
    local want = cached_run("batch8", { "--batch", "8" })
    for name, args in pairs { batch1 = { "--batch", "1", "--threads", "1" }, nocache = { "--no-cache", "--batch", "3" } } do
      local got = cached_run(name, args)
      assert.equals(want.out, got.out, name)
      assert.same({ want.j.accuracy, want.j.accuracy_norm, want.j.accuracy_per_token },
        { got.j.accuracy, got.j.accuracy_norm, got.j.accuracy_per_token })
    end
  end)

  it("2 shards with GNU parallel, merged, equal the unsharded run; --merge gives its accuracy", function()
    if not real_path then return pending("smollm2 not available") end
    if not os.execute("parallel --version >/dev/null 2>&1") then return pending("GNU parallel is not installed") end
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir -p " .. S.shell_quote(dir)))
    local build = os.getenv("KVLUA_BUILD")
    local cmd = string.format("%sparallel --will-cite --halt now,fail=1 lua5.4 scripts/mc-eval.lua --file %s"
      .. " --shard {}/2 --out %s/out.{}.jsonl --quiet ::: 0 1 >/dev/null 2>&1",
      build and ("KVLUA_BUILD=" .. S.shell_quote(build) .. " ") or "", EXAMPLE, dir)
    assert(os.execute(cmd), cmd)
    local shard0, shard1 = read(dir .. "/out.0.jsonl"), read(dir .. "/out.1.jsonl")
    assert.is_true(#shard0 > 0 and #shard1 > 0) -- both shards did work
    local want = cached_run("batch8", { "--batch", "8" })
    assert.equals(want.out, shard0 .. shard1)
    local r = run("mc-eval.lua", { "--merge", dir .. "/out.1.jsonl", dir .. "/out.0.jsonl", "--json" })
    os.execute("rm -rf " .. S.shell_quote(dir))
    assert_ok(r)
    local m = json_decode(r.out)
    for _, k in ipairs { "total", "correct", "correct_norm", "correct_per_token", "accuracy", "accuracy_norm",
                         "accuracy_per_token", "skipped" } do
      assert.equals(want.j[k], m[k], k)
    end
  end)
end)
