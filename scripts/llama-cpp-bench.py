#!/usr/bin/env python3
"""llama.cpp's decode and prefill speed on the same GGUF file and prompt as `codedmesh bench`,
for the side-by-side table in docs/perf.md. Not part of the tests: llama.cpp is installed
outside the repository (`pip install llama-cpp-python` builds it from source).

Usage: python3 scripts/llama-cpp-bench.py MODEL.gguf [--threads N] [--tokens 32] [--runs 3]
Prints best-of-runs prefill and decode tokens/s; decode is timed as the difference between a
(tokens + 1)-token completion and a 1-token one, both greedy, from the same prompt.
"""
import argparse
import time

from llama_cpp import Llama

# node-native/src/main.rs, BENCH_TEXT: the prompt `codedmesh bench` encodes.
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when "
    "Johannes Gutenberg combined movable metal type, oil-based ink and a "
    "screw press into a system that could produce books far faster than "
    "scribes."
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    llm = Llama(model_path=a.model, n_threads=a.threads, n_ctx=512, verbose=False, seed=0)
    n_prompt = len(llm.tokenize(PROMPT.encode()))

    def timed(max_tokens):
        llm.reset()
        t = time.perf_counter()
        out = llm.create_completion(PROMPT, max_tokens=max_tokens, temperature=0.0)
        return time.perf_counter() - t, out["usage"]["completion_tokens"]

    timed(1)
    best_prefill, best_decode = 0.0, 0.0
    for _ in range(a.runs):
        t1, _ = timed(1)
        tn, n = timed(a.tokens + 1)
        best_prefill = max(best_prefill, n_prompt / t1)
        if n > 1 and tn > t1:
            best_decode = max(best_decode, (n - 1) / (tn - t1))
    print(f"llama.cpp, {a.threads} threads: prefill ({n_prompt} tokens) {best_prefill:.1f} tok/s, "
          f"decode ({a.tokens} tokens) {best_decode:.1f} tok/s")


if __name__ == "__main__":
    main()
