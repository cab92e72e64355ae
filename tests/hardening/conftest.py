"""Fixtures for tests/hardening: fault injection, access control and a load test on real
mounts. The mount machinery is the `mounts` fixture of tests/ckptfs_mounts.py: every command
has a timeout, every test body has a pytest-timeout deadline, every mount is torn down, also
after a failure."""

import pytest

from ckptfs_checkpoints import large_checkpoint
from ckptfs_testlib import ckptfs_bin  # noqa: F401  (shared fixture)


@pytest.fixture(scope="session")
def large_ckpt(tmp_path_factory):
    """A ~256 MB torch.save checkpoint (ckptfs_checkpoints.large_checkpoint)."""
    import torch

    path = tmp_path_factory.mktemp("large") / "large.pt"
    torch.save(large_checkpoint(), path)
    return path
