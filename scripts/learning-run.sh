#!/usr/bin/env bash
# Measures learning on a local mesh of SmolLM2 (seed + 4 nodes, k = 3, n = 5, 127.0.0.1):
# held-out perplexity before and after, the loss on a repeated prompt, and the bytes each update
# puts on the wire. Extra arguments go to `codedmesh seed` (e.g. --accumulate 4 --momentum 0.5,
# or --rank 0 for exact f32 factors).
#
#   bash scripts/learning-run.sh [--requests N] [seed flags...]
set -euo pipefail
cd "$(dirname "$0")/.."

requests=10
if [[ "${1:-}" == "--requests" ]]; then
    requests="$2"
    shift 2
fi

heldout=/usr/share/games/fortunes/literature
if [[ ! -f "$heldout" ]]; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        apt-get install -y fortunes >/dev/null
    else
        echo "held-out text $heldout is missing: install Debian's fortunes package" >&2
        exit 1
    fi
fi

# The test command's build (same features), so it is reused rather than compiled again.
cargo build --workspace --all-targets --release --locked >&2
bin="${CARGO_TARGET_DIR:-target}/release/codedmesh"
"$bin" fetch-model >&2
dir="$(mktemp -d)"
pids=()
stop() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$dir"
}
trap stop EXIT

# A free port for the seed.
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
boot="/ip4/127.0.0.1/tcp/$port"
"$bin" seed --data "$dir/d0" --listen "$boot" --tcp-only "$@" >"$dir/n0.log" 2>&1 &
pids+=($!)
wait_log() { # file, text, seconds
    for _ in $(seq 1 "$3"); do
        grep -q "$2" "$1" 2>/dev/null && return 0
        sleep 1
    done
    echo "timed out waiting for '$2' in $1:" >&2
    cat "$1" >&2
    return 1
}
wait_log "$dir/n0.log" "serving row" 300
for i in 1 2 3 4; do
    "$bin" node --bootstrap "$boot" --data "$dir/d$i" --listen /ip4/127.0.0.1/tcp/0 --tcp-only \
        >"$dir/n$i.log" 2>&1 &
    pids+=($!)
done
for i in 1 2 3 4; do wait_log "$dir/n$i.log" "serving row" 300; done

eval_ppl() {
    "$bin" eval --bootstrap "$boot" --file "$heldout" --chunk 64 --max-chunks 8 2>&1 |
        grep -i perplexity | tail -n 1
}
echo "held-out before: $(eval_ppl)"
"$bin" generate --bootstrap "$boot" --prompt "The capital of France is" --max-tokens 24 \
    --repeat "$requests" 2>"$dir/generate.log" >/dev/null
grep -E "^(learned|update)" "$dir/generate.log"
sleep 3
echo "held-out after: $(eval_ppl)"
"$bin" status --bootstrap "$boot" | head -n 3
