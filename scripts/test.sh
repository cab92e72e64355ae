#!/usr/bin/env bash
# Installs everything, builds, and runs every test: the Boost.Test unit tests and the
# Python suites (real torch / safetensors / transformers) through CTest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
venv=$("$root/scripts/setup-venv.sh")
"$root/scripts/build.sh" -DCKPTFS_PYTHON="$venv/bin/python"
cd "$root/build"
ctest --output-on-failure --timeout 1500 "$@"
