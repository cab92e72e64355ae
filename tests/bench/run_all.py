#!/usr/bin/env python3
"""Runs every ckptfs benchmark and prints one table: figure | ckptfs | alternative | ratio |
goal | met.

    python tests/bench/run_all.py [--quick] [--only a,b,...] [--workdir DIR]
    scripts/bench.sh [same options]        (sets up the venvs, builds, then runs this)

Benchmarks (ids for --only):
  a b c e   bench_read_throughput.py   sequential / concurrent / bf16 / 4 KiB random reads
  d         bench_archive_peers.py     a .pt storage record vs fuse-zip and ratarmount
  f         bench_mount_ls.py          mount + first ls and daemon peak RSS (1k, 100k, sparse 1 TB,
                                       5k + 200 KB metadata, remount with the catalog cache)
  g         bench_load_file.py         load_file of model.safetensors vs a real file, torch mmap
  h         bench_loader_mount.py      from_pretrained / load_file through a fresh mount vs the source
                                       folder (2.2 GB Llama), vs dd's first read of the mount
  p         bench_passthrough.py       load_file / from_pretrained / dd of a mounted HF folder with
                                       FUSE passthrough on and off, vs the source folder
  ttm       bench_time_to_model.py     time to model: ZeRO-3 / fp32 .pt as bf16 / DCP, ckptfs vs
                                       zero_to_fp32, torch.load, dcp_to_torch_save (by name only)
  ls        bench_ls_scaling.py        `ckptfs ls` by tensor count and size (its own checks)
  bf16      bench_bf16_load.py         fp32 .pt loaded as bf16 vs torch.load (its own checks)
  zero      bench_zero_consolidate.py  ZeRO-3 to safetensors vs zero_to_fp32 (its own checks)
  dcp       bench_dcp_consolidate.py   FSDP2 DCP save to one file vs dcp_to_torch_save (its own checks)
  verl      bench_verl_merge.py        veRL FSDP2 actor to one file vs veRL's model merger (its own checks)
  scale     bench_metadata_scale.py    `ckptfs ls` of a 1,000,000-chunk DCP folder (writes ~1.7 GB)
  diff      bench_diff.py              `ckptfs diff` of two 2.15 GB .pt vs a torch.load(mmap=True) script
  keymap    bench_keymap.py            mount + ls of 100k Megatron tensors with and without -o map=llama;
                                       read rates of mapped (unstacked, QKV row-group) tensors

Every benchmark appends JSON lines to WORKDIR/results.jsonl; a rerun of one benchmark
replaces its earlier lines, so `--only d` after a full run refreshes just that part, and the
table always shows the latest figure of every benchmark (`--table` prints it without
running anything). Every row records its time, the commit (`-dirty` when tracked files
had uncommitted changes), the machine and the load average; the table's header sums them
up. The five benches with checks of their own (ls, bf16, zero, dcp, verl) report pass/fail plus
the tail of their output (in the JSON detail). Each benchmark runs under a deadline;
generated data live under --workdir (default /tmp/ckptfs-bench) and are deleted afterwards
unless --keep. Needs root (page-cache control, bdi read-ahead) and /dev/fuse.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import benchlib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# id -> (script, letters it covers, extra args full, extra args quick, timeout full, timeout quick)
BENCHES = {
    "throughput": ("bench_read_throughput.py", "abce", [], [], 900, 150),
    "peers": ("bench_archive_peers.py", "d", [], [], 420, 90),
    "mount_ls": ("bench_mount_ls.py", "f", [], [], 420, 120),
    "load_file": ("bench_load_file.py", "g", [], [], 420, 120),
    "loader": ("bench_loader_mount.py", "h", [], ["--repeats", "1"], 1200, 400),
    "passthrough": ("bench_passthrough.py", "p", [], [], 1200, 300),
    # Fixtures (~14 GB) stay in its own cache folder (~/.cache/ckptfs/bench/time-to-model).
    "ttm": ("bench_time_to_model.py", "", [], ["--only", "c", "--repeats", "1"], 3600, 1200),
    "ls": ("bench_ls_scaling.py", "ls", ["--repeats", "3", "--sparse-repeats", "9"],
           ["--repeats", "1", "--sparse-repeats", "3", "--tensors", "10000"], 420, 120),
    "bf16": ("bench_bf16_load.py", "bf16", ["--tensors", "12", "--repeats", "2", "--no-pread"],
             ["--tensors", "8", "--repeats", "1", "--no-pread"], 420, 120),
    "metadata_scale": ("bench_metadata_scale.py", "scale", [], ["--repeats", "1"], 1500, 900),
    "zero": ("bench_zero_consolidate.py", "zero",
             ["--vocab", "8000", "--hidden", "1024", "--ffn", "2816", "--layers", "4", "--repeats", "2"],
             ["--vocab", "1000", "--hidden", "256", "--ffn", "512", "--layers", "1", "--repeats", "1",
              "--no-train"], 900, 240),
    # Full: the 2.1 GB-of-fp32-weights FSDP2 world-4 save (6.4 GB with Adam moments), ~2 min to
    # generate; quick: a few MB.
    "dcp": ("bench_dcp_consolidate.py", "dcp", [],
            ["--vocab", "1000", "--hidden", "256", "--ffn", "512", "--layers", "1"], 1800, 300),
    # Full: a 2.15 GB veRL FSDP2 world-4 actor saved by veRL itself (the verl overlay env), ~40 s to
    # generate; quick: a few MB.
    "verl": ("bench_verl_merge.py", "verl", [],
             ["--vocab", "1000", "--hidden", "256", "--ffn", "512", "--layers", "1", "--heads", "4",
              "--kv-heads", "2"], 1800, 600),
    # Two 2.15 GB .pt (16 x 128 MiB fp32), 3 repeats, cold cache; quick: 16 x 8 MiB.
    "diff": ("bench_diff.py", "diff", [], [], 900, 180),
    # Full: 100,005 per-layer tensors and a ~0.7 GB stacked save, ~40 s to generate; quick: a tenth.
    "keymap": ("bench_keymap.py", "keymap", [], [], 900, 300),
}
LEGACY = {"ls", "bf16", "zero", "dcp", "verl"}  # report their own PASS/FAIL; no JSON of their own
WORD_IDS = LEGACY | {"scale", "diff", "keymap"}  # ids that are words; the others are sets of one-letter ids


def selected(only: str) -> list[str]:
    if not only:
        return list(BENCHES)
    want = set(x.strip() for x in only.split(",") if x.strip())
    out = []
    for name, (_, letters, *_r) in BENCHES.items():
        if name in want or (letters in WORD_IDS and letters in want) or \
                (letters and letters not in WORD_IDS and any(w in letters for w in want if len(w) == 1)):
            out.append(name)
    unknown = [w for w in want if w not in BENCHES and w not in WORD_IDS and not (len(w) == 1 and w in "abcdefghp")]
    if unknown:
        raise SystemExit(f"unknown --only ids: {unknown}")
    return out


def load_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def drop_bench_rows(path: Path, bench: str):
    rows = [r for r in load_rows(path) if r.get("bench") != bench]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def fmt(v, unit):
    if v is None:
        return "-"
    if isinstance(v, float):
        s = f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    else:
        s = str(v)
    return f"{s} {unit}".strip()


def spans(rows: list[dict], value) -> str:
    """The distinct values of value(row) over rows, each with the benches it covers when
    there are several (a bench rerun with --only at another commit shows as such)."""
    by_value: dict[str, list[str]] = {}
    for r in rows:
        benches = by_value.setdefault(value(r), [])
        if r["bench"] not in benches:
            benches.append(r["bench"])
    if len(by_value) == 1:
        return next(iter(by_value))
    return "; ".join(f"{v} ({', '.join(b)})" for v, b in by_value.items())


def machine_text(m) -> str:
    if not m:
        return "not recorded"
    return f"{m['cpu']}, {m['cpus']} CPUs, {m['ram_gib']:g} GiB RAM, Linux {m['kernel']}"


def header(rows: list[dict]) -> str:
    """Where and when the figures of the table were measured, from what each row recorded
    (benchlib.provenance): machine, dates, commit, and the range of the 1-minute load
    average at the moments the figures were taken."""
    latest = list({(r["bench"], r["id"]): r for r in rows}.values())
    times = sorted(r["time"].replace("T", " ")[:16] for r in latest if r.get("time"))
    dates = times[0] if times and times[0] == times[-1] else (f"{times[0]} to {times[-1]}" if times else "-")
    loads = [r["load"][0] for r in latest if r.get("load")]
    load = (f"{min(loads):.2f}" + (f" to {max(loads):.2f}" if max(loads) > min(loads) else "")) if loads \
        else "not recorded"
    return "\n".join([
        f"- machine: {spans(latest, lambda r: machine_text(r.get('machine')))}",
        f"- results of: {dates}",
        f"- commit: {spans(latest, lambda r: r.get('commit', 'not recorded'))}",
        f"- load average (1 min) when the figures were taken: {load}",
    ])


def table(rows: list[dict]) -> str:
    order = {"read_throughput": 0, "archive_peers": 1, "mount_ls": 2, "load_file": 3, "loader_mount": 4,
             "time_to_model": 5, "ls": 6, "bf16": 7, "zero": 8}
    latest = {}
    for r in rows:
        latest[(r["bench"], r["id"])] = r
    rows = sorted(latest.values(), key=lambda r: (order.get(r["bench"], 9), r["id"][:1], r["id"]))
    head = ["figure", "ckptfs", "alternative", "ratio", "goal", "met"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        alt = fmt(r.get("alternative"), r.get("unit", ""))
        if r.get("alt_name") and r.get("alternative") is not None:
            alt = f"{alt} ({r['alt_name']})"
        ratio = r.get("ratio")
        ratio = f"{ratio:.2f}" if isinstance(ratio, (int, float)) else "-"
        met = {True: "yes", False: "**no**", None: "-"}[r.get("met")]
        lines.append(f"| {r['id']}: {r['figure']} | {fmt(r.get('ckptfs'), r.get('unit', ''))} | {alt} | "
                     f"{ratio} | {r.get('goal', '')} | {met} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckptfs", default=str(ROOT / "build" / "ckptfs"))
    ap.add_argument("--workdir", default="/tmp/ckptfs-bench")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repeat: a smoke test (~3 min)")
    ap.add_argument("--only", default="", help="comma list: a,b,c,d,e,f,g,h,ls,bf16,zero,dcp,verl,scale,ttm or bench names")
    ap.add_argument("--repeats", type=int, default=0, help="override every bench's repeat count")
    ap.add_argument("--keep", action="store_true", help="keep generated checkpoints for the next run")
    ap.add_argument("--table", action="store_true", help="print the table of WORKDIR/results.jsonl and stop")
    ap.add_argument("--ratarmount-path", default=os.environ.get("CKPTFS_BENCH_PKGS", ""))
    args = ap.parse_args()

    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    results = workdir / "results.jsonl"
    if args.table:
        rows = load_rows(results)
        if not rows:
            print(f"run_all: no results in {results}", file=sys.stderr)
            return 1
        print(header(rows) + "\n\n" + table(rows))
        return 0
    if os.geteuid() != 0:
        print("run_all: needs root (drop_caches, read-ahead, fuse mounts of the peers)", file=sys.stderr)
        return 2
    ckptfs = Path(args.ckptfs).resolve()
    if not os.access(ckptfs, os.X_OK):
        print(f"run_all: ckptfs binary not found: {ckptfs} (scripts/build.sh)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    if args.ratarmount_path:
        env["CKPTFS_BENCH_PKGS"] = args.ratarmount_path

    started = time.time()
    load0 = os.getloadavg()
    status = 0
    for name in selected(args.only):
        script, letters, full_extra, quick_extra, t_full, t_quick = BENCHES[name]
        bench_key = {"throughput": "read_throughput", "peers": "archive_peers", "loader": "loader_mount",
                     "ttm": "time_to_model"}.get(name, name)
        drop_bench_rows(results, bench_key)
        sub = workdir / name if name in LEGACY else workdir
        sub.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, str(HERE / script), "--ckptfs", str(ckptfs)]
        if name != "ttm":
            argv += ["--workdir", str(sub)]
        if name not in LEGACY:
            argv += ["--json-out", str(results)]
            if args.quick:
                argv.append("--quick")
            if args.keep:
                argv.append("--keep")
            if name == "throughput":
                want = set(args.only.split(",")) & set("abce") if args.only else set("abce")
                argv += ["--only", ",".join(sorted(want or set("abce")))]
        argv += quick_extra if args.quick else full_extra
        if args.repeats:
            argv += ["--repeats", str(args.repeats)]
        timeout = t_quick if args.quick else t_full
        print(f"\n=== {name}: {' '.join(argv[1:])}", flush=True)
        t0 = time.perf_counter()
        tail = ""
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    start_new_session=True)
            out = []
            deadline = time.monotonic() + timeout
            import selectors
            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                if time.monotonic() > deadline:
                    os.killpg(proc.pid, 9)
                    raise subprocess.TimeoutExpired(argv, timeout)
                if sel.select(timeout=1.0):
                    line = proc.stdout.readline()
                    if not line:
                        break
                    out.append(line)
                    print(line, end="", flush=True)
            rc = proc.wait(timeout=30)
            tail = "".join(out[-40:])
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except Exception as e:  # a broken bench must not stop the others
            rc = f"error: {e}"
        wall = time.perf_counter() - t0
        print(f"=== {name}: exit {rc} after {wall:.0f} s", flush=True)
        # Mounts of a killed bench must not stay behind.
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            mp = line.split()[4]
            if mp.startswith(str(workdir) + "/"):
                subprocess.run(["fusermount3", "-uz", mp], capture_output=True, timeout=60)
        if name in LEGACY or rc != 0:
            row = {"bench": bench_key if name not in LEGACY else name,
                   "id": (letters if name in LEGACY else name) + (".run" if rc != 0 and name not in LEGACY else ""),
                   "figure": f"{script}: its own targets" if name in LEGACY else f"{script} did not finish",
                   "ckptfs": "PASS" if rc == 0 else ("FAIL" if isinstance(rc, int) else str(rc)),
                   "alternative": None, "alt_name": "", "unit": "", "ratio": None,
                   "goal": "exit 0", "met": rc == 0, "detail": {"tail": tail, "seconds": wall},
                   **benchlib.provenance()}
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
        if rc != 0:
            status = 1
        if name in LEGACY and not args.keep:
            shutil.rmtree(sub, ignore_errors=True)
    if not args.keep:
        for p in workdir.glob("mnt-*"):
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
    load1 = os.getloadavg()
    print(f"\nckptfs benchmarks, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cpus, load "
          f"{load0[0]:.1f} -> {load1[0]:.1f}, {'quick' if args.quick else 'full'} run, "
          f"{(time.time() - started) / 60:.1f} min; results in {results}\n")
    rows = load_rows(results)
    print(header(rows) + "\n\n" + table(rows))
    return status


if __name__ == "__main__":
    sys.exit(main())
