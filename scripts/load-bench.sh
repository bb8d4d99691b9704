#!/usr/bin/env bash
# Load benchmark: `codedmesh up` (the default model, or --model PATH) on this machine, then 64
# concurrent streaming chat clients through the official openai client (scripts/load_bench.py),
# bounded in count (2 requests of 32 tokens each) and time (15 minutes); prints a Markdown
# table (docs/perf.md keeps the results). Any argument is passed to load_bench.py
# (--clients, --requests, --max-tokens, --time-limit, or --texts: greedy streams of
# `bench --speculate`'s three texts, each one's decode); UP_ARGS adds flags to `up`
# (e.g. UP_ARGS="--no-learning").
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/up-lib.sh load-bench
"$python" scripts/load_bench.py --base "$base" --model "$model" --pid "$up" "$@"
echo
echo "metrics after the run:"
curl -s "${base%/v1}/metrics" | grep -E '^codedmesh_((requests|requests_rejected|tokens_generated|updates_published|train_dropped|forward_steps|groups_formed|members_replaced)_total|train_backlog) ' || true
