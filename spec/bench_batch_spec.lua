-- scripts/bench-batch.lua, run as a user would, on a tiny model: it prints
-- its figures (no timing is asserted, only that every figure is there and
-- consistent with the others).
local tiny = require "spec.support.tiny_models"
local S = require "spec.support.scripts"

describe("scripts/bench-batch.lua", function()
  local path
  setup(function() path = tiny.llama { seed = 7 } end)
  teardown(function() tiny.cleanup() end)

  it("--json gives batched and lone decode tok/s for each N, and scheduler latencies for both prefill modes", function()
    local r = S.run("bench-batch.lua", { "--model", path, "--threads", "1", "--n", "1,3", "--steps", "3",
      "--depth", "5", "--requests", "6", "--long", "40", "--short", "4", "--max-tokens", "5", "--batch", "3",
      "--prefill-chunk", "8", "--json" })
    S.assert_ok(r)
    local j = S.json_decode(r.out)
    assert.equals(2, #j.decode.rows)
    for i, n in ipairs { 1, 3 } do
      local row = j.decode.rows[i]
      assert.equals(n, row.n)
      assert.is_true(S.finite(row.alone_tps) and row.alone_tps > 0)
      assert.is_true(S.finite(row.batch_tps) and row.batch_tps > 0)
      assert.near(row.batch_tps / row.alone_tps, row.speedup, 1e-9)
      assert.is_true(S.finite(row.wall_speedup) and row.wall_speedup > 0)
    end
    assert.same({ 0, 8 }, { j.scheduler.runs[1].prefill_chunk, j.scheduler.runs[2].prefill_chunk })
    for _, run in ipairs(j.scheduler.runs) do
      -- request i generates 1 + (7 i) % 5 tokens, EOG ignored
      local want = 0
      for i = 1, 6 do want = want + 1 + (7 * i) % 5 end
      assert.equals(want, run.tokens)
      assert.is_true(run.itl_ms.p50 <= run.itl_ms.p90 and run.itl_ms.p90 <= run.itl_ms.p99)
      assert.is_true(run.ttft_ms.p50 > 0 and run.ttft_long_ms.p50 > 0)
    end
    assert.is_true(j.scheduler.runs[2].steps > j.scheduler.runs[1].steps) -- the long prompts took several steps
  end)

  it("prints a table; a bad option exits 2", function()
    local r = S.run("bench-batch.lua", { "--model", path, "--threads", "1", "--n", "2", "--steps", "2",
      "--depth", "3", "--requests", "4", "--long", "12", "--short", "3", "--max-tokens", "3", "--batch", "2" })
    S.assert_ok(r)
    S.like("speedup", r.out)
    S.like("whole prompts", r.out)
    r = S.run("bench-batch.lua", { "--model", path, "--n", "0" })
    assert.equals(2, r.rc, S.explain(r))
    S.like("%-%-n", r.err)
  end)
end)
