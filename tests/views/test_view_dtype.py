"""`--dtype bf16|fp16|fp32` / `-o dtype=`: every floating tensor (F64, F32, F16, BF16, fp8) is
served as the real torch's `tensor.to(target)` computes it, bit for bit (NaN: a NaN bit
pattern torch itself produces, see viewtools.assert_converted_bytes); integer, bool and
complex tensors are untouched; headers, sizes, ls --json, info, manifest reflect the
converted dtypes."""

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptfs_testlib import flatten_tensors
from viewtools import (
    SAFETENSORS_DTYPE,
    TARGETS,
    assert_converted_bytes,
    converted,
    expected_nbytes,
    make_dtype_checkpoint,
    parse_safetensors,
)


@pytest.fixture(scope="module")
def dtype_ckpt(tmp_path_factory):
    """(path of the .pt, {key: tensor} as torch.load reads it back)."""
    path = tmp_path_factory.mktemp("dtype") / "dtypes.pt"
    make_dtype_checkpoint(path)
    return path, flatten_tensors(torch.load(path, weights_only=True))


@pytest.fixture(scope="module")
def exports(dtype_ckpt, run_ckptfs, tmp_path_factory):
    """{target name: export dir of `ckptfs export --dtype TARGET`} (made on first use)."""
    made = {}

    def get(target: str):
        if target not in made:
            out = tmp_path_factory.mktemp(f"export-{target}")
            run_ckptfs("export", "--write", "all", "--dtype", target, dtype_ckpt[0], out)
            made[target] = out
        return made[target]

    return get


def check_model_file(data: bytes, expected: dict, target, what: str) -> dict:
    """The served safetensors bytes DATA hold exactly EXPECTED's keys, each with the converted
    dtype, shape and bytes. Returns the parsed file."""
    parsed = parse_safetensors(data, what)
    assert set(parsed) == set(expected), (
        f"{what}: keys differ: missing {sorted(set(expected) - set(parsed))[:5]}, "
        f"extra {sorted(set(parsed) - set(expected))[:5]}"
    )
    for key, source in expected.items():
        want = converted(source, target)
        dtype, shape, raw = parsed[key]
        assert dtype == SAFETENSORS_DTYPE[want.dtype], (
            f"{what}[{key}]: header dtype {dtype}, expected {SAFETENSORS_DTYPE[want.dtype]} "
            f"({source.dtype} -> {target})"
        )
        assert shape == list(want.shape), f"{what}[{key}]: shape {shape} != {list(want.shape)}"
        assert_converted_bytes(raw, source, target, f"{what}[{key}]")
    return parsed


@pytest.mark.parametrize("target", list(TARGETS))
def test_export_bytes_equal_torch(target, dtype_ckpt, exports, ls_json):
    source, expected = dtype_ckpt
    out = exports(target)
    tgt = TARGETS[target]

    check_model_file((out / "model.safetensors").read_bytes(), expected, tgt, f"{target}/model.safetensors")

    entries = {e["key"]: e for e in ls_json(source)}
    for key, tensor in expected.items():
        f = out / entries[key]["file"]
        check_model_file(f.read_bytes(), {key: tensor}, tgt, f"{target}/{entries[key]['file']}")

    # The real loader accepts the converted file and sees the converted dtypes.
    loaded = load_file(out / "model.safetensors")
    for key, tensor in expected.items():
        assert loaded[key].dtype == converted(tensor, tgt).dtype, key


@pytest.mark.parametrize("target", list(TARGETS))
def test_listing_and_manifest_show_converted_dtypes(target, dtype_ckpt, exports, run_ckptfs):
    source, expected = dtype_ckpt
    tgt = TARGETS[target]
    out = exports(target)

    listed = json.loads(run_ckptfs("ls", "--json", "--dtype", target, source).stdout)
    assert [e["key"] for e in listed] == list(expected), "ls --json --dtype: keys or order differ"
    for entry in listed:
        source_tensor = expected[entry["key"]]
        want = converted(source_tensor, tgt)
        assert entry["dtype"] == SAFETENSORS_DTYPE[want.dtype], (entry["key"], entry["dtype"])
        assert entry["nbytes"] == expected_nbytes(want), (entry["key"], entry["nbytes"])
        assert entry["shape"] == list(want.shape), entry["key"]
        assert entry["torch_dtype"] == str(source_tensor.dtype).removeprefix("torch."), (
            f"{entry['key']}: torch_dtype is the dtype torch saved"
        )

    total = sum(expected_nbytes(converted(t, tgt)) for t in expected.values())
    info = json.loads(run_ckptfs("info", "--json", "--dtype", target, source).stdout)
    assert info["tensor_count"] == len(expected)
    assert info["total_bytes"] == total, f"info --json total_bytes {info['total_bytes']} != {total}"

    model = (out / "model.safetensors").read_bytes()
    manifest = json.loads((out / "manifest.json").read_text())
    by_key = {t["key"]: t for t in manifest["tensors"]}
    assert set(by_key) == set(expected)
    for key, source_tensor in expected.items():
        want = converted(source_tensor, tgt)
        entry = by_key[key]
        assert entry["dtype"] == SAFETENSORS_DTYPE[want.dtype], (key, entry["dtype"])
        assert entry["nbytes"] == expected_nbytes(want), (key, entry["nbytes"])
        assert entry["shape"] == list(want.shape), key
        assert entry["model_file"] == "model.safetensors", key
        start, end = entry["model_offsets"]
        assert end - start == entry["nbytes"], key
        assert_converted_bytes(model[start:end], source_tensor, tgt, f"manifest model_offsets of {key}")
        # A per-tensor file's size follows from the converted size.
        assert (out / entry["file"]).stat().st_size >= 8 + entry["nbytes"], key


@pytest.mark.parametrize("target", list(TARGETS))
def test_cat_serves_the_exported_bytes(target, dtype_ckpt, exports, run_ckptfs, ls_json):
    source, _ = dtype_ckpt
    out = exports(target)
    for vpath in ("model.safetensors", "manifest.json"):
        catted = run_ckptfs("cat", "--dtype", target, source, vpath).stdout
        assert catted == (out / vpath).read_bytes(), f"cat --dtype {target} {vpath} != exported"
    for entry in ls_json(source)[::5]:
        catted = run_ckptfs("cat", "--dtype", target, source, entry["file"]).stdout
        assert catted == (out / entry["file"]).read_bytes(), f"cat {entry['file']} != exported"


@pytest.mark.parametrize("target", list(TARGETS))
def test_safetensors_source(target, run_ckptfs, tmp_path):
    """The safetensors reader feeds the same conversion: a .safetensors file of every
    float dtype, converted, equals torch's conversion of what safetensors loads."""
    g = torch.Generator().manual_seed(5)
    values = torch.cat([
        torch.randn(3000, generator=g) * 1000,
        torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, 65520.0,
                      65519.0, 2.0**-25, 3.4028234663852886e38, 1e-45]),
    ])
    state = {
        "w.f64": values.double() * (1 + 2.0**-40),
        "w.f32": values,
        "w.f16": values.to(torch.float16),
        "w.bf16": values.to(torch.bfloat16),
        "w.f8_e4m3fn": torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn),
        "w.f8_e5m2": torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e5m2),
        "w.i32": torch.arange(-50, 50, dtype=torch.int32),
        "w.u8": torch.arange(0, 200, dtype=torch.int32).to(torch.uint8),
        "w.bool": torch.arange(0, 9) % 2 == 0,
    }
    # Only torch's canonical NaN in the sources (fp8 bit patterns otherwise hold others).
    for key in ("w.f8_e4m3fn", "w.f8_e5m2"):
        t = state[key]
        keep = ~torch.isnan(t.float())
        state[key] = torch.cat([t[keep], torch.tensor([float("nan")]).to(t.dtype)])
    src = tmp_path / "weights.safetensors"
    save_file(state, src)
    expected = load_file(src)
    out = tmp_path / "out"
    run_ckptfs("export", "--dtype", target, src, out)
    check_model_file((out / "model.safetensors").read_bytes(), expected, TARGETS[target],
                     f"safetensors source, {target}")


# --- mounts ----------------------------------------------------------------------------


def _xattr(path, name):
    return os.getxattr(path, name).decode()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("target", list(TARGETS))
def test_mount_serves_converted_files(target, dtype_ckpt, exports, mounts, ls_json):
    source, expected = dtype_ckpt
    tgt = TARGETS[target]
    out = exports(target)
    mnt = mounts.mount(source, f"dtype={target}")

    names = sorted(p.name for p in mnt.iterdir())
    assert "model.safetensors" in names and "tensors" in names, names

    model = mnt / "model.safetensors"
    want_model = (out / "model.safetensors").read_bytes()
    assert model.stat().st_size == len(want_model), "st_size of the converted model.safetensors"
    data = model.read_bytes()
    check_model_file(data, expected, tgt, f"mount dtype={target}: model.safetensors")
    assert data == want_model, "the mount and `export --dtype` serve different model.safetensors"

    # Partial reads at unaligned offsets and lengths (conversion of element ranges that start
    # and end inside an element, across buffer boundaries).
    rng = random.Random(11)
    fd = os.open(model, os.O_RDONLY)
    try:
        for _ in range(300):
            off = rng.randrange(0, len(want_model))
            n = rng.choice([1, 3, 7, 4093, 65537, 1 << 20, (1 << 20) + 5])
            got = os.pread(fd, n, off)
            assert got == want_model[off : off + n], f"pread({n} bytes at {off}) differs"
        assert os.pread(fd, 100, len(want_model)) == b"", "read past the end"
    finally:
        os.close(fd)

    # Every per-tensor file: size, bytes, dtype xattr.
    for entry in ls_json(source):
        key = entry["key"]
        f = mnt / entry["file"]
        want = (out / entry["file"]).read_bytes()
        assert f.stat().st_size == len(want), f"st_size of {entry['file']}"
        got = f.read_bytes()
        check_model_file(got, {key: expected[key]}, tgt, f"mount dtype={target}: {entry['file']}")
        assert got == want, f"{entry['file']}: mount and export differ"
        assert _xattr(f, "user.ckptfs.dtype") == SAFETENSORS_DTYPE[converted(expected[key], tgt).dtype], key

    manifest = (mnt / "manifest.json").read_bytes()
    assert (mnt / "manifest.json").stat().st_size == len(manifest)
    assert json.loads(manifest)["tensors"] == json.loads((out / "manifest.json").read_text())["tensors"], (
        "the mount's manifest.json tensor entries differ from `export --dtype`'s"
    )

    # mmap readers (safetensors' load_file) see the same converted tensors.
    loaded = load_file(model)
    for key in ("floats.f16", "floats.f64", "views.window_f16", "views.big_f64", "ints.i64"):
        assert_converted_bytes(
            loaded[key].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
            expected[key], tgt, f"mount dtype={target}: load_file[{key}]",
        )
