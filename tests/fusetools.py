"""Helpers for the suites that mount (tests/fuse, views, corpus, hardening): start and tear
down real ckptfs mounts without ever letting a hung mount hang the run, read /proc/mounts,
compare tensors bit for bit. `Mounts` is what the `mounts` fixture of ckptfs_mounts.py (the
pytest plugin) hands to tests.

Nothing here touches a mount except through a subprocess with a timeout or from a test
body (which has a pytest-timeout deadline)."""

import errno
import json
import os
import signal
import time
from pathlib import Path

import pytest

from ckptfs_testlib import REPO_ROOT, assert_bitwise_equal, ckptfs_path, flatten_tensors, scaled  # noqa: F401
# run_bounded lives in ckptfs_testlib, beside run_ckptfs, which is built on it.
from ckptfs_testlib import Bounded, run_bounded  # noqa: F401

# Deadlines on the normal build, scaled for the build under test (ckptfs_testlib.scaled).
# Starting a mount indexes the source first; even a large checkpoint takes seconds.
MOUNT_TIMEOUT_S = scaled(60)
# How long a mount may take to show up in /proc/mounts after the command returned (it
# should already be there: `ckptfs SOURCE MOUNTPOINT` returns once the mount is ready).
MOUNT_APPEAR_S = scaled(10)
HELPER_TIMEOUT_S = scaled(15)  # fusermount3, pgrep, rsync of small trees
DAEMON_EXIT_S = scaled(10)  # how long a daemon may take to exit after its mount went away


def fuse_unavailable_reason():
    """Why this machine cannot mount FUSE file systems at all, or None."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no FUSE support in this kernel or container)"
    if not _which("fusermount3"):
        return "fusermount3 is not installed (Debian package fuse3)"
    return None


def _which(name: str):
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


# --- /proc/mounts ----------------------------------------------------------------------


def _unescape_mount_field(s: str) -> str:
    # The kernel escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 4 <= len(s) and s[i + 1 : i + 4].isdigit():
            out.append(chr(int(s[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def mount_entries() -> list:
    """The entries of /proc/self/mounts as dicts (source, target, fstype, options).
    Reading it never blocks on a FUSE daemon."""
    entries = []
    with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split(" ")
            if len(fields) < 4:
                continue
            entries.append(
                {
                    "source": _unescape_mount_field(fields[0]),
                    "target": _unescape_mount_field(fields[1]),
                    "fstype": fields[2],
                    "options": fields[3].split(","),
                }
            )
    return entries


def mount_entry(mountpoint):
    """The /proc/mounts entry mounted on MOUNTPOINT (the topmost one), or None."""
    target = os.path.realpath(mountpoint)
    found = None
    for e in mount_entries():
        if e["target"] == target:
            found = e
    return found


def wait_for_mount(mountpoint, timeout: float = MOUNT_APPEAR_S, daemon=None):
    """Poll /proc/mounts until MOUNTPOINT is a ckptfs mount; the entry, or None at the
    deadline. With DAEMON (the Popen of a foreground `ckptfs ... -f`, which indexes its
    source before it mounts) the wait lasts as long as that process runs, up to
    MOUNT_TIMEOUT_S: it ends on a condition, not on a guess of how long indexing takes."""
    if daemon is not None:
        timeout = max(timeout, MOUNT_TIMEOUT_S)
    deadline = time.monotonic() + timeout
    while True:
        e = mount_entry(mountpoint)
        if e is not None and e["fstype"].startswith("fuse"):
            return e
        if time.monotonic() >= deadline or (daemon is not None and daemon.poll() is not None):
            return None
        time.sleep(0.05)


# --- daemons ----------------------------------------------------------------------------


def _ere_escape(s: str) -> str:
    return "".join("\\" + c if c in ".[]()*+?{}|^$\\" else c for c in s)


def daemon_pids(mountpoint, binary) -> list:
    """PIDs of ckptfs daemons serving MOUNTPOINT: found with `pgrep -f` on the mountpoint,
    then kept only when /proc/PID/exe is the ckptfs binary and MOUNTPOINT is one of its
    arguments (so that nothing but the daemons this suite started is ever signalled)."""
    target = os.path.realpath(mountpoint)
    names = {str(mountpoint), target}
    try:
        res = run_bounded(["pgrep", "-f", _ere_escape(target)], HELPER_TIMEOUT_S)
        candidates = res.stdout.split() if res.returncode in (0, 1) else None
    except OSError:  # no pgrep (procps)
        candidates = None
    if candidates is None:  # pgrep unusable: look at every process
        candidates = [d for d in os.listdir("/proc") if d.isdigit()]
    real_bin = os.path.realpath(binary)
    pids = []
    for token in candidates:
        pid = int(token)
        if pid == os.getpid():
            continue
        try:
            # A binary rebuilt while its daemon runs shows as "PATH (deleted)".
            exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = [a.decode(errors="replace") for a in f.read().split(b"\0")]
        except OSError:
            continue
        if exe == real_bin and names & set(args):
            pids.append(pid)
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # A zombie has exited; its parent (not us, it was daemonized) will reap it.
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def teardown_mount(mountpoint, binary) -> list:
    """Unmount MOUNTPOINT and make sure its daemon is gone, whatever state it is in.

    fusermount3 -u; if that fails, fusermount3 -uz (lazy); then wait for the daemon to exit
    and SIGTERM / SIGKILL it if it does not (a killed daemon aborts the FUSE connection, which
    also frees any thread blocked on the mount). Returns a list of problems, empty when the
    clean path worked."""
    problems = []
    pids_before = daemon_pids(mountpoint, binary)
    if mount_entry(mountpoint) is not None:
        res = run_bounded(["fusermount3", "-u", mountpoint], HELPER_TIMEOUT_S)
        if res.returncode != 0 or mount_entry(mountpoint) is not None:
            problems.append(f"fusermount3 -u failed: {res.describe()}")
            lazy = run_bounded(["fusermount3", "-uz", mountpoint], HELPER_TIMEOUT_S)
            if lazy.returncode != 0:
                problems.append(f"fusermount3 -uz failed: {lazy.describe()}")
    pids = sorted(set(pids_before) | set(daemon_pids(mountpoint, binary)))
    # A daemon whose mount would not come off cleanly is likely stuck: do not wait long.
    grace = 2 if problems else DAEMON_EXIT_S
    alive = _wait_gone(pids, grace)
    if alive:
        problems.append(f"daemon {alive} still running {grace}s after unmount; killed")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in alive:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            alive = _wait_gone(alive, 3)
            if not alive:
                break
        if alive:
            problems.append(f"daemon {alive} survived SIGKILL")
    if mount_entry(mountpoint) is not None:
        # The daemon is gone: a lazy unmount of the dead connection cannot block.
        run_bounded(["fusermount3", "-uz", mountpoint], HELPER_TIMEOUT_S)
        if mount_entry(mountpoint) is not None:
            problems.append(f"{mountpoint} is still mounted after teardown")
    return problems


# --- mounts of a test ----------------------------------------------------------------


# Every mountpoint any test used, for the end-of-session safety net.
EVERY_MOUNTPOINT = set()


class Mounts:
    """Starts mounts and remembers every mountpoint it ever used, so teardown can clean up
    whatever state each one is in (mounted, half-mounted, daemon hung, already gone)."""

    def __init__(self, binary: Path, tmp_path_factory):
        self.binary = binary
        self._tmp = tmp_path_factory
        self._used = []

    def new_mountpoint(self) -> Path:
        return self._tmp.mktemp("mnt")

    def start(self, argv, mountpoint, *, timeout: float = MOUNT_TIMEOUT_S, **kwargs):
        """Run ARGV (some way of mounting at MOUNTPOINT) with a timeout; the Bounded result.
        The mountpoint is registered for teardown before anything runs."""
        self.register(mountpoint)
        return run_bounded(argv, timeout, **kwargs)

    def mount(self, source, mountpoint=None, *args, argv=None, **kwargs) -> Path:
        """`ckptfs SOURCE MOUNTPOINT ARGS...` (or ARGV); fails the test unless it exits 0 and
        the mount shows in /proc/mounts before the deadline. Returns the mountpoint."""
        mountpoint = Path(mountpoint) if mountpoint is not None else self.new_mountpoint()
        if argv is None:
            argv = [self.binary, source, mountpoint, *args]
        res = self.start(argv, mountpoint, **kwargs)
        self.check_mounted(mountpoint, res)
        return mountpoint

    @staticmethod
    def check_mounted(mountpoint, res) -> None:
        """Fail the test unless RES (the mount command) exited 0 and MOUNTPOINT shows in
        /proc/mounts."""
        if res.returncode != 0:
            pytest.fail(f"mount failed: {res.describe()}", pytrace=False)
        if wait_for_mount(mountpoint) is None:
            pytest.fail(
                f"{res.describe()}\nbut {mountpoint} did not appear in /proc/mounts",
                pytrace=False,
            )

    def unmount(self, mountpoint) -> None:
        """Unmount now (e.g. to remount); fails the test unless the clean path worked."""
        problems = teardown_mount(mountpoint, self.binary)
        assert not problems, f"unmounting {mountpoint}: " + "; ".join(problems)
        assert mount_entry(mountpoint) is None

    def register(self, mountpoint):
        """Tear MOUNTPOINT down after the test, whatever mounted it."""
        mp = Path(mountpoint)
        if mp not in self._used:
            self._used.append(mp)
        EVERY_MOUNTPOINT.add(mp)

    def teardown(self) -> list:
        problems = []
        for mp in reversed(self._used):
            problems += [f"{mp}: {p}" for p in teardown_mount(mp, self.binary)]
        return problems


def teardown_every_mount() -> None:
    """Last resort for pytest_sessionfinish (the `mounts` teardown normally did this
    already): leave nothing of this run mounted or running, even after an internal error or
    an interrupted run."""
    binary = ckptfs_path()
    for mp in sorted(EVERY_MOUNTPOINT):
        if mount_entry(mp) is not None:
            teardown_mount(mp, binary)


def kill_every_daemon() -> list:
    """SIGKILL the daemon of every mount of this run that is still mounted; the PIDs killed.
    The kernel then aborts their FUSE connections, so every call blocked on one of them
    returns (ENOTCONN). Safe from any thread: it only reads /proc and runs pgrep."""
    binary = ckptfs_path()
    killed = []
    for mp in sorted(EVERY_MOUNTPOINT):
        if mount_entry(mp) is None:
            continue
        for pid in daemon_pids(mp, binary):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


# --- tensors ----------------------------------------------------------------------------


def read_manifest(root) -> dict:
    with open(Path(root) / "manifest.json", "rb") as f:
        return json.loads(f.read())


def tree_files(root) -> dict:
    """{relative path: absolute Path} of every regular file under ROOT."""
    root = Path(root)
    return {
        p.relative_to(root).as_posix(): p
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def expect_errno(code: int, fn, *args, **kwargs):
    """Call fn and return the OSError it raises; fail unless its errno is CODE."""
    try:
        fn(*args, **kwargs)
    except OSError as e:
        assert e.errno == code, (
            f"{getattr(fn, '__name__', fn)}{args}: errno {e.errno} ({errno.errorcode.get(e.errno)}), "
            f"expected {errno.errorcode[code]}"
        )
        return e
    raise AssertionError(
        f"{getattr(fn, '__name__', fn)}{args} succeeded, expected {errno.errorcode[code]}"
    )
