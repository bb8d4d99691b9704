#!/usr/bin/env bash
# Makes (once) a Python virtual environment in target/llama-py with llama.cpp (llama-cpp-python,
# built from source: AVX2, AVX-512 where the CPU has it, never AMX) and the
# `gguf` package, pinned, and prints the path of its python. The architecture tests write small
# GGUF files with `gguf`, quantise them with llama.cpp's own quantiser and compare against its
# logits; the shape-file script and the llama.cpp benchmark use it too. The first build takes
# about 8 minutes on 2 cores; later runs reuse it. Run from anywhere in the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/llama-py
# Pinned: the releases the architecture tests were written against.
llama=0.3.36
gguf=0.19.0
# AVX2 always; AVX-512 where this CPU has it (a build with it dies on "illegal instruction"
# elsewhere); never AMX, which crashes on these machines. No llava/mtmd (multimodal) library:
# nothing here uses it, and llama_cpp imports it only when a multimodal chat handler is made.
flags="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DLLAVA_BUILD=OFF"
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  flags="$flags -DGGML_AVX512=ON"
else
  flags="$flags -DGGML_AVX512=OFF"
fi
stamp="llama-cpp-python==$llama gguf==$gguf $flags"
check="import llama_cpp, gguf, numpy; assert llama_cpp.__version__ == '$llama'"
if ! "$venv/bin/python" -c "$check" 2>/dev/null || [ "$(cat "$venv/stamp" 2>/dev/null)" != "$stamp" ]; then
  mkdir -p target
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  echo "building llama.cpp $llama from source with $flags (about 8 minutes on 2 cores) ..." >&2
  CMAKE_ARGS="$flags" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
      "llama-cpp-python==$llama" "gguf==$gguf" numpy >&2
  "$venv/bin/python" -c "$check" >&2
  echo "$stamp" > "$venv/stamp"
fi
echo "$PWD/$venv/bin/python"
