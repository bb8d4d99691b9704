#!/usr/bin/env bash
# Builds the dashboard (web-ui, Leptos) into web-ui/dist, which every native node serves at `/`,
# and the browser node's npm-style package (node-web) into web-ui/dist/pkg, which
# web-ui/dist/embed.html uses. Cargo builds both for wasm32; wasm-bindgen-cli (the release of
# the wasm-bindgen crate in Cargo.lock, installed once from crates.io: a few minutes on 2
# cores) writes their JavaScript bindings. No other tool: trunk and wasm-pack did the same
# work, and installing them took most of a fresh machine's set-up. Run from anywhere in the repo.
set -euo pipefail
cd "$(dirname "$0")/.."

# One build at a time in a checkout: two `up`s started together each run this script, and two
# builds sharing a folder left web-ui/dist without index.html. The second waits, then finds
# cargo's work done and swaps in its own whole copy.
if command -v flock >/dev/null; then
  mkdir -p target
  exec 9>target/build-web.lock
  if ! flock -n 9; then
    echo "another build of the dashboard is running in this checkout: waiting for it"
    flock 9
  fi
fi

rustup target add wasm32-unknown-unknown >/dev/null 2>&1 || true
wasm_bindgen=$(sed -n '/^name = "wasm-bindgen"$/{n;s/^version = "\(.*\)"/\1/p}' Cargo.lock)
if ! wasm-bindgen --version 2>/dev/null | grep -q " $wasm_bindgen\b"; then
  echo "installing wasm-bindgen-cli $wasm_bindgen (once; a build from crates.io)"
  cargo install --locked -q wasm-bindgen-cli --version "$wasm_bindgen"
fi
# `--examples` (neither package has one) makes cargo resolve features as `cargo test` does, with
# the dev-dependencies' (wasm-bindgen-test turns on num-traits/libm and serde_json/alloc). So
# the wasm tests of scripts/test.sh reuse this build: without it they compiled everything above
# those two crates again (nalgebra, tokenizers, leptos, server_fn, node-core, the two packages).
cargo build --release --locked --target wasm32-unknown-unknown -p web-ui -p node-web --lib --bins --examples
target_dir=$(cargo metadata --format-version 1 --no-deps --locked |
  sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
wasm="$target_dir/wasm32-unknown-unknown/release"

# Built beside the old dist and swapped in at the end: a node serving it never sees half.
out=web-ui/dist.new
rm -rf "$out"
mkdir -p "$out/pkg"
wasm-bindgen --target web --no-typescript --out-dir "$out" --out-name web-ui "$wasm/web-ui.wasm"
cp web-ui/index.html web-ui/style.css web-ui/embed.html "$out/"
echo "built the dashboard"

wasm-bindgen --target web --out-dir "$out/pkg" "$wasm/node_web.wasm"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
cat >"$out/pkg/package.json" <<JSON
{
  "name": "node-web",
  "type": "module",
  "description": "Coded Mesh browser node (wasm): node-core in the browser, dialing native nodes.",
  "version": "$version",
  "license": "MIT OR Apache-2.0",
  "files": ["node_web_bg.wasm", "node_web.js", "node_web.d.ts"],
  "main": "node_web.js",
  "types": "node_web.d.ts",
  "sideEffects": ["./snippets/*"]
}
JSON
echo "built the browser node's package"

rm -rf web-ui/dist.old
if [ -d web-ui/dist ]; then mv web-ui/dist web-ui/dist.old; fi
mv "$out" web-ui/dist
rm -rf web-ui/dist.old
echo "web-ui/dist is ready"
