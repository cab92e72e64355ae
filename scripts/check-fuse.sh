#!/usr/bin/env bash
# Says whether this machine can mount FUSE file systems. Exit 0: it can. Otherwise one line
# naming what is missing goes to stderr, and the exit status is 1 under CI=true (a CI machine
# that lost FUSE must fail, not pass with every mount test skipped) or 3 elsewhere (the
# caller skips its mount steps; the mount tests skip, each with this reason).
#   scripts/check-fuse.sh NAME    NAME prefixes the line (the calling script)
set -euo pipefail
name=${1:-check-fuse}
reason=
if [ ! -e /dev/fuse ]; then
  reason="/dev/fuse is missing (no FUSE support in this kernel or container)"
elif ! command -v fusermount3 >/dev/null; then
  reason="fusermount3 is not installed (Debian package fuse3)"
fi
[ -n "$reason" ] || exit 0
if [ "${CI:-}" = true ]; then
  echo "$name: CI=true and this machine cannot mount: $reason" >&2
  exit 1
fi
echo "$name: $reason; the mount steps and tests are skipped" >&2
exit 3
