#!/usr/bin/env bash
# Runs CI (.ci/run: the demo, then scripts/test.sh with every pass) the way a machine that has
# never run it does: in a fresh clone of this checkout's HEAD, with every cache the suite
# writes pointed at empty folders (the Python environments and fixtures of CKPTFS_CACHE,
# ccache, pip's downloads, and $HOME itself, so nothing under ~/.cache is found either).
# Debian packages are the one thing it does not start without: scripts/install-deps.sh installs
# what is missing, and removing system packages is out of its scope.
#
# Run it before resolving a change that adds or edits a fixture generator, a requirements file
# or a build option: a fixture cache that only works when it is old stops every landing the day
# the machine changes. It takes as long as the first CI run on a new machine (about an hour on
# two cores) and needs ~25 GB of free disk under its folder.
#
#   scripts/test-from-nothing.sh [--again] [ARGS...]
#     ARGS      go to scripts/test.sh (e.g. -LE fuzz); with ARGS the demo is left out
#     --again   afterwards, run scripts/test.sh once more in the same clone on the caches the
#               first run filled, and compare every test's verdict between the two runs
#   CKPTFS_FROM_NOTHING_DIR  the folder to work in (default: a new one under /var/tmp); kept
#                            afterwards for its logs, delete it to reclaim the space
#
# Uncommitted changes are not part of the run (it clones HEAD); it says so when there are some.
# Its last lines are the time of each step, from scripts/test.sh, and the verdict.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
again=0
if [ "${1:-}" = --again ]; then again=1; shift; fi

work=${CKPTFS_FROM_NOTHING_DIR:-$(mktemp -d /var/tmp/ckptfs-from-nothing.XXXXXX)}
mkdir -p "$work"
if [ -n "$(ls -A "$work")" ]; then
  echo "test-from-nothing: $work is not empty; give an empty or new folder" >&2
  exit 2
fi
if [ -n "$(git -C "$root" status --porcelain --untracked-files=no)" ]; then
  echo "test-from-nothing: uncommitted changes in $root are NOT part of this run (it clones HEAD)" >&2
fi
clone="$work/ckptfs"
git clone --quiet --no-local --no-hardlinks "$root" "$clone"
commit=$(git -C "$clone" rev-parse --short HEAD)

# Every cache the suite, its builds and its installers read or write, each an empty folder.
mkdir -p "$work/home" "$work/cache" "$work/ccache" "$work/pip-cache"
export HOME="$work/home"
export XDG_CACHE_HOME="$HOME/.cache"
export CKPTFS_CACHE="$work/cache"
export CCACHE_DIR="$work/ccache"
export PIP_CACHE_DIR="$work/pip-cache"
export HF_HOME="$HOME/.cache/huggingface"
export TORCH_HOME="$HOME/.cache/torch"
export TRITON_CACHE_DIR="$HOME/.cache/triton"
# Nothing from the caller's Python setup leaks in.
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP PIP_CONFIG_FILE PIP_FIND_LINKS PIP_INDEX_URL VIRTUAL_ENV || true

# One line per test and pass: "<build> <ctest test> failed" from ctest, and
# "<build> <pytest node id> <passed|failed|error|skipped>" from the suites' JUnit XML.
verdicts() {
  /usr/bin/python3 - "$1" <<'PY'
import sys, xml.etree.ElementTree as ET
from pathlib import Path
clone = Path(sys.argv[1])
for build in sorted(clone.glob("build*/")):
    failed = build / "Testing" / "Temporary" / "LastTestsFailed.log"
    if failed.exists():
        for line in failed.read_text().split():
            print(build.name, line.split(":", 1)[-1], "failed")
    for xml in sorted((build / "tests" / "junit").glob("*.xml")):
        for case in ET.parse(xml).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            verdict = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
            print(build.name, f"{case.get('classname')}::{case.get('name')}", verdict)
PY
}

echo "test-from-nothing: commit $commit in $clone; caches under $work" >&2
t0=$(date +%s)
rc=0
if [ $# -eq 0 ]; then
  (cd "$clone" && ./.ci/run) > >(tee "$work/run-1.log") 2>&1 || rc=$?
else
  (cd "$clone" && ./scripts/test.sh "$@") > >(tee "$work/run-1.log") 2>&1 || rc=$?
fi
t1=$(date +%s)
verdicts "$clone" > "$work/run-1.verdicts"
summary=("run 1 (from nothing): exit $rc, $((t1 - t0))s")

if [ "$again" = 1 ]; then
  rc2=0
  (cd "$clone" && ./scripts/test.sh "$@") > >(tee "$work/run-2.log") 2>&1 || rc2=$?
  summary+=("run 2 (caches of run 1): exit $rc2, $(( $(date +%s) - t1 ))s")
  verdicts "$clone" > "$work/run-2.verdicts"
  if diff "$work/run-1.verdicts" "$work/run-2.verdicts" > "$work/verdicts.diff"; then
    summary+=("every test's verdict is the same in both runs ($(wc -l < "$work/run-1.verdicts") verdicts)")
  else
    summary+=("verdicts differ between the runs: $work/verdicts.diff")
    [ "$rc" -ne 0 ] || rc=1
  fi
  [ "$rc2" -eq 0 ] || rc=$rc2
fi

echo "test-from-nothing: commit $commit" >&2
printf '  %s\n' "${summary[@]}" >&2
sed -n '/test.sh: where the time went/,$p' "$work/run-1.log" >&2
echo "test-from-nothing: logs in $work (run-*.log), exit $rc" >&2
exit "$rc"
