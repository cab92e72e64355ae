"""Measuring helpers shared by the benches in tests/bench: peak RSS of a child process (GNU
time, else os.wait4), subprocesses with a deadline, a cold (or warmed) page cache before each
run, and unmounting a ckptfs mount. The benches run as scripts (`python tests/bench/X.py`),
so their own directory is sys.path[0] and `import benchlib` finds this file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def _find_gnu_time() -> str | None:
    try:
        out = subprocess.run(["/usr/bin/time", "--version"], capture_output=True, text=True, timeout=10)
        return "/usr/bin/time" if "GNU" in out.stdout + out.stderr else None
    except (OSError, subprocess.TimeoutExpired):
        return None


# A direct child's ru_maxrss is at least the parent's RSS: Linux carries the old mm's
# high-water mark across exec. GNU time is a small process, so the maxrss it reports for its
# own child is clean.
GNU_TIME = _find_gnu_time()


def wait4_timeout(proc: subprocess.Popen, timeout: float):
    """os.wait4 with a deadline (polls with WNOHANG); marks proc as reaped."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return pid, status, usage
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def run_measured(argv: list[str], timeout: float, stdout=None, env=None) -> tuple[float, int, str, str]:
    """Run argv in a fresh process (its own session, killed at the deadline):
    (wall seconds, peak RSS KiB, stdout, stderr). STDOUT None captures the output; anything
    else is passed to Popen and the stdout returned is "". Raises on failure."""
    with tempfile.NamedTemporaryFile(suffix=".rss") as rss_file, tempfile.TemporaryFile() as out, \
            tempfile.TemporaryFile() as err:
        full = [GNU_TIME, "-f", "%M", "-o", rss_file.name, "--", *argv] if GNU_TIME else argv
        t0 = time.perf_counter()
        proc = subprocess.Popen(full, stdout=out if stdout is None else stdout, stderr=err,
                                env=env, start_new_session=True)
        try:
            _, status, usage = wait4_timeout(proc, timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{' '.join(map(str, argv))}: timed out after {timeout}s")
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout_text = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise RuntimeError(f"{' '.join(map(str, argv))} exited {code}: {stderr.strip()[-3000:]}")
        rss = int(Path(rss_file.name).read_text().split()[-1]) if GNU_TIME else usage.ru_maxrss
    return wall, rss, stdout_text, stderr


class Cache:
    """Cold page cache before each run (root), else SOURCE (a file, or every file under a
    directory) read once before each run (warm). WARM_NOTE says so in `mode`."""

    def __init__(self, source: Path, warm_note: str):
        self.source = Path(source)
        self.mode = "cold"
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError as e:
            self.mode = f"warm (cannot drop caches: {e.strerror}; {warm_note})"

    def prepare(self):
        os.sync()  # the previous run's output is written back outside the timed region
        if self.mode == "cold":
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return
        buf = bytearray(8 * MiB)
        files = [self.source] if self.source.is_file() else sorted(self.source.rglob("*"))
        for p in files:
            if p.is_file():
                with open(p, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass


def mounted(mnt: Path) -> bool:
    target = str(mnt)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 4 and parts[4].encode().decode("unicode_escape") == target:
                return True
    return False


def unmount(mnt: Path):
    if not mounted(mnt):
        return
    r = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and mounted(mnt):
        print(f"warning: fusermount3 -u {mnt}: {r.stderr.strip()}; unmounting lazily", file=sys.stderr)
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, timeout=60)


def workdir_and_binary(args) -> tuple[Path, Path] | None:
    """The bench's work folder (created) and the ckptfs binary from --workdir/--ckptfs;
    None, after saying why, when the binary is missing and the bench needs it."""
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ckptfs = Path(args.ckptfs).resolve()
    if not args.generate_only and not os.access(ckptfs, os.X_OK):
        print(f"ckptfs binary not found: {ckptfs} (build it, or pass --ckptfs)", file=sys.stderr)
        return None
    return workdir, ckptfs
