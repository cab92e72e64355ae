#!/usr/bin/env bash
# Creates (once) the Python virtual environment the tests use and prints its path.
#
# The environment lives outside the clone, keyed by the hash of tests/requirements.txt,
# so a fresh clone on a machine that already ran the tests reuses it, and changing the
# requirements builds a new one. torch is large: it is downloaded once per cache.
#   CKPTFS_CACHE  where environments are kept (default ~/.cache/ckptfs)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
req="$root/tests/requirements.txt"
cache=${CKPTFS_CACHE:-$HOME/.cache/ckptfs}
key=$(sha256sum "$req" | cut -c1-16)
venv="$cache/venv-$key"

if [ ! -f "$venv/.complete" ]; then
  # A half-built environment (interrupted download) has no marker: start over.
  rm -rf "$venv"
  mkdir -p "$cache"
  echo "setup-venv: creating $venv (the first run on a machine downloads torch)" >&2
  /usr/bin/python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req" >&2
  "$venv/bin/python" -c "import torch, safetensors, numpy, pytest" >&2
  touch "$venv/.complete"
fi
echo "$venv"
