#!/usr/bin/env python3
"""Benchmark: consolidating a DeepSpeed ZeRO-3 checkpoint through ckptfs vs zero_to_fp32.

On a real ZeRO-3 checkpoint saved by DeepSpeed itself (default: ~623M parameters,
2.5 GB of fp32 master weights, 2 data-parallel ranks, bf16 training, one AdamW step,
so the rank files also hold both Adam moments), it consolidates the fp32 weights to
one model.safetensors three ways, each in a fresh process with a cold page cache:

  zero_to_fp32   python SAVE_DIR/zero_to_fp32.py SAVE_DIR OUT --safe_serialization
                 (the script DeepSpeed copies next to every checkpoint; the reference)
  export         ckptfs export SAVE_DIR OUT  (model.safetensors and the small files: the default)
  mount+cp       ckptfs -f SAVE_DIR MNT; cp MNT/model.safetensors OUT; fusermount3 -u MNT
                 (wall: from starting the daemon to the end of cp; peak RSS: daemon + cp)
  cat            ckptfs cat SAVE_DIR model.safetensors > OUT  (information only, no target)

Targets (exit status 1 if one fails), for export and for mount+cp:
  peak RSS  <= 1/10 of zero_to_fp32's
  wall time <= zero_to_fp32's
and export at >= 0.9x the speed of mount+cp (wall <= mount+cp's / 0.9).
and every output equals zero_to_fp32's tensor by tensor (same keys, dtypes, shapes,
bit-identical values; compared with safetensors safe_open, one tensor at a time).

Peak RSS comes from GNU time (/usr/bin/time -f %M) around each command; without it,
os.wait4, which over-reports (Linux carries the parent's RSS high-water mark into a
direct child across exec). Between runs: sync, then `echo 3 > /proc/sys/vm/drop_caches`
(root); where that is refused, every run instead starts with the checkpoint files read
once into the page cache (all runs equally warm) and the table says so.

The checkpoint is generated once with DeepSpeed on CPU (DS_ACCELERATOR=cpu, gloo,
ranks forked from one process) and cached under --workdir; reruns reuse it. Needs
torch, deepspeed, safetensors and huggingface_hub in the interpreter running this file
(the test venv, `scripts/setup-venv.sh`), and a built ckptfs. Run by hand, as root for
cold-cache numbers, from the repo root:

    python tests/bench/bench_zero_consolidate.py --ckptfs build/ckptfs
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

RSS_TARGET = 0.10   # ckptfs peak RSS <= 1/10 of zero_to_fp32's
TIME_TARGET = 1.0   # ckptfs wall time <= zero_to_fp32's
EXPORT_VS_CP = 0.9  # export's speed >= 0.9x mount + cp's

# ---------------------------------------------------------------------------
# Checkpoint generation (runs in a child process: `--_generate`, never in the
# measuring process, which stays free of torch until the final verification).
# ---------------------------------------------------------------------------


def model_spec(args) -> dict:
    """Everything the cached checkpoint depends on; a mismatch regenerates it."""
    return {"version": 1, "world": args.world, "dtype": args.dtype, "train": not args.no_train,
            "vocab": args.vocab, "hidden": args.hidden, "ffn": args.ffn, "layers": args.layers}


def count_params(spec: dict) -> int:
    v, d, f, n = spec["vocab"], spec["hidden"], spec["ffn"], spec["layers"]
    block = 2 * d + (d * f + f) + (f * d + d)          # ln, up, down
    return v * d + n * block + 2 * d + v * d            # embed, blocks, norm, head


def build_model(spec: dict):
    import torch
    import torch.nn as nn

    class Block(nn.Module):

        def __init__(self, d, f):
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.up = nn.Linear(d, f)
            self.down = nn.Linear(f, d)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))

    class Net(nn.Module):
        """A decoder-shaped stack of big Linear layers: ~all bytes in a few huge matrices."""

        def __init__(self, vocab, d, f, layers):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d, f) for _ in range(layers))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            # a frozen parameter and a persistent buffer, as real models have
            self.frozen_shift = nn.Parameter(torch.linspace(-0.1, 0.1, d), requires_grad=False)
            self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, d))

        def forward(self, ids):
            x = self.embed(ids) * self.pos_scale.to(self.embed.weight.dtype)
            for b in self.blocks:
                x = b(x)
            return self.head(self.norm(x) + self.frozen_shift)

    return Net(spec["vocab"], spec["hidden"], spec["ffn"], spec["layers"])


def _gen_worker(rank: int, spec: dict, save_dir: str, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(spec["world"]), LOCAL_SIZE=str(spec["world"]))
    t0 = time.time()
    import torch
    if spec["dtype"] == "fp16":
        # CPU_Accelerator.is_fp16_supported() asks oneDNN for AVX512-FP16/AMX; fake it.
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
        CPU_Accelerator.is_fp16_supported = lambda self: True
    import deepspeed
    import deepspeed.comm as dist
    import deepspeed.comm.torch  # noqa: F401
    # Otherwise the torch backend JIT-compiles DeepSpeed's shm all-reduce op (C++, minutes).
    # (`import deepspeed.comm.torch as x` yields the real torch module, shadowed by a star import.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    model = build_model(spec)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": 3},
        # AdamW from torch (DeepSpeed's FusedAdam/CPUAdam would JIT-build C++ ops)
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
    }
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=cfg)
    t1 = time.time()
    if spec["train"]:
        g = torch.Generator().manual_seed(100 + rank)
        ids = torch.randint(0, spec["vocab"], (1, 16), generator=g)
        logits = engine(ids)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, spec["vocab"]), ids.reshape(-1))
        engine.backward(loss)
        engine.step()
    t2 = time.time()
    engine.save_checkpoint(save_dir)
    dist.barrier()
    t3 = time.time()
    if rank == 0:
        print(f"[gen rank0] deepspeed {deepspeed.__version__} torch {torch.__version__}: import+init+initialize "
              f"{t1 - t0:.1f}s, train step {t2 - t1:.1f}s, save {t3 - t2:.1f}s", flush=True)


def generate_main(spec_json: str, save_dir: str, port: int):
    """Entry of `--_generate`: pre-import torch and deepspeed once, fork the ranks."""
    spec = json.loads(spec_json)
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp
    import deepspeed  # noqa: F401  (pre-imported so the forked ranks start fast)
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    mp.start_processes(_gen_worker, args=(spec, save_dir, port), nprocs=spec["world"], start_method="fork",
                       join=True)


def ensure_checkpoint(args, workdir: Path) -> Path:
    """The cached checkpoint's save dir (with `latest`, global_stepN/, zero_to_fp32.py)."""
    if args.checkpoint:
        print(f"checkpoint: {args.checkpoint} (given)")
        return Path(args.checkpoint).resolve()
    spec = model_spec(args)
    save_dir = workdir / "ckpt"
    stamp = save_dir / "bench_spec.json"
    if not args.regenerate and stamp.is_file() and json.loads(stamp.read_text()) == spec:
        print(f"checkpoint: cached in {save_dir}")
        return save_dir
    tmp = workdir / "ckpt.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(save_dir, ignore_errors=True)
    tmp.mkdir(parents=True)
    n = count_params(spec)
    print(f"checkpoint: generating with DeepSpeed ZeRO-3 ({n / 1e6:.0f}M parameters, world {spec['world']}, "
          f"{spec['dtype']}, {'one AdamW step' if spec['train'] else 'no training step'}) ...", flush=True)
    log = workdir / "generate.log"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        try:
            rc = subprocess.run([sys.executable, __file__, "--_generate", json.dumps(spec), str(tmp), str(args.port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, timeout=args.gen_timeout,
                                start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"checkpoint generation failed ({rc}); see {log}:\n{tail}\n"
                         "If it ran out of memory or time, try --no-train (save right after deepspeed.initialize).")
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("[gen rank0]"):
            print("  " + line)
    stamp_tmp = tmp / "bench_spec.json"
    stamp_tmp.write_text(json.dumps(spec))
    tmp.rename(save_dir)
    print(f"  generated in {time.perf_counter() - t0:.1f}s")
    return save_dir


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


@dataclass
class Run:
    wall_s: float
    rss_kib: int
    detail: str = ""


@dataclass
class Method:
    name: str
    runs: list[Run] = field(default_factory=list)

    @property
    def wall(self) -> float:
        return statistics.median(r.wall_s for r in self.runs)

    @property
    def rss_mib(self) -> float:
        return max(r.rss_kib for r in self.runs) / 1024


def run_measured(argv: list[str], timeout: float, stdout=None, env=None) -> tuple[float, int, str]:
    """Run argv in a fresh process: (wall seconds, peak RSS KiB, stderr); its stdout goes to
    STDOUT, else nowhere. Raises on failure."""
    out = stdout if stdout is not None else subprocess.DEVNULL
    wall, rss, _, stderr = benchlib.run_measured(argv, timeout, stdout=out, env=env)
    return wall, rss, stderr


def run_mount_cp(ckptfs: Path, save_dir: Path, mnt: Path, out_file: Path, timeout: float, log: Path,
                 options=()) -> Run:
    """ckptfs -f SAVE_DIR MNT OPTIONS (foreground, under GNU time for its peak RSS), cp of its
    model.safetensors to OUT_FILE, unmount."""
    mnt.mkdir(parents=True, exist_ok=True)
    if mounted(mnt):
        raise RuntimeError(f"{mnt} is already a mount point")
    with tempfile.NamedTemporaryFile(suffix=".rss") as rss_file, open(log, "wb") as logf:
        argv = [str(ckptfs), "-f", str(save_dir), str(mnt), *options]
        full = [GNU_TIME, "-f", "%M", "-o", rss_file.name, "--", *argv] if GNU_TIME else argv
        t0 = time.perf_counter()
        daemon = subprocess.Popen(full, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        daemon_usage = None
        try:
            deadline = time.monotonic() + min(timeout, 120)
            while not mounted(mnt):
                if daemon.poll() is not None:
                    raise RuntimeError(f"ckptfs mount exited {daemon.returncode}: {log.read_text(errors='replace')[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{mnt}: not mounted after {min(timeout, 120)}s")
                time.sleep(0.002)
            t_ready = time.perf_counter()
            cp_wall, cp_rss, _ = run_measured(["cp", str(mnt / "model.safetensors"), str(out_file)], timeout)
            t_end = time.perf_counter()
        finally:
            unmount(mnt)
            try:
                _, status, daemon_usage = wait4_timeout(daemon, 60)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
        daemon_rss = int(Path(rss_file.name).read_text().split()[-1]) if GNU_TIME else daemon_usage.ru_maxrss
    return Run(t_end - t0, daemon_rss + cp_rss,
               f"mount ready {t_ready - t0:.2f}s + cp {cp_wall:.2f}s; daemon {daemon_rss / 1024:.1f} MiB + "
               f"cp {cp_rss / 1024:.1f} MiB")


# ---------------------------------------------------------------------------
# Verification (after all timed runs: this is where torch gets imported)
# ---------------------------------------------------------------------------


def safetensors_files(out_dir: Path) -> dict[str, Path]:
    """key -> file, for a folder holding model.safetensors or a sharded index."""
    index = out_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: out_dir / v for k, v in weight_map.items()}
    from safetensors import safe_open
    path = out_dir / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        return {k: path for k in f.keys()}


def frozen_parameter_names(save_dir: Path) -> set:
    """Names in frozen_param_shapes of rank 0's model states (a small file)."""
    import torch

    tag = (save_dir / "latest").read_text().strip()
    files = sorted((save_dir / tag).glob("*model_states.pt"))
    states = torch.load(files[0], map_location="cpu", weights_only=False)
    return set((states.get("frozen_param_shapes") or {}).keys())


def compare_outputs(reference: dict[str, Path], candidate: Path) -> tuple[bool, list[str], str]:
    """Tensor by tensor (one in memory at a time per side): keys, dtypes, shapes, bits.

    Returns (values_ok, upcast_only, message). upcast_only lists the tensors whose only
    difference is that zero_to_fp32 up-cast a 16-bit tensor to float32 (the candidate's
    tensor converted to float32 is bit-identical to zero_to_fp32's)."""
    import torch
    from safetensors import safe_open
    upcast_only: list[str] = []
    with safe_open(str(candidate), framework="pt") as c:
        ckeys = list(c.keys())
        if set(ckeys) != set(reference):
            missing = sorted(set(reference) - set(ckeys))[:5]
            extra = sorted(set(ckeys) - set(reference))[:5]
            return False, [], f"keys differ: missing {missing}, extra {extra}"
        handles = {}
        try:
            nbytes = 0
            for k in ckeys:
                path = reference[k]
                if path not in handles:
                    handles[path] = safe_open(str(path), framework="pt").__enter__()
                want = handles[path].get_tensor(k)
                got = c.get_tensor(k)
                nbytes += got.numel() * got.element_size()
                if got.shape != want.shape:
                    return False, [], f"{k}: shape {list(got.shape)} != {list(want.shape)}"
                if got.dtype != want.dtype:
                    if (want.dtype == torch.float32 and got.dtype in (torch.bfloat16, torch.float16)
                            and torch.equal(got.to(torch.float32).view(torch.int32), want.view(torch.int32))):
                        upcast_only.append(f"{k} ({str(got.dtype)[6:]} here, float32 in zero_to_fp32's)")
                        continue
                    return False, [], f"{k}: {got.dtype} != {want.dtype} and values differ"
                if not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                    return False, [], f"{k}: values differ"
                del want, got
        finally:
            for h in handles.values():
                h.__exit__(None, None, None)
    msg = f"{len(ckeys)} tensors, {nbytes / 1e9:.2f} GB: same keys and shapes, "
    if upcast_only:
        msg += (f"{len(ckeys) - len(upcast_only)} bit-identical, {len(upcast_only)} in another dtype only, equal "
                f"after up-cast to float32: " + ", ".join(upcast_only))
    else:
        msg += "all bit-identical (same dtypes)"
    return True, upcast_only, msg


# ---------------------------------------------------------------------------


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fmt_ratio(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def measure(methods: dict[str, Method], args, ckptfs: Path, save_dir: Path, z2f: Path, cache: Cache,
            outs: Path, mnt: Path, workdir: Path):
    """All timed runs; the methods take turns, each run on a prepared page cache. The
    last repeat's outputs stay under `outs` for the correctness check."""
    ds_env = dict(os.environ, DS_ACCELERATOR="cpu")
    for rep in range(args.repeats):
        shutil.rmtree(outs, ignore_errors=True)
        outs.mkdir(parents=True)
        for key, m in methods.items():
            out = outs / key
            cache.prepare()
            if key == "zero_to_fp32":
                wall, rss, _ = run_measured([sys.executable, str(z2f), str(save_dir), str(out),
                                             "--safe_serialization"], args.timeout, env=ds_env)
                run = Run(wall, rss)
            elif key == "export":
                wall, rss, _ = run_measured([str(ckptfs), "export", str(save_dir), str(out)], args.timeout)
                run = Run(wall, rss, f"writes {dir_bytes(out) / 1e9:.2f} GB")
            elif key == "mount":
                out.mkdir()
                run = run_mount_cp(ckptfs, save_dir, mnt, out / "model.safetensors", args.timeout,
                                   workdir / "mount.log")
            else:
                out.mkdir()
                with open(out / "model.safetensors", "wb") as f:
                    wall, rss, _ = run_measured([str(ckptfs), "cat", str(save_dir), "model.safetensors"],
                                                args.timeout, stdout=f)
                run = Run(wall, rss)
            m.runs.append(run)
            print(f"  run {rep + 1}  {m.name:28s} {run.wall_s:7.2f} s  {run.rss_kib / 1024:9.1f} MiB"
                  + (f"   {run.detail}" if run.detail else ""), flush=True)
    os.sync()



def print_table(methods: dict, ref: "Method", ref_name: str, rss_target: float, time_target: float) -> None:
    """Each method's median wall time and peak RSS, and both as ratios of the reference's."""
    header = f"  {'method':30s} {'wall s':>8s} {'peak RSS MiB':>13s} {'time ratio':>11s} {'RSS ratio':>10s}"
    print(header)
    print("  " + "-" * (len(header) - 2))
    for m in methods.values():
        print(f"  {m.name:30s} {m.wall:8.2f} {m.rss_mib:13.1f} {fmt_ratio(m.wall / ref.wall):>11s} "
              f"{fmt_ratio(m.rss_mib / ref.rss_mib):>10s}")
    print(f"  (ratios: method / {ref_name}; targets: RSS ratio <= {rss_target:g}, time ratio <= {time_target:g})\n")


def check_targets(m: "Method", ref: "Method", rss_target: float, time_target: float) -> bool:
    """Prints PASS/FAIL for M's peak RSS and wall time against the reference's; True if both pass."""
    rss_ok = m.rss_mib <= rss_target * ref.rss_mib
    time_ok = m.wall <= time_target * ref.wall
    print(f"  {'PASS' if rss_ok else 'FAIL'}  {m.name}: peak RSS {m.rss_mib:.1f} MiB <= {rss_target:g} x "
          f"{ref.rss_mib:.1f} MiB = {rss_target * ref.rss_mib:.1f} MiB")
    print(f"  {'PASS' if time_ok else 'FAIL'}  {m.name}: wall {m.wall:.2f} s <= {time_target:g} x {ref.wall:.2f} s")
    return rss_ok and time_ok

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckptfs", default=str(REPO_ROOT / "build" / "ckptfs"))
    ap.add_argument("--workdir", default="/tmp/ckptfs-bench-zero", help="cached checkpoint and outputs")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per method (median wall, max peak RSS)")
    ap.add_argument("--world", type=int, default=2, help="data-parallel ranks of the generated checkpoint")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="training dtype")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--no-train", action="store_true",
                    help="save right after deepspeed.initialize (no AdamW step: the rank files hold no moments)")
    ap.add_argument("--regenerate", action="store_true", help="rebuild the cached checkpoint")
    ap.add_argument("--generate-only", action="store_true", help="build (or reuse) the checkpoint and stop")
    ap.add_argument("--warm", action="store_true", help="source files read before every run instead of dropping "
                    "the page cache (a shared machine: other users' caches stay)")
    ap.add_argument("--checkpoint", default="", help="an existing ZeRO save dir to use instead of generating one "
                    "(e.g. bench_time_to_model.py's llama-zero3)")
    ap.add_argument("--keep-outputs", action="store_true", help="keep the consolidated outputs of the last repeat")
    ap.add_argument("--strict-dtypes", action="store_true",
                    help="fail on frozen parameters that differ from zero_to_fp32's file only by its up-cast to "
                         "float32 (by default that documented difference passes: ckptfs serves frozen "
                         "parameters 16-bit as stored, like get_fp32_state_dict_from_zero_checkpoint)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per timed command")
    ap.add_argument("--gen-timeout", type=float, default=3600, help="seconds for generating the checkpoint")
    ap.add_argument("--port", type=int, default=29533, help="rendezvous port of the generating ranks")
    ap.add_argument("--_generate", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._generate:
        generate_main(args._generate[0], args._generate[1], int(args._generate[2]))
        return 0

    paths = benchlib.workdir_and_binary(args)
    if paths is None:
        return 2
    workdir, ckptfs = paths

    save_dir = ensure_checkpoint(args, workdir)
    latest = (save_dir / "latest").read_text().strip()
    tag_dir = save_dir / latest
    spec = model_spec(args)
    n_params = count_params(spec)
    if args.checkpoint:  # what the given checkpoint holds, from its own listing
        listing = subprocess.run([str(ckptfs), "ls", "--json", str(save_dir)], capture_output=True, text=True,
                                 timeout=300, check=True)
        n_params = sum(e["nbytes"] for e in json.loads(listing.stdout)) // 4
        spec.update(world=len(list(tag_dir.glob("*_optim_states.pt"))), dtype="(given)", train=None)
    print(f"  {save_dir}: {dir_bytes(save_dir) / 1e9:.2f} GB on disk, tag {latest}, "
          f"{len(list(tag_dir.glob('*_optim_states.pt')))} optimizer rank files")
    for p in sorted(tag_dir.iterdir()):
        print(f"    {p.name:48s} {p.stat().st_size / 1e9:7.2f} GB")
    print(f"  {n_params / 1e6:.1f}M parameters: {4 * n_params / 1e9:.2f} GB of fp32 weights "
          f"({spec['world']} ranks, {spec['dtype']}, {'one AdamW step' if spec['train'] else 'no training step'})")
    if args.generate_only:
        return 0

    z2f = save_dir / "zero_to_fp32.py"
    if not z2f.is_file():
        print(f"{z2f} missing (DeepSpeed copies it into every save dir)", file=sys.stderr)
        return 1
    cache = Cache(save_dir, "checkpoint files read into the page cache before every run", cold=not args.warm)
    outs = workdir / "out"
    mnt = workdir / "mnt"
    unmount(mnt)
    methods = {
        "zero_to_fp32": Method("zero_to_fp32 (DeepSpeed CLI)"),
        "export": Method("ckptfs export"),
        "mount": Method("ckptfs mount + cp"),
        "cat": Method("ckptfs cat > file (info)"),
    }
    print(f"\npage cache: {cache.mode}")
    print(f"peak RSS: {'GNU time (/usr/bin/time -f %M)' if GNU_TIME else 'os.wait4 (no GNU time; over-reports)'}")
    print(f"{args.repeats} timed run(s) per method, in turn\n")
    try:
        measure(methods, args, ckptfs, save_dir, z2f, cache, outs, mnt, workdir)
        print("\ncorrectness (against zero_to_fp32's output, safe_open tensor by tensor):")
        reference = safetensors_files(outs / "zero_to_fp32")
        frozen = frozen_parameter_names(save_dir)
        verdicts = {}
        for key in ("export", "mount", "cat"):
            values_ok, upcast_only, msg = compare_outputs(reference, outs / key / "model.safetensors")
            # Only frozen parameters may differ, and only by zero_to_fp32's up-cast.
            upcast_names = {entry.split(" ")[0] for entry in upcast_only}
            verdicts[key] = values_ok and (not upcast_names or (not args.strict_dtypes and upcast_names <= frozen))
            print(f"  {'PASS' if verdicts[key] else 'FAIL'}  {methods[key].name:28s} {msg}")
    except RuntimeError as e:  # a command failed or timed out
        print(f"\nFAIL: {e}", file=sys.stderr)
        return 1
    finally:
        unmount(mnt)
        if not args.keep_outputs:
            shutil.rmtree(outs, ignore_errors=True)

    ds = methods["zero_to_fp32"]
    print(f"\nZeRO-3 -> model.safetensors, {n_params / 1e6:.0f}M params ({4 * n_params / 1e9:.2f} GB fp32), "
          f"world {spec['world']}; page cache {cache.mode.split(' ')[0]}; median wall of {args.repeats}, max peak RSS")
    print_table(methods, ds, "zero_to_fp32", RSS_TARGET, TIME_TARGET)

    failed = not all(verdicts.values())
    for key in ("export", "mount"):
        m = methods[key]
        failed |= not (check_targets(m, ds, RSS_TARGET, TIME_TARGET) and verdicts[key])
        print(f"  {'PASS' if verdicts[key] else 'FAIL'}  {m.name}: output equals zero_to_fp32's")
    exp, cp = methods["export"], methods["mount"]
    speed_ok = exp.wall <= cp.wall / EXPORT_VS_CP
    failed |= not speed_ok
    print(f"  {'PASS' if speed_ok else 'FAIL'}  ckptfs export: speed {cp.wall / exp.wall:.2f}x of mount + cp "
          f"(wall {exp.wall:.2f} s vs {cp.wall:.2f} s; target >= {EXPORT_VS_CP:g}x)")
    print("\nRESULT:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
