#!/usr/bin/env python3
"""Per-rank torch.save files of FSDP1 and FSDP2 state dicts, written by torch itself, for
tests/frameworks/test_fsdp_rank_files.py.

    python make_fsdp_rank_files.py OUT

torch.distributed runs on the CPU with gloo; the ranks of each world size (2, then 3) are
forked from this process (tests/ckptfs_ranks.py). Each rank saves its own state dicts with
torch.save, as veRL and other trainers do, and the ranks gather the full tensors torch itself
assembles (DTensor.full_tensor(), FSDP1's FULL_STATE_DICT) into reference files:

    OUT/<case>/model/<group with rank R>.pt   model.state_dict() of rank R
    OUT/<case>/optim/<group with rank R>.pt   the optimizer's state dict of rank R (FSDP2:
                                              optimizer.state_dict(); FSDP1:
                                              FSDP.optim_state_dict under SHARDED_STATE_DICT)
    OUT/<case>/model.reference.safetensors    the full tensors, keyed as ckptfs flattens them
    OUT/<case>/optim.reference.safetensors
    OUT/<case>/local/rank<R>.safetensors      each rank's local shards, keyed
                                              <key>.local_shards.<i> (model and optim)
    OUT/fsdp1_*/local_state_dict/<group>.pt   FSDP1 LOCAL_STATE_DICT of rank R, and
    OUT/fsdp1_*/local/rank<R>.flat.safetensors  its local shard of the flat parameter
    OUT/cases.json                            {case: {world_size, kind, placements}}

Cases: fsdp2_ws{2,3} (fully_shard: Shard(0)), fsdp1_ws{2,3} (FSDP1 SHARDED_STATE_DICT
ShardedTensors), tp_ws{2,3} (ColwiseParallel / RowwiseParallel: Shard(0) and Shard(1)),
hsdp_ws2 (fully_shard on a (2, 1) mesh: Replicate() then Shard(0)), partial_ws2 and
strided_ws2 (a DTensor with a Partial / _StridedShard placement, which no full tensor is a box
of). The model's dimensions do not divide by 3, its head bias has fewer rows (2) than 3
ranks, so shards are uneven and some are empty; a buffer stays a plain tensor.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for ckptfs_ranks
from ckptfs_ranks import run_ranks_per_world_size  # noqa: E402

# case -> world size
CASES = {
    "fsdp2_ws2": 2,
    "fsdp1_ws2": 2,
    "tp_ws2": 2,
    "hsdp_ws2": 2,
    "partial_ws2": 2,
    "strided_ws2": 2,
    "fsdp2_ws3": 3,
    "fsdp1_ws3": 3,
    "tp_ws3": 3,
}
MODEL_GROUP = "model_world_size_{world}_rank_{rank}.pt"
OPTIM_GROUP = "optim_world_size_{world}_rank_{rank}.pt"


def _net():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(11, 6)
            self.proj = torch.nn.Linear(6, 7)
            self.head = torch.nn.Linear(7, 2)
            self.register_buffer("scale", torch.tensor([0.5, 1.0, 2.0]))

        def forward(self, ids):
            return self.head(torch.relu(self.proj(self.embed(ids) * self.scale.sum())))

    return Net()


def _train(model, rank):
    import torch

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 11, (4, 3), generator=torch.Generator().manual_seed(rank))
    model(ids).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def _flatten(tree, prefix=""):
    """{dotted key: tensor} of a nested state dict, as ckptfs flattens it."""
    import torch

    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}{i}."))
    elif isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tree
    return out


def _save_tensors(tensors: dict, path: Path):
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(path))


def _full(value):
    """The full tensor of a DTensor (a collective: every rank calls it), else the value."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _gathered(value, rank: int):
    """The full tensor of a ShardedTensor, gathered to rank 0 by torch (a collective), else the
    value."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(value, ShardedTensor):
        return value
    out = torch.empty(value.size(), dtype=value.dtype) if rank == 0 else None
    value.gather(0, out)
    return out


def _local_shards(tensors: dict) -> dict:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    out = {}
    for key, value in tensors.items():
        if isinstance(value, DTensor):
            out[f"{key}.local_shards.0"] = value.to_local()
        elif isinstance(value, ShardedTensor):
            for i, shard in enumerate(value.local_shards()):
                out[f"{key}.local_shards.{i}"] = shard.tensor
    return out


def _write(out: Path, name: str, rank: int, world: int, model_sd, optim_sd, full_model: dict, full_optim: dict):
    import torch

    case = out / name
    for sub in ("model", "local") + (("optim",) if optim_sd is not None else ()):
        (case / sub).mkdir(parents=True, exist_ok=True)
    torch.save(model_sd, case / "model" / MODEL_GROUP.format(world=world, rank=rank))
    if optim_sd is not None:
        torch.save(optim_sd, case / "optim" / OPTIM_GROUP.format(world=world, rank=rank))
    local = _local_shards(_flatten(model_sd))
    if optim_sd is not None:
        local.update(_local_shards(_flatten(optim_sd)))
    _save_tensors(local, case / "local" / f"rank{rank}.safetensors")
    if rank == 0:
        _save_tensors(full_model, case / "model.reference.safetensors")
        if full_optim:
            _save_tensors(full_optim, case / "optim.reference.safetensors")


def case_fsdp2(out: Path, name: str, rank: int, world: int, mesh_shape=None):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    model = _net()
    if mesh_shape:
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard(model, mesh=init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")))
    else:
        fully_shard(model)
    _train_and_write_dtensors(out, name, rank, world, model)


def _train_and_write_dtensors(out: Path, name: str, rank: int, world: int, model):
    """Trains MODEL (whose parameters are DTensors), then writes its model and optimizer state
    dicts and their full tensors (full_tensor())."""
    optimizer = _train(model, rank)
    model_sd = model.state_dict()
    optim_sd = optimizer.state_dict()
    full_model = {k: _full(v) for k, v in _flatten(model_sd).items()}
    full_optim = {k: _full(v) for k, v in _flatten(optim_sd).items()}
    _write(out, name, rank, world, model_sd, optim_sd, full_model, full_optim)


def case_fsdp1(out: Path, name: str, rank: int, world: int):
    import torch
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    torch.manual_seed(7)
    model = FSDP(_net(), use_orig_params=True, device_id=torch.device("cpu"))
    optimizer = _train(model, rank)
    FSDP.set_state_dict_type(
        model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
    )
    model_sd = model.state_dict()
    optim_sd = FSDP.optim_state_dict(model, optimizer)
    FSDP.set_state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=False),
        FullOptimStateDictConfig(rank0_only=False),
    )
    full_model = _flatten(model.state_dict())
    # LOCAL_STATE_DICT: the flat parameter as a 1-D ShardedTensor, each original parameter a
    # plain view of its storage.
    FSDP.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT)
    local_sd = model.state_dict()
    for sub in ("local_state_dict", "local"):
        (out / name / sub).mkdir(parents=True, exist_ok=True)
    torch.save(local_sd, out / name / "local_state_dict" / MODEL_GROUP.format(world=world, rank=rank))
    _save_tensors(_local_shards(_flatten(local_sd)), out / name / "local" / f"rank{rank}.flat.safetensors")
    # The optimizer's full tensors as ShardedTensor.gather() assembles them (FSDP1's
    # FULL_STATE_DICT optimizer state on the CPU gives exp_avg the values of exp_avg_sq).
    full_optim = {k: _gathered(v, rank) for k, v in _flatten(optim_sd).items()}
    _write(out, name, rank, world, model_sd, optim_sd, full_model, full_optim)


def case_tp(out: Path, name: str, rank: int, world: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(7)
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(_net(), mesh, {"proj": ColwiseParallel(use_local_output=False), "head": RowwiseParallel()})
    _train_and_write_dtensors(out, name, rank, world, model)


def case_placement(out: Path, name: str, rank: int, world: int):
    """A DTensor whose shards are not blocks of one full tensor: Partial (each rank holds a
    summand) or _StridedShard (interleaved pieces)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,))
    local = torch.arange(12, dtype=torch.float32).reshape(6, 2) + 100 * rank
    if name.startswith("partial"):
        value = DTensor.from_local(local, mesh, [Partial()])
    else:
        value = DTensor.from_local(
            local, mesh, [_StridedShard(0, split_factor=2)], shape=torch.Size([6 * world, 2]), stride=(2, 1)
        )
    plain = DTensor.from_local(local[:3].contiguous(), mesh, [Shard(0)])
    sd = {"odd": value, "fine": plain}
    _write(out, name, rank, world, sd, None, {"fine": plain.full_tensor()}, {})


def run_case(out: Path, name: str, rank: int):
    world = CASES[name]
    if name.startswith("fsdp2"):
        case_fsdp2(out, name, rank, world)
    elif name.startswith("hsdp"):
        case_fsdp2(out, name, rank, world, mesh_shape=(world, 1))
    elif name.startswith("fsdp1"):
        case_fsdp1(out, name, rank, world)
    elif name.startswith("tp"):
        case_tp(out, name, rank, world)
    else:
        case_placement(out, name, rank, world)


def _rank_main(rank: int, world_size: int, names: list, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for name in names:
        started = time.monotonic()
        run_case(Path(out), name, rank)
        dist.barrier()
        if rank == 0:
            print(f"  {name}: saved in {time.monotonic() - started:.1f}s", flush=True)
    dist.destroy_process_group()


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed.fsdp  # noqa: F401  (imported once, before the ranks fork)
    import torch.distributed.tensor.parallel  # noqa: F401

    by_world = {}
    for name, world in CASES.items():
        by_world.setdefault(world, []).append(name)
    run_ranks_per_world_size(_rank_main, by_world, out)
    info = {"cases": {name: {"world_size": world} for name, world in CASES.items()}, "torch": torch.__version__}
    (out / "cases.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    main()
