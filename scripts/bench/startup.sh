#!/usr/bin/env bash
# Start-up cost of the journal (docs/benchmarks.md, "Start-up"): fills a journal of N
# records once, then ROUNDS rounds of opens, the order of `full` (snapshot deleted,
# everything replayed) and `snapshot` (restored from the one at the head) alternated.
#
# Usage: scripts/bench/startup.sh N [ROUNDS] [DIR]
#   builds journal/examples/startup.rs (release) into $CARGO_TARGET_DIR (or target/);
#   the journal goes to DIR/jN (default /tmp/spindle-startup).
set -euo pipefail
N=$1
ROUNDS=${2:-3}
BASE=${3:-/tmp/spindle-startup}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cargo build --release -p spindle-journal --example startup --manifest-path "$ROOT/Cargo.toml"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/startup"
D="$BASE/j$N"
if [ ! -d "$D/journal" ]; then
    start=$(date +%s)
    "$BIN" fill "$D" "$N"
    echo "fill $N: $(( $(date +%s) - start )) s"
fi
du -sh "$D/journal"
"$BIN" open "$D" save
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) -eq 1 ]; then
        "$BIN" open "$D" snapshot; "$BIN" open "$D" full; "$BIN" open "$D" save
    else
        "$BIN" open "$D" full; "$BIN" open "$D" save; "$BIN" open "$D" snapshot
    fi
done
