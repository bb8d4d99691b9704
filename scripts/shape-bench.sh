#!/usr/bin/env bash
# Decode through the API against llama.cpp on the same GGUF file, in one run (issue 58's
# figure): llama.cpp's decode on 2 threads (scripts/llama-cpp-bench.py), then a fresh
# `codedmesh up --model FILE` (UP_ARGS adds flags, e.g. "--no-learning --draft 0") and one
# streaming client's requests through its API (scripts/load_bench.py); prints both and their
# ratio. Files of the real shapes: scripts/shape_files.py.
# Usage: bash scripts/shape-bench.sh FILE.gguf [--requests N] [--max-tokens N]
set -euo pipefail
cd "$(dirname "$0")/.."
file=$(realpath "${1:?usage: scripts/shape-bench.sh FILE.gguf [load_bench.py args]}")
shift
llama_python=$(bash scripts/llama-cpp-env.sh)
llama=$("$llama_python" scripts/llama-cpp-bench.py "$file" --tokens 32 --runs 3)
echo "$llama"
UP_ARGS="--model $file ${UP_ARGS:-}"
source scripts/up-lib.sh shape-bench
json=$(mktemp)
"$python" scripts/load_bench.py --base "$base" --model "$model" --pid "$up" --clients 1 \
  --requests 4 --max-tokens 32 --json "$json" "$@"
"$python" - "$json" "$llama" <<'PY'
import json, re, sys
rows = dict(json.load(open(sys.argv[1]))["rows"])
api = float(rows["decode after the first token, per stream"].split()[0])
cpp = float(re.search(r"decode \(\d+ tokens\) ([\d.]+) tok/s", sys.argv[2]).group(1))
print(f"\ndecode through the API {api:.1f} tok/s, llama.cpp {cpp:.1f} tok/s: {api / cpp:.2f}x")
PY
rm -f "$json"
