"""Checkpoints written by the real torch.save, exported by ckptfs, read back by safetensors."""

import argparse
import ctypes
import ctypes.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ckptfs_testlib import ALL_DTYPES, assert_bitwise_equal, json_dicts

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample-mlp-training.pt"


def save_and_load(obj, path: Path):
    """torch.save OBJ to PATH and return what torch.load reads back (the reference)."""
    torch.save(obj, path)
    return torch.load(path, weights_only=True)


def random_bits(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of DTYPE whose bytes are random, so NaN payloads, infinities, -0.0 and
    subnormals all occur and any conversion on the way would show."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(seed)).bool()
    itemsize = dtype.itemsize
    numel = torch.Size(shape).numel()
    raw = torch.randint(
        0,
        256,
        (numel * itemsize,),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(seed),
    )
    return raw.view(dtype).reshape(shape)


def training_checkpoint() -> dict:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.BatchNorm1d(16), nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4)
    for _ in range(2):
        loss = model(torch.randn(4, 8)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": 3,
        "step": 200,
        "buffers": [torch.arange(5), (torch.ones(2), torch.zeros(3, dtype=torch.int8))],
        "config": {"lr": 3e-4, "name": "demo"},
    }


def find_dict_with(document, **items):
    """The first JSON object in DOCUMENT holding all ITEMS, or None."""
    return next(
        (d for d in json_dicts(document) if all(k in d and d[k] == v for k, v in items.items())),
        None,
    )


def test_flat_state_dict(tmp_path, verify_export):
    torch.manual_seed(0)
    state = {
        "embed.weight": torch.randn(100, 32),
        "layers.0.weight": torch.randn(32, 32),
        "layers.0.bias": torch.randn(32),
        "head.weight": torch.randn(10, 32).half(),
        # Larger than any plausible read buffer, to cross chunk boundaries.
        "big": torch.randn(1 << 20),
    }
    src = tmp_path / "flat.pt"
    verify_export(src, save_and_load(state, src))


def test_bin_extension(tmp_path, verify_export):
    # Hugging Face names torch checkpoints pytorch_model.bin.
    src = tmp_path / "pytorch_model.bin"
    verify_export(src, save_and_load({"w": torch.randn(4, 4)}, src))


def test_saved_to_a_buffer(tmp_path, verify_export):
    # torch.save to a file object names the zip's folder "archive", not after the file.
    src = tmp_path / "buffered.pt"
    with open(src, "wb") as f:
        torch.save({"w": torch.randn(3, 5)}, f)
    verify_export(src, torch.load(src, weights_only=True))


def test_nested_training_checkpoint(tmp_path, verify_export):
    src = tmp_path / "train.pt"
    expected = save_and_load(training_checkpoint(), src)
    out, entries = verify_export(src, expected)

    # Adam's state is keyed by int parameter index: the key is decimal, the path keeps the int.
    assert entries["optimizer.state.0.exp_avg"]["path"] == ["optimizer", "state", 0, "exp_avg"]
    assert entries["optimizer.state.0.step"]["shape"] == []
    assert entries["model.2.num_batches_tracked"]["dtype"] == "I64"
    assert entries["buffers.1.1"]["path"] == ["buffers", 1, 1]

    metadata = json.loads((out / "metadata.json").read_text())
    assert find_dict_with(metadata, epoch=3, step=200), "epoch/step missing from metadata.json"
    assert find_dict_with(metadata, lr=3e-4, name="demo"), "config missing from metadata.json"
    group = find_dict_with(metadata, lr=3e-4, betas=[0.9, 0.999])
    assert group, "optimizer param_groups missing from metadata.json"
    assert group["params"] == expected["optimizer"]["param_groups"][0]["params"]


def test_bundled_sample(verify_export):
    expected = torch.load(SAMPLE, weights_only=True)
    out, entries = verify_export(SAMPLE, expected)
    assert len(entries) == 6 + 6 * 3  # six parameters, each with step/exp_avg/exp_avg_sq
    metadata = json.loads((out / "metadata.json").read_text())
    assert find_dict_with(metadata, epoch=3, step=200)
    assert find_dict_with(metadata, lr=1e-3, name="demo")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_dtype(tmp_path, verify_export, dtype):
    state = {
        "matrix": random_bits((5, 7), dtype, seed=1),
        "vector": random_bits((3,), dtype, seed=2),
    }
    src = tmp_path / "dtype.pt"
    verify_export(src, save_and_load(state, src))


def test_all_dtypes_in_one_file(tmp_path, verify_export):
    # Mixed item sizes in one model.safetensors: offsets must stay exact across them.
    state = {str(dtype): random_bits((3, 5), dtype, seed=i) for i, dtype in enumerate(ALL_DTYPES)}
    src = tmp_path / "mixed.pt"
    verify_export(src, save_and_load(state, src))


def test_complex_served_as_real_view(tmp_path, verify_export):
    src = tmp_path / "complex.pt"
    state = {
        "z128": torch.randn(4, 3, dtype=torch.complex128),
        "z32": torch.randn(2, 3, dtype=torch.complex64).to(torch.complex32),
    }
    expected = save_and_load(state, src)
    out, entries = verify_export(src, expected)
    assert entries["z128"]["shape"] == [4, 3, 2]
    assert entries["z32"]["shape"] == [2, 3, 2]
    # torch.view_as_complex restores the originals exactly.
    served = load_file(out / "model.safetensors")
    assert torch.equal(torch.view_as_complex(served["z128"]), expected["z128"])
    assert_bitwise_equal(torch.view_as_complex(served["z32"]), expected["z32"], "z32")


def test_tied_weights(tmp_path, verify_export):
    shared = torch.randn(50, 8)
    src = tmp_path / "tied.pt"
    expected = save_and_load({"embed.weight": shared, "lm_head.weight": shared}, src)
    assert expected["embed.weight"].untyped_storage().data_ptr() == (
        expected["lm_head.weight"].untyped_storage().data_ptr()
    ), "torch.save must have written one storage for both keys"
    # Both keys must be served, each with its own byte range (safetensors rejects overlaps).
    verify_export(src, expected)


def test_transposed_tensor(tmp_path, verify_export):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    src = tmp_path / "transposed.pt"
    expected = save_and_load({"t": base.t()}, src)
    assert not expected["t"].is_contiguous()
    verify_export(src, expected)


def test_slice_with_storage_offset(tmp_path, verify_export):
    big = torch.randn(10, 4)
    src = tmp_path / "slice.pt"
    expected = save_and_load({"part": big[3:7]}, src)
    assert expected["part"].storage_offset() == 12
    verify_export(src, expected)


def test_views_sharing_one_storage(tmp_path, verify_export):
    # The whole tensor, an offset slice and a strided column view all share one storage.
    big = torch.randn(10, 4)
    src = tmp_path / "views.pt"
    expected = save_and_load(
        {
            "whole": big,
            "rows": big[3:7],
            "columns": big[:, 1::2],
            "viewed": big[2:8].reshape(4, 6).t(),
        },
        src,
    )
    verify_export(src, expected)


def test_broadcast_view_with_zero_stride(tmp_path, verify_export):
    src = tmp_path / "expanded.pt"
    expected = save_and_load({"expanded": torch.randn(3).expand(4, 3)}, src)
    assert expected["expanded"].stride() == (0, 1)
    verify_export(src, expected)


def test_scalar(tmp_path, verify_export):
    src = tmp_path / "scalar.pt"
    out, entries = verify_export(src, save_and_load({"scale": torch.tensor(3.5)}, src))
    assert entries["scale"]["shape"] == []


@pytest.mark.parametrize("shape", [(0,), (3, 0)], ids=["0", "3x0"])
def test_empty_tensor(tmp_path, verify_export, shape):
    src = tmp_path / "empty.pt"
    # A non-empty neighbour makes sure the empty one does not disturb the offsets.
    state = {"empty": torch.empty(shape), "next": torch.randn(2, 2)}
    out, entries = verify_export(src, save_and_load(state, src))
    assert entries["empty"]["nbytes"] == 0


def test_key_escaping(tmp_path, verify_export):
    src = tmp_path / "escaping.pt"
    state = {"w/x": torch.randn(2, 3), "100%/ok": torch.randn(3), "a.b": torch.randn(1)}
    out, entries = verify_export(src, save_and_load(state, src))
    assert entries["w/x"]["file"] == "tensors/w%2Fx.safetensors"
    assert entries["100%/ok"]["file"] == "tensors/100%25%2Fok.safetensors"
    assert entries["a.b"]["file"] == "tensors/a.b.safetensors"


def xxh3_64(data: bytes):
    """XXH3-64 from the system libxxhash (the library ckptfs itself links), or None."""
    name = ctypes.util.find_library("xxhash")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    lib.XXH3_64bits.restype = ctypes.c_uint64
    lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return lib.XXH3_64bits(data, len(data))


def test_long_key_is_shortened(tmp_path, verify_export):
    # 2-byte characters make the cut land where a naive byte cut would split one.
    key = "layer.x" + "é" * 150
    src = tmp_path / "long.pt"
    out, entries = verify_export(src, save_and_load({key: torch.randn(2)}, src))

    name = entries[key]["file"].removeprefix("tensors/")
    assert len(name.encode()) <= 255
    match = re.fullmatch(r"(.*)~([0-9a-fA-F]{16})\.safetensors", name, flags=re.S)
    assert match, f"shortened name {name!r} lacks ~<16 hex> before the suffix"
    prefix, digest = match.groups()
    assert key.startswith(prefix)
    # As long as fits: 255 - len("~" + 16 hex + ".safetensors") = 226 bytes, minus a split char.
    assert len(prefix.encode()) >= 226 - 1
    expected_hash = xxh3_64(key.encode())
    if expected_hash is None:
        pytest.skip("libxxhash not installed: cannot check the hash value")
    assert int(digest, 16) == expected_hash


def test_parameters_saved_directly(tmp_path, verify_export):
    weight = nn.Parameter(torch.randn(3, 4))
    weight.tag = "with python state"  # takes the _rebuild_parameter_with_state path
    frozen = nn.Parameter(torch.randn(4), requires_grad=False)
    src = tmp_path / "params.pt"
    expected = save_and_load({"weight": weight, "frozen": frozen}, src)
    assert isinstance(expected["weight"], nn.Parameter)
    verify_export(src, expected)


def test_tensor_with_python_attribute(tmp_path, verify_export):
    # A plain tensor carrying Python state is pickled through _rebuild_from_type_v2.
    tensor = torch.randn(4, 2)
    tensor.note = "calibrated"
    src = tmp_path / "attribute.pt"
    verify_export(src, save_and_load({"w": tensor}, src))


@pytest.mark.parametrize("protocol", [4, 5])
def test_newer_pickle_protocols(tmp_path, verify_export, protocol):
    # torch.save(pickle_protocol=N) is public API; 4+ brings FRAME, MEMOIZE, SHORT_BINUNICODE.
    src = tmp_path / f"protocol{protocol}.pt"
    torch.save(training_checkpoint(), src, pickle_protocol=protocol)
    # weights_only refuses those opcodes; the file is our own, so a full load is safe.
    verify_export(src, torch.load(src, weights_only=False))


def test_non_tensor_python_objects(tmp_path, verify_export):
    # Real checkpoints carry argparse args, numpy values, sets and bytes beside the tensors.
    # They are data to ckptfs (never imported) and must not stop the tensors being served.
    checkpoint = {
        "model": {"w": torch.randn(3, 3)},
        "args": argparse.Namespace(lr=0.1, name="run"),
        "best_loss": np.float64(0.25),
        "seen": {1, 2},
        "blob": b"\x00\x01",
        "array": np.arange(3),
    }
    src = tmp_path / "objects.pt"
    torch.save(checkpoint, src)
    out, _ = verify_export(src, torch.load(src, weights_only=False))
    metadata = json.loads((out / "metadata.json").read_text())
    assert find_dict_with(metadata, lr=0.1, name="run"), "argparse values missing from metadata"


def test_many_tensors(tmp_path, verify_export):
    # Over 256 memo entries (LONG_BINPUT) and over 1000 items per dict (batched SETITEMS).
    state = {f"layers.{i}.weight": torch.full((2,), float(i)) for i in range(1500)}
    src = tmp_path / "many.pt"
    verify_export(src, save_and_load(state, src))


def test_more_than_65535_records(tmp_path, ls_json, export_source):
    # 70000 storages: the zip needs zip64 for its entry count. Per-tensor files are not
    # checked one by one here; the other tests cover them.
    state = {f"t{i}": torch.full((1,), float(i)) for i in range(70000)}
    src = tmp_path / "huge-directory.pt"
    torch.save(state, src)
    assert len(ls_json(src)) == len(state)
    served = load_file(export_source(src) / "model.safetensors")
    assert set(served) == set(state)
    for key, tensor in state.items():
        assert torch.equal(served[key], tensor), key


def test_checkpoint_without_tensors(tmp_path, ls_json, export_source):
    src = tmp_path / "config-only.pt"
    torch.save({"epoch": 3, "config": {"lr": 0.5, "name": "demo"}}, src)
    assert ls_json(src) == []
    out = export_source(src)
    assert load_file(out / "model.safetensors") == {}
    metadata = json.loads((out / "metadata.json").read_text())
    assert find_dict_with(metadata, epoch=3)
    assert find_dict_with(metadata, lr=0.5, name="demo")


def test_unusual_source_path(tmp_path, verify_export):
    # Spaces and non-ASCII in the path; torch then names the zip folder "archive".
    src = tmp_path / "run 1 – été.pt"
    verify_export(src, save_and_load({"w": torch.randn(2, 2)}, src))


def test_key_with_nul_byte(tmp_path, run_ckptfs, verify_export):
    # No file name can hold NUL: ckptfs must escape it (or refuse the source cleanly),
    # never name a file it cannot create.
    src = tmp_path / "nul.pt"
    expected = save_and_load({"a\0b": torch.randn(2), "a": torch.randn(3)}, src)
    result = run_ckptfs("ls", "--json", src, check=False)
    if result.returncode == 1:
        assert len(result.stderr.splitlines()) == 1, result.stderr
        return
    entries = {entry["key"]: entry for entry in json.loads(result.stdout)}
    assert "\0" not in entries["a\0b"]["file"], "file name contains NUL"
    verify_export(src, expected)
