#!/usr/bin/env bash
# apt_install.sh PACKAGE...: install Debian packages, or say what to install.
set -euo pipefail
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing $* from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
else
    echo "missing: $* (Debian: sudo apt-get install $*)" >&2
    exit 1
fi
