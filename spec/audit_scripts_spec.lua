-- Findings of an audit of the command-line scripts (scripts/*.lua) under
-- hostile input, one describe per finding, each written to fail before its
-- fix:
--
--   1  an output that cannot be written (--output /dev/full, stdout on a
--      full disk) exited 0 with the results lost
--   2  an item id JSON cannot carry (1e400) aborted batch-generate with a
--      traceback and lost the items after it
--   3  option values out of range (--seed 1e999, --shard 0/2^63, --ctx 2^31,
--      --threads 1000, --kv bogus, --ctx 0, --prompt "", a folder as --file)
--      ended in tracebacks or failed every item; now exit 2 with one line
--      naming the option and what it takes
--   4  arguments without an option (a prompt without --prompt) were
--      ignored; every script parses its options with argparse
--   5  bench-tokenize.lua ran only from the checkout's root (build/ and git
--      ls-files relative to the working directory)
--   6  chat.lua: Ctrl-C ended the program, not the reply; /quit and EOF quit
--   7  generate.lua with no options printed no text (an instruction given
--      as text to continue); --json printed nothing when the context filled
--   8  kv-demo.lua: the "recomputed" baseline got pages back from the cache
--      (prefix reuse) instead of computing them
--   9  an item the engine refuses (max_tokens that take the context past
--      2^24 tokens) ended batch-generate with a traceback; item errors
--      carried a Lua module's file position; mc-eval's "answer": 1e400
--      was reported as a JSON encoding failure
--
-- The scripts run as a user runs them (a separate lua5.4), on tiny
-- random-weight models written to temporary files.
local tiny = require "spec.support.tiny_models"
local S = require "spec.support.scripts"
local files = require "spec.support.files"
local write, read = files.write_temp, files.read
local run, explain, json_decode, jsonl_lines = S.run, S.explain, S.json_decode, S.jsonl_lines

-- ChatML as SmolLM2's template writes it: chat.lua recognizes the format
local CHATML = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
  .. " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"

local tiny_path, chat_path
setup(function()
  tiny_path = tiny.llama { seed = 2, vocab = "bytes" }
  chat_path = tiny.llama { seed = 2, vocab = "bytes", meta = { { "tokenizer.chat_template", "string", CHATML } } }
end)
teardown(function() tiny.cleanup() end)

local PROMPTS = '{"id": "a", "prompt": "Hello"}\n{"id": "b", "prompt": "world"}\n'
local MC = '{"id": "x", "context": "Hello", "choices": [" world", "!"], "answer": 0}\n'

-- the lines of a text
local function lines(text)
  local t = {}
  for l in text:gmatch("[^\n]+") do t[#t + 1] = l end
  return t
end

-- ==== 1 ======================================================================

describe("1: an output that cannot be written", function()
  local has_full = io.open("/dev/full", "w")
  if has_full then has_full:close() end

  -- runs a script with stdout on /dev/full (S.run reads stdout through a pipe)
  local function to_full(name, args)
    local quoted = {}
    for i, a in ipairs(args) do quoted[i] = S.shell_quote(a) end
    local build = os.getenv("KVLUA_BUILD")
    local errfile = os.tmpname()
    local cmd = string.format("%slua5.4 scripts/%s %s >/dev/full 2>%s </dev/null",
      build and ("KVLUA_BUILD=" .. S.shell_quote(build) .. " ") or "", name, table.concat(quoted, " "), errfile)
    local _, _, rc = os.execute(cmd)
    local err = read(errfile)
    os.remove(errfile)
    return rc, err
  end

  it("batch-generate.lua and mc-eval.lua exit 1 with one line naming the file", function()
    if not has_full then return pending("no /dev/full") end
    local input, items = write(PROMPTS), write(MC)
    local r = run("batch-generate.lua", { "--model", tiny_path, "--file", input, "--max-tokens", "2", "--quiet",
      "--output", "/dev/full" })
    assert.equals(1, r.rc, explain(r))
    assert.same({ "batch-generate.lua: cannot write /dev/full: No space left on device" }, lines(r.err))
    r = run("mc-eval.lua", { "--model", tiny_path, "--file", items, "--quiet", "--out", "/dev/full" })
    assert.equals(1, r.rc, explain(r))
    assert.same({ "mc-eval.lua: cannot write /dev/full: No space left on device" }, lines(r.err))
    os.remove(input)
    os.remove(items)
  end)

  it("so does a full stdout, for the scripts that print results there", function()
    if not has_full then return pending("no /dev/full") end
    local input, items = write(PROMPTS), write(MC)
    for name, args in pairs {
      ["batch-generate.lua"] = { "--file", input, "--max-tokens", "2", "--quiet" },
      ["mc-eval.lua"] = { "--file", items, "--quiet" },
      ["generate.lua"] = { "--max-tokens", "2", "--prompt", "Hi" },
      ["perplexity.lua"] = { "--file", "tests/data/public-domain.txt", "--ctx", "64", "--chunks", "1", "--quiet" },
    } do
      local all = { "--model", tiny_path }
      table.move(args, 1, #args, 3, all)
      local rc, err = to_full(name, all)
      assert.equals(1, rc, name .. ": " .. err)
      S.like("cannot write stdout: No space left on device", err, name)
    end
    os.remove(input)
    os.remove(items)
  end)
end)

-- ==== 2 ======================================================================

describe("2: an item id JSON cannot carry", function()
  it("is that item's error line; the items after it run", function()
    local input = write('{"id": 1e400, "prompt": "Hi"}\n{"id": "next", "prompt": "Ho"}\n'
      .. '{"id": [1e400], "prompt": "Hu"}\n')
    local r = run("batch-generate.lua", { "--model", tiny_path, "--file", input, "--max-tokens", "2", "--quiet" })
    assert.equals(1, r.rc, explain(r)) -- some items failed
    local out = jsonl_lines(r.out)
    assert.equals(3, #out)
    assert.same({ 1, 1, "error" }, { out[1].id, out[1].line, out[1].finish_reason })
    S.like("id", out[1].error)
    assert.same({ "next", "length", 2 }, { out[2].id, out[2].finish_reason, out[2].tokens })
    assert.same({ 3, "error" }, { out[3].id, out[3].finish_reason })
    S.like(":1: \"id\" must be a string or a finite number", r.err)
    assert.is_nil(r.err:find("traceback", 1, true))

    local items = write('{"id": -1e400, "context": "Hello", "choices": [" world", "!"], "answer": 0}\n' .. MC)
    r = run("mc-eval.lua", { "--model", tiny_path, "--file", items, "--quiet", "--json" })
    assert.equals(1, r.rc, explain(r))
    assert.same({ 1, 1 }, { json_decode(r.out).total, json_decode(r.out).skipped })
    os.remove(input)
    os.remove(items)
  end)
end)

-- ==== 3 ======================================================================

describe("3: option values out of range", function()
  it("exit 2 with one line naming the option and what it takes", function()
    local input, items = write(PROMPTS), write(MC)
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir " .. S.shell_quote(dir)))
    local bg = { "--model", tiny_path, "--file", input }
    local cases = {
      { "batch-generate.lua", { "--seed", "1e999" }, "%-%-seed takes an integer in 0%.%.%d+" },
      { "batch-generate.lua", { "--shard", "0/9223372036854775808" }, "%-%-shard" },
      { "batch-generate.lua", { "--shard", "0/2147483648" }, "%-%-shard.*2147483647" },
      { "batch-generate.lua", { "--ctx", "2147483648" }, "%-%-ctx takes an integer in 0%.%.2%^24" },
      { "batch-generate.lua", { "--threads", "1000" }, "%-%-threads takes an integer in 0%.%.256" },
      { "batch-generate.lua", { "--kv", "bogus" }, "%-%-kv takes a K/V type %(f16, f32, q8_0, q4_0%)" },
      { "batch-generate.lua", { "--kv", "f16,7=f32" }, "%-%-kv: layer 7, but the model has layers 0%.%.1" },
      { "batch-generate.lua", { "--batch", "0" }, "%-%-batch takes an integer in 1%.%." },
      { "batch-generate.lua", { "--temp", "nan" }, "%-%-temp takes a finite number" },
      { "generate.lua", { "--ctx", "0" }, "%-%-ctx takes an integer in 1%.%.2%^24" },
      { "generate.lua", { "--prompt", "" }, "%-%-prompt takes a non%-empty text" },
      { "generate.lua", { "--max-tokens", "2.5" }, "%-%-max%-tokens takes an integer" },
      { "generate.lua", { "--top-p", "2" }, "%-%-top%-p takes a finite number in 0%.%.1" },
      { "generate.lua", { "--backend", "gpu" }, "%-%-backend takes one of auto, cpu, opencl" },
      { "chat.lua", { "--ctx=-1" }, "%-%-ctx takes an integer in 1%.%.2%^24, not '%-1'" },
      { "perplexity.lua", { "--ktype", "q3" }, "%-%-ktype takes a K/V type" },
      { "bench.lua", { "--depth", "16,x" }, "%-%-depth takes a comma%-separated list" },
      { "bench-batch.lua", { "--n", "0" }, "%-%-n takes a comma%-separated list" },
      { "kv-demo.lua", { "--tokens", "1" }, "%-%-tokens takes an integer in 2%.%." },
      { "agent.lua", { "--protocol", "xml" }, "%-%-protocol takes one of text, hermes" },
      { "mc-eval.lua", { "--file", dir }, "cannot read .*: Is a directory" },
      { "perplexity.lua", { "--file", dir }, "cannot read .*: Is a directory" },
    }
    for _, c in ipairs(cases) do
      local args = c[1] == "batch-generate.lua" and table.move(bg, 1, #bg, 1, {}) or { "--model", tiny_path }
      table.move(c[2], 1, #c[2], #args + 1, args)
      local r = run(c[1], args)
      assert.equals(2, r.rc, explain(r))
      assert.equals(1, #lines(r.err), explain(r))
      S.like("^" .. c[1]:gsub("%-", "%%-"):gsub("%.", "%%.") .. ": ", r.err, c[1])
      S.like(c[3], r.err, c[1])
      assert.equals("", r.out)
    end
    os.remove(input)
    os.remove(items)
    os.execute("rmdir " .. S.shell_quote(dir))
  end)
end)

-- ==== 4 ======================================================================

describe("4: every script parses its options with argparse", function()
  local scripts = {}
  local p = io.popen("ls scripts/*.lua")
  for path in p:lines() do scripts[#scripts + 1] = path:match("[^/]+$") end
  p:close()

  it("--help lists the options; an unknown option or a stray argument exits 2 with the usage", function()
    assert.is_true(#scripts >= 12)
    for _, s in ipairs(scripts) do
      local r = run(s, { "--help" })
      assert.equals(0, r.rc, explain(r))
      S.like("^usage: " .. s:gsub("%-", "%%-"):gsub("%.", "%%.") .. " %[%-h%]", r.out, s)
      r = run(s, { "--no-such-option" })
      assert.equals(2, r.rc, explain(r))
      S.like("unknown option %-%-no%-such%-option\nusage:", r.err, s)
      r = run(s, { "Hello" })
      assert.equals(2, r.rc, explain(r))
      S.like("unexpected argument 'Hello'", r.err, s)
    end
  end)

  it("the model options are the same everywhere, defined once", function()
    for _, s in ipairs(scripts) do
      if s ~= "bench-tokenize.lua" then
        local r = run(s, { "--threads", "257" })
        assert.equals(2, r.rc, explain(r))
        assert.equals(s .. ": option --threads takes an integer in 0..256, not '257'\n", r.err)
      end
    end
  end)

  it("a prompt given without --prompt is refused, not ignored", function()
    local r = run("generate.lua", { "--model", tiny_path, "Tell me a story" })
    assert.equals(2, r.rc, explain(r))
    S.like("unexpected argument 'Tell me a story'", r.err)
    assert.equals("", r.out)
  end)
end)

-- ==== 5 ======================================================================

describe("5: the scripts run from any working directory", function()
  it("bench-tokenize.lua, generate.lua and batch-generate.lua run from /", function()
    local root = io.popen("pwd"):read("l")
    local build = os.getenv("KVLUA_BUILD") or "build"
    if build:sub(1, 1) ~= "/" then build = root .. "/" .. build end
    local input = write(PROMPTS)
    local p = io.popen(string.format("cd / && KVLUA_BUILD=%s lua5.4 %s/scripts/generate.lua --model %s --prompt Hi "
      .. "--max-tokens 2 --json 2>&1", S.shell_quote(build), S.shell_quote(root), S.shell_quote(tiny_path)))
    local out = p:read("a")
    assert.is_true(p:close(), out)
    assert.equals(2, json_decode(out).tokens)
    p = io.popen(string.format("cd / && KVLUA_BUILD=%s lua5.4 %s/scripts/batch-generate.lua --model %s --file %s "
      .. "--max-tokens 2 --quiet 2>&1", S.shell_quote(build), S.shell_quote(root), S.shell_quote(tiny_path),
      S.shell_quote(input)))
    out = p:read("a")
    assert.is_true(p:close(), out)
    assert.equals(2, #jsonl_lines(out))
    os.remove(input)
    p = io.popen(string.format("cd / && KVLUA_BUILD=%s lua5.4 %s/scripts/bench-tokenize.lua --mb 0.001 --repeats 1 2>&1",
      S.shell_quote(build), S.shell_quote(root)))
    out = p:read("a")
    assert.is_true(p:close(), out)
    S.like("^text: 0%.00 MB from %d+ files", out)
  end)
end)

-- ==== 6 ======================================================================

describe("6: chat.lua", function()
  local function sleep(s) os.execute("sleep " .. s) end

  -- Waits until pred() holds (up to about 20 s).
  local function wait_for(pred, what)
    for _ = 1, 400 do
      if pred() then return end
      sleep(0.05)
    end
    error("timed out waiting for " .. what)
  end

  local function size(path)
    local f = io.open(path, "rb")
    if not f then return 0 end
    local n = f:seek("end")
    f:close()
    return n
  end

  it("Ctrl-C stops the reply being generated, not the program; /quit quits", function()
    local dir = os.tmpname()
    os.remove(dir)
    assert(os.execute("mkdir " .. S.shell_quote(dir)))
    local fifo = dir .. "/in"
    assert(os.execute("mkfifo " .. S.shell_quote(fifo)))
    local build = os.getenv("KVLUA_BUILD")
    -- greedy on this model repeats a few bytes and never ends: a reply runs until interrupted
    os.execute(string.format("(%slua5.4 scripts/chat.lua --model %s --temp 0 --max-tokens 1000000 --ctx 1048576 "
      .. "--stats <%s >%s/out 2>%s/err & echo $! >%s/pid; wait $!; echo $? >%s/rc) >/dev/null 2>&1 &",
      build and ("KVLUA_BUILD=" .. S.shell_quote(build) .. " ") or "", S.shell_quote(chat_path),
      S.shell_quote(fifo), dir, dir, dir, dir))
    local w = assert(io.open(fifo, "w")) -- (opens once chat.lua reads)
    w:setvbuf("no")
    wait_for(function() return size(dir .. "/pid") > 0 end, "the pid")
    local pid = read(dir .. "/pid"):match("%d+")
    local out = dir .. "/out"
    w:write("Tell me about the sea.\n")
    wait_for(function() return size(out) > 200 end, "a reply")
    os.execute("kill -INT " .. pid)
    wait_for(function() return read(out):find("[stopped]\n> ", 1, true) ~= nil end, "the prompt again")
    w:write("/quit\n")
    w:close()
    wait_for(function() return size(dir .. "/rc") > 0 end, "the exit")
    local rc, err, text = read(dir .. "/rc"), read(dir .. "/err"), read(out)
    os.execute("rm -rf " .. S.shell_quote(dir))
    assert.equals("0", rc:match("%d+"), err)
    S.like("^> ", text)
    S.like("%[%d+ prompt tokens, 0 reused from the cache, finish: interrupted%]", err)
    assert.is_nil(err:find("traceback", 1, true))
  end)

  it("EOF quits with status 0", function()
    local r = run("chat.lua", { "--model", chat_path, "--max-tokens", "4" }) -- stdin: /dev/null
    assert.equals(0, r.rc, explain(r))
    assert.equals("> ", r.out)
  end)
end)

-- ==== 7 ======================================================================

describe("7: generate.lua's defaults and --json", function()
  it("with no prompt continues a sentence; --chat asks the instruction", function()
    local r = run("generate.lua", { "--model", tiny_path, "--max-tokens", "3", "--temp", "0", "--json" })
    assert.equals(0, r.rc, explain(r))
    local plain = json_decode(r.out)
    r = run("generate.lua", { "--model", chat_path, "--max-tokens", "3", "--temp", "0", "--json", "--chat" })
    assert.equals(0, r.rc, explain(r))
    local chat = json_decode(r.out)
    -- a completion prompt is short text; the chat prompt is the ChatML turn around an instruction
    assert.is_true(plain.prompt_tokens < chat.prompt_tokens)
    r = run("generate.lua", { "--model", tiny_path, "--max-tokens", "3", "--temp", "0" })
    assert.equals(0, r.rc, explain(r))
    S.like("^The sea at dawn was calm, and", r.out)
  end)

  it("--json prints its object when the context fills, with finish_reason ctx", function()
    local r = run("generate.lua", { "--model", tiny_path, "--prompt", "Hello", "--max-tokens", "100", "--ctx", "12",
      "--temp", "0", "--json" })
    assert.equals(0, r.rc, explain(r))
    local j = json_decode(r.out)
    assert.equals("ctx", j.finish_reason)
    -- every position of the context filled, and one more token sampled from the last one's logits
    assert.equals(12 + 1, j.prompt_tokens + j.tokens)
  end)
end)

-- ==== 8 ======================================================================

describe("8: kv-demo.lua's recomputed baseline", function()
  it("computes every position: no token comes back from the cache", function()
    -- a prompt of 40 byte tokens: two full 16-token pages a cache could hand back
    local r = run("kv-demo.lua", { "--model", tiny_path, "--tokens", "20", "--json", "--prompt",
      ("Lua is small. "):rep(3) })
    assert.equals(0, r.rc, explain(r))
    local j = json_decode(r.out)
    assert.is_true(j.prompt_tokens > 32)
    assert.equals(0, j.reused_tokens)
    assert.equals(20, j.same_argmax)
  end)
end)

-- ==== 9 ======================================================================

describe("9: items the engine refuses", function()
  it("are their own error lines with the reason; the run goes on", function()
    local input = write('{"prompt": "x", "max_tokens": 16777216}\n{"prompt": "y", "temp": 1, "top_p": 7}\n'
      .. '{"prompt": "z", "max_tokens": 2}\n')
    local r = run("batch-generate.lua", { "--model", tiny_path, "--file", input, "--quiet" })
    os.remove(input)
    assert.equals(1, r.rc, explain(r))
    local out = jsonl_lines(r.out)
    assert.equals(3, #out)
    assert.same({ "error", "error", "length" }, { out[1].finish_reason, out[2].finish_reason, out[3].finish_reason })
    S.like("^the prompt %(%d+ tokens%) and max_tokens %(16777216%) need more than the largest context", out[1].error)
    assert.equals("sampling: top_p must be in [0, 1], got 7", out[2].error)
    assert.is_nil(r.err:find("traceback", 1, true))

    local items = write('{"context": "Hello", "choices": [" a", " b"], "answer": 1e400}\n' .. MC)
    r = run("mc-eval.lua", { "--model", tiny_path, "--file", items, "--quiet" })
    os.remove(items)
    assert.equals(1, r.rc, explain(r))
    S.like(':1: "answer" must be a 0%-based index below 2 %(the number of choices%), not inf', r.err)
  end)
end)
