"""The catalog cache (-o catalog_cache=DIR, --catalog-cache DIR): reopening an unchanged
checkpoint file reads its catalog from DIR instead of parsing it; anything else reads the
source afresh, never a stale or damaged entry.

Checkpoints are real torch.save files. To show that a hit really skips the source's pickle,
one test edits a cached entry (a tensor key renamed, the entry's XXH3-64 checksum recomputed
with the system's libxxhash) and sees the edit in the listing: nothing else could produce it.
An entry records the ckptfs version and the reader code stamp (a hash of the readers' sources,
made by the build) that built it; one edited to look written by another is stale and rewritten.

Every source kind that the writers of torch, safetensors and DeepSpeed make (the ZeRO save from
the fixture cache, tests/ckptfs_fixture_cache.py) is served the same with the cache on and off,
by `ls`, `export` and a mount; only single local files get an entry. URLs: tests/remote.
"""

import ctypes
import ctypes.util
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ckptfs_testlib import ckptfs_bin, run_ckptfs, zero_fixtures_root  # noqa: E402,F401
from fusetools import mount_entry  # noqa: E402
from served import served  # noqa: E402


def save_checkpoint(path: Path, scale: float = 1.0) -> dict:
    torch.manual_seed(0)
    state = {
        "model": {"embed.weight": torch.randn(7, 5) * scale, "head.bias": torch.arange(4, dtype=torch.int64)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(7, 5).bfloat16()}}, "param_groups": [{"lr": 0.01}]},
        "step": 12,
        "config": {"name": "tiny", "layers": [1, 2, 3], "dropout": None},
    }
    torch.save(state, path)
    return state


def entries(folder: Path) -> list:
    return sorted(folder.glob("*.catalog"))


def listing(run_ckptfs, source, *options):
    result = run_ckptfs("ls", "--json", *options, source)
    return json.loads(result.stdout), result.stderr.decode()


def xxh3_64(data: bytes) -> int:
    name = ctypes.util.find_library("xxhash")
    if not name:
        pytest.fail("libxxhash not found (scripts/install-deps.sh installs it: ckptfs links it)")
    lib = ctypes.CDLL(name)
    lib.XXH3_64bits.restype = ctypes.c_uint64
    lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return lib.XXH3_64bits(data, len(data))


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path)
    return path


def test_hit_gives_the_same_listing_metadata_and_bytes(checkpoint, tmp_path, run_ckptfs):
    cache = tmp_path / "cache"
    reference, _ = listing(run_ckptfs, checkpoint)
    reference_info = run_ckptfs("info", checkpoint).stdout
    reference_bytes = run_ckptfs("cat", checkpoint, "model.safetensors").stdout
    reference_metadata = run_ckptfs("cat", checkpoint, "metadata.json").stdout

    first, err = listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
    assert err == "" and first == reference
    [entry] = entries(cache)
    assert not list(cache.glob("*.tmp-*")), "a temporary file was left in the cache folder"
    written = entry.stat().st_mtime_ns
    for _ in range(2):
        again, err = listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
        assert err == "" and again == reference
    assert run_ckptfs("info", "--catalog-cache", cache, checkpoint).stdout == reference_info
    assert run_ckptfs("cat", "--catalog-cache", cache, checkpoint, "model.safetensors").stdout == reference_bytes
    assert run_ckptfs("cat", "--catalog-cache", cache, checkpoint, "metadata.json").stdout == reference_metadata
    assert entries(cache) == [entry] and entry.stat().st_mtime_ns == written, "a hit rewrote the entry"
    assert not any(p.suffix == ".catalog" for p in checkpoint.parent.iterdir()), "cache written beside the source"


def test_a_hit_does_not_parse_the_source(checkpoint, tmp_path, run_ckptfs):
    """An edited entry (checksum made right again) is what a hit lists."""
    cache = tmp_path / "cache"
    listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
    [entry] = entries(cache)
    data = entry.read_bytes()
    body = data[:-8]
    assert body.count(b"model.embed.weight") == 1
    body = body.replace(b"model.embed.weight", b"model.EMBED.weight")
    entry.write_bytes(body + xxh3_64(body).to_bytes(8, "little"))
    edited, err = listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
    assert err == ""
    assert "model.EMBED.weight" in {e["key"] for e in edited}


def test_a_changed_source_is_read_afresh(checkpoint, tmp_path, run_ckptfs):
    cache = tmp_path / "cache"
    listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
    stat = checkpoint.stat()
    # Same path, new content; mtime set back to the old one: size or ctime still differ.
    state = save_checkpoint(checkpoint, scale=2.0)
    state["model"]["extra"] = torch.zeros(3)
    torch.save(state, checkpoint)
    os.utime(checkpoint, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    fresh, _ = listing(run_ckptfs, checkpoint)
    cached, err = listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
    assert err == "" and cached == fresh and "model.extra" in {e["key"] for e in cached}
    assert (run_ckptfs("cat", "--catalog-cache", cache, checkpoint, "model.safetensors").stdout ==
            run_ckptfs("cat", checkpoint, "model.safetensors").stdout)
    assert len(entries(cache)) == 1


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "empty", "not an entry", "older version"])
def test_a_damaged_entry_is_ignored_with_one_line(checkpoint, tmp_path, run_ckptfs, damage):
    cache = tmp_path / "cache"
    reference, _ = listing(run_ckptfs, checkpoint)
    listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
    [entry] = entries(cache)
    data = bytearray(entry.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    elif damage == "older version":  # the layout before paths were stored packed
        data[16:20] = (1).to_bytes(4, "little")
    else:
        data = bytearray(b"PK\x03\x04" + bytes(200))
    entry.write_bytes(bytes(data))
    got, err = listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
    assert got == reference
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfs: ignoring the catalog cache entry") and str(entry) in lines[0]
    # Replaced by a good entry: the next open is a quiet hit.
    again, err = listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
    assert again == reference and err == ""


def test_mount_reads_through_the_cache(checkpoint, tmp_path, mounts, run_ckptfs):
    cache = tmp_path / "cache"
    expected_bytes = run_ckptfs("cat", checkpoint, "model.safetensors").stdout
    names = None
    for _ in range(2):  # the first mount writes the entry, the second reads it
        mnt = mounts.mount(checkpoint, None, "-o", f"catalog_cache={cache}")
        assert (mnt / "model.safetensors").read_bytes() == expected_bytes
        listed = sorted(os.listdir(mnt / "tensors"))
        assert names is None or listed == names
        names = listed
        mounts.unmount(mnt)
    assert len(entries(cache)) == 1


# ---- a mount through a hit opens the catalog in its daemon, after mounting ------------------

def rewrite_entry(entry: Path, edit) -> None:
    """Applies EDIT to the entry's fields and makes its checksum right again."""
    body = edit(entry.read_bytes()[:-8])
    entry.write_bytes(body + xxh3_64(body).to_bytes(8, "little"))


def gone_within(mountpoint: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if mount_entry(mountpoint) is None:
            return True
        time.sleep(0.05)
    return mount_entry(mountpoint) is None


def test_a_mount_through_a_hit_serves_the_entry(checkpoint, tmp_path, mounts, run_ckptfs):
    """The second mount finds the entry usable (checksum, files, distinct keys), mounts, and
    opens the catalog in its daemon: what it serves is the entry's (an edited key shows)."""
    cache = tmp_path / "cache"
    listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
    [entry] = entries(cache)
    rewrite_entry(entry, lambda b: b.replace(b"model.embed.weight", b"model.EMBED.weight"))
    expected = run_ckptfs("cat", "--catalog-cache", cache, checkpoint, "model.safetensors").stdout
    assert b"model.EMBED.weight" in expected
    mnt = mounts.mount(checkpoint, None, "-o", f"catalog_cache={cache}")
    assert "model.EMBED.weight.safetensors" in os.listdir(mnt / "tensors")
    assert (mnt / "model.safetensors").read_bytes() == expected
    manifest = json.loads((mnt / "manifest.json").read_text())
    assert {t["key"] for t in manifest["tensors"]} == {e["key"] for e in listing(run_ckptfs, checkpoint,
                                                                                  "--catalog-cache", cache)[0]}


def test_a_hit_whose_content_is_damaged_is_read_from_the_source_by_the_daemon(checkpoint, tmp_path, mounts,
                                                                              run_ckptfs):
    """Head intact, a tensor's packed path malformed (checksum made right): the mount checks
    only the head and mounts; its daemon finds the damage, reads the source instead, and
    serves exactly what a mount without the cache serves."""
    cache = tmp_path / "cache"
    listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
    [entry] = entries(cache)
    key = b"model.embed.weight"

    def damage_path(body: bytes) -> bytes:
        at = body.index(key) + len(key)  # the key, then the path: u64 length, packed bytes
        length = int.from_bytes(body[at:at + 8], "little")
        assert 0 < length < 100
        # The path's first element claims more bytes than the path holds.
        return body[:at + 8] + bytes([0x7E]) + body[at + 9:]

    rewrite_entry(entry, damage_path)
    expected = run_ckptfs("cat", checkpoint, "model.safetensors").stdout
    mnt = mounts.mount(checkpoint, None, "-o", f"catalog_cache={cache}")
    assert (mnt / "model.safetensors").read_bytes() == expected
    assert sorted(os.listdir(mnt / "tensors")) == sorted(
        t["file"].split("/", 1)[1] for t in listing(run_ckptfs, checkpoint)[0])


def test_a_source_that_cannot_be_served_fails_the_mount_with_the_cache_on(tmp_path, mounts):
    """Two keys flatten to one: the reader refuses the source, so there is no entry, and each
    mount with the cache on fails before mounting, with one line and exit 1."""
    source = tmp_path / "clash.pt"
    torch.save({"a.b": torch.zeros(2), "a": {"b": torch.ones(2)}}, source)
    cache = tmp_path / "cache"
    for _ in range(2):
        mnt = mounts.new_mountpoint()
        res = mounts.start([mounts.binary, source, mnt, "-o", f"catalog_cache={cache}"], mnt)
        assert res.returncode == 1, res.describe()
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "two tensors flatten to the same key 'a.b'" in lines[0], res.describe()
        assert mount_entry(mnt) is None
        assert entries(cache) == []


def test_a_tampered_hit_that_cannot_be_served_leaves_no_mount(tmp_path, mounts, run_ckptfs):
    """An entry edited so that two keys are equal while it still says they are distinct: the
    mount goes ahead, its daemon cannot build the tree, says so, and unmounts."""
    source = tmp_path / "pair.pt"
    torch.save({"model.aaaa": torch.zeros(2), "model.bbbb": torch.ones(2)}, source)
    cache = tmp_path / "cache"
    listing(run_ckptfs, source, "--catalog-cache", cache)
    [entry] = entries(cache)
    rewrite_entry(entry, lambda b: b.replace(b"model.bbbb", b"model.aaaa"))
    mnt = mounts.new_mountpoint()
    res = mounts.start([mounts.binary, source, mnt, "-o", f"catalog_cache={cache}"], mnt)
    assert res.returncode == 0, res.describe()
    assert gone_within(mnt, 30), "the mount stayed with no tree behind it"


# ---- the readers that built an entry ----------------------------------------------------

def ckptfs_version(run_ckptfs) -> str:
    return run_ckptfs("--version").stdout.decode().split()[1]


def changed_digit(body: bytes, field: bytes) -> bytes:
    """BODY with the last (hex) digit of FIELD (found once) changed: another value, same length."""
    assert body.count(field) == 1, field
    at = body.index(field) + len(field) - 1
    digit = body[at:at + 1]
    assert digit in b"0123456789abcdef"
    return body[:at] + (b"1" if digit == b"0" else b"0") + body[at + 1:]


# The stamp an entry carries: "ckptfs VERSION; readers HASH".
STAMP = rb"ckptfs [^;]+; readers [0-9a-f]{32}"


@pytest.mark.parametrize("written_by", ["other reader code", "another ckptfs version"])
def test_an_entry_of_other_readers_is_read_afresh_and_rewritten(checkpoint, tmp_path, run_ckptfs, written_by):
    """Stale, as an entry of a changed file is: silently not used, the source parsed again and
    the entry rewritten as this build writes it."""
    cache = tmp_path / "cache"
    reference, _ = listing(run_ckptfs, checkpoint)
    listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
    [entry] = entries(cache)
    written = entry.read_bytes()
    version = ckptfs_version(run_ckptfs)
    stamp = re.search(STAMP, written)
    assert stamp and stamp.group(0).startswith(f"ckptfs {version}; ".encode()), written[:200]
    field = {"other reader code": stamp.group(0),
             "another ckptfs version": f"ckptfs {version}".encode()}[written_by]
    rewrite_entry(entry, lambda body: changed_digit(body, field))
    assert entry.read_bytes() != written
    got, err = listing(run_ckptfs, checkpoint, "--catalog-cache", cache)
    assert got == reference and err == ""
    assert entry.read_bytes() == written, "the stale entry was not rewritten"
    # Rewritten: a hit, and the edit trick shows the hit is the entry's.
    rewrite_entry(entry, lambda b: b.replace(b"model.embed.weight", b"model.EMBED.weight"))
    assert "model.EMBED.weight" in {e["key"] for e in listing(run_ckptfs, checkpoint, "--catalog-cache", cache)[0]}


# ---- every source kind, the cache on and off ---------------------------------------------

# Single local files: the only sources with an entry.
CACHED_KINDS = ("torch zip", "legacy torch.save", "TorchScript", "torch.export", "safetensors file")
KINDS = CACHED_KINDS + ("safetensors folder", "safetensors index", "DeepSpeed ZeRO", "DCP torch_save",
                        "DCP safetensors", "DCP Hugging Face shards")


def write_source_kinds(out: Path) -> dict:
    """{kind: source} of each kind but ZeRO, written by torch, safetensors and torch's DCP
    writers (one process, no process group)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch import nn
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    torch.manual_seed(0)
    state = {"model": {"w": torch.randn(6, 4), "ids": torch.arange(5), "half": torch.randn(3, 2).half()},
             "step": 3, "name": "kinds"}
    module = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    kinds = {kind: out / name for kind, name in [
        ("torch zip", "zip.pt"), ("legacy torch.save", "legacy.pt"), ("TorchScript", "script.pt"),
        ("torch.export", "program.pt2"), ("safetensors file", "file.safetensors"), ("safetensors folder", "folder"),
        ("safetensors index", "sharded/model.safetensors.index.json"), ("DCP torch_save", "dcp-torch-save"),
        ("DCP safetensors", "dcp-safetensors"), ("DCP Hugging Face shards", "dcp-hf")]}
    torch.save(state, kinds["torch zip"])
    torch.save(state, kinds["legacy torch.save"], _use_new_zipfile_serialization=False)
    torch.jit.save(torch.jit.script(module), str(kinds["TorchScript"]))
    torch.export.save(torch.export.export(module, (torch.randn(1, 4),)), str(kinds["torch.export"]))
    save_file(state["model"], str(kinds["safetensors file"]), metadata={"note": "kinds"})
    folder = kinds["safetensors folder"]
    folder.mkdir()
    save_file({"a": torch.randn(3, 2)}, str(folder / "a.safetensors"))
    save_file({"b": torch.randn(4)}, str(folder / "b.safetensors"))
    (folder / "config.json").write_text('{"model_type": "kinds"}')
    sharded = kinds["safetensors index"].parent
    sharded.mkdir()
    shards = {"model-00001-of-00002.safetensors": {"a": torch.randn(3, 2)},
              "model-00002-of-00002.safetensors": {"b": torch.randn(4), "c": torch.ones(2, dtype=torch.int32)}}
    for name, tensors in shards.items():
        save_file(tensors, str(sharded / name), metadata={"format": "pt"})
    kinds["safetensors index"].write_text(json.dumps(
        {"metadata": {"total_size": 44}, "weight_map": {k: n for n, t in shards.items() for k in t}}))
    (sharded / "config.json").write_text('{"model_type": "kinds"}')
    dcp_state = {"w": torch.randn(6, 4), "ids": torch.arange(5), "step": 7}
    dcp.save(dcp_state, storage_writer=FileSystemWriter(str(kinds["DCP torch_save"])))
    dcp.save(dcp_state, storage_writer=FileSystemWriter(str(kinds["DCP safetensors"]),
                                                        serialization_format=SerializationFormat.SAFETENSORS))
    dcp.save({"w": torch.randn(6, 4), "b": torch.randn(5)},
             storage_writer=HuggingFaceStorageWriter(str(kinds["DCP Hugging Face shards"]), save_distributed=True))
    return kinds


@pytest.fixture(scope="module")
def source_kinds(tmp_path_factory) -> dict:
    return write_source_kinds(tmp_path_factory.mktemp("kinds"))


def stamped_entries(cache: Path) -> list:
    return [(e, e.stat().st_mtime_ns, e.read_bytes()) for e in entries(cache)] if cache.exists() else []


@pytest.mark.parametrize("kind", KINDS)
def test_every_source_kind_serves_the_same_with_the_cache_on_and_off(kind, source_kinds, zero_fixtures_root,
                                                                     tmp_path, mounts, ckptfs_bin, run_ckptfs):
    """ls, export and a mount: the same bytes without the cache, when the entry is written, and
    when it is read (the second round, which rewrites nothing)."""
    if kind == "DeepSpeed ZeRO":
        source = zero_fixtures_root / "w2-s2-bf16" / "checkpoint"
        assert source.is_dir(), source
    else:
        source = source_kinds[kind]
    cache = tmp_path / "cache"
    off = served(ckptfs_bin, mounts, source, tmp_path / "off")
    assert off["mount"] and off["export"] and json.loads(off["ls"])
    assert served(ckptfs_bin, mounts, source, tmp_path / "writing", cache=cache) == off
    written = stamped_entries(cache)
    assert len(written) == (1 if kind in CACHED_KINDS else 0), written
    if written:
        # Stamped by this build: its version and its reader code stamp.
        stamp = re.search(STAMP, written[0][2])
        assert stamp and stamp.group(0).startswith(f"ckptfs {ckptfs_version(run_ckptfs)}; ".encode()), \
            written[0][2][:300]
    assert served(ckptfs_bin, mounts, source, tmp_path / "reading", cache=cache) == off
    assert stamped_entries(cache) == written, "an entry was written again or added"
