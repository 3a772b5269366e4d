"""Second reference: llama.cpp through the xllamacpp package (an in-process llama-server).

xllamacpp gives tokenization (with add_special / parse_special), greedy completion
and top-n log-probabilities over its HTTP API, but no raw logits and no arbitrary
bytes (requests are JSON, so text must be valid UTF-8). It is used to cross-check
the llama-cpp-python build (scripts/ref/gen-fixtures.py --crosscheck).

    with XlRef(path, n_ctx=2048, n_threads=2) as xl:
        xl.tokenize("text", add_special=True, parse_special=False) -> [ids]
        xl.greedy(ids, 32) -> [ids]            (temperature 0, no penalties)
        xl.top_logprobs(ids, 20) -> [(id, logprob), ...] for the next token
"""

import json
import urllib.request

import xllamacpp


def version():
    return "xllamacpp %s" % xllamacpp.__version__


class XlRef:
    def __init__(self, path, n_ctx=2048, n_threads=2):
        p = xllamacpp.CommonParams()
        p.model.path = path
        p.n_ctx = n_ctx
        p.n_parallel = 1
        p.cpuparams.n_threads = n_threads
        p.cpuparams_batch.n_threads = n_threads
        p.verbosity = 0
        self.server = xllamacpp.Server(p)
        self.addr = self.server.listening_address

    def _post(self, path, obj):
        req = urllib.request.Request(self.addr + path, data=json.dumps(obj).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def tokenize(self, text, add_special=True, parse_special=False):
        r = self._post("/tokenize", {"content": text, "add_special": add_special,
                                     "parse_special": parse_special})
        return [t if isinstance(t, int) else t["id"] for t in r["tokens"]]

    def _complete(self, ids, n, n_probs=0):
        return self._post("/completion", {
            "prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1,
            "repeat_penalty": 1.0, "n_probs": n_probs, "cache_prompt": False,
            "ignore_eos": True, "return_tokens": True, "samplers": ["top_k"],
        })

    def greedy(self, ids, n):
        return list(self._complete(ids, n)["tokens"])

    def top_logprobs(self, ids, k):
        r = self._complete(ids, 1, n_probs=k)
        top = r["completion_probabilities"][0]["top_logprobs"]
        return [(t["id"], t["logprob"]) for t in top]

    def close(self):
        self.server = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()
