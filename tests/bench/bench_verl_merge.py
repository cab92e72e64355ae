#!/usr/bin/env python3
"""Benchmark: consolidating a veRL FSDP2 actor checkpoint through ckptfs vs veRL's own model
merger.

On a real veRL checkpoint (default: a Qwen2-shaped model of ~537M parameters, 2.15 GB of fp32
weights, FSDP2 through veRL's apply_fsdp2 at world size 4 on CPU/gloo, saved by veRL 0.9.1's
FSDPCheckpointManager: model_world_size_4_rank_{0..3}.pt, fsdp_config.json, huggingface/),
each way in a fresh process with the same page cache state:

  merger       veRL's FSDPModelMerger(operation="merge").merge_and_save(): torch.load of every
               rank file, each local shard cast to bf16, torch.cat per tensor, save_pretrained
               (the reference; what `python -m verl.model_merger merge --backend fsdp` runs)
  torch.load   the same without veRL (the test venv: no veRL imports): torch.load of every
               rank file, torch.cat of the DTensors' local shards along their Shard dimension,
               safetensors' save_file, in fp32 (info: the least a script of one's own does)
  mount bf16   ckptfs -f ACTOR MNT -o dtype=bf16; cp MNT/model.safetensors OUT; unmount
               (the merger's output, bit for bit)
  mount fp32   the same without dtype=: the weights as trained, which the merger cannot give
               (wall: from starting the daemon to the end of cp; peak RSS: daemon + cp)

Checked after the timed runs (exit status 1 if one fails): the bf16 output equals the
merger's model.safetensors tensor by tensor (keys, dtypes, shapes, bits), the fp32 output
equals the torch.load script's, and cast to bf16 the merger's too. Targets for both mounts: peak RSS <= 1/20 of the
merger's, wall time <= 0.5 x the merger's.

The checkpoint is generated once into --workdir by a child process running the overlay of
scripts/setup-venv.sh verl (veRL and its pins), which forks the ranks; each rank builds the
model on the meta device, shards it and fills only its own shards, so no rank holds the
whole model. Peak RSS and page cache as in benchlib (GNU time; cold cache as root unless
--warm). Run from the repository root with the test venv's python:

    python tests/bench/bench_verl_merge.py --ckptfs build/ckptfs
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
from bench_zero_consolidate import Method, Run, check_targets, dir_bytes, print_table, run_mount_cp
from benchlib import GNU_TIME, Cache, unmount

REPO_ROOT = Path(__file__).resolve().parents[2]
RSS_TARGET = 1 / 20
TIME_TARGET = 0.5


def model_spec(args) -> dict:
    """Everything the cached checkpoint depends on; a mismatch regenerates it."""
    return {"version": 1, "world": args.world, "vocab": args.vocab, "hidden": args.hidden, "ffn": args.ffn,
            "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads}


def count_params(spec: dict) -> int:
    v, d, f, n = spec["vocab"], spec["hidden"], spec["ffn"], spec["layers"]
    head_dim = d // spec["heads"]
    kv = spec["kv_heads"] * head_dim
    attn = d * d + d + 2 * (kv * d + kv) + d * d       # q (bias), k, v (bias), o
    block = attn + 3 * d * f + 2 * d                  # gate, up, down, two norms
    return 2 * v * d + n * block + d                  # embed, head, blocks, final norm


# ---------------------------------------------------------------------------
# Checkpoint generation (`--_generate`, in the verl overlay; the ranks are forked from it)
# ---------------------------------------------------------------------------


def qwen2_config(spec: dict):
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["ffn"],
                         num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                         num_key_value_heads=spec["kv_heads"], tie_word_embeddings=False,
                         max_position_embeddings=2048)
    config.architectures = ["Qwen2ForCausalLM"]
    return config


def _gen_rank(rank: int, spec: dict, save_dir: str, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(spec["world"]))
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import Qwen2ForCausalLM

    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import apply_fsdp2

    dist.init_process_group("gloo", rank=rank, world_size=spec["world"])
    t0 = time.time()
    mesh = init_device_mesh("cpu", (spec["world"],), mesh_dim_names=("fsdp",))
    with torch.device("meta"):
        model = Qwen2ForCausalLM._from_config(qwen2_config(spec), attn_implementation="eager", dtype=torch.float32)
    apply_fsdp2(model, {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                         reduce_dtype=torch.float32),
                        "offload_policy": None, "reshard_after_forward": True}, {})
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02, generator=generator)
    manager = FSDPCheckpointManager(model=model, optimizer=None, lr_scheduler=None, processing_class=None,
                                    checkpoint_config=OmegaConf.create({"save_contents": ["model"],
                                                                        "load_contents": ["model"]}))
    t1 = time.time()
    manager.save_checkpoint(save_dir, global_step=1)
    dist.barrier()
    if rank == 0:
        print(f"[gen rank0] torch {torch.__version__}: init {t1 - t0:.1f}s, veRL save {time.time() - t1:.1f}s",
              flush=True)
    dist.destroy_process_group()


def generate_main(spec_json: str, save_dir: str, port: int):
    spec = json.loads(spec_json)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp
    import verl.utils.checkpoint.fsdp_checkpoint_manager  # noqa: F401  (imported once, before the fork)

    mp.start_processes(_gen_rank, args=(spec, save_dir, port), nprocs=spec["world"], start_method="fork", join=True)


def overlay_python() -> str:
    done = subprocess.run([str(REPO_ROOT / "scripts" / "setup-venv.sh"), "verl"], capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"scripts/setup-venv.sh verl failed:\n{done.stderr[-3000:]}")
    return str(Path(done.stdout.strip()) / "bin" / "python")


def ensure_checkpoint(args, workdir: Path, python: str) -> Path:
    spec = model_spec(args)
    save_dir = workdir / "actor"
    stamp = workdir / "actor.spec.json"
    if not args.regenerate and stamp.is_file() and json.loads(stamp.read_text()) == spec and save_dir.is_dir():
        print(f"checkpoint: cached in {save_dir}")
        return save_dir
    tmp = workdir / "actor.tmp"
    for p in (tmp, save_dir):
        shutil.rmtree(p, ignore_errors=True)
    stamp.unlink(missing_ok=True)
    print(f"checkpoint: generating with veRL's FSDP2 ({count_params(spec) / 1e6:.0f}M parameters, world "
          f"{spec['world']}, fp32) ...", flush=True)
    log = workdir / "generate.log"
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        try:
            rc = subprocess.run([python, __file__, "--_generate", json.dumps(spec), str(tmp), str(args.port)],
                                stdout=out, stderr=subprocess.STDOUT, timeout=args.gen_timeout,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True,
                                cwd=Path(__file__).parent).returncode
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
# Timed runs
# ---------------------------------------------------------------------------

MERGER = """import sys
from verl.model_merger.base_model_merger import ModelMergerConfig
from verl.model_merger.fsdp_model_merger import FSDPModelMerger
actor, out = sys.argv[1], sys.argv[2]
FSDPModelMerger(ModelMergerConfig(operation="merge", backend="fsdp", local_dir=actor, target_dir=out,
                                  hf_model_config_path=actor + "/huggingface")).merge_and_save()
"""


TORCH_LOAD = """import sys, torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
actor, out, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
ranks = [torch.load(f"{actor}/model_world_size_{world}_rank_{r}.pt", map_location="cpu", weights_only=False)
         for r in range(world)]
full = {}
for key, first in list(ranks[0].items()):
    if isinstance(first, DTensor):
        (placement,) = first.placements
        parts = [rank.pop(key)._local_tensor for rank in ranks]
        full[key] = torch.cat(parts, dim=placement.dim) if placement.is_shard() else parts[0]
    else:
        full[key] = first
save_file(full, out)
"""


def compare(merged: Path, candidate: Path, cast_bf16: bool) -> tuple[bool, str]:
    """CANDIDATE's tensors (cast to bf16 first when CAST_BF16) against the merger's output."""
    import torch
    from safetensors import safe_open

    with safe_open(str(merged), framework="pt") as want, safe_open(str(candidate), framework="pt") as got:
        keys = set(want.keys())
        if set(got.keys()) != keys:
            return False, f"keys differ: {sorted(set(got.keys()) ^ keys)[:5]}"
        nbytes = 0
        for key in sorted(keys):
            w, g = want.get_tensor(key), got.get_tensor(key)
            if cast_bf16:
                g = g.to(torch.bfloat16)
            if g.dtype != w.dtype or g.shape != w.shape:
                return False, f"{key}: {g.dtype} {list(g.shape)} != {w.dtype} {list(w.shape)}"
            if not torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)):
                return False, f"{key}: values differ"
            nbytes += g.numel() * g.element_size()
    how = "cast to bf16, " if cast_bf16 else ""
    return True, f"{len(keys)} tensors ({how}{nbytes / 1e9:.2f} GB): same keys, dtypes, shapes, bit-identical"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckptfs", default=str(REPO_ROOT / "build" / "ckptfs"))
    ap.add_argument("--workdir", default="/tmp/ckptfs-bench-verl", help="cached checkpoint and outputs")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per method (median wall, max peak RSS)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--warm", action="store_true", help="read the checkpoint into the page cache before each run "
                                                         "instead of dropping caches")
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--generate-only", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per timed command")
    ap.add_argument("--gen-timeout", type=float, default=3600)
    ap.add_argument("--port", type=int, default=29547)
    ap.add_argument("--_generate", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._generate:
        generate_main(*args._generate[:2], int(args._generate[2]))
        return 0
    paths = benchlib.workdir_and_binary(args)
    if paths is None:
        return 2
    workdir, ckptfs = paths
    python = overlay_python()
    actor = ensure_checkpoint(args, workdir, python)
    spec = model_spec(args)
    n_params = count_params(spec)
    print(f"  {actor}: {dir_bytes(actor) / 1e9:.2f} GB on disk in {len(list(actor.glob('model_world_size_*.pt')))} "
          f"rank files; {n_params / 1e6:.1f}M parameters = {4 * n_params / 1e9:.2f} GB of fp32 weights")
    if args.generate_only:
        return 0

    cache = Cache(actor, "checkpoint files read into the page cache before every run", cold=not args.warm)
    outs, mnt = workdir / "out", workdir / "mnt"
    unmount(mnt)
    methods = {
        "merger": Method("veRL model merger"),
        "torch_load": Method("torch.load + cat (info)"),
        "bf16": Method("ckptfs mount bf16 + cp"),
        "fp32": Method("ckptfs mount fp32 + cp"),
    }
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
                if key == "merger":
                    wall, rss, _, _ = benchlib.run_measured([python, "-c", MERGER, str(actor), str(out)], args.timeout,
                                                            stdout=subprocess.DEVNULL,
                                                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
                    run = Run(wall, rss, f"writes {dir_bytes(out) / 1e9:.2f} GB")
                elif key == "torch_load":
                    wall, rss, _, _ = benchlib.run_measured([sys.executable, "-c", TORCH_LOAD, str(actor),
                                                            str(out / "model.safetensors"), str(spec["world"])],
                                                           args.timeout, stdout=subprocess.DEVNULL)
                    run = Run(wall, rss)
                else:
                    options = ["-o", "dtype=bf16"] if key == "bf16" else []
                    run = run_mount_cp(ckptfs, actor, mnt, out / "model.safetensors", args.timeout,
                                   workdir / "mount.log", options)
                m.runs.append(run)
                print(f"  run {rep + 1}  {m.name:28s} {run.wall_s:7.2f} s  {run.rss_kib / 1024:9.1f} MiB"
                      + (f"   {run.detail}" if run.detail else ""), flush=True)
                if last and key in ("bf16", "fp32"):
                    ok, msg = compare(outs / "merger" / "model.safetensors", out / "model.safetensors", key == "fp32")
                    verdicts[key] = ok
                    print(f"        {'PASS' if ok else 'FAIL'}: {msg}", flush=True)
                if last and key == "fp32":
                    ok, msg = compare(outs / "torch_load" / "model.safetensors", out / "model.safetensors", False)
                    verdicts["fp32 vs torch.load"] = ok
                    print(f"        {'PASS' if ok else 'FAIL'}: against torch.load + cat: {msg}", flush=True)
                if key in ("bf16", "fp32"):
                    shutil.rmtree(out, ignore_errors=True)
    except RuntimeError as e:
        print(f"\nFAIL: {e}", file=sys.stderr)
        return 1
    finally:
        unmount(mnt)
        shutil.rmtree(outs, ignore_errors=True)

    ref = methods["merger"]
    print(f"\nveRL FSDP2 actor (world {spec['world']}) -> one safetensors file, {n_params / 1e6:.0f}M params "
          f"({4 * n_params / 1e9:.2f} GB fp32); page cache {cache.mode.split(' ')[0]}; median wall of "
          f"{args.repeats}, max peak RSS")
    print_table(methods, ref, "veRL model merger", RSS_TARGET, TIME_TARGET)
    lean = methods["torch_load"]
    for key in ("bf16", "fp32"):
        m = methods[key]
        print(f"  {m.name} against torch.load + cat: time ratio {m.wall / lean.wall:.3f}, "
              f"RSS ratio {m.rss_mib / lean.rss_mib:.3f}")
    print()
    failed = not all(verdicts.values())
    for key in ("bf16", "fp32"):
        failed |= not check_targets(methods[key], ref, RSS_TARGET, TIME_TARGET)
    print("\nRESULT:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
