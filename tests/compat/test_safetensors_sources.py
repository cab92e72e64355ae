"""safetensors sources (one file, a sharded folder, a plain folder) exported by ckptfs."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ckptfs_testlib import assert_bitwise_equal


def sample_tensors(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{seed}.attn.q_proj.weight": torch.randn(16, 8, generator=generator),
        f"model.layers.{seed}.attn.q_proj.bias": torch.randn(16, generator=generator).bfloat16(),
        f"model.layers.{seed}.norm.weight": torch.randn(8, generator=generator).half(),
        f"model.layers.{seed}.mask": torch.randint(0, 2, (3, 4), generator=generator).bool(),
        f"model.layers.{seed}.ids": torch.randint(-100, 100, (5,), generator=generator),
        f"model.layers.{seed}.fp8": torch.randn(4, 4, generator=generator).to(torch.float8_e4m3fn),
        f"model.layers.{seed}.scale": torch.tensor(0.5),
        f"model.layers.{seed}.empty": torch.empty(0, 4),
    }


def write_sharded(folder: Path, shards: list) -> None:
    """Write SHARDS the way transformers' save_pretrained does: numbered files plus an index."""
    folder.mkdir()
    weight_map, total_size = {}, 0
    for i, tensors in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, folder / name, metadata={"format": "pt"})
        for key, tensor in tensors.items():
            weight_map[key] = name
            total_size += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def test_single_file(tmp_path, verify_export):
    src = tmp_path / "model.safetensors"
    save_file(sample_tensors(0), src, metadata={"format": "pt", "note": "kept as is"})
    verify_export(src, load_file(src))


def test_single_file_without_metadata(tmp_path, verify_export):
    # save_file without metadata writes no __metadata__; the served files must still say pt.
    src = tmp_path / "bare.safetensors"
    save_file({"w": torch.randn(3, 3)}, src)
    verify_export(src, load_file(src))


def test_sharded_folder(tmp_path, verify_export):
    shards = [sample_tensors(0), sample_tensors(1) | {"lm_head.weight": torch.randn(32, 8)}]
    src = tmp_path / "sharded"
    write_sharded(src, shards)
    expected = {key: value for shard in shards for key, value in shard.items()}
    verify_export(src, expected)


def test_folder_without_index(tmp_path, verify_export):
    src = tmp_path / "loose"
    src.mkdir()
    save_file(sample_tensors(0), src / "encoder.safetensors")
    save_file(sample_tensors(1), src / "decoder.safetensors")
    save_file(sample_tensors(2), src / "head.safetensors")
    expected = sample_tensors(0) | sample_tensors(1) | sample_tensors(2)
    verify_export(src, expected)


def test_source_tensors_equal_originals(tmp_path, export_source):
    # Against the in-memory originals, not only against what safetensors reads back.
    originals = sample_tensors(7)
    src = tmp_path / "model.safetensors"
    save_file(originals, src)
    served = load_file(export_source(src) / "model.safetensors")
    assert set(served) == set(originals)
    for key, tensor in originals.items():
        assert_bitwise_equal(served[key], tensor, key)
