#!/usr/bin/env python3
"""Benchmark: reads through a ckptfs mount vs dd of the same bytes of the source file.

Source: a safetensors file of four float32 tensors t0..t3 of SIZE bytes each (1 GiB each,
4 GiB in all; --quick: 128 MiB each), generated once and cached under --workdir. Every
source byte range is read once with dd before each timed run, so the alternative (and
ckptfs's own preads) always hit the page cache: "source in page cache".

  a  sequential read of t0: dd bs=1M of the tensor's data range of MNT/tensors/t0.safetensors
     vs dd bs=1M skip/count of the same bytes of the source.
       first read: the mount file's pages are evicted (FADV_DONTNEED, checked with mincore)
       re-read:    the same dd again, now from the kernel's page cache of the mount file,
                   vs dd of the same bytes copied to a tmpfs mounted with huge=never (4 KiB
                   pages, as the FUSE page cache on this kernel: the ceiling of a re-read);
                   after one unmeasured read of each, --reread-pairs pairs per repeat taking
                   turns on which goes first; the median of the per-pair ratios, with its
                   spread, is the figure (one 1 GiB re-read takes ~0.1 s: single pairs swing)
  b  k = 1, 2, 4 concurrent dd readers, each on its own tensor (first read): aggregate
     bytes/s through the mount vs the same k dd on the source.
  c  t0 through a second mount with -o dtype=bf16 (first read): output bytes per second
     vs the unconverted view's first read.
  e  4 KiB reads at random page-aligned offsets of t0 (each offset once, FADV_RANDOM, mount
     pages evicted, so every read is a FUSE request): requests/s and p50/p99 latency vs
     the same preads of the source file (page cache).

The alternatives are interleaved within each repeat and the median of --repeats (default 3)
is reported. Results go to stdout and, as JSON lines, to --json-out (run_all.py).

Experiment knobs (optimization work): --mount-opts (e.g. max_threads=2,clone_fd),
--read-ahead-kb (the mount's bdi read-ahead, after ckptfs's own 1 MiB), --only a,b,c,e.

    python tests/bench/bench_read_throughput.py --ckptfs build/ckptfs [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import time
from pathlib import Path

import benchlib
from benchlib import GB, MiB, CkptfsMount, Results, dd, dd_parallel, evict, median

KiB = 1 << 10


def make_source(path: Path, n: int, size: int) -> dict:
    """safetensors file of n float32 tensors of `size` bytes; returns {name: (offset, size)}."""
    header = {}
    off = 0
    for i in range(n):
        header[f"t{i}"] = {"dtype": "F32", "shape": [size // 4], "data_offsets": [off, off + size]}
        off += size
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    ranges = {k: (8 + len(hb) + v["data_offsets"][0], size) for k, v in header.items()}
    if path.exists() and path.stat().st_size == 8 + len(hb) + off:
        return ranges
    import numpy as np
    block = np.random.default_rng(7).standard_normal(4 * MiB, dtype=np.float32).tobytes()  # 16 MiB
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for _ in range(off // len(block)):
            f.write(block)
        f.write(block[: off % len(block)])
    tmp.rename(path)
    return ranges


def data_range(mnt_file: Path) -> tuple[int, int]:
    """(offset, length) of the tensor data in a per-tensor safetensors file."""
    with open(mnt_file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n, mnt_file.stat().st_size - 8 - n


def warm(src: Path, ranges: dict):
    for off, size in ranges.values():
        dd(src, off, size)


class SmallPageTmpfs:
    """A tmpfs of SIZE bytes with 4 KiB pages only (huge=never) at PATH, holding a copy of
    bytes [offset, offset+length) of SRC as `copy`; unmounted on exit."""

    def __init__(self, path: Path, src: Path, offset: int, length: int):
        self.path, self.src, self.offset, self.length = path, src, offset, length
        self.copy = path / "copy"

    def __enter__(self):
        import subprocess
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.length + 64 * MiB},huge=never", "tmpfs",
                        str(self.path)], check=True, timeout=60)
        subprocess.run(["dd", f"if={self.src}", f"of={self.copy}", "bs=1M", f"skip={self.offset}",
                        f"count={self.length}", "iflag=skip_bytes,count_bytes", "status=none"], check=True,
                       timeout=600)
        return self

    def __exit__(self, *exc):
        import subprocess
        subprocess.run(["umount", str(self.path)], timeout=60)
        return False


def wait_read_ahead(mnt: Path, want: int | None):
    """ckptfs raises the bdi read-ahead from a thread after mounting: wait for it, then
    apply --read-ahead-kb if given."""
    deadline = time.monotonic() + 5
    while benchlib.read_ahead_kb(mnt) < 1024 and time.monotonic() < deadline:
        time.sleep(0.01)
    if want:
        benchlib.set_read_ahead_kb(mnt, want)


def random_reads(path: Path, offsets: list[int], advise_random: bool) -> list[float]:
    """Latency (s) of each 4 KiB pread at the given offsets."""
    fd = os.open(path, os.O_RDONLY)
    lat = []
    try:
        if advise_random:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        pc = time.perf_counter
        pread = os.pread
        for off in offsets:
            t = pc()
            b = pread(fd, 4096, off)
            lat.append(pc() - t)
            if len(b) != 4096:
                raise RuntimeError(f"short read at {off}")
    finally:
        os.close(fd)
    return lat


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(ap)
    ap.add_argument("--size-mib", type=int, default=0, help="bytes per tensor (default 1024, quick 128)")
    ap.add_argument("--only", default="a,b,c,e")
    ap.add_argument("--mount-opts", default="", help="extra -o options for both mounts")
    ap.add_argument("--read-ahead-kb", type=int, default=0)
    ap.add_argument("--random-reads", type=int, default=0, help="4 KiB reads per run (default 20000, quick 4000)")
    ap.add_argument("--tag", default="", help="suffix for figure ids (experiments)")
    ap.add_argument("--reread-pairs", type=int, default=5,
                    help="re-read pairs (mount, tmpfs copy) per repeat, taking turns on which goes first")
    args = ap.parse_args()
    got = benchlib.workdir_and_binary(argparse.Namespace(workdir=args.workdir, ckptfs=args.ckptfs, generate_only=False))
    if not got:
        return 2
    workdir, ckptfs = got
    if os.geteuid() != 0:
        print("needs root (drop_caches, bdi read-ahead)", file=sys.stderr)
        return 2
    only = set(args.only.split(","))
    size = (args.size_mib or (128 if args.quick else 1024)) * MiB
    repeats = args.repeats or (1 if args.quick else 3)
    nrand = args.random_reads or (4000 if args.quick else 20000)
    res = Results("read_throughput", args.json_out)
    tag = args.tag

    src = workdir / f"throughput-4x{size // MiB}MiB.safetensors"
    t0 = time.perf_counter()
    ranges = make_source(src, 4, size)
    print(f"source {src} ({4 * size / GB:.2f} GB, 4 x {size // MiB} MiB float32) ready in "
          f"{time.perf_counter() - t0:.1f} s; {benchlib.machine_note()}; repeats {repeats}", flush=True)
    mnt_plain = workdir / "mnt-plain"
    mnt_bf16 = workdir / "mnt-bf16"
    opts = args.mount_opts
    bf16_opts = "dtype=bf16" + ("," + opts if opts else "")
    ok = True
    with CkptfsMount(ckptfs, src, mnt_plain, opts) as mp, CkptfsMount(ckptfs, src, mnt_bf16, bf16_opts) as mb, \
            SmallPageTmpfs(workdir / "tmpfs-4k", src, *ranges["t0"]) as tmpfs:
        wait_read_ahead(mnt_plain, args.read_ahead_kb)
        wait_read_ahead(mnt_bf16, args.read_ahead_kb)
        ra = benchlib.read_ahead_kb(mnt_plain)
        files = {k: mnt_plain / "tensors" / f"{k}.safetensors" for k in ranges}
        mranges = {k: data_range(f) for k, f in files.items()}
        bf16_file = mnt_bf16 / "tensors" / "t0.safetensors"
        bf16_range = data_range(bf16_file)
        assert bf16_range[1] == size // 2
        # The same bytes? (cheap check on the first and last MiB)
        with open(src, "rb") as s, open(files["t0"], "rb") as m:
            for rel in (0, size - MiB):
                s.seek(ranges["t0"][0] + rel)
                m.seek(mranges["t0"][0] + rel)
                if s.read(MiB) != m.read(MiB):
                    print("mount and source differ", file=sys.stderr)
                    return 1
        detail = {"tensor_bytes": size, "read_ahead_kb": ra, "mount_opts": opts, "repeats": repeats,
                  "load": benchlib.machine_note()}

        if "a" in only or "c" in only:
            first, reread, dd_first, bf16 = [], [], [], []
            for _ in range(repeats):
                warm(src, ranges)
                dd_first.append(dd(src, *ranges["t0"]))
                evict(files["t0"])
                first.append(dd(files["t0"], *mranges["t0"]))
                # Steady re-reads: one unmeasured read of each side first (the mount's first
                # re-read also moves its pages to the active LRU list, which the tmpfs copy's
                # pages went through when it was read before), then pairs taking turns on
                # which goes first; the ratio is taken per pair.
                dd(files["t0"], *mranges["t0"])
                dd(tmpfs.copy)
                for j in range(args.reread_pairs):
                    if j % 2 == 0:
                        m = dd(files["t0"], *mranges["t0"])
                        t = dd(tmpfs.copy)
                    else:
                        t = dd(tmpfs.copy)
                        m = dd(files["t0"], *mranges["t0"])
                    reread.append((m, dd(src, *ranges["t0"]), t))
                if "c" in only:
                    evict(bf16_file)
                    bf16.append(dd(bf16_file, *bf16_range))
            src_bps = size / median(dd_first)
            if "a" in only:
                f_bps = size / median(first)
                res.add("a.first" + tag, f"seq read {size // MiB} MiB tensor, first read (source cached)",
                        f_bps / GB, src_bps / GB, "GB/s", "≥ 0.3", f_bps / src_bps >= 0.3,
                        alt_name="dd source", detail={**detail, "ckptfs_s": first, "dd_s": dd_first})
                rr = size / median([r[0] for r in reread])
                rs = size / median([r[1] for r in reread])
                rt = size / median([r[2] for r in reread])
                res.add("a.reread" + tag, f"seq read {size // MiB} MiB tensor, re-read (both cached)",
                        rr / GB, rs / GB, "GB/s", "info", None, alt_name="dd source",
                        detail={**detail, "pairs_s": reread})
                # Per pair (the two reads a few ms apart): the median ratio and its spread.
                pair_ratios = sorted(r[2] / r[0] for r in reread)
                pr = median(pair_ratios)
                print(f"  re-read / tmpfs per pair ({len(pair_ratios)}): median {pr:.3f}, "
                      f"min {pair_ratios[0]:.3f}, max {pair_ratios[-1]:.3f}; mount "
                      f"{min(r[0] for r in reread) * 1e3:.0f}-{max(r[0] for r in reread) * 1e3:.0f} ms, tmpfs "
                      f"{min(r[2] for r in reread) * 1e3:.0f}-{max(r[2] for r in reread) * 1e3:.0f} ms", flush=True)
                res.add("a.reread_tmpfs" + tag, f"re-read vs a tmpfs copy with 4 KiB pages (the ceiling), median of pairs",
                        rr / GB, rt / GB, "GB/s", "≥ 0.95", pr >= 0.95, ratio=pr, alt_name="dd tmpfs 4 KiB",
                        detail={**detail, "triples_s": reread, "pair_ratios": pair_ratios})
            if "c" in only:
                c_bps = (size // 2) / median(bf16)
                u_bps = size / median(first)
                res.add("c.bf16" + tag, f"bf16 view of fp32 tensor, output bytes/s (first read)",
                        c_bps / GB, u_bps / GB, "GB/s", "≥ 0.6", c_bps / u_bps >= 0.6,
                        alt_name="unconverted view", detail={**detail, "bf16_s": bf16, "plain_s": first})

        if "b" in only:
            names = list(ranges)
            aggs = {}
            for k in (1, 2, 4):
                mine, theirs = [], []
                for _ in range(repeats):
                    warm(src, ranges)
                    theirs.append(dd_parallel([(src, *ranges[n]) for n in names[:k]]))
                    for n in names[:k]:
                        evict(files[n])
                    mine.append(dd_parallel([(files[n], *mranges[n]) for n in names[:k]]))
                m_bps = k * size / median(mine)
                t_bps = k * size / median(theirs)
                aggs[k] = (m_bps, t_bps)
                res.add(f"b.{k}{tag}", f"{k} concurrent readers, aggregate (first read)", m_bps / GB, t_bps / GB,
                        "GB/s", "info", None, alt_name="dd source",
                        detail={**detail, "ckptfs_s": mine, "dd_s": theirs})
            g2 = aggs[2][0] / aggs[1][0]
            g4 = aggs[4][0] / aggs[2][0]
            ncpu = os.cpu_count() or 1
            res.add("b.scale2" + tag, "aggregate 2 readers / 1 reader", aggs[2][0] / GB, aggs[1][0] / GB, "GB/s",
                    "> 1.0 (grows up to the core count)" if ncpu >= 2 else "info",
                    (g2 > 1.0) if ncpu >= 2 else None, alt_name="1 reader",
                    detail={"dd_scale2": aggs[2][1] / aggs[1][1], "cpus": ncpu})
            res.add("b.scale4" + tag, "aggregate 4 readers / 2 readers", aggs[4][0] / GB, aggs[2][0] / GB, "GB/s",
                    "> 1.0" if ncpu >= 4 else "≥ 0.9 (beyond the core count)",
                    (g4 > 1.0) if ncpu >= 4 else g4 >= 0.9, alt_name="2 readers",
                    detail={"dd_scale4": aggs[4][1] / aggs[2][1], "cpus": ncpu})

        if "e" in only:
            rng = random.Random(11)
            m_off, _ = mranges["t0"]
            s_off, _ = ranges["t0"]
            pages = rng.sample(range(size // 4096), min(nrand, size // 4096))
            m_lat, s_lat = [], []
            for _ in range(repeats):
                warm(src, {"t0": ranges["t0"]})
                s_lat.append(random_reads(src, [s_off + p * 4096 for p in pages], True))
                evict(files["t0"])
                m_lat.append(random_reads(files["t0"], [m_off + p * 4096 for p in pages], True))
            resident = benchlib.cached_pages(files["t0"])[0]
            rps_m = median([len(x) / sum(x) for x in m_lat])
            rps_s = median([len(x) / sum(x) for x in s_lat])
            p50_m = median([pct(x, 50) for x in m_lat]) * 1e6
            p99_m = median([pct(x, 99) for x in m_lat]) * 1e6
            p50_s = median([pct(x, 50) for x in s_lat]) * 1e6
            p99_s = median([pct(x, 99) for x in s_lat]) * 1e6
            d = {**detail, "reads": len(pages), "mount_pages_resident_after": resident}
            res.add("e.rps" + tag, f"4 KiB random reads ({len(pages)}, mount uncached), requests/s",
                    rps_m, rps_s, "req/s", "info", None, alt_name="pread source", detail=d)
            res.add("e.p50" + tag, "4 KiB random read p50 latency", p50_m, p50_s, "us",
                    "≤ 25 us (anchor L6)", p50_m <= 25, alt_name="pread source", detail=d)
            res.add("e.p99" + tag, "4 KiB random read p99 latency", p99_m, p99_s, "us", "info", None,
                    alt_name="pread source", detail=d)
    if not args.keep:
        src.unlink(missing_ok=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
