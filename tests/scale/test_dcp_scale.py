"""A DCP folder of 1,000,000 chunks (tests/scale/make_dcp_scale.py: torch's own metadata
classes, a 256-rank FSDP-shaped save of a 3,999-parameter model, built once per machine into
the fixture cache): `ckptfs ls` lists exactly its tensors, and a damaged chunk among many of
one shape is still refused with its fqn named.

Times are not asserted here (tests/bench/bench_metadata_scale.py prints them); peak RSS has
a generous ceiling that catches a regression in per-chunk memory, not the goal itself.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SUITE_DIR.parent))

from ckptfs_testlib import cached_fixtures_or_fail, ckptfs_bin, run_ckptfs  # noqa: E402,F401

GENERATOR = SUITE_DIR / "make_dcp_scale.py"
# About 2.5 minutes on two loaded cores (1.7 GB of zip records).
GENERATE_TIMEOUT_S = 1200
# Peak RSS of `ckptfs ls` on the million chunks: 1.5 GB measured (the goal, 1 GB, is not
# met yet: the parsed .metadata pickle still takes ~1 KB per chunk, six objects and dicts of
# 128 bytes each). A ceiling a little above today's figure, so that a regression in per-chunk
# memory fails.
RSS_CEILING_BYTES = 2_200_000_000

pytestmark = pytest.mark.skipif(
    bool(os.environ.get("CKPTFS_SANITIZED")),
    reason="a million-chunk listing under ASan measures the sanitizer; tests/dcp covers the reader there",
)


@pytest.fixture(scope="module")
def million_chunks() -> Path:
    return cached_fixtures_or_fail(GENERATOR, timeout_s=GENERATE_TIMEOUT_S)


def test_million_chunk_listing(million_chunks, ckptfs_bin, tmp_path):
    expected = json.loads((million_chunks / "expected.json").read_text())
    assert expected["chunks"] >= 1_000_000 and expected["ranks"] == 256
    argv = [str(ckptfs_bin), "ls", "--json", str(million_chunks)]
    listing_path = tmp_path / "ls.json"
    with open(listing_path, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        # wait4 gives this child's own peak RSS (the stderr pipe is tiny: one line at most).
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            process.returncode = 0  # reaped above; keep Popen from waiting again
    stderr = process.stderr.read().decode(errors="replace")
    process.stderr.close()
    assert os.waitstatus_to_exitcode(status) == 0, f"{' '.join(argv)} failed:\n{stderr}"
    entries = json.loads(listing_path.read_text())
    got = {e["key"]: [e["dtype"], e["shape"]] for e in entries}
    assert len(entries) == len(got) == len(expected["tensors"])
    assert got == expected["tensors"]
    peak = usage.ru_maxrss * 1024
    assert peak < RSS_CEILING_BYTES, f"ckptfs ls peak RSS {peak / 1e9:.2f} GB over the ceiling"


def damage_chunk(folder: Path, fqn: str, rank: int) -> None:
    """Makes the chunk of `fqn` in rank `rank`'s file hold an int16 storage: one byte-for-byte
    substitution inside its data.pkl, so its archive stays well formed but differs from the
    other chunks of that shape (which share one parsed pickle)."""
    import pickle

    import torch  # noqa: F401  (unpickles the metadata's torch.Size)

    metadata = pickle.loads((folder / ".metadata").read_bytes())
    info = next(v for k, v in metadata.storage_data.items()
                if k.fqn == fqn and v.relative_path == f"__{rank}_0.distcp")
    path = folder / info.relative_path
    data = bytearray(path.read_bytes())
    window = data[info.offset:info.offset + info.length]
    at = window.find(b"FloatStorage")
    assert at >= 0, "chunk archive without a FloatStorage global"
    data[info.offset + at:info.offset + at + 12] = b"ShortStorage"
    path.write_bytes(bytes(data))


def test_damaged_chunk_among_many_of_one_shape_is_refused(tmp_path, run_ckptfs):
    folder = tmp_path / "dcp"
    subprocess.run([sys.executable, str(GENERATOR), str(folder), "--ranks", "16", "--layers", "2"],
                   check=True, capture_output=True, timeout=300)
    expected = json.loads((folder / "expected.json").read_text())
    entries = json.loads(run_ckptfs("ls", "--json", folder).stdout)
    assert {e["key"]: [e["dtype"], e["shape"]] for e in entries} == expected["tensors"]

    victim = "model.layers.1.self_attn.k_proj.weight"
    damage_chunk(folder, victim, rank=9)
    result = run_ckptfs("ls", folder, check=False)
    lines = result.stderr.decode().strip().splitlines()
    assert result.returncode == 1 and result.stdout == b""
    assert len(lines) == 1 and victim in lines[0] and "__9_0.distcp" in lines[0], lines
