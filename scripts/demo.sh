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
# As root, the slots are Unix users with SSH logins (openssh-server, installed when
# missing); see README.md for the second terminal.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

# As root the demo's slots are Unix users that log in through an sshd of the demo's own:
# Debian's openssh-server, installed here when missing without starting the system's.
if [ "$(id -u)" -eq 0 ] && [ ! -x /usr/sbin/sshd ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> openssh-server (for logins into the demo's slots; the system sshd is not started)" >&2
    made_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends openssh-server openssh-client; } >&2 ||
        echo "==> could not install openssh-server: the demo's slots will be directories" >&2
    if [ -n "$made_policy" ]; then rm -f /usr/sbin/policy-rc.d; fi
fi

echo "==> nats-server" >&2
SLOTPOOL_NATS_SERVER="$(scripts/nats-server.sh)"
export SLOTPOOL_NATS_SERVER

echo "==> cargo build --release --bins (the first build takes 6-13 minutes on 2 cores)" >&2
cargo build --release --bins

exec target/release/slotpool demo "$@"
