#!/usr/bin/env python3
"""A GGUF file with the shape of Llama-3.2-1B or Llama-3.1-8B and seeded random weights,
quantised to Q4_K_M by llama.cpp's own quantiser: speed and memory at the sizes a mesh is for,
reproducible without a download (only SmolLM2 can be downloaded on these machines).

Usage: python scripts/shape_files.py {1b,8b} OUT.gguf [--seed N] [--type Q4_K_M|Q8_0|F16]
  (the python of scripts/llama-cpp-env.sh)

It writes an F16 file tensor by tensor next to OUT (2.5 GB for 1B, 16 GB for 8B), so its
memory stays near one tensor's, then quantises it and deletes it. The weights are random
(N(0, 1/in) matrices, gains near 1) and the vocabulary is 128,256 made-up tokens over
byte-level BPE: the text is noise, the shapes, bytes and arithmetic are the real model's.
"""
import argparse
import ctypes
import os
import sys
import time

import numpy as np
import gguf
import llama_cpp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arch_files import byte_tokens, llama3_factors  # noqa: E402

SHAPES = {
    # hidden, ffn, layers, heads, kv_heads, head_dim, tied, llama3 rope scaling factor
    "1b": dict(name="Llama-3.2-1B shape", hidden=2048, ffn=8192, layers=16, heads=32,
               kv_heads=8, head_dim=64, tied=True, factor=32.0),
    "8b": dict(name="Llama-3.1-8B shape", hidden=4096, ffn=14336, layers=32, heads=32,
               kv_heads=8, head_dim=128, tied=False, factor=8.0),
}
VOCAB = 128256
THETA = 500000.0
TYPES = {"Q4_K_M": 15, "Q8_0": 7, "F16": None}


def tensors(s):
    """(name, numpy shape) of every tensor, in file order."""
    d, f, hd = s["hidden"], s["ffn"], s["head_dim"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    out = [("token_embd.weight", (VOCAB, d))]
    if not s["tied"]:
        out.append(("output.weight", (VOCAB, d)))
    out += [("output_norm.weight", (d,)), ("rope_freqs.weight", (hd // 2,))]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (d,)), (b + "attn_q.weight", (q, d)),
                (b + "attn_k.weight", (kv, d)), (b + "attn_v.weight", (kv, d)),
                (b + "attn_output.weight", (d, q)), (b + "ffn_norm.weight", (d,)),
                (b + "ffn_gate.weight", (f, d)), (b + "ffn_up.weight", (f, d)),
                (b + "ffn_down.weight", (d, f))]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", choices=SHAPES)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--type", choices=TYPES, default="Q4_K_M")
    a = ap.parse_args()
    s = SHAPES[a.shape]
    rng = np.random.default_rng(a.seed)
    f16 = a.out if TYPES[a.type] is None else a.out + ".f16.tmp"
    w = gguf.GGUFWriter(f16, "llama")
    w.add_name(f"random {s['name']} (seed {a.seed})")
    w.add_context_length(131072)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_block_count(s["layers"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    tokens = byte_tokens()
    merges = ["Ġ t", "Ġ a", "h e", "i n"]
    tokens += [m.replace(" ", "") for m in merges]
    tokens += [f"<tok{i}>" for i in range(VOCAB - len(tokens) - 2)] + ["<|begin|>", "<|end|>"]
    w.add_token_list(tokens)
    w.add_token_types([1] * (VOCAB - 2) + [3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(VOCAB - 2)
    w.add_eos_token_id(VOCAB - 1)
    plan = tensors(s)
    for name, shape in plan:
        dtype = np.float16 if len(shape) == 2 else np.float32
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    started = time.time()
    for i, (name, shape) in enumerate(plan):
        if name == "rope_freqs.weight":
            t = llama3_factors(THETA, s["head_dim"], s["factor"], 1.0, 4.0, 8192)
        elif len(shape) == 1:
            t = (1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        else:
            scale = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(shape[1])
            t = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)
        w.write_tensor_data(t)
        print(f"\rwriting F16: {i + 1}/{len(plan)} tensors, {time.time() - started:.0f} s",
              end="", file=sys.stderr)
    w.close()
    print(file=sys.stderr)
    if TYPES[a.type] is not None:
        print(f"quantising to {a.type} with llama.cpp ...", file=sys.stderr)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = TYPES[a.type]
        params.nthread = os.cpu_count() or 2
        rc = llama_cpp.llama_model_quantize(f16.encode(), a.out.encode(), ctypes.byref(params))
        os.remove(f16)
        if rc != 0:
            raise SystemExit(f"llama.cpp could not quantise to {a.type}")
    print(f"{a.out}: {os.path.getsize(a.out) / 1e9:.2f} GB in {time.time() - started:.0f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
