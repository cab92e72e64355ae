#!/usr/bin/env python3
"""Real DeepSpeed ZeRO checkpoints for tests/zero, saved by DeepSpeed itself.

    python make_zero_checkpoints.py OUT [--only NAME,...] [--no-zero-to-fp32]

DeepSpeed runs on the CPU accelerator with the gloo backend. No launcher is needed: the parent
imports torch and DeepSpeed once, then forks one process per rank (all fixtures of one world
size are trained and saved by the same set of ranks, one after the other). Each fixture is a
tiny model trained for two steps and saved with engine.save_checkpoint():

    OUT/<name>/checkpoint/          the save dir: latest, global_step2/, zero_to_fp32.py, ...
    OUT/<name>/engine_reference.pt  ground truth read from the live engine at save time
    OUT/<name>/zero_to_fp32.pt      DeepSpeed's own get_fp32_state_dict_from_zero_checkpoint()
                                    on the save dir (absent where it refuses the checkpoint)
    OUT/<name>/fixture.json         the fixture's settings, DeepSpeed config and versions

The module is importable without torch or DeepSpeed (the test suite takes FIXTURES from it to
parametrize its tests); everything heavy is imported in the functions that need it.

The model covers what a ZeRO reader has to get right: parameters with fewer elements than the
world size (shapes [1] and [3]), two optimizer param groups, a frozen Linear, a tied
embedding/output weight, float, float16 and int64 persistent buffers (some in a submodule, between
parameters) and a non-persistent buffer. Stage 3 fixtures use a small sub_group_size, so every
param group is split into several flat fp32 sub-groups.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for ckptfs_ranks
from ckptfs_ranks import run_ranks_per_world_size  # noqa: E402

TRAIN_STEPS = 2
TAG = f"global_step{TRAIN_STEPS}"  # DeepSpeed's default tag: global_step<engine.global_steps>
VOCAB = 37
WIDTH = 10
HIDDEN = 13


@dataclass(frozen=True)
class Fixture:
    """One saved checkpoint: a world size and a DeepSpeed configuration."""

    world_size: int
    stage: int  # ZeRO stage 1, 2 or 3
    dtype: str  # training precision: "bf16", "fp16" or "fp32"
    sub_group_size: int | None = None  # stage 3: zero_optimization.sub_group_size
    grad_accum_fp32: bool = False  # data_types.grad_accum_dtype=fp32 (stage 1 + bf16: BF16_Optimizer)
    param_alignment: bool = False  # zero_optimization.parameter_alignment (per-param padding)
    round_robin: bool = False  # zero_optimization.round_robin_gradients (reorders params)

    @property
    def name(self) -> str:
        name = f"w{self.world_size}-s{self.stage}-{self.dtype}"
        if self.sub_group_size is not None:
            name += f"-sg{self.sub_group_size}"
        if self.grad_accum_fp32:
            name += "-acc32"
        if self.param_alignment:
            name += "-pa"
        if self.round_robin:
            name += "-rr"
        return name

    @property
    def bf16_optimizer(self) -> bool:
        """DeepSpeed saves these with its BF16_Optimizer, whose files zero_to_fp32 refuses."""
        return self.stage == 1 and self.dtype == "bf16" and self.grad_accum_fp32

    def ds_config(self) -> dict:
        zero = {"stage": self.stage}
        if self.stage == 3:
            # Without a sub_group_size each param group is one flat fp32 group; with a small one
            # DeepSpeed cuts it into several (sub-groups hold whole params; sizes are counted in
            # per-rank partition elements).
            zero["sub_group_size"] = self.sub_group_size or 1_000_000_000
            zero["stage3_param_persistence_threshold"] = 0  # partition every param
        if self.param_alignment:
            zero["parameter_alignment"] = True
        if self.round_robin:
            zero["round_robin_gradients"] = True
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 1_000_000,
            "wall_clock_breakdown": False,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,  # the client's torch.optim.AdamW
        }
        if self.dtype == "bf16":
            config["bf16"] = {"enabled": True}
        elif self.dtype == "fp16":
            config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 100}
        if self.grad_accum_fp32:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        return config


SUB_GROUP_SIZE = 8  # per-rank elements: several sub-groups per param group at every world size


def _matrix() -> list[Fixture]:
    fixtures = []
    # Every stage at every world size, in bf16 (the common case). 3 does not divide the flat
    # group sizes, 8 exceeds the element count of the [1] and [3] parameters.
    for world in (1, 2, 3, 4, 8):
        fixtures += [
            Fixture(world, 1, "bf16"),
            Fixture(world, 2, "bf16"),
            Fixture(world, 3, "bf16", sub_group_size=SUB_GROUP_SIZE),
        ]
    # Precisions and optimizer variants at a few world sizes.
    fixtures += [
        Fixture(2, 1, "fp16"),
        Fixture(2, 2, "fp16"),
        Fixture(2, 3, "fp16", sub_group_size=SUB_GROUP_SIZE),
        Fixture(2, 2, "fp32"),
        Fixture(2, 3, "fp32"),  # one flat group per param group
        Fixture(2, 1, "bf16", grad_accum_fp32=True),
        Fixture(3, 1, "fp32"),
        Fixture(3, 2, "fp16", param_alignment=True),
        Fixture(4, 1, "fp16"),
        Fixture(4, 3, "fp16", sub_group_size=SUB_GROUP_SIZE),
        Fixture(4, 3, "bf16"),
        Fixture(4, 2, "bf16", param_alignment=True),
        Fixture(4, 2, "bf16", round_robin=True),
        Fixture(4, 1, "bf16", grad_accum_fp32=True),
        Fixture(8, 1, "bf16", grad_accum_fp32=True),
        # More than 10 ranks: rank files must be ordered by rank number, not by name
        # (..._rank_10_... sorts before ..._rank_2_...).
        Fixture(12, 2, "bf16"),
        Fixture(12, 3, "bf16", sub_group_size=SUB_GROUP_SIZE),
    ]
    return fixtures


FIXTURES = _matrix()
FIXTURES_BY_NAME = {fixture.name: fixture for fixture in FIXTURES}
assert len(FIXTURES_BY_NAME) == len(FIXTURES), "fixture names must be unique"


# --- everything below runs with torch and DeepSpeed ---------------------------------------


def _set_up_environment() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # many ranks on few cores


def _build_model():
    import torch
    import torch.nn as nn

    class Tracker(nn.Module):
        """A scaling layer that keeps running statistics in buffers, like BatchNorm (whose
        float32 running stats cannot meet 16-bit inputs: DeepSpeed casts parameters, not
        buffers)."""

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(WIDTH))
            self.register_buffer("running_mean", torch.zeros(WIDTH))  # float32
            self.register_buffer("num_updates", torch.tensor(0, dtype=torch.int64))

        def forward(self, x):
            if self.training:
                with torch.no_grad():
                    self.running_mean.mul_(0.9).add_(x.detach().float().mean(dim=(0, 1)), alpha=0.1)
                    self.num_updates += 1
            return x * self.weight

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            # A [1] and a [3] parameter: smaller than most world sizes, so some ranks hold
            # nothing or only padding of them. (A 0-d parameter crashes DeepSpeed's
            # _broadcast_model in 16-bit modes, so there is none.)
            self.scale = nn.Parameter(torch.full((1,), 1.5))
            self.gate = nn.Parameter(torch.tensor([0.25, -0.5, 0.75]))
            self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, WIDTH))  # float32
            self.register_buffer("counter", torch.tensor(123456789012345, dtype=torch.int64))
            # A float16 buffer: zero_to_fp32 casts float buffers to fp32, ckptfs keeps them as
            # stored.
            self.register_buffer("half_table", torch.linspace(-2.0, 2.0, 6, dtype=torch.float16))
            self.register_buffer("scratch", torch.ones(3), persistent=False)  # never saved
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.fc1 = nn.Linear(WIDTH, HIDDEN)
            self.fc2 = nn.Linear(HIDDEN, WIDTH)
            self.frozen = nn.Linear(WIDTH, WIDTH)
            for p in self.frozen.parameters():
                p.requires_grad_(False)
            # Buffers in a submodule too: they interleave with parameters in the module's
            # state_dict.
            self.tracker = Tracker()
            self.ln = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, VOCAB, bias=False)
            self.head.weight = self.embed.weight  # tied: saved once, listed under both names

        def forward(self, ids):
            x = self.embed(ids) * self.pos_scale.to(self.embed.weight.dtype)
            x = x + self.fc2(torch.relu(self.fc1(x)))
            x = x + self.frozen(x)
            x = self.tracker(x)
            x = self.ln(x) * self.scale + self.gate.sum()
            return self.head(x)

    return Tiny()


def _param_groups(model) -> list[dict]:
    """Two groups with different hyper-parameters: matrices with weight decay, the rest
    without. Frozen parameters are left out (DeepSpeed records them separately)."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():  # the tied weight is listed once
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": 0.01},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3},
    ]


def _engine_reference(engine) -> dict:
    """Ground truth from the live engine (every rank must call this: stage 3 gathers).

    trainable: the fp32 master weight of each trainable parameter (safe_get_full_fp32_param)
    frozen:    each frozen parameter in the model's precision (gathered in stage 3)
    buffers:   each persistent buffer as stored
    aliases:   {tied name: name it is saved under}
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    ref = {"trainable": {}, "frozen": {}, "buffers": {}, "aliases": {}}
    first_name = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            ref["aliases"][name] = first_name[id(param)]
            continue
        first_name[id(param)] = name
        if param.requires_grad:
            full = safe_get_full_fp32_param(param)
            if full is None:
                raise RuntimeError(f"safe_get_full_fp32_param({name}) returned None")
            ref["trainable"][name] = full.detach().cpu().clone()
        elif hasattr(param, "ds_id"):  # stage 3: partitioned
            with deepspeed.zero.GatheredParameters([param]):
                ref["frozen"][name] = param.data.detach().cpu().clone()
        else:
            ref["frozen"][name] = param.data.detach().cpu().clone()
    for name, buffer in engine.module.named_buffers():
        owner_name, _, leaf = name.rpartition(".")
        owner = engine.module.get_submodule(owner_name)
        if leaf not in owner._non_persistent_buffers_set:
            ref["buffers"][name] = buffer.detach().cpu().clone()
    return ref


def _preimport() -> None:
    """Import torch and DeepSpeed once in the parent before forking the ranks, so that each
    rank starts warm. The first torch.optim.AdamW() and DeepSpeed's optimizer sanity check
    lazily import torch._dynamo and torch._inductor (DeepSpeed's Muon module calls
    torch.compile at import): seconds per rank if left to the ranks."""
    import torch
    import deepspeed  # noqa: F401
    import deepspeed.runtime.bf16_optimizer  # noqa: F401
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import deepspeed.utils.zero_to_fp32  # noqa: F401

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    try:  # what DeepSpeed's is_zero_supported_optimizer() imports
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:
        pass


def _patch_deepspeed_for_cpu() -> None:
    """Two monkeypatches that let DeepSpeed 0.19.8 train on this CPU-only machine quickly."""
    # fp16 configs: CPU_Accelerator.is_fp16_supported() asks oneDNN for AVX512-FP16/AMX and
    # DeepSpeed refuses fp16 without it. The tiny fp16 training runs fine on any CPU.
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: True
    # The torch comm backend would JIT-compile a C++ shared-memory all-reduce (~2 minutes on
    # two cores). gloo does not need it. ("import deepspeed.comm.torch as m" would give the
    # torch package itself: deepspeed.comm re-exports it under that name.)
    import deepspeed.comm.torch  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def _rank_main(rank: int, world_size: int, fixture_names: list[str], out: str) -> None:
    """One rank: train and save every fixture of this world size."""
    import torch

    _patch_deepspeed_for_cpu()
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo")
    assert dist.get_world_size() == world_size
    for name in fixture_names:
        fixture = FIXTURES_BY_NAME[name]
        torch.manual_seed(1234)  # the same initial model on every rank
        model = _build_model()
        optimizer = torch.optim.AdamW(_param_groups(model), lr=1e-3)
        config = fixture.ds_config()
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        batches = torch.Generator().manual_seed(100 + rank)  # different data on each rank
        for _ in range(TRAIN_STEPS):
            ids = torch.randint(0, VOCAB, (2, 5), generator=batches)
            logits = engine(ids)
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), ids.reshape(-1))
            engine.backward(loss)
            engine.step()
        fixture_dir = Path(out) / name
        engine.save_checkpoint(str(fixture_dir / "checkpoint"))
        dist.barrier()
        reference = _engine_reference(engine)
        if rank == 0:
            torch.save(reference, fixture_dir / "engine_reference.pt")
            info = {
                "fixture": asdict(fixture),
                "name": name,
                "tag": TAG,
                "ds_config": config,
                "optimizer_class": type(ds_optimizer).__name__,
                "deepspeed_version": deepspeed.__version__,
                "torch_version": torch.__version__,
            }
            (fixture_dir / "fixture.json").write_text(json.dumps(info, indent=1) + "\n")
            print(f"  {name}: {type(ds_optimizer).__name__}, loss {loss.item():.4f}", flush=True)
        dist.barrier()
        del engine, ds_optimizer, optimizer, model
    dist.barrier()
    dist.destroy_process_group()


def save_checkpoints(out: Path, fixtures: list[Fixture]) -> None:
    """Train and save FIXTURES under OUT, one forked process group per world size."""
    _set_up_environment()
    _preimport()
    names_by_world_size = {}
    for f in fixtures:
        names_by_world_size.setdefault(f.world_size, []).append(f.name)
    run_ranks_per_world_size(_rank_main, names_by_world_size, out)


def write_zero_to_fp32_reference(fixture_dir: Path) -> None:
    """Run DeepSpeed's own, unmodified zero_to_fp32 on the fixture's save dir and keep its
    result (key order and tied tensors survive torch.save) in zero_to_fp32.pt. Where it refuses
    the checkpoint, fixture.json records why instead."""
    import contextlib
    import io

    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    info_path = fixture_dir / "fixture.json"
    info = json.loads(info_path.read_text())
    chatter = io.StringIO()  # zero_to_fp32 prints progress
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            state_dict = get_fp32_state_dict_from_zero_checkpoint(str(fixture_dir / "checkpoint"))
    except Exception as error:  # noqa: BLE001  (recorded; the suite decides what it means)
        info["zero_to_fp32_error"] = f"{type(error).__name__}: {error}"
    else:
        info["zero_to_fp32_error"] = None
        torch.save(state_dict, fixture_dir / "zero_to_fp32.pt")
    info_path.write_text(json.dumps(info, indent=1) + "\n")


def generate(out: Path, fixtures: list[Fixture] | None = None, zero_to_fp32: bool = True) -> None:
    fixtures = FIXTURES if fixtures is None else fixtures
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoints(out, fixtures)
    if zero_to_fp32:
        started = time.monotonic()
        for fixture in fixtures:
            write_zero_to_fp32_reference(out / fixture.name)
        print(f"zero_to_fp32 on {len(fixtures)} checkpoints: {time.monotonic() - started:.1f}s", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder to write the fixtures into")
    parser.add_argument("--only", help="comma-separated fixture names (default: all); --list shows them")
    parser.add_argument("--list", action="store_true", help="print the fixture names and exit")
    parser.add_argument("--no-zero-to-fp32", action="store_true", help="skip the zero_to_fp32 reference")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(FIXTURES_BY_NAME))
        return 0
    fixtures = FIXTURES
    if args.only:
        unknown = [n for n in args.only.split(",") if n not in FIXTURES_BY_NAME]
        if unknown:
            parser.error(f"unknown fixtures: {', '.join(unknown)}")
        fixtures = [FIXTURES_BY_NAME[n] for n in args.only.split(",")]
    started = time.monotonic()
    generate(args.out, fixtures, zero_to_fp32=not args.no_zero_to_fp32)
    print(f"total {time.monotonic() - started:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
