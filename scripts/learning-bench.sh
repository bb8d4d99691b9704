#!/usr/bin/env bash
# Learning through the API: `codedmesh up` (learning on, fresh data dir) on this machine, then
# scripts/learning_bench.py: a passage taught N times (its perplexity before and after, held-out
# perplexity, the canary gate) and a poisoner; with --load, back-to-back chats and concurrent
# clients (throughput, share of requests trained on). UP_ARGS adds flags to `up` (e.g.
# UP_ARGS="--no-learning" for the throughput baseline). Prints a Markdown table
# (docs/perf.md keeps the results). Other arguments go to learning_bench.py.
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(bash scripts/python-env.sh)
# The test command's build (same features), so it is reused rather than compiled again.
cargo build --workspace --all-targets --release --locked
target=$(cargo metadata --format-version 1 --no-deps --locked |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
scratch=$(mktemp -d)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$target/release/codedmesh" up --data "$scratch/mesh" --port "$port" --no-build-web ${UP_ARGS:-} \
  >"$scratch/up.out" 2>"$scratch/up.log" &
up=$!
logs="$target/learning-bench"
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
bootstrap=$(sed -n 's/.* bootstrap \([^ ]*\).*/\1/p' <<<"$ready")
"$python" scripts/learning_bench.py --base "$base" --model "$model" --bootstrap "$bootstrap" \
  --codedmesh "$target/release/codedmesh" "$@"
