#!/usr/bin/env python3
"""Benchmark (d): one storage record of a torch .pt read through ckptfs vs through the
archive mounts fuse-zip (Debian) and ratarmount (PyPI) of the same file.

The checkpoint is written by the real torch.save (in a child process): {"w": randn} of
1 GiB float32 (--quick: 128 MiB), cached under --workdir. Its storage record is
ARCHIVE/data/0 in the zip, stored uncompressed, which every tool serves:

  ckptfs      MNT/tensors/w.safetensors, the tensor's data range (after the 8-byte length and
              the JSON header)
  fuse-zip    fuse-zip -r SRC MNT, then MNT/ARCHIVE/data/0
  ratarmount  python -m ratarmount SRC MNT (index in memory), then MNT/ARCHIVE/data/0

Each repeat mounts every tool afresh (in turn), reads the source .pt once (source in page
cache), then times dd bs=1M of the record: first read (nothing of the mount cached), then
re-read. The mount time is reported too (information). Medians of --repeats (default 3).

ratarmount runs from a cached package folder (scripts/bench.sh installs
tests/bench/requirements.txt there): pass --ratarmount-path, or set CKPTFS_BENCH_PKGS.

    python tests/bench/bench_archive_peers.py --ckptfs build/ckptfs [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import benchlib
from benchlib import GB, MiB, CkptfsMount, Results, dd, evict, median, unmount, mounted


def make_checkpoint(path: Path, size: int):
    if path.exists():
        return
    tmp = path.with_name(path.stem + "-tmp.pt")
    code = (f"import torch; torch.manual_seed(0); "
            f"torch.save({{'w': torch.randn({size // 4})}}, {str(tmp)!r})")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=900)
    # torch.save names the archive folder after the file's stem: keep the final name's.
    import zipfile
    with zipfile.ZipFile(tmp) as z:
        names = z.namelist()
    tmp.rename(path)
    print(f"wrote {path} ({path.stat().st_size / GB:.2f} GB); records: {names[:4]}...", flush=True)


def record_name(path: Path) -> str:
    import zipfile
    with zipfile.ZipFile(path) as z:
        for n in z.namelist():
            if n.endswith("/data/0"):
                return n
    raise RuntimeError("no data/0 record")


class ExternalMount:
    """A peer's mount command (it daemonizes and returns once mounted), with a deadline."""

    def __init__(self, argv: list[str], mnt: Path, env=None, timeout: float = 300):
        self.argv, self.mnt, self.env, self.timeout = argv, mnt, env, timeout
        self.mount_s = 0.0

    def __enter__(self):
        self.mnt.mkdir(parents=True, exist_ok=True)
        unmount(self.mnt)
        t0 = time.perf_counter()
        r = subprocess.run(self.argv, capture_output=True, text=True, timeout=self.timeout, env=self.env)
        deadline = time.monotonic() + 30
        while not mounted(self.mnt) and time.monotonic() < deadline:
            time.sleep(0.005)
        self.mount_s = time.perf_counter() - t0
        if not mounted(self.mnt):
            raise RuntimeError(f"{' '.join(self.argv)} exited {r.returncode}, not mounted: "
                               f"{(r.stderr or r.stdout).strip()[-2000:]}")
        return self

    def __exit__(self, *exc):
        unmount(self.mnt)
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(ap)
    ap.add_argument("--size-mib", type=int, default=0, help="storage size (default 1024, quick 128)")
    ap.add_argument("--ratarmount-path", default=os.environ.get("CKPTFS_BENCH_PKGS", ""),
                    help="folder with the ratarmount package (pip --target)")
    args = ap.parse_args()
    got = benchlib.workdir_and_binary(argparse.Namespace(workdir=args.workdir, ckptfs=args.ckptfs, generate_only=False))
    if not got:
        return 2
    workdir, ckptfs = got
    size = (args.size_mib or (128 if args.quick else 1024)) * MiB
    repeats = args.repeats or (1 if args.quick else 3)
    res = Results("archive_peers", args.json_out)

    src = workdir / f"peers{size // MiB}.pt"
    make_checkpoint(src, size)
    rec = record_name(src)
    env = dict(os.environ)
    if args.ratarmount_path:
        env["PYTHONPATH"] = args.ratarmount_path + os.pathsep + env.get("PYTHONPATH", "")
    tools = {
        "ckptfs": None,
        "fuse-zip": (["fuse-zip", "-r", str(src)], rec),
        "ratarmount": ([sys.executable, "-m", "ratarmount", "--index-file", ":memory:", str(src)], rec),
    }
    if not shutil.which("fuse-zip"):
        print("fuse-zip missing (apt-get install fuse-zip; scripts/install-deps.sh)", file=sys.stderr)
        del tools["fuse-zip"]
    r = subprocess.run([sys.executable, "-c", "import ratarmount"], env=env, capture_output=True)
    if r.returncode != 0:
        print("ratarmount missing (scripts/bench.sh installs it; or --ratarmount-path)", file=sys.stderr)
        del tools["ratarmount"]

    first = {t: [] for t in tools}
    reread = {t: [] for t in tools}
    mount_s = {t: [] for t in tools}
    src_first = []
    digests = {}
    for rep in range(repeats):
        for tool, spec in tools.items():
            mnt = workdir / f"mnt-{tool}"
            if tool == "ckptfs":
                ctx = CkptfsMount(ckptfs, src, mnt)
            else:
                argv, _ = spec
                ctx = ExternalMount(argv + [str(mnt)], mnt, env=env)
            with ctx as m:
                if tool == "ckptfs":
                    f = mnt / "tensors" / "w.safetensors"
                    with open(f, "rb") as fh:
                        (n,) = struct.unpack("<Q", fh.read(8))
                    off, length = 8 + n, f.stat().st_size - 8 - n
                else:
                    f = mnt / rec
                    off, length = 0, f.stat().st_size
                if length != size:
                    raise RuntimeError(f"{tool}: record is {length} bytes, expected {size}")
                src_first.append(dd(src))  # source in page cache
                evict(f)
                first[tool].append(dd(f, off, length))
                reread[tool].append(dd(f, off, length))
                mount_s[tool].append(m.mount_s)
                if rep == 0:
                    with open(f, "rb") as fh:
                        fh.seek(off)
                        digests[tool] = hashlib.sha256(fh.read(4 * MiB)).hexdigest()
    if len(set(digests.values())) != 1:
        print(f"the tools serve different bytes: {digests}", file=sys.stderr)
        return 1
    bps = {t: size / median(v) for t, v in first.items()}
    bps2 = {t: size / median(v) for t, v in reread.items()}
    peers = [t for t in tools if t != "ckptfs"]
    detail = {"record_bytes": size, "repeats": repeats, "load": benchlib.machine_note(),
              "first_s": first, "reread_s": reread, "mount_s": mount_s}
    for t in peers:
        res.add(f"d.{t}", f".pt storage record {size // MiB} MiB, first read: vs {t}", bps["ckptfs"] / GB,
                bps[t] / GB, "GB/s", "info", None, alt_name=t, detail=detail)
    if peers:
        best = max(peers, key=lambda t: bps[t])
        res.add("d.first", f".pt storage record {size // MiB} MiB, first read (source cached) vs faster peer",
                bps["ckptfs"] / GB, bps[best] / GB, "GB/s", "≥ 1.0", bps["ckptfs"] / bps[best] >= 1.0,
                alt_name=best, detail=detail)
        best2 = max(peers, key=lambda t: bps2[t])
        res.add("d.reread", f".pt storage record, re-read vs faster peer", bps2["ckptfs"] / GB, bps2[best2] / GB,
                "GB/s", "info", None, alt_name=best2, detail=detail)
        for t in peers:
            res.add(f"d.mount.{t}", f"mount time vs {t}", median(mount_s["ckptfs"]), median(mount_s[t]), "s",
                    "info", None, alt_name=t, detail=detail)
    if not args.keep:
        src.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
