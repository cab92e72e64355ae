#!/usr/bin/env bash
# Builds the Debian package build/ckptfs_<version>_<arch>.deb.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh" -DCMAKE_INSTALL_PREFIX=/usr
cd "$root/build"
cpack -G DEB >&2
ls "$root"/build/ckptfs_*.deb
