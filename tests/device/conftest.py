"""Fixtures for tests/device: checkpoints of every format ckptfs reads, loaded to a device by
`ckptfs load` and by the Python entry point `ckptfs.load` (python/ckptfs, over libckptfs.so).

Without a GPU everything runs on the host back end (the same pipeline: pinned-buffer ring,
asynchronous copies by worker threads); the GPU tests skip with the reason. The ZeRO
checkpoints are two of the real DeepSpeed saves of tests/zero (make_zero_checkpoints.py), from
the machine's fixture cache (tests/ckptfs_fixture_cache.py)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

SUITE_DIR = Path(__file__).resolve().parent
TESTS_DIR = SUITE_DIR.parent
sys.path.insert(0, str(TESTS_DIR.parent / "python"))

from ckptfs_testlib import REPO_ROOT, ckptfs_bin, ls_json, run_ckptfs, zero_fixtures_root  # noqa: E402,F401  (shared fixtures)

ZERO_FIXTURES = ("w2-s2-fp16", "w2-s3-fp32")


@pytest.fixture(scope="session", autouse=True)
def ckptfs_library():
    """libckptfs.so beside the binary under test (CKPTFS_BUILD_DIR, else the binary's folder)."""
    if "CKPTFS_LIB" not in os.environ:
        build = os.environ.get("CKPTFS_BUILD_DIR") or str(Path(os.environ.get("CKPTFS_BIN", REPO_ROOT / "build" / "ckptfs")).parent)
        os.environ["CKPTFS_LIB"] = str(Path(build) / "libckptfs.so")
    lib = Path(os.environ["CKPTFS_LIB"])
    if not lib.is_file():
        pytest.fail(f"libckptfs.so not found at {lib}: build the ckptfs_shared target", pytrace=False)
    return lib


@pytest.fixture(scope="session", autouse=True)
def active_environment():
    """The test environment as the active one ($VIRTUAL_ENV), as a user's shell has it: `ckptfs
    load` (a program outside any environment) finds the CUDA runtime of torch's NVIDIA wheels
    there. CTest runs the environment's python without activating it."""
    with pytest.MonkeyPatch.context() as patch:
        if sys.prefix != sys.base_prefix:
            patch.setenv("VIRTUAL_ENV", sys.prefix)
        yield


def _torch_checkpoint() -> dict:
    g = torch.Generator().manual_seed(8)
    big = torch.randn(300, 257, generator=g)  # about 300 KiB: many 4 KiB buffers
    emb = torch.randn(37, 10, generator=g)
    return {
        "model": {
            "emb.weight": emb,
            "out.weight": emb,  # tied: one storage, two keys
            "big": big,
            "big_t": big.t(),  # non-contiguous (strided) view of the same storage
            "every_other": torch.randn(64, 40, generator=g)[:, ::2],  # non-contiguous, own storage
            "half": torch.randn(333, generator=g).half(),
            "bf": torch.randn(1001, generator=g).bfloat16(),
            "double": torch.randn(17, 3, generator=g).double(),
            "ids": torch.arange(1000, dtype=torch.int64),
            "mask": torch.rand(99, generator=g) > 0.5,
            "scalar": torch.tensor(3.25),
            "empty": torch.zeros(0, 4),
        },
        "step": 12,
    }


@pytest.fixture(scope="session")
def sources(tmp_path_factory, zero_fixtures_root) -> dict:
    """{name: (path, torch reference state dict or None)} for every source kind."""
    root = tmp_path_factory.mktemp("device-sources")
    ck = _torch_checkpoint()
    pt = root / "ck.pt"
    torch.save(ck, pt)
    model = {k: v.contiguous().clone() for k, v in ck["model"].items() if k != "out.weight"}
    st = root / "model.safetensors"
    save_file(model, st)
    sharded = root / "sharded"
    sharded.mkdir()
    keys = sorted(model)
    shards = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    weight_map = {}
    for i, part in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: model[k] for k in part}, sharded / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    flat = {f"model.{k}": v for k, v in ck["model"].items()}
    return {
        "pt": (pt, flat),
        "safetensors": (st, model),
        "sharded": (sharded, model),
        "zero2": (zero_fixtures_root / ZERO_FIXTURES[0] / "checkpoint", None),
        "zero3": (zero_fixtures_root / ZERO_FIXTURES[1] / "checkpoint", None),
    }
