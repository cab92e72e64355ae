"""Measuring helpers shared by the benches in tests/bench: peak RSS of a child process (GNU
time, else os.wait4), subprocesses with a deadline, a cold (or warmed) page cache before each
run, and unmounting a ckptfs mount. The benches run as scripts (`python tests/bench/X.py`),
so their own directory is sys.path[0] and `import benchlib` finds this file."""

from __future__ import annotations

import inspect
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

    def __init__(self, source: Path, warm_note: str, cold: bool = True):
        self.source = Path(source)
        self.mode = "cold"
        if not cold:  # asked for: e.g. on a machine shared with others, whose caches stay
            self.mode = f"warm (asked for; {warm_note})"
            return
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


# ---------------------------------------------------------------------------
# Shared by the side-by-side benches that run_all.py drives (read throughput, archive
# peers, mount + ls, load_file): results as JSON lines, a ckptfs mount with a deadline,
# explicit page-cache control, dd timings.
# ---------------------------------------------------------------------------

import json
import re
import statistics

GB = 1e9


def add_common_args(ap, default_workdir: str = "/tmp/ckptfs-bench"):
    """--ckptfs, --workdir, --quick, --repeats, --json-out: the options run_all.py passes."""
    root = Path(__file__).resolve().parents[2]
    ap.add_argument("--ckptfs", default=str(root / "build" / "ckptfs"))
    ap.add_argument("--workdir", default=default_workdir)
    ap.add_argument("--quick", action="store_true", help="small sizes, fewer repeats (smoke test)")
    ap.add_argument("--repeats", type=int, default=0, help="timed runs per alternative (default 3, quick 1)")
    ap.add_argument("--json-out", default="", help="append one JSON object per figure to this file")
    ap.add_argument("--keep", action="store_true", help="keep generated data in the workdir")


class Results:
    """Collects figures; prints each one and appends it as a JSON line to --json-out.

    A figure: id ("a.first"), text, ckptfs and alternative values (numbers, with unit),
    ratio (ckptfs / alternative unless given), goal text and met (True/False/None for
    information only), and a free-form detail dict (sizes, samples, cache state)."""

    def __init__(self, bench: str, json_out: str):
        self.bench = bench
        self.json_out = json_out
        self.rows: list[dict] = []

    def add(self, fid: str, figure: str, ckptfs, alternative, unit: str, goal: str = "info",
            met=None, ratio=None, alt_name: str = "", detail: dict | None = None):
        if ratio is None and isinstance(ckptfs, (int, float)) and isinstance(alternative, (int, float)) \
                and alternative:
            ratio = ckptfs / alternative
        row = {"bench": self.bench, "id": fid, "figure": figure, "ckptfs": ckptfs,
               "alternative": alternative, "alt_name": alt_name, "unit": unit, "ratio": ratio,
               "goal": goal, "met": met, "detail": detail or {}, **provenance()}
        self.rows.append(row)
        r = f"{ratio:.3f}" if isinstance(ratio, (int, float)) else "-"
        m = {True: "yes", False: "NO", None: "-"}[met]
        print(f"[{fid}] {figure}: ckptfs {fmt_value(ckptfs, unit)} | {alt_name or 'alternative'} "
              f"{fmt_value(alternative, unit)} | ratio {r} | goal {goal} | met {m}", flush=True)
        if self.json_out:
            with open(self.json_out, "a") as f:
                f.write(json.dumps(row) + "\n")


def fmt_value(v, unit: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g} {unit}".strip() if abs(v) < 100 else f"{v:.0f} {unit}".strip()
    return f"{v} {unit}".strip()


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def drop_caches():
    """echo 1 > drop_caches (page cache of every file; needs root)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def cached_pages(path: Path) -> tuple[int, int]:
    """(resident pages, total pages) of a file, from mincore (fincore)."""
    import mmap as _mmap
    import ctypes
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, _mmap.PROT_READ, _mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        n = (size + page - 1) // page
        vec = ctypes.create_string_buffer(n)
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
        finally:
            libc.munmap(addr, size)
        return sum(b & 1 for b in vec.raw), n
    finally:
        os.close(fd)


def evict(path: Path):
    """Drop the page cache of one file (FADV_DONTNEED; works on FUSE files too) and check
    that nothing stayed resident; falls back to drop_caches."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if cached_pages(path)[0] != 0:
        drop_caches()


def dd(path: Path, skip: int = 0, count: int | None = None, timeout: float = 600) -> float:
    """Seconds dd bs=1M takes to read [skip, skip+count) of path, as dd reports it."""
    argv = ["dd", f"if={path}", "of=/dev/null", "bs=1M", f"skip={skip}", "iflag=skip_bytes,count_bytes"]
    if count is not None:
        argv.append(f"count={count}")
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
    m = re.search(r"copied, ([0-9.e+-]+) s", r.stderr)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {r.stderr!r}")
    return float(m.group(1))


def dd_parallel(jobs: list[tuple[Path, int, int]], timeout: float = 600) -> float:
    """Wall seconds until all of several concurrent dd reads (path, skip, count) finish."""
    procs = []
    t0 = time.perf_counter()
    for path, skip, count in jobs:
        procs.append(subprocess.Popen(["dd", f"if={path}", "of=/dev/null", "bs=1M", f"skip={skip}",
                                       f"count={count}", "iflag=skip_bytes,count_bytes"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"dd failed: {err.decode(errors='replace')}")
    return time.perf_counter() - t0


def daemon_pids(mnt: Path) -> list[int]:
    """Pids of processes whose command line names mnt (the ckptfs daemon of that mount)."""
    want = str(mnt).encode()
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            args = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in args and args and b"ckptfs" in os.path.basename(args[0]):
            pids.append(int(d))
    return pids


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


class CkptfsMount:
    """`ckptfs SRC MNT [-o OPTS]` (returns once mounted), with a deadline; the daemon's pid
    is found by its command line. Unmounted on exit, and the daemon waited for.

    hwm_kib() is the peak of the whole start-up: the mounting process builds the catalog and
    the View before it forks the daemon, and the daemon's VmHWM starts at the fork, so the
    peak is the larger of the mounting process's max RSS and the daemon's VmHWM. The former
    comes from GNU time (`/usr/bin/time -f %M`; ru_maxrss of a child of this process would
    count this process's own memory, which the child had until its exec); without GNU time
    only the daemon's VmHWM is known."""

    def __init__(self, ckptfs: Path, src: Path, mnt: Path, opts: str = "", timeout: float = 120):
        self.argv = [str(ckptfs), str(src), str(mnt)] + (["-o", opts] if opts else [])
        self.mnt, self.timeout = Path(mnt), timeout
        self.pid = None
        self.mount_s = 0.0
        self.startup_maxrss_kib = 0

    def __enter__(self):
        self.mnt.mkdir(parents=True, exist_ok=True)
        if mounted(self.mnt):
            unmount(self.mnt)
        gnu_time = Path("/usr/bin/time")
        with tempfile.NamedTemporaryFile(mode="r", suffix=".maxrss") as rss:
            argv = ([str(gnu_time), "-f", "%M", "-o", rss.name] if gnu_time.exists() else []) + self.argv
            t0 = time.perf_counter()
            r = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout)
            self.mount_s = time.perf_counter() - t0
            words = rss.read().split()
            self.startup_maxrss_kib = int(words[-1]) if words and words[-1].isdigit() else 0
        if r.returncode != 0 or not mounted(self.mnt):
            unmount(self.mnt)
            raise RuntimeError(f"{' '.join(self.argv)} exited {r.returncode}: {r.stderr.strip()}")
        pids = daemon_pids(self.mnt)
        self.pid = pids[0] if pids else None
        return self

    def hwm_kib(self) -> int:
        daemon = vm_hwm_kib(self.pid) if self.pid else 0
        return max(daemon, self.startup_maxrss_kib)

    def __exit__(self, *exc):
        unmount(self.mnt)
        deadline = time.monotonic() + 30
        while self.pid and Path(f"/proc/{self.pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return False


def set_read_ahead_kb(mnt: Path, kb: int) -> int:
    """Sets the FUSE mount's bdi read_ahead_kb; returns the old value."""
    dev = os.stat(mnt).st_dev
    p = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    old = int(p.read_text())
    p.write_text(f"{kb}\n")
    return old


def read_ahead_kb(mnt: Path) -> int:
    dev = os.stat(mnt).st_dev
    return int(Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").read_text())


def vm_status() -> dict:
    """This process's peak and current memory from /proc/self/status, in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0])
    return out


def touch_pages(tensors) -> int:
    """Reads one byte of every 4 KiB page of every tensor, and its last byte, so tensors that
    only map a file are really read (as a loader's first use would); returns their sum, which
    callers keep so the reads are not optimised away. torch is imported here, not by benchlib."""
    import torch
    total = 0
    for t in tensors:
        b = t.detach().reshape(-1).view(torch.uint8)
        if b.numel():
            total += int(b[::4096].sum(dtype=torch.int64)) + int(b[-1])
    return total


# touch_pages as source text, for the loaders run with `python -c` in fresh processes.
TOUCH_PAGES_SOURCE = inspect.getsource(touch_pages)


def _commit() -> str:
    """`git rev-parse --short HEAD` of this source tree, plus "-dirty" when tracked files
    differ from it; "unknown" outside a git checkout. safe.directory: the benches run as root
    in a tree another user owns, which git otherwise refuses."""
    git = ["git", "-c", f"safe.directory={_ROOT}", "-C", str(_ROOT)]
    try:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=60)
        return head.stdout.strip() + ("-dirty" if dirty.returncode != 0 or dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def _machine() -> dict:
    """CPU model, logical CPUs, RAM and kernel, from /proc."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                cpu = value.strip()
                break
        ram_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal:"))
        kernel = Path("/proc/sys/kernel/osrelease").read_text().strip()
    except (OSError, StopIteration, ValueError):
        ram_kib, kernel = 0, ""
    return {"cpu": cpu or "unknown CPU", "cpus": os.cpu_count(), "ram_gib": round(ram_kib / (1 << 20), 1),
            "kernel": kernel}


_ROOT = Path(__file__).resolve().parents[2]
_PROVENANCE: dict = {}


def provenance() -> dict:
    """What a result row records besides its figure: when ("time"), the source tree's commit
    ("commit"), the machine ("machine") and the load average then ("load": 1, 5 and 15
    minutes). The commit and machine are read once per process."""
    if not _PROVENANCE:
        _PROVENANCE.update(commit=_commit(), machine=_machine())
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **_PROVENANCE,
            "load": [round(x, 2) for x in os.getloadavg()]}


def machine_note() -> str:
    load = os.getloadavg()
    return f"{os.cpu_count()} cpus, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
