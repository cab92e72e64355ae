#!/usr/bin/env python3
"""Profile: where the CPU of a first read through a fresh mount goes (the read path).

For each push-ahead setting (CKPTFS_PUSH_AHEAD_MIB) and repeat: the source is read into the
page cache, a fresh mount is made, and `perf record -a -g` runs while `dd bs=1M` reads the
first --mib MiB of a served file; then dd of the same bytes of the cached source for the
ratio. The samples of dd and of the daemon (its pid) are sorted by their call chains into
what they were doing: the reader's copy to user space, the reader's readahead (allocating
pages, inserting them into the page cache and the LRU, queueing FUSE requests), the daemon's
pread of the source, its READ replies (copying into the mount's pages, pinning its buffer),
its push-ahead stores (page allocation and copy), fetching requests. Everything else on the
machine (other sessions) is left out of the percentages, which are of the reader's and the
daemon's samples together.

On a VM without a PMU, perf samples with a timer that cannot fire while interrupts are off:
time spent under an irq-disabling lock (the LRU and zone locks) is sampled at its unlock,
which still lies in the right call chain, so the categories below hold.

    python tests/bench/profile_first_read.py --ckptfs build/ckptfs \\
        --source ~/.cache/ckptfs/bench/time-to-model/llama-hf --file model.safetensors \\
        --mib 1024 --push 0,256 --repeats 3
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib

SAMPLE_HZ = 4000  # samples per second of CPU time: one sample is 0.25 ms

# (category, test on the set of frames); the first match wins. Daemon categories first: a
# daemon's pread of the source also passes through filemap_read.
DAEMON_RULES = [
    ("daemon: pread copy of the source (page cache -> its buffer)",
     lambda s: "__x64_sys_pread64" in s and "copy_page_to_iter" in s),
    ("daemon: pread, rest (page lookup, marking pages accessed)", lambda s: "__x64_sys_pread64" in s),
    ("daemon: push-ahead store, page allocation + insert + LRU + memcg",
     lambda s: "fuse_dev_do_write" in s and "fuse_copy_args" not in s and "__filemap_get_folio" in s),
    ("daemon: push-ahead store, copy into the mount's pages",
     lambda s: "fuse_dev_do_write" in s and "fuse_copy_args" not in s and "fuse_copy_folio" in s),
    ("daemon: READ reply, pinning its buffer (get_user_pages)",
     lambda s: "fuse_dev_do_write" in s and ("gup_fast_fallback" in s or "__iov_iter_get_pages_alloc" in s
                                             or "iov_iter_get_pages2" in s)),
    ("daemon: READ reply, copy into the mount's pages", lambda s: "fuse_dev_do_write" in s and "fuse_copy_folio" in s),
    ("daemon: READ reply, rest (completion, unlocking pages)", lambda s: "fuse_dev_do_write" in s),
    ("daemon: fetching requests (read of /dev/fuse)", lambda s: "fuse_dev_do_read" in s),
    ("daemon: conversion and user space", lambda s: not any(f.startswith(("entry_SYSCALL", "asm_")) for f in s)),
    ("daemon: rest", lambda s: True),
]
READER_RULES = [
    ("reader: readahead, queueing FUSE requests", lambda s: "fuse_readahead" in s),
    ("reader: readahead, page allocation",
     lambda s: "page_cache_ra_unbounded" in s and ("folio_alloc_noprof" in s or "alloc_pages_mpol" in s)),
    ("reader: readahead, page-cache insert + LRU + memcg", lambda s: "page_cache_ra_unbounded" in s),
    ("reader: copy to user space", lambda s: "copy_page_to_iter" in s),
    ("reader: marking pages accessed (LRU)", lambda s: "folio_mark_accessed" in s),
    ("reader: waiting for pages", lambda s: "folio_wait_bit_common" in s or "schedule" in s),
    ("reader: rest of the read path", lambda s: "ksys_read" in s),
    ("reader: rest", lambda s: True),
]


def classify(script_text: str, daemon_pid: int) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for block in script_text.split("\n\n"):
        lines = [ln for ln in block.splitlines() if ln.strip()]
        if not lines:
            continue
        head = lines[0].split()
        # "comm pid/tid": a comm may hold spaces, the pid/tid field is the last of the line.
        pid = int(head[-1].split("/")[0]) if "/" in head[-1] else -1
        comm = " ".join(head[:-1])
        frames = {ln.split()[1].split("+")[0] for ln in lines[1:] if len(ln.split()) >= 2}
        if pid == daemon_pid:
            rules = DAEMON_RULES
        elif comm == "dd":
            rules = READER_RULES
        else:
            continue
        counts[next(name for name, test in rules if test(frames))] += 1
    return counts


def one_run(args, ckptfs: Path, push: int, work: Path) -> tuple[collections.Counter, float, float]:
    mnt = work / "mnt"
    mnt.mkdir(exist_ok=True)
    subprocess.run(["cat", *[str(p) for p in sources(args.source)]], stdout=subprocess.DEVNULL, check=True)
    env = dict(os.environ, CKPTFS_PUSH_AHEAD_MIB=str(push))
    daemon = subprocess.Popen([str(ckptfs), "-f", str(args.source), str(mnt)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    data = work / f"perf-{push}.data"
    try:
        deadline = time.monotonic() + 60
        while not benchlib.mounted(mnt):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mount of {args.source} did not come up")
            time.sleep(0.02)
        target = mnt / args.file
        os.stat(target)  # lookups and the readahead window before the clock
        count = args.mib * benchlib.MiB
        r = subprocess.run(["perf", "record", "-a", "-g", "-q", "-F", str(SAMPLE_HZ), "-o", str(data), "--", "dd",
                            f"if={target}", "of=/dev/null", "bs=1M", f"count={args.mib}"], capture_output=True,
                           text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"perf record: {r.stderr.strip()}")
        m = re.search(r"copied, ([0-9.e+-]+) s", r.stderr)
        if not m:
            raise RuntimeError(f"cannot parse dd output: {r.stderr!r}")
        mount_s = float(m.group(1))
    finally:
        benchlib.unmount(mnt)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    text = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,pid,tid,ip,sym"], capture_output=True,
                          text=True, timeout=600).stdout
    data.unlink()
    source_file = first_file(args.source, args.file)
    source_s = benchlib.dd(source_file, 0, count)
    return classify(text, daemon.pid), count / mount_s, count / source_s


def sources(source: Path) -> list[Path]:
    return sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]


def first_file(source: Path, name: str) -> Path:
    """The source file dd reads for the ratio: the same name in a folder source, else the file."""
    return source / name if source.is_dir() and (source / name).is_file() else sources(source)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckptfs", default="build/ckptfs")
    ap.add_argument("--source", type=Path, required=True, help="checkpoint to mount (its files are read first)")
    ap.add_argument("--file", default="model.safetensors", help="served file to read, relative to the mount")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--push", default="0,256", help="CKPTFS_PUSH_AHEAD_MIB values to profile")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("perf"):
        print("needs root and perf (perf record -a)", file=sys.stderr)
        return 2
    ckptfs = Path(args.ckptfs).resolve()
    print(benchlib.machine_note(), flush=True)
    with tempfile.TemporaryDirectory(prefix="ckptfs-profile-") as tmp:
        for push in [int(p) for p in args.push.split(",")]:
            total: collections.Counter = collections.Counter()
            rates = []
            for _ in range(args.repeats):
                counts, mount_bps, source_bps = one_run(args, ckptfs, push, Path(tmp))
                total += counts
                rates.append((mount_bps, source_bps))
            n = sum(total.values())
            cpu_ms = 1000 * n / SAMPLE_HZ / args.repeats
            mount_rates = ", ".join(f"{m / 1e9:.2f}" for m, _ in rates)
            source_rates = ", ".join(f"{s / 1e9:.1f}" for _, s in rates)
            print(f"\npush-ahead {push} MiB: reader + daemon {cpu_ms:.0f} CPU-ms per read of {args.mib} MiB "
                  f"({n} samples); first read {mount_rates} GB/s vs dd of the cached source {source_rates} GB/s "
                  f"({benchlib.machine_note()})")
            for name, c in sorted(total.items(), key=lambda kv: -kv[1]):
                print(f"  {100 * c / n:5.1f} %  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
