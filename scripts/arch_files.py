#!/usr/bin/env python3
"""Small GGUF files of each supported architecture, with seeded random weights, written with
the `gguf` package, quantised with llama.cpp's own quantiser, and llama.cpp's answers on them:
the reference the architecture test (tests/tests/e2e/architectures.rs) holds the Rust model to.

Usage: python scripts/arch_files.py OUT_DIR   (the python of scripts/llama-cpp-env.sh)

For every case and file type (F32, Q8_0, Q4_K_M) it writes `{case}.{type}.gguf` and
`{case}.{type}.logits` (f32, little-endian): llama.cpp's logits at every position from the last
prompt token on, while it decodes GREEDY tokens greedily one at a time (one thread, an f32 KV
cache). `index.json` lists the cases, the prompt, llama.cpp's greedy tokens and the smallest gap
between its best and second-best logit along the way (how far apart the greedy choices were).
"""
import ctypes
import json
import os
import sys

import numpy as np
import gguf
import llama_cpp

PROMPT = [5, 77, 130, 9, 200, 31, 64, 250]
# Text whose tokens (llama.cpp's, the file's own tokenizer) the test compares.
TEXT = "Hello there, it's 12345 and 3.14!\n\n  the end\tat last"
GREEDY = 32
# Tensor widths are multiples of 256 so that Q4_K_M quantises every matrix as K-quants.
HIDDEN, FFN, LAYERS, VOCAB_MERGES = 256, 512, 2, 40

CASES = {
    # Llama 3.x: grouped-query attention, rope frequency factors.
    "llama3": dict(arch="llama", pre="llama-bpe", heads=4, kv_heads=2, head_dim=64,
                   theta=500000.0, rope_factors=True),
    # Mistral 7B: the llama architecture with 4:1 grouped-query attention and a SentencePiece
    # tokenizer (Llama 1 and 2's too).
    "mistral": dict(arch="llama", tokenizer="llama", heads=4, kv_heads=1, head_dim=64,
                    theta=1000000.0),
    # Qwen2/2.5: biases on q, k and v; NeoX rope (half-split rows in the file).
    "qwen2": dict(arch="qwen2", pre="qwen2", heads=4, kv_heads=2, head_dim=64,
                  theta=1000000.0, bias=True),
    # Qwen3: RMSNorm on every q and k head; heads wider than hidden/heads.
    "qwen3": dict(arch="qwen3", pre="qwen2", heads=8, kv_heads=2, head_dim=64,
                  theta=1000000.0, qk_norm=True),
}

TYPES = {"F32": None, "Q8_0": 7, "Q4_K_M": 15}  # llama_ftype


def llama3_factors(theta, head_dim, factor, low, high, old):
    """Each pair's RoPE frequency divisor, as llama.cpp's converter writes `rope_freqs.weight`
    from a Hugging Face "llama3" rope_scaling."""
    freqs = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    f = np.where(wavelen < old / high, 1.0,
                 np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    return f.astype(np.float32)


def byte_tokens():
    """GPT-2's byte-to-unicode table: the 256 single-byte tokens of a byte-level BPE vocab."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def vocab():
    tokens = byte_tokens()
    merges = []
    letters = "etaoinsrhl"
    for a in "Ġ" + letters[:3]:
        for b in letters:
            if len(merges) < VOCAB_MERGES:
                merges.append(f"{a} {b}")
                tokens.append(a + b)
    # Digit merges: Llama 3's pre-tokenizer keeps "123" together, Qwen2's splits it.
    for a, b in [("1", "2"), ("12", "3")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    types = [1] * len(tokens)
    tokens += ["<|begin|>", "<|end|>"]
    types += [3, 3]
    return tokens, types, merges


def spm_vocab():
    """A SentencePiece vocabulary as Llama 2's and Mistral's GGUFs hold it: <unk>, <s>, </s>,
    the 256 byte tokens, then pieces with distinct scores (higher merges first). "H", the
    newline and the tab are in no piece: llama.cpp writes them as their bytes."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    chars = sorted(set(TEXT) - set("H\n\t "))
    merged = ["▁t", "he", "▁the", "er", "ere", "▁there", "ll", "▁a", "an",
              "▁an", "▁and", "12", "123", "▁1", "▁e", "nd", "▁end",
              "▁at", "as", "st", "▁last", "it", "▁it", "'s", "▁3", "14"]
    pieces = merged + ["▁"] + chars
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def write(path, name, c, rng):
    spm = c.get("tokenizer") == "llama"
    if spm:
        tokens, types, scores = spm_vocab()
    else:
        tokens, types, merges = vocab()
    n_vocab = len(tokens)
    hd, heads, kvh = c["head_dim"], c["heads"], c["kv_heads"]
    q_dim, kv_dim = heads * hd, kvh * hd
    w = gguf.GGUFWriter(path, c["arch"])
    w.add_name(f"random {name}")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_head_count(heads)
    w.add_head_count_kv(kvh)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(c["theta"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if spm:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(c["pre"])
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(n_vocab - 2)
        w.add_eos_token_id(n_vocab - 1)

    def mat(rows, cols, scale=1.0):
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def gain(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    # A separate LM head that maps each token's embedding onto a successor's (a seeded
    # permutation): greedy decoding walks its cycles with its choices far apart, so quantisation
    # cannot flip them, while every logit still carries the blocks' work (their comparison is
    # where the architecture's arithmetic is checked). The tied head (SmolLM2) is checked
    # against the numpy reference (tests/tests/e2e/reference_logits.rs).
    embed = rng.standard_normal((n_vocab, HIDDEN)).astype(np.float32)
    successor = rng.permutation(n_vocab)
    head = np.empty_like(embed)
    head[successor] = embed
    w.add_tensor("token_embd.weight", embed)
    w.add_tensor("output.weight", 0.1 * head + mat(n_vocab, HIDDEN))
    w.add_tensor("output_norm.weight", gain(HIDDEN))
    if c.get("rope_factors"):
        # Llama 3's factors for factor 8, low 1, high 4, and an original context of 32
        # positions (Llama 3.1's is 8192): short enough that the factors change the angles of
        # the 40 positions compared here.
        f = llama3_factors(c["theta"], hd, 8.0, 1.0, 4.0, 32)
        w.add_tensor("rope_freqs.weight", f)
    for i in range(LAYERS):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", gain(HIDDEN))
        w.add_tensor(b + "attn_q.weight", mat(q_dim, HIDDEN, 2.0))
        w.add_tensor(b + "attn_k.weight", mat(kv_dim, HIDDEN, 2.0))
        w.add_tensor(b + "attn_v.weight", mat(kv_dim, HIDDEN))
        if c.get("bias"):
            w.add_tensor(b + "attn_q.bias", (0.5 * rng.standard_normal(q_dim)).astype(np.float32))
            w.add_tensor(b + "attn_k.bias", (0.5 * rng.standard_normal(kv_dim)).astype(np.float32))
            w.add_tensor(b + "attn_v.bias", (0.5 * rng.standard_normal(kv_dim)).astype(np.float32))
        if c.get("qk_norm"):
            w.add_tensor(b + "attn_q_norm.weight", gain(hd))
            w.add_tensor(b + "attn_k_norm.weight", gain(hd))
        w.add_tensor(b + "attn_output.weight", mat(HIDDEN, q_dim))
        w.add_tensor(b + "ffn_norm.weight", gain(HIDDEN))
        w.add_tensor(b + "ffn_gate.weight", mat(FFN, HIDDEN))
        w.add_tensor(b + "ffn_up.weight", mat(FFN, HIDDEN))
        w.add_tensor(b + "ffn_down.weight", mat(HIDDEN, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return n_vocab


def quantize(src, dst, ftype):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama.cpp could not quantise {src} to {dst}")


def reference(path, n_vocab):
    """llama.cpp's logits from the last prompt token on while it decodes greedily."""
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_batch=64, n_threads=1,
                          n_threads_batch=1, logits_all=True, verbose=False, seed=0,
                          type_k=0, type_v=0)
    llm.eval(PROMPT)
    rows = [np.array(llm.scores[len(PROMPT) - 1], dtype=np.float32)]
    tokens = []
    for _ in range(GREEDY):
        nxt = int(np.argmax(rows[-1]))
        tokens.append(nxt)
        llm.eval([nxt])
        rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
    logits = np.stack(rows[:GREEDY])
    assert logits.shape == (GREEDY, n_vocab)
    top2 = np.sort(logits, axis=1)[:, -2:]
    text_ids = llm.tokenize(TEXT.encode(), add_bos=False, special=False)
    return logits, tokens, float((top2[:, 1] - top2[:, 0]).min()), text_ids


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    index = {"prompt": PROMPT, "greedy": GREEDY, "text": TEXT, "files": []}
    for seed, (name, c) in enumerate(CASES.items()):
        rng = np.random.default_rng(1000 + seed)
        src = os.path.join(out, f"{name}.F32.gguf")
        n_vocab = write(src, name, c, rng)
        for ty, ftype in TYPES.items():
            path = os.path.join(out, f"{name}.{ty}.gguf")
            if ftype is not None:
                quantize(src, path, ftype)
            logits, tokens, gap, text_ids = reference(path, n_vocab)
            logits.tofile(os.path.join(out, f"{name}.{ty}.logits"))
            index["files"].append({"case": name, "arch": c["arch"], "type": ty,
                                   "file": f"{name}.{ty}.gguf", "logits": f"{name}.{ty}.logits",
                                   "vocab": n_vocab, "tokens": tokens, "min_gap": gap,
                                   "text_ids": text_ids})
            print(f"{name:8} {ty:7} greedy {tokens[:8]}... smallest top-2 gap {gap:.3f}",
                  file=sys.stderr)
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)


if __name__ == "__main__":
    main()
