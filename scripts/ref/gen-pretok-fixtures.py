#!/usr/bin/env python3
"""Generate tests/fixtures/pretok_cases.txt: expected pre-tokenizer splits.

The expected splits come from a Python model of llama.cpp's
unicode_regex_split(), NOT from kvlua's C code:

  * the regex lists per tokenizer.ggml.pre family, verbatim from
    llama.cpp src/llama-vocab.cpp (llm_tokenizer_bpe);
  * each regex re-splits every piece left by the previous one; matches
    and the text between matches both become pieces (unicode_regex_split_stl);
  * a regex with \\p{..} runs on the "collapsed" text (ASCII kept, other
    codepoints -> one byte per class, non-ASCII whitespace -> \\x0B) with
    the categories in the pattern rewritten the same way; a regex without
    them runs on the codepoints with non-ASCII whitespace -> \\x0B;
  * UTF-8 is decoded like unicode_cpt_from_utf8 (an invalid byte is
    U+FFFD and consumes one byte).

Matching is done by the third-party `regex` package (pip install regex),
whose backtracking semantics equal std::regex ECMAScript for these
patterns. Inputs only use codepoints assigned in Python's unicodedata
(so categories agree across Unicode versions).

    pip install regex
    python3 scripts/ref/gen-pretok-fixtures.py > tests/fixtures/pretok_cases.txt
"""
import random
import sys
import unicodedata

import regex

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
          r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
         r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DSL_LETTERS = ("\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
               "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
               "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
               "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
               "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
               "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
               "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
               "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
               "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
               "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
               "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
               "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
               "\U000118a0-\U000118df\U0001e900-\U0001e943]+")
DSL_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|"
          r"\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SEED_CODER = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
              r"\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
MINICPM5 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
            r"\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

FAMILIES = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt-2": [GPT2],
    "llama-bpe": [LLAMA3],
    "qwen2": [QWEN2],
    "starcoder": [r"\p{N}", GPT2],
    "deepseek-llm": ["[\r\n]", DSL_LETTERS, DSL_PUNCT, r"\s+$", CJK, r"\p{N}+"],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK, r"\p{N}"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
    "qwen35": [QWEN35],
    "seed-coder": [SEED_CODER],
    "minicpm5": [r"\p{N}{1,3}", MINICPM5],
    "bailingmoe": [BAILINGMOE],
    "laguna": [r"[^\n]+|[\n]+", QWEN2],
    "ufakzeka": [UFAKZEKA],
}

# ---- the reference's text transforms -------------------------------------

WS = regex.compile(r"\s")
UCAT = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
UCAT_ASCII = {  # k_ucat_map: the ASCII members of each class
    "N": "\x30-\x39", "L": "\x41-\x5A\x61-\x7A",
    "P": "\x21-\x23\x25-\x2A\x2C-\x2F\x3A-\x3B\x3F-\x40\\\x5B-\\\x5D\x5F\\\x7B\\\x7D",
    "M": "", "S": "\\\x24\\\x2B\x3C-\x3E\x5E\x60\\\x7C",
}


def decode(b):
    """unicode_cpts_from_utf8: list of (codepoint, byte offset)."""
    out, i, n = [], 0, len(b)
    while i < n:
        c = b[i]
        if c < 0x80:
            out.append((c, i)); i += 1; continue
        need = 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 0
        if c & 0xC0 == 0x80 or need == 0 or i + need > n or any(x & 0xC0 != 0x80 for x in b[i + 1:i + need]):
            out.append((0xFFFD, i)); i += 1; continue
        v = c & (0x1F, 0x0F, 0x07)[need - 2]
        for x in b[i + 1:i + need]:
            v = (v << 6) | (x & 0x3F)
        out.append((v, i)); i += need
    return out


def collapse_text(cps):
    s = []
    for c in cps:
        if c < 128:
            s.append(chr(c)); continue
        ch = chr(c)
        if WS.match(ch):
            s.append("\x0b"); continue
        s.append(UCAT.get(unicodedata.category(ch)[0], "\xd0"))
    return "".join(s)


def collapse_regex(p):
    out, inside, i = [], False, 0
    while i < len(p):
        if p[i] == "[" and (i == 0 or p[i - 1] != "\\"):
            out.append("["); inside = True; i += 1; continue
        if inside and p[i] == "]" and p[i - 1] != "\\":
            out.append("]"); inside = False; i += 1; continue
        if p.startswith("\\p{", i) and i + 4 < len(p) and p[i + 4] == "}" and p[i + 3] in UCAT:
            k = p[i + 3]
            out.append(("" if inside else "[") + UCAT[k] + UCAT_ASCII[k] + ("" if inside else "]"))
            i += 5; continue
        out.append(p[i]); i += 1
    return "".join(out)


def wide_text(cps):
    return "".join("\x0b" if c > 0x7F and WS.match(chr(c)) else chr(c) for c in cps)


def split(b, pats):
    dec = decode(b)
    cps = [c for c, _ in dec]
    offs = [o for _, o in dec] + [len(b)]
    ctext, wtext = collapse_text(cps), wide_text(cps)
    chunks = [len(cps)]
    for p in pats:
        if "\\p{" in p:
            text, rx = ctext, regex.compile(collapse_regex(p))
        else:
            text, rx = wtext, regex.compile(p)
        new, start = [], 0
        for ln in chunks:
            sub, at = text[start:start + ln], 0
            for m in rx.finditer(sub):
                if m.start() > at:
                    new.append(m.start() - at)
                new.append(m.end() - m.start())
                at = m.end()
            if at < ln:
                new.append(ln - at)
            start += ln
        chunks = new
    spans, start = [], 0
    for ln in chunks:
        spans.append(offs[start + ln] - offs[start])
        start += ln
    return spans


# ---- inputs ------------------------------------------------------------------

FIXED = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\t\n", "\r\n", " \r\n ", "a\r\n\r\nb",
    "Hello world", " Hello world", "Hello World", " Hello World!", "Hello, world!", " this is 🦙.cpp",
    "w048 7tuijk dsdfhu", "нещо на Български", "កាន់តែពិសេសអាចខលចេញ",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ (only emoji that has its own token)",
    "Hello\n\n\n   world  \t  \t\t x", "   Hello", "    Hello\n    Hello", " (", "\n =", "' era",
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
    "3", "33", "333", "3333", "33333", "333333", "3333333", "33333333", "333333333", "1234567890123",
    "Cửa Việt", " discards", "it's I'M we'RE you've THEY'LL he'd she'S 'tis don't X'D",
    "'s 'S 'Ll 'lL ''s '' 'x ' s", "'sa 'Sat 'rex 'llama 'dd 'ttt don'tcha we'rexx Ma'am O'Neil",
    "x  123 y   4567\t89 a 1b !1 +12 ' 3 \n 77 \u00a0 88", "word\u0301\u0301 \u0915\u093f\u0928\u094d\u0928 a\u20dd!",
    "def f(x):\n    return x**2  # comment\n\n\tif a<=b and c!=d: pass\n",
    "int main() { printf(\"%d\\n\", a[i]++); }  // ok",
    "٠١٢٣٤٥٦٧٨٩ १२३४५ ١٢٣ ௧௨௩ 一二三 ½ ² Ⅻ",
    "中文字符测试，包含标点。還有繁體字！한국어 텍스트 日本語のテキスト",
    "مرحبا بالعالم! هذا اختبار.", "שלום עולם", "नमस्ते दुनिया १२३",
    "e\u0301 a\u0308o\u0302 ñ n\u0303 \u0301\u0301x",
    "a\u00a0b\u2003c\u3000d\u2028e\u0085f\u200bg", " \u3000 \u3000x", "\u3000\u3000",
    "x\u000by\u000cz\u001cw\u001fv\u007f\u0000u",
    "$+<=>^~|` @#%&*_-", "a~b ~~ `x` ^^", "!!!   ???   ...\n\n...",
    "😀😃😄 👨‍👩‍👧‍👦 🇫🇷🇩🇪 👍🏽 ❤️", "µ ÿ Ω Ω K K ι ι ʼ ˆ",
    "ＡＢＣａｂｃ！？　（全角）１２３", "‘quoted’ “double” «guillemets» — dash… ellipsis",
    "trailing spaces   ", "trailing newline\n", "mixed \t \n \r end \t ",
    "𝐀𝐁𝐂 𝟏𝟐𝟑 𐐀𐐨", "ÀÉÎÕÜ àéîõü ŁŚŻ łśż",
]

INVALID = [
    b"\xff", b"a\xffb", b"\x80abc", b"\xc3", b"\xc3(", b"\xe2\x82", b"\xe2\x82(", b"\xf0\x9f\x98",
    b"\xf0\x9f\x98 x", b"\xc0\x80 \xc1\xbf", b"\xed\xa0\x80 surrogate", b"\xf8\x88\x80\x80\x80",
    b"caf\xe9 na\xefve", b"Hello \xff\xfe world's 123", b"\xe4\xb8\xad\xe6\x96", b"12\x803\x8045",
    b"\n\xff\n", b"  \xa0  x",
]

ALPHABET = list(" \t\n\r'sStTmMdDlLrReEvV") + list("abcXYZ0123456789") + list(",.!?;:-_()[]{}<>=+$^~|`@#%&*/\\\"") + [
    "\u00e9", "\u00fc", "\u00df", "\u0416", "\u03a9", "\u05d0", "\u0627", "\u0915", "\u093f", "\u0301",
    "\u4e2d", "\u6587", "\ud55c", "\u3042", "\u30ab", "\u0660", "\u0967", "\u00bd", "\u00b2", "\u2167",
    "\u00a0", "\u3000", "\u2003", "\u0085", "\u2028", "\u200b", "\u200d", "\ufe0f", "\U0001f600",
    "\U0001f999", "\u2014", "\u2026", "\u00ab", "\u20ac", "\u00a9", "\uff01", "\uff21", "\u2018",
    "\u00b5", "\u2126", "\u212a", "\u1fbe", "\u0800", "\uac00", "\u9fa5", "\u9fa6", "\u3001",
    "\U0001d400", "\U00010400", "\u0000", "\u001f", "\u007f", "\u00ad",
]


def random_inputs(rng, count):
    out = []
    for _ in range(count):
        n = rng.randint(1, 40)
        s = "".join(rng.choice(ALPHABET) for _ in range(n))
        b = s.encode("utf-8", "surrogatepass")
        if rng.random() < 0.15:  # sprinkle an invalid byte
            i = rng.randint(0, len(b))
            b = b[:i] + bytes([rng.choice([0x80, 0xbf, 0xc3, 0xe2, 0xf0, 0xff])]) + b[i:]
        out.append(b)
    return out


def assigned(b):
    for c, _ in decode(b):
        if c > 0x10FFFF or (c not in (0xFFFD,) and not (0xD800 <= c <= 0xDFFF)
                            and unicodedata.category(chr(c)) == "Cn"):
            return False
    return True


def main():
    rng = random.Random(1234)
    inputs = [s.encode("utf-8") for s in FIXED] + INVALID
    inputs += [("x" * 300 + " " * 200 + "\n" * 3 + "7" * 50 + "!" * 40).encode()]
    out = sys.stdout
    out.write("# GENERATED by scripts/ref/gen-pretok-fixtures.py - do not edit.\n"
              "# Expected llama.cpp pre-tokenizer splits. Per case:\n"
              "#   case <tokenizer.ggml.pre> <input bytes in hex, '-' if empty>\n"
              "#   <byte length of each piece, in order>\n")
    ncase = 0
    for fam, pats in FAMILIES.items():
        for b in inputs + random_inputs(rng, 120):
            if not assigned(b):
                continue
            lens = split(b, pats)
            assert sum(lens) == len(b) and all(x > 0 for x in lens)
            out.write("# %s\n" % ascii(b.decode("utf-8", "backslashreplace"))[:200])
            out.write("case %s %s\n%s\n" % (fam, b.hex() or "-", " ".join(map(str, lens))))
            ncase += 1
    sys.stderr.write("%d cases\n" % ncase)


if __name__ == "__main__":
    main()
