#!/usr/bin/env python3
"""Benchmark: metadata at scale, `ckptfs ls` wall time and peak RSS (issue 13's scale
acceptance, issue 14's million tensors).

  dcp-1m    a DCP folder of 1,023,744 chunks: tests/scale/make_dcp_scale.py (torch's own
            metadata classes, a 256-rank FSDP-shaped save of a 3,999-parameter model,
            pickled as dcp.save pickles it; chunk archives are torch.save's bytes, data
            left as holes). Beside it, what a user would run instead to list it:
            FileSystemReader(DIR).read_metadata() and printing keys and shapes.
            Goal: ckptfs ls < 3 s, peak RSS < 1 GB.
  torch-1m  a torch.save checkpoint of 1,000,000 small float32 tensors (bench_ls_scaling's
            make_many_tensors, the real torch.save: ~5 minutes to write here). Beside it,
            torch.load(mmap=True, weights_only=True) + listing. Goal: < 2 s, < 500 MB.

Each timed command is a fresh process (peak RSS from GNU time); page cache warm (one
untimed run first); medians of --repeats. Generated data are kept in --workdir between
runs (delete them by hand, ~2 GB) so that a rerun takes minutes, not ten.

    python tests/bench/bench_metadata_scale.py --ckptfs build/ckptfs [--only dcp-1m]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import benchlib
from benchlib import Results, median, run_measured

REPO = Path(__file__).resolve().parents[2]
DCP_GENERATOR = REPO / "tests" / "scale" / "make_dcp_scale.py"

LIST_DCP = """
import sys, time
t0 = time.perf_counter()
from torch.distributed.checkpoint import FileSystemReader
md = FileSystemReader(sys.argv[1]).read_metadata()
n = 0
for fqn, m in md.state_dict_metadata.items():
    if hasattr(m, "size"):
        print(fqn, tuple(m.size), m.properties.dtype)
        n += 1
print(n, "tensors", f"{time.perf_counter() - t0:.3f}", file=sys.stderr)
"""

LIST_TORCH = """
import sys, time
t0 = time.perf_counter()
import torch
sd = torch.load(sys.argv[1], mmap=True, weights_only=True)
for k, v in sd.items():
    print(k, tuple(v.shape), v.dtype)
print(len(sd), "tensors", f"{time.perf_counter() - t0:.3f}", file=sys.stderr)
"""


def make_dcp(workdir: Path) -> Path:
    out = workdir / "scale-dcp-1m"
    if not (out / "expected.json").exists():
        tmp = workdir / "scale-dcp-1m.tmp"
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
        subprocess.run([sys.executable, str(DCP_GENERATOR), str(tmp)], check=True, timeout=3600)
        tmp.rename(out)
    return out


def make_torch(workdir: Path, n: int) -> Path:
    path = workdir / f"scale-torch-{n}.pt"
    if not path.exists():
        import bench_ls_scaling as ls

        tmp = path.with_name(path.name + ".tmp")
        ls.make_many_tensors(tmp, n)
        tmp.rename(path)
    return path


def measure(argvs: dict[str, list[str]], repeats: int) -> dict[str, tuple[list[float], list[int]]]:
    out = {name: ([], []) for name in argvs}
    for argv in argvs.values():
        run_measured(argv, timeout=900, stdout=subprocess.DEVNULL)  # warm-up
    for _ in range(repeats):
        for name, argv in argvs.items():
            wall, rss_kib, _, _ = run_measured(argv, timeout=900, stdout=subprocess.DEVNULL)
            out[name][0].append(wall)
            out[name][1].append(rss_kib)
    return out


def report(res: Results, fid: str, what: str, runs, alt_name: str, time_goal: float, rss_goal_mb: float,
           count: int, repeats: int):
    walls, rss = runs["ckptfs"]
    alt_walls, alt_rss = runs["alternative"]
    detail = {"repeats": repeats, "load": benchlib.machine_note(), "wall_s": walls, "rss_kib": rss,
              "alt_wall_s": alt_walls, "alt_rss_kib": alt_rss, "count": count}
    w, a = median(walls), median(alt_walls)
    mb, amb = max(rss) * 1024 / 1e6, max(alt_rss) * 1024 / 1e6
    res.add(fid, f"ckptfs ls, {what}", w, a, "s", f"< {time_goal:g} s", w < time_goal, alt_name=alt_name,
            detail=detail)
    res.add(f"{fid}.rss", f"ckptfs ls peak RSS, {what}", mb, amb, "MB", f"< {rss_goal_mb:g} MB",
            mb < rss_goal_mb, alt_name=alt_name, detail=detail)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(ap)
    ap.add_argument("--only", default="dcp-1m,torch-1m", help="comma-separated: dcp-1m, torch-1m")
    ap.add_argument("--tensors", type=int, default=1_000_000, help="tensor count of torch-1m")
    args = ap.parse_args()
    got = benchlib.workdir_and_binary(argparse.Namespace(workdir=args.workdir, ckptfs=args.ckptfs,
                                                         generate_only=False))
    if not got:
        return 2
    workdir, ckptfs = got
    repeats = args.repeats or (1 if args.quick else 3)
    only = set(args.only.split(","))
    res = Results("metadata_scale", args.json_out)
    print(benchlib.machine_note(), flush=True)
    if "dcp-1m" in only:
        t0 = time.perf_counter()
        folder = make_dcp(workdir)
        print(f"DCP folder ready in {time.perf_counter() - t0:.0f} s: {folder}", flush=True)
        runs = measure({"ckptfs": [str(ckptfs), "ls", str(folder)],
                        "alternative": [sys.executable, "-c", LIST_DCP, str(folder)]}, repeats)
        report(res, "scale.dcp", "DCP, 1,023,744 chunks (256 ranks x 3,999 tensors)", runs,
               "torch read_metadata + list", 3.0, 1000.0, 3999, repeats)
    if "torch-1m" in only:
        t0 = time.perf_counter()
        path = make_torch(workdir, args.tensors)
        print(f"torch.save checkpoint ready in {time.perf_counter() - t0:.0f} s: {path}", flush=True)
        runs = measure({"ckptfs": [str(ckptfs), "ls", str(path)],
                        "alternative": [sys.executable, "-c", LIST_TORCH, str(path)]}, repeats)
        report(res, "scale.torch", f"torch.save, {args.tensors:,} tensors", runs,
               "torch.load(mmap) + list", 2.0, 500.0, args.tensors, repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
