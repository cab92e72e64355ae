"""What stat, readdir, xattrs, statfs and modifying calls see on a mount."""

import ctypes
import errno
import json
import os
import shutil
import stat

import pytest
import torch
from safetensors.torch import save_file

from fusetools import expect_errno, read_manifest, tree_files

# A source mtime with a nanosecond part, so truncation to seconds would show.
SOURCE_MTIME_NS = 1_700_000_000_123_456_789


def walk(mnt) -> dict:
    """{relative path: os.stat_result} of everything under MNT (root included as '.')."""
    found = {".": os.stat(mnt)}
    for dirpath, dirnames, filenames in os.walk(mnt):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            found[os.path.relpath(path, mnt)] = os.stat(path)
    return found


@pytest.fixture
def source(training_ckpt, tmp_path):
    """A private copy of the training checkpoint with a known mtime."""
    path = tmp_path / "state.pt"
    shutil.copyfile(training_ckpt[0], path)
    os.utime(path, ns=(SOURCE_MTIME_NS, SOURCE_MTIME_NS))
    return path


def test_writes_fail_with_erofs(source, mounts):
    mnt = mounts.mount(source)
    model = mnt / "model.safetensors"
    tensor = mnt / read_manifest(mnt)["tensors"][0]["file"]
    expect_errno(errno.EROFS, open, model, "r+b")
    expect_errno(errno.EROFS, open, model, "ab")
    expect_errno(errno.EROFS, open, tensor, "wb")
    expect_errno(errno.EROFS, open, mnt / "new-file", "wb")
    expect_errno(errno.EROFS, os.open, mnt / "new-file", os.O_CREAT | os.O_EXCL | os.O_RDONLY)
    expect_errno(errno.EROFS, os.mkdir, mnt / "new-dir")
    expect_errno(errno.EROFS, os.unlink, model)
    expect_errno(errno.EROFS, os.rmdir, mnt / "tensors")
    expect_errno(errno.EROFS, os.truncate, model, 0)
    expect_errno(errno.EROFS, os.rename, model, mnt / "renamed")
    expect_errno(errno.EROFS, os.symlink, "model.safetensors", mnt / "link")
    expect_errno(errno.EROFS, os.chmod, model, 0o644)
    expect_errno(errno.EROFS, os.setxattr, tensor, "user.x", b"1")
    # Nothing changed.
    assert sorted(os.listdir(mnt)) == ["manifest.json", "metadata.json", "model.safetensors", "tensors"]
    assert os.stat(model).st_size > 0


def test_stat_matches_export(source, mounts, run_ckptfs, tmp_path):
    export = tmp_path / "export"
    run_ckptfs("export", "--write", "all", source, export)
    exported = tree_files(export)
    mnt = mounts.mount(source)
    seen = walk(mnt)
    files = {rel: st for rel, st in seen.items() if stat.S_ISREG(st.st_mode)}
    assert set(files) == set(exported), "the mount and the export hold different files"
    for rel, st in files.items():
        size = exported[rel].stat().st_size
        assert st.st_size == size, f"{rel}: size {st.st_size} != exported {size}"
        assert st.st_blocks == (size + 511) // 512, f"{rel}: st_blocks {st.st_blocks}"
        assert st.st_blksize >= 131072, f"{rel}: st_blksize {st.st_blksize}"
        assert stat.S_IMODE(st.st_mode) == 0o444, f"{rel}: mode {oct(st.st_mode)}"
        assert st.st_nlink == 1, rel
        # One source file: every file carries its mtime, to the nanosecond.
        assert st.st_mtime_ns == SOURCE_MTIME_NS, f"{rel}: mtime {st.st_mtime_ns}"
        # `ckptfs export` gives its files the same mtimes (rsync compares the two).
        assert exported[rel].stat().st_mtime_ns == st.st_mtime_ns, f"{rel}: export mtime"
        # The bytes are the exported ones.
        with open(mnt / rel, "rb") as f:
            assert f.read() == exported[rel].read_bytes(), f"{rel}: contents differ from export"
    for rel in (".", "tensors"):
        assert stat.S_ISDIR(seen[rel].st_mode) and stat.S_IMODE(seen[rel].st_mode) == 0o555, rel
    inodes = [st.st_ino for st in seen.values()]
    assert len(set(inodes)) == len(inodes), "two entries share an inode number"


def test_mtime_and_inodes_stable_across_remount(source, mounts):
    mnt = mounts.mount(source)
    first = walk(mnt)
    mounts.unmount(mnt)
    mounts.mount(source, mnt)
    second = walk(mnt)
    assert set(first) == set(second)
    for rel in first:
        a, b = first[rel], second[rel]
        assert (a.st_ino, a.st_mtime_ns, a.st_size) == (b.st_ino, b.st_mtime_ns, b.st_size), rel


def test_folder_mtimes_follow_their_source_files(mounts, tmp_path):
    """In a folder source, tensor files carry the mtime of the file holding the tensor,
    sibling files their own mtime, and the generated files the newest source mtime."""
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": torch.ones(3, 4)}, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({"b": torch.zeros(5)}, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 68},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }))
    (folder / "config.json").write_text('{"model_type": "test"}\n')
    mtimes = {
        "model-00001-of-00002.safetensors": 1_600_000_000_000_000_001,
        "model-00002-of-00002.safetensors": 1_600_000_100_000_000_002,
        "model.safetensors.index.json": 1_600_000_200_000_000_003,
        "config.json": 1_600_000_050_000_000_004,
    }
    for name, ns in mtimes.items():
        os.utime(folder / name, ns=(ns, ns))
    mnt = mounts.mount(folder)
    mt = lambda rel: os.stat(mnt / rel).st_mtime_ns  # noqa: E731
    assert mt("tensors/a.safetensors") == mtimes["model-00001-of-00002.safetensors"]
    assert mt("tensors/b.safetensors") == mtimes["model-00002-of-00002.safetensors"]
    assert mt("config.json") == mtimes["config.json"]
    assert (mnt / "config.json").read_text() == '{"model_type": "test"}\n'
    newest = max(os.stat(folder / n).st_mtime_ns for n in mtimes)
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"):
        assert mt(shard) >= mtimes["model-00002-of-00002.safetensors"]
        assert mt(shard) <= newest


def test_readdir_is_sorted(training_ckpt, mounts):
    mnt = mounts.mount(training_ckpt[0])
    for d in (mnt, mnt / "tensors"):
        names = os.listdir(d)
        assert names == sorted(names, key=os.fsencode), f"{d}: readdir order {names}"
    names = os.listdir(mnt / "tensors")
    assert len(names) == len(read_manifest(mnt)["tensors"])
    # readdir agrees with lookups: every listed name stats as a regular file.
    for entry in os.scandir(mnt / "tensors"):
        assert entry.is_file(follow_symlinks=False), entry.name
        assert entry.inode() == os.stat(entry.path).st_ino, entry.name


def test_a_directory_too_big_for_the_kernels_listing_cache_lists_alike(tmp_path, mounts):
    # Over 65,536 entries the daemon answers every listing itself (src/fuse/filesystem.cpp,
    # kMaxCachedListing): each listing, and one resumed from an offset, must be complete.
    count = 70_000
    keys = [f"w.{i}" for i in range(count)]
    path = tmp_path / "many.safetensors"
    save_file({k: torch.full((1,), float(i)) for i, k in enumerate(keys)}, str(path))
    mnt = mounts.mount(path)
    expected = sorted((k + ".safetensors" for k in keys), key=os.fsencode)
    for _ in range(2):
        assert os.listdir(mnt / "tensors") == expected
    fd = os.open(mnt / "tensors", os.O_RDONLY | os.O_DIRECTORY)
    try:  # small getdents64 calls resume where the previous one stopped
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(4096)
        names = []
        while (n := libc.syscall(217, fd, buf, len(buf))) > 0:  # getdents64
            at = 0
            while at < n:
                reclen = int.from_bytes(buf.raw[at + 16:at + 18], "little")
                names.append(buf.raw[at + 19:at + reclen].split(b"\0", 1)[0].decode())
                at += reclen
        assert n == 0, ctypes.get_errno()
    finally:
        os.close(fd)
    assert names[2:] == expected and names[:2] == [".", ".."]
    assert (mnt / "tensors" / "w.69999.safetensors").stat().st_size > 0


def test_xattrs(training_ckpt, mounts):
    source, expected = training_ckpt
    mnt = mounts.mount(source)
    for entry in read_manifest(mnt)["tensors"]:
        path = mnt / entry["file"]
        assert set(os.listxattr(path)) >= {"user.ckptfs.dtype", "user.ckptfs.shape"}, path.name
        assert os.getxattr(path, "user.ckptfs.dtype").decode() == entry["dtype"], path.name
        shape = json.loads(os.getxattr(path, "user.ckptfs.shape"))
        assert shape == list(expected[entry["key"]].shape) == entry["shape"], path.name
    assert os.getxattr(mnt / "tensors/extra.bf16.safetensors", "user.ckptfs.dtype") == b"BF16"
    assert os.getxattr(mnt / "tensors/extra.mask.safetensors", "user.ckptfs.dtype") == b"BOOL"
    assert json.loads(os.getxattr(mnt / "tensors/extra.scalar.safetensors", "user.ckptfs.shape")) == []
    # Files that are not one tensor carry none.
    expect_errno(errno.ENODATA, os.getxattr, mnt / "model.safetensors", "user.ckptfs.dtype")
    expect_errno(errno.ENODATA, os.getxattr, mnt / "tensors/extra.bf16.safetensors", "user.other")
    assert not [a for a in os.listxattr(mnt / "manifest.json") if a.startswith("user.ckptfs.")]


def test_statfs(training_ckpt, mounts):
    mnt = mounts.mount(training_ckpt[0])
    sv = os.statvfs(mnt)
    total = sum(st.st_size for st in walk(mnt).values() if stat.S_ISREG(st.st_mode))
    assert sv.f_bsize > 0 and sv.f_frsize > 0
    assert sv.f_blocks * sv.f_frsize >= total
    assert sv.f_bfree == 0 and sv.f_bavail == 0
    assert sv.f_flag & os.ST_RDONLY
    assert sv.f_namemax >= 255
