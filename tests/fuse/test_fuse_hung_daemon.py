"""A daemon that stops answering must not hang the run: the test reading from it fails at its
pytest-timeout deadline, its mount is torn down, and the next test runs.

A read waiting for a FUSE daemon sits in the kernel, where SIGALRM (pytest-timeout's signal
method) cannot make it return; the `mounts` plugin (tests/ckptfs_mounts.py) kills the daemons
once the deadline is past, which aborts the connection and frees the read. This runs a small
pytest session of its own, so that the hang happens there."""

import os
import sys
import textwrap

from ckptfs_testlib import REPO_ROOT, scaled
from fusetools import mount_entries, run_bounded

SAMPLE = REPO_ROOT / "tests" / "data" / "sample-mlp-training.pt"
# Mounting and reading the manifest come out of the same deadline, which must hold on a
# loaded two-core machine and on the sanitizer builds.
DEADLINE_S = scaled(8)
GRACE_S = 1
# The inner session: interpreter and torch start-up, the deadline and grace, teardown.
INNER_SESSION_TIMEOUT_S = scaled(90)

INNER_TESTS = f'''
import os
import signal

import pytest

from fusetools import daemon_pids, read_manifest


@pytest.mark.timeout({DEADLINE_S})
def test_read_from_a_stopped_daemon(mounts):
    mnt = mounts.mount({str(SAMPLE)!r})
    files = [mnt / entry["file"] for entry in read_manifest(mnt)["tensors"]]
    pids = daemon_pids(mnt, mounts.binary)
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    with open(files[0], "rb") as f:  # not cached: the read waits for the stopped daemon
        f.read()


def test_the_session_goes_on():
    pass
'''


def test_a_read_blocked_on_a_stopped_daemon_fails_at_its_deadline(ckptfs_bin, tmp_path):
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    inner_tmp = tmp_path / "inner-tmp"
    res = run_bounded(
        [
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "ckptfs_mounts",
            "-c", REPO_ROOT / "pytest.ini", "--rootdir", tmp_path, "--basetemp", inner_tmp,
            "-o", f"hung_body_grace={GRACE_S}", "-rA", tmp_path / "test_inner.py",
        ],
        INNER_SESSION_TIMEOUT_S,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "tests"), "CKPTFS_BIN": str(ckptfs_bin)},
    )
    output = res.stdout + res.stderr
    assert not res.timed_out, f"the inner session hung:\n{output[-4000:]}"
    assert res.returncode == 1, output[-4000:]
    assert "FAILED test_inner.py::test_read_from_a_stopped_daemon" in output, output[-4000:]
    assert f"Timeout (>{DEADLINE_S:.1f}s)" in output, output[-4000:]
    assert "killed the daemons" in output, output[-4000:]
    assert "PASSED test_inner.py::test_the_session_goes_on" in output, output[-4000:]
    left = [e["target"] for e in mount_entries() if e["target"].startswith(str(inner_tmp))]
    assert left == [], f"still mounted after the inner session: {left}"
