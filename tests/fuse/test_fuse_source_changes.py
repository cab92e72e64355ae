"""A source file that changes under a mount must turn reads into EIO, never into stale or
foreign bytes.

Caching caveat: the mount sets keep_cache (contents never change while mounted), so pages
of a virtual file the kernel has already read are served from the page cache without asking
the daemon, whose identity check (size, mtime, inode) only sees the reads that reach it.
ckptfs covers this with an inotify watch on the source files that drops all cached pages of
the mount when one changes (README "Mounting"). The tests therefore read three kinds of
files after the change: files never read before (nothing cached: EIO straight from the
daemon), a file read before whose pages we drop ourselves (posix_fadvise DONTNEED), and a
file read before whose pages only the watcher can drop; the watcher works asynchronously, so
that file may keep showing its old bytes for a moment, but must fail with EIO within
WATCHER_DEADLINE_S and must never show bytes of the new content."""

import errno
import os
import time

import pytest
import torch

from ckptfs_testlib import scaled
from fusetools import expect_errno, read_manifest

KEYS = [f"layer{i}.weight" for i in range(6)]
READ_BEFORE = (KEYS[0], KEYS[4])  # read before the change; the others are not
WATCHER_DEADLINE_S = scaled(5)


def write_checkpoint(path, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {key: torch.randn(32, 64, generator=g) for key in KEYS}
    torch.save(state, path)
    return state


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def read_file(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def drop_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def mounted(mounts, tmp_path):
    """(source path, mountpoint, {key: virtual file}, {key: bytes read before the change})."""
    source = tmp_path / "ckpt.pt"
    state = write_checkpoint(source, seed=1)
    mnt = mounts.mount(source)
    files = {e["key"]: mnt / e["file"] for e in read_manifest(mnt)["tensors"]}
    assert set(files) == set(KEYS)
    before = {}
    for key in READ_BEFORE:
        before[key] = read_file(files[key])
        assert before[key].endswith(tensor_bytes(state[key])), "the mount serves the source"
    return source, mnt, files, before


def assert_eio_everywhere(mnt, files, before):
    # Never read before the change: nothing cached, the read reaches ckptfs.
    for key in KEYS:
        if key not in READ_BEFORE:
            expect_errno(errno.EIO, read_file, files[key])
    expect_errno(errno.EIO, read_file, mnt / "model.safetensors")

    # Read before the change, its cached pages dropped by us: the read reaches ckptfs.
    dropped = READ_BEFORE[1]
    drop_cache(files[dropped])
    expect_errno(errno.EIO, read_file, files[dropped])

    # Read before the change, cached: the watcher must drop the pages. Until it has, the
    # read may still return the old bytes, never anything else.
    cached = READ_BEFORE[0]
    deadline = time.monotonic() + WATCHER_DEADLINE_S
    while True:
        try:
            got = read_file(files[cached])
        except OSError as e:
            assert e.errno == errno.EIO, f"{cached}: errno {e.errno}, expected EIO"
            break
        assert got == before[cached], f"{cached}: served bytes that are neither old nor EIO"
        assert time.monotonic() < deadline, (
            f"{cached}: still served from the page cache {WATCHER_DEADLINE_S}s after its "
            "source changed (the inotify watcher did not drop the cached pages)"
        )
        time.sleep(0.05)


def test_source_replaced_by_rename(mounted, tmp_path):
    source, mnt, files, before = mounted
    replacement = tmp_path / "new.pt"
    write_checkpoint(replacement, seed=2)
    old_ino = os.stat(source).st_ino
    os.replace(replacement, source)
    assert os.stat(source).st_ino != old_ino
    assert_eio_everywhere(mnt, files, before)


def test_source_rewritten_in_place(mounted, tmp_path):
    source, mnt, files, before_change = mounted
    before = os.stat(source)
    # A different checkpoint of exactly the same size, written into the same inode.
    # (torch.save names the archive's records after the file's stem: keep the name.)
    other = tmp_path / "other" / source.name
    other.parent.mkdir()
    write_checkpoint(other, seed=3)
    content = other.read_bytes()
    assert len(content) == before.st_size, "same keys and shapes give the same file size"
    assert content != source.read_bytes()
    with open(source, "r+b") as f:
        f.write(content)
    # A new mtime for sure (the write's own timestamp could fall in the same clock tick).
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns + 5_000_000_000))
    after = os.stat(source)
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert_eio_everywhere(mnt, files, before_change)


def test_source_rewritten_in_place_with_mtime_restored(mounted, tmp_path):
    source, mnt, files, _ = mounted
    before = os.stat(source)
    other = tmp_path / "other" / source.name
    other.parent.mkdir()
    write_checkpoint(other, seed=4)
    with open(source, "r+b") as f:
        f.write(other.read_bytes())
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(source)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)
    assert after.st_ctime_ns != before.st_ctime_ns
    for key in KEYS:
        if key not in READ_BEFORE:
            expect_errno(errno.EIO, read_file, files[key])
