#!/usr/bin/env bash
# Creates (once) a Python virtual environment the tests use and prints its path.
#
#   scripts/setup-venv.sh          the base environment: tests/requirements.txt
#   scripts/setup-venv.sh NAME     an overlay: tests/requirements-NAME.txt on top of the base
#
# Environments live outside the clone, keyed by the hash of their requirements, so a fresh
# clone on a machine that already ran the tests reuses them, and changing a requirements file
# builds a new one. torch is large: it is downloaded once per cache.
#
# An overlay holds framework versions the base cannot (transformers 4 beside 5, megatron-core
# that wants numpy 1): its own site-packages come first on sys.path and the base's follow
# (a .pth file), so it shares the base's torch and shadows only what it pins. It is installed
# with --no-deps: its file lists every package it adds, pinned, so what the tests ran against
# is written down. A line `# import: a b c` names the modules that must import afterwards.
#   CKPTFS_CACHE  where environments are kept (default ~/.cache/ckptfs)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${CKPTFS_CACHE:-$HOME/.cache/ckptfs}
base_req="$root/tests/requirements.txt"
base="$cache/venv-$(sha256sum "$base_req" | cut -c1-16)"

if [ ! -f "$base/.complete" ]; then
  # A half-built environment (interrupted download) has no marker: start over.
  rm -rf "$base"
  mkdir -p "$cache"
  echo "setup-venv: creating $base (the first run on a machine downloads torch)" >&2
  /usr/bin/python3 -m venv "$base" >&2
  "$base/bin/pip" install --quiet --disable-pip-version-check -r "$base_req" >&2
  "$base/bin/python" -c "import torch, safetensors, numpy, pytest" >&2
  touch "$base/.complete"
fi
if [ $# -eq 0 ]; then
  echo "$base"
  exit 0
fi

name=$1
req="$root/tests/requirements-$name.txt"
if [ ! -f "$req" ]; then
  echo "setup-venv: no overlay '$name' (no $req)" >&2
  exit 2
fi
venv="$cache/venv-$name-$(cat "$base_req" "$req" | sha256sum | cut -c1-16)"
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  echo "setup-venv: creating overlay $venv" >&2
  /usr/bin/python3 -m venv "$venv" >&2
  own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  shared=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # Processed after the overlay's own packages, so the base's come second.
  echo "$shared" > "$own/zz-ckptfs-base.pth"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -r "$req" >&2
  imports=$(sed -n 's/^# import: *//p' "$req" | tr ' ' ',')
  if [ -n "$imports" ]; then
    "$venv/bin/python" -c "import $imports" >&2
  fi
  touch "$venv/.complete"
fi
echo "$venv"
