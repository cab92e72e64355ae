"""torch's Hugging Face storage writer, sharded (HuggingFaceStorageWriter(save_distributed=True,
enable_consolidation=True)): each rank writes shard-<rank>-model-1-of-1.safetensors under
<case>/sharded/ with its chunks' saved_offsets in the header, and torch consolidates them into
<case>/model-*.safetensors. ckptfs serves <case>/sharded consolidated: the mount's
model.safetensors equals torch's own consolidation key for key, dtype, shape and bytes, and
both equal the model part of dcp_to_torch_save of the same state saved in torch_save form."""

import json
import shutil
import struct

import pytest
from safetensors.torch import load_file

from ckptfs_testlib import assert_bitwise_equal, check_safetensors_file
from make_dcp_checkpoints import HF_CASES, HF_SHARDED_DIR
from test_dcp_bad_input import assert_refused  # noqa: F401  (fixture)


def torch_consolidated(case) -> dict:
    """What torch's consolidate_safetensors_files wrote beside sharded/ (every file its index
    names), loaded."""
    index = json.loads((case.checkpoint_dir / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(case.checkpoint_dir / name))
    return tensors


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_mount_matches_torch_consolidation(name, dcp_case, mounts):
    case = dcp_case(name)
    want = torch_consolidated(case)
    model = {key[len("model.") :]: t for key, t in case.tensors.items() if key.startswith("model.")}
    assert set(want) == set(model), "torch's consolidation and dcp_to_torch_save name different tensors"
    for key, tensor in model.items():
        assert_bitwise_equal(want[key], tensor, f"torch's consolidation of {key} vs dcp_to_torch_save")
    shards = sorted((case.checkpoint_dir / HF_SHARDED_DIR).glob("shard-*.safetensors"))
    assert len(shards) == HF_CASES[name], shards  # one per rank: really sharded
    mnt = mounts.mount(case.checkpoint_dir / HF_SHARDED_DIR)
    check_safetensors_file(mnt / "model.safetensors", want)


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_export_and_info(name, dcp_case, run_ckptfs, tmp_path):
    case = dcp_case(name)
    sharded = case.checkpoint_dir / HF_SHARDED_DIR
    run_ckptfs("export", sharded, tmp_path / "out")
    check_safetensors_file(tmp_path / "out" / "model.safetensors", torch_consolidated(case))
    info = json.loads(run_ckptfs("info", "--json", sharded).stdout)
    assert info["format"] == "dcp-hf-shards", info
    assert info["metadata"]["dcp"]["shard_files"] == HF_CASES[name], info["metadata"]


def test_consolidated_folder_is_a_plain_model_folder(dcp_case, mounts):
    """The folder torch consolidated into (index, model-*.safetensors, sharded/) is served as the
    Hugging Face model folder it is."""
    case = dcp_case("hf_fsdp2_ws3")
    mnt = mounts.mount(case.checkpoint_dir)
    check_safetensors_file(mnt / "model.safetensors", torch_consolidated(case))


@pytest.fixture
def shards_copy(dcp_case, tmp_path):
    copy = tmp_path / "sharded"
    shutil.copytree(dcp_case("hf_fsdp2_ws3").checkpoint_dir / HF_SHARDED_DIR, copy)
    return copy


def test_missing_middle_shard_is_refused(shards_copy, assert_refused):  # noqa: F811
    """Rank 2 of 3 missing: every FSDP-sharded tensor has a hole where its rows were."""
    (shards_copy / "shard-00002-model-00001-of-00001.safetensors").unlink()
    line = assert_refused(shards_copy, ["sharded"])
    assert "weight" in line or "bias" in line, line


def test_shard_with_pickled_values_before_it_is_refused(shards_copy, assert_refused):  # noqa: F811
    """What the writer produces for a state dict with non-tensor values: torch.save bytes before
    the safetensors header."""
    path = shards_copy / "shard-00001-model-00001-of-00001.safetensors"
    path.write_bytes(b"PK\x03\x04" + bytes(60) + path.read_bytes())
    line = assert_refused(shards_copy, [path.name])
    assert "safetensors header" in line, line


def test_shard_without_sharding_info_is_refused(shards_copy, assert_refused):  # noqa: F811
    path = shards_copy / "shard-00001-model-00001-of-00001.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    del header["__metadata__"]["DCP_SHARDING_INFO"]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    line = assert_refused(shards_copy, [path.name])
    assert "DCP_SHARDING_INFO" in line, line
