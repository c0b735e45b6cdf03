#!/usr/bin/env bash
# Provisions the packaging tools and prints the directory holding cargo-deb and
# cargo-generate-rpm (progress goes to stderr; only the directory to stdout).
#
#   cargo-deb, cargo-generate-rpm   pinned, `cargo install --locked` into <repo>/.tools/cargo
#                                   (a few minutes once; then found there)
#   rpm                             Debian's package, for checking the .rpm (rpm -qip,
#                                   rpm -K); installed with apt-get when run as root
#
# Set SLOTPOOL_SKIP_RPM_TOOLS=1 to skip the rpm package (building needs only the two
# cargo tools).
set -euo pipefail

CARGO_DEB="cargo-deb@3.8.0"
CARGO_GENERATE_RPM="cargo-generate-rpm@0.21.1"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="$repo/.tools/cargo"
bin="$root/bin"

log() { echo "packaging/tools.sh: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# True when $bin/$1 reports version $2.
has_version() {
    [ -x "$bin/$1" ] && "$bin/$1" --version 2>/dev/null | grep -qF "$2"
}

install_crate() { # crate@version binary
    local crate="$1" binary="$2"
    has_version "$binary" "${crate#*@}" && return 0
    log "installing $crate into $root"
    cargo install --quiet --locked --root "$root" "$crate" >&2 ||
        die "cargo install $crate failed (is the crates.io registry reachable?)"
    has_version "$binary" "${crate#*@}" || die "$crate installed but $bin/$binary reports another version"
}

mkdir -p "$repo/.tools"
# Serialise concurrent provisioning.
exec 9>"$repo/.tools/packaging.lock"
flock 9

install_crate "$CARGO_DEB" cargo-deb
install_crate "$CARGO_GENERATE_RPM" cargo-generate-rpm

if [ -z "${SLOTPOOL_SKIP_RPM_TOOLS:-}" ] && ! command -v rpm >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        log "installing rpm with apt-get"
        apt_get() { DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=300 "$@" >&2; }
        apt_get install -y --no-install-recommends rpm ||
            { apt_get update && apt_get install -y --no-install-recommends rpm; } ||
            die "apt-get install rpm failed"
    else
        die "rpm is missing: apt-get install rpm (or set SLOTPOOL_SKIP_RPM_TOOLS=1)"
    fi
fi

echo "$bin"
