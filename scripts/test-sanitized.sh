#!/usr/bin/env bash
# Builds ckptfs with AddressSanitizer + UndefinedBehaviorSanitizer (LeakSanitizer included)
# into build-asan/ and runs the whole CTest suite against that build: the Boost.Test unit
# tests and every pytest suite (whose ckptfs subprocesses and FUSE daemons are then the
# instrumented binary; the Python processes themselves are not instrumented).
#
# Every sanitizer report goes to a file under build-asan/sanitizer-logs/ instead of stderr:
# a mounted daemon has daemonized and points stderr at /dev/null, so a finding there would
# otherwise be lost (the test that triggered it may even pass). The job fails when ctest
# fails OR when any report file exists, and prints every report.
#
# Run scripts/test.sh first (or let it call this script): it installs the Debian packages
# and the Python environment this uses. Extra arguments go to ctest (e.g. -R unit).
#   CKPTFS_ASAN_BUILD_TYPE  CMake build type (default RelWithDebInfo: -O2 -g)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build-asan"
logs="$build/sanitizer-logs"
venv=$("$root/scripts/setup-venv.sh")

start=$(date +%s)
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE="${CKPTFS_ASAN_BUILD_TYPE:-RelWithDebInfo}" \
  -DCKPTFS_SANITIZE=address,undefined -DCKPTFS_PYTHON="$venv/bin/python" >/dev/null
nice cmake --build "$build" -j"$(nproc)"
built=$(date +%s)

rm -rf "$logs"
mkdir -p "$logs"
# log_path: one file per process, <prefix>.<exe>.<pid>, created only when there is a report.
# abort_on_error: a finding kills the process with SIGABRT (a test sees it as a crash).
# detect_stack_use_after_return: affordable here (the suite is dominated by Python).
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=1:disable_coredump=1\
:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1\
:strict_string_checks=1\
:log_path=$logs/asan:log_exe_name=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan:log_exe_name=1"
# Leaks inside third-party libraries only; each entry says why.
export LSAN_OPTIONS="suppressions=$root/tests/sanitizer-suppressions-lsan.txt:print_suppressions=0"

# Tests see that the binary under test is sanitized (for assertions on its resources).
export CKPTFS_SANITIZED=address,undefined
# Deselected here, and only here: the tests whose point is a bound on the daemon's or CLI's
# memory. Under ASan that memory is mostly the sanitizer's (shadow, redzones, and the
# quarantine that holds freed blocks back, up to 256 MB: under the 16-reader load the daemon's
# RSS climbs ~0.5 MB/s, right at the test's 16 MB slack), so these bounds measure ASan, not
# ckptfs. Every other test in these
# files (the 16-reader load itself excepted, see below) still runs; the normal pass
# (scripts/test.sh) asserts the bounds on the normal build.
#  - corpus, the 10^6-deep nested dict: peak RSS 181 MB normally, 310 MB under ASan (limit 256).
#  - hardening/test_load: "RSS stays flat within 16 MB" during 16 readers x 60 s (+ bf16).
#    Concurrent reads under ASan stay covered by tests/fuse/test_fuse_concurrent.py.
# TODO(owners of tests/corpus, tests/hardening): skip only the RSS assertion when
# CKPTFS_SANITIZED is set, then drop these lines.
deselect=(
  "tests/corpus/test_corpus.py::test_ls_refuses[pkl-nested-dict-1m.pt]"
  "tests/corpus/test_corpus.py::test_mount_refuses[pkl-nested-dict-1m.pt]"
  "tests/hardening/test_load.py::test_load_16_readers_random_ranges"
  "tests/hardening/test_load.py::test_load_bf16_view"
)
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-}${deselect[*]/#/ --deselect }"
# Tests that load libckptfs.so into Python (marker loads_libckptfs) run in the second ctest
# below, with the ASan runtime preloaded.
passes_addopts=$PYTEST_ADDOPTS

cd "$build"
rc=0
# fuzz.smoke is left to the normal pass: it builds and runs its own clang ASan+libFuzzer
# targets (scripts/fuzz.sh into build-fuzz/), independent of this build; running it twice
# would only cost two more minutes. So is pypkg: it tests the wheel, which pip builds with its
# own uninstrumented CMake build, not this one.
PYTEST_ADDOPTS="$passes_addopts -m 'not loads_libckptfs'" \
  ctest --output-on-failure --timeout 1500 -E '^(device|fuzz\.smoke|pypkg)$' "$@" || rc=$?
# The device suite and the option table's tests load the instrumented libckptfs.so into
# Python through ctypes (ckptfs.load, ckptfs_open). The ASan runtime must then be the first
# library of the process, or it aborts at load ("ASan runtime does not come first"): preload
# it, for those tests only.
# Every uninstrumented process of the suite (Python with torch, the DeepSpeed fixture
# generator, tail) then carries ASan too and reports its own interpreter's and torch's
# exit-time leaks, so leak detection is off here; ASan and UBSan errors still abort.
# The other suites check ckptfs's leaks.
libasan=$(ldd "$build/libckptfs.so" | awk '$1 ~ /^libasan\.so/ {print $3}')
LD_PRELOAD="$libasan" ASAN_OPTIONS="${ASAN_OPTIONS/detect_leaks=1/detect_leaks=0}" \
  PYTEST_ADDOPTS="$passes_addopts -m loads_libckptfs" \
  ctest --output-on-failure --timeout 1500 -R '^(device|views)$' "$@" || rc=$?
end=$(date +%s)

. "$root/scripts/sanitizer-verdict.sh"
sanitizer_verdict test-sanitized "$logs" "$rc" "$start" "$built" "$end"
