#!/usr/bin/env bash
# The project's test command: sets up what it needs, then checks formatting, lints (native and
# wasm32) and runs every test, natively and (the WebGPU kernels) in headless Chromium. Run from
# anywhere in the repository.
set -euo pipefail
cd "$(dirname "$0")/.."

began=$SECONDS
skipped=()
# Any non-empty CI is CI: there a missing tool fails the run, naming it, instead of skipping.
in_ci() { [ -n "${CI:-}" ]; }
# Every test's output also goes to $results, and each check a test skips (outside CI) is a line
# of $CODEDMESH_SKIPS (tests::procs::skip): the closing line counts both.
results=$(mktemp)
export CODEDMESH_SKIPS
CODEDMESH_SKIPS=$(mktemp)
trap 'rm -f "$results" "$CODEDMESH_SKIPS"' EXIT
step() { printf '\n==> %s (at %dm%02ds)\n' "$*" $(((SECONDS - began) / 60)) $(((SECONDS - began) % 60)); }
# The closing line (after $1): tests passed and failed (cargo's "test result:" lines in $results) and
# checks skipped (by a test, or by this script), each skip named above it.
summary() {
  local counts skips=()
  counts=$(awk '/^test result:/ { for (i = 1; i < NF; i++) { if ($(i + 1) ~ /^passed/) p += $i; if ($(i + 1) ~ /^failed/) f += $i } }
    END { print p + 0, f + 0 }' "$results")
  mapfile -t skips <"$CODEDMESH_SKIPS"
  skips+=(${skipped[@]+"${skipped[@]}"})
  echo
  for s in ${skips[@]+"${skips[@]}"}; do echo "SKIPPED: $s"; done
  read -r passed failed <<<"$counts"
  echo "${1:-}$passed passed, $failed failed, ${#skips[@]} skipped"
}
# Runs a test command with its output also in $results; a failure ends the run after the
# closing line.
run_tests() {
  local rc=0
  "$@" 2>&1 | tee -a "$results" || rc=$?
  if [ "$rc" -ne 0 ]; then
    summary
    exit "$rc"
  fi
}

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
  elif in_ci; then
    echo "CI needs Mesa's lavapipe (mesa-vulkan-drivers) for the GPU tests, and cannot install it without root apt-get" >&2
    exit 1
  else
    # The GPU tests then skip their GPU halves, each counted in the closing line.
    echo "no lavapipe and no root apt-get: the GPU halves of the tests will be skipped (install mesa-vulkan-drivers)"
  fi
fi

step "nftables for the network lab's NAT (tests/src/lab; the lab test needs root)"
if ! command -v nft >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if ! apt-get install -y -q nftables >/dev/null; then
      apt-get update -q >/dev/null
      apt-get install -y -q nftables >/dev/null
    fi
  elif in_ci; then
    echo "CI needs nftables (nft) for the network lab's NAT, and cannot install it without root apt-get" >&2
    exit 1
  else
    # The lab's tests then skip, each counted in the closing line.
    echo "no nft and no root apt-get: the network lab's tests will be skipped (install nftables)"
  fi
fi

step "headless Chromium and wasm-bindgen's test runner (the wasm and browser tests)"
if ! command -v chromedriver >/dev/null || ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if ! apt-get install -y -q chromium chromium-driver >/dev/null; then
      apt-get update -q >/dev/null
      apt-get install -y -q chromium chromium-driver >/dev/null
    fi
  fi
fi
# The runner must be the release of the wasm-bindgen in Cargo.lock.
wasm_bindgen=$(sed -n '/^name = "wasm-bindgen"$/{n;s/^version = "\(.*\)"/\1/p}' Cargo.lock)
if ! wasm-bindgen-test-runner --version 2>/dev/null | grep -q " $wasm_bindgen\b"; then
  cargo install --locked -q wasm-bindgen-cli --version "$wasm_bindgen"
fi

step "the dashboard (web-ui) and the browser node's package: native nodes serve them, the browser test opens them"
# Two builds at once, as two `up`s started together in one checkout run them: the second waits
# for the first, and web-ui/dist is whole after both.
bash scripts/build-web.sh &
first_build=$!
bash scripts/build-web.sh
wait "$first_build"
for f in index.html web-ui.js web-ui_bg.wasm embed.html pkg/node_web.js pkg/node_web_bg.wasm pkg/package.json; do
  if [ ! -s "web-ui/dist/$f" ]; then
    echo "two builds of the dashboard at once left web-ui/dist without $f" >&2
    exit 1
  fi
done

step "cargo fmt --check"
cargo fmt --all -- --check

step "the house rules: no import cycle, no source file over 900 lines, README and docs/perf.md within their lengths"
python3 scripts/house.py

step "cargo deny: licences, duplicate versions and sources of every dependency (deny.toml); advisories where their database can be fetched"
# Built once from crates.io (about 3 minutes on 2 cores), then kept in cargo's bin folder.
deny_version=0.20.2
if ! cargo deny --version 2>/dev/null | grep -q " $deny_version$"; then
  cargo install --locked -q cargo-deny --version "$deny_version"
fi
cargo deny --locked check bans licenses sources
# The advisory database is a git repository on github.com, which some machines cannot reach.
if cargo deny --locked fetch db >/dev/null 2>&1; then
  cargo deny --locked check advisories
else
  skipped+=("cargo deny check advisories: the advisory database (github.com/RustSec/advisory-db) cannot be fetched from here")
fi

step "clippy (native, all targets, -D warnings)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "clippy (wasm32: node-core, the browser node, the dashboard)"
# Both name all three packages, so they resolve one set of features and check each dependency
# once. node-core's unit tests and example are native-only, so it gets its lib and webgpu test.
cargo clippy -p node-core -p node-web -p web-ui --target wasm32-unknown-unknown --lib --test webgpu --locked -- -D warnings
cargo clippy -p node-web -p web-ui --target wasm32-unknown-unknown --all-targets --locked -- -D warnings

step "every test and the codedmesh binary (the multi-process tests run it), in one build"
# One feature resolution for all of them (dev-dependencies included), so `cargo test` below
# reuses this build instead of compiling the workspace a second time.
cargo build --workspace --all-targets --release --locked
target=$(cargo metadata --format-version 1 --no-deps --locked |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')

step "the default model (fetched once, then cached)"
"$target/release/codedmesh" fetch-model

step "the official openai Python client (the API test drives the API with it)"
export CODEDMESH_PYTHON
CODEDMESH_PYTHON=$(bash scripts/python-env.sh)

step "llama.cpp, built from source once (about 8 minutes on 2 cores, then cached in target/llama-py): the architecture tests compare with it"
export CODEDMESH_LLAMA_PYTHON
CODEDMESH_LLAMA_PYTHON=$(bash scripts/llama-cpp-env.sh)

step "tests"
# A failed test's error is the last thing it prints: no backtrace captured into it to bury it
# (where the output is cut to its tail). Panics still follow RUST_BACKTRACE.
export RUST_LIB_BACKTRACE=0
run_tests cargo test --workspace --locked --release

step "wasm tests in headless Chromium: WebGPU kernels, the browser node, the dashboard's components"
if command -v chromedriver >/dev/null; then
  export CHROMEDRIVER
  CHROMEDRIVER=$(command -v chromedriver)
  # A whole token on SwiftShader's WebGPU takes ~25 s here; the runner's default is 20 s.
  export WASM_BINDGEN_TEST_TIMEOUT=${WASM_BINDGEN_TEST_TIMEOUT:-180}
  # The same packages as scripts/build-web.sh and the next command, so the three resolve one set
  # of features and share their compiled dependencies: only the test crates are compiled here.
  run_tests cargo test -p node-core -p node-web -p web-ui --target wasm32-unknown-unknown --test webgpu --locked --release
  run_tests cargo test -p node-web -p web-ui --target wasm32-unknown-unknown --locked --release
else
  if in_ci; then
    echo "CI needs chromium and chromium-driver for the wasm and browser tests" >&2
    exit 1
  fi
  skipped+=("the wasm tests in headless Chromium: no chromium-driver (install chromium and chromium-driver)")
fi

summary "all checks passed: "
