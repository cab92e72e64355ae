#!/usr/bin/env python3
"""Benchmark: ckptfs.load(device="cpu") from Python vs torch.load(mmap=True) and vs
safetensors.torch.load_file of the same tensors as a real safetensors file.

Sources (generated once, cached under --workdir):
  pt           a torch.save file of float32 tensors (default 32 x 4096x2048: 1.07 GB)
  pt.st        the same tensors written by safetensors' save_file (the reference copy)
  zero         a DeepSpeed ZeRO-3 save dir (--zero DIR; tests/bench/bench_zero_consolidate.py
               --generate-only makes one), whose fp32 master weights ckptfs consolidates
  zero.st      `ckptfs export` of it: model.safetensors, a real safetensors file holding what
               zero_to_fp32 gives (tests/zero checks that bit for bit)
  dcp          a torch.distributed.checkpoint save dir (--dcp DIR; tests/bench/bench_dcp_consolidate.py
               --generate-only makes one: FSDP2 at world 2 or more, model and Adam state), loaded
               with root="model" (the model's weights, as from_pretrained wants them)
  dcp.st       `ckptfs export --root model` of it (tests/dcp checks the export against
               dcp_to_torch_save)

Methods, each in a fresh process (this file with a hidden mode), --repeats rounds of one run
of each method (interleaved, so a change in the machine's load hits every method alike), medians:
  ckptfs.load             ckptfs.load(SOURCE, device="cpu"): tensors stored as served are views
                          of a private map of their file; tensors split over files (ZeRO-3) are
                          composed of maps of those files where their pages line up; others
                          are filled by libckptfs
  ckptfs.load bf16        ckptfs.load(SOURCE, device="cpu", dtype="bf16"): converted by the
                          library through bounded buffers into the bf16 tensors
  torch.load mmap         torch.load(SOURCE, mmap=True, weights_only=True)     (.pt only)
  ckptfs.load mmap=False  (ZeRO, DCP) every tensor copied by buffered pread into torch.empty
                          tensors (two threads): the loader without its maps
  new memory              (ZeRO, DCP) torch.empty(N bytes).fill_(1), N = the copy's size: the
                          page faults and zeroing that any loader copying into new memory pays
  memcpy into faulted     (ZeRO, DCP) the tensors of load_file, made resident, copied into
                          memory allocated and written before the clock: the copy alone
  load_file               safetensors.torch.load_file(COPY.safetensors)         the reference
  load_file + clone       the same, each tensor cloned: what any loader that copies costs at
                          least                                                  (information)
  ckptfs.load of the copy ckptfs.load(COPY.safetensors, device="cpu")

Times: `call` is the load call; `+touch` adds reading one byte of every 4 KiB page of every
tensor, which makes lazily mapped tensors resident, so it is the time until all bytes are in
memory whatever the method (the fair comparison: a map costs nothing until touched). `cpu s`
is the loading process's user + system time over call and touch, `faults` its minor page
faults: both barely change with the machine's load, unlike the times. Each child imports torch,
safetensors and ckptfs and loads libckptfs.so before the clock, and sets torch's threads to
--torch-threads (default 1; 0 leaves torch's default): the touch is a strided sum, and with
torch's OpenMP pool on a loaded 2-core machine its barrier took 25-30 ms of CPU per touch of
0.89 GB whatever the loader (the same touch repeated with no fault left cost as much), which
hid the loaders' own differences; libckptfs's threads are not torch's. Medians of --repeats runs
decide the goals; the best run is printed too (the machine may be loaded). Peak RSS is VmHWM of
the loading process after the touch, and net of the floor (the VmHWM of a process that only
imported torch, safetensors and ckptfs), which every loader pays.

Goals (printed; exit status 1 when one fails):
  ckptfs.load call+touch time <= 1.1 x load_file's of the safetensors copy, for every source
  ckptfs.load bf16 from fp32: peak RSS net of the floor <= 1.1 x the bf16 size

The page cache is warm (every source file dropped from it and read back before each run, so
that it is cached in the same large folios for every method): the figures compare the
loaders' own work, not the disk. Run by hand from the repo root with the interpreter whose
ckptfs is to be measured (the installed wheel's, or the test venv with PYTHONPATH=python):

    python tests/bench/bench_python_load.py --zero /tmp/ckptfs-bench-pyload/zero/ckpt \
        [--dcp /tmp/ckptfs-bench-pyload-dcp/ckpt] [--only zero,dcp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import benchlib

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
TIME_GOAL = 1.1
RSS_GOAL = 1.1


# --- child modes (torch is imported only here) ---------------------------------------------


def child_load(mode: str, source: str, torch_threads: int, root: str) -> None:
    import resource

    import safetensors.torch
    import torch

    import ckptfs

    ckptfs.option_table()  # loads libckptfs.so before the clock, as importing safetensors loads its own
    if torch_threads > 0:
        torch.set_num_threads(torch_threads)
    if mode == "memcpy":
        # Made resident and allocated before the clock: what is timed is the copy alone.
        sources = safetensors.torch.load_file(source)
        benchlib.touch_pages(sources.values())
        flat = torch.empty(sum(t.nbytes for t in sources.values()), dtype=torch.uint8).fill_(1)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    roots = {"root": root} if root else {}
    if mode == "ckptfs":
        out = ckptfs.load(source, device="cpu", **roots)
    elif mode == "ckptfs-copy":
        out = ckptfs.load(source, device="cpu", mmap=False, **roots)
    elif mode == "ckptfs-bf16":
        out = ckptfs.load(source, device="cpu", dtype="bf16", **roots)
    elif mode == "torch-mmap":
        out = torch.load(source, mmap=True, weights_only=True)
    elif mode == "load_file":
        out = safetensors.torch.load_file(source)
    elif mode == "load_file-clone":
        out = {key: tensor.clone() for key, tensor in safetensors.torch.load_file(source).items()}
    elif mode == "new-memory":
        out = {"buffer": torch.empty(os.path.getsize(source), dtype=torch.uint8).fill_(1)}
    elif mode == "memcpy":
        out, at = {}, 0
        for key, tensor in sources.items():
            out[key] = flat[at:at + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
            at += tensor.nbytes
    elif mode == "floor":
        out = {}
    else:
        raise SystemExit(f"unknown mode {mode}")
    t1 = time.perf_counter()
    benchlib.touch_pages(out.values())
    t2 = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"call_s": t1 - t0, "touch_s": t2 - t1, "tensors": len(out),
                      "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
                      "faults": r1.ru_minflt - r0.ru_minflt,
                      "bytes": sum(t.numel() * t.element_size() for t in out.values()), **benchlib.vm_status()}))


def child_generate_pt(out: str, tensors: int, rows: int, cols: int) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(16)
    state = {f"model.layers.{i}.weight": torch.randn(rows, cols, generator=g) for i in range(tensors)}
    torch.save(state, out)
    save_file(state, out + ".safetensors")


# --- the measuring process -------------------------------------------------------------------


def run_child(args: list[str], timeout: float) -> dict:
    result = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def warm(path: Path) -> None:
    """Drops PATH's pages from the page cache and reads them back in: every run starts with the
    file wholly cached in the large folios that a sequential read gives. Left as other runs and
    memory pressure leave them, a file can end up in small folios, and every loader that maps it
    then takes several times the faults (3-6x seen on the loaded machine)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    buf = bytearray(8 * MiB)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            while f.readinto(buf):
                pass


def measure(methods: dict, repeats: int, timeout: float, torch_threads: int) -> dict:
    """Runs every method of METHODS ({name: (mode, source, root)}) REPEATS times, interleaved
    (one run of each per round, so a change in the machine's load hits them alike); medians."""
    runs = {name: [] for name in methods}
    for _ in range(repeats):
        for name, (mode, source, root) in methods.items():
            warm(source)
            runs[name].append(run_child(["--_load", mode, str(source), str(torch_threads), root], timeout))
    out = {}
    for name, rs in runs.items():
        med = {key: statistics.median(r[key] for r in rs) for key in ("call_s", "touch_s", "VmHWM", "cpu_s", "faults")}
        med["total_s"] = statistics.median(r["call_s"] + r["touch_s"] for r in rs)
        med["best_s"] = min(r["call_s"] + r["touch_s"] for r in rs)
        med["bytes"] = rs[0]["bytes"]
        med["tensors"] = rs[0]["tensors"]
        out[name] = med
    return out


def ckptfs_binary() -> Path:
    import ckptfs

    return ckptfs.executable_path()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/ckptfs-bench-pyload")
    ap.add_argument("--zero", default="", help="a DeepSpeed ZeRO save dir (bench_zero_consolidate.py --generate-only)")
    ap.add_argument("--dcp", default="", help="a DCP save dir with a model.* subtree (bench_dcp_consolidate.py "
                    "--generate-only)")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--only", default="", help="comma-separated sources to measure (pt, zero, dcp); default all")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch.set_num_threads in every child (0: torch's default); see the docstring")
    ap.add_argument("--_load", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--_generate", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._load:
        child_load(args._load[0], args._load[1], int(args._load[2]), args._load[3])
        return 0
    if args._generate:
        out, *dims = args._generate
        child_generate_pt(out, *map(int, dims))
        return 0

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec = f"{args.tensors}x{args.rows}x{args.cols}"
    pt = workdir / f"fp32-{spec}.pt"
    if not Path(str(pt) + ".safetensors").is_file():
        print(f"generating {pt} and its safetensors copy ...", flush=True)
        subprocess.run([sys.executable, __file__, "--_generate", str(pt), str(args.tensors), str(args.rows),
                        str(args.cols)], check=True, timeout=args.timeout)
    sources = {"pt": (pt, Path(str(pt) + ".safetensors"), "")}
    for name, folder, root in (("zero", args.zero, ""), ("dcp", args.dcp, "model")):
        if not folder:
            continue
        copy = workdir / f"{name}-export"
        if not (copy / "model.safetensors").is_file():
            print(f"exporting {folder} to {copy} (the safetensors copy) ...", flush=True)
            subprocess.run([str(ckptfs_binary()), "export", *(["--root", root] if root else []), folder, str(copy)],
                           check=True, timeout=args.timeout)
        sources[name] = (Path(folder), copy / "model.safetensors", root)

    floor = measure({"floor": ("floor", pt, "")}, args.repeats, args.timeout, args.torch_threads)["floor"]["VmHWM"]
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; page cache warm; "
          f"torch threads {args.torch_threads or 'default'}; "
          f"floor (torch + safetensors + ckptfs imported) {floor / 1024:.0f} MiB; medians of {args.repeats}, "
          f"methods interleaved\n")
    header = (f"{'source':8} {'method':30} {'GB':>6} {'call s':>8} {'+touch s':>9} {'cpu s':>7} {'faults':>7} "
              f"{'peak MiB':>9} {'net MiB':>8}  ratio")
    print(header)
    failed = []
    for name, (source, copy, root) in sources.items():
        if args.only and name not in args.only.split(","):
            continue
        methods = {"ckptfs.load": ("ckptfs", source, root), "ckptfs.load bf16": ("ckptfs-bf16", source, root)}
        if name == "pt":
            methods["torch.load mmap"] = ("torch-mmap", source, "")
        else:
            methods["ckptfs.load mmap=False (copy)"] = ("ckptfs-copy", source, root)
            methods["new memory (empty + fill_)"] = ("new-memory", copy, "")
            methods["memcpy into faulted memory"] = ("memcpy", copy, "")
        methods["load_file (safetensors copy)"] = ("load_file", copy, "")
        methods["load_file + clone (copy floor)"] = ("load_file-clone", copy, "")
        methods["ckptfs.load of the copy"] = ("ckptfs", copy, "")
        rows = measure(methods, args.repeats, args.timeout, args.torch_threads)
        reference = rows["load_file (safetensors copy)"]["total_s"]
        reference_best = rows["load_file (safetensors copy)"]["best_s"]
        reference_cpu = rows["load_file (safetensors copy)"]["cpu_s"]
        for method, m in rows.items():
            net = (m["VmHWM"] - floor) / 1024
            ratio = m["total_s"] / reference
            if method == "ckptfs.load bf16":
                ratio_text = f"net RSS {net * MiB / m['bytes']:.2f}x bf16 size (goal <= {RSS_GOAL})"
                if net * MiB > RSS_GOAL * m["bytes"]:
                    failed.append(f"{name}: {ratio_text}")
            else:
                ratio_text = (f"{ratio:.2f}x load_file (call+touch; best of {args.repeats}: {m['best_s']:.3f} s, "
                              f"{m['best_s'] / reference_best:.2f}x; cpu {m['cpu_s'] / reference_cpu:.2f}x)")
                if method in ("ckptfs.load", "ckptfs.load of the copy") and ratio > TIME_GOAL:
                    failed.append(f"{name} {method}: {ratio_text}, goal <= {TIME_GOAL}")
            print(f"{name:8} {method:30} {m['bytes'] / 1e9:6.2f} {m['call_s']:8.3f} {m['total_s']:9.3f} "
                  f"{m['cpu_s']:7.3f} {m['faults']:7.0f} {m['VmHWM'] / 1024:9.0f} {net:8.0f}  {ratio_text}", flush=True)
    print("\ngoals: " + ("all met" if not failed else "NOT met: " + "; ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
