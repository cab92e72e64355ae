# Sourced by scripts/test-sanitized.sh and scripts/test-tsan.sh after their ctest runs:
#   sanitizer_verdict NAME LOGS RC START BUILT END
# prints every report file under LOGS, turns RC into a failure when there is one (a test can
# pass while a daemon it started reported), prints the timings and exits with the result.
sanitizer_verdict() {
  local name=$1 logs=$2 rc=$3 start=$4 built=$5 end=$6
  shopt -s nullglob
  local reports=("$logs"/*)
  if [ ${#reports[@]} -gt 0 ]; then
    for f in "${reports[@]}"; do
      echo "===== sanitizer report: $f"
      cat "$f"
    done
    echo "$name: ${#reports[@]} sanitizer report(s) under $logs" >&2
    [ "$rc" -ne 0 ] || rc=1
  fi
  echo "$name: build $((built - start))s, tests $((end - built))s, ctest exit $rc" >&2
  exit "$rc"
}
