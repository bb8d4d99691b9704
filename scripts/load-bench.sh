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
python=$(bash scripts/python-env.sh)
# The test command's build (same features), so it is reused rather than compiled again.
cargo build --workspace --all-targets --release --locked
target=$(cargo metadata --format-version 1 --no-deps --locked |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
scratch=$(mktemp -d)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# A fresh mesh each run (the model itself is cached), so runs compare.
"$target/release/codedmesh" up --data "$scratch/mesh" --port "$port" --no-build-web ${UP_ARGS:-} \
  >"$scratch/up.out" 2>"$scratch/up.log" &
up=$!
# The logs (up's, each node's) are kept in target/load-bench/; the mesh's data is not.
logs="$target/load-bench"
stop() {
  kill -TERM "$up" 2>/dev/null || true
  wait "$up" 2>/dev/null || true
  rm -rf "$logs" && mkdir -p "$logs"
  cp "$scratch"/up.* "$scratch"/mesh/*.log "$logs"/ 2>/dev/null || true
  rm -rf "$scratch"
  echo "logs: $logs"
}
trap stop EXIT
for _ in $(seq 1 900); do
  grep -q '^ready: ' "$scratch/up.out" && break
  kill -0 "$up" 2>/dev/null || { cat "$scratch/up.log"; exit 1; }
  sleep 1
done
ready=$(grep '^ready: ' "$scratch/up.out") || { echo "up was not ready"; cat "$scratch/up.log"; exit 1; }
echo "$ready"
base=$(sed -n 's/.*OpenAI API \([^ ]*\).*/\1/p' <<<"$ready")
model=$(sed -n 's/.* model \([^ ]*\).*/\1/p' <<<"$ready")
"$python" scripts/load_bench.py --base "$base" --model "$model" --pid "$up" "$@"
echo
echo "metrics after the run:"
curl -s "${base%/v1}/metrics" | grep -E '^codedmesh_((requests|requests_rejected|tokens_generated|updates_published|train_dropped|forward_steps|groups_formed|members_replaced)_total|train_backlog) ' || true
