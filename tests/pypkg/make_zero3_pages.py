#!/usr/bin/env python3
"""ZeRO-3 checkpoints whose parameters are large enough for ckptfs.load to map, saved by
DeepSpeed itself (tests/pypkg; generated once per machine through tests/ckptfs_fixture_cache.py).

    python make_zero3_pages.py OUT

    OUT/w<N>/checkpoint/        the save dir of N ranks (bf16 training, fp32 masters)
    OUT/w<N>/zero_to_fp32.pt    DeepSpeed's get_fp32_state_dict_from_zero_checkpoint() of it

The tests/zero fixtures hold parameters of a few elements, whose pieces ckptfs.load reads.
Here every rank holds a whole number of pages of most parameters (their partitions are a
multiple of 4 KiB of fp32), so ckptfs.load composes those tensors of maps of the rank files,
and `proj`/`back` have partitions of 76,800 bytes at 2 ranks (18.75 pages): only their first
piece can be mapped and the rest is read. At 4 ranks the 64 KiB partitions of fc1/fc2 leave the
middle ranks' pieces, a page short once cut to whole pages, to be read.
"""

import os
import sys
import time
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS_DIR))  # ckptfs_ranks
sys.path.insert(0, str(TESTS_DIR / "zero"))  # DeepSpeed-on-CPU set-up shared with tests/zero
from ckptfs_ranks import run_ranks_per_world_size  # noqa: E402
from make_zero_checkpoints import _patch_deepspeed_for_cpu, _preimport  # noqa: E402

WORLD_SIZES = (2, 4)
VOCAB = 1024
WIDTH = 128


def _build_model():
    import torch.nn as nn

    class PageSized(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)  # 131,072 elements
            self.fc1 = nn.Linear(WIDTH, 512)  # 65,536 (+ a 512-element bias, read)
            self.fc2 = nn.Linear(512, WIDTH)
            self.proj = nn.Linear(WIDTH, 300, bias=False)  # 38,400: 19,200 per rank at 2 ranks
            self.back = nn.Linear(300, WIDTH, bias=False)
            self.ln = nn.LayerNorm(WIDTH)

        def forward(self, ids):
            import torch

            x = self.embed(ids)
            x = x + self.fc2(torch.relu(self.fc1(x)))
            x = x + self.back(torch.tanh(self.proj(x)))
            return self.ln(x) @ self.embed.weight.t()

    return PageSized()


def _rank_main(rank: int, world_size: int, names: list, out: str) -> None:
    import torch

    _patch_deepspeed_for_cpu()
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)  # the same initial model on every rank
    model = _build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": True},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 + rank))
    loss = torch.nn.functional.cross_entropy(engine(ids).float().reshape(-1, VOCAB), ids.reshape(-1))
    engine.backward(loss)
    engine.step()  # the fp32 masters move away from the initial weights
    engine.save_checkpoint(str(Path(out) / names[0] / "checkpoint"))
    dist.barrier()
    dist.destroy_process_group()


def write_reference(fixture_dir: Path) -> None:
    import contextlib
    import io

    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        state = get_fp32_state_dict_from_zero_checkpoint(str(fixture_dir / "checkpoint"))
    torch.save(state, fixture_dir / "zero_to_fp32.pt")


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    _preimport()
    run_ranks_per_world_size(_rank_main, {w: [f"w{w}"] for w in WORLD_SIZES}, out)
    for w in WORLD_SIZES:
        write_reference(out / f"w{w}")
    print(f"total {time.monotonic() - started:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
