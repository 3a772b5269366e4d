#!/usr/bin/env python3
"""Writes tests/fixtures/quant_dequant.bin: random blocks of every weight
format with their dequantization computed by the gguf Python package (the
reference for tests/test_quant.c, which must match it bit for bit).

    python3 scripts/ref/gen-quant-fixtures.py [out]

File layout (little endian), repeated until EOF:
    u32 ggml type id, u32 n_elements, u32 n_bytes,
    n_bytes of blocks, n_elements float32 (gguf.quants.dequantize)
"""
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

# (type, n_elements, byte offsets of f16 scale fields in each block, block bytes)
TYPES = [
    (Q.F16, 64, None, 2),
    (Q.BF16, 64, None, 2),
    (Q.Q4_0, 32 * 12, [0], 18),
    (Q.Q4_1, 32 * 12, [0, 2], 20),
    (Q.Q5_0, 32 * 12, [0], 22),
    (Q.Q5_1, 32 * 12, [0, 2], 24),
    (Q.Q8_0, 32 * 12, [0], 34),
    (Q.Q4_K, 256 * 4, [0, 2], 144),
    (Q.Q5_K, 256 * 4, [0, 2], 176),
    (Q.Q6_K, 256 * 4, [208], 210),
]


def rand_f16(rng, n):
    # finite halves of moderate size, both signs, some subnormal
    v = rng.standard_normal(n).astype(np.float32) * np.float32(0.05)
    v[::7] *= np.float32(1e-4)
    return v.astype(np.float16).view(np.uint8).reshape(n, 2)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/quant_dequant.bin"
    rng = np.random.default_rng(20240611)
    parts = []
    for qt, n, scale_offs, bsize in TYPES:
        if qt == Q.F16:
            raw = rng.integers(0, 65536, n, dtype=np.uint16)
            raw[(raw & 0x7C00) == 0x7C00] &= 0xBFFF  # no inf/nan
            data = raw.view(np.uint8)
        elif qt == Q.BF16:
            raw = rng.integers(0, 65536, n, dtype=np.uint16)
            raw[(raw & 0x7F80) == 0x7F80] &= 0xBFFF
            data = raw.view(np.uint8)
        else:
            nb = n // (256 if bsize in (144, 176, 210) else 32)
            data = rng.integers(0, 256, (nb, bsize), dtype=np.uint8)
            for off in scale_offs:
                data[:, off:off + 2] = rand_f16(rng, nb)
            data = data.reshape(-1)
        ref = dequantize(data, qt).astype(np.float32).reshape(-1)
        assert ref.size == n, (qt, ref.size)
        parts.append(struct.pack("<III", int(qt), n, data.size) + data.tobytes() + ref.tobytes())
    with open(out, "wb") as f:
        for p in parts:
            f.write(p)
    print(f"wrote {out}: {sum(len(p) for p in parts)} bytes")


if __name__ == "__main__":
    main()
