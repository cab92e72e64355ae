"""Helpers for tests/zero: the generated fixtures as DeepSpeed sees them, and what ckptfs must
serve for each (see conftest.py for the contract)."""

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from make_zero_checkpoints import FIXTURES, FIXTURES_BY_NAME, TAG, Fixture

DEEPSPEED_VERSION = "0.19.8"

# torch dtype -> the safetensors dtype ckptfs serves it as (doc/CLI.md).
SERVED_DTYPE = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
}


def fixture_names(predicate=lambda fixture: True) -> list[str]:
    """Names of the fixtures PREDICATE accepts, for pytest.mark.parametrize."""
    return [fixture.name for fixture in FIXTURES if predicate(fixture)]


def torch_load(path: Path):
    # DeepSpeed's files pickle DeepSpeed objects (ZeroStageEnum, LossScaler, ...).
    return torch.load(path, map_location="cpu", weights_only=False)


@dataclass
class ZeroCheckpoint:
    """One generated fixture: its files, DeepSpeed's view of it, what ckptfs must serve."""

    name: str
    root: Path  # OUT/<name>

    @property
    def fixture(self) -> Fixture:
        return FIXTURES_BY_NAME[self.name]

    @property
    def stage(self) -> int:
        return self.fixture.stage

    @property
    def world_size(self) -> int:
        return self.fixture.world_size

    @property
    def save_dir(self) -> Path:
        """The DeepSpeed save dir (holds `latest`): what users point ckptfs at."""
        return self.root / "checkpoint"

    @property
    def tag_dir(self) -> Path:
        return self.save_dir / TAG

    @cached_property
    def info(self) -> dict:
        return json.loads((self.root / "fixture.json").read_text())

    @property
    def model_states_file(self) -> Path:
        """Rank 0's model states (stage 3 has one per rank, with the module's tensors empty)."""
        name = "mp_rank_00_model_states.pt" if self.stage <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
        return self.tag_dir / name

    @cached_property
    def model_states(self) -> dict:
        return torch_load(self.model_states_file)

    @property
    def module(self) -> dict:
        """The module's state_dict as saved: 16-bit weights (stages 1 and 2), buffers as stored."""
        return self.model_states["module"]

    # Names, in the order zero_to_fp32 builds its state dict.

    @cached_property
    def buffer_names(self) -> list[str]:
        saved = set(self.model_states["buffer_names"])
        return [key for key in self.module if key in saved]

    @cached_property
    def trainable_names(self) -> list[str]:
        return [key for group in self.model_states["param_shapes"] for key in group]

    @cached_property
    def aliases(self) -> dict:
        """{tied name: the name it is saved under}."""
        return dict(self.model_states["shared_params"])

    @cached_property
    def frozen_names(self) -> list[str]:
        recorded = self.model_states.get("frozen_param_shapes")
        if recorded:
            return list(recorded)
        # Stage 1 records no frozen_param_shapes: frozen parameters are what the module has
        # besides buffers, trainable parameters and tied aliases.
        others = set(self.buffer_names) | set(self.trainable_names) | set(self.aliases)
        return [key for key in self.module if key not in others]

    @cached_property
    def expected_order(self) -> list[str]:
        return self.buffer_names + self.frozen_names + self.trainable_names + list(self.aliases)

    # The references.

    @property
    def zero_to_fp32_error(self) -> str | None:
        return self.info["zero_to_fp32_error"]

    @cached_property
    def zero_to_fp32(self) -> dict | None:
        """DeepSpeed's get_fp32_state_dict_from_zero_checkpoint(save_dir) (an ordered dict),
        None where it refuses the checkpoint."""
        path = self.root / "zero_to_fp32.pt"
        return torch_load(path) if path.exists() else None

    @cached_property
    def engine_reference(self) -> dict:
        """{"trainable", "frozen", "buffers": {name: tensor}, "aliases": {name: owner}} read
        from the live engine at save time (make_zero_checkpoints._engine_reference)."""
        return torch_load(self.root / "engine_reference.pt")

    @cached_property
    def expected(self) -> dict:
        """{key: tensor} that ckptfs must serve, in expected_order."""
        z2f = self.zero_to_fp32
        engine = self.engine_reference
        want = {}
        for key in self.expected_order:
            if key in self.buffer_names:
                want[key] = self.module[key]  # stored dtype
            elif key in self.aliases:
                want[key] = want[self.aliases[key]]
            elif z2f is not None and key in z2f:
                want[key] = z2f[key]
            elif key in self.frozen_names:  # stage 1: zero_to_fp32 drops them
                want[key] = self.module[key]
            else:  # BF16_Optimizer: zero_to_fp32 refuses the checkpoint
                assert z2f is None, f"{self.name}: zero_to_fp32 has no {key}"
                want[key] = engine["trainable"][key]
        return want


