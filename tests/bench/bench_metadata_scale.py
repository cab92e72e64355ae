#!/usr/bin/env python3
"""Benchmark: `ckptfs ls` of a DCP folder of a million chunks, wall time, CPU time and peak
RSS (the goal for a million chunks).

  dcp-1m    a DCP folder of 1,023,744 chunks: tests/scale/make_dcp_scale.py (torch's own
            metadata classes, a 256-rank FSDP-shaped save of a 3,999-parameter model,
            pickled as dcp.save pickles it; chunk archives are torch.save's bytes, data
            left as holes). Beside it, what a user would run instead to list it:
            FileSystemReader(DIR).read_metadata() and printing keys and shapes.
            Goal: ckptfs ls < 3 s, peak RSS < 1 GB.

The million-tensor torch.save figures are bench_ls_scaling.py --tensors 1000000 (ls) and
bench_mount_ls.py --tensors 1000000 (mount, first ls, remount with the catalog cache).

Each timed command is a fresh process under GNU time (wall, user + system CPU, peak RSS);
page cache warm (one untimed run first); medians of --repeats. CPU time is printed beside
wall time because a loaded machine stretches the wall time of a single-threaded command by
its share of the cores. The folder (~1.7 GB) is kept in --workdir between runs; delete it
by hand.

    python tests/bench/bench_metadata_scale.py --ckptfs build/ckptfs
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib
from benchlib import GNU_TIME, Results, median

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

def make_dcp(workdir: Path) -> Path:
    out = workdir / "scale-dcp-1m"
    if not (out / "expected.json").exists():
        tmp = workdir / "scale-dcp-1m.tmp"
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
        subprocess.run([sys.executable, str(DCP_GENERATOR), str(tmp)], check=True, timeout=3600)
        tmp.rename(out)
    return out


def run_timed(argv: list[str]) -> tuple[float, float, int]:
    """(wall s, user + system CPU s, peak RSS KiB) of one fresh run under GNU time."""
    if not GNU_TIME:
        raise SystemExit("this bench needs GNU time (/usr/bin/time) for CPU time and peak RSS")
    with tempfile.NamedTemporaryFile(suffix=".time") as timing:
        t0 = time.perf_counter()
        subprocess.run([GNU_TIME, "-f", "%M %U %S", "-o", timing.name, "--", *argv], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=900)
        wall = time.perf_counter() - t0
        rss, user, system = Path(timing.name).read_text().split()[-3:]
    return wall, float(user) + float(system), int(rss)


def measure(argvs: dict[str, list[str]], repeats: int) -> dict[str, list[tuple[float, float, int]]]:
    out = {name: [] for name in argvs}
    for argv in argvs.values():
        run_timed(argv)  # warm-up: page cache
    for _ in range(repeats):
        for name, argv in argvs.items():
            out[name].append(run_timed(argv))
    return out


def report(res: Results, fid: str, what: str, runs, alt_name: str, time_goal: float, rss_goal_mb: float,
           repeats: int):
    mine, alt = runs["ckptfs"], runs["alternative"]
    detail = {"repeats": repeats, "load": benchlib.machine_note(), "ckptfs": mine, "alternative": alt,
              "columns": ["wall_s", "cpu_s", "rss_kib"]}
    wall, alt_wall = median([r[0] for r in mine]), median([r[0] for r in alt])
    cpu, alt_cpu = median([r[1] for r in mine]), median([r[1] for r in alt])
    mb, alt_mb = max(r[2] for r in mine) * 1024 / 1e6, max(r[2] for r in alt) * 1024 / 1e6
    res.add(fid, f"ckptfs ls wall time, {what}", wall, alt_wall, "s", f"< {time_goal:g} s", wall < time_goal,
            alt_name=alt_name, detail=detail)
    res.add(f"{fid}.cpu", f"ckptfs ls CPU time (user + system), {what}", cpu, alt_cpu, "s",
            f"< {time_goal:g} s on an idle core", cpu < time_goal, alt_name=alt_name, detail=detail)
    res.add(f"{fid}.rss", f"ckptfs ls peak RSS, {what}", mb, alt_mb, "MB", f"< {rss_goal_mb:g} MB",
            mb < rss_goal_mb, alt_name=alt_name, detail=detail)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(ap)
    args = ap.parse_args()
    got = benchlib.workdir_and_binary(argparse.Namespace(workdir=args.workdir, ckptfs=args.ckptfs,
                                                         generate_only=False))
    if not got:
        return 2
    workdir, ckptfs = got
    repeats = args.repeats or (1 if args.quick else 3)
    res = Results("metadata_scale", args.json_out)
    print(benchlib.machine_note(), flush=True)
    t0 = time.perf_counter()
    folder = make_dcp(workdir)
    print(f"DCP folder ready in {time.perf_counter() - t0:.0f} s: {folder}", flush=True)
    runs = measure({"ckptfs": [str(ckptfs), "ls", str(folder)],
                    "alternative": [sys.executable, "-c", LIST_DCP, str(folder)]}, repeats)
    report(res, "scale.dcp", "DCP, 1,023,744 chunks (256 ranks x 3,999 tensors)", runs,
           "torch read_metadata + list", 3.0, 1000.0, repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
