#!/usr/bin/env lua5.4
-- scripts/perplexity.lua — perplexity of a model on a text file, with the
-- method of llama.cpp's perplexity tool (see luamod/kvlua/eval.lua).
-- Shows the running estimate on stderr; prints the result on stdout.
local usage = [[
usage: lua5.4 scripts/perplexity.lua --file TEXT [--model PATH] [--ctx 512] [--batch 128]
                                     [--chunks N] [--ktype T] [--vtype T] [--threads N] [--json] [--quiet]
  --batch N   tokens per forward pass (bounds the logits buffer: N x vocabulary floats)
  --ktype T   K/V cache storage: f16 (default), f32, q8_0, q4_0, or per layer:
  --vtype T   "q8_0,0=f16,1=f16" (a default, then 0-based layer=type overrides)
]]
local common = dofile((arg[0]:match("^(.*)/") or ".") .. "/common.lua")
local o = common.parse(arg, {
  model = "", file = "", ctx = 512, batch = 128, chunks = 0, threads = 0, json = false, quiet = false,
  ktype = "f16", vtype = "f16",
}, usage)
if o.file == "" then common.die(usage) end

local f, ferr = io.open(o.file, "rb")
if not f then common.die(ferr) end
local text = f:read("a")
f:close()

local eval = require "kvlua.eval"
local model = common.load(common.model_path(o.model), o.threads, o.backend, o.device)
local ids = model:tokenize(text, { add_special = true, parse_special = false })
local r, err = eval.perplexity(model, ids, {
  ctx = math.tointeger(o.ctx), batch = math.tointeger(o.batch),
  chunks = o.chunks > 0 and math.tointeger(o.chunks) or nil,
  ktype = common.kv_types(o.ktype), vtype = common.kv_types(o.vtype),
  progress = not o.quiet and function(c, n, ppl)
    io.stderr:write(string.format("\rchunk %d/%d  ppl %.4f", c, n, ppl))
    if c == n then io.stderr:write("\n") end
  end or nil,
})
if not r then common.die(err) end
if o.json then
  print(string.format('{"ppl":%.6f,"chunks":%d,"ctx":%d,"tokens":%d,"scored":%d,"ktype":"%s","vtype":"%s"}', r.ppl,
    #r.chunks, r.ctx, #ids, r.count, o.ktype, o.vtype))
else
  print(string.format("perplexity %.4f over %d chunks of %d tokens (%d tokens in the text, %d scored)",
    r.ppl, #r.chunks, r.ctx, #ids, r.count))
end
