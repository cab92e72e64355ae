#!/usr/bin/env python3
"""DeepSpeed universal checkpoints for tests/zero, converted by DeepSpeed's own ds_to_universal
from the ZeRO saves of make_zero_checkpoints.py (taken from the fixture cache, not trained
again), and what DeepSpeed itself loads back from them.

    python make_universal_checkpoints.py OUT

    OUT/<name>/latest_universal            written by ds_to_universal (names the step folder)
    OUT/<name>/global_step2_universal/     its output: zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt,
                                           zero/optimizer_state.pt, the copied model-states files
    OUT/<name>/engine_load.safetensors     a fresh engine of one rank (same stage and precision)
                                           after load_checkpoint() with checkpoint.load_universal:
                                           every trainable parameter's fp32 master weight and Adam
                                           moments (exp_avg.<name>, exp_avg_sq.<name>)
    OUT/<name>/universal.json              the source ZeRO fixture, ds_to_universal's arguments,
                                           whether the engine loaded it

ds_to_universal runs in this process (its main() with one extract and one merge worker, as its
command line would with those flags), once per save. The saves carry no
universal_checkpoint_info (that is Megatron-DeepSpeed's client state), so --inject_missing_state
adds the empty one DeepSpeed defines. The "-vocab" case instead injects, into a copy of the
save's model-states file, the info a Megatron-style client records for a padded vocabulary
(vocabulary_parameter_patterns, original_vocab_size): ds_to_universal then cuts the padding
rows off embed.weight, and its fp32.pt holds a view whose storage is larger than the tensor.
"""

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS_DIR))  # ckptfs_ranks, ckptfs_fixture_cache
sys.path.insert(0, str(TESTS_DIR / "zero"))
from ckptfs_fixture_cache import ZERO_CHECKPOINTS, cached_fixtures  # noqa: E402
from ckptfs_ranks import run_ranks_per_world_size  # noqa: E402
from make_zero_checkpoints import (  # noqa: E402
    FIXTURES_BY_NAME,
    TAG,
    _build_model,
    _param_groups,
    _patch_deepspeed_for_cpu,
    _preimport,
)

STEP = f"{TAG}_universal"
ORIGINAL_VOCAB = 30  # of the 37 rows of embed.weight, for the "-vocab" case


# (case name, ZeRO fixture it converts): stages 1, 2, 3 in bf16 and fp16, the BF16_Optimizer,
# fp32 training, parameter_alignment paddings, stage 3 without sub-groups, and a padded
# vocabulary.
CASES = {
    "w2-s1-bf16": "w2-s1-bf16",
    "w2-s2-bf16": "w2-s2-bf16",
    "w2-s3-bf16-sg8": "w2-s3-bf16-sg8",
    "w2-s1-fp16": "w2-s1-fp16",
    "w2-s2-fp16": "w2-s2-fp16",
    "w2-s3-fp16-sg8": "w2-s3-fp16-sg8",
    "w2-s1-bf16-acc32": "w2-s1-bf16-acc32",
    "w2-s2-fp32": "w2-s2-fp32",
    "w3-s2-fp16-pa": "w3-s2-fp16-pa",
    "w4-s3-bf16": "w4-s3-bf16",
    "w2-s2-bf16-vocab": "w2-s2-bf16",
}


def _quiet():
    """ds_to_universal and the engine print progress; keep it out of the log unless asked."""
    chatter = io.StringIO()
    return contextlib.ExitStack() if os.environ.get("CKPTFS_VERBOSE") else _redirect(chatter)


@contextlib.contextmanager
def _redirect(sink):
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def convert(zero_root: Path, out: Path, case: str) -> dict:
    """ds_to_universal of the case's ZeRO save into OUT/<case>/global_step2_universal."""
    import torch
    from deepspeed.checkpoint import ds_to_universal

    source = zero_root / CASES[case] / "checkpoint" / TAG
    info = {"zero_fixture": CASES[case], "injected_universal_checkpoint_info": None}
    with tempfile.TemporaryDirectory() as work:
        if case.endswith("-vocab"):
            # A copy of the tag folder whose model states carry the client's info.
            copy = Path(work) / TAG
            shutil.copytree(source, copy)
            model_file = copy / "mp_rank_00_model_states.pt"
            state = torch.load(model_file, map_location="cpu", weights_only=False)
            injected = {
                "universal_checkpoint_version": 0.2,
                "vocabulary_parameter_patterns": [r"^embed\.weight$"],
                "original_vocab_size": ORIGINAL_VOCAB,
            }
            state["universal_checkpoint_info"] = injected
            torch.save(state, model_file)
            info["injected_universal_checkpoint_info"] = injected
            source = copy
        args = Namespace(
            input_folder=str(source),
            output_folder=str(out / case / STEP),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=info["injected_universal_checkpoint_info"] is None,
        )
        with _quiet():
            ds_to_universal.main(args)
    info["ds_to_universal_args"] = {k: v for k, v in vars(args).items() if k != "input_folder"}
    return info


def _rank_main(rank: int, world_size: int, cases: list, out: str) -> None:
    """One rank (of one): for each case, a fresh engine of the case's stage and precision loads
    the universal checkpoint, and its fp32 weights and moments are saved."""
    import torch
    from safetensors.torch import save_file

    _patch_deepspeed_for_cpu()
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo")
    for case in cases:
        fixture = FIXTURES_BY_NAME[CASES[case]]
        torch.manual_seed(4321)  # another initial model: every value must come from the load
        model = _build_model()
        optimizer = torch.optim.AdamW(_param_groups(model), lr=1e-3)
        config = fixture.ds_config()
        config["checkpoint"] = {"load_universal": True}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        case_dir = Path(out) / case
        record = json.loads((case_dir / "universal.json").read_text())
        try:
            with _quiet():
                engine.load_checkpoint(str(case_dir), load_optimizer_states=True, load_lr_scheduler_states=False)
            loaded = {}
            for name, param in engine.module.named_parameters():  # the tied weight once
                if not param.requires_grad:
                    continue
                loaded[name] = safe_get_full_fp32_param(param).detach().cpu().clone()
                for moment in ("exp_avg", "exp_avg_sq"):
                    loaded[f"{moment}.{name}"] = safe_get_full_optimizer_state(param, moment).detach().cpu().clone()
        except Exception as error:  # noqa: BLE001  (recorded; the suite says which cases must load)
            record["engine_load_error"] = f"{type(error).__name__}: {error}"
        else:
            record["engine_load_error"] = None
            save_file({k: v.contiguous() for k, v in loaded.items()}, case_dir / "engine_load.safetensors")
        (case_dir / "universal.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"  {case}: engine load {'failed' if record['engine_load_error'] else 'ok'}", flush=True)
        del engine, optimizer, model


def generate(out: Path) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    zero_root = cached_fixtures(ZERO_CHECKPOINTS)
    _preimport()
    import deepspeed.checkpoint.ds_to_universal  # noqa: F401

    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    for case in CASES:
        info = convert(zero_root, out, case)
        (out / case / "universal.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"ds_to_universal of {len(CASES)} saves: {time.monotonic() - started:.1f}s", flush=True)
    run_ranks_per_world_size(_rank_main, {1: list(CASES)}, out)


def main(argv=None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    started = time.monotonic()
    generate(out)
    print(f"total {time.monotonic() - started:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
