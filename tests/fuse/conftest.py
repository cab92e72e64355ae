"""Fixtures for the FUSE suite: real `ckptfs SOURCE MOUNTPOINT` mounts of real checkpoints,
read with the real torch, safetensors, transformers and rsync.

A hung FUSE mount must never hang the run:
- every command (ckptfs, fusermount3, mount, rsync, pgrep) runs with a timeout;
- every test body has a pytest-timeout deadline (pytest.ini), so a read that blocks on a
  broken mount turns into a test failure (tests/ckptfs_mounts.py frees a body stuck in the
  kernel);
- the `mounts` fixture (tests/ckptfs_mounts.py) always tears its mounts down, also when the
  test failed or timed out: fusermount3 -u, else fusermount3 -uz, then the daemon (found with
  pgrep -f on the mountpoint) is waited for and killed if it lingers, which also frees
  blocked readers.

The whole suite is skipped only when the machine has no /dev/fuse or no fusermount3."""

import os
import shutil

import pytest

# transformers must never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from ckptfs_checkpoints import concurrency_checkpoint, training_checkpoint  # noqa: E402
from ckptfs_testlib import ckptfs_bin, run_ckptfs  # noqa: E402,F401  (shared fixtures)
from minilm import minilm_dir  # noqa: E402,F401  (shared fixture)


@pytest.fixture(autouse=True)
def every_test_mounts(requires_fuse):
    """Every test of this suite is about mounts: all of them skip where FUSE is unavailable."""


# --- checkpoints -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def training_ckpt(tmp_path_factory):
    """(path of the .pt, {flattened key: tensor} as torch.load reads it back)."""
    import torch

    from fusetools import flatten_tensors

    path = tmp_path_factory.mktemp("training") / "training-state.pt"
    torch.save(training_checkpoint(), path)
    expected = flatten_tensors(torch.load(path, weights_only=True))
    assert len(expected) > 20
    return path, expected


@pytest.fixture(scope="session")
def big_ckpt(tmp_path_factory):
    import torch

    path = tmp_path_factory.mktemp("big") / "big.pt"
    torch.save(concurrency_checkpoint(), path)
    return path


@pytest.fixture(scope="session")
def rsync_bin():
    path = shutil.which("rsync")
    if path is None:
        pytest.fail("rsync is not installed (Debian package rsync)", pytrace=False)
    return path
