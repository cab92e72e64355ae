#!/usr/bin/env python3
"""Megatron distributed-optimizer checkpoints as megatron-core before 0.14 writes them
(tests/requirements-megatron.txt: megatron-core 0.13.1), for tests/frameworks.

    python make_megatron_fragments.py OUT        (run by the overlay's python)

megatron-core's DistributedOptimizer keeps its buffers on CUDA in this version, so it cannot
run on a CPU machine. The state dict is built the way its `sharded_state_dict()`
(`sharded_param_state_fs_model_space`, the default `fully_sharded_model_space`) builds it,
with megatron-core's own classes: each model parameter is a `ShardedTensor.from_rank_offsets`
(layers stacked on a prepended axis, tensor-parallel splits along dim 0 and dim 1, TP
replicas), and each optimizer state (`fp32_param`, `exp_avg`, `exp_avg_sq`) is that
ShardedTensor `replace`d with the rank's 1-D fragment of the parameter and its
`flattened_range`, as the optimizer does. Which fragment a data-parallel rank holds follows
the optimizer's buffer (megatron-core's param_and_grad_buffer): every parameter of the rank's
model in reverse module order, each starting at a multiple of 64 elements, the end padded to
a multiple of lcm(DP, 128), the buffer cut into DP equal parts (cutting parameters mid-row). Then megatron-core's
`dist_checkpointing.save` (torch_dist backend: DCP underneath) writes it on CPU with gloo
ranks (tests/ckptfs_ranks.py), and `dist_checkpointing.load_plain_tensors` (megatron-core's
own load, with its reformulation restore) reads it back in a single-rank group.

    OUT/<case>/run/latest_checkpointed_iteration.txt   "10", as Megatron-LM's training writes it
    OUT/<case>/run/iter_0000010/                      what dist_checkpointing.save wrote
    OUT/<case>/reference.safetensors                  load_plain_tensors, each tensor viewed
                                                      with the real shape (the original
                                                      parameter's, checked equal to it)
    OUT/<case>/fixture.json                           the real shape of every tensor, the
                                                      DCP shapes and chunks, mcore_data, versions
    OUT/variants/<name>/                              a copy of a case's step folder whose
                                                      .metadata has one mcore_data record
                                                      changed (VARIANTS), for the refusals
                                                      (the pickle names megatron-core's
                                                      classes: only its environment rewrites it)
"""

import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for ckptfs_ranks
from ckptfs_ranks import free_port, run_ranks_per_world_size  # noqa: E402

ITERATION = 10
STEP_DIR = f"iter_{ITERATION:07d}"
LAYERS = 2
# With the buffer's alignment rules below, these sizes make the DP cut fall mid-row of a
# linear_proj weight in both cases (20x20 at TP 1; a 20x10 column-split chunk at TP 2).
HIDDEN = 20
VOCAB = 24
# case -> (tensor-parallel size, data-parallel size); world size = TP x DP, TP fastest.
CASES = {
    # No TP: every moment a reformulated [1, ..., numel] tensor, DP cutting a square weight
    # mid-row.
    "dp2": (1, 2),
    # TP splits along dim 0 (column-parallel) and dim 1 (row-parallel: chunks not contiguous
    # in the full tensor), TP-replicated layer norms, DP fragments of each TP chunk.
    "tp2_dp2": (2, 2),
}
# name -> (number of stacked layers or None for a non-layer parameter, per-layer shape, TP
# split axis or None)
PARAMS = {
    "embedding.word_embeddings.weight": (None, (VOCAB, HIDDEN), 0),
    "decoder.layers.input_layernorm.weight": (LAYERS, (HIDDEN,), None),
    "decoder.layers.self_attention.linear_qkv.weight": (LAYERS, (3 * HIDDEN, HIDDEN), 0),
    "decoder.layers.self_attention.linear_proj.weight": (LAYERS, (HIDDEN, HIDDEN), 1),
    "decoder.layers.self_attention.linear_proj.bias": (LAYERS, (HIDDEN,), None),
    "decoder.final_layernorm.weight": (None, (HIDDEN,), None),
}
STATES = ("fp32_param", "exp_avg", "exp_avg_sq")
VARIANT_KEY = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_proj.weight"
# name -> (case, the new mcore_data record of VARIANT_KEY)
VARIANTS = {
    # 21 columns cannot be split into the 2 equal chunks the reformulated shape says.
    "shape_not_split_evenly": ("tp2_dp2", {"nd_reformulated_orig_global_shape": (2, 20, 21)}),
    # A chunk of this shape holds half the elements the reformulated shape gives.
    "chunk_size_disagrees": ("dp2", {"nd_reformulated_orig_global_shape": (2, 20, 10)}),
    # A record of a layout nobody knows yet.
    "unknown_record": ("dp2", {"nd_reformulated_orig_global_shape": (2, 20, 20), "some_future_layout": True}),
}


def full_tensor(name, kind):
    """The whole (all layers, all TP ranks) tensor NAME holds for KIND ("param" or a state)."""
    import torch

    layers, shape, _ = PARAMS[name]
    g = torch.Generator().manual_seed(hash_name(f"{kind}/{name}"))
    full = torch.randn(((layers,) if layers else ()) + shape, generator=g, dtype=torch.float32)
    if kind == "exp_avg_sq":
        full = full.abs()
    return full


def hash_name(s):
    import zlib

    return zlib.crc32(s.encode())


def local_params(tp, tp_rank):
    """[(name, layer or None, local fp32 tensor, rank_offsets, prepend, replica tp coord)] of one
    TP rank's model, in module order (the embedding, each layer's parameters, the final norm)."""
    stacked = [name for name, (layers, _, _) in PARAMS.items() if layers]
    order = [("embedding.word_embeddings.weight", None)]
    order += [(name, layer) for layer in range(LAYERS) for name in stacked]
    order += [("decoder.final_layernorm.weight", None)]
    out = []
    for name, layer in order:
        layers, shape, axis = PARAMS[name]
        t = full_tensor(name, "fp32_param")
        offsets = []
        prepend = 0
        if layer is not None:
            t = t[layer]
            offsets.append((0, layer, layers))
            prepend = 1
        if axis is not None and tp > 1:
            t = t.chunk(tp, dim=axis)[tp_rank]
            offsets.append((prepend + axis, tp_rank, tp))
            replica_tp = 0
        else:
            replica_tp = tp_rank  # replicated over TP: rank 0's copy is the main one
        out.append((name, layer, t.contiguous(), tuple(offsets), prepend, replica_tp))
    return out


def pad(n, multiple):
    return -(-n // multiple) * multiple


def sharded_state_dict(tp, dp, rank):
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    tp_rank, dp_rank = rank % tp, rank // tp
    params = local_params(tp, tp_rank)
    model, param_state = {}, {}
    # The optimizer's buffer: parameters in reverse order, aligned, padded to DP equal parts.
    order = list(reversed(params))
    starts, end = [], 0
    for p in order:
        starts.append(pad(end, 64))
        end = starts[-1] + p[2].numel()
    part = pad(end, math.lcm(dp, 128)) // dp
    lo, hi = dp_rank * part, (dp_rank + 1) * part
    for (name, layer, fp32, offsets, prepend, replica_tp), start in zip(order, starts):
        model_key = name if layer is None else f"{name}.{layer}"
        sh = ShardedTensor.from_rank_offsets(
            name, fp32.to(torch.bfloat16), *offsets, replica_id=(0, replica_tp, dp_rank), prepend_axis_num=prepend
        )
        model[model_key] = sh
        a, b = max(start, lo), min(start + fp32.numel(), hi)
        if a < b:
            item = slice(a - start, b - start)
            states = {}
            for state in STATES:
                full = full_tensor(name, state)
                t = full[layer] if layer is not None else full
                _, _, axis = PARAMS[name]
                if axis is not None and tp > 1:
                    t = t.chunk(tp, dim=axis)[tp_rank]
                fragment = t.contiguous().flatten()[item].clone()
                # What DistributedOptimizer.sharded_param_state_fs_model_space does.
                st = replace(sh, key=f"optimizer.state.{state}.{name}", data=fragment, dtype=fragment.dtype,
                             flattened_range=item, replica_id=(0, replica_tp, 0))
                st.validate_metadata_integrity()
                states[state] = st
            param_state[model_key] = states
    return {
        "model": model,
        "optimizer": {
            "param_state": param_state,
            "param_state_sharding_type": "fully_sharded_model_space",
            "optimizer": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "step": ITERATION}]},
        },
        "iteration": ITERATION,
        "checkpoint_version": 3.0,
    }


def cpu_only(torch):
    """megatron-core 0.13's torch_dist writer assumes a GPU in two places that write nothing:
    it waits for device-to-host copies (torch.cuda.synchronize(); with every tensor on the CPU
    there is nothing to wait for), and it all-reduces a "writer still alive" flag placed on
    torch.cuda.current_device() (with gloo, that flag lives on the CPU)."""
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"


def rank_main(rank, world_size, names, out):
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    cpu_only(torch)

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for case in names:
        tp, dp = CASES[case]
        step = Path(out) / case / "run" / STEP_DIR
        if rank == 0:
            step.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(sharded_state_dict(tp, dp, rank), str(step))
        dist.barrier()
        if rank == 0:
            (step.parent / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.destroy_process_group()


def reference(case_dir):
    """megatron-core's own load of every tensor whole, in a single-rank gloo group: the request
    `load_tensors_metadata` builds (a flattened tensor asked for as one fragment covering the
    whole parameter, whose real shape comes from mcore_data), passed to
    `dist_checkpointing.load`, which restores the reformulated fragments itself.
    (`load_plain_tensors` does the same but fails on torch 2.15's TensorProperties, which
    gained a `strides` field that megatron-core 0.13 passes on to torch.empty.)"""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader

    step = case_dir / "run" / STEP_DIR
    meta = FileSystemReader(str(step)).read_metadata()
    mcore_data = getattr(meta, "mcore_data", {})
    request = {}
    for key, tp in meta.state_dict_metadata.items():
        if not hasattr(tp, "chunks"):
            continue  # an object
        real = mcore_data.get(key, {}).get("nd_reformulated_orig_global_shape")
        if real is None:
            request[key] = ShardedTensor.from_rank_offsets(key, torch.empty(tp.size, dtype=tp.properties.dtype))
        else:
            numel = int(torch.Size(real).numel())
            request[key] = ShardedTensor.from_rank_offsets_flat(
                key, torch.empty(numel, dtype=tp.properties.dtype), tuple(real), flattened_range=slice(0, numel))
    loaded = dist_checkpointing.load(request, str(step), validate_access_integrity=False)
    shapes, dcp_shapes, chunks, tensors = {}, {}, {}, {}
    for key in sorted(request):
        value = loaded[key]
        name = key.split(".", 3)[3] if key.startswith("optimizer.state.") else key
        kind = key.split(".")[2] if key.startswith("optimizer.state.") else "param"
        # The model's bf16 parameters are its fp32 master weights rounded.
        want = full_tensor(name, kind) if kind != "param" else full_tensor(name, "fp32_param").to(torch.bfloat16)
        real = value.reshape(want.shape)  # a flattened tensor comes back 1-D, whole
        expect = want
        assert torch.equal(real, expect), f"{case_dir.name}: megatron-core loads {key} differently from what was saved"
        tensors[key] = real.contiguous()
        shapes[key] = list(real.shape)
        dcp_shapes[key] = list(meta.state_dict_metadata[key].size)
        chunks[key] = [[list(c.offsets), list(c.sizes)] for c in meta.state_dict_metadata[key].chunks]
    save_file(tensors, str(case_dir / "reference.safetensors"))
    mcore = {k: {kk: list(vv) if isinstance(vv, tuple) else vv for kk, vv in v.items()}
             for k, v in getattr(meta, "mcore_data", {}).items()}
    return shapes, dcp_shapes, chunks, mcore


def write_variant(out, name):
    """OUT/variants/NAME: the case's step folder with VARIANT_KEY's mcore_data record replaced."""
    import pickle
    import shutil

    case, record = VARIANTS[name]
    step = out / "variants" / name
    shutil.copytree(out / case / "run" / STEP_DIR, step)
    with open(step / ".metadata", "rb") as f:
        meta = pickle.load(f)
    meta.mcore_data[VARIANT_KEY] = dict(record)
    with open(step / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def main():
    out = Path(sys.argv[1])
    import importlib.metadata as md

    import torch
    import torch.distributed as dist

    by_world = {}
    for case, (tp, dp) in CASES.items():
        by_world.setdefault(tp * dp, []).append(case)
    run_ranks_per_world_size(rank_main, by_world, out)

    cpu_only(torch)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    for case, (tp, dp) in CASES.items():
        shapes, dcp_shapes, chunks, mcore = reference(out / case)
        (out / case / "fixture.json").write_text(json.dumps({
            "tp": tp, "dp": dp, "step_dir": STEP_DIR, "iteration": ITERATION,
            "shapes": shapes, "dcp_shapes": dcp_shapes, "dcp_chunks": chunks, "mcore_data": mcore,
            "versions": {"megatron-core": md.version("megatron-core"), "torch": torch.__version__},
        }, indent=1))
        print(f"{case}: {len(shapes)} tensors", flush=True)
    dist.destroy_process_group()
    for name in VARIANTS:
        write_variant(out, name)


if __name__ == "__main__":
    main()
