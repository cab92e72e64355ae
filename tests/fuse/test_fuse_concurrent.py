"""Concurrent random-range reads of a mounted ~36 MB checkpoint, and mmap, all compared with
the bytes `ckptfs export` wrote before anything was mounted (the export itself is checked
against torch.load first, so the reference does not depend on the mount)."""

import mmap
import os
import random
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from fusetools import assert_bitwise_equal, flatten_tensors, read_manifest, tree_files

READERS = 8
DURATION_S = 20
MAX_READ = 2 << 20
MODEL = "model.safetensors"


@pytest.fixture(scope="module")
def reference(big_ckpt, run_ckptfs, tmp_path_factory):
    """{virtual path: bytes} of `ckptfs export`, plus the boundaries between segments of
    model.safetensors (end of header, start and end of every tensor)."""
    out = tmp_path_factory.mktemp("big-export")
    run_ckptfs("export", "--write", "all", big_ckpt, out, timeout=180)
    expected = flatten_tensors(torch.load(big_ckpt, weights_only=True))
    exported = load_file(out / MODEL)
    assert set(exported) == set(expected)
    for key, tensor in expected.items():
        assert_bitwise_equal(exported[key], tensor, f"exported {MODEL}[{key}]")

    data = {rel: p.read_bytes() for rel, p in tree_files(out).items()}
    assert len(data[MODEL]) > 30 << 20, "the checkpoint should be a few tens of MB"
    boundaries = sorted({b for e in read_manifest(out)["tensors"] for b in e["model_offsets"]})
    return data, boundaries


def pread_full(fd: int, length: int, offset: int) -> bytes:
    parts, got = [], 0
    while got < length:
        chunk = os.pread(fd, length - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def reader(idx, mnt, data, boundaries, stop_at, errors, stats):
    """Random reads until STOP_AT: half on model.safetensors (half of those crossing a
    tensor boundary), half on tensor files (big ones often: large and gathered tensors).
    Odd readers open the file for each read; even ones keep descriptors and now and then
    drop the file's page cache so the reads keep reaching the daemon."""
    rng = random.Random(1000 + idx)
    tensor_files = sorted(n for n in data if n.startswith("tensors/"))
    big = [n for n in tensor_files if n.startswith("tensors/state.big.")]
    fds = {}
    reads = nbytes = 0
    try:
        while time.monotonic() < stop_at and not errors:
            r = rng.random()
            name = MODEL if r < 0.5 else rng.choice(big if r < 0.75 else tensor_files)
            want_all = data[name]
            size = len(want_all)
            length = rng.randint(1, MAX_READ)
            if name == MODEL and rng.random() < 0.5:
                b = rng.choice(boundaries[1:])
                offset = rng.randint(max(0, b - length + 1), b - 1)  # [offset, offset+length) spans b
            elif rng.random() < 0.05:
                offset = max(0, size - rng.randint(0, 4096))  # at or near EOF: short reads
            else:
                offset = rng.randrange(0, size)
            if idx % 2:
                fd = os.open(mnt / name, os.O_RDONLY)
                try:
                    got = pread_full(fd, length, offset)
                finally:
                    os.close(fd)
            else:
                fd = fds.get(name)
                if fd is None:
                    fd = fds[name] = os.open(mnt / name, os.O_RDONLY)
                got = pread_full(fd, length, offset)
                if reads % 8 == 0:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            want = want_all[offset : offset + length]
            if got != want:
                first = next(
                    (i for i in range(min(len(got), len(want))) if got[i] != want[i]),
                    min(len(got), len(want)),
                )
                errors.append(
                    f"reader {idx}: {name} [{offset}, +{length}) returned {len(got)} bytes, "
                    f"expected {len(want)}; first difference at file offset {offset + first}"
                )
                return
            reads += 1
            nbytes += len(got)
    except BaseException as exc:
        errors.append(f"reader {idx}: {exc!r}")
    finally:
        for fd in fds.values():
            os.close(fd)
        stats[idx] = (reads, nbytes)


@pytest.mark.timeout(DURATION_S + 90)
def test_concurrent_random_reads(big_ckpt, reference, mounts):
    data, boundaries = reference
    mnt = mounts.mount(big_ckpt)
    for name, want in data.items():
        assert os.stat(mnt / name).st_size == len(want), name

    errors, stats = [], {}
    stop_at = time.monotonic() + DURATION_S
    threads = [
        threading.Thread(target=reader, args=(i, mnt, data, boundaries, stop_at, errors, stats))
        for i in range(READERS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DURATION_S + 60)
    assert not any(t.is_alive() for t in threads), f"readers still blocked: {stats}"
    assert not errors, "\n".join(errors)
    assert len(stats) == READERS
    for idx, (reads, _) in stats.items():
        assert reads >= 20, f"reader {idx} did only {reads} reads in {DURATION_S}s: {stats}"
    total = sum(n for _, n in stats.values())
    assert total > 4 * len(data[MODEL]), f"only {total} bytes read: {stats}"


def test_mmap_shared_and_private(big_ckpt, reference, mounts):
    data, _ = reference
    mnt = mounts.mount(big_ckpt)
    names = [MODEL, "tensors/state.big.f32.safetensors", "tensors/state.big.transposed.safetensors",
             "tensors/state.small.007.safetensors"]
    rng = random.Random(5)
    for name in names:
        want = data[name]
        with open(mnt / name, "rb") as f:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as shared:
                assert len(shared) == len(want)
                for _ in range(20):
                    a = rng.randrange(len(want))
                    b = min(len(want), a + rng.randint(1, MAX_READ))
                    assert shared[a:b] == want[a:b], f"{name}: shared mmap [{a}, {b})"
                assert shared[:] == want, f"{name}: shared mmap differs"

            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as private:
                assert private[:] == want, f"{name}: private mmap differs"
                # Writing to a private mapping changes only this process's copy.
                private[8:16] = b"\xa5" * 8
                assert private[8:16] == b"\xa5" * 8
                assert private[16:] == want[16:]
            assert pread_full(f.fileno(), 64, 0) == want[:64], f"{name}: file changed"
