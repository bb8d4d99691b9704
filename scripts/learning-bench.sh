#!/usr/bin/env bash
# Learning through the API: `codedmesh up` (learning on, fresh data dir) on this machine, then
# scripts/learning_bench.py: a passage taught N times (its perplexity before and after, held-out
# perplexity, the canary gate) and a poisoner; with --load, back-to-back chats and concurrent
# clients (throughput, share of requests trained on). UP_ARGS adds flags to `up` (e.g.
# UP_ARGS="--no-learning" for the throughput baseline). Prints a Markdown table
# (docs/perf.md keeps the results). Other arguments go to learning_bench.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/up-lib.sh learning-bench
"$python" scripts/learning_bench.py --base "$base" --model "$model" --bootstrap "$bootstrap" \
  --codedmesh "$target/release/codedmesh" "$@"
