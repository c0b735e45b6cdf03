#!/usr/bin/env bash
# Runs the slotpool demo: a local nats-server, a launcher with the local provider, local
# agents and a small load generator, all on this machine. Ctrl-C stops everything.
#
#   scripts/demo.sh                      # until Ctrl-C
#   scripts/demo.sh --jobs 10 --duration 60
#
# Extra arguments go to `slotpool demo` (see `slotpool demo --help`).
# Needs: a Rust toolchain, and python3 with venv (for nats-server, see
# scripts/nats-server.sh) unless SLOTPOOL_NATS_SERVER points at a nats-server >= 2.11.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

echo "==> nats-server" >&2
SLOTPOOL_NATS_SERVER="$(scripts/nats-server.sh)"
export SLOTPOOL_NATS_SERVER

echo "==> cargo build --release --bins (the first build takes 6-13 minutes on 2 cores)" >&2
cargo build --release --bins

exec target/release/slotpool demo "$@"
