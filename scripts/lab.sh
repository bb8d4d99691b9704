#!/usr/bin/env bash
# The network lab (tests/src/lab): every node in its own network namespace, sites behind NAT,
# links with delay, rate and loss in user space. Linux, as root.
#   scripts/lab.sh up tests/lab/three-sites.toml     start a topology; prints each node's namespace
#   scripts/lab.sh exec three ei1 -- CMD…            run CMD as node ei1 of lab three
#   scripts/lab.sh shape three home-ei 25 20 1       give a site's link 25 ms, 20 Mbit/s, 1 % loss
#   scripts/lab.sh down three                        stop it: its processes, links and namespaces
#   scripts/lab.sh bench [--settings 25/0/100,…]     the mesh measured between sites (docs/perf.md)
# `up` also builds codedmesh; inside the lab run it as target/release/codedmesh.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "the lab needs root (network namespaces, TAP devices, nftables)" >&2; exit 1; }
need() {
  command -v "$1" >/dev/null && return
  apt-get install -y -q "$2" >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q "$2" >/dev/null; }
}
case "${1:-}" in
  up)
    [ $# = 2 ] || { echo "usage: scripts/lab.sh up TOPOLOGY.toml" >&2; exit 2; }
    need ip iproute2
    need nft nftables
    cargo build --release --locked -q -p tests --bin lab -p node-native --bin codedmesh
    exec target/release/lab up "$2" ;;
  down)
    [ $# = 2 ] || { echo "usage: scripts/lab.sh down NAME" >&2; exit 2; }
    exec target/release/lab down "$2" ;;
  shape)
    [ $# = 5 ] || [ $# = 6 ] || { echo "usage: scripts/lab.sh shape LAB SITE DELAY_MS RATE_MBIT [LOSS_PERCENT]" >&2; exit 2; }
    exec target/release/lab shape "$2" "$3" --delay-ms "$4" --rate-mbit "$5" --loss-percent "${6:-0}" ;;
  bench)
    shift
    need ip iproute2
    need nft nftables
    cargo build --release --locked -q -p tests --bin lab -p node-native --bin codedmesh
    exec target/release/lab bench "$@" ;;
  exec)
    [ $# -ge 4 ] && [ "$4" = -- ] || { echo "usage: scripts/lab.sh exec LAB NODE -- COMMAND…" >&2; exit 2; }
    ns="cm-$2-$3"; shift 4
    exec ip netns exec "$ns" "$@" ;;
  *) echo "usage: scripts/lab.sh up TOPOLOGY.toml | exec LAB NODE -- COMMAND… | shape LAB SITE MS MBIT [LOSS] | down LAB | bench [ARGS]" >&2; exit 2 ;;
esac
