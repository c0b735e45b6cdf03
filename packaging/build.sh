#!/usr/bin/env bash
# Builds slotpool's packages into target/packages/ (or $SLOTPOOL_PACKAGES_DIR):
#
#   slotpool_<version>-1_<arch>.deb        slotpool-<version>-1.<arch>.rpm
#   slotpool-agent_<version>-1_<arch>.deb  slotpool-agent-<version>-1.<arch>.rpm
#   slotpool-provider-ec2_<version>-1_<arch>.deb  slotpool-provider-ec2-<version>-1.<arch>.rpm
#
#   packaging/build.sh                   release binaries (cargo build --release)
#   packaging/build.sh --profile dev     debug binaries, as the tests use
#   packaging/build.sh --no-build ...    package binaries built before, do not build
#   packaging/build.sh --bin-dir DIR     package the binaries in DIR (implies --no-build)
#   packaging/build.sh --fast ...        quick compression, bigger files (for tests)
#
# The slotpool package also carries its shell completions and manual pages, written here
# by the staged binary (`slotpool completions SHELL`, `slotpool man DIR`).
#
# Package metadata is in [package.metadata.deb] and [package.metadata.generate-rpm] of
# cli/Cargo.toml (package `slotpool`), agent/Cargo.toml (`slotpool-agent`) and
# provider-ec2/Cargo.toml (`slotpool-provider-ec2`); units,
# default configuration and maintainer scripts are in packaging/. The tools come from
# packaging/tools.sh.
#
# Both tools read binaries from <target-dir>/release/. build.sh hands them stripped
# copies of the chosen profile's binaries in a staging target dir, so any profile can be
# packaged (cargo-deb itself refuses dev builds) without touching target/<profile>/.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

profile=release
build=1
bin_dir=
fast=
while [ $# -gt 0 ]; do
    case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --profile=*) profile="${1#*=}"; shift ;;
    --release) profile=release; shift ;;
    --no-build) build=; shift ;;
    --bin-dir) bin_dir="$2"; build=; shift 2 ;;
    --fast) fast=1; shift ;;
    -h | --help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "packaging/build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

step() { echo "==> packaging: $*" >&2; }

tools="$(packaging/tools.sh)"
export PATH="$tools:$PATH"

if [ -n "$build" ]; then
    step "cargo build --profile $profile (slotpool, slotpool-agent, slotpool-provider-ec2)"
    cargo build --profile "$profile" -p slotpool-cli -p slotpool-agent -p slotpool-provider-ec2 --bins
fi

target_dir="${CARGO_TARGET_DIR:-$repo/target}"
case "$profile" in
dev) profile_dir="$target_dir/debug" ;;
*) profile_dir="$target_dir/$profile" ;;
esac
[ -z "$bin_dir" ] || profile_dir="$bin_dir"
out="${SLOTPOOL_PACKAGES_DIR:-$target_dir/packages}"
stage="$out/stage"

step "staging stripped binaries from $profile_dir"
rm -rf "$stage"
rm -f "$out"/slotpool*.deb "$out"/slotpool*.rpm
mkdir -p "$stage/release"
for bin in slotpool slotpool-agent slotpool-provider-ec2; do
    [ -x "$profile_dir/$bin" ] ||
        { echo "packaging/build.sh: $profile_dir/$bin is missing: build it, or drop --no-build" >&2; exit 1; }
    strip --strip-unneeded -o "$stage/release/$bin" "$profile_dir/$bin"
done

step "shell completions and manual pages"
"$stage/release/slotpool" completions bash >"$stage/release/slotpool.bash"
"$stage/release/slotpool" completions zsh >"$stage/release/_slotpool"
"$stage/release/slotpool" completions fish >"$stage/release/slotpool.fish"
"$stage/release/slotpool" man "$stage/release/man"
gzip -9n "$stage/release/man/"*.1

# cargo-deb finds the binaries through cargo's target dir; generate-rpm takes it as an
# option and resolves the other assets against the package directory it runs in.
# By default .deb data is xz and .rpm payload zstd -19: slow on big binaries.
deb_args=()
rpm_args=()
if [ -n "$fast" ]; then
    deb_args=(--fast)
    rpm_args=(--payload-compress gzip)
fi
for crate in cli agent provider-ec2; do
    step "cargo deb -p slotpool-$crate"
    CARGO_TARGET_DIR="$stage" cargo deb --quiet -p "slotpool-$crate" --no-build --no-strip "${deb_args[@]}" --output "$out/"
    step "cargo generate-rpm ($crate)"
    (cd "$crate" && cargo generate-rpm --target-dir "$stage" "${rpm_args[@]}" --output "$out/")
done

rm -rf "$stage"
step "done:"
ls -1 "$out"/*.deb "$out"/*.rpm
