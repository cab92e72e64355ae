#!/usr/bin/env python3
"""veRL actor checkpoints as veRL 0.9.1 writes them, for tests/frameworks/test_verl.py.

    python make_verl_checkpoints.py OUT        (in the overlay of scripts/setup-venv.sh verl)

Each case wraps a tiny Qwen2 causal LM the way veRL's FSDP engine does
(verl/workers/engine/fsdp/transformer_impl.py: FSDP1 with veRL's wrap policy and the device
mesh, or FSDP2 through veRL's own apply_fsdp2 and fsdp2_load_full_state_dict), trains it with
AdamW on the CPU with gloo, and saves it twice with veRL's own, unmodified
FSDPCheckpointManager into a run folder laid out as veRL's trainer lays it out
(global_step_N/actor/, latest_checkpointed_iteration.txt naming the last step; the trainer's
own lines that write the tracker file and data.pt are repeated here, as the trainer needs a
ray cluster). Then the parent, with no process group, runs veRL's own FSDPModelMerger on the
last step, where it can.

    OUT/<case>/run/                           the run folder
    OUT/<case>/run/global_step_{1,2}/actor/   what FSDPCheckpointManager.save_checkpoint wrote
    OUT/<case>/reference/state_dict.safetensors  the unsharded model's state_dict at step 2
                                                 (veRL's get_fsdp_full_state_dict), fp32
    OUT/<case>/reference/step1.safetensors       the same at step 1
    OUT/<case>/reference/optimizer.safetensors   FSDP2: every AdamW state tensor, full
                                                 (full_tensor()), keyed
                                                 optimizer.state.<parameter name>.<entry>
    OUT/<case>/reference/logits.safetensors      input_ids and the trained model's logits
                                                 (eager attention, fp32)
    OUT/<case>/merged/                           veRL's model merger output (bf16), where it ran
    OUT/cases.json                               cases, what each holds, merger results, versions

Module-level names are importable without torch or veRL (the suite takes CASES from here).
Dimensions: neither 2 nor 3 divides the vocabulary (101 rows) and 3 does not divide most
others, so dim-0 shards are uneven and a rank can hold an empty one (FSDP's torch.chunk rule).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for ckptfs_ranks
from ckptfs_ranks import run_ranks_per_world_size  # noqa: E402

# case -> (world size, FSDP version, how it differs)
CASES = {
    "fsdp2_ws2": (2, 2, {}),
    "fsdp2_ws3": (3, 2, {"buffer": True}),
    "fsdp2_tied_ws3": (3, 2, {"tied": True}),
    "fsdp1_ws2": (2, 1, {}),
    "fsdp1_ws3": (3, 1, {"buffer": True}),
    # FSDP1 without a device mesh: SHARDED_STATE_DICT gives ShardedTensors instead of DTensors
    # (veRL's engine passes its mesh; older veRL releases and hand-built FSDP1 wrappers do not).
    "fsdp1_sharded_tensor_ws3": (3, 1, {"no_mesh": True}),
}
STEPS = (1, 2)  # a save after each
MODEL_CONFIG = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=70,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
# A persistent buffer, registered on the model's root where a case asks for one: FSDP leaves
# buffers unsharded, so every rank file holds a full copy.
BUFFER_NAME = "score_scale"
SEQ = 12


def build_model(options):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**MODEL_CONFIG, "tie_word_embeddings": bool(options.get("tied"))})
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    if options.get("buffer"):
        model.register_buffer(BUFFER_NAME, torch.linspace(0.5, 2.0, 7), persistent=True)
    return model


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(MODEL_CONFIG["vocab_size"] - 1)}
    vocab["<unk>"] = MODEL_CONFIG["vocab_size"] - 1
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", pad_token="<unk>")


def input_ids(batch, seed):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL_CONFIG["vocab_size"], (batch, SEQ), generator=generator)


def wrap(model, version, world_size, options):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from verl.utils.fsdp_utils import apply_fsdp2, get_fsdp_wrap_policy

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    if version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        fsdp_kwargs = {
            "mesh": mesh,
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                              cast_forward_inputs=True),
            "offload_policy": None,
            "reshard_after_forward": True,
        }
        # veRL then broadcasts rank 0's weights with fsdp2_load_full_state_dict, which moves the
        # model to the accelerator (0.9.1 has no CPU platform); every rank here built the same
        # weights from one seed, which is what that broadcast leaves.
        apply_fsdp2(model, fsdp_kwargs, {})
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, ShardedStateDictConfig, StateDictType

    wrapped = FSDP(
        model,
        auto_wrap_policy=get_fsdp_wrap_policy(module=model, config={}, is_lora=False),
        # veRL passes get_device_id(), the accelerator; FSDP1 runs on the CPU when told so.
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.float32),
        device_mesh=None if options.get("no_mesh") else mesh,
        use_orig_params=False,
    )
    # As veRL's engine does for world sizes above 1.
    FSDP.set_state_dict_type(wrapped, state_dict_type=StateDictType.SHARDED_STATE_DICT,
                             state_dict_config=ShardedStateDictConfig())
    return wrapped


def train_step(model, optimizer, scheduler, rank, step):
    ids = input_ids(2, 1000 * step + rank)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def optimizer_reference(model, optimizer):
    """Every optimizer state tensor in full, keyed by parameter name (collective)."""
    import torch
    from torch.distributed.tensor import DTensor

    names = {id(p): n for n, p in model.named_parameters()}
    ids = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    out = {}
    for index, entries in optimizer.state_dict()["state"].items():
        for entry, value in entries.items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if isinstance(value, torch.Tensor):
                out[f"optimizer.state.{ids[index]}.{entry}"] = value.detach().clone().contiguous()
    return out


def state_reference(model):
    from verl.utils.fsdp_utils import get_fsdp_full_state_dict

    full = get_fsdp_full_state_dict(model, offload_to_cpu=True, rank0_only=True)
    return {k: v.detach().clone().contiguous() for k, v in full.items()}


def rank_main(rank, world_size, names, out):
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.torch_functional import get_constant_schedule_with_warmup

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for name in names:
        _, version, options = CASES[name]
        case = Path(out) / name
        run = case / "run"
        reference = case / "reference"
        if rank == 0:
            reference.mkdir(parents=True, exist_ok=True)
        model = wrap(build_model(options), version, world_size, options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=1)
        manager = FSDPCheckpointManager(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            processing_class=build_tokenizer(),
            checkpoint_config=OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                                                "load_contents": ["model", "optimizer", "extra"]}),
        )
        for step in STEPS:
            model.train()
            train_step(model, optimizer, scheduler, rank, step)
            step_folder = run / f"global_step_{step}"
            manager.save_checkpoint(str(step_folder / "actor"), global_step=step, max_ckpt_to_keep=None)
            full = state_reference(model)
            if rank == 0:
                # The trainer's own lines after the workers saved (verl/trainer/ppo/ray_trainer.py).
                torch.save({"_num_yielded": step, "_sampler_iter_yielded": step}, step_folder / "data.pt")
                with open(run / "latest_checkpointed_iteration.txt", "w") as f:
                    f.write(str(step))
                name_of = "state_dict" if step == STEPS[-1] else f"step{step}"
                save_file(full, reference / f"{name_of}.safetensors")
            dist.barrier()
        if version == 2:
            optim = optimizer_reference(model, optimizer)
            if rank == 0:
                save_file(optim, reference / "optimizer.safetensors")
        if rank == 0:
            save_logits(options, full, reference)
        dist.barrier()
        del manager, optimizer, model
    dist.destroy_process_group()


def save_logits(options, full_state, reference):
    import torch
    from safetensors.torch import save_file

    model = build_model(options)
    missing, unexpected = model.load_state_dict(full_state, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    model.eval()
    ids = input_ids(3, 7)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    save_file({"input_ids": ids.contiguous(), "logits": logits.contiguous()}, reference / "logits.safetensors")


def run_merger(case: Path) -> str | None:
    """veRL's FSDPModelMerger on the last step; None when it succeeded, else why not."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    actor = case / "run" / f"global_step_{STEPS[-1]}" / "actor"
    config = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=str(actor),
        target_dir=str(case / "merged"),
        hf_model_config_path=str(actor / "huggingface"),
    )
    try:
        FSDPModelMerger(config).merge_and_save()
    except Exception as error:  # recorded, and the suite checks it is the expected refusal
        return f"{type(error).__name__}: {error}"
    return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    import torch  # noqa: F401  (imported once, before the ranks fork)
    import transformers
    import verl
    import verl.utils.checkpoint.fsdp_checkpoint_manager  # noqa: F401

    by_world_size = {}
    for name, (world_size, _, _) in CASES.items():
        by_world_size.setdefault(world_size, []).append(name)
    run_ranks_per_world_size(rank_main, by_world_size, out)

    merger = {}
    for name in CASES:
        merger[name] = run_merger(out / name)
        print(f"{name}: merger {'ok' if merger[name] is None else merger[name]}", flush=True)
    (out / "cases.json").write_text(json.dumps({
        "cases": {name: {"world_size": ws, "fsdp_version": v, **opts} for name, (ws, v, opts) in CASES.items()},
        "steps": list(STEPS),
        "merger_error": merger,
        "buffer_name": BUFFER_NAME,
        "versions": {"verl": verl.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }, indent=1))
    print(f"generated in {time.monotonic() - started:.1f}s", flush=True)


if __name__ == "__main__":
    main()
