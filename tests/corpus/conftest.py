"""Fixtures for tests/corpus: the ckptfs binary, and the mount machinery of tests/fuse (every
refused mount attempt has a timeout; anything that did get mounted is torn down)."""

import sys
from pathlib import Path

import pytest

SUITE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SUITE_DIR.parent / "fuse"))

from ckptfs_testlib import ckptfs_bin  # noqa: E402,F401  (shared fixture)
from fusetools import (  # noqa: E402
    Mounts,
    add_body_timeout_marker,
    fuse_unavailable_reason,
    in_suite,
    run_body_with_deadline,
    serve_mounts,
    teardown_every_mount,
)

FUSE_MISSING = fuse_unavailable_reason()


def pytest_configure(config):
    add_body_timeout_marker(config, "tests/corpus")


def pytest_collection_modifyitems(config, items):
    if FUSE_MISSING is None:
        return
    skip = pytest.mark.skip(reason=f"cannot try mounts here: {FUSE_MISSING}")
    for item in items:
        if in_suite(item, SUITE_DIR) and "mounts" in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    return run_body_with_deadline(pyfuncitem)


def pytest_sessionfinish(session, exitstatus):
    teardown_every_mount()


@pytest.fixture
def mounts(ckptfs_bin, tmp_path_factory):
    yield from serve_mounts(Mounts(ckptfs_bin, tmp_path_factory))
