#!/usr/bin/env python3
"""Benchmark (h): loaders that read a mount through mmap page faults, on their first read.

The model: a 551M-parameter transformers Llama (2.2 GB of fp32) written by save_pretrained,
shared with bench_time_to_model.py (generated once under --model-dir, default
~/.cache/ckptfs/bench/time-to-model/llama-hf). Every run mounts the folder afresh (the mount's
page cache starts empty) with the source files in page cache, then, in a fresh Python process
that has imported torch and transformers before the clock starts:

  from_pretrained   AutoModelForCausalLM.from_pretrained(DIR) + a touch of one byte of every
                    4 KiB page of every parameter, DIR = the source folder vs the mount
  load_file         safetensors.torch.load_file(DIR/model.safetensors) + the same touch
  dd                dd bs=1M of MNT/model.safetensors (the mount's sequential first-read rate)

With --compare-push MIB, every mount run is paired with one whose daemon pushes ahead
(CKPTFS_PUSH_AHEAD_MIB=MIB; src/fuse/push_ahead.hpp, off by default), the two taking turns, and
the bench prints both medians and their ratio. It prints CPU seconds for every alternative
(loader's timed part, daemon's whole life): on a loaded machine the wall times mostly measure
the load, the CPU seconds much less.

Five runs each (--repeats), the alternatives in turn; median and spread (max - min over twice
the median). Goals: from_pretrained through the mount at >= 0.8x dd's first-read
rate through the same mount, spread under 25%, <= 4x the source folder's time; load_file of
the mount <= 5x the real file's.

    python tests/bench/bench_loader_mount.py --ckptfs build/ckptfs [--mount-opts OPTS]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import benchlib
from benchlib import GB, CkptfsMount, Results, dd, median

HERE = Path(__file__).resolve().parent

LOADER = r"""
import json, resource, sys, time
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
import transformers.core_model_loading  # noqa: F401
mode, path = sys.argv[1], sys.argv[2]
# transformers imports its model code lazily: a first from_pretrained in a process spent ~4 s
# here before reading anything. Built once before the clock, as a long-lived process would.
LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2))
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, t0 = cpu(), time.perf_counter()
if mode == "from_pretrained":
    tensors = list(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).parameters())
else:
    tensors = list(load_file(path + "/model.safetensors").values())
t1 = time.perf_counter()
touch_pages(tensors)
t2 = time.perf_counter()
print(json.dumps({"load": t1 - t0, "touch": t2 - t1, "total": t2 - t0, "cpu": cpu() - c0}))
"""


def load(mode: str, folder: Path, timeout: float = 600) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-c", benchlib.TOUCH_PAGES_SOURCE + LOADER, mode, str(folder)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"loader {mode} {folder}: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spread(xs: list[float]) -> float:
    """(max - min) / (2 * median): the ± around the median."""
    return (max(xs) - min(xs)) / (2 * median(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(ap)
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache" / "ckptfs" / "bench" / "time-to-model" /
                                               "llama-hf"))
    ap.add_argument("--mount-opts", default="", help="extra -o options (experiments)")
    ap.add_argument("--read-ahead-kb", type=int, default=0, help="set the mount's bdi read_ahead_kb (experiments)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--compare-push", type=int, default=0, metavar="MIB",
                    help="pair every mount run with one that pushes ahead (CKPTFS_PUSH_AHEAD_MIB=MIB)")
    args = ap.parse_args()
    got = benchlib.workdir_and_binary(argparse.Namespace(workdir=args.workdir, ckptfs=args.ckptfs, generate_only=False))
    if not got:
        return 2
    workdir, ckptfs = got
    src = Path(args.model_dir)
    if not (src / "model.safetensors").is_file():
        gen = subprocess.run([sys.executable, str(HERE / "bench_time_to_model.py"), "--only", "c", "--generate-only",
                              "--workdir", str(src.parent)], timeout=3600)
        if gen.returncode != 0 or not (src / "model.safetensors").is_file():
            print(f"no model at {src}", file=sys.stderr)
            return 1
    repeats = args.repeats or (1 if args.quick else 5)
    res = Results("loader_mount", args.json_out)
    mnt = workdir / "mnt-loader"
    size = (src / "model.safetensors").stat().st_size
    t = {"src_fp": [], "mnt_fp": [], "src_lf": [], "mnt_lf": [], "dd": []}
    if args.compare_push:
        t.update({"mnt_fp_push": [], "mnt_lf_push": [], "dd_push": []})
    cpu = {k: [] for k in t}  # loader CPU s (timed part; dd: none) and daemon CPU s, per run
    daemon_cpu = {k: [] for k in t}
    print(f"model {src} ({size / GB:.2f} GB); {benchlib.machine_note()}; repeats {repeats}; opts "
          f"{args.mount_opts or '-'}", flush=True)

    def fresh_mount(push: bool = False):
        m = CkptfsMount(ckptfs, src, mnt, args.mount_opts)
        # Without --compare-push the environment decides, as for a user's mount.
        saved = os.environ.get("CKPTFS_PUSH_AHEAD_MIB")
        if args.compare_push:
            os.environ["CKPTFS_PUSH_AHEAD_MIB"] = str(args.compare_push) if push else "0"
        try:
            m.__enter__()
        finally:
            os.environ.pop("CKPTFS_PUSH_AHEAD_MIB", None)
            if saved is not None:
                os.environ["CKPTFS_PUSH_AHEAD_MIB"] = saved
        if args.read_ahead_kb:
            import time
            deadline = time.monotonic() + 5
            while benchlib.read_ahead_kb(mnt) < 1024 and time.monotonic() < deadline:
                time.sleep(0.01)  # ckptfs raises it itself first
            benchlib.set_read_ahead_kb(mnt, args.read_ahead_kb)
        return m

    def through_mount(key: str, push: bool, run):
        dd(src / "model.safetensors")
        m = fresh_mount(push)
        try:
            seconds, loader_cpu = run()
            daemon_cpu[key].append(process_cpu_s(m.pid) if m.pid else float("nan"))
        finally:
            m.__exit__(None, None, None)
        t[key].append(seconds)
        cpu[key].append(loader_cpu)

    variants = [("", False)] + ([("_push", True)] if args.compare_push else [])
    for rep in range(repeats):
        for key, mode in (("fp", "from_pretrained"), ("lf", "load_file")):
            dd(src / "model.safetensors")
            r = load(mode, src)
            t[f"src_{key}"].append(r["total"])
            cpu[f"src_{key}"].append(r["cpu"])
            # The variants take turns, their order alternating from one repeat to the next.
            for suffix, push in (variants if rep % 2 == 0 else variants[::-1]):
                through_mount(f"mnt_{key}{suffix}", push, lambda: (lambda r: (r["total"], r["cpu"]))(load(mode, mnt)))
        for suffix, push in (variants if rep % 2 == 0 else variants[::-1]):
            through_mount(f"dd{suffix}", push, lambda: (dd(mnt / "model.safetensors"), float("nan")))
        print(f"  run {rep + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in t.items()), flush=True)

    detail = {"model_bytes": size, "repeats": repeats, "load": benchlib.machine_note(), "seconds": t,
              "loader_cpu_s": cpu, "daemon_cpu_s": daemon_cpu, "mount_opts": args.mount_opts}
    tag = args.tag
    dd_rate = size / median(t["dd"])
    fp_rate = size / median(t["mnt_fp"])
    res.add("h.rate" + tag, "from_pretrained + touch through a fresh mount: rate vs dd's first read of the mount",
            fp_rate / GB, dd_rate / GB, "GB/s", "≥ 0.8", fp_rate / dd_rate >= 0.8, alt_name="dd of the mount",
            detail=detail)
    sp = spread(t["mnt_fp"])
    res.add("h.spread" + tag, "from_pretrained + touch through a fresh mount: spread ± around the median",
            sp * 100, None, "%", "< 25%", (sp < 0.25) if repeats >= 3 else None, ratio=sp, detail=detail)
    res.add("h.source" + tag, "from_pretrained + touch: fresh mount vs the source folder", median(t["mnt_fp"]),
            median(t["src_fp"]), "s", "≤ 4", median(t["mnt_fp"]) / median(t["src_fp"]) <= 4,
            alt_name="source folder", detail=detail)
    res.add("h.load_file" + tag, "load_file + touch: fresh mount vs the real file", median(t["mnt_lf"]),
            median(t["src_lf"]), "s", "≤ 5", median(t["mnt_lf"]) / median(t["src_lf"]) <= 5,
            alt_name="real file", detail=detail)
    print("spread: mount from_pretrained " + f"{sp * 100:.0f}%, source {spread(t['src_fp']) * 100:.0f}%, "
          f"mount load_file {spread(t['mnt_lf']) * 100:.0f}%, dd {spread(t['dd']) * 100:.0f}%")
    print("median CPU s (loader's timed part / daemon): " + ", ".join(
        f"{k} {median(cpu[k]):.2f}/{median(daemon_cpu[k]) if daemon_cpu[k] else float('nan'):.2f}" for k in t))
    if args.compare_push:
        for key, what in (("mnt_fp", "from_pretrained + touch"), ("mnt_lf", "load_file + touch"), ("dd", "dd")):
            on, off = median(t[key + "_push"]), median(t[key])
            res.add(f"h.push.{key}" + tag, f"{what} through a fresh mount: push-ahead {args.compare_push} MiB vs off "
                    "(median s)", on, off, "s", "info", None, alt_name="push-ahead off", detail=detail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
