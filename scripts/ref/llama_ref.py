"""Reference tokenizer: llama.cpp's own llama_tokenize / llama_detokenize,
called through ctypes on the shared library shipped in the xllamacpp wheel.

    from llama_ref import RefVocab
    v = RefVocab("model.gguf")          # vocab-only load
    ids = v.tokenize(b"Hello", add_special=False, parse_special=False)
    text = v.detokenize(ids)            # bytes

Only the stable C entry points are used. llama_model_params is treated as an
opaque blob: the one field set, vocab_only, is located by VOCAB_ONLY_OFFSET
(checked against the default blob: the byte must be 0 and the following
use_extra_bufts-style flag 1 in the layout of the bundled llama.cpp).
"""
import ctypes
import os
import sys

import xllamacpp

VOCAB_ONLY_OFFSET = 72

_lib = ctypes.CDLL(os.path.join(os.path.dirname(xllamacpp.__file__), "xllamacpp.abi3.so"))


class _Params(ctypes.Structure):
    _fields_ = [("b", ctypes.c_ubyte * 512)]


_LOGCB = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


@_LOGCB
def _quiet(level, text, ud):
    pass


_lib.llama_log_set(_quiet, None)
_lib.llama_backend_init()
_lib.llama_model_default_params.restype = _Params
_lib.llama_model_load_from_file.restype = ctypes.c_void_p
_lib.llama_model_load_from_file.argtypes = [ctypes.c_char_p, _Params]
_lib.llama_model_get_vocab.restype = ctypes.c_void_p
_lib.llama_model_get_vocab.argtypes = [ctypes.c_void_p]
_lib.llama_model_free.argtypes = [ctypes.c_void_p]
_lib.llama_tokenize.restype = ctypes.c_int32
_lib.llama_tokenize.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32,
                                ctypes.POINTER(ctypes.c_int32), ctypes.c_int32,
                                ctypes.c_bool, ctypes.c_bool]
_lib.llama_detokenize.restype = ctypes.c_int32
_lib.llama_detokenize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32,
                                  ctypes.c_char_p, ctypes.c_int32, ctypes.c_bool, ctypes.c_bool]
_lib.llama_token_to_piece.restype = ctypes.c_int32
_lib.llama_token_to_piece.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p,
                                      ctypes.c_int32, ctypes.c_int32, ctypes.c_bool]
for _name in ("bos", "eos", "eot", "nl", "pad", "sep"):
    getattr(_lib, "llama_vocab_" + _name).restype = ctypes.c_int32
    getattr(_lib, "llama_vocab_" + _name).argtypes = [ctypes.c_void_p]
_lib.llama_vocab_n_tokens.restype = ctypes.c_int32
_lib.llama_vocab_n_tokens.argtypes = [ctypes.c_void_p]
_lib.llama_vocab_is_eog.restype = ctypes.c_bool
_lib.llama_vocab_is_eog.argtypes = [ctypes.c_void_p, ctypes.c_int32]
_lib.llama_vocab_get_attr.restype = ctypes.c_int32
_lib.llama_vocab_get_attr.argtypes = [ctypes.c_void_p, ctypes.c_int32]
_lib.llama_vocab_get_add_bos.restype = ctypes.c_bool
_lib.llama_vocab_get_add_bos.argtypes = [ctypes.c_void_p]
_lib.llama_vocab_get_add_eos.restype = ctypes.c_bool
_lib.llama_vocab_get_add_eos.argtypes = [ctypes.c_void_p]


class RefVocab:
    def __init__(self, path):
        p = _lib.llama_model_default_params()
        if p.b[VOCAB_ONLY_OFFSET] != 0:
            raise RuntimeError("unexpected llama_model_params layout")
        p.b[VOCAB_ONLY_OFFSET] = 1
        self.model = _lib.llama_model_load_from_file(path.encode(), p)
        if not self.model:
            raise RuntimeError("llama.cpp could not load " + path)
        self.vocab = _lib.llama_model_get_vocab(self.model)

    def close(self):
        if self.model:
            _lib.llama_model_free(self.model)
            self.model = None

    def n_tokens(self):
        return _lib.llama_vocab_n_tokens(self.vocab)

    def special(self, name):
        return getattr(_lib, "llama_vocab_" + name)(self.vocab)

    def is_eog(self, tid):
        return _lib.llama_vocab_is_eog(self.vocab, tid)

    def attr(self, tid):
        return _lib.llama_vocab_get_attr(self.vocab, tid)

    def add_bos(self):
        return _lib.llama_vocab_get_add_bos(self.vocab)

    def add_eos(self):
        return _lib.llama_vocab_get_add_eos(self.vocab)

    def tokenize(self, text, add_special=False, parse_special=False):
        if isinstance(text, str):
            text = text.encode()
        cap = len(text) + 16
        while True:
            buf = (ctypes.c_int32 * cap)()
            n = _lib.llama_tokenize(self.vocab, text, len(text), buf, cap, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def detokenize(self, ids, remove_special=False, unparse_special=False):
        arr = (ctypes.c_int32 * max(1, len(ids)))(*ids)
        cap = 4 * len(ids) + 16
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = _lib.llama_detokenize(self.vocab, arr, len(ids), buf, cap, remove_special, unparse_special)
            if n >= 0:
                return buf.raw[:n]
            cap = -n

    def piece(self, tid, special=False, lstrip=0):
        cap = 64
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = _lib.llama_token_to_piece(self.vocab, tid, buf, cap, lstrip, special)
            if n >= 0:
                return buf.raw[:n]
            cap = -n


if __name__ == "__main__":
    # usage: llama_ref.py MODEL.gguf TEXT  -> prints ids (no BOS/EOS, no special parsing)
    v = RefVocab(sys.argv[1])
    print(" ".join(map(str, v.tokenize(sys.argv[2].encode()))))
