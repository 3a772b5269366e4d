"""Thin access to the reference implementation (llama.cpp) for fixtures and benchmarks.

Uses the low-level ctypes API of llama-cpp-python (`import llama_cpp`), which
exposes what the server-style xllamacpp package does not: raw logits of every
position, tokenization of arbitrary bytes (invalid UTF-8 included), and decode
calls that can be timed one by one. See scripts/ref/README.md for the install.

    ref = Ref(path, n_ctx=512, n_threads=2, n_batch=512)
    ids = ref.tokenize(b"text", add_special=True, parse_special=False)
    logits = ref.eval(ids)               # (n_vocab,) float32, last position
    rows = ref.eval(ids, all_logits=True) # (len(ids), n_vocab)
    ref.clear()                           # empty the KV cache
    ref.close()

Everything is 0-based GGUF token ids; logits are numpy float32 copies.
"""

import ctypes
import os
import re

import numpy as np

# llama.cpp's CPU backend here is built with OpenMP; libgomp's default busy-wait
# collapses when the cores are shared with other processes (2 threads on a loaded
# 2-core machine: ~2 tok/s decode instead of ~35). Passive waiting must be chosen
# before libgomp is loaded; set OMP_WAIT_POLICY yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import llama_cpp as L  # noqa: E402

_backend_ready = False


def _quiet_log():
    """Silence llama.cpp's log callback (it prints every load to stderr)."""
    @L.llama_log_callback
    def _cb(level, text, user_data):
        if os.environ.get("KVLUA_REF_VERBOSE"):
            os.write(2, text)
    return _cb


_LOG_CB = None


def version():
    """Reference identification: llama-cpp-python version plus its bundled ggml version."""
    libdir = os.path.join(os.path.dirname(L.__file__), "lib")
    ggml = "?"
    try:
        for f in sorted(os.listdir(libdir)):
            m = re.match(r"libggml-base\.so\.(\d+\.\d+\.\d+)$", f)
            if m:
                ggml = m.group(1)
    except OSError:
        pass
    return "llama-cpp-python %s (ggml %s)" % (L.__version__, ggml)


class Ref:
    def __init__(self, path, n_ctx=512, n_threads=2, n_batch=512, n_ubatch=None, flash_attn=None,
                 kv_type=None):
        global _backend_ready, _LOG_CB
        if not _backend_ready:
            _LOG_CB = _quiet_log()
            L.llama_log_set(_LOG_CB, ctypes.c_void_p(0))
            L.llama_backend_init()
            _backend_ready = True
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError("llama.cpp could not load " + path)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_ubatch or n_batch
        cp.n_seq_max = 1
        cp.n_threads = n_threads
        cp.n_threads_batch = n_threads
        cp.no_perf = False
        if kv_type is not None:  # "f16" (default), "f32", "q8_0", "q4_0", or "K/V" (e.g. "q8_0/q4_0")
            names = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
            kt, _, vt = kv_type.partition("/")
            cp.type_k = names[kt]
            cp.type_v = names[vt or kt]
        if flash_attn is not None:  # None: llama.cpp's default (auto: on for the CPU)
            cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                  else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise RuntimeError("llama.cpp could not create a context for " + path)
        self.n_ctx = L.llama_n_ctx(self.ctx)
        self.n_batch = n_batch
        self.n_past = 0
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.bos = int(L.llama_vocab_bos(self.vocab))
        self.eos = int(L.llama_vocab_eos(self.vocab))
        self.batch = L.llama_batch_init(max(n_batch, 1), 0, 1)

    # -- tokenizer --------------------------------------------------------

    def tokenize(self, text, add_special=True, parse_special=False):
        if isinstance(text, str):
            text = text.encode("utf-8")
        n_max = len(text) + 16
        buf = (L.llama_token * n_max)()
        n = L.llama_tokenize(self.vocab, text, len(text), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (L.llama_token * n_max)()
            n = L.llama_tokenize(self.vocab, text, len(text), buf, n_max, add_special, parse_special)
        if n < 0:
            raise RuntimeError("llama_tokenize failed")
        return [int(buf[i]) for i in range(n)]

    def detokenize(self, ids, remove_special=False, unparse_special=True):
        arr = (L.llama_token * max(len(ids), 1))(*ids)
        cap = 64 + 64 * len(ids)
        out = ctypes.create_string_buffer(cap)
        n = L.llama_detokenize(self.vocab, arr, len(ids), out, cap, remove_special, unparse_special)
        if n < 0:
            cap = -n
            out = ctypes.create_string_buffer(cap)
            n = L.llama_detokenize(self.vocab, arr, len(ids), out, cap, remove_special, unparse_special)
        return out.raw[:n]

    def piece(self, tid, special=True):
        out = ctypes.create_string_buffer(256)
        n = L.llama_token_to_piece(self.vocab, tid, out, 256, 0, special)
        return out.raw[:max(n, 0)]

    def is_eog(self, tid):
        return bool(L.llama_vocab_is_eog(self.vocab, tid))

    # -- evaluation -------------------------------------------------------

    def clear(self):
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        self.n_past = 0

    def _decode(self, ids, flags):
        """Decode ids at positions n_past.. in one llama_decode; flags[i]: output row i."""
        b = self.batch
        n = len(ids)
        for i, t in enumerate(ids):
            b.token[i] = t
            b.pos[i] = self.n_past + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if flags[i] else 0
        b.n_tokens = n
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError("llama_decode failed: %d" % rc)
        self.n_past += n

    def eval(self, ids, all_logits=False, want_logits=True, first_output=0):
        """Append ids to the sequence; return logits (last row, or with all_logits the
        rows of ids[first_output:], or None with want_logits=False)."""
        rows = []
        nb = self.n_batch
        n_all = len(ids)
        for s in range(0, n_all, nb):
            chunk = ids[s:s + nb]
            if all_logits:
                flags = [s + i >= first_output for i in range(len(chunk))]
            else:
                flags = [want_logits and s + i == n_all - 1 for i in range(len(chunk))]
            self._decode(chunk, flags)
            n_out = sum(flags)
            if all_logits and n_out:
                p = L.llama_get_logits(self.ctx)
                rows.append(np.ctypeslib.as_array(p, shape=(n_out * self.n_vocab,))
                            .reshape(n_out, self.n_vocab).copy())
        if all_logits:
            return np.concatenate(rows, axis=0)
        if not want_logits:
            L.llama_synchronize(self.ctx)
            return None
        p = L.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(p, shape=(self.n_vocab,)).copy()

    def greedy(self, ids, n_new, stop_at_eog=False):
        """Prefill ids (after a clear) and greedily continue n_new tokens (argmax of raw logits)."""
        self.clear()
        logits = self.eval(ids)
        out = []
        for _ in range(n_new):
            t = int(np.argmax(logits))
            out.append(t)
            if stop_at_eog and self.is_eog(t):
                break
            logits = self.eval([t])
        return out

    def close(self):
        if getattr(self, "batch", None) is not None:
            L.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def system_info():
    return L.llama_print_system_info().decode(errors="replace").strip()
