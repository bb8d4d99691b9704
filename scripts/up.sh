#!/usr/bin/env bash
# The quick start in one command: installs the toolchain rust-toolchain.toml pins (rustup does
# not always do it by itself), then runs `codedmesh up` with any arguments given here.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! rustup toolchain install >/dev/null 2>&1; then
  # Older rustup: name the pinned channel explicitly.
  channel=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' rust-toolchain.toml)
  rustup toolchain install "$channel" --profile minimal -c clippy,rustfmt -t wasm32-unknown-unknown
fi
exec cargo run --release --locked -p node-native -- up "$@"
