"""Broken DCP checkpoint dirs (copies of the fsdp2_ws2 save, damaged on purpose): `ckptfs ls`
exits 1 within 2 s with one stderr line naming the offending file and, where one tensor is at
fault, its fqn; the mount refuses and leaves nothing mounted. The .metadata damages go
through torch's own classes (pickle.load, change, pickle.dump), so everything but the lie is a
real DCP file."""

import dataclasses
import os
import pickle
import pickletools
import shutil
import time

import pytest
import torch  # noqa: F401  (the .metadata pickle names torch classes)
import torch.distributed.checkpoint.metadata as dcp_metadata

from ckptfs_testlib import scaled
from fusetools import mount_entry

CASE = "fsdp2_ws2"
# [22, 13] in two row chunks of 11: chunk 1 lives in __1_0.distcp.
VICTIM = "model.0.weight"
REFUSE_WITHIN_S = scaled(2.0)


@pytest.fixture
def damaged(dcp_case, tmp_path):
    """A private copy of the case's checkpoint dir."""
    copy = tmp_path / CASE
    shutil.copytree(dcp_case(CASE).checkpoint_dir, copy)
    return copy


def load_metadata(ckpt):
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)


def dump_metadata(ckpt, metadata) -> None:
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def storage_key(metadata, fqn: str, chunk):
    """The storage_data key of CHUNK of FQN (MetadataIndex compares fqn and offset only)."""
    return dcp_metadata.MetadataIndex(fqn, chunk.offsets)


def move_chunk(metadata, fqn: str, chunk_index: int, **changes) -> None:
    """Replace a chunk's offsets and/or sizes, re-keying its storage entry to the new offsets."""
    chunks = metadata.state_dict_metadata[fqn].chunks
    old = chunks[chunk_index]
    new = dataclasses.replace(old, **changes)
    chunks[chunk_index] = new
    info = metadata.storage_data.pop(storage_key(metadata, fqn, old))
    metadata.storage_data[storage_key(metadata, fqn, new)] = info


@pytest.fixture
def assert_refused(run_ckptfs, mounts, tmp_path):
    """assert_refused(ckpt, file_names, fqn=None): `ckptfs ls` exits 1 in under 2 s with one
    `ckptfs: ` line naming one of FILE_NAMES (and FQN if given); the mount refuses and nothing
    is mounted."""

    def check(ckpt, file_names, fqn=None) -> str:
        started = time.monotonic()
        result = run_ckptfs("ls", ckpt, check=False)
        elapsed = time.monotonic() - started
        stderr = result.stderr.decode(errors="replace")
        assert result.returncode == 1, f"ckptfs ls: exit {result.returncode}; stderr:\n{stderr}"
        assert result.stdout == b"", "ckptfs ls wrote to stdout for a refused source"
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("ckptfs: "), f"expected one error line, got:\n{stderr}"
        assert any(name in lines[0] for name in file_names), f"{lines[0]!r} names none of {file_names}"
        if fqn is not None:
            assert fqn in lines[0], f"{lines[0]!r} does not name {fqn}"
        assert elapsed < REFUSE_WITHIN_S, f"ckptfs ls took {elapsed:.2f}s to refuse"

        mnt = mounts.new_mountpoint()
        res = mounts.start([mounts.binary, ckpt, mnt], mnt)
        assert res.returncode != 0, f"the mount accepted a damaged checkpoint: {res.describe()}"
        assert mount_entry(mnt) is None, f"{mnt} is mounted after a refused mount"
        return lines[0]

    return check


def test_missing_distcp_file(damaged, assert_refused):
    (damaged / "__1_0.distcp").unlink()
    assert_refused(damaged, ["__1_0.distcp"])


def test_truncated_distcp_file(damaged, assert_refused):
    path = damaged / "__1_0.distcp"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    # The fqn named must be one whose bytes were cut off.
    metadata = load_metadata(damaged)
    cut = {
        index.fqn
        for index, info in metadata.storage_data.items()
        if info.relative_path == "__1_0.distcp" and info.offset + info.length > len(data) // 2
    }
    line = assert_refused(damaged, ["__1_0.distcp"])
    assert any(fqn in line for fqn in cut), f"{line!r} names none of the truncated items {sorted(cut)}"


def test_metadata_chunk_sizes_lie(damaged, assert_refused):
    """Chunk 0 claims 10 rows where 11 are stored: row 10 is covered by no chunk and the
    stored tensor disagrees with its metadata."""
    metadata = load_metadata(damaged)
    chunk = metadata.state_dict_metadata[VICTIM].chunks[0]
    assert list(chunk.sizes) == [11, 13]
    metadata.state_dict_metadata[VICTIM].chunks[0] = dataclasses.replace(chunk, sizes=torch.Size([10, 13]))
    dump_metadata(damaged, metadata)
    assert_refused(damaged, [".metadata", "__0_0.distcp"], fqn=VICTIM)


def test_overlapping_chunks(damaged, assert_refused):
    """Chunk 1 moved up one row: rows 10 and 11..20 overlap chunk 0, row 21 is left uncovered."""
    metadata = load_metadata(damaged)
    assert list(metadata.state_dict_metadata[VICTIM].chunks[1].offsets) == [11, 0]
    move_chunk(metadata, VICTIM, 1, offsets=torch.Size([10, 0]))
    dump_metadata(damaged, metadata)
    assert_refused(damaged, [".metadata"], fqn=VICTIM)


def test_missing_chunk(damaged, assert_refused):
    metadata = load_metadata(damaged)
    chunk = metadata.state_dict_metadata[VICTIM].chunks.pop(1)
    del metadata.storage_data[storage_key(metadata, VICTIM, chunk)]
    dump_metadata(damaged, metadata)
    assert_refused(damaged, [".metadata"], fqn=VICTIM)


def test_unknown_transform_descriptor(damaged, assert_refused):
    """A chunk whose bytes must first be decoded by a stream transform ckptfs does not know."""
    metadata = load_metadata(damaged)
    key = storage_key(metadata, VICTIM, metadata.state_dict_metadata[VICTIM].chunks[1])
    metadata.storage_data[key] = dataclasses.replace(
        metadata.storage_data[key], transform_descriptors=["ckptfs-test-unknown-codec"]
    )
    dump_metadata(damaged, metadata)
    assert_refused(damaged, [".metadata"], fqn=VICTIM)


class _RunsShellCommand:
    """Unpickling this calls os.system(COMMAND)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_metadata_pickle_calling_os_system_is_never_run(damaged, assert_refused, run_ckptfs, tmp_path):
    sentinel = tmp_path / "SENTINEL"
    metadata = load_metadata(damaged)
    # planner_data is read to re-nest the fqns: the payload sits where a reader must look.
    metadata.planner_data[VICTIM] = _RunsShellCommand(f"touch {sentinel}")
    dump_metadata(damaged, metadata)
    # The file really calls os.system: the global and a REDUCE opcode are in the pickle.
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops((damaged / ".metadata").read_bytes())]
    assert ("SHORT_BINUNICODE", "system") in ops and any(name == "REDUCE" for name, _ in ops)

    assert_refused(damaged, [".metadata"])
    run_ckptfs("export", damaged, tmp_path / "out", check=False)
    assert not (tmp_path / "out").exists(), "a refused export left output behind"
    assert not sentinel.exists(), "ckptfs ran the command in the .metadata pickle"
