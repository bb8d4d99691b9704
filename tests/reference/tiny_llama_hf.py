#!/usr/bin/env python3
"""A tiny random Llama checkpoint in Hugging Face format, with float64 reference logits.

Writes config.json, model.safetensors (written by hand: 8-byte header length, JSON header,
raw little-endian f32), tokenizer.json (a byte-level BPE trained here) and reference.json.
The reference uses Hugging Face's RoPE convention (rotate_half: pairs (i, i + d/2)) on the
unpermuted q/k weights, so a loader that forgets to convert the layout fails the test.

Usage: python3 tiny_llama_hf.py OUTDIR
"""
import json
import os
import struct
import sys

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEXT = """The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins
with a single step. To be or not to be, that is the question. All that glitters is not gold.
The early bird catches the worm. Knowledge is power, and time is money. Practice makes perfect.
Where there is a will there is a way. Actions speak louder than words. Fortune favours the bold.
Numbers like 12, 345 and 6789 appear in text too, as do symbols: (a + b) * c = d!""" * 4

CFG = dict(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, eps=1e-5, theta=10000.0)
PROMPTS = ["The quick brown fox", "Knowledge is power, and 12 + 345"]


def train_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    tok.train_from_iterator([TEXT], trainer)
    return tok


def rope_half(x, theta):
    t, h, d = x.shape
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def forward(W, ids):
    c = CFG
    hd = c["hidden"] // c["heads"]
    x = W["model.embed_tokens.weight"][ids]
    t = len(ids)
    mask = np.triu(np.full((t, t), -np.inf), 1)
    g = c["heads"] // c["kv_heads"]
    for l in range(c["layers"]):
        p = f"model.layers.{l}."
        h = rms(x, W[p + "input_layernorm.weight"], c["eps"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(t, c["heads"], hd)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(t, c["kv_heads"], hd)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(t, c["kv_heads"], hd)
        q, k = rope_half(q, c["theta"]), rope_half(k, c["theta"])
        k, v = np.repeat(k, g, 1), np.repeat(v, g, 1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", s, v).reshape(t, -1) @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"], c["eps"])
        gg = h @ W[p + "mlp.gate_proj.weight"].T
        x = x + ((gg / (1 + np.exp(-gg))) * (h @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    return rms(x, W["model.norm.weight"], c["eps"]) @ W["lm_head.weight"].T


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    tok = train_tokenizer()
    vocab = tok.get_vocab_size()
    rng = np.random.default_rng(20261122)
    c = CFG
    d, f, kv = c["hidden"], c["ffn"], c["kv_heads"] * (c["hidden"] // c["heads"])
    W = {"model.embed_tokens.weight": rng.normal(0, 0.5, (vocab, d))}
    for l in range(c["layers"]):
        p = f"model.layers.{l}."
        W[p + "input_layernorm.weight"] = 1 + rng.normal(0, 0.1, d)
        W[p + "self_attn.q_proj.weight"] = rng.normal(0, 0.15, (d, d))
        W[p + "self_attn.k_proj.weight"] = rng.normal(0, 0.15, (kv, d))
        W[p + "self_attn.v_proj.weight"] = rng.normal(0, 0.15, (kv, d))
        W[p + "self_attn.o_proj.weight"] = rng.normal(0, 0.1, (d, d))
        W[p + "post_attention_layernorm.weight"] = 1 + rng.normal(0, 0.1, d)
        W[p + "mlp.gate_proj.weight"] = rng.normal(0, 0.1, (f, d))
        W[p + "mlp.up_proj.weight"] = rng.normal(0, 0.1, (f, d))
        W[p + "mlp.down_proj.weight"] = rng.normal(0, 0.1, (d, f))
    W["model.norm.weight"] = 1 + rng.normal(0, 0.1, d)
    W["lm_head.weight"] = rng.normal(0, 0.1, (vocab, d))
    W = {k: v.astype(np.float32) for k, v in W.items()}

    header, blobs, offset = {}, [], 0
    for name in sorted(W):
        b = W[name].astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(W[name].shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as fh:
        fh.write(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
        "intermediate_size": f, "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"], "vocab_size": vocab, "rms_norm_eps": c["eps"],
        "rope_theta": c["theta"], "tie_word_embeddings": False, "max_position_embeddings": 256,
        "torch_dtype": "float32",
    }
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    tok.save(os.path.join(out, "tokenizer.json"))
    W64 = {k: v.astype(np.float64) for k, v in W.items()}
    ref = {"prompts": []}
    for text in PROMPTS:
        ids = tok.encode(text).ids
        logits = forward(W64, np.array(ids))[-1]
        ref["prompts"].append({"text": text, "token_ids": ids, "logits": [float(v) for v in logits]})
        print(text, ids, int(np.argmax(logits)))
    with open(os.path.join(out, "reference.json"), "w") as fh:
        json.dump(ref, fh)


if __name__ == "__main__":
    main()
