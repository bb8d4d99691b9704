#!/usr/bin/env bash
# Builds the dashboard (web-ui, Leptos) with trunk into web-ui/dist, which every native node
# serves at `/`, and the browser node's npm-style package (node-web, wasm-pack) into
# web-ui/dist/pkg, which web-ui/dist/embed.html uses. Installs trunk, wasm-pack and the
# wasm-bindgen-cli matching Cargo.lock once (each is a build from crates.io: minutes on 2
# cores), then reuses them. Run from anywhere in the repo.
set -euo pipefail
cd "$(dirname "$0")/.."

rustup target add wasm32-unknown-unknown >/dev/null 2>&1 || true
if ! command -v trunk >/dev/null; then
  echo "installing trunk (once; a build from crates.io)"
  cargo install --locked -q trunk
fi
if ! command -v wasm-pack >/dev/null; then
  echo "installing wasm-pack (once; a build from crates.io)"
  cargo install --locked -q wasm-pack
fi
# trunk and wasm-pack run wasm-bindgen; it must be the release of the wasm-bindgen crate in Cargo.lock.
wasm_bindgen=$(sed -n '/^name = "wasm-bindgen"$/{n;s/^version = "\(.*\)"/\1/p}' Cargo.lock)
if ! wasm-bindgen --version 2>/dev/null | grep -q " $wasm_bindgen\b"; then
  echo "installing wasm-bindgen-cli $wasm_bindgen (once)"
  cargo install --locked -q wasm-bindgen-cli --version "$wasm_bindgen"
fi
(cd web-ui && trunk build --release --locked)
echo "built the dashboard into web-ui/dist"
# `--mode no-install`: the wasm-bindgen above, never one downloaded from GitHub.
wasm-pack --quiet build node-web --release --target web --mode no-install \
  --out-dir ../web-ui/dist/pkg -- --locked
echo "built the browser node's package into web-ui/dist/pkg"
