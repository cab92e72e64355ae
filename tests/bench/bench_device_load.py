#!/usr/bin/env python3
"""Loading a checkpoint into GPU memory: ckptfs's device path vs the usual loaders.

    python tests/bench/bench_device_load.py [--size-mb 4096] [--runs 3] [--dtype bf16] [--keep DIR]
                                            [--json PATH]

One fp32 safetensors checkpoint (64 tensors) is written, read once so it sits in the page
cache, then each contender loads all of it, best of --runs, GB/s of the tensor bytes delivered
(after --dtype):

  with a GPU (torch.cuda.is_available()):
    ckptfs.load(device="cuda:0")              pinned ring + cudaMemcpyAsync (or cuFile), from
                                              the page cache (direct_io=False) with 2 and 8 I/O
                                              threads, and as a user runs it by default (O_DIRECT
                                              where the file system takes it)
    safetensors.torch.load_file(device="cuda") then .to(dtype) on the GPU with --dtype: torch's
                                              load-then-convert
    fastsafetensors                           GDS where it works, and its bounce-buffer path
                                              (nogds), then .to(dtype) with --dtype
    ceiling: pinned H2D of the same bytes     file -> pinned host tensor (readinto), then
                                              .to("cuda", non_blocking=True): read+copy and
                                              copy alone
  without one (CI machines, scripts/device-check.sh --dry-run):
    ckptfs load --backend host                the same pipeline into host memory (CLI, --json)
    ckptfs.load(device="cpu", mmap=False)     the Python entry point (host back end; mmap=False:
                                              through the pipeline, not maps of the file)
    plain read of the file                    readinto one preallocated buffer, 16 MiB chunks
    safetensors.torch.load_file (cpu)         mmap + copy into tensors
    fastsafetensors (cpu, nogds)              its bounce-buffer path
  and says that the GPU figures need a GPU.

--json writes the rows, the ratios the goals are stated in (tests/bench/README.md) and the
machine, for scripts/device-check.sh's summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
TENSORS = 64
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Goals (ratio of ckptfs's rate to the other's, the same bytes delivered), with a GPU. The
# ceiling is the copy of the bytes, already in pinned memory, to the GPU; reading them into
# pinned memory first (one thread) is shown beside it.
GOALS = {
    "vs_pinned_copy": 0.8,  # ckptfs from page cache / pinned -> GPU copy alone
    "vs_safetensors": 1.0,  # ckptfs / load_file(device="cuda") (then .to(dtype): load-then-convert)
}
# ckptfs's I/O threads in the GPU rows: its default and a count that uses a server's cores.
IO_THREADS = (2, 8)


def ckptfs_bin() -> Path:
    return Path(os.environ.get("CKPTFS_BIN", REPO / "build" / "ckptfs"))


def make_checkpoint(path: Path, size_mb: int) -> None:
    """TENSORS fp32 tensors of random normal values. One random block, shifted per tensor:
    the values need to be ordinary floats, not independent, and drawing gigabytes of them
    one by one takes longer than the loads measured."""
    per = size_mb * MiB // TENSORS // 4
    block = torch.randn(min(per, 16 * MiB), generator=torch.Generator().manual_seed(0))
    tensors = {}
    for i in range(TENSORS):
        t = block.repeat((per + block.numel() - 1) // block.numel())[:per].clone()
        tensors[f"layer.{i}.weight"] = t.add_(i / TENSORS)
    save_file(tensors, path)


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


def convert(tensors: dict, dtype: str | None) -> dict:
    if not dtype:
        return tensors
    return {k: v.to(TORCH_DTYPE[dtype]) for k, v in tensors.items()}


def fastsafetensors_load(path: Path, device: str, nogds: bool, dtype: str | None) -> None:
    from fastsafetensors import SafeTensorsFileLoader  # type: ignore

    loader = SafeTensorsFileLoader(None, device, nogds=nogds)
    try:
        loader.add_filenames({0: [str(path)]})
        files = loader.copy_files_to_device()
        try:
            tensors = convert({key: files.get_tensor(key) for key in files.key_to_rank_lidx}, dtype)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            del tensors
        finally:
            files.close()
    finally:
        loader.close()


def fastsafetensors_rows(path: Path, device: str, modes, dtype, runs, rows: list, notes: list) -> None:
    try:
        import fastsafetensors  # type: ignore
    except ImportError as e:
        notes.append(f"fastsafetensors: not importable ({e}); scripts/device-pack.sh packs its wheel")
        return
    for nogds in modes:
        name = f"fastsafetensors {fastsafetensors.__version__} ({device}, {'nogds' if nogds else 'GDS'})"
        try:
            rows.append((name, best(lambda: fastsafetensors_load(path, device, nogds, dtype), runs)))
        except Exception as e:  # noqa: BLE001  (a peer that fails is a row of the report, not a crash)
            notes.append(f"{name}: failed ({type(e).__name__}: {e})")


def gpu_rows(path: Path, args, rows: list, notes: list) -> dict:
    dev = "cuda:0"
    torch.cuda.init()
    described = {}

    def ck(direct_io: bool, io_threads: int, backend: str = "auto"):
        def run():
            # A thread fills one buffer at a time: twice as many buffers keep them all busy.
            out = ckptfs.load(path, device=dev, dtype=args.dtype, direct_io=direct_io, io_threads=io_threads,
                              buffers=max(4, 2 * io_threads), backend=backend)
            torch.cuda.synchronize()
            del out
        return run

    for threads in IO_THREADS:
        rows.append((f"ckptfs.load cuda, page cache (direct_io=False), {threads} I/O threads",
                     best(ck(False, threads), args.runs)))
        described[f"ckptfs_page_cache_{threads}_threads_stats"] = ckptfs.last_load_stats()
    rows.append(("ckptfs.load cuda, default (O_DIRECT where taken)", best(ck(True, IO_THREADS[0]), args.runs)))
    described["ckptfs_default_stats"] = ckptfs.last_load_stats()
    if described["ckptfs_default_stats"]["backend"] != "cuda":  # auto took cuFile: the pinned path too
        rows.append(("ckptfs.load backend=cuda (pinned ring, no cuFile), default",
                     best(ck(True, IO_THREADS[0], "cuda"), args.runs)))

    def st():
        out = convert(load_file(path, device="cuda"), args.dtype)
        torch.cuda.synchronize()
        del out

    rows.append(("safetensors load_file(device=cuda)" + (f" + .to({args.dtype})" if args.dtype else ""),
                 best(st, args.runs)))

    size = path.stat().st_size
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device_buf = torch.empty(size, dtype=torch.uint8, device=dev)

    def read_pinned():
        with open(path, "rb", buffering=0) as f:
            view = memoryview(pinned.numpy())
            off = 0
            while off < size:
                n = f.readinto(view[off:])
                if not n:
                    break
                off += n

    def copy_only():
        device_buf.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    def read_and_copy():
        read_pinned()
        copy_only()

    rows.append(("ceiling: file -> pinned -> .to(cuda)", best(read_and_copy, args.runs)))
    rows.append(("ceiling: pinned -> GPU copy alone", best(copy_only, args.runs)))
    del pinned, device_buf
    torch.cuda.empty_cache()
    described["device"] = torch.cuda.get_device_name(0)
    # Last: a peer's GDS set-up is what may hang on a machine without GDS.
    fastsafetensors_rows(path, dev, (True, False), args.dtype, args.runs, rows, notes)
    return described


def host_rows(path: Path, args, rows: list, notes: list) -> dict:
    notes.append("no GPU here (torch.cuda.is_available() is False): the GPU figures (ckptfs cuda/cufile vs "
                 "safetensors, fastsafetensors and the pinned-copy ceiling) need a machine with one; "
                 "measuring the host back end of the same pipeline instead")
    extra = ["--dtype", args.dtype] if args.dtype else []
    cli_secs = []
    for _ in range(args.runs):
        out = subprocess.run([str(ckptfs_bin()), "load", "--backend", "host", "--json", *extra, str(path)],
                             capture_output=True, check=True, timeout=600)
        cli_secs.append(json.loads(out.stdout)["seconds"])
    rows.append(("ckptfs load --backend host (CLI, pipeline time)", min(cli_secs)))
    for threads in (1, 2):
        rows.append((f"ckptfs.load(device=cpu), {threads} I/O thread(s)",
                     best(lambda: ckptfs.load(path, device="cpu", dtype=args.dtype, io_threads=threads, mmap=False),
                          args.runs)))
    rows.append(("ckptfs.load(device=cpu), buffered (no O_DIRECT)",
                 best(lambda: ckptfs.load(path, device="cpu", dtype=args.dtype, direct_io=False, mmap=False),
                      args.runs)))
    rows.append(("plain read of the file (readinto, 16 MiB)", best(lambda: plain_read(path), args.runs)))

    def st_cpu():
        out = load_file(path)
        for v in out.values():
            v.add_(0) if not args.dtype else v.to(TORCH_DTYPE[args.dtype])

    rows.append(("safetensors load_file (cpu) + touch", best(st_cpu, args.runs)))
    fastsafetensors_rows(path, "cpu", (True,), args.dtype, args.runs, rows, notes)
    return {"device": "none (host back end)"}


class Report:
    """Rows (name, seconds) and notes, written to --json as each arrives, so a run stopped
    at its deadline (a peer hung in its GDS set-up, say) still leaves what it measured."""

    def __init__(self, path: Path | None, header: dict, nbytes: int):
        self.path, self.header, self.nbytes = path, header, nbytes
        self.rows, self.notes, self.described = Rows(self), Rows(self), {}

    def save(self) -> None:
        if not self.path:
            return
        self.path.write_text(json.dumps({
            **self.header, "rows": [{"name": n, "seconds": s, "gb_per_s": self.nbytes / s / 1e9} for n, s in self.rows],
            "ratios": ratios(self.rows), "goals": GOALS, "notes": list(self.notes), **self.described,
        }, indent=1, default=str))


class Rows(list):
    def __init__(self, report: Report):
        super().__init__()
        self.report = report

    def append(self, item) -> None:
        super().append(item)
        self.report.save()


def ratios(rows: list) -> dict:
    """The goal ratios, where both sides were measured (rates: higher is faster)."""
    secs = dict(rows)

    def find(prefix):
        return next((s for name, s in secs.items() if name.startswith(prefix)), None)

    page_cache = [s for name, s in secs.items() if name.startswith("ckptfs.load cuda, page cache")]
    out = {}
    if page_cache:
        ck = min(page_cache)
        copy, read_copy, st = (find("ceiling: pinned -> GPU copy alone"), find("ceiling: file -> pinned"),
                               find("safetensors load_file(device=cuda)"))
        if copy:
            out["vs_pinned_copy"] = copy / ck
        if read_copy:
            out["vs_read_then_copy"] = read_copy / ck
        if st:
            out["vs_safetensors"] = st / ck
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                    help="deliver this dtype (ckptfs converts while loading; the others load, then .to())")
    ap.add_argument("--keep", type=Path, help="write the checkpoint here and keep it (reused when present)")
    ap.add_argument("--json", type=Path, help="write the rows, ratios and machine here")
    args = ap.parse_args()

    tmp = None
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        folder = args.keep
    else:
        tmp = tempfile.TemporaryDirectory(prefix="bench-device-")
        folder = Path(tmp.name)
    path = folder / f"model-{args.size_mb}mb.safetensors"
    t0 = time.perf_counter()
    if not path.exists():
        make_checkpoint(path, args.size_mb)
    written = time.perf_counter() - t0
    nbytes = sum(e["nbytes"] for e in ckptfs.list_tensors(path, dtype=args.dtype))
    warm(path)
    gpu = torch.cuda.is_available()
    print(f"checkpoint: {path.stat().st_size / 1e9:.2f} GB, {TENSORS} fp32 tensors (written in {written:.1f} s), "
          f"page cache warm; delivering {args.dtype or 'as stored'}; best of {args.runs}")
    report = Report(args.json, {"gpu": gpu, "machine": platform.node(), "checkpoint_bytes": path.stat().st_size,
                                "delivered_bytes": nbytes, "dtype": args.dtype or "as stored", "runs": args.runs},
                    nbytes)
    rows, notes = report.rows, report.notes
    described = gpu_rows(path, args, rows, notes) if gpu else host_rows(path, args, rows, notes)
    report.described = described
    report.save()
    for note in notes:
        print(note)

    base = rows[0][1]
    print(f"device: {described['device']}")
    print(f"\n{'contender':58s} {'s':>8s} {'GB/s':>8s} {'vs first':>9s}")
    for name, secs in rows:
        print(f"{name:58s} {secs:8.3f} {nbytes / secs / 1e9:8.2f} {base / secs:8.2f}x")
    goal_ratios = ratios(rows)
    for key, value in goal_ratios.items():
        goal = GOALS.get(key)
        verdict = f"(goal >= {goal}x) {'met' if value >= goal else 'MISSED'}" if goal else "(info)"
        print(f"ckptfs {key}: {value:.2f}x {verdict}")
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
