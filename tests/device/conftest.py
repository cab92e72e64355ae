"""Fixtures for tests/device: checkpoints of every format ckptfs reads, loaded to a device by
`ckptfs load` and by the Python entry point `ckptfs.load` (python/ckptfs, over libckptfs.so).

Without a GPU everything runs on the host back end (the same pipeline: pinned-buffer ring,
asynchronous copies by worker threads); the GPU tests skip with the reason (fail, under
CKPTFS_REQUIRE_GPU=1). The checkpoints are device_sources.py's: one of every kind, the ZeRO and
DCP ones real DeepSpeed and torch.distributed saves."""

import os
import sys
from pathlib import Path

import pytest
import torch

SUITE_DIR = Path(__file__).resolve().parent
TESTS_DIR = SUITE_DIR.parent
sys.path.insert(0, str(TESTS_DIR.parent / "python"))

from ckptfs_testlib import ckptfs_bin, ckptfs_library, ls_json, run_ckptfs  # noqa: E402,F401  (shared fixtures)
from device_sources import make_sources  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def active_environment():
    """The test environment as the active one ($VIRTUAL_ENV), as a user's shell has it: `ckptfs
    load` (a program outside any environment) finds the CUDA runtime of torch's NVIDIA wheels
    there. CTest runs the environment's python without activating it."""
    with pytest.MonkeyPatch.context() as patch:
        if sys.prefix != sys.base_prefix:
            patch.setenv("VIRTUAL_ENV", sys.prefix)
        yield


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> dict:
    """{name: (path, torch reference state dict or None)} for every source kind
    (device_sources.KINDS)."""
    return make_sources(tmp_path_factory.mktemp("device-sources"))


@pytest.fixture
def cuda_device() -> str:
    """The GPU the GPU tests load to. Without one they skip, except under
    CKPTFS_REQUIRE_GPU=1 (scripts/device-check.sh on a GPU machine), where they fail: there a
    missing GPU is what the check exists to find."""
    if not torch.cuda.is_available():
        reason = "no GPU: torch.cuda.is_available() is False"
        if os.environ.get("CKPTFS_REQUIRE_GPU") == "1":
            pytest.fail(f"{reason}, and CKPTFS_REQUIRE_GPU=1 says there is one", pytrace=False)
        pytest.skip(reason)
    return "cuda:0"
