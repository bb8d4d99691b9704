#!/usr/bin/env bash
# Runs the tests of one test file N times in a row (default 20), stopping at the first failure:
# how a flake is shown gone. Builds once (what `scripts/test.sh` builds), then runs the test
# binary directly, so nothing is rebuilt between runs. Each crate's integration tests are one
# binary (tests/tests/e2e, node-core/tests/native) with a module per file: TEST names the
# module, and only its tests run.
#
#   bash scripts/repeat-test.sh mesh_processes 20
#   CHROMEDRIVER=$(command -v chromedriver) bash scripts/repeat-test.sh browser 20
#   bash scripts/repeat-test.sh gpu 5
#
# The browser test needs the dashboard built first (bash scripts/build-web.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
test=${1:?usage: repeat-test.sh TEST [RUNS]}
runs=${2:-20}
# The crate directory and the test target that hold this module.
if [ -f "tests/tests/e2e/$test.rs" ]; then
  crate=tests target=e2e
elif [ -f "node-core/tests/native/$test.rs" ]; then
  crate=node-core target=native
else
  echo "no test file $test.rs in tests/tests/e2e or node-core/tests/native" >&2
  exit 1
fi
cargo build --workspace --all-targets --release --locked
bin=$(cargo test --workspace --release --locked --test "$target" --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
[ -x "$bin" ] || { echo "no test binary for $target" >&2; exit 1; }
logs=$(mktemp -d)
for i in $(seq 1 "$runs"); do
  started=$SECONDS
  if (cd "$crate" && "$bin" "$test::" >"$logs/run$i.log" 2>&1); then
    echo "run $i of $runs: ok ($((SECONDS - started)) s)"
  else
    echo "run $i of $runs: FAILED after $((SECONDS - started)) s; its output: $logs/run$i.log"
    exit 1
  fi
done
echo "$test passed $runs runs in a row"
