"""The real transformers loads all-MiniLM-L6-v2 from a mount, both from the published model
folder and from a folder holding only a torch.save'd pytorch_model.bin, and computes exactly
the embeddings of the original model."""

import shutil

import pytest
import torch

SENTENCES = [
    "ckptfs mounts checkpoints read-only.",
    "A quick brown fox jumps over the lazy dog, twice!",
]
# What a model folder needs besides its weights.
NON_WEIGHT_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)


def load(folder):
    from transformers import AutoModel, AutoTokenizer

    model, info = AutoModel.from_pretrained(str(folder), output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), f"{folder}: {kind}: {info.get(kind)}"
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return model.eval(), tokenizer


def embed(model, tokenizer):
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return batch["input_ids"], (hidden * mask).sum(1) / mask.sum(1)


@pytest.fixture(scope="module")
def original(minilm_dir):
    model, tokenizer = load(minilm_dir)
    ids, emb = embed(model, tokenizer)
    return model, ids, emb


def assert_same_embeddings(folder, original):
    _, want_ids, want = original
    model, tokenizer = load(folder)
    ids, got = embed(model, tokenizer)
    assert torch.equal(ids, want_ids), "the mounted tokenizer encodes differently"
    assert got.dtype == want.dtype and got.shape == want.shape == (2, 384)
    assert torch.equal(got, want), f"embeddings differ by up to {(got - want).abs().max()}"


@pytest.mark.body_timeout(180)
def test_model_folder_mounted_as_is(minilm_dir, original, mounts):
    mnt = mounts.mount(minilm_dir)
    for name in NON_WEIGHT_FILES:
        assert (mnt / name).read_bytes() == (minilm_dir / name).read_bytes(), name
    assert_same_embeddings(mnt, original)


@pytest.mark.body_timeout(180)
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
