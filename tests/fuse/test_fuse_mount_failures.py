"""A mount that cannot work fails at once: exit status non-zero, one stderr line naming the
file, nothing left in /proc/mounts and no daemon left running."""

import json
import os
import struct

import pytest

from fusetools import daemon_pids, mount_entry


def corrupt_pt(tmp_path, training_ckpt):
    p = tmp_path / "corrupt.pt"
    p.write_bytes(b"PK\x03\x04" + os.urandom(4000))
    return p, p


def truncated_pt(tmp_path, training_ckpt):
    data = training_ckpt[0].read_bytes()
    p = tmp_path / "truncated.pt"
    p.write_bytes(data[: len(data) // 2])
    return p, p


def random_bytes(tmp_path, training_ckpt):
    p = tmp_path / "noise.bin"
    p.write_bytes(os.urandom(1000))
    return p, p


def short_safetensors(tmp_path, training_ckpt):
    """A header promising more data than the file holds."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    header += b" " * (-len(header) % 8)
    p = tmp_path / "short.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    return p, p


def missing_file(tmp_path, training_ckpt):
    p = tmp_path / "does-not-exist.pt"
    return p, p


def empty_folder(tmp_path, training_ckpt):
    d = tmp_path / "empty-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d, d


def bad_shard_in_folder(tmp_path, training_ckpt):
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text("{}")
    bad = d / "model-00001-of-00001.safetensors"
    bad.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    return d, bad


def fifo_source(tmp_path, training_ckpt):
    p = tmp_path / "fifo.pt"
    os.mkfifo(p)
    return p, p


def dangling_symlink(tmp_path, training_ckpt):
    # CI runs as root, for whom permissions cannot make a file unreadable; a link to
    # nothing fails open() for everyone.
    p = tmp_path / "gone.pt"
    p.symlink_to(tmp_path / "deleted-checkpoint.pt")
    return p, p


# name -> maker(tmp_path, training_ckpt) -> (SOURCE, the file the error must name)
CASES = {
    "corrupt-zip": corrupt_pt,
    "truncated-torch-zip": truncated_pt,
    "random-bytes": random_bytes,
    "short-safetensors": short_safetensors,
    "missing-file": missing_file,
    "folder-without-weights": empty_folder,
    "folder-with-bad-shard": bad_shard_in_folder,
    "fifo": fifo_source,
    "dangling-symlink": dangling_symlink,
}


@pytest.mark.parametrize("case", CASES)
def test_bad_source_is_refused(case, tmp_path, training_ckpt, mounts, ckptfs_bin):
    source, named = CASES[case](tmp_path, training_ckpt)
    mnt = mounts.new_mountpoint()
    res = mounts.start([ckptfs_bin, source, mnt], mnt)
    assert not res.timed_out, res.describe()
    assert res.returncode not in (0, None), res.describe()
    lines = res.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {lines}"
    assert lines[0].startswith("ckptfs: "), lines
    assert os.path.basename(named) in lines[0], f"{lines[0]!r} does not name {named}"
    assert mount_entry(mnt) is None, f"{mnt} is mounted after a failed mount"
    assert daemon_pids(mnt, ckptfs_bin) == [], "a daemon is left running"
    assert os.listdir(mnt) == []


def test_missing_mountpoint(training_ckpt, mounts, ckptfs_bin, tmp_path):
    mnt = tmp_path / "no-such-dir"
    res = mounts.start([ckptfs_bin, training_ckpt[0], mnt], mnt)
    assert not res.timed_out, res.describe()
    assert res.returncode not in (0, None), res.describe()
    assert res.stderr.strip(), "no error message"
    assert str(mnt) in res.stderr, res.stderr
    assert mount_entry(mnt) is None
    assert not mnt.exists()
    assert daemon_pids(mnt, ckptfs_bin) == []


def test_mountpoint_is_a_file(training_ckpt, mounts, ckptfs_bin, tmp_path):
    mnt = tmp_path / "a-file"
    mnt.write_text("x")
    res = mounts.start([ckptfs_bin, training_ckpt[0], mnt], mnt)
    assert not res.timed_out, res.describe()
    assert res.returncode not in (0, None), res.describe()
    assert mount_entry(mnt) is None
    assert mnt.read_text() == "x"
