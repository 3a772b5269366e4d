#!/usr/bin/env python3
"""Generate reference fixtures from llama.cpp (via llama-cpp-python) for the real models.

    python3 scripts/ref/gen-fixtures.py [--models smollm2,gemma3] [--only tokens,logits,ppl]

Writes, for each model <m> in {smollm2, gemma3} (paths from scripts/fetch-models.sh):

  tests/fixtures/ref_tokens_<m>.lua  tokenizer cases: text bytes, add_special,
                                     parse_special -> ids (+ detokenized bytes)
  tests/fixtures/ref_logits_<m>.lua  prompts -> ids, top-20 (id, logit) of the last
                                     position, stats of the full vector, 32-token
                                     greedy continuation (+ top1-top2 margin per step)
  tests/fixtures/ref_ppl_<m>.lua     perplexity of tests/data/public-domain.txt,
                                     llama-perplexity's method, per-chunk values

Deterministic: greedy decoding, fixed inputs, 2 threads. Re-running it with the
same reference version reproduces the files (up to last-digit float noise if the
thread count or batch size changes).
"""

import argparse
import hashlib
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import refimpl  # noqa: E402
from luaser import write_fixture  # noqa: E402

N_THREADS = 2
LOGITS_N_CTX = 2048     # big enough for the longest prompt + 32 new tokens
TOP_K = 20
N_GREEDY = 32
PPL_N_CTX = 512
PPL_TEXT = "tests/data/public-domain.txt"


def model_path(name):
    out = subprocess.run([os.path.join(ROOT, "scripts", "fetch-models.sh"), name],
                         check=True, capture_output=True, text=True).stdout.strip()
    return out.splitlines()[-1]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


# ---------------------------------------------------------------------------
# Tokenizer cases
# ---------------------------------------------------------------------------

TOKEN_TEXTS = [
    # plain English, casing, punctuation
    "Hello, world!",
    "hello world",
    "HELLO World hElLo",
    " leading space",
    "trailing space ",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they're right; we've done it, she'd say, and I'D agree. Can't won't don't.",
    # whitespace runs
    "",
    " ",
    "  two spaces and   three   and    four",
    "tabs\tand\t\tdouble\ttabs",
    "line1\nline2\n\nline4\n",
    "windows\r\nline\r\nendings\r\n",
    "\n\n\n",
    "   \n\t  \r\n   mixed\t \n",
    "                                                                end",
    # numbers
    "1234567890 3.14159 -42 1e10 0x1F 1,000,000 2024-01-31 12:30:45",
    "0 00 000 0000 00000 123456789012345",
    # code
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "local t = { a = 1, [\"b\"] = 2 } -- comment\nfor k, v in pairs(t) do print(k, v) end",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "x += y**2 // 3; a != b && c <= d || e >= f >>= 1",
    # URLs, emails, paths
    "https://example.com/path/to/page?query=1&b=two#frag",
    "user.name+tag@example.org /usr/local/bin/lua5.4 C:\\Windows\\System32",
    # multilingual
    "Le cœur a ses raisons que la raison ne connaît point. À bientôt, garçon !",
    "Größenwahnsinnige Straßenbahnhaltestelle über Äpfel und Öl.",
    "我爱自然语言处理。今天天气很好！",
    "こんにちは、世界。カタカナとひらがなと漢字。",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "مرحبا بالعالم. اللغة العربية جميلة.",
    "नमस्ते दुनिया। हिन्दी भाषा सुंदर है।",
    "안녕하세요 세계",
    "Ελληνικά: αβγδε ΑΒΓΔΕ",
    "∑ᵢ xᵢ² ≤ ∞, ∀ε>0 ∃δ: λ→0 ⇒ ‖f‖ ≈ 0",
    # emoji and combining sequences
    "I ❤️ 🦙 and 🚀🔥!",
    "Family: 👨‍👩‍👧‍👦, flag: 🏳️‍🌈, thumbs: 👍🏽, keycap: 1️⃣",
    "e\u0301 vs \u00e9, n\u0303, \u0915\u094d\u0937",
    # repetition
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "!!!!!!!!!! ................ ----------",
    # chat markup and special-token text
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<|endoftext|>text<|endoftext|>",
    "<bos>hello<eos>",
    "<unk><pad> <mask>",
    # invalid UTF-8 and control bytes (kept as raw bytes)
    b"\xff\xfe",
    b"abc\x80def",
    b"\xc3\x28 bad two-byte",
    b"truncated euro \xe2\x82",
    b"truncated emoji \xf0\x9f\x98",
    b"surrogate \xed\xa0\x80 half",
    b"overlong \xc0\xaf slash",
    b"nul\x00inside",
    b"\x01\x02\x7f controls",
]


def gen_tokens(ref, mname, mpath, out):
    cases = []
    for t in TOKEN_TEXTS:
        b = t.encode("utf-8") if isinstance(t, str) else t
        for add_special in (False, True):
            for parse_special in (False, True):
                ids = ref.tokenize(b, add_special, parse_special)
                cases.append({
                    "text": b,
                    "add_special": add_special,
                    "parse_special": parse_special,
                    "ids": ids,
                    "detok": ref.detokenize(ids, remove_special=False, unparse_special=True),
                })
    header = [
        "Generated by scripts/ref/gen-fixtures.py from %s; do not edit." % refimpl.version(),
        "model: %s (sha256 %s)" % (os.path.basename(mpath), sha256(mpath)),
        "Each case: text (raw bytes), add_special, parse_special -> ids (0-based GGUF ids,",
        "llama_tokenize), detok = llama_detokenize(ids, remove_special=false, unparse_special=true).",
    ]
    write_fixture(out, header, {
        "model": os.path.basename(mpath),
        "reference": refimpl.version(),
        "add_bos": ref.add_bos, "bos": ref.bos, "eos": ref.eos, "n_vocab": ref.n_vocab,
        "cases": cases,
    })
    return len(cases)


# ---------------------------------------------------------------------------
# Logits and greedy continuation
# ---------------------------------------------------------------------------

LONG_EN = (
    "The lighthouse keeper had lived on the island for thirty-one years, and in all that time "
    "he had never once let the lamp go dark. Every evening he climbed the one hundred and "
    "twelve iron steps, trimmed the wick, polished the great brass-bound lens with a soft "
    "cloth, and wound the clockwork that turned it through the night. Ships he would never "
    "meet passed by in the dark, their captains counting the flashes to know where they were. "
    "In winter the storms came in from the north-east and threw spray against the windows of "
    "the lamp room, and he would sit with his back to the warm glass, listening to the sea and "
    "writing in the log book: wind, visibility, ships sighted, oil consumed. One spring morning "
    "a letter arrived with the supply boat. It said that the lighthouse was to be automated, "
    "and that his services would no longer be required after the end of the summer. He read it "
    "twice, folded it carefully, and put it in the drawer with the others. Then he went out to"
)


def logit_prompts(mname, ref):
    if mname == "smollm2":
        chat = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n"
                "<|im_start|>assistant\n")
        chat2 = ("<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n")
    else:
        chat = ("<start_of_turn>user\nWhat is the capital of France? Answer in one word.<end_of_turn>\n"
                "<start_of_turn>model\n")
        chat2 = "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n"
    with open(os.path.join(ROOT, PPL_TEXT), "rb") as f:
        pd = f.read()
    very_long = pd[:3000].decode("utf-8", errors="ignore")
    return [
        ("short", "The capital of France is", False),
        ("one_word", "Hello", False),
        ("story", "Once upon a time, in a small village", False),
        ("long_200", LONG_EN, False),
        ("chat", chat, True),
        ("chat_haiku", chat2, True),
        ("code_py", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
        ("code_lua", "-- Lua: sum the elements of an array\nlocal function sum(t)\n", False),
        ("french", "La capitale de l'Allemagne est", False),
        ("chinese", "中国的首都是", False),
        ("numbers", "1, 2, 3, 4, 5, 6, 7,", False),
        ("very_long_declaration", very_long, False),
    ]


def topk(v, k):
    idx = np.argsort(-v.astype(np.float64), kind="stable")[:k]
    return [int(i) for i in idx], [float(v[i]) for i in idx]


def gen_logits(ref, mname, mpath, out):
    prompts = []
    import np_llama
    exact = np_llama.load(mpath)     # llama and gemma3; SystemExit for other archs
    for name, text, parse_special in logit_prompts(mname, ref):
        ids = ref.tokenize(text, add_special=True, parse_special=parse_special)
        ref.clear()
        logits = ref.eval(ids)
        tids, tvals = topk(logits, TOP_K)
        lv = logits.astype(np.float64)
        m = lv.max()
        lse = m + np.log(np.exp(lv - m).sum())
        # greedy continuation, recording the top1-top2 margin at each step
        cont, margins = [], []
        cur = logits
        for _ in range(N_GREEDY):
            i2, v2 = topk(cur, 2)
            cont.append(i2[0])
            margins.append(v2[0] - v2[1])
            cur = ref.eval([i2[0]])
        extra = {}
        if exact is not None:
            ev = exact.forward(ids)[-1]
            eids, evals = topk(ev, TOP_K)
            etop, emargin = np_llama.greedy_margins(exact, ids, cont)
            extra = {"exact_top_ids": eids, "exact_top_logits": evals,
                     "exact_greedy_top": etop, "exact_greedy_margin": emargin}
        prompts.append({
            "name": name,
            "text": text,
            "add_special": True,
            "parse_special": parse_special,
            "ids": ids,
            "top_ids": tids,
            "top_logits": tvals,
            "logits_mean": float(lv.mean()),
            "logits_std": float(lv.std()),
            "logsumexp": float(lse),
            "logits_first8": [float(x) for x in logits[:8]],
            "greedy": cont,
            "greedy_margin": margins,
            "greedy_text": ref.detokenize(cont, remove_special=False, unparse_special=True),
            **extra,
        })
    header = [
        "Generated by scripts/ref/gen-fixtures.py from %s; do not edit." % refimpl.version(),
        "model: %s (sha256 %s)" % (os.path.basename(mpath), sha256(mpath)),
        "Per prompt: ids = llama_tokenize(text, add_special=true, parse_special as given);",
        "top_ids/top_logits = the %d largest raw logits of the last prompt position (descending);" % TOP_K,
        "logits_mean/std/logsumexp over the full vector; greedy = %d argmax tokens (no penalties," % N_GREEDY,
        "EOG not special-cased), greedy_margin[i] = top1 - top2 logit before greedy[i] was chosen.",
        "n_ctx %d, %d threads, one sequence, F16 KV cache (llama.cpp default)." % (LOGITS_N_CTX, N_THREADS),
        "exact_top_ids/exact_top_logits: the top-%d logits of a float64 numpy forward pass over the" % TOP_K,
        "dequantized weights (scripts/ref/np_llama.py, no activation quantization, no F16 KV): an",
        "independent check. llama.cpp differs from it by up to a few tenths in logit, so compare",
        "with tolerances (top-1, top-k overlap, greedy up to the first small margin), not bits.",
        "exact_greedy_top/exact_greedy_margin: the float64 pass teacher-forced over ids + greedy: its",
        "top-1 id and top1 - top2 logit before greedy[i] (added by scripts/ref/add-exact-greedy.py).",
        "A greedy step is a clear choice only if both margins are large and both top-1s agree.",
    ]
    write_fixture(out, header, {
        "model": os.path.basename(mpath),
        "reference": refimpl.version(),
        "n_ctx": LOGITS_N_CTX,
        "n_threads": N_THREADS,
        "n_vocab": ref.n_vocab,
        "prompts": prompts,
    })
    return len(prompts)


# ---------------------------------------------------------------------------
# Perplexity (llama-perplexity's default method)
# ---------------------------------------------------------------------------

def gen_ppl(ref, mname, mpath, out):
    text_path = os.path.join(ROOT, PPL_TEXT)
    with open(text_path, "rb") as f:
        text = f.read()
    tokens = ref.tokenize(text, add_special=True, parse_special=False)
    n_ctx = PPL_N_CTX
    first = n_ctx // 2
    n_chunk = len(tokens) // n_ctx
    chunks, nll_total, count = [], 0.0, 0
    t0 = time.time()
    for i in range(n_chunk):
        start = i * n_ctx
        batch = list(tokens[start:start + n_ctx])
        if ref.add_bos:
            batch[0] = ref.bos
        ref.clear()
        rows = ref.eval(batch, all_logits=True, first_output=first)  # (n_ctx - first, n_vocab)
        lg = rows[:n_ctx - 1 - first].astype(np.float64)  # positions first .. n_ctx-2
        tgt = np.array(tokens[start + first + 1:start + n_ctx])
        m = lg.max(axis=1, keepdims=True)
        lse = (m[:, 0] + np.log(np.exp(lg - m).sum(axis=1)))
        nll = lse - lg[np.arange(len(tgt)), tgt]
        nll_total += float(nll.sum())
        count += len(tgt)
        chunks.append({
            "nll_sum": float(nll.sum()),
            "ppl": float(np.exp(nll.mean())),
            "ppl_cumulative": float(np.exp(nll_total / count)),
        })
    elapsed = time.time() - t0
    ppl = float(np.exp(nll_total / count))
    header = [
        "Generated by scripts/ref/gen-fixtures.py from %s; do not edit." % refimpl.version(),
        "model: %s (sha256 %s)" % (os.path.basename(mpath), sha256(mpath)),
        "text: %s (sha256 %s)" % (PPL_TEXT, sha256(text_path)),
        "Method (llama-perplexity default, no stride): tokens = tokenize(whole file, add_special=true,",
        "parse_special=false); n_chunk = floor(#tokens / n_ctx); chunk i = tokens[i*n_ctx+1 .. (i+1)*n_ctx]",
        "(1-based) evaluated from an empty KV cache at positions 0..n_ctx-1, with its first token",
        "replaced by BOS when the vocab's add_bos is true. Scored: the logits of positions",
        "n_ctx/2 .. n_ctx-2 (0-based) predicting the next token, i.e. n_ctx/2 - 1 tokens per chunk;",
        "nll = logsumexp(logits) - logits[target] (float64). ppl = exp(sum nll / count) over all",
        "chunks; per chunk: nll_sum, ppl of that chunk alone, cumulative ppl (as llama-perplexity prints).",
    ]
    write_fixture(out, header, {
        "model": os.path.basename(mpath),
        "reference": refimpl.version(),
        "text": PPL_TEXT,
        "text_sha256": sha256(text_path),
        "n_tokens": len(tokens),
        "first_ids": tokens[:16],
        "n_ctx": n_ctx,
        "n_batch": n_ctx,
        "add_bos": ref.add_bos,
        "bos": ref.bos,
        "scored_per_chunk": n_ctx - 1 - first,
        "n_chunks": n_chunk,
        "count": count,
        "nll_sum": nll_total,
        "ppl": ppl,
        "chunks": chunks,
    }, digits=12)
    return ppl, n_chunk, len(tokens), elapsed


# ---------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description="generate llama.cpp reference fixtures")
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--only", default="tokens,logits,ppl")
    ap.add_argument("--outdir", default=os.path.join(ROOT, "tests", "fixtures"))
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    only = set(a.only.split(","))
    for mname in a.models.split(","):
        mpath = model_path(mname)
        if "tokens" in only or "logits" in only:
            with refimpl.Ref(mpath, n_ctx=LOGITS_N_CTX, n_threads=N_THREADS, n_batch=512) as ref:
                if "tokens" in only:
                    out = os.path.join(a.outdir, "ref_tokens_%s.lua" % mname)
                    n = gen_tokens(ref, mname, mpath, out)
                    print("%s: %d token cases -> %s" % (mname, n, out))
                if "logits" in only:
                    out = os.path.join(a.outdir, "ref_logits_%s.lua" % mname)
                    n = gen_logits(ref, mname, mpath, out)
                    print("%s: %d logit prompts -> %s" % (mname, n, out))
        if "ppl" in only:
            with refimpl.Ref(mpath, n_ctx=PPL_N_CTX, n_threads=N_THREADS, n_batch=PPL_N_CTX) as ref:
                out = os.path.join(a.outdir, "ref_ppl_%s.lua" % mname)
                ppl, nc, nt, el = gen_ppl(ref, mname, mpath, out)
                print("%s: ppl %.4f over %d chunks of %d (%d tokens, %.1fs) -> %s"
                      % (mname, ppl, nc, PPL_N_CTX, nt, el, out))


if __name__ == "__main__":
    main()
