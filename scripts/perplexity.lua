#!/usr/bin/env lua5.4
-- scripts/perplexity.lua — perplexity of a model on a text file, with the
-- method of llama.cpp's perplexity tool (see luamod/kvlua/eval.lua).
-- Shows the running estimate on stderr; prints the result on stdout.
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local p = cli.parser("Perplexity of a model on a text file (llama.cpp's method).")
p:str("--file", "TEXT", "the text file", nil, true)
p:model_options()
p:ctx_option(512)
p:int("--batch", "N", "tokens per forward pass (bounds the logits buffer: N x vocabulary floats)", 128, 1, cli.MAX_CTX)
p:int("--chunks", "N", "chunks scored at most; 0 = all", 0, 0)
p:kv("--ktype", "K cache storage: f16, f32, q8_0, q4_0, or per layer 'q8_0,0=f16,1=f16' "
  .. "(a default, then 0-based layer=type overrides)", "f16")
p:kv("--vtype", "V cache storage, as --ktype", "f16")
p:flag("--json", "print the result as one JSON object")
p:flag("--quiet", "no running estimate on stderr")
local o = p:parse()
if not o.file then
  io.stderr:write(cli.prog, ": missing --file TEXT\n", p.ap:get_usage(), "\n")
  os.exit(2)
end
local text = cli.read_file(o.file, "--file TEXT")

local eval = require "kvlua.eval"
local model = cli.load(o)
local ktype, vtype = cli.check_kv(model, o.ktype, "--ktype"), cli.check_kv(model, o.vtype, "--vtype")
local ids = model:tokenize(text, { add_special = true, parse_special = false })
local r, err = eval.perplexity(model, ids, {
  ctx = o.ctx, batch = o.batch, chunks = o.chunks > 0 and o.chunks or nil, ktype = ktype, vtype = vtype,
  progress = not o.quiet and function(c, n, ppl)
    io.stderr:write(string.format("\rchunk %d/%d  ppl %.4f", c, n, ppl))
    if c == n then io.stderr:write("\n") end
  end or nil,
})
if not r then cli.die(err, 1) end
if o.json then
  cli.print(string.format('{"ppl":%.6f,"chunks":%d,"ctx":%d,"tokens":%d,"scored":%d,"ktype":"%s","vtype":"%s"}', r.ppl,
    #r.chunks, r.ctx, #ids, r.count, cli.kv_text(o.ktype), cli.kv_text(o.vtype)))
else
  cli.print(string.format("perplexity %.4f over %d chunks of %d tokens (%d tokens in the text, %d scored)",
    r.ppl, #r.chunks, r.ctx, #ids, r.count))
end
cli.exit(0)
