#!/usr/bin/env bash
# The red team as a benchmark: runs the red-team test (tests/tests/e2e/red_team.rs: `up` on the
# tiny model, a client streaming throughout, a stranger's peer attacking it) RUNS times
# (default 1) and prints, for each run, the client's stream before and during the attacks and
# their ratio, and the largest resident memory of any node.
#
#   bash scripts/red-team-bench.sh 3
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-1}
cargo build --workspace --all-targets --release --locked
printf '%-4s %13s %14s %7s %13s %7s %9s\n' run 'calm tok/s' 'attacks tok/s' ratio 'a liar tok/s' ratio 'peak MiB'
for run in $(seq 1 "$runs"); do
  out=$(cargo test --workspace --release --locked --test e2e red_team -- --nocapture 2>&1) || {
    echo "$out" | tail -40
    exit 1
  }
  line=$(echo "$out" | grep 'red team: the client' | tail -1)
  calm=$(echo "$line" | sed -n 's/.*stream \([0-9.]*\) tok\/s before.*/\1/p')
  net=$(echo "$line" | sed -n 's/.*, \([0-9.]*\) tok\/s under the network.*/\1/p')
  liar=$(echo "$line" | sed -n 's/.*, \([0-9.]*\) tok\/s while a member.*/\1/p')
  peak=$(echo "$line" | sed -n 's/.*peak node memory \([0-9]*\) MiB.*/\1/p')
  r1=$(python3 -c "print(f'{$net / $calm:.2f}')")
  r2=$(python3 -c "print(f'{$liar / $calm:.2f}')")
  printf '%-4s %13s %14s %7s %13s %7s %9s\n' "$run" "$calm" "$net" "$r1" "$liar" "$r2" "$peak"
done
