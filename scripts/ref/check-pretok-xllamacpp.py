#!/usr/bin/env python3
"""Cross-check the C pre-tokenizer against llama.cpp itself (xllamacpp).

llama.cpp BPE-merges each pre-tokenizer word on its own, so no token it
returns can cross a word boundary. This script tokenizes many strings with
the real llama.cpp (xllamacpp's /tokenize on a GGUF model, e.g. SmolLM2,
tokenizer.ggml.pre = "smollm") and checks that every token lies inside one
word of kvlua's split (engine/pretok.c, loaded through ctypes), and that
the C split equals the Python model of scripts/ref/gen-pretok-fixtures.py.

    python3 scripts/ref/check-pretok-xllamacpp.py [model.gguf] [count]
    (default model: scripts/fetch-models.sh smollm2; PRETOK_FORCE=<pre name>
    splits with another family instead, to see that the check can fail)
"""
import ctypes
import json
import os
import random
import subprocess
import sys
import tempfile
import urllib.request

import xllamacpp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import importlib.util  # noqa: E402

spec = importlib.util.spec_from_file_location("pf", os.path.join(HERE, "gen-pretok-fixtures.py"))
pf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pf)


class Span(ctypes.Structure):
    _fields_ = [("off", ctypes.c_size_t), ("len", ctypes.c_size_t)]


def load_c():
    tmp = tempfile.mkdtemp()
    so = os.path.join(tmp, "libpretok.so")
    src = [os.path.join(ROOT, "engine", f) for f in ("pretok.c", "unicode.c", "unicode_tables.c", "kv_error.c")]
    subprocess.check_call(["cc", "-O2", "-shared", "-fPIC", "-I", os.path.join(ROOT, "engine"), "-o", so] + src)
    lib = ctypes.CDLL(so)
    lib.kv_pretok_kind.restype = ctypes.c_int
    lib.kv_pretok_kind.argtypes = [ctypes.c_char_p]
    lib.kv_pretok_kind_name.restype = ctypes.c_char_p
    lib.kv_pretok_kind_name.argtypes = [ctypes.c_int]
    lib.kv_pretokenize.restype = ctypes.c_int
    lib.kv_pretokenize.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
                                   ctypes.POINTER(ctypes.POINTER(Span)), ctypes.POINTER(ctypes.c_size_t),
                                   ctypes.c_char_p]
    libc = ctypes.CDLL(None)
    libc.free.argtypes = [ctypes.c_void_p]

    def split(kind, b):
        spans, n, err = ctypes.POINTER(Span)(), ctypes.c_size_t(), ctypes.create_string_buffer(512)
        st = lib.kv_pretokenize(kind, b, len(b), ctypes.byref(spans), ctypes.byref(n), err)
        if st != 0:
            raise RuntimeError(err.value)
        out = [spans[i].len for i in range(n.value)]
        libc.free(ctypes.cast(spans, ctypes.c_void_p))
        return out
    return lib, split


def gguf_pre(path):
    from gguf import GGUFReader
    r = GGUFReader(path)
    f = r.fields["tokenizer.ggml.pre"]
    return bytes(f.parts[f.data[0]]).decode()


def main():
    path = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else subprocess.check_output(
        [os.path.join(ROOT, "scripts", "fetch-models.sh"), "smollm2"]).decode().strip()
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    pre = gguf_pre(path)
    lib, csplit = load_c()
    kind = lib.kv_pretok_kind(os.environ.get("PRETOK_FORCE", pre).encode())
    assert kind >= 0, pre
    pats = pf.FAMILIES[lib.kv_pretok_kind_name(kind).decode()]
    p = xllamacpp.CommonParams()
    p.model.path = path
    p.n_ctx = 4096
    p.cpuparams.n_threads = 2
    p.verbosity = 0
    server = xllamacpp.Server(p)

    def tokenize(text):
        req = urllib.request.Request(server.listening_address + "/tokenize", data=json.dumps(
            {"content": text, "add_special": False, "parse_special": False, "with_pieces": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            toks = json.loads(r.read())["tokens"]
        return [t["piece"].encode() if isinstance(t["piece"], str) else bytes(t["piece"]) for t in toks]

    rng = random.Random(7)
    alphabet = pf.ALPHABET + [c for c in "ÀÉàéøßĞğİıŁłŒœƒǅǈΆΑΩάωЁЖжѣԱաאבتثپچकखगঅআਕકଓகఅಅഅසกขກ" "ཀကᄀᎠᐁᚠᛁកᠠᥐᦀᨀᩀᬅᮃᰀ"]
    alphabet += ["\U0001f44d\U0001f3fd", "\u2764\ufe0f", "\U0001f1eb\U0001f1f7", "\u00b9", "\u2460", "\u3007",
                 "\u0f20", "\u1040", "\u17e0", "\uff10", "\U0001d7ce", "\u2070", "\u0300", "\u0903", "\u20dd"]
    inputs = [s.encode() for s in pf.FIXED]
    for _ in range(count):
        n = rng.randint(1, 60)
        inputs.append("".join(rng.choice(alphabet) for _ in range(n)).encode("utf-8"))
    bad = mism = ntok = 0
    for b in inputs:
        if not b:
            continue
        text = b.decode("utf-8")
        toks = tokenize(text)
        if b"".join(toks) != b:
            continue  # special tokens or normalisation; not a pre-tokenizer question
        cw = csplit(kind, b)
        if pf.assigned(b):
            if cw != pf.split(b, pats):
                mism += 1
                print("C != model:", ascii(text))
        cuts, o = set(), 0
        for ln in cw:
            o += ln
            cuts.add(o)
        o = 0
        for t in toks:
            ntok += 1
            if any(o < c < o + len(t) for c in cuts):
                bad += 1
                print("token crosses a word boundary:", ascii(text), ascii(t))
                break
            o += len(t)
    print("%d inputs, %d tokens; %d with a token crossing a word, %d C/model mismatches"
          % (len(inputs), ntok, bad, mism))
    return 1 if bad or mism else 0


if __name__ == "__main__":
    sys.exit(main())
