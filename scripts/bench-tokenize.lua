-- bench-tokenize.lua — tokenization speed (MB/s) on the real models.
--
--   lua5.4 scripts/bench-tokenize.lua [--ref] [--mb N] [--repeats N]
--
-- The text is the repository's tracked source and documentation files
-- (git ls-files, sorted), concatenated and repeated up to N MB (default 1),
-- so it mixes English, code and a little non-ASCII. Each model tokenizes it
-- whole (add_special = false, parse_special = false), best of --repeats
-- (default 3) by CPU time. With --ref the same text goes through llama.cpp
-- (scripts/ref/bench_tokenize_ref.py, needs python3 and the xllamacpp wheel)
-- and its MB/s and token count are printed beside ours.
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

local p = cli.parser("Tokenization speed (MB/s) on the real models.")
p:flag("--ref", "also run llama.cpp's tokenizer on the text (scripts/ref/bench_tokenize_ref.py)")
p:num("--mb", "N", "megabytes of text", 1, 1e-6, 4096)
p:int("--repeats", "N", "runs per model (the best counts)", 3, 1, 1000)
local opts = p:parse()
local kvlua = require "kvlua"

local function q(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local function sh(cmd)
  local p = assert(io.popen(cmd))
  local out = p:read("a")
  p:close()
  return out
end

-- the corpus
local parts, size = {}, 0
for path in sh("git -C " .. q(root) .. " ls-files '*.c' '*.h' '*.lua' '*.md' '*.py' '*.sh' | sort"):gmatch("[^\n]+") do
  local f = io.open(root .. "/" .. path, "rb")
  if f then
    local s = f:read("a")
    f:close()
    parts[#parts + 1] = s
    size = size + #s
  end
end
if size == 0 then cli.die("no text files found (the script runs from a git checkout)", 1) end
local want = math.floor(opts.mb * 1e6)
local text = table.concat(parts)
local chunks = { text }
while #text * #chunks < want do chunks[#chunks + 1] = text end
text = table.concat(chunks):sub(1, math.max(want, 1))
local corpus = os.tmpname()
do
  local f = assert(io.open(corpus, "wb"))
  f:write(text)
  f:close()
end
cli.print(("text: %.2f MB from %d files (%s)"):format(#text / 1e6, #parts, corpus))

local function bench(model)
  local best, n = math.huge, 0
  for _ = 1, opts.repeats do
    local t0 = os.clock()
    local ids = model:tokenize(text, { add_special = false, parse_special = false })
    local dt = os.clock() - t0
    n = #ids
    if dt < best then best = dt end
  end
  return #text / 1e6 / best, n, best
end

for _, name in ipairs({ "smollm2", "gemma3" }) do
  local path = sh(q(root .. "/scripts/fetch-models.sh") .. " " .. name .. " 2>/dev/null"):match("[^\n]+")
  if not path then
    cli.print(name .. ": model not available")
  else
    local t0 = os.clock()
    local model, err = kvlua.load(path)
    if not model then cli.die(err, 1) end
    local load_s = os.clock() - t0
    local mbs, n, secs = bench(model)
    local line = ("%-8s kvlua %7.2f MB/s  %8d tokens  %.3f s   (model load %.0f ms)"):format(name, mbs, n, secs, load_s * 1e3)
    if opts.ref then
      local out = sh(("python3 %s %s %s %d 2>/dev/null"):format(q(root .. "/scripts/ref/bench_tokenize_ref.py"), q(path),
        q(corpus), opts.repeats))
      local rmbs, rn = out:match("^(%S+) (%S+)")
      if rmbs then
        line = line .. ("\n%-8s llama.cpp %5.2f MB/s  %8d tokens  (%s)"):format("", tonumber(rmbs), math.tointeger(tonumber(rn)),
          math.tointeger(tonumber(rn)) == n and "same count" or "DIFFERENT count")
      else
        line = line .. "\n         llama.cpp: reference run failed"
      end
    end
    cli.print(line)
    model:close()
  end
end
os.remove(corpus)
cli.exit(0)
