#!/usr/bin/env bash
# Prints the path of a moto_server binary (moto's server mode: an EC2 API on loopback,
# which the ec2 provider's tests point the AWS SDK at), provisioning it under
# <repo>/.tools/moto if needed. Progress goes to stderr; only the path to stdout.
#
# Order:
#   1. $SLOTPOOL_MOTO_SERVER, if set (used as it is);
#   2. <repo>/.tools/moto/bin/moto_server, if present and of the pinned version;
#   3. a python venv at <repo>/.tools/moto with the pinned moto[server] from PyPI.
set -euo pipefail

VERSION="5.2.1"
PACKAGE="moto[server]==$VERSION"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.tools/moto"
bin="$venv/bin/moto_server"

log() { echo "moto-server.sh: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# The moto version installed in the venv, or nothing.
installed_version() {
    "$venv/bin/python" -c 'import moto; print(moto.__version__)' 2>/dev/null || true
}

if [ -n "${SLOTPOOL_MOTO_SERVER:-}" ]; then
    [ -x "$SLOTPOOL_MOTO_SERVER" ] || die "SLOTPOOL_MOTO_SERVER=$SLOTPOOL_MOTO_SERVER is not an executable file"
    echo "$SLOTPOOL_MOTO_SERVER"
    exit 0
fi

if [ -x "$bin" ] && [ "$(installed_version)" = "$VERSION" ]; then
    echo "$bin"
    exit 0
fi

# Serialise concurrent provisioning (several test processes on a clean checkout).
mkdir -p "$repo/.tools"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$repo/.tools/moto.lock"
    flock 9
    if [ -x "$bin" ] && [ "$(installed_version)" = "$VERSION" ]; then
        echo "$bin"
        exit 0
    fi
fi

command -v python3 >/dev/null 2>&1 ||
    die "python3 is needed to install moto (apt-get install python3 python3-venv), or set SLOTPOOL_MOTO_SERVER"

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
        die "python3 -m venv failed: install python3-venv (apt-get install python3-venv), or set SLOTPOOL_MOTO_SERVER"
    fi
fi
[ -x "$venv/bin/pip" ] ||
    die "the venv at $venv has no pip: install python3-venv and python3-pip (apt-get install python3-venv python3-pip)"

log "installing $PACKAGE"
"$venv/bin/pip" install --disable-pip-version-check -q "$PACKAGE" >&2 ||
    die "pip install $PACKAGE failed (is the PyPI registry reachable?); or set SLOTPOOL_MOTO_SERVER"

[ -x "$bin" ] || die "$PACKAGE installed but $bin is missing"
[ "$(installed_version)" = "$VERSION" ] || die "installed moto reports version '$(installed_version)', expected $VERSION"
log "installed moto $VERSION"
echo "$bin"
