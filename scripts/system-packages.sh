#!/usr/bin/env bash
# Installs Debian packages the project needs, once: `protobuf-compiler`
# (protoc, for the etcd client's generated code) when the build needs it,
# `etcd-server` when a test or benchmark starts etcd. Idempotent and safe
# to call from several processes at once. Needs root (or sudo) the first
# time only.
#
# Usage: scripts/system-packages.sh PACKAGE...
set -euo pipefail
missing=()
for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || {
        echo "system-packages: ${missing[*]} missing, and installing them needs root: apt-get install ${missing[*]}" >&2
        exit 1
    }
    sudo=(sudo)
fi
exec 9>/tmp/hatrain-system-packages.lock
flock 9
echo "system-packages: installing ${missing[*]} (once)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; then
    "${sudo[@]}" apt-get update -qq >&2
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
