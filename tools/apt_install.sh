#!/usr/bin/env bash
# Install the Debian packages the tests use (tools/apt-packages.txt) when they are missing.
# Needs root (CI runs as root); elsewhere it says what is missing and the tests that
# need those packages skip with a stated reason.
set -euo pipefail
list="$(dirname "$0")/apt-packages.txt"
missing=()
while read -r pkg; do
    [ -n "$pkg" ] || continue
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done < "$list"
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "not root: cannot install ${missing[*]}; tests needing them will skip" >&2
    exit 0
fi
echo "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
