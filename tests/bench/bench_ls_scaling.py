#!/usr/bin/env python3
"""Benchmark: `ckptfs ls` costs O(tensor count), never O(checkpoint bytes).

Acceptance checks (exit status 1 if one fails):
  (a) `ckptfs ls` on a real torch.save checkpoint of 100,000 tensors takes < 1 s.
      Shown side by side with what a user would otherwise run:
      `torch.load(path, mmap=True, weights_only=True)` and listing keys/shapes.
  (b) `ckptfs ls` on a sparse ~1 TB torch checkpoint (1000 x 1 GiB tensors) takes
      the same time as on a ~1 GB one (1000 x 1 MiB): median ratio <= 1.5. Peak RSS
      of both is printed.
  (c) `ckptfs ls` on a safetensors file of 100,000 tensors (safetensors' save_file) takes
      < 1 s, beside `safe_open` + keys + shapes.

torch.save cannot write 1 TB here, so this file carries a small writer that
produces the same bytes torch 2.7+ writes (checked byte for byte against
torch.save at start-up), except that tensor data are left as holes (f.seek), so
the files take almost no disk space.

Every timed command runs in a fresh process; peak RSS comes from GNU time
(/usr/bin/time) when present. Run by hand from the repo root:

    python tests/bench/bench_ls_scaling.py --ckptfs build/ckptfs
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import mmap
import os
import pickle
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from benchlib import GNU_TIME  # peak RSS via GNU time: see benchlib

REPO_ROOT = Path(__file__).resolve().parents[2]

GiB = 1 << 30
MiB = 1 << 20

# ---------------------------------------------------------------------------
# torch-compatible zip writer (layout of torch 2.7+ `torch.save`, see doc/FORMATS.md,
# "torch.save archives")
# ---------------------------------------------------------------------------

ALIGNMENT = 64          # torch's default storage alignment
ZIP64_LIMIT = 0xFFFFFFFF  # a 32-bit field at or above this moves to the zip64 extra
FLAG_UTF8 = 0x0800
FLAG_DATA_DESCRIPTOR = 0x0008

# dtype -> (storage class pickled in the persistent id, itemsize, safetensors name)
STORAGE_TYPES = {
    torch.float32: (torch.FloatStorage, 4, "F32"),
    torch.float16: (torch.HalfStorage, 2, "F16"),
    torch.bfloat16: (torch.BFloat16Storage, 2, "BF16"),
    torch.int64: (torch.LongStorage, 8, "I64"),
}


@dataclass
class TensorSpec:
    """One tensor to write. data=None means all zeros, written as a file hole."""
    key: str
    shape: tuple
    dtype: torch.dtype = torch.float32
    data: bytes | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * STORAGE_TYPES[self.dtype][1]


def contiguous_stride(shape: tuple) -> tuple:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


class _StorageRef:
    """Stands in for a TypedStorage; the pickler turns it into torch's persistent id."""

    def __init__(self, key: str, spec: TensorSpec):
        self.key, self.spec = key, spec


class _TensorRef:
    """Pickles exactly like a plain dense CPU tensor (Tensor.__reduce_ex__)."""

    def __init__(self, storage: _StorageRef):
        self.storage = storage

    def __reduce__(self):
        shape = tuple(self.storage.spec.shape)
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, shape, contiguous_stride(shape), False,
                 collections.OrderedDict()))


class _TorchPickler(pickle.Pickler):
    # Same persistent id tuple as torch.serialization._save: numel is in elements
    # for typed storages.
    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            storage_cls = STORAGE_TYPES[obj.spec.dtype][0]
            return ("storage", storage_cls, obj.key, "cpu", obj.spec.numel)
        return None


def build_data_pkl(tensors: list[TensorSpec]) -> bytes:
    """Protocol-2 pickle of {key: tensor}; storage keys "0".."N-1" in pickle order."""
    state = {t.key: _TensorRef(_StorageRef(str(i), t)) for i, t in enumerate(tensors)}
    buf = io.BytesIO()
    _TorchPickler(buf, protocol=2).dump(state)
    return buf.getvalue()


_zero_crc_cache: dict[int, int] = {}


def crc32_of_zeros(size: int) -> int:
    """CRC32 of `size` zero bytes, cached: every sparse tensor of a size shares it."""
    if size not in _zero_crc_cache:
        chunk = bytes(min(size, 64 * MiB))
        crc, left = 0, size
        while left:
            n = min(left, len(chunk))
            crc = zlib.crc32(memoryview(chunk)[:n], crc)
            left -= n
        _zero_crc_cache[size] = crc
    return _zero_crc_cache[size]


@dataclass
class _Entry:
    name: bytes
    size: int
    crc: int
    header_offset: int
    flags: int


class TorchZipWriter:
    """Writes records the way PyTorchStreamWriter (patched miniz) does:
    stored, FB padding extra to 64-byte data alignment, data descriptors,
    zip64 extras only for overflowing fields, zip64 end records always."""

    def __init__(self, f, archive: str = "archive"):
        self.f, self.archive = f, archive
        self.entries: list[_Entry] = []

    def add(self, record: str, data: bytes | None = None, size: int | None = None):
        """Add `archive/record`. data=None writes `size` zero bytes as a hole."""
        f = self.f
        name = f"{self.archive}/{record}".encode()
        size = len(data) if data is not None else size
        crc = zlib.crc32(data) if data is not None else crc32_of_zeros(size)
        offset = f.tell()
        big_size, big_offset = size >= ZIP64_LIMIT, offset >= ZIP64_LIMIT

        extra = b""
        if big_size or big_offset:
            # Local zip64 block: uncompressed size, compressed size (0 here: a
            # miniz quirk), then header offset, each only if it overflowed.
            body = (struct.pack("<QQ", size, 0) if big_size else b"") + \
                   (struct.pack("<Q", offset) if big_offset else b"")
            extra += struct.pack("<HH", 0x0001, len(body)) + body
        data_start = offset + 30 + len(name) + len(extra) + 4
        pad = -data_start % ALIGNMENT
        extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad

        flags = FLAG_UTF8 | (FLAG_DATA_DESCRIPTOR if size else 0)
        # CRC and sizes are 0 in the local header; the descriptor carries them.
        f.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0,
                            0, 0, 0, len(name), len(extra)))
        f.write(name)
        f.write(extra)
        if data is not None:
            f.write(data)
        else:
            f.seek(size, os.SEEK_CUR)  # leave a hole: the file stays sparse
        if size:
            if big_size or big_offset:
                f.write(struct.pack("<IIQQ", 0x08074B50, crc, size, size))
            else:
                f.write(struct.pack("<IIII", 0x08074B50, crc, size, size))
        self.entries.append(_Entry(name, size, crc, offset, flags))

    def close(self):
        f = self.f
        cd_offset = f.tell()
        for e in self.entries:
            body = b""
            size32 = offset32 = None
            if e.size >= ZIP64_LIMIT:
                body += struct.pack("<QQ", e.size, e.size)
                size32 = ZIP64_LIMIT
            if e.header_offset >= ZIP64_LIMIT:
                body += struct.pack("<Q", e.header_offset)
                offset32 = ZIP64_LIMIT
            extra = struct.pack("<HH", 0x0001, len(body)) + body if body else b""
            size32 = e.size if size32 is None else size32
            offset32 = e.header_offset if offset32 is None else offset32
            f.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, e.flags, 0, 0, 0,
                                e.crc, size32, size32, len(e.name), len(extra), 0,
                                0, 0, 0, offset32))
            f.write(e.name)
            f.write(extra)
        cd_size = f.tell() - cd_offset
        n = len(self.entries)
        eocd64_offset = f.tell()
        # torch always writes zip64 end records, even for tiny files.
        f.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0,
                            n, n, cd_size, cd_offset))
        f.write(struct.pack("<IIQI", 0x07064B50, 0, eocd64_offset, 1))
        f.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                            min(cd_size, ZIP64_LIMIT), min(cd_offset, ZIP64_LIMIT), 0))


def write_torch_checkpoint(f, tensors: list[TensorSpec], archive: str = "archive",
                           serialization_id: str = "0" * 40):
    """Write a checkpoint with torch 2.7+'s record order (A.2). Because data records
    are contiguous, numeric and torch-padded, `.format_version` 1 is truthful (A.9)."""
    w = TorchZipWriter(f, archive)
    w.add("data.pkl", build_data_pkl(tensors))
    w.add(".format_version", b"1")
    w.add(".storage_alignment", str(ALIGNMENT).encode())
    w.add("byteorder", b"little")
    for i, t in enumerate(tensors):
        if t.data is not None:
            assert len(t.data) == t.nbytes, t.key
            w.add(f"data/{i}", t.data)
        else:
            w.add(f"data/{i}", None, t.nbytes)
    w.add("version", b"3\n")
    w.add(".data/serialization_id", serialization_id.encode())
    w.close()


# ---------------------------------------------------------------------------
# Checkpoint generators and their validation
# ---------------------------------------------------------------------------

@dataclass
class Checkpoint:
    label: str
    path: Path
    expected: list[tuple[str, tuple, str, int]]  # (key, shape, safetensors dtype, nbytes)
    sparse: bool = False

    @property
    def logical_bytes(self) -> int:
        return self.path.stat().st_size

    @property
    def disk_bytes(self) -> int:
        return self.path.stat().st_blocks * 512


SMALL_SHAPES = [(4,), (8,), (16,), (2, 4), (4, 4), (2, 8), (3, 5)]  # 4..16 floats


def make_many_tensors(path: Path, n: int) -> Checkpoint:
    """n small float32 tensors saved with the real torch.save."""
    sd = {f"layers.{i}.weight": torch.randn(SMALL_SHAPES[i % len(SMALL_SHAPES)])
          for i in range(n)}
    torch.save(sd, path)
    expected = [(k, tuple(v.shape), "F32", v.nbytes) for k, v in sd.items()]
    return Checkpoint(f"{n} tensors, torch.save", path, expected)


def make_many_safetensors(path: Path, n: int) -> Checkpoint:
    """n small float32 tensors saved with the real safetensors save_file."""
    from safetensors.torch import save_file
    sd = {f"layers.{i}.weight": torch.randn(SMALL_SHAPES[i % len(SMALL_SHAPES)])
          for i in range(n)}
    save_file(sd, str(path))
    expected = [(k, tuple(v.shape), "F32", v.nbytes) for k, v in sd.items()]
    return Checkpoint(f"{n} tensors, safetensors", path, expected)


def make_sparse(path: Path, n: int, shape: tuple, label: str) -> Checkpoint:
    """n float32 tensors of `shape` whose data are holes in a sparse file."""
    specs = [TensorSpec(f"layers.{i}.weight", shape) for i in range(n)]
    with open(path, "wb") as f:
        write_torch_checkpoint(f, specs)
    return Checkpoint(label, path, [(s.key, s.shape, "F32", s.nbytes) for s in specs],
                      sparse=True)


def check_writer_matches_torch_save():
    """Our writer must give torch.save's exact bytes (given torch's serialization id,
    which is only a hash we do not reproduce). Covers several dtypes, a 0-d and an
    empty tensor."""
    sd = {
        "emb.weight": torch.randn(7, 5),
        "layers.0.bias": torch.arange(3, dtype=torch.int64),
        "half": torch.randn(2, 3, 4).half(),
        "bf": torch.randn(9).bfloat16(),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
    }
    buf = io.BytesIO()
    torch.save(sd, buf)  # a buffer gives the folder name "archive", like our writer
    reference = buf.getvalue()
    sid = zipfile.ZipFile(io.BytesIO(reference)).read("archive/.data/serialization_id").decode()

    specs = [TensorSpec(k, tuple(v.shape), v.dtype,
                        v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
             for k, v in sd.items()]
    ours = io.BytesIO()
    write_torch_checkpoint(ours, specs, serialization_id=sid)
    ours = ours.getvalue()
    if ours != reference:
        at = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b),
                  min(len(ours), len(reference)))
        raise SystemExit(f"writer self-check: bytes differ from torch.save at offset {at} "
                         f"(ours {len(ours)} bytes, torch {len(reference)} bytes)")
    loaded = torch.load(io.BytesIO(ours), weights_only=True)
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k


def torch_load_mmap(path: Path, shared: bool):
    """torch.load(mmap=True, weights_only=True). torch maps the whole file with
    MAP_PRIVATE by default; Linux's overcommit heuristic refuses a private mapping
    larger than RAM + swap (the 1 TB file), so MAP_SHARED is the way round it."""
    if not shared:
        return torch.load(path, mmap=True, weights_only=True)
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        return torch.load(path, mmap=True, weights_only=True)


def check_torch_loads(ckpt: Checkpoint) -> str:
    """torch.load(mmap=True, weights_only=True) must see the expected keys/shapes.
    Returns a note when it needed MAP_SHARED."""
    note = ""
    try:
        sd = torch_load_mmap(ckpt.path, shared=False)
    except RuntimeError as e:
        reason = str(e).splitlines()[0].rsplit(": ", 1)[-1]
        note = f" (default MAP_PRIVATE mmap failed: {reason}; loaded with MAP_SHARED)"
        sd = torch_load_mmap(ckpt.path, shared=True)
    got = [(k, tuple(v.shape), v.nbytes) for k, v in sd.items()]
    want = [(k, shape, nbytes) for k, shape, _, nbytes in ckpt.expected]
    if got != want:
        raise SystemExit(f"{ckpt.path}: torch.load disagrees with the generator "
                         f"(first of {len(got)}: {got[:1]}, expected {want[:1]})")
    # Read the very last element: the mapping must reach the end of the data.
    last = sd[want[-1][0]].reshape(-1)[-1].item()
    if ckpt.sparse and last != 0.0:
        raise SystemExit(f"{ckpt.path}: a hole read back as {last}, not 0")
    return note


def check_sparse_supported(workdir: Path):
    """Refuse to run where holes are not supported: 1 TB would really be written."""
    probe = workdir / "sparse-probe"
    with open(probe, "wb") as f:
        f.seek(256 * MiB)
        f.write(b"x")
    used = probe.stat().st_blocks * 512
    probe.unlink()
    if used > 16 * MiB:
        raise SystemExit(f"{workdir}: filesystem does not keep sparse files sparse; "
                         f"use --workdir on ext4/xfs/btrfs/tmpfs")


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------

@dataclass
class Run:
    wall_s: float
    max_rss_kib: int
    stdout: Path
    stderr: str


def run_measured(argv: list[str], stdout_path: Path) -> Run:
    """Run argv in a fresh process: wall time, and its max RSS via GNU time (or,
    without it, os.wait4, which then over-reports; see GNU_TIME)."""
    rss_path = stdout_path.with_suffix(".rss")
    full = [GNU_TIME, "-f", "%M", "-o", str(rss_path), "--", *argv] if GNU_TIME else argv
    with open(stdout_path, "wb") as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(full, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    if proc.returncode != 0:
        shown = " ".join("-c <script>" if "\n" in a else a for a in map(str, argv))
        raise RuntimeError(f"{shown} exited {proc.returncode}: "
                           f"{stderr.strip()[-2000:]}")
    max_rss_kib = usage.ru_maxrss  # KiB on Linux
    if GNU_TIME:
        max_rss_kib = int(rss_path.read_text().split()[-1])
        rss_path.unlink()
    return Run(wall, max_rss_kib, stdout_path, stderr)


# What a user would otherwise run to list a checkpoint. Prints the listing to stdout
# (like ckptfs ls) and its own timings as JSON on the last stderr line.
TORCH_LIST_SCRIPT = r"""
import json, mmap, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
if sys.argv[2] == "shared":
    torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)
sd = torch.load(sys.argv[1], mmap=True, weights_only=True)
rows = [f"{k}  {v.dtype}  {list(v.shape)}  {v.nbytes}" for k, v in sd.items()]
sys.stdout.write("\n".join(rows) + "\n")
sys.stdout.flush()
t2 = time.perf_counter()
sys.stderr.write(json.dumps({"import_s": t1 - t0, "load_list_s": t2 - t1}) + "\n")
"""


# What a safetensors user runs for the same listing: safe_open, keys, each one's shape.
SAFETENSORS_LIST_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from safetensors import safe_open
t1 = time.perf_counter()
with safe_open(sys.argv[1], framework="numpy") as f:
    rows = [f"{k}  {f.get_slice(k).get_dtype()}  {f.get_slice(k).get_shape()}" for k in f.keys()]
sys.stdout.write("\n".join(rows) + "\n")
sys.stdout.flush()
t2 = time.perf_counter()
sys.stderr.write(json.dumps({"import_s": t1 - t0, "load_list_s": t2 - t1}) + "\n")
"""


@dataclass
class Stats:
    wall_s: float          # median wall time of the whole process
    max_rss_mib: float     # median peak RSS
    inner_s: float | None = None  # torch only: median load+list time, without `import torch`


def summarize(runs: list[Run], torch_runs: bool = False) -> Stats:
    s = Stats(statistics.median(r.wall_s for r in runs),
              statistics.median(r.max_rss_kib for r in runs) / 1024)
    if torch_runs:
        s.inner_s = statistics.median(
            json.loads(r.stderr.strip().splitlines()[-1])["load_list_s"] for r in runs)
    return s


def ckptfs_ls_argv(ckptfs: Path, ckpt: Checkpoint, json_out: bool = False):
    return [str(ckptfs), "ls"] + (["--json"] if json_out else []) + [str(ckpt.path)]


def torch_list_argv(ckpt: Checkpoint, shared: bool = False):
    return [sys.executable, "-c", TORCH_LIST_SCRIPT, str(ckpt.path),
            "shared" if shared else "private"]


def check_ckptfs_output(ckptfs: Path, ckpt: Checkpoint, plain_listing: Path, workdir: Path):
    """A fast wrong answer is no pass: compare ls and ls --json with the generator."""
    problems = []
    lines = [l for l in plain_listing.read_text().splitlines() if l.strip()]
    if lines and lines[0].split()[:2] == ["key", "dtype"]:
        lines = lines[1:]  # a column header line is allowed
    keys = [l.split()[0] for l in lines]
    want_keys = [k for k, *_ in ckpt.expected]
    if sorted(keys) != sorted(want_keys):
        problems.append(f"`ls` printed {len(lines)} rows; keys differ from the "
                        f"{len(want_keys)} expected (first row: {lines[:1]})")
    try:
        run = run_measured(ckptfs_ls_argv(ckptfs, ckpt, json_out=True), workdir / "ls.json")
        items = json.loads(run.stdout.read_text())
    except (RuntimeError, ValueError) as e:
        return problems + [f"`ls --json`: {e}"]
    got = sorted((i["key"], tuple(i["shape"]), i["dtype"], i["nbytes"]) for i in items)
    if got != sorted(ckpt.expected):
        diff = sorted(set(got) ^ set(ckpt.expected))[:3]
        problems.append(f"`ls --json` gave {len(items)} items; (key, shape, dtype, nbytes) "
                        f"differ, e.g. {diff}")
    return problems


def measure(argvs: dict[str, list[str]], repeats: int, workdir: Path) -> dict[str, list[Run]]:
    """One untimed warm-up each (page cache), then `repeats` rounds, interleaved so
    slow drift of the machine hits every command alike."""
    runs = {name: [] for name in argvs}
    for name, argv in argvs.items():
        run_measured(argv, workdir / f"{name}.out")
    for _ in range(repeats):
        for name, argv in argvs.items():
            runs[name].append(run_measured(argv, workdir / f"{name}.out"))
    return runs


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_ratio(x: float) -> str:
    return f"{x:.0f}x" if x >= 10 else f"{x:.1f}x"


def fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckptfs", type=Path, default=REPO_ROOT / "build" / "ckptfs",
                    help="ckptfs binary (default: build/ckptfs in the repo)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckptfs-bench"),
                    help="where checkpoints are generated (default /tmp/ckptfs-bench)")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed runs per command (median reported); default 5")
    ap.add_argument("--sparse-repeats", type=int, default=15,
                    help="timed runs of ckptfs ls per sparse file; each takes "
                         "milliseconds, so more runs steady the ratio; default 15")
    ap.add_argument("--tensors", type=int, default=100_000,
                    help="tensor count of the torch.save checkpoint")
    ap.add_argument("--sparse-tensors", type=int, default=1000,
                    help="tensor count of each sparse checkpoint")
    ap.add_argument("--max-ls-seconds", type=float, default=1.0)
    ap.add_argument("--max-size-ratio", type=float, default=1.5,
                    help="max median time ratio of ckptfs ls, 1 TB file / 1 GB file")
    ap.add_argument("--generators-only", action="store_true",
                    help="build the checkpoints, validate them with torch.load, stop "
                         "(needs no ckptfs)")
    args = ap.parse_args()

    ckptfs = args.ckptfs.resolve()
    if not args.generators_only and not os.access(ckptfs, os.X_OK):
        print(f"ckptfs binary not found or not executable: {ckptfs}", file=sys.stderr)
        return 2

    workdir = args.workdir.resolve()
    created_workdir = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    made_here: list[Path] = []
    try:
        check_sparse_supported(workdir)
        print("writer self-check: byte-identical to torch.save ...", end=" ", flush=True)
        check_writer_matches_torch_save()
        print("ok")

        n = args.sparse_tensors
        t0 = time.perf_counter()
        ckpts = {}
        for name, make in (
                ("many", lambda p: make_many_tensors(p, args.tensors)),
                ("small", lambda p: make_sparse(p, n, (512, 512), f"sparse {n} x 1 MiB")),
                ("huge", lambda p: make_sparse(p, n, (16384, 16384), f"sparse {n} x 1 GiB"))):
            path = workdir / f"bench_{name}.pt"
            made_here.append(path)
            ckpts[name] = make(path)
        st_path = workdir / "bench_many.safetensors"
        made_here.append(st_path)
        st = make_many_safetensors(st_path, args.tensors)
        print(f"generated 4 checkpoints in {time.perf_counter() - t0:.1f} s")

        torch_shared = {}  # checkpoint -> needs MAP_SHARED for torch.load(mmap=True)
        for name, c in ckpts.items():
            if c.disk_bytes > 256 * MiB:
                raise SystemExit(f"{c.path}: uses {fmt_bytes(c.disk_bytes)} on disk; "
                                 "expected a sparse file")
            t0 = time.perf_counter()
            note = check_torch_loads(c)
            torch_shared[name] = bool(note)
            print(f"torch.load validates {c.path.name}: {len(c.expected)} tensors, "
                  f"{fmt_bytes(c.logical_bytes)} ({fmt_bytes(c.disk_bytes)} on disk), "
                  f"{time.perf_counter() - t0:.2f} s{note}")
        if args.generators_only:
            return 0

        print("\ntiming, one fresh process per run ...", flush=True)
        try:
            runs = measure({"ls_many": ckptfs_ls_argv(ckptfs, ckpts["many"]),
                            "torch_many": torch_list_argv(ckpts["many"])},
                           args.repeats, workdir)
            runs.update(measure({"ls_small": ckptfs_ls_argv(ckptfs, ckpts["small"]),
                                 "ls_huge": ckptfs_ls_argv(ckptfs, ckpts["huge"])},
                                args.sparse_repeats, workdir))
            runs.update(measure({f"torch_{k}": torch_list_argv(ckpts[k], torch_shared[k])
                                 for k in ("small", "huge")}, args.repeats, workdir))
            runs.update(measure({"ls_st": ckptfs_ls_argv(ckptfs, st),
                                 "safe_open_st": [sys.executable, "-c", SAFETENSORS_LIST_SCRIPT, str(st.path)]},
                                args.repeats, workdir))
        except RuntimeError as e:
            print(f"[FAIL] {e}")
            return 1

        problems = [f"{c.path.name}: {p}" for k, c in [*ckpts.items(), ("st", st)]
                    for p in check_ckptfs_output(ckptfs, c, runs[f"ls_{k}"][-1].stdout,
                                                 workdir)]
        ls = {k: summarize(runs[f"ls_{k}"]) for k in ckpts}
        tl = {k: summarize(runs[f"torch_{k}"], torch_runs=True) for k in ckpts}
        print_table(ckpts, ls, tl, torch_shared, args)
        ls_st, so_st = summarize(runs["ls_st"]), summarize(runs["safe_open_st"], torch_runs=True)
        print(f"\n{st.label}: ckptfs ls {fmt_s(ls_st.wall_s)}, {ls_st.max_rss_mib:.1f} MiB; "
              f"safe_open + keys + shapes {fmt_s(so_st.inner_s)} (process {fmt_s(so_st.wall_s)}, "
              f"{so_st.max_rss_mib:.0f} MiB)")

        size_ratio = ls["huge"].wall_s / ls["small"].wall_s
        rss_ratio = ls["huge"].max_rss_mib / ls["small"].max_rss_mib
        print(f"\nckptfs ls, 1 TB file vs 1 GB file: time x{size_ratio:.2f}, "
              f"peak RSS x{rss_ratio:.2f} ({ls['small'].max_rss_mib:.1f} MiB -> "
              f"{ls['huge'].max_rss_mib:.1f} MiB)")
        checks = [
            (f"(a) ckptfs ls, {len(ckpts['many'].expected)} tensors: "
             f"{fmt_s(ls['many'].wall_s)} < {args.max_ls_seconds:g} s "
             f"(torch.load: {fmt_s(tl['many'].inner_s)}, "
             f"{fmt_ratio(tl['many'].inner_s / ls['many'].wall_s)} slower)",
             ls["many"].wall_s < args.max_ls_seconds),
            (f"(b) ckptfs ls time, 1 TB file / 1 GB file: {size_ratio:.2f} <= {args.max_size_ratio:g}",
             size_ratio <= args.max_size_ratio),
            (f"(c) ckptfs ls, {len(st.expected)} tensors in one safetensors file: "
             f"{fmt_s(ls_st.wall_s)} < {args.max_ls_seconds:g} s "
             f"(safe_open + keys + shapes: {fmt_s(so_st.inner_s)}; that / ckptfs ls = "
             f"{so_st.inner_s / ls_st.wall_s:.2f})",
             ls_st.wall_s < args.max_ls_seconds),
            ("ckptfs ls / ls --json list exactly the generated tensors", not problems),
        ]
        print()
        for text, ok in checks:
            print(f"[{'PASS' if ok else 'FAIL'}] {text}")
        for p in problems:
            print(f"       {p}")
        return 0 if all(ok for _, ok in checks) else 1
    finally:
        if args.keep:
            print(f"kept generated files in {workdir}")
        else:
            for p in made_here:
                p.unlink(missing_ok=True)
        for scratch in [*workdir.glob("*.out"), *workdir.glob("*.rss")]:
            scratch.unlink()
        (workdir / "ls.json").unlink(missing_ok=True)
        if created_workdir and not any(workdir.iterdir()):
            workdir.rmdir()


def print_table(ckpts, ls, tl, torch_shared, args):
    rss_how = ("GNU time" if GNU_TIME else
               "os.wait4, WITHOUT GNU time: includes this script's own RSS, an upper bound")
    print(f"\nmedian of {args.repeats} runs ({args.sparse_repeats} for ckptfs ls on the "
          f"sparse files); RSS = peak RSS of the process ({rss_how})")
    cols = (f"{'checkpoint':<28}{'tensors':>8}{'file size':>12}{'on disk':>10}  |"
            f"{'ckptfs ls':>11}{'RSS':>10}  |{'torch.load':>12}{'process':>10}{'RSS':>10}"
            f"  |{'speedup':>8}")
    print(f"{'':<60}|{'ckptfs':^23}|{'python + torch':^34}|")
    print(cols)
    print("-" * len(cols))
    for k, c in ckpts.items():
        star = "*" if torch_shared[k] else ""
        print(f"{c.label:<28}{len(c.expected):>8}{fmt_bytes(c.logical_bytes):>12}"
              f"{fmt_bytes(c.disk_bytes):>10}  |{fmt_s(ls[k].wall_s):>11}"
              f"{ls[k].max_rss_mib:>6.1f} MiB  |{fmt_s(tl[k].inner_s) + star:>12}"
              f"{fmt_s(tl[k].wall_s):>10}{tl[k].max_rss_mib:>6.0f} MiB"
              f"  |{fmt_ratio(tl[k].inner_s / ls[k].wall_s):>8}")
    print("torch.load = torch.load(path, mmap=True, weights_only=True) + listing "
          "keys/dtypes/shapes, timed inside python;\nprocess = that whole python "
          "process incl. `import torch`; speedup = torch.load / ckptfs ls")
    if any(torch_shared.values()):
        print("* torch.load(mmap=True) fails with its default MAP_PRIVATE mapping here "
              "(ENOMEM: a private mapping larger than RAM + swap);\n  timed with "
              "torch.serialization.set_default_mmap_options(mmap.MAP_SHARED) instead")


if __name__ == "__main__":
    sys.exit(main())
