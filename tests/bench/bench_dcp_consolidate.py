#!/usr/bin/env python3
"""Benchmark: consolidating a torch.distributed.checkpoint (DCP) save through ckptfs vs
torch's dcp_to_torch_save.

On a real DCP checkpoint saved by torch itself (default: ~532M parameters, 2.1 GB of fp32
weights, FSDP2 `fully_shard` at world size 4 on CPU/gloo, one Adam step, saved with
get_state_dict + dcp.save, so the .distcp files also hold both Adam moments: ~6.4 GB), it
consolidates the whole state (model and optimizer) into one file, each way in a fresh
process with the same page cache state:

  dcp_to_torch_save  torch.distributed.checkpoint.format_utils.dcp_to_torch_save(DIR, OUT)
                     (torch's own tool; it builds the whole state dict in RAM; the reference)
  export             ckptfs export DIR OUT  (model.safetensors and the small files: export's
                     default parts)
  mount+cp           ckptfs -f DIR MNT; cp MNT/model.safetensors OUT; fusermount3 -u MNT
                     (wall: from starting the daemon to the end of cp; peak RSS: daemon + cp)
  cat                ckptfs cat DIR model.safetensors > OUT  (the same file through stdout)

Targets (exit status 1 if one fails or an output differs), for export, mount+cp and cat:
  peak RSS  <= 1/20 of dcp_to_torch_save's
  wall time <= 0.5 x dcp_to_torch_save's
Every ckptfs output must equal dcp_to_torch_save's tensor by
tensor (same keys, dtypes, shapes, bit-identical; the reference is loaded with mmap).

Peak RSS and page cache as in benchlib (GNU time; cold cache as root, else every run
starts with the checkpoint read once into the page cache). The checkpoint is generated
once (a child process forks the ranks) and cached under --workdir. Needs torch and
safetensors in the interpreter running this file (the test venv) and a built ckptfs:

    python tests/bench/bench_dcp_consolidate.py --ckptfs build/ckptfs
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
from bench_zero_consolidate import (Method, Run, build_model, check_targets, count_params, dir_bytes, print_table,
                                    run_mount_cp)
from benchlib import GNU_TIME, Cache, unmount

REPO_ROOT = Path(__file__).resolve().parents[2]
RSS_TARGET = 1 / 20
TIME_TARGET = 0.5

# ---------------------------------------------------------------------------
# Checkpoint generation (`--_generate`, in a child process; the ranks are forked from it)
# ---------------------------------------------------------------------------


def model_spec(args) -> dict:
    """Everything the cached checkpoint depends on; a mismatch regenerates it."""
    return {"version": 1, "world": args.world, "vocab": args.vocab, "hidden": args.hidden, "ffn": args.ffn,
            "layers": args.layers}


def _gen_rank(rank: int, spec: dict, save_dir: str, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(spec["world"]))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=rank, world_size=spec["world"])
    t0 = time.time()
    # Built on the meta device and sharded before any memory is allocated: each rank only
    # ever holds its own shards (plus one gathered block during forward/backward).
    with torch.device("meta"):
        model = build_model(spec)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02, generator=generator)
        model.pos_scale.copy_(torch.linspace(0.5, 1.5, spec["hidden"]))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=False)
    ids = torch.randint(0, spec["vocab"], (1, 8), generator=torch.Generator().manual_seed(rank))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits.float().reshape(-1, spec["vocab"]), ids.reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=save_dir)
    dist.barrier()
    if rank == 0:
        print(f"[gen rank0] torch {torch.__version__}: init + one Adam step {t1 - t0:.1f}s, "
              f"dcp.save {time.time() - t1:.1f}s", flush=True)
    dist.destroy_process_group()


def generate_main(spec_json: str, save_dir: str, port: int):
    spec = json.loads(spec_json)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed.checkpoint  # noqa: F401  (pre-imported so the forked ranks start warm)
    import torch.distributed.fsdp  # noqa: F401
    import torch.multiprocessing as mp

    mp.start_processes(_gen_rank, args=(spec, save_dir, port), nprocs=spec["world"], start_method="fork", join=True)


def ensure_checkpoint(args, workdir: Path) -> Path:
    spec = model_spec(args)
    save_dir = workdir / "ckpt"
    stamp = workdir / "ckpt.spec.json"  # beside it: nothing extra inside the DCP folder
    if not args.regenerate and stamp.is_file() and json.loads(stamp.read_text()) == spec and save_dir.is_dir():
        print(f"checkpoint: cached in {save_dir}")
        return save_dir
    tmp = workdir / "ckpt.tmp"
    for p in (tmp, save_dir):
        shutil.rmtree(p, ignore_errors=True)
    stamp.unlink(missing_ok=True)
    print(f"checkpoint: generating with FSDP2 ({count_params(spec) / 1e6:.0f}M parameters, world {spec['world']}, "
          "fp32, one Adam step) ...", flush=True)
    log = workdir / "generate.log"
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        try:
            rc = subprocess.run([sys.executable, __file__, "--_generate", json.dumps(spec), str(tmp), str(args.port)],
                                stdout=out, stderr=subprocess.STDOUT, timeout=args.gen_timeout,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        raise SystemExit(f"checkpoint generation failed ({rc}); see {log}:\n{log.read_text(errors='replace')[-3000:]}")
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("[gen rank0]"):
            print("  " + line)
    tmp.rename(save_dir)
    stamp.write_text(json.dumps(spec))
    print(f"  generated in {time.perf_counter() - t0:.1f}s")
    return save_dir


# ---------------------------------------------------------------------------
# Verification (after the timed runs)
# ---------------------------------------------------------------------------


def flatten(obj, prefix=""):
    """{dotted key: tensor} of a nested state dict, as DCP names its fqns."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}.{i}" if prefix else str(i))


def compare_with_reference(state_pt: Path, candidate: Path) -> tuple[bool, str]:
    """CANDIDATE (a safetensors file) against dcp_to_torch_save's STATE_PT, loaded with mmap
    and released afterwards (nothing of it stays mapped during the next timed run)."""
    import gc

    import torch

    state = torch.load(state_pt, mmap=True, weights_only=False)
    try:
        return compare(dict(flatten(state)), candidate)
    finally:
        del state
        gc.collect()


def compare(reference: dict, candidate: Path) -> tuple[bool, str]:
    import torch
    from safetensors import safe_open

    with safe_open(str(candidate), framework="pt") as f:
        keys = set(f.keys())
        if keys != set(reference):
            return False, (f"keys differ: missing {sorted(set(reference) - keys)[:5]}, "
                           f"extra {sorted(keys - set(reference))[:5]}")
        nbytes = 0
        for key, want in reference.items():
            got = f.get_tensor(key)
            if got.dtype != want.dtype or got.shape != want.shape:
                return False, f"{key}: {got.dtype} {list(got.shape)} != {want.dtype} {list(want.shape)}"
            if not torch.equal(got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)):
                return False, f"{key}: values differ"
            nbytes += got.numel() * got.element_size()
            del got
    return True, f"{len(keys)} tensors, {nbytes / 1e9:.2f} GB: same keys, dtypes, shapes, all bit-identical"


# ---------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckptfs", default=str(REPO_ROOT / "build" / "ckptfs"))
    ap.add_argument("--workdir", default="/tmp/ckptfs-bench-dcp", help="cached checkpoint and outputs")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per method (median wall, max peak RSS)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--generate-only", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per timed command")
    ap.add_argument("--gen-timeout", type=float, default=3600)
    ap.add_argument("--port", type=int, default=29541)
    ap.add_argument("--_generate", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._generate:
        generate_main(*args._generate[:2], int(args._generate[2]))
        return 0
    paths = benchlib.workdir_and_binary(args)
    if paths is None:
        return 2
    workdir, ckptfs = paths
    save_dir = ensure_checkpoint(args, workdir)
    spec = model_spec(args)
    n_params = count_params(spec)
    print(f"  {save_dir}: {dir_bytes(save_dir) / 1e9:.2f} GB on disk in {len(list(save_dir.glob('*.distcp')))} "
          f".distcp files; {n_params / 1e6:.1f}M parameters = {4 * n_params / 1e9:.2f} GB of fp32 weights")
    if args.generate_only:
        return 0

    cache = Cache(save_dir, "checkpoint files read into the page cache before every run")
    outs, mnt = workdir / "out", workdir / "mnt"
    unmount(mnt)
    methods = {
        "dcp_to_torch_save": Method("dcp_to_torch_save (torch)"),
        "export": Method("ckptfs export"),
        "mount": Method("ckptfs mount + cp"),
        "cat": Method("ckptfs cat > file"),
    }
    to_torch_save = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                     "dcp_to_torch_save(sys.argv[1], sys.argv[2])")
    print(f"\nmachine: {benchlib.machine_note()}")
    print(f"page cache: {cache.mode}")
    print(f"peak RSS: {'GNU time (/usr/bin/time -f %M)' if GNU_TIME else 'os.wait4 (no GNU time; over-reports)'}\n")
    verdicts = {}
    try:
        for rep in range(args.repeats):
            last = rep == args.repeats - 1
            shutil.rmtree(outs, ignore_errors=True)
            outs.mkdir(parents=True)
            for key, m in methods.items():
                out = outs / key
                out.mkdir()
                cache.prepare()
                if key == "dcp_to_torch_save":
                    wall, rss, _, _ = benchlib.run_measured([sys.executable, "-c", to_torch_save, str(save_dir),
                                                            str(out / "state.pt")], args.timeout)
                    run = Run(wall, rss)
                elif key == "export":
                    wall, rss, _, _ = benchlib.run_measured([str(ckptfs), "export", str(save_dir), str(out / "x")],
                                                            args.timeout)
                    run = Run(wall, rss, f"writes {dir_bytes(out) / 1e9:.2f} GB")
                elif key == "mount":
                    run = run_mount_cp(ckptfs, save_dir, mnt, out / "model.safetensors", args.timeout,
                                       workdir / "mount.log")
                else:
                    with open(out / "model.safetensors", "wb") as f:
                        wall, rss, _, _ = benchlib.run_measured([str(ckptfs), "cat", str(save_dir),
                                                                "model.safetensors"], args.timeout, stdout=f)
                    run = Run(wall, rss)
                m.runs.append(run)
                print(f"  run {rep + 1}  {m.name:28s} {run.wall_s:7.2f} s  {run.rss_kib / 1024:9.1f} MiB"
                      + (f"   {run.detail}" if run.detail else ""), flush=True)
                if last and key != "dcp_to_torch_save":
                    # Compared at once and deleted: the outputs are as large as the checkpoint.
                    produced = out / "x" / "model.safetensors" if key == "export" else out / "model.safetensors"
                    ok, msg = compare_with_reference(outs / "dcp_to_torch_save" / "state.pt", produced)
                    verdicts[key] = ok
                    print(f"        {'PASS' if ok else 'FAIL'}: {msg}", flush=True)
                if key != "dcp_to_torch_save":
                    shutil.rmtree(out, ignore_errors=True)
    except RuntimeError as e:
        print(f"\nFAIL: {e}", file=sys.stderr)
        return 1
    finally:
        unmount(mnt)
        shutil.rmtree(outs, ignore_errors=True)

    ref = methods["dcp_to_torch_save"]
    print(f"\nDCP (FSDP2, world {spec['world']}) -> one file, {n_params / 1e6:.0f}M params "
          f"({4 * n_params / 1e9:.2f} GB fp32) + Adam moments; page cache {cache.mode.split(' ')[0]}; "
          f"median wall of {args.repeats}, max peak RSS")
    print_table(methods, ref, "dcp_to_torch_save", RSS_TARGET, TIME_TARGET)
    failed = not all(verdicts.values())
    for key in ("mount", "cat", "export"):
        failed |= not check_targets(methods[key], ref, RSS_TARGET, TIME_TARGET)
    print("\nRESULT:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
