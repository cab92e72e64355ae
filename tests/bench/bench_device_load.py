#!/usr/bin/env python3
"""Loading a checkpoint into GPU memory: ckptfs's device path vs the usual loaders.

    python tests/bench/bench_device_load.py [--size-mb 1024] [--runs 3] [--dtype bf16] [--keep DIR]

One fp32 safetensors checkpoint (64 tensors) is written, read once so it sits in the page
cache, then each contender loads all of it, best of --runs, GB/s of tensor bytes delivered:

  with a GPU (torch.cuda.is_available()):
    ckptfs.load(device="cuda:0")             pinned ring + cudaMemcpyAsync (or cuFile)
    safetensors.torch.load_file(device="cuda")
    fastsafetensors                           if importable
    ceiling: pinned H2D of the same bytes     file -> pinned host tensor (readinto), then
                                              .to("cuda", non_blocking=True): read+copy and
                                              copy alone
  without one (this is what CI machines run):
    ckptfs load --backend host                the same pipeline into host memory (CLI, --json)
    ckptfs.load(device="cpu")                 the Python entry point (host back end)
    plain read of the file                    readinto one preallocated buffer, 16 MiB chunks
    safetensors.torch.load_file (cpu)         mmap + copy into tensors
  and says that the GPU figures need a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import ckptfs  # noqa: E402

MiB = 1 << 20


def ckptfs_bin() -> Path:
    return Path(os.environ.get("CKPTFS_BIN", REPO / "build" / "ckptfs"))


def make_checkpoint(path: Path, size_mb: int) -> int:
    n = 64
    per = size_mb * MiB // n // 4
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}.weight": torch.randn(per, generator=g) for i in range(n)}
    save_file(tensors, path)
    return sum(t.numel() * 4 for t in tensors.values())


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 * MiB):
            pass


def best(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def plain_read(path: Path) -> None:
    size = path.stat().st_size
    buf = bytearray(size)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        off = 0
        while off < size:
            n = f.readinto(view[off:off + 16 * MiB])
            if not n:
                break
            off += n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                    help="also convert (ckptfs on the host, safetensors/torch after load)")
    ap.add_argument("--keep", type=Path, help="write the checkpoint here and keep it")
    args = ap.parse_args()

    tmp = None
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        folder = args.keep
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench-device-")
        folder = Path(tmp.name)
    path = folder / "model.safetensors"
    if not path.exists():
        make_checkpoint(path, args.size_mb)
    nbytes = sum(e["nbytes"] for e in ckptfs.list_tensors(path, dtype=args.dtype))
    warm(path)
    gpu = torch.cuda.is_available()
    print(f"checkpoint: {path.stat().st_size / 1e9:.2f} GB, 64 fp32 tensors, page cache warm; "
          f"dtype {args.dtype or 'as stored'}; best of {args.runs}")
    rows = []  # (name, seconds)

    if gpu:
        dev = "cuda:0"
        torch.cuda.init()
        print(f"device: {torch.cuda.get_device_name(0)}")

        def ck():
            ckptfs.load(path, device=dev, dtype=args.dtype)
            torch.cuda.synchronize()

        rows.append(("ckptfs.load cuda (auto)", best(ck, args.runs)))
        rows[-1] = (rows[-1][0] + f" [{ckptfs.last_load_stats()['backend']}]", rows[-1][1])

        def st():
            out = load_file(path, device="cuda")
            if args.dtype:
                out = {k: v.to(getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[args.dtype]))
                       for k, v in out.items()}
            torch.cuda.synchronize()

        rows.append(("safetensors load_file(device=cuda)", best(st, args.runs)))
        try:
            from fastsafetensors import SafeTensorsFileLoader, SingleGroup  # type: ignore

            def fst():
                loader = SafeTensorsFileLoader(SingleGroup(), "cuda:0", nogds=False)
                loader.add_filenames({0: [str(path)]})
                fb = loader.copy_files_to_device()
                for key in fb.key_to_rank_lidx:
                    fb.get_tensor(key)
                torch.cuda.synchronize()
                fb.close()
                loader.close()

            rows.append(("fastsafetensors", best(fst, args.runs)))
        except ImportError:
            print("fastsafetensors: not installed (pip install fastsafetensors to compare)")
        except Exception as e:  # its API moves between releases
            print(f"fastsafetensors: failed ({type(e).__name__}: {e})")

        size = path.stat().st_size
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        device_buf = torch.empty(size, dtype=torch.uint8, device=dev)

        def read_pinned():
            with open(path, "rb", buffering=0) as f:
                f.readinto(memoryview(pinned.numpy()))

        def copy_only():
            device_buf.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

        def read_and_copy():
            read_pinned()
            copy_only()

        rows.append(("ceiling: file -> pinned -> .to(cuda)", best(read_and_copy, args.runs)))
        rows.append(("ceiling: pinned -> GPU copy alone", best(copy_only, args.runs)))
    else:
        print("no GPU here (torch.cuda.is_available() is False): the GPU figures (ckptfs cuda/cufile vs "
              "safetensors, fastsafetensors and the pinned-copy ceiling) need a machine with one; "
              "measuring the host back end of the same pipeline instead")
        binary = ckptfs_bin()
        extra = ["--dtype", args.dtype] if args.dtype else []
        cli_secs = []
        for _ in range(args.runs):
            out = subprocess.run([str(binary), "load", "--backend", "host", "--json", *extra, str(path)],
                                 capture_output=True, check=True, timeout=600)
            cli_secs.append(json.loads(out.stdout)["seconds"])
        rows.append(("ckptfs load --backend host (CLI, pipeline time)", min(cli_secs)))
        for threads in (1, 2):
            rows.append((f"ckptfs.load(device=cpu), {threads} I/O thread(s)",
                         best(lambda: ckptfs.load(path, device="cpu", dtype=args.dtype, io_threads=threads), args.runs)))
        rows.append(("ckptfs.load(device=cpu), buffered (no O_DIRECT)",
                     best(lambda: ckptfs.load(path, device="cpu", dtype=args.dtype, direct_io=False), args.runs)))
        rows.append(("plain read of the file (readinto, 16 MiB)", best(lambda: plain_read(path), args.runs)))

        def st_cpu():
            out = load_file(path)
            for v in out.values():
                v.add_(0) if not args.dtype else v.to(torch.bfloat16)

        rows.append(("safetensors load_file (cpu) + touch", best(st_cpu, args.runs)))

    base = rows[0][1]
    print(f"\n{'contender':55s} {'s':>8s} {'GB/s':>8s} {'vs first':>9s}")
    for name, secs in rows:
        print(f"{name:55s} {secs:8.3f} {nbytes / secs / 1e9:8.2f} {base / secs:8.2f}x")
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
