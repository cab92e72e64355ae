"""What the daemon asks of the kernel at INIT, read from libfuse's debug log (`-d`): the
kernel offers FUSE_AUTO_INVAL_DATA and ckptfs declines it (the tree is immutable; the source
watcher drops the pages of a changed source itself, tests/fuse/test_fuse_source_changes.py),
and it negotiates 1 MiB requests (FUSE_MAX_PAGES, max_write)."""

import os
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
            assert wait_for_mount(mnt, daemon=proc) is not None, "the -d mount did not appear"
            assert (mnt / "model.safetensors").stat().st_size > 0
        finally:
            mounts.unmount(mnt)
            proc.wait(timeout=30)
    offered, replied, fields = init_flags(log_path.read_text(errors="replace"))
    assert offered & FUSE_AUTO_INVAL_DATA, f"this kernel does not offer auto_inval_data ({offered:#x}): nothing to test"
    assert not replied & FUSE_AUTO_INVAL_DATA, f"ckptfs asked for auto_inval_data (reply flags {replied:#x})"
    assert replied & FUSE_MAX_PAGES, f"no FUSE_MAX_PAGES in the reply ({replied:#x})"
    assert int(fields["max_write"], 16) == 1 << 20, fields


@pytest.mark.timeout(60)
def test_readahead_window_raised_after_init(ckptfs_bin, mounts):
    """The kernel applies INIT's readahead after the reply, so the daemon raises the mount's
    window to 1 MiB on its first request after INIT (root only: sysfs)."""
    if os.geteuid() != 0:
        pytest.skip("raising a mount's read_ahead_kb needs root")
    mnt = mounts.mount(SAMPLE)
    dev = os.stat(mnt).st_dev  # a GETATTR: the first request after INIT
    knob = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    with open(knob) as f:
        assert int(f.read()) == 1024, knob


@pytest.mark.timeout(120)
def test_unmount_right_after_a_read_is_never_busy(ckptfs_bin, mounts):
    """Nothing in the daemon holds the mount: an unmount right after a first read succeeds
    (a stat() of the mountpoint from a daemon thread once made this fail now and then)."""
    for _ in range(10):
        mnt = mounts.mount(SAMPLE)
        assert (mnt / "manifest.json").read_bytes()
        mounts.unmount(mnt)
