"""Which weights files a view serves as the source's own file, header and all (doc/MOUNT.md,
"Files served as they are"), and which get a header ckptfs writes: the rule a FUSE mount's
passthrough relies on, checked without a mount (`ckptfs cat`). Either way the tensors are the
view's, bit for bit; served as it is, the file is the source file byte for byte, and the
manifest's offsets are its own."""

import json
import struct

import pytest
import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file

from ckptfs_testlib import assert_bitwise_equal


def header_of(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


def tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed.weight": torch.randn(16, 8, generator=g),
            "model.norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
            "model.steps": torch.arange(5, dtype=torch.int64)}


def served(run_ckptfs, source, path, *options) -> bytes:
    return run_ckptfs("cat", *options, source, path).stdout


def check_tensors(data: bytes, want: dict) -> None:
    got = load_bytes(data)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert_bitwise_equal(got[key], value, key)


@pytest.fixture
def pt_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(tensors(), path, metadata={"format": "pt", "note": "kept"})
    return path


def test_file_the_view_keeps_is_served_as_it_is(pt_file, run_ckptfs):
    data = served(run_ckptfs, pt_file, "model.safetensors")
    assert data == pt_file.read_bytes()
    # The manifest's offsets are the source file's.
    manifest = json.loads(served(run_ckptfs, pt_file, "manifest.json"))
    header, start = header_of(data), 8 + struct.unpack("<Q", data[:8])[0]
    for entry in manifest["tensors"]:
        begin, end = header[entry["key"]]["data_offsets"]
        assert entry["model_offsets"] == [start + begin, start + end], entry["key"]


@pytest.mark.parametrize("options, want", [
    (("--dtype", "bf16"), {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors().items()}),
    (("--shard-size", "1GB"), tensors()),
    (("--root", "model"), {k.removeprefix("model."): v for k, v in tensors().items()}),
])
def test_a_view_that_changes_the_file_writes_its_header(pt_file, run_ckptfs, options, want):
    manifest = json.loads(served(run_ckptfs, pt_file, "manifest.json", *options))
    data = served(run_ckptfs, pt_file, manifest["model_file"], *options)
    assert data != pt_file.read_bytes()
    assert header_of(data)["__metadata__"] == {"format": "pt"}
    check_tensors(data, want)


def test_a_dtype_view_keeps_a_file_it_does_not_convert(tmp_path, run_ckptfs):
    path = tmp_path / "ints.safetensors"
    save_file({"ids": torch.arange(12, dtype=torch.int32), "mask": torch.ones(3, dtype=torch.bool)}, path,
              metadata={"format": "pt"})
    assert served(run_ckptfs, path, "model.safetensors", "--dtype", "bf16") == path.read_bytes()


@pytest.mark.parametrize("metadata", [None, {"format": "np"}])
def test_a_header_without_format_pt_is_written_anew(tmp_path, run_ckptfs, metadata):
    path = tmp_path / "bare.safetensors"
    save_file(tensors(), path, metadata=metadata)
    data = served(run_ckptfs, path, "model.safetensors")
    assert data != path.read_bytes()
    assert header_of(data)["__metadata__"] == {"format": "pt"}
    check_tensors(data, tensors())


def test_a_file_with_an_empty_tensor_is_written_anew(tmp_path, run_ckptfs):
    path = tmp_path / "empty.safetensors"
    want = tensors() | {"model.none": torch.zeros(0, 4)}
    save_file(want, path, metadata={"format": "pt", "note": "kept only by the source's own header"})
    data = served(run_ckptfs, path, "model.safetensors")
    assert header_of(data)["__metadata__"] == {"format": "pt"}
    check_tensors(data, want)


def test_components_of_a_folder_tree_are_served_as_they_are(tmp_path, run_ckptfs):
    """A diffusers-like tree: each component's weights file in its folder, keys without the
    folder; a sharded component keeps its shards, each the source's file."""
    root = tmp_path / "pipeline"
    (root / "unet").mkdir(parents=True)
    (root / "text_encoder").mkdir()
    (root / "model_index.json").write_text(json.dumps({"_class_name": "Pipeline"}))
    save_file(tensors(1), root / "unet" / "diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
    (root / "unet" / "config.json").write_text("{}")
    shards = [tensors(2), {"head.weight": torch.randn(4, 4)}]
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-00002.safetensors"
        save_file(shard, root / "text_encoder" / name, metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    (root / "text_encoder" / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "text_encoder" / "config.json").write_text("{}")

    for rel in ("unet/diffusion_pytorch_model.safetensors", "text_encoder/model-00001-of-00002.safetensors",
                "text_encoder/model-00002-of-00002.safetensors"):
        assert served(run_ckptfs, root, rel) == (root / rel).read_bytes(), rel
    # root= serves one component as the source: its keys keep their names, its file stays.
    assert served(run_ckptfs, root, "diffusion_pytorch_model.safetensors", "--root", "unet") == \
        (root / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
