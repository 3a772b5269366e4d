-- kvlua.json, kvlua.jsonl and kvlua.progress: the pieces the pipeline
-- scripts share. Expected texts are written by hand from RFC 8259 (JSON)
-- and the shard rule documented in kvlua.jsonl.
local json = require "kvlua.json"
local jsonl = require "kvlua.jsonl"
local progress = require "kvlua.progress"
local files = require "spec.support.files"

describe("json.encode", function()
  it("writes objects with sorted keys, arrays, and scalars", function()
    assert.equals('{"a":[1,2,3],"b":{"c":true,"d":null},"e":"x"}',
      json.encode { e = "x", a = { 1, 2, 3 }, b = { d = json.null, c = true } })
    assert.equals("[]", json.encode(json.array {}))
    assert.equals("{}", json.encode {})
    assert.equals("false", json.encode(false))
  end)

  it("writes integers as integers and floats as the shortest text that reads back", function()
    assert.equals("42", json.encode(42))
    assert.equals("-7", json.encode(-7))
    assert.equals("0.1", json.encode(0.1))
    assert.equals("3", json.encode(3.0))
    assert.equals("1e+300", json.encode(1e300))
    assert.equals("0.30000000000000004", json.encode(0.1 + 0.2))
  end)

  it("escapes quotes, backslashes and control characters", function()
    assert.equals([["a\"b\\c\nd\te\u0001"]], json.encode('a"b\\c\nd\te\1'))
  end)

  it("keeps valid UTF-8 and replaces invalid bytes by U+FFFD", function()
    assert.equals('"é"', json.encode("é"))
    assert.equals('"a\u{FFFD}b"', json.encode("a\xffb"))
    assert.equals('"\u{FFFD}"', json.encode("\xc3")) -- a lead byte cut off
  end)

  it("pretty-prints with an indent", function()
    assert.equals('{\n  "a": [\n    1\n  ]\n}', json.encode({ a = { 1 } }, { indent = "  " }))
  end)

  it("raises on values JSON cannot hold", function()
    assert.has_error(function() json.encode(0 / 0) end)
    assert.has_error(function() json.encode(math.huge) end)
    assert.has_error(function() json.encode { f = print } end)
    local t = {}
    t.self = t
    assert.has_error(function() json.encode(t) end)
  end)
end)

describe("json.decode", function()
  it("reads objects, arrays, strings, numbers and literals", function()
    local v = assert(json.decode('{"a": [1, 2.5, -3e2, null, true, false], "b": "x\\ny"}'))
    assert.same({ 1, 2.5, -300.0, json.null, true, false }, setmetatable(v.a, nil))
    assert.equals("x\ny", v.b)
    assert.equals("integer", math.type(v.a[1]))
    assert.equals("float", math.type(v.a[2]))
  end)

  it("marks arrays, so an empty array encodes back as []", function()
    local v = assert(json.decode('{"list": []}'))
    assert.is_true(json.is_array(v.list))
    assert.equals('{"list":[]}', json.encode(v))
  end)

  it("decodes \\u escapes, surrogate pairs included", function()
    assert.equals("é😀", json.decode('"\\u00e9\\ud83d\\ude00"'))
    assert.equals("\u{FFFD}", json.decode('"\\ud83d"')) -- a lone surrogate
  end)

  it("returns nil and a message with the byte position for bad text", function()
    local cases = {
      { '{"a": 1,}', "a string key expected at byte 9" },
      { "01", "bad number at byte 1" },
      { "1.", "trailing text at byte 2" },
      { '"abc', "unterminated string at byte 1" },
      { "[1 2]", "',' or ']' expected at byte 4" },
      { "tru", "unexpected character 't' at byte 1" },
      { "{} x", "trailing text at byte 4" },
      { "", "unexpected end of text at byte 1" },
      { '"a\tb"', "control character in a string at byte 3" },
      { '"\\x"', "bad escape \\x at byte 2" },
    }
    for _, c in ipairs(cases) do
      local v, err = json.decode(c[1])
      assert.is_nil(v, c[1])
      assert.equals(c[2], err, c[1])
    end
  end)

  it("decode_prefix reads one value and says where it ended", function()
    local v, after = json.decode_prefix('{"x": 1} and more')
    assert.same({ x = 1 }, v)
    assert.equals(9, after)
  end)

  it("raises when not given a string", function()
    assert.has_error(function() json.decode(nil) end)
  end)
end)

describe("json.key_order", function()
  it("lists every object's keys in text order, nested in objects and arrays", function()
    local text = '{"z": 1, "a": {"y": [], "x": [{"q": null, "p": {}}]}, "m": "}"}'
    local v = assert(json.decode(text))
    local order = json.key_order(text, v)
    assert.same({ "z", "a", "m" }, order[v])
    assert.same({ "y", "x" }, order[v.a])
    assert.same({ "q", "p" }, order[v.a.x[1]])
    assert.same({}, order[v.a.x[1].p])
  end)

  it("a repeated key keeps its first place and the last value's keys (as Python's json.loads)", function()
    -- Python: list(json.loads(text)) == ["z", "a"]; json.loads(text)["z"] == [{"d": 1, "c": 2}]
    local text = '{"z": [{"b": 1, "a": null}, [], {}], "a": 1, "z": [{"d": 1, "c": 2}]}'
    local v = assert(json.decode(text))
    local order = json.key_order(text, v)
    assert.same({ "z", "a" }, order[v])
    assert.same({ "d", "c" }, order[v.z[1]])
  end)
end)

describe("jsonl shards", function()
  it("parses i/n with 0 <= i < n", function()
    assert.same({ index = 1, count = 4 }, jsonl.parse_shard("1/4"))
    for _, bad in ipairs { "4/4", "1", "a/b", "-1/2", "1/0" } do
      local v, err = jsonl.parse_shard(bad)
      assert.is_nil(v, bad)
      assert.matches("shard", err)
    end
  end)

  it("gives line k of N to shard floor(k * n / N): contiguous ranges in order", function()
    -- 10 lines in 3 shards: k*3//10 = 0,0,0,0,1,1,1,2,2,2 for k = 0..9
    local ranges = {}
    for i = 0, 2 do ranges[#ranges + 1] = { jsonl.shard_range(10, { index = i, count = 3 }) } end
    assert.same({ { 1, 4 }, { 5, 7 }, { 8, 10 } }, ranges)
    -- more shards than lines: some shards are empty (first > last)
    local f, l = jsonl.shard_range(2, { index = 1, count = 4 })
    assert.is_true(f > l)
  end)

  it("covers every line exactly once, for many sizes", function()
    for N = 0, 23 do
      for n = 1, 7 do
        local next_line = 1
        for i = 0, n - 1 do
          local first, last = jsonl.shard_range(N, { index = i, count = n })
          assert.equals(next_line, first)
          for k = first, last do assert.equals(i, (k - 1) * n // N) end
          next_line = math.max(next_line, last + 1)
        end
        assert.equals(N + 1, next_line)
      end
    end
  end)
end)

describe("jsonl.open", function()
  it("yields each object with its line number; bad lines come with a message and the rest go on", function()
    local path = files.write_temp('{"id": 1}\n\nnot json\n[1]\n{"id": 5}\n')
    local seen = {}
    local r = assert(jsonl.open(path, { on_error = function(line, msg) seen[#seen + 1] = line .. ":" .. msg end }))
    local items = {}
    for line, item, err in r:items() do items[#items + 1] = { line, item and item.id or err } end
    os.remove(path)
    assert.same({ { 1, 1 }, { 3, "malformed JSON: unexpected character 'n' at byte 1" },
      { 4, "expected a JSON object" }, { 5, 5 } }, items)
    assert.same({ "3:malformed JSON: unexpected character 'n' at byte 1", "4:expected a JSON object" }, seen)
    assert.equals(2, #r.errors)
    assert.equals(5, r.lines)
  end)

  it("reads only its shard's lines", function()
    local path = files.write_temp('{"k":1}\n{"k":2}\n{"k":3}\n{"k":4}\n{"k":5}\n')
    local got = {}
    for i = 0, 1 do
      local r = assert(jsonl.open(path, { shard = { index = i, count = 2 } }))
      local ks = {}
      for _, item in r:items() do ks[#ks + 1] = item.k end
      got[#got + 1] = ks
      assert.equals(#ks, r:count_items())
    end
    os.remove(path)
    assert.same({ { 1, 2, 3 }, { 4, 5 } }, got)
  end)

  it("returns nil and a message for a missing file", function()
    local r, err = jsonl.open("/nonexistent/dir/in.jsonl")
    assert.is_nil(r)
    assert.matches("in.jsonl", err, 1, true)
  end)
end)

describe("progress", function()
  local function sink()
    local buf = {}
    return { write = function(self, ...) for _, s in ipairs { ... } do buf[#buf + 1] = s end return self end,
      flush = function() end, text = function() return table.concat(buf) end }
  end

  it("in lines mode prints a line every tenth of the work and a summary", function()
    local out = sink()
    local p = progress.new { total = 20, label = "items", mode = "lines", stream = out }
    for i = 1, 20 do p:update(i) end
    p:finish("done")
    local lines = {}
    for l in out.text():gmatch("[^\n]+") do lines[#lines + 1] = l end
    assert.equals(10, #lines) -- 2, 4, ..., 18 of 20, then "done"
    assert.equals("progress: 2/20 items", lines[1])
    assert.equals("done", lines[10])
  end)

  it("in bar mode redraws one line in place", function()
    local out = sink()
    local p = progress.new { total = 4, label = "items", mode = "bar", stream = out, width = 4 }
    p:update(1)
    p:update(4, "9 tok/s")
    p:finish()
    assert.equals("\r[#...] 1/4 items  25%\27[K\r[####] 4/4 items 100%  9 tok/s\27[K\n", out.text())
  end)

  it("off prints nothing; an unknown mode raises", function()
    local out = sink()
    local p = progress.new { total = 4, mode = "off", stream = out }
    p:update(4)
    p:finish("done")
    assert.equals("", out.text())
    assert.has_error(function() progress.new { mode = "fancy" } end)
  end)
end)
