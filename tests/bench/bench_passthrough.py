#!/usr/bin/env python3
"""Benchmark (p): a Hugging Face folder mounted without a view, read with FUSE passthrough on
(-o passthrough=auto, the default) and off, side by side with the source folder itself.

The model: a transformers Llama written by save_pretrained (one model.safetensors of ~0.7 GB
fp32; --quick: ~0.17 GB), generated once under --workdir. Every mount run mounts afresh (the
mount's page cache starts empty) with the source files in page cache; each loader runs in a
fresh Python process that has imported torch and transformers before the clock starts
(bench_loader_mount.py's loader):

  load_file         safetensors.torch.load_file(DIR/model.safetensors) + a touch of one byte of
                    every 4 KiB page of every tensor; DIR = the source folder vs the mount
  from_pretrained   AutoModelForCausalLM.from_pretrained(DIR) + the same touch
  dd                dd bs=1M of DIR/model.safetensors: the mount's first sequential read vs the
                    cached source file's

The alternatives take turns, medians of --repeats (default 5). Before timing, the mount's
mapped tensors are compared with the source's (every byte). Goals with passthrough: load_file
and from_pretrained <= 1.2x the source, dd >= 0.9x the source's rate. The copy path's figures
(passthrough off) are printed beside them for information.

    python tests/bench/bench_passthrough.py --ckptfs build/ckptfs [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import benchlib
from bench_loader_mount import load
from benchlib import GB, CkptfsMount, Results, dd, median

GENERATE = r"""
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
hidden, layers, vocab = (int(a) for a in sys.argv[2:5])
torch.manual_seed(0)
config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                     num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                     max_position_embeddings=256, tie_word_embeddings=False)
LlamaForCausalLM(config).save_pretrained(sys.argv[1], max_shard_size="100GB")
"""

EXACT = r"""
import sys, torch
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
assert a.keys() == b.keys()
for k in a:
    assert torch.equal(a[k].view(torch.uint8) if a[k].dim() else a[k], b[k].view(torch.uint8) if b[k].dim() else b[k]), k
print(len(a))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(ap)
    args = ap.parse_args()
    got = benchlib.workdir_and_binary(argparse.Namespace(workdir=args.workdir, ckptfs=args.ckptfs, generate_only=False))
    if not got:
        return 2
    workdir, ckptfs = got
    shape = (512, 6, 32000) if args.quick else (1024, 10, 32000)
    src = workdir / ("passthrough-llama-%d-%d-%d" % shape)
    if not (src / "model.safetensors").is_file():
        subprocess.run([sys.executable, "-c", GENERATE, str(src), *map(str, shape)], check=True, timeout=1800)
    model = src / "model.safetensors"
    size = model.stat().st_size
    repeats = args.repeats or (1 if args.quick else 5)
    res = Results("passthrough", args.json_out)
    mnt = workdir / "mnt-passthrough"
    print(f"model {src} ({size / GB:.2f} GB); {benchlib.machine_note()}; repeats {repeats}", flush=True)

    with CkptfsMount(ckptfs, src, mnt) as m:
        status = json.loads(os.getxattr(mnt, "user.ckptfs.passthrough"))
        print(f"passthrough on this machine: {status}", flush=True)
        if not status["active"]:
            print(f"passthrough is not available here ({status.get('why')}): nothing to compare", file=sys.stderr)
            return 1
        exact = subprocess.run([sys.executable, "-c", EXACT, str(mnt / "model.safetensors"), str(model)],
                               capture_output=True, text=True, timeout=600)
        if exact.returncode != 0:
            print(f"the mount's mapped tensors differ from the source's: {exact.stderr[-2000:]}", file=sys.stderr)
            return 1
        print(f"mapped reads exact: {exact.stdout.strip()} tensors equal, byte for byte", flush=True)

    modes = {"on": "passthrough=auto", "off": "passthrough=off"}
    t = {f"{where}_{what}": [] for where in ("src", "on", "off") for what in ("lf", "fp", "dd")}

    def through_mount(key: str, opts: str, run):
        dd(model)  # the source in page cache, as for the source's own runs
        with CkptfsMount(ckptfs, src, mnt, opts):
            t[key].append(run())

    for rep in range(repeats):
        order = ("on", "off") if rep % 2 == 0 else ("off", "on")
        for key, mode in (("lf", "load_file"), ("fp", "from_pretrained")):
            dd(model)
            t[f"src_{key}"].append(load(mode, src)["total"])
            for where in order:
                through_mount(f"{where}_{key}", modes[where], lambda: load(mode, mnt)["total"])
        dd(model)
        t["src_dd"].append(dd(model))
        for where in order:
            through_mount(f"{where}_dd", modes[where], lambda: dd(mnt / "model.safetensors"))
        print(f"  run {rep + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in t.items()), flush=True)

    detail = {"model_bytes": size, "repeats": repeats, "load": benchlib.machine_note(), "seconds": t}
    med = {k: median(v) for k, v in t.items()}
    for where, goal_met in (("on", True), ("off", False)):
        name = "passthrough" if where == "on" else "copy path (passthrough off)"
        res.add(f"p.load_file.{where}", f"load_file + touch of a fresh mount, {name}, vs the real file", med[f"{where}_lf"],
                med["src_lf"], "s", "≤ 1.2" if goal_met else "info",
                (med[f"{where}_lf"] / med["src_lf"] <= 1.2) if goal_met else None, alt_name="real file", detail=detail)
        res.add(f"p.from_pretrained.{where}", f"from_pretrained + touch of a fresh mount, {name}, vs the source folder",
                med[f"{where}_fp"], med["src_fp"], "s", "≤ 1.2" if goal_met else "info",
                (med[f"{where}_fp"] / med["src_fp"] <= 1.2) if goal_met else None, alt_name="source folder",
                detail=detail)
        mnt_rate, src_rate = size / med[f"{where}_dd"] / GB, size / med["src_dd"] / GB
        res.add(f"p.dd.{where}", f"dd first read of a fresh mount, {name}, vs dd of the cached source", mnt_rate,
                src_rate, "GB/s", "≥ 0.9" if goal_met else "info", (mnt_rate / src_rate >= 0.9) if goal_met else None,
                alt_name="dd of the source", detail=detail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
