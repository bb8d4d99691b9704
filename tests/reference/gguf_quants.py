#!/usr/bin/env python3
"""Test vectors for GGUF dequantization: blocks of each quantized type, dequantized by llama.cpp's
`gguf` package.

For each type, three blocks built from seeded random bytes, with the scale fields overwritten by
finite values (two blocks with scales of the size real files have, one with the extremes: the
largest f16 and the smallest subnormal), so the vectors look like real weights. Each block is
dequantized with `gguf.quants.dequantize`, except Q8_K, which gguf (0.19.0) cannot dequantize:
its expected values are d * q in float32, as ggml's `dequantize_row_q8_K` computes them.

Writes OUTDIR/<type>.bin, little-endian: u32 ggml type id, u32 block count, the blocks' bytes,
then the expected values as f32. The Rust test (node-core/src/gguf/tests.rs) checks them bit for bit.

Made with gguf 0.19.0 and numpy 2.4.6 (the script refuses other gguf versions; change GGUF_VERSION
after checking the new one's output). Regenerate:

    python3 -m venv /tmp/gq && /tmp/gq/bin/pip install gguf==0.19.0 numpy
    /tmp/gq/bin/python tests/reference/gguf_quants.py tests/testdata/gguf-quants

Usage: python3 gguf_quants.py OUTDIR
"""
import importlib.metadata
import os
import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

GGUF_VERSION = "0.19.0"
BLOCKS = 3

# Type -> the byte offsets of its f16 scale fields (d first, then dmin or m).
F16_SCALES = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}


def blocks(qtype, rng):
    """BLOCKS blocks of random bytes with realistic scale fields."""
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(BLOCKS, size), dtype=np.uint8)
    for b in range(BLOCKS):
        if b == BLOCKS - 1:
            scales = [-65504.0, 2.0**-24]  # extremes: f16 max, smallest subnormal
        else:
            scales = rng.choice([-1, 1], 2) * rng.uniform(1e-4, 0.05, 2)
        if qtype == T.Q8_K:
            # f32 d, int8 qs[256], int16 bsums[16] (sums of 16 quants, unused by dequantization).
            d = np.float32(scales[0] if b < BLOCKS - 1 else -1e-40)  # an f32 subnormal
            raw[b, 0:4] = np.frombuffer(d.tobytes(), np.uint8)
            sums = raw[b, 4:260].view(np.int8).astype(np.int16).reshape(16, 16).sum(axis=1)
            raw[b, 260:292] = np.frombuffer(sums.astype("<i2").tobytes(), np.uint8)
        else:
            for at, s in zip(F16_SCALES[qtype], scales):
                raw[b, at : at + 2] = np.frombuffer(np.float16(s).tobytes(), np.uint8)
    return raw


def reference(qtype, raw):
    if qtype == T.Q8_K:
        d = raw[:, 0:4].copy().view("<f4")
        q = raw[:, 4:260].view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)
    return dequantize(raw.reshape(-1), qtype).reshape(-1)


def main():
    version = importlib.metadata.version("gguf")
    if version != GGUF_VERSION:
        sys.exit(f"gguf {version}, not {GGUF_VERSION}: check its output, then update GGUF_VERSION")
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    for i, qtype in enumerate([*F16_SCALES, T.Q8_K]):
        raw = blocks(qtype, np.random.default_rng(2500 + i))
        values = reference(qtype, raw).astype("<f4")
        per_block, _ = GGML_QUANT_SIZES[qtype]
        assert values.size == BLOCKS * per_block and np.isfinite(values).all()
        path = os.path.join(out_dir, f"{qtype.name.lower()}.bin")
        with open(path, "wb") as f:
            f.write(struct.pack("<II", int(qtype), BLOCKS))
            f.write(raw.tobytes())
            f.write(values.tobytes())
        print(f"{path}: {BLOCKS} blocks, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
