#!/usr/bin/env bash
# Installs everything, builds, and runs every test: the Boost.Test unit tests and the
# Python suites (real torch / safetensors / transformers) through CTest, twice:
#   1. the normal build (build/), as shipped;
#   2. the AddressSanitizer + UndefinedBehaviorSanitizer build (build-asan/, through
#      scripts/test-sanitized.sh), which also fails on any sanitizer report a daemon left;
#   3. the ThreadSanitizer build (build-tsan/, scripts/test-tsan.sh): the unit tests and
#      the suites whose daemons run several threads (fuse, views, remote, hardening).
# Extra arguments go to every ctest run (e.g. -R unit). CKPTFS_SKIP_SANITIZED=1 runs only
# the first pass. CI runs both passes with every test; the quick local loop leaves out the
# fuzz label (fuzz.smoke builds its own clang tree first):
#   CKPTFS_SKIP_SANITIZED=1 scripts/test.sh -LE fuzz
# Labels (tests/CMakeLists.txt): unit, python, mount (pytest suites that mount), fuzz.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# Where the time goes: one line per step at the end (and a step's own lines as it runs).
t0=$(date +%s); last=$t0; steps=()
step() { local now; now=$(date +%s); steps+=("$(printf '%-34s %5ss' "$1" $((now - last)))"); last=$now; }
"$root/scripts/install-deps.sh"
# Under CI=true a machine that cannot mount fails here, in one line, before any build.
fuse=0
"$root/scripts/check-fuse.sh" test.sh || fuse=$?
[ "$fuse" -ne 1 ] || exit 1
step "Debian packages"
venv=$("$root/scripts/setup-venv.sh")
step "Python environment"
"$root/scripts/build.sh" -DCKPTFS_PYTHON="$venv/bin/python"
step "normal build"
rc=0
(cd "$root/build" && ctest --output-on-failure --timeout 1500 "$@") || rc=$?
step "normal pass tests (exit $rc)"
if [ "${CKPTFS_SKIP_SANITIZED:-0}" != 1 ]; then
  echo "test.sh: normal pass exit $rc; now the sanitized pass (scripts/test-sanitized.sh)" >&2
  "$root/scripts/test-sanitized.sh" "$@" || rc=$?
  step "ASan+UBSan pass (build and tests)"
  echo "test.sh: now the ThreadSanitizer pass (scripts/test-tsan.sh)" >&2
  "$root/scripts/test-tsan.sh" "$@" || rc=$?
  step "TSan pass (build and tests)"
fi
echo "test.sh: where the time went" >&2
printf '  %s\n' "${steps[@]}" >&2
echo "test.sh: total $(( $(date +%s) - t0 ))s, exit $rc" >&2
exit "$rc"
