#!/usr/bin/env python3
"""`ckptfs diff` of two large checkpoints against the script a user writes instead: both
loaded with torch.load(mmap=True), every pair compared in float64 (differing elements, max
abs and max rel difference, ||A-B||/||A||).

Checkpoints: A, a torch.save .pt of fp32 tensors (--tensors x --tensor-mib, ~2.15 GB by
default); B, A after a simulated optimizer step (every tensor but every fourth moved by
1e-3 * randn), also a .pt. Each run starts from a cold page cache (--warm: both files read
once before every run instead). Figures: wall time (goal <= 1.0x the script's) and peak RSS
(goal <= 0.1x), the median of --repeats runs that take turns; the per-tensor rel_l2 of the
two must agree (to 1e-9: torch's Tensor.norm is the looser of the two) or the bench fails.

    python tests/bench/bench_diff.py [--tensors 16 --tensor-mib 128] [--warm] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import benchlib
from benchlib import GB, MiB, Results, median

# The alternative: what a user writes today.
SCRIPT = r"""
import json, sys, torch
a = torch.load(sys.argv[1], mmap=True, weights_only=True)
b = torch.load(sys.argv[2], mmap=True, weights_only=True)
out = {"only_in_a": [k for k in a if k not in b], "only_in_b": [k for k in b if k not in a], "tensors": {}}
for key, x in a.items():
    if key not in b:
        continue
    y = b[key]
    if x.shape != y.shape:
        out["tensors"][key] = {"status": "shape"}
        continue
    if x.dtype == y.dtype and torch.equal(x, y):
        out["tensors"][key] = {"status": "identical", "rel_l2": 0.0}
        continue
    xd, yd = x.double(), y.double()
    d = xd - yd
    ad = d.abs()
    out["tensors"][key] = {"differing": int((d != 0).sum()), "max_abs": float(ad.max()),
                           "max_rel": float((ad / xd.abs()).max()), "rel_l2": float(d.norm() / xd.norm())}
json.dump(out, sys.stdout)
"""


def make_pair(workdir: Path, tensors: int, tensor_mib: int) -> tuple[Path, Path]:
    import torch

    a_path, b_path = workdir / f"diff-a-{tensors}x{tensor_mib}.pt", workdir / f"diff-b-{tensors}x{tensor_mib}.pt"
    if a_path.exists() and b_path.exists():
        return a_path, b_path
    numel = tensor_mib * MiB // 4
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(numel // 1024, 1024, generator=g) for i in range(tensors)}
    torch.save(state, a_path)
    for i, t in enumerate(state.values()):  # in place: one checkpoint in memory at a time
        if i % 4 != 3:
            t.add_(torch.randn(t.shape, generator=g), alpha=1e-3)
    torch.save(state, b_path)
    return a_path, b_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(ap)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--tensor-mib", type=int, default=0, help="default 128 (2.15 GB a side), quick 8")
    ap.add_argument("--warm", action="store_true", help="both files cached before every run, not a cold cache")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    got = benchlib.workdir_and_binary(argparse.Namespace(workdir=args.workdir, ckptfs=args.ckptfs, generate_only=False))
    if not got:
        return 2
    workdir, ckptfs = got
    tensor_mib = args.tensor_mib or (8 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    a, b = make_pair(workdir, args.tensors, tensor_mib)
    size = a.stat().st_size
    cache = benchlib.Cache(workdir, "other processes' pages stay", cold=not args.warm)
    if cache.mode != "cold":  # warm: read exactly the two checkpoints before each run
        cache.source = a
    print(f"two .pt of {size / GB:.2f} GB ({args.tensors} x {tensor_mib} MiB fp32); cache {cache.mode}; "
          f"{benchlib.machine_note()}; repeats {repeats}", flush=True)

    def warm_both():
        cache.prepare()
        if cache.mode != "cold":
            benchlib.Cache(b, "", cold=False).prepare()

    runs = {"ckptfs": [], "script": []}
    results = {}
    for _ in range(repeats):
        for name in ("ckptfs", "script"):
            warm_both()
            # diff exits 1 for "different", which run_measured takes for a failure: a shell
            # maps 0 and 1 to success (its peak RSS is its child's, GNU time reports the max).
            argv = (["sh", "-c", '"$0" "$@"; [ $? -le 1 ]', str(ckptfs), "diff", "--json", str(a), str(b)]
                    if name == "ckptfs" else [sys.executable, "-c", SCRIPT, str(a), str(b)])
            wall, rss, out, _ = benchlib.run_measured(argv, args.timeout)
            runs[name].append((wall, rss))
            results[name] = json.loads(out)
    # The two must agree, or the timing compares different work.
    ours = {t["key"]: t for t in results["ckptfs"]["tensors"]}
    for key, theirs in results["script"]["tensors"].items():
        mine = ours[key]
        if abs(mine["rel_l2"] - theirs["rel_l2"]) > 1e-9 * max(theirs["rel_l2"], 1e-300) or \
                (theirs.get("differing") is not None and mine["differing"] != theirs["differing"]):
            print(f"{key}: ckptfs {mine} differs from the script's {theirs}", file=sys.stderr)
            return 1
    wall = {k: median([w for w, _ in v]) for k, v in runs.items()}
    rss = {k: median([r for _, r in v]) * 1024 for k, v in runs.items()}
    detail = {"checkpoint_bytes": size, "tensors": args.tensors, "tensor_mib": tensor_mib, "cache": cache.mode,
              "repeats": repeats, "load": benchlib.machine_note(),
              "runs": {k: [{"seconds": w, "peak_rss_kib": r} for w, r in v] for k, v in runs.items()}}
    res = Results("diff", args.json_out)
    res.add("diff.wall", f"diff of two {size / GB:.2f} GB .pt ({cache.mode}) vs torch.load(mmap=True) script",
            wall["ckptfs"], wall["script"], "s", "≤ 1.0", wall["ckptfs"] <= wall["script"],
            alt_name="torch mmap script", detail=detail)
    res.add("diff.rss", f"diff of two {size / GB:.2f} GB .pt: peak RSS vs the script's", rss["ckptfs"] / 1e6,
            rss["script"] / 1e6, "MB", "≤ 0.1", rss["ckptfs"] <= 0.1 * rss["script"], alt_name="torch mmap script",
            detail=detail)
    if not args.keep:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
