#!/usr/bin/env bash
# Builds ckptfs with ThreadSanitizer into build-tsan/ and runs, against that build, the tests
# whose code runs on several threads: the Boost.Test unit tests and the suites whose FUSE
# daemons serve concurrent requests, push pages ahead, watch their sources and fetch remote
# ranges on fetcher threads (fuse, views, remote, hardening).
#
# Reports go to files under build-tsan/sanitizer-logs/ (a mounted daemon's stderr is
# /dev/null); the job fails when ctest fails OR when any report file exists, and prints them.
# Tests that load libckptfs.so into Python are left out: a TSan-built library cannot be
# loaded into an uninstrumented interpreter (the runtime must start with the program); the
# ASan pass (scripts/test-sanitized.sh) and the normal pass run them.
#
# Run scripts/test.sh first (or let it call this script): it installs the Debian packages
# and the Python environment this uses. Extra arguments go to ctest (e.g. -R unit).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build-tsan"
logs="$build/sanitizer-logs"
venv=$("$root/scripts/setup-venv.sh")

start=$(date +%s)
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCKPTFS_SANITIZE=thread \
  -DCKPTFS_PYTHON="$venv/bin/python" >/dev/null
# Only what this pass runs: the unit tests and the ckptfs binary (its suites' daemons).
nice cmake --build "$build" -j"$(nproc)" --target unit_tests ckptfs
built=$(date +%s)

rm -rf "$logs"
mkdir -p "$logs"
# halt_on_error + abort_on_error: the first race kills the process (a test sees a crash);
# log_path: one file per process that reports, <prefix>.<exe>.<pid>.
export TSAN_OPTIONS="halt_on_error=1:abort_on_error=1:disable_coredump=1:second_deadlock_stack=1\
:log_path=$logs/tsan:log_exe_name=1"
export CKPTFS_SANITIZED=thread
cd "$build"
rc=0
PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -m 'not loads_libckptfs'" \
  ctest --output-on-failure --timeout 1500 -R '^(unit\..*|fuse|views|remote|hardening)$' "$@" || rc=$?
end=$(date +%s)

. "$root/scripts/sanitizer-verdict.sh"
sanitizer_verdict test-tsan "$logs" "$rc" "$start" "$built" "$end"
