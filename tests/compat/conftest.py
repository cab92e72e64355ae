"""Shared fixtures for the compatibility tests: run the real ckptfs binary, export a source,
and check the exported files with the real safetensors and torch loaders."""

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BIN = REPO_ROOT / "build" / "ckptfs"
COMMAND_TIMEOUT_S = 60

# torch dtype -> the safetensors dtype ckptfs serves it as (doc/CLI.md).
SERVED_DTYPE = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    # safetensors has no name for these: served as their real view with a trailing 2.
    torch.complex128: "F64",
    torch.complex32: "F16",
}


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def served_form(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as ckptfs serves it: complex128/complex32 become their real view."""
    if tensor.dtype in (torch.complex128, torch.complex32):
        return torch.view_as_real(tensor)
    return tensor


def flatten_tensors(obj, path=()) -> dict:
    """{flattened key: (path, tensor)} for every tensor in a nested checkpoint, keyed the way
    doc/CLI.md flattens them (containers joined with '.', ints in decimal)."""
    if isinstance(obj, torch.Tensor):
        return {".".join(str(p) for p in path): (list(path), obj)}
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {}
    flat = {}
    for name, value in items:
        flat.update(flatten_tensors(value, path + (name,)))
    return flat


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same dtype, same shape, same bytes (NaN payloads and -0.0 included)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    # reshape(-1) first: a 0-dim tensor cannot be viewed as bytes directly.
    actual_bytes = actual.contiguous().reshape(-1).view(torch.uint8)
    expected_bytes = expected.contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(actual_bytes, expected_bytes):
        differing = (actual_bytes != expected_bytes).nonzero().flatten()
        raise AssertionError(
            f"{what}: {differing.numel()} of {expected_bytes.numel()} bytes differ, "
            f"first at byte {int(differing[0])}"
        )


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return length, json.loads(f.read(length))


def json_strings(node) -> set:
    """Every string (dict keys included) anywhere in a JSON document."""
    if isinstance(node, str):
        return {node}
    if isinstance(node, dict):
        found = set(node)
        for value in node.values():
            found |= json_strings(value)
        return found
    if isinstance(node, list):
        return set().union(*(json_strings(v) for v in node)) if node else set()
    return set()


def json_dicts(node):
    """Every JSON object anywhere in a document, depth first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from json_dicts(value)
    elif isinstance(node, list):
        for value in node:
            yield from json_dicts(value)


def ckptfs_path() -> Path:
    return Path(os.environ.get("CKPTFS_BIN", DEFAULT_BIN))


@pytest.fixture(scope="session")
def ckptfs_bin() -> Path:
    path = ckptfs_path()
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            f"ckptfs binary not found at {path}: build it with "
            f"'cmake -S {REPO_ROOT} -B {REPO_ROOT}/build && cmake --build {REPO_ROOT}/build' "
            "or point CKPTFS_BIN at it",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def run_ckptfs(ckptfs_bin):
    """run_ckptfs(*args, check=True) -> CompletedProcess with bytes stdout/stderr.

    The timeout turns a hang into a test failure instead of a stuck suite."""

    def run(*args, check: bool = True) -> subprocess.CompletedProcess:
        argv = [str(ckptfs_bin), *map(str, args)]
        result = subprocess.run(argv, capture_output=True, timeout=COMMAND_TIMEOUT_S)
        if check and result.returncode != 0:
            pytest.fail(
                f"{' '.join(argv)} exited {result.returncode}:\n"
                f"{result.stderr.decode(errors='replace')}",
                pytrace=False,
            )
        return result

    return run


@pytest.fixture(scope="session")
def ls_json(run_ckptfs):
    """ls_json(source) -> the parsed `ckptfs ls --json SOURCE` array."""

    def ls(source) -> list:
        entries = json.loads(run_ckptfs("ls", "--json", source).stdout)
        assert isinstance(entries, list), "ls --json must print a JSON array"
        return entries

    return ls


@pytest.fixture
def export_source(run_ckptfs, tmp_path_factory):
    """export_source(source) -> a fresh directory holding `ckptfs export SOURCE DIR`."""

    def export(source) -> Path:
        out = tmp_path_factory.mktemp("export")
        run_ckptfs("export", source, out)
        return out

    return export


@pytest.fixture
def verify_export(run_ckptfs, ls_json, export_source):
    """verify_export(source, expected) exports SOURCE and checks every served tensor against
    `expected` (a nested checkpoint or a flat dict, as torch/safetensors loaded it) bit for bit,
    through load_file and safe_open, in model.safetensors and in every per-tensor file.

    Returns (export dir, ls --json entries by key) for test-specific checks."""

    def verify(source, expected) -> tuple[Path, dict]:
        flat = flatten_tensors(expected)
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
        model = out / "model.safetensors"
        check_safetensors_file(model, want)

        # Each per-tensor file holds exactly its one tensor, under its key.
        for key, entry in by_key.items():
            check_safetensors_file(out / entry["file"], {key: want[key]})
        listed = {out / entry["file"] for entry in entries}
        on_disk = set((out / "tensors").rglob("*.safetensors"))
        assert on_disk == listed, "tensors/ differs from the files ls --json names"

        # cat serves the same bytes that export wrote.
        for vpath in ("model.safetensors", "manifest.json", "metadata.json"):
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


def check_safetensors_file(path: Path, want: dict) -> None:
    """Load PATH with both safetensors entry points and compare with WANT bit for bit."""
    header_len, header = read_safetensors_header(path)
    # transformers refuses files without format=pt; the writer pads the header to 8 bytes.
    assert header.get("__metadata__", {}).get("format") == "pt", f"{path.name}: format != pt"
    assert header_len % 8 == 0, f"{path.name}: header length {header_len} not a multiple of 8"

    loaded = load_file(path)
    assert set(loaded) == set(want), f"{path.name}: keys differ"
    for key, tensor in want.items():
        assert_bitwise_equal(loaded[key], tensor, f"{path.name}[{key}] via load_file")

    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == set(want)
        for key, tensor in want.items():
            assert_bitwise_equal(f.get_tensor(key), tensor, f"{path.name}[{key}] via safe_open")
            # Partial reads go through get_slice; exercise them on 2-D tensors.
            if tensor.dim() == 2 and tensor.shape[0] > 1 and tensor.shape[1] > 1:
                part = f.get_slice(key)
                assert part.get_shape() == list(tensor.shape)
                assert_bitwise_equal(
                    part[1:, : tensor.shape[1] - 1],
                    tensor[1:, : tensor.shape[1] - 1],
                    f"{path.name}[{key}] via get_slice",
                )
