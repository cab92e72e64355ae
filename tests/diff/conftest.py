"""Fixtures for tests/diff: `ckptfs diff` and ckptfs.diff (python/ckptfs over libckptfs.so) on
real pairs: the DCP and ZeRO fixtures against torch's and DeepSpeed's own consolidations,
exports, dtype views, and two training steps of a real transformers model."""

import json
import sys
from pathlib import Path

import pytest

SUITE_DIR = Path(__file__).resolve().parent
TESTS_DIR = SUITE_DIR.parent
sys.path.insert(0, str(TESTS_DIR.parent / "python"))
sys.path.insert(0, str(TESTS_DIR / "dcp"))

from ckptfs_fixture_cache import DCP_CHECKPOINTS  # noqa: E402
from ckptfs_testlib import (  # noqa: E402,F401  (shared fixtures)
    cached_fixtures_or_fail,
    ckptfs_bin,
    ckptfs_library,
    ls_json,
    run_ckptfs,
    zero_fixtures_root,
)
from minilm import minilm_dir  # noqa: E402,F401


@pytest.fixture(scope="session")
def dcp_fixtures_root() -> Path:
    """make_dcp_checkpoints.py's folder (<case>/, <case>.reference.pt, <case>.torch_save/)."""
    return cached_fixtures_or_fail(DCP_CHECKPOINTS)


@pytest.fixture(scope="session")
def diff_json(run_ckptfs):
    """diff_json(*args) -> (exit status, parsed `ckptfs diff --json ARGS`)."""

    def run(*args):
        res = run_ckptfs("diff", "--json", *map(str, args), check=False)
        assert res.returncode in (0, 1), res.stderr.decode(errors="replace")
        return res.returncode, json.loads(res.stdout)

    return run
