# Sourced by the benches that run against a fresh `codedmesh up` (load-bench.sh,
# learning-bench.sh): builds the test command's binary, starts `up` on a free port with a
# scratch data dir (UP_ARGS adds flags), waits until it is ready, and on exit stops it and keeps
# its logs in $target/$1. Sets: python, target, up (its pid), base, model, bootstrap.
# Usage: source scripts/up-lib.sh LOGS_DIR_NAME
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
# The logs (up's, each node's) are kept in $target/$1; the mesh's data is not.
logs="$target/$1"
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
