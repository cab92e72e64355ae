#!/usr/bin/env python3
"""Benchmark: listing a legacy (pre-1.6) torch.save checkpoint reads O(tensors) bytes.

A legacy stream has no directory: torch.load reads it from end to end. ckptfs parses the
pickles before the storages and walks the storages' 8-byte element counts, seeking over the
data (doc/FORMATS.md, "Legacy torch.save streams"). Side by side, in fresh processes, on a
1 GB file of 256 float32 tensors (`--quick`: 64 MB of 64):

  ckptfs ls SRC                                   vs
  python -c "torch.load(SRC, weights_only=True)"  (what a user runs to list it)

Figures: bytes read through read()/pread() (rchar of /proc/<pid>/io, taken while the exited
child is a zombie) and wall time, median of the repeats, source in the page cache. Goal:
ckptfs reads at most 300 KB. Run by hand from the repo root:

    python tests/bench/bench_legacy_ls.py [--quick] [--ckptfs build/ckptfs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchlib import Results, add_common_args, machine_note, median


def rchar_and_wall(argv: list[str]) -> tuple[int, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    wall = time.perf_counter() - t0
    io = dict(line.split(": ") for line in Path(f"/proc/{proc.pid}/io").read_text().splitlines())
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.read().decode()}")
    return int(io["rchar"]), wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    tensors = 64 if args.quick else 256
    work = Path(args.workdir) / "legacy-ls"
    work.mkdir(parents=True, exist_ok=True)
    src, empty = work / "legacy.pt", work / "empty.pt"
    torch.save({f"layers.{i}.weight": torch.zeros(1 << 20) for i in range(tensors)}, src,
               _use_new_zipfile_serialization=False)
    torch.save({}, empty, _use_new_zipfile_serialization=False)
    size = src.stat().st_size
    src.read_bytes()  # into the page cache
    res = Results("legacy_ls", args.json_out)
    print(machine_note(), flush=True)
    try:
        # What each tool reads besides the checkpoint (libraries, its own files) is measured
        # on an empty checkpoint and subtracted.
        ck_base, _ = rchar_and_wall([args.ckptfs, "ls", str(empty)])
        load = [sys.executable, "-c", "import sys, torch; torch.load(sys.argv[1], weights_only=True)"]
        py_base, _ = rchar_and_wall(load + [str(empty)])
        ck, py = [], []
        for _ in range(repeats):
            ck.append(rchar_and_wall([args.ckptfs, "ls", str(src)]))
            py.append(rchar_and_wall(load + [str(src)]))
        ck_read = median([r for r, _ in ck]) - ck_base
        py_read = median([r for r, _ in py]) - py_base
        detail = {"file_bytes": size, "tensors": tensors, "repeats": repeats}
        res.add("legacy.read", f"bytes read listing a {size / 1e9:.2f} GB legacy checkpoint", ck_read, py_read,
                "B", goal="ckptfs <= 300 KB", met=ck_read <= 300 * 1024, alt_name="torch.load", detail=detail)
        res.add("legacy.wall", "wall time, fresh process (source cached)", median([w for _, w in ck]),
                median([w for _, w in py]), "s", alt_name="torch.load (incl. import torch)", detail=detail)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["met"] is not False for r in res.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
