"""Fixtures for tests/diff: `ckptfs diff` and ckptfs.diff (python/ckptfs over libckptfs.so) on
real pairs: the DCP and ZeRO fixtures against torch's and DeepSpeed's own consolidations,
exports, dtype views, and two training steps of a real transformers model."""

import json
import os
import sys
from pathlib import Path

import pytest

SUITE_DIR = Path(__file__).resolve().parent
TESTS_DIR = SUITE_DIR.parent
sys.path.insert(0, str(TESTS_DIR.parent / "python"))
sys.path.insert(0, str(TESTS_DIR / "dcp"))

from ckptfs_fixture_cache import DCP_CHECKPOINTS  # noqa: E402
from ckptfs_testlib import (  # noqa: E402,F401  (shared fixtures)
    REPO_ROOT,
    cached_fixtures_or_fail,
    ckptfs_bin,
    ls_json,
    run_ckptfs,
    zero_fixtures_root,
)
from minilm import minilm_dir  # noqa: E402,F401


@pytest.fixture(scope="session", autouse=True)
def ckptfs_library():
    """libckptfs.so beside the binary under test (CKPTFS_BUILD_DIR, else the binary's folder)."""
    if "CKPTFS_LIB" not in os.environ:
        build = os.environ.get("CKPTFS_BUILD_DIR") or str(Path(os.environ.get("CKPTFS_BIN", REPO_ROOT / "build" / "ckptfs")).parent)
        os.environ["CKPTFS_LIB"] = str(Path(build) / "libckptfs.so")
    lib = Path(os.environ["CKPTFS_LIB"])
    if not lib.is_file():
        pytest.fail(f"libckptfs.so not found at {lib}: build the ckptfs_shared target", pytrace=False)


@pytest.fixture(scope="session")
def dcp_fixtures_root() -> Path:
    """make_dcp_checkpoints.py's folder (<case>/, <case>.reference.pt, <case>.torch_save/)."""
    return cached_fixtures_or_fail(DCP_CHECKPOINTS, packages=("torch", "transformers"))


@pytest.fixture(scope="session")
def diff_json(run_ckptfs):
    """diff_json(*args) -> (exit status, parsed `ckptfs diff --json ARGS`)."""

    def run(*args):
        res = run_ckptfs("diff", "--json", *map(str, args), check=False)
        assert res.returncode in (0, 1), res.stderr.decode(errors="replace")
        return res.returncode, json.loads(res.stdout)

    return run
