#!/usr/bin/env bash
# Prints the path of a python3 with nats-py (and its nkeys extra) for the tests that run
# the Python examples of docs/protocol.md, provisioning a venv under <repo>/.tools/python if
# needed. Progress goes to stderr; only the path to stdout.
#
# The requirement is the one docs/protocol.md tells readers to install; tests/tests/docs_python.rs
# checks the two agree.
set -euo pipefail

REQUIREMENTS=("nats-py[nkeys]==2.16.0" "nkeys==0.2.1")

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.tools/python"
python="$venv/bin/python3"
stamp="$venv/.requirements"

log() { echo "nats-py.sh: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

if [ -x "$python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "${REQUIREMENTS[*]}" ]; then
    echo "$python"
    exit 0
fi

mkdir -p "$repo/.tools"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$repo/.tools/python.lock"
    flock 9
    if [ -x "$python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "${REQUIREMENTS[*]}" ]; then
        echo "$python"
        exit 0
    fi
fi

command -v python3 >/dev/null 2>&1 || die "python3 is needed (apt-get install python3 python3-venv)"
make_venv() {
    rm -rf "$venv"
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
        die "python3 -m venv failed: install python3-venv (apt-get install python3-venv)"
    fi
fi
log "installing ${REQUIREMENTS[*]}"
"$venv/bin/pip" install --disable-pip-version-check -q "${REQUIREMENTS[@]}" >&2 ||
    die "pip install ${REQUIREMENTS[*]} failed (is the PyPI registry reachable?)"
"$python" -c 'import nats, nkeys' || die "nats-py installed, but python cannot import nats and nkeys"
echo "${REQUIREMENTS[*]}" >"$stamp"
echo "$python"
