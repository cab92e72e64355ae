#!/usr/bin/env python3
"""Benchmark: loading an fp32 torch checkpoint as bf16, through ckptfs vs torch.load.

On a real `torch.save` checkpoint of float32 tensors (default: 40 x 4096x4096, 2.68 GB;
cached under --workdir), it loads every tensor as bfloat16, each way in a fresh process:

  torch.load          sd = torch.load(PATH, weights_only=True)
                      {k: v.to(torch.bfloat16) for k, v in sd.items()}   (what users do today)
  torch.load mmap     the same with torch.load(PATH, mmap=True, weights_only=True)
  ckptfs              ckptfs -f PATH MNT -o dtype=bf16 (the daemon, its own process), then
                      safetensors.torch.load_file(MNT/model.safetensors) (safetensors' default
                      mmap backend); wall: from starting the daemon to the end of the load
  ckptfs pread        the same with load_file(..., backend="pread")     (information only)
  floor               python -c "import torch, safetensors.torch"        (information only)

Every method ends by reading one byte of every 4 KiB page of every loaded tensor ("touch").
safetensors >= 0.8's default backend returns tensors backed by a private mapping of the file,
read only when touched; the touch makes them resident, so every row has all bf16 bytes in
memory (for the mmap backend as page cache of the mounted file, counted in RSS as RssFile).

Peak RSS is reported relative to the bf16 model size (sum of the bf16 tensors' bytes):
raw, and net of the floor (the RSS of a process that has only imported torch and
safetensors, about 0.5 GiB, which every loader pays whatever the model size). For ckptfs
the loading process and the daemon are reported separately, and their sum.

Targets (exit status 1 if one fails; 2 if the binary is missing):
  ckptfs: peak RSS of the loading process <= 1.15 x the bf16 model size, net of the floor
          (--raw-target: without subtracting the floor)
  every loaded tensor equals torch's .to(torch.bfloat16) of the stored tensor: torch.equal,
  or, for tensors holding NaN, bit-identical non-NaN values and NaN where torch has NaN
  (whether the NaN bit patterns match too is printed)

Peak RSS comes from GNU time (/usr/bin/time -f %M) around each command; without it,
os.wait4, which over-reports (Linux carries the parent's RSS high-water mark into a direct
child across exec). Before every run: sync, then `echo 3 > /proc/sys/vm/drop_caches` (root);
where that is refused, every run instead starts with the checkpoint read once into the page
cache (all runs equally warm), and the output says so. The measuring process never imports
torch: generation, loading and verification run in child processes (this file with a hidden
mode), each under a timeout. Run by hand from the repo root, as root for cold-cache numbers:

    python tests/bench/bench_bf16_load.py --ckptfs build/ckptfs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import benchlib
from benchlib import GNU_TIME, Cache, unmount, mounted, wait4_timeout

REPO_ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20

RSS_TARGET = 1.15   # ckptfs loading process: peak RSS <= 1.15 x bf16 model size
MIN_CHECKPOINT_BYTES = 2_000_000_000  # the acceptance asks for at least 2 GB

# ---------------------------------------------------------------------------
# Child modes (this file run with a hidden option; torch is imported only here)
# ---------------------------------------------------------------------------

# Values every bf16 conversion must get right, written at the start of the first tensor:
# NaNs (several payloads and signs), infinities, signed zeros, fp32 subnormals, values that
# overflow bf16, exact rounding ties (to even, down and up), near-max finite values.
SPECIAL_BITS = [
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FC00001, 0xFFFFFFFF, 0x7FBFFFFF,  # NaN
    0x7F800000, 0xFF800000, 0x00000000, 0x80000000,                          # inf, zeros
    0x00000001, 0x80000001, 0x00400000, 0x007FFFFF, 0x00008000, 0x00018000,  # subnormals
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,                          # overflow edge
    0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000,  # ties
    0x00800000, 0x80800000, 0x3F800000, 0x40490FDB,                          # normal
]


def checkpoint_spec(args) -> dict:
    """Everything the cached checkpoint depends on; a mismatch regenerates it."""
    return {"version": 1, "tensors": args.tensors, "rows": args.rows, "cols": args.cols, "seed": 1234}


def generate_main(spec_json: str, out_path: str):
    """`--_generate`: a dict of float32 tensors, written by torch.save itself."""
    import torch
    spec = json.loads(spec_json)
    g = torch.Generator().manual_seed(spec["seed"])
    sd = {}
    for i in range(spec["tensors"]):
        # Mixed magnitudes, so the rounding sees many exponents.
        t = torch.randn(spec["rows"], spec["cols"], generator=g, dtype=torch.float32)
        t.mul_(10.0 ** (i % 7 - 3))
        sd[f"model.layers.{i}.weight"] = t
    first = sd["model.layers.0.weight"].view(-1)
    n = min(len(SPECIAL_BITS), first.numel())
    first[:n] = torch.tensor(SPECIAL_BITS[:n], dtype=torch.int64).to(torch.int32).view(torch.float32)
    t0 = time.perf_counter()
    torch.save(sd, out_path)
    print(f"[gen] torch {torch.__version__}: torch.save {time.perf_counter() - t0:.1f}s", flush=True)


def load_main(mode: str, path: str):
    """`--_load MODE PATH`: one loading method; prints one JSON line on stdout."""
    t0 = time.perf_counter()
    import torch
    import safetensors.torch
    t1 = time.perf_counter()
    out = {}
    if mode == "torch":
        sd = torch.load(path, weights_only=True)
        out = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    elif mode == "torch-mmap":
        sd = torch.load(path, mmap=True, weights_only=True)
        out = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    elif mode == "ckptfs":
        out = safetensors.torch.load_file(path)
    elif mode == "ckptfs-pread":
        out = safetensors.torch.load_file(path, backend="pread")
    elif mode != "floor":
        raise SystemExit(f"unknown mode {mode}")
    t2 = time.perf_counter()
    # Make every tensor resident: safetensors' default (mmap) backend returns tensors that
    # map the file and are read only when touched. One byte per 4 KiB page (no temporaries
    # beyond a few KiB); on tensors already in anonymous memory this costs milliseconds.
    benchlib.touch_pages(out.values())
    t3 = time.perf_counter()
    status = benchlib.vm_status()
    print(json.dumps({
        "import_s": t1 - t0, "load_s": t2 - t1, "touch_s": t3 - t2, "tensors": len(out),
        "bytes": sum(v.numel() * v.element_size() for v in out.values()),
        "dtypes": sorted({str(v.dtype) for v in out.values()}), "vmhwm_kib": status.get("VmHWM", 0),
        "vmrss_kib": status.get("VmRSS", 0), "anon_kib": status.get("RssAnon", 0),
        "file_kib": status.get("RssFile", 0),
    }), flush=True)


def verify_main(src: str, served: str):
    """`--_verify SRC MNT/model.safetensors`: each served tensor against torch's
    .to(torch.bfloat16) of the stored one. Prints one JSON line."""
    import torch
    from safetensors.torch import load_file
    sd = torch.load(src, weights_only=True)
    want = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    del sd
    report = {"ok": True, "problems": [], "nan_tensors": 0, "nan_values": 0, "nan_bits_differ": 0}
    for backend in ("mmap", "pread"):
        got = load_file(served, backend=backend)
        if list(got) != list(want):
            report["problems"].append(f"{backend}: keys differ (or their order)" if set(got) == set(want) else
                                      f"{backend}: keys differ: missing {sorted(set(want) - set(got))[:3]}, "
                                      f"extra {sorted(set(got) - set(want))[:3]}")
            if set(got) != set(want):
                report["ok"] = False
                continue
        for k, w in want.items():
            g = got[k]
            if g.dtype != w.dtype or g.shape != w.shape:
                report["ok"] = False
                report["problems"].append(f"{backend}: {k}: {g.dtype} {list(g.shape)} != {w.dtype} {list(w.shape)}")
                continue
            if torch.equal(g, w):
                continue
            wn, gn = torch.isnan(w), torch.isnan(g)
            if not bool(wn.any()) and not bool(gn.any()):
                report["ok"] = False
                bad = (g.view(torch.int16) != w.view(torch.int16)).nonzero()
                report["problems"].append(f"{backend}: {k}: {bad.shape[0]} values differ, first at {bad[0].tolist()}")
                continue
            gb, wb = g.view(torch.int16), w.view(torch.int16)
            same_nan = torch.equal(wn, gn)
            same_rest = torch.equal(gb[~wn], wb[~wn])
            if not (same_nan and same_rest):
                report["ok"] = False
                report["problems"].append(f"{backend}: {k}: NaN positions differ" if not same_nan else
                                          f"{backend}: {k}: non-NaN values differ")
                continue
            if backend == "mmap":
                report["nan_tensors"] += 1
                report["nan_values"] += int(wn.sum())
                report["nan_bits_differ"] += int((gb[wn] != wb[wn]).sum())
                report.setdefault("nan_bits_example", [
                    f"{int(x) & 0xFFFF:04X}/{int(y) & 0xFFFF:04X}" for x, y in zip(gb[wn][:6], wb[wn][:6])])
        report[f"{backend}_tensors"] = len(got)
        report[f"{backend}_bytes"] = sum(v.numel() * v.element_size() for v in got.values())
        del got
    print(json.dumps(report), flush=True)


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


@dataclass
class Run:
    wall_s: float
    rss_kib: int            # the loading process
    load_s: float
    touch_s: float
    end_rss_kib: int = 0    # the loading process's RSS when it finished (VmRSS)
    daemon_kib: int = 0     # ckptfs rows: the daemon
    detail: str = ""
    result: dict = field(default_factory=dict)   # the loader's JSON line


@dataclass
class Method:
    name: str
    mode: str
    via_ckptfs: bool = False
    info: bool = False      # no target
    runs: list[Run] = field(default_factory=list)

    @property
    def wall(self) -> float:
        return statistics.median(r.wall_s for r in self.runs)

    @property
    def load_s(self) -> float:
        return statistics.median(r.load_s for r in self.runs)

    @property
    def touch_s(self) -> float:
        return statistics.median(r.touch_s for r in self.runs)

    @property
    def rss_mib(self) -> float:
        return statistics.median(r.rss_kib for r in self.runs) / 1024

    @property
    def end_rss_mib(self) -> float:
        return statistics.median(r.end_rss_kib for r in self.runs) / 1024

    @property
    def daemon_mib(self) -> float:
        return statistics.median(r.daemon_kib for r in self.runs) / 1024

    @property
    def total_mib(self) -> float:
        return statistics.median(r.rss_kib + r.daemon_kib for r in self.runs) / 1024


def run_measured(argv: list[str], timeout: float) -> tuple[float, int, str]:
    """Run argv in a fresh process: (wall seconds, peak RSS KiB, stdout). Raises on failure."""
    wall, rss, stdout, _ = benchlib.run_measured(argv, timeout)
    return wall, rss, stdout


def child_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"child printed no result: {stdout[-2000:]}")
    return json.loads(lines[-1])


class Mount:
    """`ckptfs -f SRC MNT -o dtype=bf16` under GNU time (for the daemon's peak RSS);
    unmounted and reaped on exit. daemon_kib is set after the exit."""

    def __init__(self, ckptfs: Path, src: Path, mnt: Path, log: Path, timeout: float):
        self.argv = [str(ckptfs), "-f", str(src), str(mnt), "-o", "dtype=bf16"]
        self.mnt, self.log, self.timeout = mnt, log, timeout
        self.daemon_kib = 0
        self.ready_s = 0.0

    def __enter__(self):
        self.mnt.mkdir(parents=True, exist_ok=True)
        if mounted(self.mnt):
            raise RuntimeError(f"{self.mnt} is already a mount point")
        self.rss_file = tempfile.NamedTemporaryFile(suffix=".rss")
        self.logf = open(self.log, "wb")
        full = [GNU_TIME, "-f", "%M", "-o", self.rss_file.name, "--", *self.argv] if GNU_TIME else self.argv
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(full, stdout=self.logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            limit = min(self.timeout, 120)
            deadline = time.monotonic() + limit
            while not mounted(self.mnt):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"ckptfs mount exited {self.proc.returncode}: "
                                       f"{self.log.read_text(errors='replace')[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.mnt}: not mounted after {limit}s")
                time.sleep(0.002)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.ready_s = time.perf_counter() - self.t0
        return self

    def __exit__(self, *exc):
        usage = None
        try:
            unmount(self.mnt)
        finally:
            try:
                _, _, usage = wait4_timeout(self.proc, 60)
            except subprocess.TimeoutExpired:
                print("warning: ckptfs daemon still running 60 s after unmount; killing it", file=sys.stderr)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ChildProcessError:
                pass
            try:
                if GNU_TIME:
                    text = Path(self.rss_file.name).read_text().split()
                    self.daemon_kib = int(text[-1]) if text and text[-1].isdigit() else 0
                elif usage is not None:
                    self.daemon_kib = usage.ru_maxrss
            finally:
                self.rss_file.close()
                self.logf.close()
        return False


def run_once(m: Method, args, ckptfs: Path, ckpt: Path, mnt: Path, workdir: Path) -> Run:
    me = [sys.executable, str(Path(__file__).resolve()), "--_load", m.mode]
    if not m.via_ckptfs:
        wall, rss, out = run_measured([*me, str(ckpt)], args.timeout)
        res = child_json(out)
        return Run(wall, rss, res["load_s"], res["touch_s"], res["vmrss_kib"], detail=res_detail(res), result=res)
    with Mount(ckptfs, ckpt, mnt, workdir / "mount.log", args.timeout) as mount:
        _, rss, out = run_measured([*me, str(mnt / "model.safetensors")], args.timeout)
        t_end = time.perf_counter()
    res = child_json(out)
    run = Run(t_end - mount.t0, rss, res["load_s"], res["touch_s"], res["vmrss_kib"], daemon_kib=mount.daemon_kib,
              result=res)
    run.detail = f"mount ready {mount.ready_s:.2f}s; daemon {mount.daemon_kib / 1024:.1f} MiB; " + res_detail(res)
    return run


def res_detail(res: dict) -> str:
    if not res["tensors"]:
        return f"import {res['import_s']:.2f}s; RSS after import {res['vmrss_kib'] / 1024:.1f} MiB"
    return (f"import {res['import_s']:.2f}s + load {res['load_s']:.2f}s + touch {res['touch_s']:.2f}s; "
            f"{res['tensors']} tensors "
            f"{'/'.join(d.replace('torch.', '') for d in res['dtypes'])}, {res['bytes'] / MiB:.1f} MiB; "
            f"at the end RssAnon {res['anon_kib'] / 1024:.0f} + RssFile {res['file_kib'] / 1024:.0f} MiB")


def ensure_checkpoint(args, workdir: Path) -> Path:
    spec = checkpoint_spec(args)
    ckpt = workdir / "model-fp32.pt"
    stamp = workdir / "model-fp32.json"
    if not args.regenerate and ckpt.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == spec:
        print(f"checkpoint: cached, {ckpt}")
        return ckpt
    stamp.unlink(missing_ok=True)
    ckpt.unlink(missing_ok=True)
    tmp = workdir / "model-fp32.pt.tmp"
    tmp.unlink(missing_ok=True)
    n = spec["tensors"] * spec["rows"] * spec["cols"]
    print(f"checkpoint: writing {spec['tensors']} float32 tensors of {spec['rows']}x{spec['cols']} "
          f"({4 * n / 1e9:.2f} GB) with torch.save ...", flush=True)
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, __file__, "--_generate", json.dumps(spec), str(tmp)],
                           capture_output=True, text=True, timeout=args.gen_timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"checkpoint generation timed out after {args.gen_timeout}s")
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"checkpoint generation failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    for line in r.stdout.splitlines():
        print("  " + line)
    tmp.rename(ckpt)
    stamp.write_text(json.dumps(spec))
    print(f"  generated in {time.perf_counter() - t0:.1f}s")
    return ckpt


def verify(args, ckptfs: Path, ckpt: Path, mnt: Path, workdir: Path) -> tuple[bool, list[str]]:
    """Untimed: a fresh mount; the served tensors (load_file, mmap and pread backends)
    against torch.load + .to(torch.bfloat16) in one child process."""
    with Mount(ckptfs, ckpt, mnt, workdir / "mount.log", args.timeout):
        r = subprocess.run([sys.executable, __file__, "--_verify", str(ckpt), str(mnt / "model.safetensors")],
                           capture_output=True, text=True, timeout=args.timeout, start_new_session=True)
    if r.returncode != 0:
        return False, [f"verification child exited {r.returncode}: {r.stderr.strip()[-2000:]}"]
    rep = child_json(r.stdout)
    lines = []
    ok = rep["ok"]
    for backend in ("mmap", "pread"):
        if f"{backend}_tensors" in rep:
            lines.append(f"load_file(backend={backend!r}): {rep[backend + '_tensors']} tensors, "
                         f"{rep[backend + '_bytes'] / MiB:.1f} MiB")
    lines += rep["problems"]
    if rep["nan_tensors"]:
        nan_line = (f"{rep['nan_tensors']} tensor(s) with NaN ({rep['nan_values']} NaN values): non-NaN values "
                    f"bit-identical, NaN where torch has NaN; NaN bit patterns ")
        if rep["nan_bits_differ"]:
            nan_line += (f"differ in {rep['nan_bits_differ']} (ckptfs/torch: "
                         f"{', '.join(rep.get('nan_bits_example', []))}; the contract allows it)")
        else:
            nan_line += f"identical too ({', '.join(rep.get('nan_bits_example', [])[:3])})"
        lines.append(nan_line)
    return ok, lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckptfs", default=str(REPO_ROOT / "build" / "ckptfs"))
    ap.add_argument("--workdir", default="/tmp/ckptfs-bench-bf16", help="cached checkpoint and mount point")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per method, in turn (medians reported)")
    ap.add_argument("--tensors", type=int, default=40, help="float32 tensors in the checkpoint")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--raw-target", action="store_true",
                    help="judge the RSS target on raw peak RSS, without subtracting the import floor")
    ap.add_argument("--no-pread", action="store_true", help="skip the load_file(backend='pread') row")
    ap.add_argument("--regenerate", action="store_true", help="rewrite the cached checkpoint")
    ap.add_argument("--generate-only", action="store_true", help="write (or reuse) the checkpoint and stop")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per command")
    ap.add_argument("--gen-timeout", type=float, default=1800, help="seconds for writing the checkpoint")
    ap.add_argument("--_generate", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_load", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_verify", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._generate:
        generate_main(*args._generate)
        return 0
    if args._load:
        load_main(*args._load)
        return 0
    if args._verify:
        verify_main(*args._verify)
        return 0

    paths = benchlib.workdir_and_binary(args)
    if paths is None:
        return 2
    workdir, ckptfs = paths

    ckpt = ensure_checkpoint(args, workdir)
    spec = checkpoint_spec(args)
    numel = spec["tensors"] * spec["rows"] * spec["cols"]
    bf16_bytes = 2 * numel
    bf16_mib = bf16_bytes / MiB
    size = ckpt.stat().st_size
    print(f"  {ckpt.name}: {size / 1e9:.2f} GB on disk; {spec['tensors']} float32 tensors, {numel / 1e6:.0f}M values; "
          f"bf16 model size {bf16_bytes / 1e9:.2f} GB ({bf16_mib:.1f} MiB)")
    if size < MIN_CHECKPOINT_BYTES:
        print(f"  note: smaller than the acceptance's {MIN_CHECKPOINT_BYTES / 1e9:.0f} GB: not an acceptance run")
    if args.generate_only:
        return 0

    methods = {
        "torch": Method("torch.load + .to(bf16)", "torch"),
        "torch-mmap": Method("torch.load(mmap) + .to(bf16)", "torch-mmap"),
        "ckptfs": Method("ckptfs bf16 + load_file", "ckptfs", via_ckptfs=True),
    }
    if not args.no_pread:
        methods["ckptfs-pread"] = Method("ckptfs bf16 + load_file pread", "ckptfs-pread", via_ckptfs=True, info=True)
    methods["floor"] = Method("import torch, safetensors", "floor", info=True)

    mnt = workdir / "mnt"
    unmount(mnt)
    cache = Cache(ckpt, "the checkpoint is read into the page cache before every run")
    print(f"\npage cache: {cache.mode}")
    print(f"peak RSS: {'GNU time (/usr/bin/time -f %M)' if GNU_TIME else 'os.wait4 (no GNU time; over-reports)'}")
    print(f"{args.repeats} timed run(s) per method, in turn\n")
    try:
        for rep in range(args.repeats):
            for m in methods.values():
                cache.prepare()
                run = run_once(m, args, ckptfs, ckpt, mnt, workdir)
                m.runs.append(run)
                res = run.result
                if m.mode != "floor" and (res["tensors"] != spec["tensors"] or res["bytes"] != bf16_bytes
                                          or res["dtypes"] != ["torch.bfloat16"]):
                    raise RuntimeError(f"{m.name}: loaded {res['tensors']} tensors, {res['bytes']} bytes, "
                                       f"dtypes {res['dtypes']}; expected {spec['tensors']} bfloat16 tensors, "
                                       f"{bf16_bytes} bytes")
                print(f"  run {rep + 1}  {m.name:32s} {run.wall_s:7.2f} s  {run.rss_kib / 1024:8.1f} MiB   "
                      f"{run.detail}", flush=True)
        print("\ncorrectness (fresh mount; every tensor against torch.load + .to(torch.bfloat16)):")
        values_ok, lines = verify(args, ckptfs, ckpt, mnt, workdir)
        print(f"  {'PASS' if values_ok else 'FAIL'}  served bf16 tensors equal torch's")
        for line in lines:
            print(f"        {line}")
    except RuntimeError as e:  # a command failed or timed out
        print(f"\nFAIL: {e}", file=sys.stderr)
        return 1
    finally:
        unmount(mnt)

    # The floor: what a process holds once torch and safetensors are imported (its RSS at the
    # end). Its peak is higher (transient import allocations, freed and reused by the load), so
    # subtracting the peak would flatter every loader.
    floor = methods["floor"].end_rss_mib
    print(f"\nfp32 .pt ({size / 1e9:.2f} GB) -> bf16 tensors in memory ({bf16_mib:.1f} MiB); page cache "
          f"{cache.mode.split(' ')[0]}; median of {args.repeats}")
    print(f"  x bf16: peak RSS / bf16 model size; net: (peak RSS - floor) / bf16 model size; floor {floor:.1f} MiB: "
          f"RSS of a process that imported torch and safetensors (its peak: {methods['floor'].rss_mib:.1f} MiB)")
    header = (f"  {'method':32s} {'wall s':>7s} {'load s':>7s} {'touch s':>8s} {'loader MiB':>11s} {'x bf16':>7s}"
              f" {'net':>6s}"
              f" {'daemon MiB':>11s} {'sum MiB':>9s} {'sum x':>6s} {'sum net':>8s}")
    print(header)
    print("  " + "-" * (len(header) - 2))
    for key, m in methods.items():
        row = (f"  {m.name:32s} {m.wall:7.2f} {m.load_s:7.2f} {m.touch_s:8.2f} {m.rss_mib:11.1f} "
               f"{m.rss_mib / bf16_mib:7.3f} {(m.rss_mib - floor) / bf16_mib:6.3f}")
        if m.via_ckptfs:
            row += (f" {m.daemon_mib:11.1f} {m.total_mib:9.1f} {m.total_mib / bf16_mib:6.3f} "
                    f"{(m.total_mib - floor) / bf16_mib:8.3f}")
        print(row)
    print("  (wall: fresh process, Python start and import included; for ckptfs from starting the daemon to the "
          "end of the load.\n   load: the load call, timed inside the process; touch: reading one byte per page "
          "of every loaded tensor, which makes mmap-backed tensors resident)\n")

    failed = not values_ok
    m = methods["ckptfs"]
    raw, net = m.rss_mib / bf16_mib, (m.rss_mib - floor) / bf16_mib
    gate_raw = args.raw_target
    for label, ratio, gating in (("net of the import floor", net, not gate_raw), ("raw", raw, gate_raw)):
        ok = ratio <= RSS_TARGET
        if gating:
            failed |= not ok
            print(f"  {'PASS' if ok else 'FAIL'}  {m.name}: loader peak RSS {label}: {ratio:.3f} x bf16 "
                  f"{'<=' if ok else '>'} {RSS_TARGET:g}")
        else:
            print(f"  info  {m.name}: loader peak RSS {label}: {ratio:.3f} x bf16 "
                  f"({'within' if ok else 'over'} {RSS_TARGET:g}; not gating)")
    print(f"  info  {m.name}: loader + daemon {m.total_mib:.1f} MiB = {m.total_mib / bf16_mib:.3f} x bf16 "
          f"(net {(m.total_mib - floor) / bf16_mib:.3f})")
    for key in ("torch", "torch-mmap"):
        b = methods[key]
        print(f"  info  {b.name}: {b.rss_mib / bf16_mib:.3f} x bf16 (net {(b.rss_mib - floor) / bf16_mib:.3f}); "
              f"ckptfs loader uses {m.rss_mib / b.rss_mib:.2f} x its peak RSS, {m.wall / b.wall:.2f} x its wall")
    print(f"  {'PASS' if values_ok else 'FAIL'}  {m.name}: tensors equal torch's .to(torch.bfloat16)")
    print("\nRESULT:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
