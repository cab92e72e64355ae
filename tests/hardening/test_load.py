"""Load test: 16 reader threads read random byte ranges (unaligned, many
across tensor and header boundaries, some past the end) of model.safetensors and of the tensor
files of a mounted ~256 MB torch.save checkpoint for 60 s, and compare every byte with an
independent reference built in Python from the tensors torch.load returns. The page cache of
the files is dropped (POSIX_FADV_DONTNEED) all along, so the reads keep reaching the daemon.
The daemon's RSS is sampled every second and must stay flat.

CKPTFS_LOAD_SECONDS overrides the duration (e.g. for a quick local run)."""

import json
import os
import random
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from fusetools import daemon_pids
from ckptfs_testlib import SERVED_DTYPE, flatten_tensors

READERS = 16
LOAD_S = float(os.environ.get("CKPTFS_LOAD_SECONDS", "60"))
MAX_READ = 4 << 20
RSS_SLACK = 16 << 20


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def served(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def read_header(path: Path) -> tuple:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        raw = f.read(n)
    return 8 + n, raw, json.loads(raw)


class Reference:
    """For each file of the mount: its size, its header bytes (checked field by field against
    torch), and where its data region lies in one buffer that holds every tensor's bytes as
    torch gives them."""

    def __init__(self, mnt: Path, tensors: dict, dtype=None):
        self.files = {}  # rel -> (size, header bytes, data offset in self.data)
        self.boundaries = {}  # rel -> sorted byte offsets where segments meet
        start, raw, header = read_header(mnt / "model.safetensors")
        keys = [k for k in header if k != "__metadata__"]
        assert set(keys) == set(tensors)
        data_len = max(header[k]["data_offsets"][1] for k in keys)
        self.data = bytearray(data_len)
        for k in keys:
            t = served(tensors[k], dtype)
            h = header[k]
            assert h["dtype"] == SERVED_DTYPE[t.dtype] and h["shape"] == list(t.shape), k
            b = tensor_bytes(t)
            lo, hi = h["data_offsets"]
            assert hi - lo == len(b), k
            self.data[lo:hi] = b
        model_size = (mnt / "model.safetensors").stat().st_size
        assert model_size == start + data_len
        self.files["model.safetensors"] = (model_size, struct.pack("<Q", start - 8) + raw, 0)
        self.boundaries["model.safetensors"] = sorted({start} | {start + header[k]["data_offsets"][0] for k in keys})
        manifest = json.loads((mnt / "manifest.json").read_bytes())
        for entry in manifest["tensors"]:
            rel, k = entry["file"], entry["key"]
            tstart, traw, th = read_header(mnt / rel)
            assert list(th) == ["__metadata__", k] or set(th) == {"__metadata__", k}, rel
            lo, hi = header[k]["data_offsets"]
            assert th[k]["dtype"] == header[k]["dtype"] and th[k]["shape"] == header[k]["shape"]
            assert th[k]["data_offsets"] == [0, hi - lo], rel
            size = (mnt / rel).stat().st_size
            assert size == tstart + hi - lo, rel
            self.files[rel] = (size, struct.pack("<Q", tstart - 8) + traw, lo)
            self.boundaries[rel] = [tstart]

    def expected(self, rel: str, offset: int, length: int) -> bytes:
        size, head, data_at = self.files[rel]
        end = min(size, offset + length)
        if offset >= end:
            return b""
        out = bytearray()
        if offset < len(head):
            out += head[offset:min(end, len(head))]
        lo = max(offset, len(head)) - len(head)
        hi = end - len(head)
        if hi > lo:
            out += self.data[data_at + lo:data_at + hi]
        return bytes(out)


class Load:
    def __init__(self, mnt: Path, ref: Reference, seconds: float, seed: int):
        self.mnt, self.ref, self.seconds, self.seed = mnt, ref, seconds, seed
        self.lock = threading.Lock()
        self.reads = self.bytes = self.mismatches = self.errors = 0
        self.problems = []
        self.files = sorted(ref.files)
        self.big = sorted(r for r in ref.files if ref.files[r][0] > 1 << 20)
        self.stop = threading.Event()

    def pick(self, rng):
        r = rng.random()
        rel = "model.safetensors" if r < 0.4 else rng.choice(self.big) if r < 0.7 else rng.choice(self.files)
        size = self.ref.files[rel][0]
        mode = rng.random()
        if mode < 0.45:  # anywhere, log-uniform length
            offset = rng.randrange(size)
            length = int(2 ** rng.uniform(0, 22))
        elif mode < 0.85:  # across a segment boundary
            b = rng.choice(self.ref.boundaries[rel])
            offset = max(0, b - rng.randrange(1, 70000))
            length = rng.randrange(1, 200000)
        else:  # at the end, past EOF
            offset = max(0, size - rng.randrange(1, 100000))
            length = rng.randrange(1, 300000)
        return rel, offset, min(length, MAX_READ)

    def reader(self, index: int):
        rng = random.Random(self.seed * 1000 + index)
        fds = {}
        reads = nbytes = 0
        try:
            while not self.stop.is_set():
                rel, offset, length = self.pick(rng)
                fd = fds.get(rel)
                if fd is None:
                    fd = fds[rel] = os.open(self.mnt / rel, os.O_RDONLY)
                try:
                    got = os.pread(fd, length, offset)
                except OSError as e:
                    with self.lock:
                        self.errors += 1
                        self.problems.append(f"{rel} [{offset}, +{length}): {e}")
                    continue
                want = self.ref.expected(rel, offset, length)
                reads += 1
                nbytes += len(got)
                if got != want:
                    with self.lock:
                        self.mismatches += 1
                        if len(self.problems) < 20:
                            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                            self.problems.append(f"{rel} [{offset}, +{length}): got {len(got)} bytes, want {len(want)}, "
                                                 f"first difference at +{first}")
        finally:
            for fd in fds.values():
                os.close(fd)
            with self.lock:
                self.reads += reads
                self.bytes += nbytes

    def cache_dropper(self):
        """Drops the page cache of the files read, so that reads keep reaching the daemon."""
        fds = [os.open(self.mnt / rel, os.O_RDONLY) for rel in ["model.safetensors", *self.big]]
        try:
            while not self.stop.wait(0.25):
                for fd in fds:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            for fd in fds:
                os.close(fd)

    def run(self, daemon_pid: int) -> list:
        """Runs the load; returns the daemon's VmRSS (bytes), one sample a second."""
        threads = [threading.Thread(target=self.reader, args=(i,), daemon=True) for i in range(READERS)]
        threads.append(threading.Thread(target=self.cache_dropper, daemon=True))
        rss = []
        started = time.monotonic()
        for t in threads:
            t.start()
        try:
            for second in range(1, int(self.seconds) + 1):
                time.sleep(max(0.0, started + second - time.monotonic()))
                rss.append(vm_rss(daemon_pid))
        finally:
            self.stop.set()
            for t in threads:
                t.join(60)
        self.elapsed = time.monotonic() - started
        assert not any(t.is_alive() for t in threads), "a reader is stuck"
        return rss


def vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def large_tensors(large_ckpt):
    return flatten_tensors(torch.load(large_ckpt, weights_only=True))


def run_load(ckptfs_bin, mounts, large_ckpt, tensors, seconds, dtype=None, opts=()):
    mnt = mounts.mount(large_ckpt, None, *opts)
    ref = Reference(mnt, tensors, dtype)
    pids = daemon_pids(mnt, ckptfs_bin)
    assert len(pids) == 1, pids
    load = Load(mnt, ref, seconds, seed=6)
    rss = load.run(pids[0])
    mib = [round(r / (1 << 20), 1) for r in rss]
    print(f"\n{READERS} readers, {load.elapsed:.1f}s: {load.reads} reads ({load.reads / load.elapsed:.0f}/s), "
          f"{load.bytes / load.elapsed / 1e6:.1f} MB/s, {load.mismatches} mismatches, {load.errors} errors")
    print(f"daemon VmRSS MiB: start {mib[0]}, min {min(mib)}, max {max(mib)}, end {mib[-1]}; series {mib}")
    assert load.errors == 0 and load.mismatches == 0, "\n".join(load.problems[:20])
    assert load.reads > 1000
    return rss


@pytest.mark.timeout(300)
def test_load_16_readers_random_ranges(ckptfs_bin, mounts, large_ckpt, large_tensors):
    rss = run_load(ckptfs_bin, mounts, large_ckpt, large_tensors, LOAD_S)
    warm = rss[min(19, len(rss) - 1)]  # at 20 s (or the last sample of a shorter run)
    tail = rss[-40:] if len(rss) >= 60 else rss[len(rss) // 3:]
    assert max(tail) <= warm + RSS_SLACK, (
        f"daemon memory grew: {warm / 2**20:.1f} MiB at 20 s, up to {max(tail) / 2**20:.1f} MiB later"
    )


@pytest.mark.timeout(200)
def test_load_bf16_view(ckptfs_bin, mounts, large_ckpt, large_tensors):
    """The same with -o dtype=bf16 (every floating tensor converted on read), for a third of
    the time: converted bytes equal torch's Tensor.to(torch.bfloat16)."""
    rss = run_load(ckptfs_bin, mounts, large_ckpt, large_tensors, max(10.0, LOAD_S / 3), torch.bfloat16,
                   ("-o", "dtype=bf16"))
    # Warm at half the run: under ThreadSanitizer on a busy machine the daemon's memory (its
    # shadow memory included) takes up to half of this short run to reach its working set;
    # growth after the midpoint is what a leak shows.
    warm = rss[len(rss) // 2]
    tail = rss[2 * len(rss) // 3:]
    assert max(tail) <= warm + RSS_SLACK, (
        f"daemon memory grew: {warm / 2**20:.1f} MiB at mid-run, up to {max(tail) / 2**20:.1f} MiB later"
    )
