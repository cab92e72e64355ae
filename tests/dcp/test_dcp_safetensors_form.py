"""Guards for the safetensors-form cases (st_*), which test_dcp_vs_dcp_to_torch_save compares
with dcp_to_torch_save of their torch_save twins: they really are in DCP's safetensors
serialization, hold the sharding they are meant to cover, and ckptfs says which
serialization it read."""

import json
import pickle
import struct

import pytest
import torch  # noqa: F401  (the .metadata pickle names torch classes)

from make_dcp_checkpoints import SAFETENSORS_FORM_CASES


def safetensors_blob_header(path, offset: int) -> dict:
    with open(path, "rb") as f:
        f.seek(offset)
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


@pytest.mark.parametrize("name", sorted(SAFETENSORS_FORM_CASES))
def test_case_is_in_safetensors_form(name, dcp_case, run_ckptfs):
    ckpt = dcp_case(name).checkpoint_dir
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    chunks = [
        (index, info)
        for index, info in metadata.storage_data.items()
        if index.offset is not None  # tensors; objects stay torch.save pickles in this form
    ]
    assert chunks
    for index, info in chunks:
        header = safetensors_blob_header(ckpt / info.relative_path, info.offset)
        sharding = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        assert sharding[index.fqn]["saved_offsets"] == list(index.offset), index
    info = json.loads(run_ckptfs("info", "--json", ckpt).stdout)
    assert info["metadata"]["dcp"]["serialization"] == "safetensors", info["metadata"]["dcp"]


def test_tp_case_has_column_shards(dcp_case):
    """RowwiseParallel's weight is Shard(1): chunks side by side along dimension 1, which the
    View gathers on read."""
    with open(dcp_case("st_tp_ws2").checkpoint_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    offsets = sorted(tuple(c.offsets) for c in metadata.state_dict_metadata["model.2.weight"].chunks)
    assert len(offsets) == 2 and offsets[0] == (0, 0) and offsets[1][0] == 0 and offsets[1][1] > 0, offsets


def test_length_lie_is_refused(dcp_case, run_ckptfs, tmp_path):
    """A chunk whose .metadata length is not its tensor's byte count in the blob: refused with
    one line naming the data file and the fqn."""
    import dataclasses
    import shutil

    import torch.distributed.checkpoint.metadata as dcp_metadata

    ckpt = tmp_path / "st"
    shutil.copytree(dcp_case("st_fsdp2_ws2").checkpoint_dir, ckpt)
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    fqn = "model.0.weight"
    key = dcp_metadata.MetadataIndex(fqn, metadata.state_dict_metadata[fqn].chunks[0].offsets)
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key],
                                                     length=metadata.storage_data[key].length - 4)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    result = run_ckptfs("ls", ckpt, check=False)
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result
    assert "__0_0.distcp" in lines[0] and fqn in lines[0] and "length" in lines[0], lines[0]


def test_chunk_outside_the_blob_is_refused(dcp_case, run_ckptfs, tmp_path):
    """Every tensor chunk of a safetensors-form file is at the file's one blob: a chunk pointed
    elsewhere (here, at the file's first pickled object) is refused naming the file and fqn."""
    import dataclasses
    import shutil

    import torch.distributed.checkpoint.metadata as dcp_metadata

    ckpt = tmp_path / "st"
    shutil.copytree(dcp_case("st_fsdp2_ws2").checkpoint_dir, ckpt)
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    fqn = "optim.state.0.weight.exp_avg"  # read after model.0.weight, whose chunks tell each file's form
    chunk = next(c for c in metadata.state_dict_metadata[fqn].chunks if c.offsets[0] > 0)
    key = dcp_metadata.MetadataIndex(fqn, chunk.offsets)
    assert metadata.storage_data[key].relative_path == "__1_0.distcp" and metadata.storage_data[key].offset > 0
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], offset=0)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    result = run_ckptfs("ls", ckpt, check=False)
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result
    assert "__1_0.distcp" in lines[0] and fqn in lines[0] and "safetensors blob at byte" in lines[0], lines[0]
