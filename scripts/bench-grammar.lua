#!/usr/bin/env lua5.4
-- scripts/bench-grammar.lua — constrained against unconstrained decode
-- speed, side by side: the same prompt, the same number of tokens, greedy,
-- through s:generate (with and without grammar =), taking turns inside
-- every repetition; figures are medians over --reps.
--
--   lua5.4 scripts/bench-grammar.lua [--model PATH] [--grammar json|story|FILE] [--max-tokens 128]
--
-- tok/s counts the generated tokens over the wall time of the generate loop
-- after the prefill (forward passes, sampling and, when constrained, the
-- masks). Greedy (the default) checks the argmax against the grammar first
-- and computes a mask only when the grammar refuses it; --temp T samples
-- (llama.cpp's default chain), which needs the whole mask at every token. Both runs keep going past end-of-generation tokens
-- (ignore_eog), so they have the same length; "open" is how many of the
-- constrained tokens came before the grammar could end (after that, only
-- EOG is allowed and a mask is trivial). Each constrained run compiles the
-- grammar afresh, so its automaton and mask cache start empty (a first
-- generation with that grammar; the vocabulary's trie is built once per
-- model, before the first run); the mask cache figures are the last run's.
--
-- --ref also runs llama.cpp (scripts/ref/bench_grammar_ref.py, through
-- llama-cpp-python's Llama.generate and LlamaGrammar) on the same model,
-- grammar, prompt, token count and sampling, constrained and unconstrained,
-- at each of --ref-threads (OMP_WAIT_POLICY=PASSIVE), and prints its best
-- figures beside kvlua's with the ratios kvlua / llama.cpp.
local root = (arg[0]:match("^(.*)/[^/]*$") or ".") .. "/.."
package.path = root .. "/luamod/?.lua;" .. root .. "/luamod/?/init.lua;" .. package.path
package.cpath = (os.getenv("KVLUA_BUILD") or root .. "/build") .. "/?.so;" .. package.cpath
local cli = require "kvlua.util.cli"

-- grammars by name: json, llama.cpp's grammars/json.gbnf, is in tests/data
local GRAMMAR_FILES = { json = root .. "/tests/data/json.gbnf" }
local GRAMMARS = {
  -- free text inside a JSON string that cannot close before 600 characters:
  -- nearly every token allowed, and each step a new automaton state (a
  -- count of characters), so no mask comes from the cache: the costliest case
  story = [[
root ::= "{\"story\": \"" char{600,} "\"}"
char ::= [^"\\\x00-\x1F] | "\\" ["\\nt]
]],
}

local PROMPTS = {
  json = "Here is a JSON object describing three cats, with their names, ages, colours and favourite toys:\n",
  story = "Write a long story about a lighthouse keeper, as JSON with a title and the story:\n",
}

local p = cli.parser("Constrained (grammar) against unconstrained decode speed, side by side.")
p:str("--grammar", "NAME|FILE", "json, story, or a GBNF file", "json", true)
p:str("--prompt", "TEXT", "the prompt (default: one that suits the grammar)", nil, true)
p:int("--max-tokens", "N", "tokens generated per run", 128, 1, 4096)
p:int("--reps", "N", "repetitions (the median is reported)", 3, 1, 100)
p:num("--temp", "T", "0: greedy (the argmax is checked first, masks only when refused); > 0: sampled\n" ..
  "(sampling.from_opts{temp = T, seed = 1}: a full mask every token)", 0, 0, 10)
p:model_options()
p:flag("--ref", "also measure llama.cpp (llama-cpp-python) and print the ratios kvlua / llama.cpp")
p:str("--ref-threads", "LIST", "llama.cpp thread counts to try, the best reported", "1,2", true)
p:flag("--json", "print the figures as one JSON object")
local o = p:parse()

local kvlua = require "kvlua"
local sampling = require "kvlua.sampling"
local text = GRAMMARS[o.grammar] or cli.read_file(GRAMMAR_FILES[o.grammar] or o.grammar, "--grammar FILE")
local prompt = o.prompt or PROMPTS[o.grammar] or PROMPTS.json
local model = cli.load(o)
local g, err = kvlua.grammar(text)
if not g then cli.die("grammar: " .. err) end
local ids = model:tokenize(prompt, { add_special = true })

local last_stats
g:state(model) -- builds the vocabulary's trie once
local function run(constrained)
  local s = model:session{ ctx = #ids + o.max_tokens + 8 }
  assert(s:prefill(ids))
  local n, open = 0, nil
  local gr = constrained and assert(kvlua.grammar(text))
  local st = constrained and gr:state(model)
  local t0 = kvlua.clock()
  local sampler = o.temp > 0 and sampling.from_opts{ temp = o.temp, seed = 1 } or nil
  for _ in s:generate{ max_tokens = o.max_tokens, grammar = gr or nil, ignore_eog = true, sampler = sampler,
                       on_token = function(id)
                         n = n + 1
                         if st and open == nil then
                           if st:accept(id) == nil or st:can_end() then open = n end
                         end
                       end } do
  end
  local dt = kvlua.clock() - t0
  local why = s.finish_reason
  s:close()
  if st then last_stats = st:stats() end
  return n / dt, n, open or n, why
end

local free, cons, open_n, why_c = {}, {}, {}, nil
for rep = 1, o.reps do
  for k = 0, 1 do -- alternate which goes first
    local constrained = (rep + k) % 2 == 0
    local rate, n, open, why = run(constrained)
    if constrained then
      cons[#cons + 1] = rate
      open_n[#open_n + 1] = open
      why_c = why
    else
      free[#free + 1] = rate
    end
    assert(n == o.max_tokens, "generated " .. n .. " tokens, not " .. o.max_tokens .. " (" .. tostring(why) .. ")")
  end
end
local stats = last_stats
local info = model.info
local res = {
  model = info.name ~= "" and info.name or info.arch, n_vocab = info.n_vocab, grammar = o.grammar, temp = o.temp,
  tokens = o.max_tokens, reps = o.reps,
  unconstrained_tok_s = cli.median(free), constrained_tok_s = cli.median(cons),
  ratio = cli.median(cons) / cli.median(free), open_tokens = cli.median(open_n),
  masks = stats.masks, mask_hits = stats.mask_hits, automaton_states = stats.states, finish_reason = why_c,
}
if o.ref then
  local json = require "kvlua.json"
  local gfile = os.tmpname()
  local f = assert(io.open(gfile, "wb"))
  f:write(text)
  f:close()
  local q = function(x) return "'" .. tostring(x):gsub("'", "'\\''") .. "'" end
  local cmd = table.concat({ "python3", q(root .. "/scripts/ref/bench_grammar_ref.py"), q(o.model), "--grammar-file",
    q(gfile), "--prompt", q(prompt), "--max-tokens", o.max_tokens, "--reps", o.reps, "--temp", o.temp,
    "--threads", q(o.ref_threads), "--json" }, " ")
  local pipe = assert(io.popen(cmd, "r"))
  local out = pipe:read("a")
  local ok = pipe:close()
  os.remove(gfile)
  if not ok then cli.die("the llama.cpp reference failed: " .. cmd) end
  local ref = json.decode(out)
  res.llama_cpp = ref
  res.threads = model.info.threads
  res.unconstrained_vs_llama_cpp = res.unconstrained_tok_s / ref.unconstrained_tok_s
  res.constrained_vs_llama_cpp = res.constrained_tok_s / ref.constrained_tok_s
end
if o.json then
  cli.print(require("kvlua.json").encode(res))
else
  cli.print(("%s (vocab %d), grammar %s, %s, %d tokens, median of %d:"):format(res.model, res.n_vocab, res.grammar,
    o.temp > 0 and ("temp " .. o.temp) or "greedy", res.tokens, res.reps))
  cli.print(("  unconstrained %.1f tok/s   constrained %.1f tok/s   ratio %.3f"):format(res.unconstrained_tok_s,
    res.constrained_tok_s, res.ratio))
  cli.print(("  open (before the grammar could end) %d of %d tokens; masks %d, from the cache %d; %d automaton states")
    :format(res.open_tokens, res.tokens, res.masks, res.mask_hits, res.automaton_states))
end
if res.llama_cpp and not o.json then
  local ref = res.llama_cpp
  cli.print(("  llama.cpp %s (best of threads %s): unconstrained %.1f tok/s (%d threads)   constrained %.1f tok/s"
    .. " (%d threads)   ratio %.3f"):format(ref.llama_cpp_python, o.ref_threads, ref.unconstrained_tok_s,
    ref.unconstrained_threads, ref.constrained_tok_s, ref.constrained_threads, ref.ratio))
  cli.print(("  kvlua (%d threads) / llama.cpp: unconstrained %.2f   constrained %.2f"):format(res.threads,
    res.unconstrained_vs_llama_cpp, res.constrained_vs_llama_cpp))
end
