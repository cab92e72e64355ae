"""The real safetensors library reads the mounted files of a nested training checkpoint
(written by the real torch.save) and gets exactly what torch.load returns."""

import os
from pathlib import Path

import torch

from ckptfs_testlib import check_safetensors_file
from fusetools import assert_bitwise_equal, read_manifest


def test_checkpoint_has_the_cases_we_mean_to_cover(training_ckpt):
    _, expected = training_ckpt
    dtypes = {t.dtype for t in expected.values()}
    assert {torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool} <= dtypes
    assert "optimizer.state.0.exp_avg_sq" in expected
    assert "layers/with/slashes.w%1" in expected
    # The tied weight: torch.load gives one storage for both keys.
    emb, head = expected["model.embed.weight"], expected["model.head.weight"]
    assert emb.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    assert not expected["extra.transposed"].is_contiguous()
    assert expected["extra.window"].storage_offset() == 10


def test_model_file_matches_torch_load(training_ckpt, mounts):
    source, expected = training_ckpt
    mnt = mounts.mount(source)
    check_safetensors_file(mnt / "model.safetensors", expected)

    # manifest.json's model_offsets point at each tensor's bytes in model.safetensors.
    manifest = read_manifest(mnt)
    data = (mnt / "model.safetensors").read_bytes()
    for entry in manifest["tensors"]:
        begin, end = entry["model_offsets"]
        want = expected[entry["key"]].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert data[begin:end] == want, f"model_offsets of {entry['key']}"


def test_each_tensor_file_matches_torch_load(training_ckpt, mounts):
    source, expected = training_ckpt
    mnt = mounts.mount(source)
    manifest = read_manifest(mnt)
    by_key = {e["key"]: e for e in manifest["tensors"]}
    assert set(by_key) == set(expected), "manifest.json keys differ from torch.load's"

    names = os.listdir(mnt / "tensors")
    assert sorted(names) == sorted(Path(e["file"]).name for e in by_key.values())
    # '%' -> %25 and '/' -> %2F in file names (doc/CLI.md).
    assert by_key["layers/with/slashes.w%1"]["file"] == "tensors/layers%2Fwith%2Fslashes.w%251.safetensors"
    assert "layers%2Fwith%2Fslashes.w%251.safetensors" in names

    for key, entry in by_key.items():
        tensor = expected[key]
        assert entry["shape"] == list(tensor.shape), key
        assert entry["torch_dtype"] == str(tensor.dtype).removeprefix("torch."), key
        assert entry["nbytes"] == tensor.numel() * tensor.element_size(), key
        check_safetensors_file(mnt / entry["file"], {key: tensor})

    # The tied weight is served under both keys and marked as shared storage.
    emb, head = by_key["model.embed.weight"], by_key["model.head.weight"]
    assert emb.get("shared_storage") is not None
    assert emb.get("shared_storage") == head.get("shared_storage")
