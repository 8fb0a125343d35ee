#!/usr/bin/env bash
# Installs Debian packages the project needs, once: `protobuf-compiler`
# (protoc, for the etcd client's generated code) when the build needs it,
# `etcd-server` when a test or benchmark starts etcd. Idempotent and safe
# to call from several processes at once. Needs root (or password-less
# sudo) the first time only. On a host that runs systemd, Debian's package
# also enables a system etcd on 127.0.0.1:2379; the tests and benchmarks
# start their own on other ports.
#
# Usage: scripts/system-packages.sh PACKAGE...
set -euo pipefail
missing() {
    local out=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || out+=("$p")
    done
    echo "${out[@]}"
}
read -r -a want <<<"$(missing "$@")"
[ ${#want[@]} -eq 0 ] && exit 0
sudo=()
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null || ! sudo -n true 2>/dev/null; then
        echo "system-packages: ${want[*]} missing, and installing them needs root: sudo apt-get install ${want[*]}" >&2
        exit 1
    fi
    sudo=(sudo -n)
fi
# One install at a time (apt-get takes its own lock, and fails rather than
# wait): the lock lives in a folder of this user's own.
lockdir="${XDG_CACHE_HOME:-$HOME/.cache}/hatrain"
mkdir -p "$lockdir"
exec 9>>"$lockdir/system-packages.lock"
flock 9
read -r -a want <<<"$(missing "$@")"
[ ${#want[@]} -eq 0 ] && exit 0
echo "system-packages: installing ${want[*]} (once)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${want[@]}" >&2; then
    "${sudo[@]}" apt-get update -qq >&2
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${want[@]}" >&2
fi
