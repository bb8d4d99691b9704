#!/usr/bin/env bash
# Fuzzes every decoder of outside bytes in node-core (network messages, shard blobs, GGUF and
# safetensors headers, update payloads, manifests) with cargo-fuzz, RUNS executions each
# (default 1 000 000), with a 512 MiB allocation limit. Not part of CI. What libFuzzer finds is
# copied to node-core/fuzz/regressions/<target>/, which the test suite replays.
#
#   bash scripts/fuzz.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-1000000}"

rustup toolchain install nightly --profile minimal >&2
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    cargo install --locked cargo-fuzz >&2
fi

cd node-core/fuzz
status=0
for target in $(cargo +nightly fuzz list); do
    mkdir -p "corpus/$target" "regressions/$target"
    echo "==> $target ($runs runs)"
    if ! cargo +nightly fuzz run "$target" "corpus/$target" "regressions/$target" -- \
        -runs="$runs" -malloc_limit_mb=512 -rss_limit_mb=2048 -max_len=65536 \
        -print_final_stats=1 2>"corpus/$target.log"; then
        status=1
        echo "$target: FAILED (see node-core/fuzz/corpus/$target.log)"
        cp artifacts/"$target"/* "regressions/$target/" 2>/dev/null || true
    fi
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "corpus/$target.log" || true
done
exit "$status"
