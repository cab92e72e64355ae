"""Fixtures for tests/pypkg: the wheel built from pyproject.toml, installed into a fresh virtual
environment by run.sh (the `pypkg` CTest test), and the checkpoints it is tested on, each with
the reference its own library gives (torch.load, safetensors, DeepSpeed's zero_to_fp32, DCP's
dcp_to_torch_save).

Every test imports the installed `ckptfs`; `installed` fails the run if that is not the one
in the environment run.sh made (run the suite through run.sh, not from the source tree)."""

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckptfs
from ckptfs_checkpoints import package_checkpoint
from ckptfs_testlib import REPO_ROOT, flatten_tensors, served_form, zero_fixtures_root  # noqa: F401

sys.path.insert(0, str(REPO_ROOT / "tests" / "zero"))
from zerotools import ZeroCheckpoint  # noqa: E402

SAMPLE = REPO_ROOT / "tests" / "data" / "sample-mlp-training.pt"
DCP_FOLDERS = {"dcp-sample": REPO_ROOT / "tests" / "data" / "dcp-sample",
               "dcp-sharded": REPO_ROOT / "tests" / "data" / "dcp-sharded"}
# A ZeRO-2 save of two ranks: flat fp32 partitions whose tensors span both rank files.
ZERO_FIXTURE = "w2-s2-bf16"


@pytest.fixture(scope="session", autouse=True)
def installed() -> Path:
    """The fresh environment the wheel was installed into; the package under test must come
    from it, with its bundled library and binary."""
    venv = os.environ.get("CKPTFS_PYPKG_VENV")
    if not venv:
        pytest.fail("tests/pypkg runs against the installed wheel: run tests/pypkg/run.sh (ctest -R pypkg)",
                    pytrace=False)
    venv = Path(venv).resolve()
    for what, path in (("the package", ckptfs.__file__), ("libckptfs.so", ckptfs.library_path()),
                       ("the binary", ckptfs.executable_path())):
        assert Path(path).resolve().is_relative_to(venv), f"{what} comes from {path}, not from {venv}"
    return venv


@pytest.fixture(scope="session")
def pt_source(tmp_path_factory) -> tuple[Path, dict]:
    """(a torch.save file, {key: tensor} as torch.load reads it back)."""
    path = tmp_path_factory.mktemp("pt") / "mixed.pt"
    torch.save(package_checkpoint(), path)
    return path, flatten_tensors(torch.load(path, weights_only=True))


@pytest.fixture(scope="session")
def safetensors_source(tmp_path_factory) -> Path:
    """A safetensors file with metadata, written by safetensors."""
    state = {key: t.contiguous() for key, t in flatten_tensors(package_checkpoint()).items() if key != "model.tail"}
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file(state, path, metadata={"format": "pt", "origin": "tests/pypkg"})
    return path


@pytest.fixture(scope="session")
def zero_source(zero_fixtures_root) -> tuple[Path, dict]:
    """(a DeepSpeed save dir, {key: tensor} that DeepSpeed's zero_to_fp32 rebuilds)."""
    checkpoint = ZeroCheckpoint(ZERO_FIXTURE, zero_fixtures_root / ZERO_FIXTURE)
    return checkpoint.save_dir, checkpoint.expected


@pytest.fixture(scope="session")
def dcp_sources(tmp_path_factory) -> dict:
    """{name: (a DCP folder, {key: tensor} of torch's dcp_to_torch_save)}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = {}
    for name, folder in DCP_FOLDERS.items():
        converted = tmp_path_factory.mktemp("dcp") / f"{name}.pt"
        dcp_to_torch_save(folder, converted)
        out[name] = (folder, flatten_tensors(torch.load(converted, weights_only=True)))
    return out


@pytest.fixture(scope="session")
def sources(pt_source, safetensors_source, zero_source, dcp_sources) -> dict:
    """{name: (source, reference {key: tensor} as ckptfs serves it)} for every format."""
    from safetensors import safe_open as reference_open

    with reference_open(safetensors_source, framework="pt") as f:
        st_reference = {key: f.get_tensor(key) for key in f.keys()}
    got = {"pt": pt_source, "safetensors": (safetensors_source, st_reference), "zero": zero_source,
           "sample": (SAMPLE, flatten_tensors(torch.load(SAMPLE, weights_only=True)))}
    got.update(dcp_sources)
    return {name: (path, {k: served_form(t) for k, t in ref.items()}) for name, (path, ref) in got.items()}


def read_io_counter(name: str = "rchar") -> int:
    """This process's byte counter NAME from /proc/self/io (rchar: bytes that read and pread
    calls returned, page cache or not)."""
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            if key == name:
                return int(value)
    raise KeyError(name)


def mapped_file(address: int):
    """The file mapped at ADDRESS in this process (/proc/self/maps), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) == 6 else None
    return None
