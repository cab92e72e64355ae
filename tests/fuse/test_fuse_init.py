"""What the daemon asks of the kernel at INIT, read from libfuse's debug log (`-d`): the
kernel offers FUSE_AUTO_INVAL_DATA and ckptfs declines it (the tree is immutable; the source
watcher drops the pages of a changed source itself, tests/fuse/test_fuse_source_changes.py),
and it negotiates 1 MiB requests (FUSE_MAX_PAGES, max_write)."""

import re
import subprocess

import pytest

from ckptfs_testlib import REPO_ROOT
from fusetools import wait_for_mount

SAMPLE = REPO_ROOT / "tests" / "data" / "sample-mlp-training.pt"

# include/uapi/linux/fuse.h
FUSE_AUTO_INVAL_DATA = 1 << 12
FUSE_MAX_PAGES = 1 << 22


def init_flags(log: str) -> tuple[int, int, dict]:
    """(flags the kernel offered, flags of the daemon's reply, the reply's other fields)."""
    offered = re.search(r"^INIT: \d+\.\d+\nflags=0x([0-9a-f]+)$", log, re.M)
    reply = re.search(r"^   INIT: \d+\.\d+\n   flags=0x([0-9a-f]+)\n((?:   \w+=\S+\n)+)", log, re.M)
    assert offered and reply, f"no INIT exchange in the debug log:\n{log[:2000]}"
    fields = dict(line.strip().split("=", 1) for line in reply.group(2).splitlines())
    return int(offered.group(1), 16), int(reply.group(1), 16), fields


@pytest.mark.timeout(60)
def test_init_declines_auto_inval_data(ckptfs_bin, mounts, tmp_path):
    mnt = mounts.new_mountpoint()
    mounts.register(mnt)
    log_path = tmp_path / "debug.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(ckptfs_bin), str(SAMPLE), str(mnt), "-d"], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            assert wait_for_mount(mnt) is not None, "the -d mount did not appear"
            assert (mnt / "model.safetensors").stat().st_size > 0
        finally:
            mounts.unmount(mnt)
            proc.wait(timeout=30)
    offered, replied, fields = init_flags(log_path.read_text(errors="replace"))
    assert offered & FUSE_AUTO_INVAL_DATA, f"this kernel does not offer auto_inval_data ({offered:#x}): nothing to test"
    assert not replied & FUSE_AUTO_INVAL_DATA, f"ckptfs asked for auto_inval_data (reply flags {replied:#x})"
    assert replied & FUSE_MAX_PAGES, f"no FUSE_MAX_PAGES in the reply ({replied:#x})"
    assert int(fields["max_write"], 16) == 1 << 20, fields
