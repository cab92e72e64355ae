"""Broken or incomplete ZeRO save dirs (copies of real ones, damaged on purpose): ckptfs must
exit 1 with one stderr line naming the offending file and the problem, and leave no output."""

import shutil
from pathlib import Path

import pytest

from make_zero_checkpoints import TAG


def optim_file(rank: int, dtype: str = "bf16") -> str:
    """DeepSpeed's name for a rank's optimizer states (16-bit runs prefix the dtype)."""
    prefix = "bf16_" if dtype == "bf16" else ""
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def stage3_model_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


@pytest.fixture
def damaged_copy(zero_checkpoint, tmp_path):
    """damaged_copy(name) -> (save dir, tag dir) of a private copy of fixture NAME."""

    def copy(name: str) -> tuple[Path, Path]:
        save_dir = tmp_path / name
        shutil.copytree(zero_checkpoint(name).save_dir, save_dir)
        return save_dir, save_dir / TAG

    return copy


@pytest.mark.parametrize("rank", [1, 3], ids=["middle-rank", "last-rank"])
def test_missing_rank_optimizer_file(damaged_copy, assert_refused, rank):
    save_dir, tag_dir = damaged_copy("w4-s2-bf16")
    (tag_dir / optim_file(rank)).unlink()
    assert_refused(save_dir, optim_file(rank))


def test_missing_stage_3_rank_model_file(damaged_copy, assert_refused):
    save_dir, tag_dir = damaged_copy("w4-s3-bf16-sg8")
    (tag_dir / stage3_model_file(2)).unlink()
    assert_refused(save_dir, stage3_model_file(2))


def test_missing_model_states_file(damaged_copy, assert_refused):
    save_dir, tag_dir = damaged_copy("w2-s2-fp16")
    (tag_dir / "mp_rank_00_model_states.pt").unlink()
    assert_refused(save_dir, "mp_rank_00_model_states.pt")


def test_extra_rank_file_from_another_world_size(zero_checkpoint, damaged_copy, assert_refused):
    """A rank-4 file in a world-size-4 checkpoint (left over from a bigger run)."""
    save_dir, tag_dir = damaged_copy("w4-s2-bf16")
    shutil.copyfile(zero_checkpoint("w2-s2-bf16").tag_dir / optim_file(1), tag_dir / optim_file(4))
    assert_refused(save_dir, optim_file(4))


def test_rank_file_of_another_world_size(zero_checkpoint, damaged_copy, assert_refused):
    """Rank 1's file replaced by rank 1's file of a world-size-2 run: partition_count 2 in a
    checkpoint of 4 ranks."""
    save_dir, tag_dir = damaged_copy("w4-s2-bf16")
    shutil.copyfile(zero_checkpoint("w2-s2-bf16").tag_dir / optim_file(1), tag_dir / optim_file(1))
    assert_refused(save_dir, optim_file(1))


@pytest.mark.parametrize(
    "name, victim",
    [
        ("w4-s2-bf16", optim_file(2)),
        ("w4-s3-bf16-sg8", optim_file(2)),
        ("w4-s3-bf16-sg8", stage3_model_file(3)),
        ("w2-s1-fp16", "mp_rank_00_model_states.pt"),
    ],
    ids=["stage2-optim", "stage3-optim", "stage3-model", "stage1-model"],
)
def test_truncated_shard(damaged_copy, assert_refused, name, victim):
    save_dir, tag_dir = damaged_copy(name)
    path = tag_dir / victim
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_refused(save_dir, victim)


def test_latest_names_a_missing_tag(damaged_copy, assert_refused):
    save_dir, _ = damaged_copy("w2-s2-fp16")
    (save_dir / "latest").write_text("global_step99")
    assert_refused(save_dir, "global_step99")


@pytest.mark.parametrize("name", ["w2-s2-fp16", "w2-s3-fp16-sg8"])
def test_moe_expert_file_is_refused(damaged_copy, assert_refused, name):
    """Expert (MoE) parameters live in their own files, which ckptfs does not read: serving the
    rest would silently drop the experts."""
    save_dir, tag_dir = damaged_copy(name)
    model_file = next(tag_dir.glob("*model_states.pt"))
    expert = "layer_0_expert_0_mp_rank_00_model_states.pt"
    shutil.copyfile(model_file, tag_dir / expert)
    assert_refused(save_dir, expert)


def test_offloaded_tensors_folder_is_refused(damaged_copy, assert_refused):
    """NVMe-offloaded optimizer states (tag/offloaded_tensors/rank0/...) are not in the .pt
    files: refuse rather than serve what may be stale."""
    save_dir, tag_dir = damaged_copy("w2-s3-bf16-sg8")
    rank_dir = tag_dir / "offloaded_tensors" / "rank0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "0.tensor.swp").write_bytes(b"\0" * 64)
    assert_refused(save_dir, "offloaded_tensors")
