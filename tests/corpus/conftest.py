"""Fixtures for tests/corpus: the ckptfs binary. Mount attempts go through the `mounts`
fixture of tests/ckptfs_mounts.py (every refused mount attempt has a timeout; anything that
did get mounted is torn down)."""

from ckptfs_testlib import ckptfs_bin  # noqa: F401  (shared fixture)
