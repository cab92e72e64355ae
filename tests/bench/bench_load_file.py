#!/usr/bin/env python3
"""Benchmark (g): safetensors.torch.load_file of the mount's model.safetensors vs the same
file on a real disk path, and vs torch.load(mmap=True) of the source .pt.

The checkpoint is written by the real torch.save (child process): 16 float32 tensors of
64 MiB (1 GiB; --quick: 16 x 8 MiB), cached under --workdir. The real-path copy is
`cp MNT/model.safetensors WORKDIR/real/model.safetensors` (checked byte-equal).

Each load runs in a fresh Python process that has imported torch and safetensors before
the clock starts; the time is the load plus a touch of one byte of every 4 KiB page of every
tensor (safetensors >= 0.8 and torch mmap load lazily; without the touch nothing is read):

  ckptfs     load_file(MNT/model.safetensors), the mount's pages evicted first
             (first read through FUSE; the source .pt in page cache)
  real file  load_file(WORKDIR/real/model.safetensors), in page cache
  torch mmap torch.load(SRC.pt, mmap=True, weights_only=True), in page cache
  ckptfs warm  the mount's pages cached too (information)

Methods take turns; medians of --repeats (default 3). Goal: ckptfs within 1.2x of the
real file.

    python tests/bench/bench_load_file.py --ckptfs build/ckptfs [--quick]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import benchlib
from benchlib import GB, MiB, CkptfsMount, Results, dd, evict, median

LOADER = r"""
import json, sys, time
import torch
from safetensors.torch import load_file
mode, path = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if mode == "safetensors":
    sd = load_file(path)
else:
    sd = torch.load(path, mmap=True, weights_only=True)
t1 = time.perf_counter()
touch_pages(sd.values())
t2 = time.perf_counter()
print(json.dumps({"load": t1 - t0, "touch": t2 - t1, "total": t2 - t0, "tensors": len(sd)}))
"""


def make_checkpoint(path: Path, n: int, size: int):
    if path.exists():
        return
    tmp = path.with_name(path.stem + "-tmp.pt")
    code = (f"import torch; torch.manual_seed(0); "
            f"torch.save({{f'layers.{{i}}.weight': torch.randn({size // 4}) for i in range({n})}}, {str(tmp)!r})")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=900)
    tmp.rename(path)


def load(mode: str, path: Path, timeout: float = 600) -> dict:
    r = subprocess.run([sys.executable, "-c", benchlib.TOUCH_PAGES_SOURCE + LOADER, mode, str(path)], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"loader {mode} {path}: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(ap)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--tensor-mib", type=int, default=0, help="default 64, quick 8")
    args = ap.parse_args()
    got = benchlib.workdir_and_binary(argparse.Namespace(workdir=args.workdir, ckptfs=args.ckptfs, generate_only=False))
    if not got:
        return 2
    workdir, ckptfs = got
    size = (args.tensor_mib or (8 if args.quick else 64)) * MiB
    repeats = args.repeats or (1 if args.quick else 3)
    res = Results("load_file", args.json_out)
    src = workdir / f"load{args.tensors}x{size // MiB}.pt"
    make_checkpoint(src, args.tensors, size)
    real = workdir / "real" / "model.safetensors"
    real.parent.mkdir(exist_ok=True)
    mnt = workdir / "mnt-load"
    times = {"ckptfs": [], "real": [], "torch": [], "warm": []}
    with CkptfsMount(ckptfs, src, mnt) as m:
        model = mnt / "model.safetensors"
        shutil.copyfile(model, real)
        if not filecmp.cmp(model, real, shallow=False):
            print("copy differs from the mount's file", file=sys.stderr)
            return 1
        total = real.stat().st_size
        print(f"model.safetensors {total / GB:.2f} GB ({args.tensors} x {size // MiB} MiB); "
              f"{benchlib.machine_note()}; repeats {repeats}", flush=True)
        for _ in range(repeats):
            dd(src)
            dd(real)
            evict(model)
            times["ckptfs"].append(load("safetensors", model)["total"])
            times["warm"].append(load("safetensors", model)["total"])
            times["real"].append(load("safetensors", real)["total"])
            times["torch"].append(load("torch", src)["total"])
    detail = {"model_bytes": total, "repeats": repeats, "load": benchlib.machine_note(), "seconds": times}
    t = {k: median(v) for k, v in times.items()}
    res.add("g.real", f"load_file + touch of model.safetensors ({total / GB:.2f} GB), mount first read",
            t["ckptfs"], t["real"], "s", "≤ 1.2", t["ckptfs"] / t["real"] <= 1.2, alt_name="real file",
            detail=detail)
    res.add("g.torch", "load_file(mount) vs torch.load(mmap=True) of the source .pt", t["ckptfs"], t["torch"], "s",
            "info", None, alt_name="torch.load mmap", detail=detail)
    res.add("g.warm", "load_file(mount), mount pages cached, vs real file", t["warm"], t["real"], "s", "info", None,
            alt_name="real file", detail=detail)
    if not args.keep:
        src.unlink(missing_ok=True)
    real.unlink(missing_ok=True)
    real.parent.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
