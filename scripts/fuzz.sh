#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan+UBSan, into build-fuzz/) and runs each for a while
# on a copy of its seed corpus. Fails on any crash, leak, timeout or invariant trap.
#
#   scripts/fuzz.sh [--seconds N] [--no-build] [target...] [-- libFuzzer flags...]
#
#   --seconds N   fuzzing time per target (default 10)
#   --no-build    use the binaries already in build-fuzz/ (no apt, no cmake)
#   target        zip pickle torch torch_legacy safetensors zero view dcp keymap (default: all)
#   -- flags      extra libFuzzer flags, e.g. -- -jobs=1 -workers=1 for the long runs
#
# Before fuzzing, each target replays tests/fuzz/regressions/<target>/ (inputs that once
# crashed it). Work files (grown corpus, crash artifacts, logs) go to
# $CKPTFS_FUZZ_WORK/<target> (default build-fuzz/work/<target>), emptied at each run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build="$root/build-fuzz"
fuzzdir="$root/tests/fuzz"
all_targets=(zip pickle torch torch_legacy safetensors zero view dcp keymap)

seconds=10
do_build=1
targets=()
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --seconds=*) seconds=${1#*=}; shift ;;
    --no-build) do_build=0; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  [[ " ${all_targets[*]} " == *" $t "* ]] || { echo "fuzz.sh: unknown target '$t' (known: ${all_targets[*]})" >&2; exit 2; }
done

if [ "$do_build" = 1 ]; then
  if ! command -v clang++ >/dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
    "$root/scripts/install-deps.sh"
  fi
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCKPTFS_FUZZ=ON -DCKPTFS_BUILD_TESTS=OFF >/dev/null
  cmake --build "$build" -j"$(nproc)" --target "${targets[@]/#/fuzz_}"
fi

work_base=${CKPTFS_FUZZ_WORK:-$build/work}
failed=()
summary=()
for t in "${targets[@]}"; do
  bin="$build/tests/fuzz/fuzz_$t"
  [ -x "$bin" ] || { echo "fuzz.sh: $bin is missing (build without --no-build)" >&2; exit 2; }
  work="$work_base/$t"
  rm -rf "$work"
  mkdir -p "$work/corpus" "$work/artifacts"
  cp -r "$fuzzdir/seeds/$t/." "$work/corpus/"
  # A stable copy: rebuilding while a long run goes on must not touch the running binary.
  cp "$bin" "$work/fuzz_$t"
  dict=()
  [ -f "$fuzzdir/$t.dict" ] && dict=(-dict="$fuzzdir/$t.dict")
  common=(-rss_limit_mb=2048 -timeout=5 -artifact_prefix="$work/artifacts/" "${dict[@]}")

  # 1. Regressions: every input that once crashed this target must now pass.
  reg="$fuzzdir/regressions/$t"
  if [ -d "$reg" ] && [ -n "$(ls -A "$reg")" ]; then
    if ! (cd "$work" && ./"fuzz_$t" "${common[@]}" "$reg"/* >regressions.log 2>&1); then
      echo "fuzz.sh: $t: a regression input crashes again, see $work/regressions.log" >&2
      grep -E "Running:|ERROR|invariant" "$work/regressions.log" | head -20 >&2 || true
      failed+=("$t"); summary+=("$t: REGRESSION FAILED"); continue
    fi
    echo "fuzz.sh: $t: $(ls "$reg" | wc -l) regression inputs pass"
  fi

  # 2. Fuzz for $seconds on the corpus copy.
  echo "fuzz.sh: $t: fuzzing for ${seconds}s (log: $work/fuzz.log)"
  rc=0
  (cd "$work" && ./"fuzz_$t" "${common[@]}" -max_total_time="$seconds" -print_final_stats=1 \
      "${extra[@]}" corpus >fuzz.log 2>&1) || rc=$?
  # With -jobs=N the fuzzing output is in fuzz-<job>.log (and copied into fuzz.log at the
  # end of each job, so the stats are counted from the job logs only).
  logs=("$work/fuzz.log"); stat_logs=()
  for l in "$work"/fuzz-*.log; do [ -f "$l" ] && logs+=("$l") && stat_logs+=("$l"); done
  [ ${#stat_logs[@]} -gt 0 ] || stat_logs=("$work/fuzz.log")
  execs=$(grep -h "stat::number_of_executed_units" "${stat_logs[@]}" | awk '{s+=$2} END {print s+0}')
  rate=$(grep -h "stat::average_exec_per_sec" "${stat_logs[@]}" | awk '{s+=$2} END {print s+0}')
  crashes=$(find "$work/artifacts" -type f | sort)
  if [ "$rc" != 0 ] || [ -n "$crashes" ] || grep -qE "^==[0-9]+==ERROR|fuzz invariant failed|deadly signal" "${logs[@]}"; then
    echo "fuzz.sh: $t: FAILED (exit $rc); log: $work/fuzz.log" >&2
    grep -hE "^==[0-9]+==ERROR|invariant failed|SUMMARY|Test unit written" "${logs[@]}" | head -20 >&2 || true
    for c in $crashes; do echo "fuzz.sh: $t: crash input: $c" >&2; done
    failed+=("$t"); summary+=("$t: FAILED, $execs executions, $rate exec/s; crash inputs: ${crashes:-none}")
  else
    summary+=("$t: ok, $execs executions in ${seconds}s, $rate exec/s, corpus $(ls "$work/corpus" | wc -l) inputs")
  fi
done

echo "fuzz.sh: summary"
for s in "${summary[@]}"; do echo "  $s"; done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: failed targets: ${failed[*]}" >&2
  exit 1
fi
