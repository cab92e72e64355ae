#!/usr/bin/env bash
# Runs every benchmark (tests/bench/run_all.py) and prints the combined table.
#   scripts/bench.sh [--quick] [--only a,b,...] [--workdir DIR] [--keep] [--table]
# Sets up (once, cached) the test venv and a package folder with ratarmount
# (tests/bench/requirements.txt), builds ckptfs, then runs run_all.py as root.
#   CKPTFS_CACHE   where environments are kept (default ~/.cache/ckptfs)
#   CKPTFS_BIN     a ckptfs binary to benchmark instead of building build/ckptfs
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$("$root/scripts/setup-venv.sh")
req="$root/tests/bench/requirements.txt"
cache=${CKPTFS_CACHE:-$HOME/.cache/ckptfs}
pkgs="$cache/bench-pkgs-$(sha256sum "$req" | cut -c1-16)"
if [ ! -f "$pkgs/.complete" ]; then
  rm -rf "$pkgs"
  echo "bench.sh: installing $req into $pkgs" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check --target "$pkgs" -r "$req" >&2
  PYTHONPATH="$pkgs" "$venv/bin/python" -c "import ratarmount" >&2
  touch "$pkgs/.complete"
fi
command -v fuse-zip >/dev/null || echo "bench.sh: fuse-zip missing (scripts/install-deps.sh); (d) compares with ratarmount only" >&2
bin=${CKPTFS_BIN:-}
if [ -z "$bin" ]; then
  "$root/scripts/build.sh" >&2
  bin="$root/build/ckptfs"
fi
exec "$venv/bin/python" "$root/tests/bench/run_all.py" --ckptfs "$bin" --ratarmount-path "$pkgs" "$@"
