#!/usr/bin/env bash
# The GPU check: run on a lent GPU machine from the repository root, with the pack of
# scripts/device-pack.sh travelling beside the tree (README, "Checking on a GPU machine").
#
#   scripts/device-check.sh [--dry-run] [--pack DIR] [OUT]
#
# OUT (else $CKPTFS_DEVICE_OUT, else $OUT, else device-check-out/) receives summary.json,
# device-check.log, device-suite.xml and bench-*.json; the steps are tests/device/device_check.py's.
# The GPU machine's own python3 (the one holding torch) runs them; --dry-run (CI) runs the same
# steps on the host back end with the test environment of scripts/setup-venv.sh, or with
# $CKPTFS_DEVICE_PYTHON. Exit 0 when every step passed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dry=()
pack="$root/device-pack"
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=(--dry-run); shift ;;
    --pack) pack=$2; shift 2 ;;
    -*) echo "device-check: unknown option $1 (usage: device-check.sh [--dry-run] [--pack DIR] [OUT])" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
out=${out:-${CKPTFS_DEVICE_OUT:-${OUT:-$root/device-check-out}}}
python=${CKPTFS_DEVICE_PYTHON:-}
if [ -z "$python" ]; then
  if [ ${#dry[@]} -gt 0 ]; then
    python="$("$root/scripts/setup-venv.sh")/bin/python"
  else
    python=$(command -v python3)
  fi
fi
# Budget: under the 6 minutes the README's call gives the command, with room for the summary.
exec "$python" "$root/tests/device/device_check.py" --pack "$pack" --out "$out" \
  --budget-s "${CKPTFS_DEVICE_BUDGET_S:-330}" "${dry[@]}"
