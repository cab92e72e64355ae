"""ckptfs.mount: mounts through the bundled binary, yields the mount point, and never leaves a
mount behind: not after the block, not after an exception, not with a file still open."""

import os
import time

import pytest
from safetensors import safe_open as reference_open

import ckptfs
from ckptfs_testlib import assert_bitwise_equal
from fusetools import daemon_pids, mount_entry

# Skips without FUSE, or fails the run under CI=true (tests/ckptfs_mounts.py).
pytestmark = pytest.mark.usefixtures("requires_fuse")


def gone(mountpoint, deadline_s: float = 10.0) -> bool:
    """True once no ckptfs daemon serves MOUNTPOINT (it exits after its mount is undone)."""
    deadline = time.monotonic() + deadline_s
    while daemon_pids(mountpoint, ckptfs.executable_path()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_mount_reads_and_unmounts(sources):
    source, reference = sources["pt"]
    with ckptfs.mount(source) as path:
        assert mount_entry(path)["fstype"] == "fuse.ckptfs"
        assert {"model.safetensors", "tensors", "manifest.json", "metadata.json"} <= set(os.listdir(path))
        with reference_open(path / "model.safetensors", framework="pt") as f:
            for key in f.keys():
                assert_bitwise_equal(f.get_tensor(key), reference[key], key)
    assert mount_entry(path) is None
    assert not path.exists(), "the temporary mount point is removed"
    assert gone(path)


def test_mount_options_and_given_mountpoint(sources, tmp_path):
    source, reference = sources["pt"]
    with ckptfs.mount(source, tmp_path, dtype="bf16", root="model") as path:
        assert path == tmp_path
        with reference_open(path / "model.safetensors", framework="pt") as f:
            assert f.get_slice("embed.weight").get_dtype() == "BF16"
    assert mount_entry(tmp_path) is None and tmp_path.is_dir()


def test_exception_with_a_file_open_leaves_no_mount(sources):
    source, _ = sources["pt"]
    with pytest.raises(RuntimeError, match="boom"):
        with ckptfs.mount(source) as path:
            held = open(path / "model.safetensors", "rb")  # busy: only a lazy unmount undoes it
            held.read(8)
            raise RuntimeError("boom")
    try:
        assert mount_entry(path) is None
    finally:
        held.close()
    assert gone(path)


def test_bad_source_is_one_line_and_no_mount(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ckptfs.CkptfsError) as error:
        with ckptfs.mount(bad):
            pass
    assert "bad.pt" in str(error.value) and "\n" not in str(error.value)
    assert not [e for e in open("/proc/self/mounts") if "bad.pt" in e]
