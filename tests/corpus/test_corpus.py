"""The committed corpus of malformed checkpoints (cases/, made by make_corpus.py): every case
must be refused, by `ckptfs ls` and by a mount attempt alike, with

- exit status 1 (not a signal, no core dump),
- exactly one stderr line, `ckptfs: <the case's file or a file in its folder>: ...`, that
  matches the case's regex in expected.json,
- within 2 s of wall time and with a bounded peak RSS (measured on the child with wait4),
- and, for the mount, nothing left in /proc/mounts;
- for a case whose pickle would run a command (expected.json "never_created": the file that
  command creates), that file never appears.

The files are never regenerated here: the test runs on the committed bytes."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfs_testlib import scaled
from fusetools import mount_entry

SUITE_DIR = Path(__file__).resolve().parent
CASES_DIR = SUITE_DIR / "cases"
EXPECTED = json.loads((SUITE_DIR / "expected.json").read_text())

WALL_LIMIT_S = scaled(2.0)
# Peak RSS of the refusing process. The worst case is the pickle of dicts nested 10^6 deep
# (3 MB of opcodes, ~185 MB of parsed objects before the nesting check refuses it); every
# other case stays under 25 MB.
RSS_LIMIT_BYTES = 256 << 20
# A hung child is killed after this (WALL_LIMIT_S is asserted separately).
KILL_AFTER_S = scaled(20)


# The child's peak RSS must be measured on a process forked from a small one: the kernel
# counts the RSS a process had before exec (here, pytest with torch loaded) in its ru_maxrss.
# So a small Python launcher spawns ckptfs, reaps it with wait4 and reports its exit status,
# peak RSS (KiB) and wall time on stdout; ckptfs's own stdout goes to /dev/null.
LAUNCHER = r"""
import os, sys, time
t = time.monotonic()
pid = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ,
                     file_actions=[(os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0)])
_, status, ru = os.wait4(pid, 0)
print(status, ru.ru_maxrss, time.monotonic() - t)
"""


class Child:
    def __init__(self, argv, status, maxrss_kib, stderr, wall):
        self.argv, self.status, self.maxrss_kib, self.stderr, self.wall = argv, status, maxrss_kib, stderr, wall

    @property
    def exit_code(self):
        return os.waitstatus_to_exitcode(self.status) if self.status is not None else None

    def describe(self):
        return (f"{' '.join(map(str, self.argv))}: exit {self.exit_code}, {self.wall:.2f}s, "
                f"maxrss {self.maxrss_kib} KiB, stderr {self.stderr!r}")


def run_measured(argv) -> Child:
    """Runs ARGV (stdout discarded, stderr captured) and measures it; a child still running
    after KILL_AFTER_S is killed with its launcher (then status None)."""
    argv = [str(a) for a in argv]
    proc = subprocess.Popen([sys.executable, "-S", "-c", LAUNCHER, *argv], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=KILL_AFTER_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Child(argv, None, None, err.decode(errors="replace"), float(KILL_AFTER_S))
    fields = out.decode().split()
    assert proc.returncode == 0 and len(fields) == 3, f"launcher failed: {out!r} {err!r}"
    return Child(argv, int(fields[0]), int(fields[1]), err.decode(errors="replace"), float(fields[2]))


def check_refusal(child: Child, source: Path, regex: str) -> None:
    assert child.status is not None, f"hung (killed after {KILL_AFTER_S}s): {child.describe()}"
    assert not os.WIFSIGNALED(child.status), (
        f"killed by signal {signal.Signals(os.WTERMSIG(child.status)).name}"
        f"{' (core dumped)' if os.WCOREDUMP(child.status) else ''}: {child.describe()}"
    )
    assert child.exit_code == 1, child.describe()
    lines = child.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line: {child.describe()}"
    line = lines[0]
    assert line.startswith(f"ckptfs: {source}"), f"the line does not name {source}: {line!r}"
    assert re.search(regex, line), f"{line!r} does not match {regex!r}"
    assert child.wall < WALL_LIMIT_S, f"took {child.wall:.2f}s: {child.describe()}"
    assert child.maxrss_kib * 1024 <= RSS_LIMIT_BYTES, f"peak RSS too high: {child.describe()}"


def case_path(name: str) -> Path:
    # Absolute and resolved: a mount names the source by its real path.
    return (CASES_DIR / name.rstrip("/")).resolve()


CASE_NAMES = sorted(EXPECTED)


def test_corpus_is_complete():
    on_disk = {p.name + ("/" if p.is_dir() else "") for p in CASES_DIR.iterdir()}
    assert on_disk == set(EXPECTED), (
        f"cases without an entry: {sorted(on_disk - set(EXPECTED))}; "
        f"entries without a case: {sorted(set(EXPECTED) - on_disk)}"
    )
    assert len(EXPECTED) >= 50
    for name, entry in EXPECTED.items():
        assert entry["fault"] and entry["error"], name
        re.compile(entry["error"])
    formats = {name.split("-", 1)[0] for name in EXPECTED}
    assert {"pt", "pkl", "st", "dir", "zero", "dcp"} <= formats


@pytest.fixture
def nothing_executed(request):
    """For a case with "never_created": the file is absent before the test and after it."""
    sentinel = EXPECTED[request.getfixturevalue("name")].get("never_created")
    if sentinel:
        Path(sentinel).unlink(missing_ok=True)
    yield
    if sentinel:
        assert not Path(sentinel).exists(), f"ckptfs ran the command in the case's pickle: {sentinel} exists"


@pytest.mark.parametrize("name", CASE_NAMES)
def test_ls_refuses(ckptfs_bin, name, nothing_executed):
    source = case_path(name)
    check_refusal(run_measured([ckptfs_bin, "ls", source]), source, EXPECTED[name]["error"])


@pytest.mark.parametrize("name", CASE_NAMES)
def test_mount_refuses(ckptfs_bin, mounts, name, nothing_executed):
    source = case_path(name)
    mountpoint = mounts.new_mountpoint()
    mounts.register(mountpoint)  # torn down whatever happens
    child = run_measured([ckptfs_bin, source, mountpoint])
    try:
        check_refusal(child, source, EXPECTED[name]["error"])
    finally:
        assert mount_entry(mountpoint) is None, f"{mountpoint} is mounted after a refused mount"
