"""Fixtures for tests/corpus: the ckptfs binary, and the mount machinery of tests/fuse (every
refused mount attempt has a timeout; anything that did get mounted is torn down)."""

import sys
from pathlib import Path


SUITE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SUITE_DIR.parent / "fuse"))

from ckptfs_testlib import ckptfs_bin  # noqa: E402,F401  (shared fixture)
from fusetools import mount_suite_hooks  # noqa: E402

globals().update(mount_suite_hooks(SUITE_DIR, "tests/corpus"))
