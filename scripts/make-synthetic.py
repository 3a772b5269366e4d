#!/usr/bin/env python3
"""Write synthetic GGUF models (llama architecture, random weights) for benchmarks.

Shapes (both with tied embeddings, no output.weight):

  smollm2-135m  n_embd 576,  30 layers,  9 heads, 3 kv heads, ff 1536, head_dim 64,
                rope theta 100000 (the SmolLM2-135M shape)
  llama32-1b    n_embd 2048, 16 layers, 32 heads, 8 kv heads, ff 8192, head_dim 64,
                rope theta 500000 (the Llama-3.2-1B shape, without its llama3
                rope-scaling factors: no rope_freqs.weight tensor)

Both copy the tokenizer metadata (gpt2/smollm BPE, 49152 tokens) from the real
SmolLM2 file so that kvlua and llama.cpp can tokenize prompts; the vocabulary of
the 1B shape is therefore 49152, not Llama 3's 128256 (its embedding table and
output projection are ~2.6x smaller than the real model's).

Types: Q4_0 or Q8_0 for every 2-D weight (token_embd included: "pure"), F32 for
the norms. Weights are N(0, 0.02^2) (seeded, deterministic), norms are
1 + N(0, 0.02^2), so activations stay finite. Outputs are meaningless text.

  python3 scripts/make-synthetic.py [--shape smollm2-135m|llama32-1b|all]
                                    [--type Q4_0|Q8_0|all] [--force]

Files go to ${KVLUA_MODELS:-~/.cache/kvlua/models}/synth-<shape>-<type>.gguf and
are not regenerated when present (unless --force). Prints the paths written or
found, one per line.
"""

import argparse
import os
import subprocess
import sys

import numpy as np
import gguf

SHAPES = {
    "smollm2-135m": dict(n_embd=576, n_layer=30, n_head=9, n_head_kv=3, n_ff=1536,
                         head_dim=64, rope_theta=100000.0, seed=135),
    "llama32-1b": dict(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192,
                       head_dim=64, rope_theta=500000.0, seed=1000),
}
TYPES = {
    "Q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
N_CTX_TRAIN = 8192
RMS_EPS = 1e-5


def repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tokenizer_source():
    """Path of the real SmolLM2 GGUF (its tokenizer metadata is copied)."""
    out = subprocess.run([os.path.join(repo_root(), "scripts", "fetch-models.sh"), "smollm2"],
                         check=True, capture_output=True, text=True).stdout.strip()
    return out.splitlines()[-1]


def copy_tokenizer(writer, reader):
    """Copy every tokenizer.* key, byte for byte for strings."""
    n_vocab = None
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]) for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(key, val, vtype, sub_type=sub)
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(val)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_key_value(key, bytes(field.parts[field.data[0]]), vtype)
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], vtype)
    if n_vocab is None:
        raise SystemExit("make-synthetic: no tokenizer.ggml.tokens in the source file")
    return n_vocab


def make(shape_name, type_name, out_path, src_path):
    s = SHAPES[shape_name]
    qtype, ftype = TYPES[type_name]
    rng = np.random.default_rng(s["seed"] * 10 + (0 if type_name == "Q4_0" else 1))
    reader = gguf.GGUFReader(src_path)

    tmp = out_path + ".part"
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(f"synthetic {shape_name} {type_name} (random weights)")
    w.add_type("model")
    w.add_block_count(s["n_layer"])
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(s["n_embd"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_dimension_count(s["head_dim"])
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    n_vocab = copy_tokenizer(w, reader)
    w.add_vocab_size(n_vocab)

    e, hd = s["n_embd"], s["head_dim"]
    q_dim, kv_dim = s["n_head"] * hd, s["n_head_kv"] * hd

    def mat(name, rows, cols):
        # numpy shape (rows, cols) = GGUF ne [cols, rows]: y = W x, x of length cols
        x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
        q = gguf.quants.quantize(x, qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    def norm(name):
        x = (1.0 + 0.02 * rng.standard_normal(e, dtype=np.float32)).astype(np.float32)
        w.add_tensor(name, x)

    mat("token_embd.weight", n_vocab, e)
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        mat(p + "attn_q.weight", q_dim, e)
        mat(p + "attn_k.weight", kv_dim, e)
        mat(p + "attn_v.weight", kv_dim, e)
        mat(p + "attn_output.weight", e, q_dim)
        norm(p + "ffn_norm.weight")
        mat(p + "ffn_gate.weight", s["n_ff"], e)
        mat(p + "ffn_up.weight", s["n_ff"], e)
        mat(p + "ffn_down.weight", e, s["n_ff"])
    norm("output_norm.weight")

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out_path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="all", choices=list(SHAPES) + ["all"])
    ap.add_argument("--type", default="all", choices=list(TYPES) + ["all"])
    ap.add_argument("--force", action="store_true", help="regenerate even if present")
    a = ap.parse_args()
    cache = os.environ.get("KVLUA_MODELS") or os.path.expanduser("~/.cache/kvlua/models")
    os.makedirs(cache, exist_ok=True)
    shapes = list(SHAPES) if a.shape == "all" else [a.shape]
    types = list(TYPES) if a.type == "all" else [a.type]
    src = None
    for sh in shapes:
        for ty in types:
            out = os.path.join(cache, f"synth-{sh}-{ty}.gguf")
            if a.force or not os.path.exists(out):
                src = src or tokenizer_source()
                print(f"make-synthetic: writing {out}", file=sys.stderr)
                make(sh, ty, out, src)
            print(out)


if __name__ == "__main__":
    main()
