"""Shared fixtures for the compatibility tests: run the real ckptfs binary, export a source,
and check the exported files with the real safetensors and torch loaders."""

import json
from pathlib import Path

import pytest
import torch

from ckptfs_testlib import (  # noqa: F401  (re-exported to the test modules)
    assert_bitwise_equal,
    check_safetensors_file,
    ckptfs_bin,
    ls_json,
    flatten_tensors_with_paths,
    json_strings,
    read_safetensors_header,
    run_ckptfs,
    served_form,
    SERVED_DTYPE,
)


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.fixture
def export_source(run_ckptfs, tmp_path_factory):
    """export_source(source) -> a fresh directory holding `ckptfs export SOURCE DIR`."""

    def export(source) -> Path:
        out = tmp_path_factory.mktemp("export")
        run_ckptfs("export", "--write", "all", source, out)
        return out

    return export


@pytest.fixture
def verify_export(run_ckptfs, ls_json, export_source):
    """verify_export(source, expected) exports SOURCE and checks every served tensor against
    `expected` (a nested checkpoint or a flat dict, as torch/safetensors loaded it) bit for bit,
    through load_file and safe_open, in model.safetensors and in every per-tensor file.

    Returns (export dir, ls --json entries by key) for test-specific checks."""

    def verify(source, expected) -> tuple[Path, dict]:
        flat = flatten_tensors_with_paths(expected)
        assert flat, "the expected checkpoint must contain tensors"
        want = {key: served_form(tensor) for key, (_, tensor) in flat.items()}

        entries = ls_json(source)
        by_key = {entry["key"]: entry for entry in entries}
        assert len(by_key) == len(entries), "ls --json lists a key twice"
        assert set(by_key) == set(want)
        for key, (path, tensor) in flat.items():
            entry = by_key[key]
            served = want[key]
            assert entry["path"] == path, key
            assert entry["torch_dtype"] == torch_dtype_name(tensor.dtype), key
            assert entry["dtype"] == SERVED_DTYPE[tensor.dtype], key
            assert entry["shape"] == list(served.shape), key
            assert entry["nbytes"] == served.numel() * served.element_size(), key

        out = export_source(source)
        # The model file a loader opens (manifest.json): model.safetensors, or the source's
        # own shards and index for a sharded folder (doc/MOUNT.md, "Weight file names").
        model_file = json.loads((out / "manifest.json").read_text())["model_file"]
        model_files = [model_file]
        if model_file.endswith(".index.json"):
            weight_map = json.loads((out / model_file).read_text())["weight_map"]
            assert set(weight_map) == set(want), f"{model_file} maps other keys"
            for shard in sorted(set(weight_map.values())):
                check_safetensors_file(out / shard, {k: want[k] for k, s in weight_map.items() if s == shard})
                model_files.append(shard)
        else:
            check_safetensors_file(out / model_file, want)

        # Each per-tensor file holds exactly its one tensor, under its key.
        for key, entry in by_key.items():
            check_safetensors_file(out / entry["file"], {key: want[key]})
        listed = {out / entry["file"] for entry in entries}
        on_disk = set((out / "tensors").rglob("*.safetensors"))
        assert on_disk == listed, "tensors/ differs from the files ls --json names"

        # cat serves the same bytes that export wrote.
        for vpath in (*model_files, "manifest.json", "metadata.json"):
            catted = run_ckptfs("cat", source, vpath).stdout
            assert catted == (out / vpath).read_bytes(), f"cat {vpath} != exported {vpath}"

        manifest = json.loads((out / "manifest.json").read_text())
        manifest_strings = json_strings(manifest)
        assert set(want) <= manifest_strings, "manifest.json misses keys"
        assert {entry["file"] for entry in entries} <= manifest_strings, (
            "manifest.json misses per-tensor file names"
        )
        json.loads((out / "metadata.json").read_text())
        return out, by_key

    return verify
