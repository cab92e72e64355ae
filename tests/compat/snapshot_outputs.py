#!/usr/bin/env python3
"""What a ckptfs build prints and serves for every fixture checkpoint of the test suites, as
one JSON file, and the comparison of two such files: a refactoring that changes no behaviour
leaves every entry identical.

    python tests/compat/snapshot_outputs.py snapshot --bin build/ckptfs --out before.json
    python tests/compat/snapshot_outputs.py compare before.json after.json

Per source (tests/data, the committed corpus of malformed files, and the fixture cache's real
DeepSpeed, DCP and parallel saves, generated first where absent; and, served through
`map=auto`, megatron-core's saves of every shipped model family in every layout the
frameworks write, which need the megatron16 overlay): `ls --json`, `info`,
`info --json`, `hash`, the files `export --write all` writes (mode, size, BLAKE2 hash),
and the tree a mount serves (every path, its mode, size and a BLAKE2 hash of its bytes), each with the exit
status and stderr. Sources whose tensor bytes exceed --max-mb are left out, and the left-out
ones listed. Paths of the machine (the source's own, temporary folders) are written as
placeholders so two runs compare."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

from ckptfs_fixture_cache import (  # noqa: E402
    DCP_CHECKPOINTS,
    PARALLEL_CHECKPOINTS,
    ZERO_CHECKPOINTS,
    cached_fixtures,
)
from fusetools import teardown_mount, wait_for_mount  # noqa: E402

COMMAND_TIMEOUT_S = 120
MEGATRON_GPT_CHECKPOINTS = TESTS / "frameworks" / "make_megatron_gpt.py"
MAP_SUFFIX = "+map=auto"


def sources(max_mb: int) -> tuple[dict, list]:
    """{stable name: path}, [left out]."""
    found = {}
    data = TESTS / "data"
    found["data/sample-mlp-training.pt"] = data / "sample-mlp-training.pt"
    for folder in ("dcp-sample", "dcp-sharded"):
        found[f"data/{folder}"] = data / folder
    for case in sorted((data / "dcp-variants").iterdir()):
        if case.is_dir():
            found[f"data/dcp-variants/{case.name}"] = case
    for case in sorted((TESTS / "corpus" / "cases").iterdir()):
        found[f"corpus/{case.name}"] = case
    zero = cached_fixtures(ZERO_CHECKPOINTS)
    for case in sorted(p for p in zero.iterdir() if p.is_dir()):
        found[f"zero/{case.name}"] = case / "checkpoint"
        for extra in ("zero_to_fp32.pt", "engine_reference.pt"):
            if (case / extra).is_file():
                found[f"zero/{case.name}/{extra}"] = case / extra
    parallel = cached_fixtures(PARALLEL_CHECKPOINTS)
    for case in sorted(p for p in parallel.iterdir() if p.is_dir()):
        found[f"parallel/{case.name}"] = case / "checkpoint" if (case / "checkpoint").is_dir() else case
    dcp = cached_fixtures(DCP_CHECKPOINTS)
    for case in sorted(dcp.iterdir()):
        if case.is_dir() or case.suffix == ".pt":
            found[f"dcp/{case.name}"] = case
    # Through the key maps: the name ends in "+map=auto" (Snapshot.of reads it).
    megatron = cached_fixtures(MEGATRON_GPT_CHECKPOINTS, overlay="megatron16", timeout_s=900)
    for case in sorted(p for p in megatron.iterdir() if (p / "fixture.json").is_file()):
        nemo_name = json.loads((case / "fixture.json").read_text())["nemo_name"]
        for layout in ("megatron_lm", "bridge", f"nemo2/{nemo_name}", "nemo_rl/step_1"):
            if (case / layout).is_dir():
                found[f"megatron/{case.name}/{layout.split('/')[0]}{MAP_SUFFIX}"] = case / layout
    left_out = []
    for name, path in list(found.items()):
        size = sum(p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
        if size > max_mb << 20:
            left_out.append(name)
            del found[name]
    return found, left_out


def digest_of(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class Snapshot:
    def __init__(self, binary: Path, work: Path):
        self.binary = binary
        self.work = work

    def scrub(self, text: str, source: Path) -> str:
        for path, placeholder in ((str(source.resolve()), "<SOURCE>"), (str(source), "<SOURCE>"),
                                  (str(self.work), "<WORK>")):
            text = text.replace(path, placeholder)
        return text

    def run(self, source: Path, *args) -> dict:
        try:
            r = subprocess.run([str(self.binary), *map(str, args)], capture_output=True, timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"exit": "timeout"}
        out = r.stdout.decode(errors="replace")
        return {"exit": r.returncode, "stdout": self.scrub(out, source) if len(out) < 200_000 else digest_of(r.stdout),
                "stderr": self.scrub(r.stderr.decode(errors="replace"), source)}

    def tree(self, root: Path) -> dict:
        entries = {}
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel = Path(dirpath).relative_to(root)
            for name in sorted(dirnames):
                entries[str(rel / name) + "/"] = oct(os.lstat(Path(dirpath) / name).st_mode)
            for name in sorted(filenames):
                path = Path(dirpath) / name
                st = os.lstat(path)
                try:
                    digest = digest_of(path.read_bytes())
                except OSError as e:
                    digest = f"error {e.errno}"
                entries[str(rel / name)] = f"{oct(st.st_mode)} {st.st_size} {digest}"
        return entries

    def export(self, source: Path, view: tuple) -> dict:
        out = self.work / "export"
        result = self.run(source, "export", "--write", "all", *view, source, out)
        result["files"] = self.tree(out) if out.is_dir() else {}
        subprocess.run(["rm", "-rf", str(out)], check=True)
        return result

    def mount(self, source: Path, options: tuple) -> dict:
        mnt = self.work / "mnt"
        mnt.mkdir(exist_ok=True)
        daemon = subprocess.Popen([str(self.binary), str(source), str(mnt), "-f", *options], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE)
        try:
            if wait_for_mount(mnt, daemon=daemon) is None:
                daemon.wait(timeout=COMMAND_TIMEOUT_S)
                return {"mounted": False, "exit": daemon.returncode,
                        "stderr": self.scrub(daemon.stderr.read().decode(errors="replace"), source)}
            return {"mounted": True, "tree": self.tree(mnt)}
        finally:
            teardown_mount(mnt, self.binary)
            if daemon.poll() is None:
                daemon.kill()
            daemon.wait()

    def of(self, name: str, source: Path) -> dict:
        view, options = (("--map", "auto"), ("-o", "map=auto")) if name.endswith(MAP_SUFFIX) else ((), ())
        return {
            "ls": self.run(source, "ls", "--json", *view, source),
            "info": self.run(source, "info", *view, source),
            "info_json": self.run(source, "info", "--json", *view, source),
            "hash": self.run(source, "hash", *view, source),
            "export": self.export(source, view),
            "mount": self.mount(source, options),
        }


def snapshot(args) -> int:
    found, left_out = sources(args.max_mb)
    t0 = time.monotonic()
    result = {"left_out": left_out, "sources": {}}
    with tempfile.TemporaryDirectory(prefix="ckptfs-snapshot-") as work:
        snap = Snapshot(args.bin.resolve(), Path(work))
        for i, (name, path) in enumerate(sorted(found.items())):
            result["sources"][name] = snap.of(name, path)
            if (i + 1) % 25 == 0:
                print(f"snapshot: {i + 1}/{len(found)} sources ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True))
    print(f"snapshot: {len(found)} sources into {args.out} in {time.monotonic() - t0:.0f} s "
          f"({len(left_out)} left out: over {args.max_mb} MiB)")
    return 0


def compare(args) -> int:
    a, b = json.loads(args.before.read_text()), json.loads(args.after.read_text())
    names = sorted(set(a["sources"]) | set(b["sources"]))
    differ = []
    for name in names:
        x, y = a["sources"].get(name), b["sources"].get(name)
        if x != y:
            parts = sorted(k for k in set(x or {}) | set(y or {}) if (x or {}).get(k) != (y or {}).get(k))
            differ.append(f"{name}: {', '.join(parts)}")
    print(f"compare: {len(names) - len(differ)} of {len(names)} sources identical "
          f"(ls --json, info, info --json, hash, export, mount tree)")
    for line in differ:
        print(f"  differs: {line}")
    return 1 if differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("--bin", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--max-mb", type=int, default=256)
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = ap.parse_args()
    return snapshot(args) if args.command == "snapshot" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
