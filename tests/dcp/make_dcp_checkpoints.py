#!/usr/bin/env python3
"""Real torch.distributed.checkpoint (DCP) saves for tests/dcp, written by torch itself.

    python make_dcp_checkpoints.py OUT [--only NAME,...]

torch.distributed runs on the CPU with the gloo backend. The parent imports torch and
transformers once, then forks one process per rank; every case of one world size is built,
trained one step and saved by the same set of ranks, one after the other. Then the parent (no
process group) runs torch's own, unmodified
torch.distributed.checkpoint.format_utils.dcp_to_torch_save() on every save, so nothing in the
pytest process ever trains or forks:

    OUT/<case>/                   the DCP checkpoint dir: .metadata, __<rank>_0.distcp
    OUT/<case>.reference.pt       dcp_to_torch_save(OUT/<case>) (the nested state dict)
    OUT/<case>.torch_save/        for the safetensors-form cases (st_*) and the Hugging Face
                                  writer's (hf_*): the same state saved by the default
                                  writer, whose dcp_to_torch_save is <case>.reference.pt
    OUT/hf_<case>/sharded/        HuggingFaceStorageWriter(save_distributed=True,
                                  enable_consolidation=True): each rank's shard file, and
    OUT/hf_<case>/model-*.safetensors  torch's own consolidation of them
    OUT/llama_fsdp2_ws2_config/   config.json of the Llama case (save_pretrained)
    OUT/cases.json                {"generated": [...], "skipped": {case: reason}, versions}

Module-level names are importable without torch (the suite takes CASES from here).

The models have dimensions that neither 3 nor 4 divide, and some with fewer rows than ranks,
so FSDP2's dim-0 shards are uneven and some ranks hold empty ones.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for ckptfs_ranks
from ckptfs_ranks import run_ranks_per_world_size  # noqa: E402

# case name -> world size
CASES = {
    "plain_ws1": 1,
    "fsdp2_ws2": 2,
    "tp_ws2": 2,
    "bf16_params_fp32_optim": 2,
    "tied_ws2": 2,
    "llama_fsdp2_ws2": 2,
    "fsdp2_ws3": 3,
    "fsdp2_ws4": 4,
    "fsdp_tp_2d_ws4": 4,
    # DCP's safetensors serialization (FileSystemWriter(serialization_format=SAFETENSORS)):
    # each .distcp holds the pickled objects, then one safetensors blob of the rank's chunks.
    # torch cannot read these back itself (its FileSystemReader torch.load()s every tensor
    # slice), so each is also saved in torch_save form from the same state (TWIN_SUFFIX), and
    # its reference is dcp_to_torch_save of that twin.
    "st_fsdp2_ws2": 2,
    "st_tp_ws2": 2,
    "st_fsdp_tp_2d_ws4": 4,
}
# torch's Hugging Face storage writer, sharded: per-rank shard-*.safetensors files whose
# headers carry each chunk's offsets, no .metadata; torch consolidates them itself beside the
# sharded/ folder. Model state only (the writer appends pickled non-tensor values to the
# .safetensors file, which then is no safetensors file). Served from <case>/sharded.
HF_CASES = {
    "hf_fsdp2_ws3": 3,
    "hf_tp_ws2": 2,
}
SAFETENSORS_FORM_CASES = {"st_fsdp2_ws2", "st_tp_ws2", "st_fsdp_tp_2d_ws4"}
TWIN_SUFFIX = ".torch_save"
HF_SHARDED_DIR = "sharded"
ALL_CASES = {**CASES, **HF_CASES}
LLAMA_CASE = "llama_fsdp2_ws2"
LLAMA_CONFIG_DIR = f"{LLAMA_CASE}_config"
LLAMA_CONFIG = dict(
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)
REFERENCE_SUFFIX = ".reference.pt"

IN_DIM = 13
HIDDEN = 22  # FSDP2 dim-0 shards: ws2 11/11, ws3 8/8/6, ws4 6/6/6/4
OUT_DIM = 5  # ws4: 2/2/1/0 (an empty shard on the last rank)
# TP shards of 11 and 11: a Rowwise forward over uneven column shards fails in this torch
# (DTensor addmm "must have same reduction dim" after its padding); 22 still is not a multiple
# of 4, and FSDP2 over it (2-D case) shards unevenly anyway.
TP_HIDDEN = 22
VOCAB = 19


def _mlp():
    import torch.nn as nn

    # A bias of one element: every rank but the first holds an empty shard of it.
    return nn.Sequential(
        nn.Linear(IN_DIM, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, OUT_DIM),
        nn.ReLU(),
        nn.Linear(OUT_DIM, 1),
    )


def _train_step(model, optimizer, inputs, loss_fn=None):
    out = model(inputs)
    loss = loss_fn(out) if loss_fn else out.float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _save_model_and_optim(model, optimizer, path: Path, model_transform=None):
    """dcp.save of {"model": ..., "optim": ...} into PATH, in the form its case name says
    (st_*: the safetensors serialization, hf_*: the Hugging Face writer), with the default
    form's twin beside the other two."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    if model_transform is not None:
        model_sd = {k: model_transform(v) for k, v in model_sd.items()}
    state = {"model": model_sd, "optim": optim_sd}
    name = Path(path).name
    if name in SAFETENSORS_FORM_CASES:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        dcp.save(state, storage_writer=FileSystemWriter(str(path), serialization_format=SerializationFormat.SAFETENSORS))
        path = Path(f"{path}{TWIN_SUFFIX}")
    elif name in HF_CASES:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

        writer = HuggingFaceStorageWriter(str(path), save_distributed=True, enable_consolidation=True)
        dcp.save(model_sd, storage_writer=writer)
        path = Path(f"{path}{TWIN_SUFFIX}")
    dcp.save(state, checkpoint_id=str(path))


def case_plain_ws1(out: Path, rank: int):
    """A nested state dict saved with dcp.save directly: model weights, an optimizer-like
    part with int keys and lists, non-tensor leaves of every simple kind, and a non-contiguous
    view (DCP stores a compact copy of it)."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(7)
    wide = torch.randn(6, 10, generator=g)
    state = {
        "model": {
            "embed.weight": torch.randn(VOCAB, 7, generator=g),
            "proj.weight": torch.randn(5, 7, generator=g, dtype=torch.float64),
            "proj.bias": torch.randn(5, generator=g).to(torch.float16),
            "norm.scale": torch.randn(7, generator=g).to(torch.bfloat16),
            "counts": torch.randint(-1000, 1000, (3, 4), generator=g, dtype=torch.int64),
            "mask": torch.rand(9, generator=g) > 0.5,
            "scalar": torch.tensor(3.25),
            "transposed_view": wide.t()[:, 1:5],  # strided, not contiguous
        },
        "optim": {
            "state": {
                0: {"step": torch.tensor(4.0), "exp_avg": torch.randn(VOCAB, 7, generator=g)},
                1: {"step": torch.tensor(4.0), "exp_avg": torch.randn(5, 7, generator=g)},
            },
            "param_groups": [
                {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "params": [0, 1]},
                {"lr": 2.5e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1, "params": [2]},
            ],
        },
        "buffers": [torch.arange(5, dtype=torch.int32), torch.ones(2, 3)],
        "epoch": 3,
        "global_step": 1234567890123,
        "loss": 0.125,
        "run_name": "dcp plain",
        "flags": [1, 2, 3],
        "tags": ["a", "b"],
        "nested": {"depth": {"value": -7, "ratio": 1.5}},
    }
    assert not state["model"]["transposed_view"].is_contiguous()
    dcp.save(state, checkpoint_id=str(out / "plain_ws1"))


def case_fsdp2(name: str):
    def run(out: Path, rank: int):
        import torch
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(11)
        model = _mlp()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        inputs = torch.randn(4, IN_DIM, generator=torch.Generator().manual_seed(rank))
        _train_step(model, optimizer, inputs)
        _save_model_and_optim(model, optimizer, out / name)

    return run


def _tp_model():
    import torch.nn as nn

    return nn.Sequential(nn.Linear(IN_DIM, TP_HIDDEN), nn.ReLU(), nn.Linear(TP_HIDDEN, 9))


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # Colwise: weight Shard(0), bias Shard(0); Rowwise: weight Shard(1), bias replicated.
    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def case_tp(name: str):
    return lambda out, rank: case_tp_ws2(out, rank, name)


def case_tp_ws2(out: Path, rank: int, name: str = "tp_ws2"):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(12)
    model = parallelize_module(_tp_model(), mesh, _tp_plan())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    inputs = torch.randn(4, IN_DIM, generator=torch.Generator().manual_seed(0))  # TP: same input
    _train_step(model, optimizer, inputs)
    _save_model_and_optim(model, optimizer, out / name)


def case_fsdp_tp_2d_ws4(out: Path, rank: int, name: str = "fsdp_tp_2d_ws4"):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(13)
    model = parallelize_module(_tp_model(), mesh["tp"], _tp_plan())
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    dp_rank = mesh["dp"].get_local_rank()
    inputs = torch.randn(4, IN_DIM, generator=torch.Generator().manual_seed(dp_rank))
    _train_step(model, optimizer, inputs)
    _save_model_and_optim(model, optimizer, out / name)


def case_bf16_params_fp32_optim(out: Path, rank: int):
    """FSDP2 mixed precision: fp32 sharded master parameters and fp32 Adam moments, bf16
    compute; the model is saved in bf16 (the sharded DTensors cast), the optimizer in fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(14)
    model = _mlp()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    inputs = torch.randn(4, IN_DIM, generator=torch.Generator().manual_seed(rank))
    _train_step(model, optimizer, inputs)
    _save_model_and_optim(
        model, optimizer, out / "bf16_params_fp32_optim", model_transform=lambda t: t.to(torch.bfloat16)
    )


class _TiedLM:
    @staticmethod
    def build():
        import torch.nn as nn

        class TiedLM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(VOCAB, 6)
                self.hidden = nn.Linear(6, 6)
                self.lm_head = nn.Linear(6, VOCAB, bias=False)
                self.lm_head.weight = self.embed.weight  # one Parameter under two names

            def forward(self, ids):
                return self.lm_head(self.hidden(self.embed(ids)).relu())

        return TiedLM()


def case_tied_ws2(out: Path, rank: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(15)
    model = _TiedLM.build()
    fully_shard(model)
    assert model.lm_head.weight is model.embed.weight
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(rank))
    _train_step(
        model,
        optimizer,
        ids,
        loss_fn=lambda logits: torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1)),
    )
    _save_model_and_optim(model, optimizer, out / "tied_ws2")


def case_llama_fsdp2_ws2(out: Path, rank: int):
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(16)
    config = LlamaConfig(**LLAMA_CONFIG)
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    _save_model_and_optim(model, optimizer, out / LLAMA_CASE)
    if rank == 0:
        config.save_pretrained(out / LLAMA_CONFIG_DIR)


CASE_FUNCTIONS = {
    "plain_ws1": case_plain_ws1,
    "fsdp2_ws2": case_fsdp2("fsdp2_ws2"),
    "fsdp2_ws3": case_fsdp2("fsdp2_ws3"),
    "fsdp2_ws4": case_fsdp2("fsdp2_ws4"),
    "tp_ws2": case_tp_ws2,
    "fsdp_tp_2d_ws4": case_fsdp_tp_2d_ws4,
    "bf16_params_fp32_optim": case_bf16_params_fp32_optim,
    "tied_ws2": case_tied_ws2,
    LLAMA_CASE: case_llama_fsdp2_ws2,
    "st_fsdp2_ws2": case_fsdp2("st_fsdp2_ws2"),
    "st_tp_ws2": case_tp("st_tp_ws2"),
    "st_fsdp_tp_2d_ws4": lambda out, rank: case_fsdp_tp_2d_ws4(out, rank, "st_fsdp_tp_2d_ws4"),
    "hf_fsdp2_ws3": case_fsdp2("hf_fsdp2_ws3"),
    "hf_tp_ws2": case_tp("hf_tp_ws2"),
}
assert set(CASE_FUNCTIONS) == set(ALL_CASES)


def _rank_main(rank: int, world_size: int, names: list[str], out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for name in names:
        started = time.monotonic()
        CASE_FUNCTIONS[name](Path(out), rank)
        dist.barrier()
        if rank == 0:
            print(f"  {name}: saved in {time.monotonic() - started:.1f}s", flush=True)
    dist.destroy_process_group()


def _preimport() -> None:
    """Import what the ranks use once in the parent, so that each forked rank starts warm."""
    import torch
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.hf_storage  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])


def save_cases(out: Path, names: list[str]) -> None:
    _preimport()
    names_by_world_size = {}
    for name in names:
        names_by_world_size.setdefault(ALL_CASES[name], []).append(name)
    run_ranks_per_world_size(_rank_main, names_by_world_size, out)


def write_reference(out: Path, name: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = out / (f"{name}{TWIN_SUFFIX}" if name in SAFETENSORS_FORM_CASES or name in HF_CASES else name)
    dcp_to_torch_save(str(saved), str(out / f"{name}{REFERENCE_SUFFIX}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", help="comma-separated case names")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(ALL_CASES)
    unknown = set(names) - set(ALL_CASES)
    if unknown:
        sys.exit(f"unknown cases: {sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    save_cases(args.out, names)
    for name in names:
        write_reference(args.out, name)
    import torch
    import transformers

    info = {
        "generated": names,
        # Every case is possible on CPU/gloo with the torch of tests/requirements.txt; a case
        # that is not gets its name and the reason here, and the tests skip it saying so.
        "skipped": {},
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    (args.out / "cases.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"all cases in {time.monotonic() - started:.1f}s", flush=True)


if __name__ == "__main__":
    main()
