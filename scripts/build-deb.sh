#!/usr/bin/env bash
# Builds the Debian package build-deb/ckptfs_<version>_<arch>.deb and prints its path (the
# only line on stdout).
#
# The package gets a build folder of its own, configured from nothing each time: build/ is the
# developers' and the tests', and its CMake cache may hold anything (the test environment's
# python, test or sanitizer options), none of which belongs in what ships. The binaries are
# stripped when packed (packaging/CMakeLists.txt, CPACK_STRIP_FILES).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build-deb"
"$root/scripts/install-deps.sh"
rm -rf "$build"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_INSTALL_PREFIX=/usr \
  -DCKPTFS_BUILD_TESTS=OFF >/dev/null
cmake --build "$build" -j"$(nproc)" >&2
(cd "$build" && cpack -G DEB >&2)
ls "$build"/ckptfs_*.deb
