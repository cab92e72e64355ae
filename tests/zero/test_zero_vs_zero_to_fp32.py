"""ckptfs on real DeepSpeed ZeRO save dirs against DeepSpeed's own zero_to_fp32: the same keys
in the same order, every tensor bit for bit (conftest.py lists the deliberate differences)."""

import json
import re

import pytest
import torch

from ckptfs_testlib import assert_bitwise_equal, check_safetensors_file
from zerotools import DEEPSPEED_VERSION, SERVED_DTYPE, fixture_names

ALL = fixture_names()
ZERO_TO_FP32_READS = fixture_names(lambda f: not f.bf16_optimizer)
STAGE_1 = fixture_names(lambda f: f.stage == 1)


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- the harness's own assumptions, checked against DeepSpeed (no ckptfs involved) ----------


@pytest.mark.parametrize("name", ALL)
def test_zero_to_fp32_reads_every_zero_checkpoint(zero_checkpoint, name):
    """zero_to_fp32 refuses exactly the BF16_Optimizer checkpoints, for the known reason."""
    ckpt = zero_checkpoint(name)
    if ckpt.fixture.bf16_optimizer:
        assert ckpt.info["optimizer_class"] == "BF16_Optimizer"
        assert "is not a zero checkpoint" in (ckpt.zero_to_fp32_error or ""), ckpt.zero_to_fp32_error
    else:
        assert ckpt.zero_to_fp32_error is None, ckpt.zero_to_fp32_error


@pytest.mark.parametrize("name", ZERO_TO_FP32_READS)
def test_expected_order_is_zero_to_fp32_order(zero_checkpoint, name):
    """The order the tests expect from ckptfs is zero_to_fp32's, plus (stage 1 only) the frozen
    parameters that zero_to_fp32 drops, placed where it puts them for stages 2 and 3."""
    ckpt = zero_checkpoint(name)
    z2f_order = list(ckpt.zero_to_fp32)
    if ckpt.stage == 1:
        assert not set(ckpt.frozen_names) & set(z2f_order)
        expected = [key for key in ckpt.expected_order if key not in ckpt.frozen_names]
    else:
        expected = ckpt.expected_order
    assert z2f_order == expected


@pytest.mark.parametrize("name", ZERO_TO_FP32_READS)
def test_zero_to_fp32_buffers_are_the_stored_buffers_cast_to_fp32(zero_checkpoint, name):
    """zero_to_fp32 serves float buffers as fp32 and keeps int buffers: ckptfs keeps the stored
    dtype, so its buffers must equal zero_to_fp32's after exactly that cast."""
    ckpt = zero_checkpoint(name)
    for key in ckpt.buffer_names:
        stored = ckpt.module[key]
        cast = stored.float() if stored.is_floating_point() else stored
        assert_bitwise_equal(ckpt.zero_to_fp32[key], cast, f"{name}: zero_to_fp32[{key}]")


# --- ckptfs against the references ------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_ls_json_keys_order_and_dtypes(zero_checkpoint, served, name):
    ckpt = zero_checkpoint(name)
    view = served(ckpt.save_dir)
    assert view.keys == ckpt.expected_order, f"{name}: ls --json order differs from zero_to_fp32's"
    for entry in view.entries:
        want = ckpt.expected[entry["key"]]
        what = f"{name}: ls --json {entry['key']}"
        assert entry["dtype"] == SERVED_DTYPE[want.dtype], what
        assert entry["torch_dtype"] == torch_dtype_name(want.dtype), what
        assert entry["shape"] == list(want.shape), what
        assert entry["nbytes"] == want.numel() * want.element_size(), what


@pytest.mark.parametrize("name", ALL)
def test_export_is_zero_to_fp32_bit_for_bit(zero_checkpoint, served, run_ckptfs, name):
    """model.safetensors holds exactly zero_to_fp32's keys (stage 1: plus the frozen
    parameters), each tensor bit for bit; so does each per-tensor file."""
    ckpt = zero_checkpoint(name)
    view = served(ckpt.save_dir)
    out = view.export_dir
    check_safetensors_file(out / "model.safetensors", ckpt.expected)

    by_key = {entry["key"]: entry for entry in view.entries}
    for key, tensor in ckpt.expected.items():
        check_safetensors_file(out / by_key[key]["file"], {key: tensor})
    on_disk = set((out / "tensors").rglob("*.safetensors"))
    assert on_disk == {out / entry["file"] for entry in view.entries}, "tensors/ differs from ls --json"

    manifest = json.loads((out / "manifest.json").read_text())
    assert [t["key"] for t in manifest["tensors"]] == view.keys, "manifest.json order differs from ls --json"
    json.loads((out / "metadata.json").read_text())
    assert run_ckptfs("cat", ckpt.save_dir, "model.safetensors").stdout == (out / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name", ZERO_TO_FP32_READS)
def test_every_zero_to_fp32_tensor_is_served(zero_checkpoint, served, name):
    """Straight from zero_to_fp32's dict (trainable and frozen parameters, aliases), independent
    of how `expected` was put together; buffers after zero_to_fp32's fp32 cast."""
    ckpt = zero_checkpoint(name)
    tensors = served(ckpt.save_dir).tensors
    for key, reference in ckpt.zero_to_fp32.items():
        assert key in tensors, f"{name}: ckptfs does not serve {key}"
        actual = tensors[key]
        if key in ckpt.buffer_names and reference.dtype != actual.dtype:
            assert actual.is_floating_point() and reference.dtype == torch.float32, key
            actual = actual.float()
        assert_bitwise_equal(actual, reference, f"{name}: {key} vs zero_to_fp32")


@pytest.mark.parametrize("name", ALL)
def test_buffers_keep_their_stored_dtype(zero_checkpoint, served, name):
    ckpt = zero_checkpoint(name)
    tensors = served(ckpt.save_dir).tensors
    assert ckpt.buffer_names, "the model has persistent buffers"
    assert "scratch" not in tensors, "a non-persistent buffer is never saved"
    for key in ckpt.buffer_names:
        assert_bitwise_equal(tensors[key], ckpt.module[key], f"{name}: buffer {key} vs the stored one")
    assert tensors["half_table"].dtype == torch.float16
    assert tensors["counter"].dtype == torch.int64


@pytest.mark.parametrize("name", STAGE_1)
def test_stage_1_frozen_parameters_come_from_module(zero_checkpoint, served, name):
    ckpt = zero_checkpoint(name)
    assert ckpt.frozen_names == ["frozen.weight", "frozen.bias"]
    tensors = served(ckpt.save_dir).tensors
    for key in ckpt.frozen_names:
        assert_bitwise_equal(tensors[key], ckpt.module[key], f"{name}: frozen {key} vs module")


@pytest.mark.parametrize("name", ALL)
def test_export_matches_the_live_engine(zero_checkpoint, served, name):
    """A second reference, read from the engine at save time: fp32 master weights
    (safe_get_full_fp32_param), frozen weights in the model's precision, buffers as stored."""
    ckpt = zero_checkpoint(name)
    tensors = served(ckpt.save_dir).tensors
    engine = ckpt.engine_reference
    if not ckpt.fixture.round_robin:
        # With round_robin_gradients DeepSpeed's own safe_get_full_fp32_param reads the wrong
        # slices (its param_slice_mappings ignore the reordering); zero_to_fp32 and the 16-bit
        # module weights agree with each other there, see the tests above and below.
        for key, reference in engine["trainable"].items():
            assert_bitwise_equal(tensors[key], reference, f"{name}: {key} vs the engine's fp32 master")
    for key, reference in engine["frozen"].items():
        assert_bitwise_equal(tensors[key], reference, f"{name}: frozen {key} vs the engine")
    for key, reference in engine["buffers"].items():
        assert_bitwise_equal(tensors[key], reference, f"{name}: buffer {key} vs the engine")
    assert set(tensors) == set(engine["trainable"]) | set(engine["frozen"]) | set(engine["buffers"]) | set(
        engine["aliases"]
    )
    for alias, owner in engine["aliases"].items():
        assert_bitwise_equal(tensors[alias], tensors[owner], f"{name}: tied {alias} vs {owner}")


@pytest.mark.parametrize("name", fixture_names(lambda f: f.stage <= 2))
def test_fp32_weights_round_to_the_saved_16bit_weights(zero_checkpoint, served, name):
    """Independent of both references: stages 1 and 2 save the model's own (16-bit or fp32)
    weights, which DeepSpeed copies from the fp32 masters after each step."""
    ckpt = zero_checkpoint(name)
    tensors = served(ckpt.save_dir).tensors
    for key in ckpt.trainable_names:
        saved = ckpt.module[key]
        assert_bitwise_equal(tensors[key].to(saved.dtype), saved, f"{name}: {key} rounded vs module")


# --- sources, info ----------------------------------------------------------------------------

TAG_SOURCES = ["w4-s1-bf16", "w4-s2-bf16", "w4-s3-bf16-sg8", "w4-s1-bf16-acc32", "w12-s3-bf16-sg8"]


@pytest.mark.parametrize("name", TAG_SOURCES)
def test_tag_folder_is_a_source(zero_checkpoint, served, name):
    """SAVE_DIR/global_stepN (what zero_to_fp32 calls the checkpoint dir) serves the same."""
    ckpt = zero_checkpoint(name)
    view = served(ckpt.tag_dir)
    assert view.keys == ckpt.expected_order
    check_safetensors_file(view.export_dir / "model.safetensors", ckpt.expected)
    from_save_dir = served(ckpt.save_dir).entries
    assert [(e["key"], e["dtype"], e["shape"]) for e in view.entries] == [
        (e["key"], e["dtype"], e["shape"]) for e in from_save_dir
    ]


def check_deepspeed_summary(ckpt, deepspeed, where: str) -> None:
    """The "deepspeed" metadata object: {"stage", "world_size", "optimizer", "ds_version",
    "dtypes", ...}."""
    assert isinstance(deepspeed, dict), f"{where}: deepspeed is {deepspeed!r}, not a JSON object"
    assert deepspeed["stage"] == ckpt.stage, where
    assert deepspeed["world_size"] == ckpt.world_size, where
    assert deepspeed["ds_version"] == ckpt.info["deepspeed_version"] == DEEPSPEED_VERSION, where
    assert deepspeed["optimizer"] == ckpt.info["optimizer_class"], where
    stored = {torch_dtype_name(t.dtype) for t in ckpt.expected.values()}
    assert stored <= set(deepspeed["dtypes"]), f"{where}: dtypes {deepspeed['dtypes']} lack some of {stored}"


@pytest.mark.parametrize("name", ALL)
def test_metadata_json_names_stage_world_size_and_version(zero_checkpoint, served, name):
    ckpt = zero_checkpoint(name)
    metadata = json.loads((served(ckpt.save_dir).export_dir / "metadata.json").read_text())
    check_deepspeed_summary(ckpt, metadata["deepspeed"], "metadata.json")


@pytest.mark.parametrize("name", ALL)
def test_info_names_stage_world_size_and_version(zero_checkpoint, run_ckptfs, name):
    """info --json: metadata "deepspeed" is the same JSON object."""
    ckpt = zero_checkpoint(name)
    info = json.loads(run_ckptfs("info", "--json", ckpt.save_dir).stdout)
    assert info["format"] == "deepspeed-zero"
    assert info["tensor_count"] == len(ckpt.expected_order)
    check_deepspeed_summary(ckpt, info["metadata"]["deepspeed"], "info --json metadata")
    text = run_ckptfs("info", ckpt.save_dir).stdout.decode()
    assert DEEPSPEED_VERSION in text, "info does not show the DeepSpeed version"


# --- rank files -------------------------------------------------------------------------------

RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_(optim|model)_states\.pt$")


@pytest.mark.parametrize("name", fixture_names(lambda f: f.world_size > 10))
def test_rank_files_are_ordered_by_rank_number(zero_checkpoint, served, name):
    """With more than 10 ranks, name order (rank_10 before rank_2) is not rank order. The values
    tests above would catch a wrong concatenation; this checks the file list itself."""
    ckpt = zero_checkpoint(name)
    manifest = json.loads((served(ckpt.save_dir).export_dir / "manifest.json").read_text())
    ranks = {"optim": [], "model": []}
    for entry in manifest["source"]["files"]:
        match = RANK.search(entry["path"])
        if match:
            ranks[match.group(2)].append(int(match.group(1)))
    assert ranks["optim"] == list(range(ckpt.world_size))
    if ckpt.stage == 3:
        assert ranks["model"] == list(range(ckpt.world_size))
