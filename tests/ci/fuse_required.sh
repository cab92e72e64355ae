#!/usr/bin/env bash
# Under CI=true a machine that cannot mount fails the run with one line, instead of passing
# with every mount test skipped; outside CI the mount tests skip with their reason. Checked in
# a private mount namespace whose /dev has no fuse node (root and unshare(1) needed: CI has
# both; elsewhere this test reports itself skipped).
#   tests/ci/fuse_required.sh PYTHON   the test environment's python
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=${1:?usage: fuse_required.sh PYTHON}
if [ "$(id -u)" -ne 0 ] || ! unshare --mount true 2>/dev/null; then
  echo "fuse_required: needs root and mount namespaces (unshare --mount): skipped"
  exit 77
fi
# Runs "$@" where /dev is a fresh tmpfs holding only the nodes a Python process needs.
without_fuse() {
  unshare --mount --propagation private bash -c '
    set -e
    keep=$(mktemp -d)
    mount --rbind /dev "$keep"
    mount -t tmpfs none /dev
    for n in null zero random urandom tty; do touch "/dev/$n"; mount --bind "$keep/$n" "/dev/$n"; done
    ln -s /proc/self/fd /dev/fd
    exec "$@"' bash "$@"
}
fail() { echo "fuse_required: $*" >&2; exit 1; }

rc=0; out=$(without_fuse env CI=true "$root/scripts/check-fuse.sh" test.sh 2>&1) || rc=$?
[ "$rc" -eq 1 ] || fail "check-fuse.sh under CI=true exited $rc, not 1: $out"
[ "$out" = "test.sh: CI=true and this machine cannot mount: /dev/fuse is missing (no FUSE support in this kernel or container)" ] \
  || fail "check-fuse.sh said: $out"
rc=0; out=$(without_fuse env -u CI "$root/scripts/check-fuse.sh" test.sh 2>&1) || rc=$?
[ "$rc" -eq 3 ] || fail "check-fuse.sh outside CI exited $rc, not 3 (skip): $out"

# The pytest plugin: a suite that mounts is an error under CI=true, skipped outside it.
suite="$root/tests/fuse/test_fuse_init.py"
rc=0; out=$(cd "$root" && without_fuse env CI=true "$python" -m pytest -q -p no:cacheprovider "$suite" 2>&1) || rc=$?
[ "$rc" -ne 0 ] || fail "pytest under CI=true passed without /dev/fuse: $out"
grep -q "CI=true and this machine cannot mount: /dev/fuse is missing" <<<"$out" || fail "pytest under CI=true said: $out"
rc=0; out=$(cd "$root" && without_fuse env -u CI "$python" -m pytest -q -p no:cacheprovider -rs "$suite" 2>&1) || rc=$?
[ "$rc" -eq 0 ] || fail "pytest outside CI exited $rc: $out"
grep -q "skipped" <<<"$out" || fail "pytest outside CI did not skip: $out"
echo "fuse_required: CI=true fails in one line without /dev/fuse (script and pytest); outside CI the mount tests skip"
