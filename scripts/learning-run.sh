#!/usr/bin/env bash
# Measures learning on a local mesh of SmolLM2 (seed + 4 nodes, k = 3, n = 5, 127.0.0.1):
# held-out perplexity before and after N learning requests, the loss and the bytes each update
# puts on the wire, then what learning leaves behind: each node's disk beside its shard blob,
# and how long a node takes to restart from its data dir after that history.
#
#   bash scripts/learning-run.sh [--requests N] [--prompts FILE] [seed flags...]
#
# Without --prompts every request is "The capital of France is". With --prompts, request i
# continues the i-th entry of FILE (entries separated by lines holding only '%', as Debian's
# fortunes files are; the first 300 characters of each), and the mesh learns from the prompt and
# its own answer. Held-out text: Debian's fortunes `literature` file. Extra arguments go to
# `codedmesh seed` (e.g. --lr 1e-3, or --optimizer sgd --lr 1e-4 --accumulate 4 --momentum 0.5).
set -euo pipefail
cd "$(dirname "$0")/.."

requests=10
prompts=""
while [[ $# -gt 0 ]]; do
    case "$1" in
    --requests) requests="$2"; shift 2 ;;
    --prompts) prompts="$2"; shift 2 ;;
    *) break ;;
    esac
done

heldout=/usr/share/games/fortunes/literature
if [[ ! -f "$heldout" ]]; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
        apt-get install -y fortunes >/dev/null || { apt-get update -q >/dev/null && apt-get install -y fortunes >/dev/null; }
    else
        echo "held-out text $heldout is missing: install Debian's fortunes package" >&2
        exit 1
    fi
fi
if [[ -n "$prompts" && ! -f "$prompts" ]]; then
    echo "--prompts $prompts: no such file" >&2
    exit 1
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
start_node() { # index, log name
    "$bin" node --bootstrap "$boot" --data "$dir/d$1" --listen /ip4/127.0.0.1/tcp/0 --tcp-only \
        >"$dir/$2.log" 2>&1 &
    pids+=($!)
}
for i in 1 2 3 4; do start_node "$i" "n$i"; done
for i in 1 2 3 4; do wait_log "$dir/n$i.log" "serving row" 300; done

eval_ppl() {
    "$bin" eval --bootstrap "$boot" --file "$heldout" --chunk 64 --max-chunks 16 2>&1 |
        grep -i perplexity | tail -n 1
}
# Waits until every node holds one version, at least `$1` updates (all published ones that
# nodes took: a refused update is nowhere), for up to 5 minutes; prints that version's count.
wait_converged() {
    for _ in $(seq 1 300); do
        if "$bin" status --json --bootstrap "$boot" | python3 -c '
import json, sys
s = json.load(sys.stdin)
d = {n["version_digest"] for n in s["nodes"]}
ok = len(s["nodes"]) == 5 and len(d) == 1 and s["version_count"] >= int(sys.argv[1])
print(s["version_count"]) if ok else None
sys.exit(0 if ok else 1)
' "$1"; then
            return 0
        fi
        sleep 1
    done
    echo "the nodes did not converge on one version of $1 updates or more" >&2
    "$bin" status --bootstrap "$boot" >&2
    return 1
}

echo "held-out before: $(eval_ppl)"
began=$SECONDS
if [[ -z "$prompts" ]]; then
    "$bin" generate --bootstrap "$boot" --prompt "The capital of France is" --max-tokens 24 \
        --repeat "$requests" --keep-published "$dir/published" 2>"$dir/generate.log" >/dev/null
    grep -E "^(learned|update)" "$dir/generate.log"
else
    python3 - "$prompts" "$requests" >"$dir/prompts.txt" <<'EOF'
import sys
text = open(sys.argv[1], encoding="utf-8", errors="replace").read()
entries = [" ".join(e.split())[:300] for e in text.split("\n%\n") if e.strip()]
n = int(sys.argv[2])
for i in range(n):
    print(entries[i % len(entries)])
EOF
    i=0
    while IFS= read -r prompt; do
        i=$((i + 1))
        "$bin" generate --bootstrap "$boot" --prompt "$prompt" --max-tokens 32 \
            --keep-published "$dir/published" 2>>"$dir/generate.log" >/dev/null
        if ((i % 50 == 0)); then
            echo "request $i of $requests: $(grep -E '^learned' "$dir/generate.log" | tail -n 1) ($((SECONDS - began)) s)"
        fi
    done <"$dir/prompts.txt"
fi
published=$(find "$dir/published" -name '*.update' | wc -l)
echo "$requests requests, $published updates published in $((SECONDS - began)) s"
# Updates the nodes refused (the leader's log says why) are in no version.
refused=$(grep -c "taken by 0 of" "$dir/generate.log" || true)
applied=$(wait_converged $((published - refused)))
echo "every node holds one version of $applied updates"
echo "held-out after: $(eval_ppl)"
"$bin" status --bootstrap "$boot" | head -n 3

echo "disk per node (the shard blob; everything else in the data dir, manifest included):"
for i in 0 1 2 3 4; do
    blob=$(stat -c %s "$dir/d$i/shard.blob")
    all=$(du -sb "$dir/d$i" | cut -f1)
    python3 -c "import sys; b, a = int(sys.argv[1]), int(sys.argv[2]); print(f'  node {sys.argv[3]}: shard blob {b/2**20:.1f} MiB, the rest {(a-b)/2**20:.2f} MiB ({100*(a-b)/b:.1f}% of the blob)')" "$blob" "$all" "$i"
done

# A restart after that history: stop node 4 and start it again from its data dir.
kill "${pids[4]}"
wait "${pids[4]}" 2>/dev/null || true
t0=$(date +%s.%N)
start_node 4 "n4-restart"
wait_log "$dir/n4-restart.log" "serving row" 120
t1=$(date +%s.%N)
python3 -c "import sys; print(f'restart of node 4 after {sys.argv[3]} updates: serving its row {float(sys.argv[2]) - float(sys.argv[1]):.2f} s after it started')" "$t0" "$t1" "$published"
grep -E "shard at version" "$dir/n4-restart.log" || true
