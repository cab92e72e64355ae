"""The real transformers loads all-MiniLM-L6-v2 from a mount, both from the published model
folder and from a folder holding only a torch.save'd pytorch_model.bin, and computes exactly
the embeddings of the original model."""

import shutil

import pytest
import torch

from minilm import NON_WEIGHT_FILES, encode, load_model


@pytest.fixture(scope="module")
def original(minilm_dir):
    model, tokenizer = load_model(minilm_dir)
    ids, emb = encode(model, tokenizer)
    return model, ids, emb


def assert_same_embeddings(folder, original):
    _, want_ids, want = original
    model, tokenizer = load_model(folder)
    ids, got = encode(model, tokenizer)
    assert torch.equal(ids, want_ids), "the mounted tokenizer encodes differently"
    assert got.dtype == want.dtype and got.shape == want.shape == (2, 384)
    assert torch.equal(got, want), f"embeddings differ by up to {(got - want).abs().max()}"


@pytest.mark.timeout(180)
def test_model_folder_mounted_as_is(minilm_dir, original, mounts):
    mnt = mounts.mount(minilm_dir)
    for name in NON_WEIGHT_FILES:
        assert (mnt / name).read_bytes() == (minilm_dir / name).read_bytes(), name
    assert_same_embeddings(mnt, original)


@pytest.mark.timeout(180)
def test_folder_with_pytorch_model_bin(minilm_dir, original, mounts, tmp_path):
    model, _, _ = original
    folder = tmp_path / "minilm-bin"
    folder.mkdir()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    for name in NON_WEIGHT_FILES:
        shutil.copy2(minilm_dir / name, folder / name)
    mnt = mounts.mount(folder)
    # transformers finds the virtual model.safetensors; the .bin itself is not listed.
    names = {p.name for p in mnt.iterdir()}
    assert "model.safetensors" in names and "pytorch_model.bin" not in names
    assert_same_embeddings(mnt, original)
