#!/usr/bin/env python3
"""Generates the committed corpus of malformed checkpoints (tests/corpus/cases/) and
tests/corpus/expected.json, which maps every case to the fault it carries and a regex the
single stderr line of `ckptfs ls CASE` (and of a refused mount) must match.

    python tests/corpus/make_corpus.py

Every case starts from a real file and is then damaged on purpose:
- torch cases from a real torch.save() zip (its records, names and layout), with the zip
  structures or the pickle in data.pkl rewritten;
- safetensors cases from a real safetensors.torch.save() file;
- ZeRO cases from real DeepSpeed saves made by tests/zero/make_zero_checkpoints.py (a
  stage-2 and a stage-3 run of 2 ranks, from the machine's fixture cache,
  tests/ckptfs_fixture_cache.py), whose pickles are loaded with torch.load and saved again,
  changed, with torch.save;
- DeepSpeed universal cases from DeepSpeed's own ds_to_universal conversions of those saves
  (tests/zero/make_universal_checkpoints.py, from the same cache), a parameter file
  rewritten with torch.save;
- DCP cases from real torch.distributed.checkpoint saves made by
  tests/dcp/make_dcp_checkpoints.py (FSDP2 at world size 2, in torch_save and safetensors
  form, from the same cache), whose .metadata is loaded with pickle, changed through torch's
  own classes and dumped again; its storage_meta (a random save id, the path it was saved
  to) is replaced by fixed values so that regenerating gives the same bytes.

The corpus is committed: the test never regenerates it, so it keeps testing the same bytes
whatever torch or DeepSpeed versions later produce. Regenerating rewrites cases/ and
expected.json entirely; review the diff.

Each regex matches the message after "ckptfs: <path>: " (the test checks the line starts
with "ckptfs: " and names the case's file or folder)."""

import argparse
import functools
import io
import json
import shutil
import struct
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES_DIR = HERE / "cases"
EXPECTED = HERE / "expected.json"
ZERO_SUITE = HERE.parent / "zero"
sys.path.insert(0, str(HERE.parent))
from ckptfs_fixture_cache import DCP_CHECKPOINTS, UNIVERSAL_CHECKPOINTS, ZERO_CHECKPOINTS, cached_fixtures  # noqa: E402

CASES = []  # (name, fault, error regex, builder(path))


def case(name, fault, error):
    def register(builder):
        CASES.append((name, fault, error, builder))
        return builder

    return register


# --- real starting points ---------------------------------------------------------------


def real_torch_bytes() -> bytes:
    """A real torch.save of a small state dict with three dtypes and a view."""
    import torch

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {
        "w": base,
        "b": torch.ones(4, dtype=torch.float16),
        "i": torch.arange(5, dtype=torch.int64),
        "t": base.t(),  # shares w's storage, non-contiguous
    }
    buf = io.BytesIO()
    # The archive's folder is named after the file ("base/"), as torch.save(path) names it.
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "base.pt"
        torch.save(state, p)
        return p.read_bytes()
    return buf.getvalue()


def real_safetensors_bytes() -> bytes:
    import torch
    from safetensors.torch import save

    return save(
        {
            "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b": torch.ones(4, dtype=torch.bfloat16),
            "c": torch.arange(3, dtype=torch.int64),
        },
        metadata={"format": "pt"},
    )


TORCH = None  # bytes of the real torch.save file
ST = None  # bytes of the real safetensors file


# --- zip structure --------------------------------------------------------------------------


class ZipInfo:
    """Offsets of every structure of a zip file (stored entries, as torch writes them)."""

    def __init__(self, data: bytes):
        self.data = data
        self.eocd = data.rindex(b"PK\x05\x06")
        (self.cd_entries, self.cd_size, self.cd_offset) = struct.unpack_from("<HII", data, self.eocd + 10)
        self.zip64_locator = data.rfind(b"PK\x06\x07", 0, self.eocd)
        self.zip64_end = data.rfind(b"PK\x06\x06", 0, self.eocd)
        self.entries = []  # (name, local header offset, data offset, size, central header offset)
        pos = self.cd_offset
        while data[pos : pos + 4] == b"PK\x01\x02":
            csize, usize = struct.unpack_from("<II", data, pos + 20)
            nlen, xlen, clen = struct.unpack_from("<HHH", data, pos + 28)
            lho = struct.unpack_from("<I", data, pos + 42)[0]
            name = data[pos + 46 : pos + 46 + nlen].decode()
            lnlen, lxlen = struct.unpack_from("<HH", data, lho + 26)
            self.entries.append((name, lho, lho + 30 + lnlen + lxlen, csize, pos))
            pos += 46 + nlen + xlen + clen
        self.cd_end = pos

    def entry(self, suffix):
        for e in self.entries:
            if e[0].endswith(suffix):
                return e
        raise KeyError(suffix)


def patch(data: bytes, offset: int, fmt: str, *values) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, *values)
    return bytes(b)


def write_stored_zip(entries, *, zip64=False, comment=b"") -> bytes:
    """A zip of stored entries [(name, bytes)], aligned like torch's writer (data at 64-byte
    boundaries, padding in an extra field), optionally with zip64 end records."""
    out = bytearray()
    central = bytearray()
    for name, payload in entries:
        nb = name.encode()
        lho = len(out)
        pad = (-(lho + 30 + len(nb) + 4)) % 64
        extra = struct.pack("<HH", 0x4B46, pad) + b"Z" * pad  # torch's "FB" padding field
        crc = zlib.crc32(payload)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, crc, len(payload), len(payload), len(nb), len(extra))
        out += nb + extra + payload
        central += struct.pack(
            "<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0, crc, len(payload), len(payload), len(nb), 0, 0, 0, 0, 0, lho
        )
        central += nb
    cd_offset = len(out)
    out += central
    n = len(entries)
    if zip64:
        z64 = len(out)
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, len(central), cd_offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, z64, 1)
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, len(comment))
    else:
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(central), cd_offset, len(comment))
    return bytes(out + comment)


def torch_records():
    """[(name, bytes)] of the real torch file, in its order."""
    z = zipfile.ZipFile(io.BytesIO(TORCH))
    return [(i.filename, z.read(i.filename)) for i in z.infolist()]


def rebuild(pickle_bytes=None, *, drop=(), replace=None, zip64=False, extra=()) -> bytes:
    """The real torch file's records written again as a stored zip, with data.pkl replaced by
    PICKLE_BYTES, records whose names end in DROP left out, REPLACE {suffix: bytes}."""
    entries = []
    for name, payload in torch_records():
        if any(name.endswith(d) for d in drop):
            continue
        if pickle_bytes is not None and name.endswith("/data.pkl"):
            payload = pickle_bytes
        for suffix, new in (replace or {}).items():
            if name.endswith(suffix):
                payload = new
        entries.append((name, payload))
    entries += list(extra)
    return write_stored_zip(entries, zip64=zip64)


# --- pickles --------------------------------------------------------------------------------


def pstr(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def pint(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if -(2**31) <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    data = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def ptuple(items) -> bytes:
    return b"(" + b"".join(items) + b"t"


def pglobal(module, name) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def ptensor(storage="FloatStorage", key="0", numel=12, offset=0, size=(3, 4), stride=(4, 1), args=None) -> bytes:
    pid = ptuple([pstr("storage"), pglobal("torch", storage), pstr(key), pstr("cpu"), pint(numel)]) + b"Q"
    if args is None:
        args = [
            pid,
            pint(offset),
            ptuple(map(pint, size)),
            ptuple(map(pint, stride)),
            b"\x89",
            pglobal("collections", "OrderedDict") + b")R",
        ]
    else:
        args = [pid] + args
    return pglobal("torch._utils", "_rebuild_tensor_v2") + ptuple(args) + b"R"


def pdict(items) -> bytes:
    """{key: value} from [(key opcodes, value opcodes)], protocol 2."""
    return b"\x80\x02}(" + b"".join(k + v for k, v in items) + b"u."


def good_pickle() -> bytes:
    """data.pkl of the real file, as torch wrote it."""
    return dict(torch_records())["base/data.pkl"]


def hand_pickle(**tensor_kwargs) -> bytes:
    """A one-tensor state dict {"w": tensor} (record 0: 12 float32) built by hand."""
    return pdict([(pstr("w"), ptensor(**tensor_kwargs))])


# --- ZeRO -----------------------------------------------------------------------------------

ZERO_FIXTURES = {"s2": "w2-s2-bf16", "s3": "w2-s3-bf16-sg8"}
ZERO_DIR = None  # the fixture cache's entry of make_zero_checkpoints.py


def zero_source(kind: str) -> Path:
    sys.path.insert(0, str(ZERO_SUITE))
    from make_zero_checkpoints import TAG

    return ZERO_DIR / ZERO_FIXTURES[kind] / "checkpoint" / TAG


def zero_copy(kind: str, dest: Path) -> Path:
    """DEST/latest + DEST/global_step2/ with the real rank files (no DeepSpeed scripts)."""
    src = zero_source(kind)
    dest.mkdir(parents=True)
    (dest / "latest").write_text(src.name)
    tag = dest / src.name
    tag.mkdir()
    for f in sorted(src.iterdir()):
        if f.suffix == ".pt":
            shutil.copyfile(f, tag / f.name)
    return tag


def zero_edit(path: Path, edit) -> None:
    """Load a DeepSpeed pickle, EDIT(obj) it, save it back with torch.save under its name."""
    import torch

    obj = torch.load(path, map_location="cpu", weights_only=False)
    obj = edit(obj) or obj
    torch.save(obj, path)


OPTIM = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MODEL2 = "mp_rank_00_model_states.pt"
MODEL3 = "zero_pp_rank_{}_mp_rank_00_model_states.pt"


# =============================================================================================
# torch zip: truncation at every structural boundary
# =============================================================================================

NO_EOCD = r"not a zip archive: no end-of-central-directory record"


def cut(at):
    return lambda p: p.write_bytes(TORCH[: at(ZipInfo(TORCH))])


@case("pt-empty.pt", "empty file", r"not a recognized checkpoint")
def _(p):
    p.write_bytes(b"")


@case("pt-trunc-local-header.pt", "cut inside the first local file header", r"not a zip archive: too short for an end-of-central-directory record")
def _(p):
    p.write_bytes(TORCH[:17])


@case("pt-trunc-after-local-header.pt", "cut after the first local header + name, before data.pkl's bytes", NO_EOCD)
def _(p):
    zi = ZipInfo(TORCH)
    p.write_bytes(TORCH[: zi.entries[0][2]])


@case("pt-trunc-mid-pickle-record.pt", "cut in the middle of data.pkl's stored bytes", NO_EOCD)
def _(p):
    zi = ZipInfo(TORCH)
    p.write_bytes(TORCH[: zi.entries[0][2] + zi.entries[0][3] // 2])


@case("pt-trunc-mid-tensor-record.pt", "cut in the middle of a tensor record", NO_EOCD)
def _(p):
    e = ZipInfo(TORCH).entry("data/0")
    p.write_bytes(TORCH[: e[2] + 20])


@case("pt-trunc-before-central-dir.pt", "cut where the central directory starts", NO_EOCD)
def _(p):
    p.write_bytes(TORCH[: ZipInfo(TORCH).cd_offset])


@case("pt-trunc-mid-central-dir.pt", "cut inside a central directory header", NO_EOCD)
def _(p):
    zi = ZipInfo(TORCH)
    p.write_bytes(TORCH[: zi.entries[2][4] + 30])


@case("pt-trunc-before-eocd.pt", "cut right before the end-of-central-directory record", NO_EOCD)
def _(p):
    p.write_bytes(TORCH[: ZipInfo(TORCH).eocd])


@case("pt-trunc-mid-eocd.pt", "last 5 bytes of the end-of-central-directory record missing", NO_EOCD)
def _(p):
    p.write_bytes(TORCH[:-5])


@case("pt-zip64-trunc-end-record.pt", "zip64 archive cut inside the zip64 end record (EOCD kept)",
      r"zip64 locator points outside the file")
def _(p):
    data = rebuild(zip64=True)
    zi = ZipInfo(data)
    # Drop the second half of the zip64 end record, keep locator + EOCD (the locator lies now).
    p.write_bytes(data[: zi.zip64_end + 20] + data[zi.zip64_locator :])


@case("pt-zip64-trunc-locator.pt", "zip64 archive with its locator cut short (EOCD kept)",
      r"central directory lies outside the file")
def _(p):
    data = rebuild(zip64=True)
    zi = ZipInfo(data)
    p.write_bytes(data[: zi.zip64_locator + 10] + data[zi.eocd :])


@case("pt-removed-middle-bytes.pt", "64 bytes cut out of a tensor record: every later offset lies",
      r"zip64 locator points outside the file")
def _(p):
    e = ZipInfo(TORCH).entry("data/0")
    p.write_bytes(TORCH[: e[2]] + TORCH[e[2] + 64 :])


# =============================================================================================
# torch zip: lies in lengths and offsets, overlapping entries
# =============================================================================================


@case("pt-not-a-zip.pt", "random bytes named .pt", r"not a recognized checkpoint")
def _(p):
    p.write_bytes(bytes((i * 73 + 11) % 256 for i in range(4096)))


def plain_zip() -> bytes:
    """The real records in a zip without zip64 end records (torch always writes them, and
    their values override the EOCD's), so that a lie in the EOCD is the one that counts."""
    return rebuild(zip64=False)


@case("pt-eocd-cd-offset-outside.pt", "EOCD central-directory offset beyond the end of the file",
      r"central directory lies outside the file")
def _(p):
    data = plain_zip()
    p.write_bytes(patch(data, ZipInfo(data).eocd + 16, "<I", 0xFFFFFF00))


@case("pt-eocd-cd-size-lie.pt", "EOCD central-directory size larger than the file", r"central directory lies outside the file")
def _(p):
    data = plain_zip()
    p.write_bytes(patch(data, ZipInfo(data).eocd + 12, "<I", 0x7FFFFFFF))


@case("pt-eocd-entry-count-lie.pt", "EOCD claims 60000 entries in a directory of 9",
      r"central directory is too small for its entry count")
def _(p):
    data = plain_zip()
    p.write_bytes(patch(data, ZipInfo(data).eocd + 8, "<HH", 60000, 60000))


@case("pt-multi-disk.pt", "EOCD says the directory is on disk 3 (split archive)", r"multi-disk zip archives are not supported")
def _(p):
    data = plain_zip()
    p.write_bytes(patch(data, ZipInfo(data).eocd + 4, "<HH", 3, 3))


@case("pt-central-bad-signature.pt", "second central directory header has a bad signature",
      r"central directory entry 1 has a bad signature")
def _(p):
    zi = ZipInfo(TORCH)
    p.write_bytes(patch(TORCH, zi.entries[1][4], "<I", 0x02014B51))


@case("pt-central-name-past-dir.pt", "a central header's name length runs past the directory",
      r"central directory entry 8 is truncated")
def _(p):
    zi = ZipInfo(TORCH)
    p.write_bytes(patch(TORCH, zi.entries[-1][4] + 28, "<H", 0xFFF0))


@case("pt-entry-outside-file.pt", "a tensor record's local header offset points past the end of the file",
      r"extends past the end of the file")
def _(p):
    e = ZipInfo(TORCH).entry("data/1")
    p.write_bytes(patch(TORCH, e[4] + 42, "<I", 0x7FFFFFF0))


@case("pt-entry-size-past-file.pt", "a tensor record's sizes (both) say 1 GiB", r"extends past the end of the file")
def _(p):
    e = ZipInfo(TORCH).entry("data/2")
    p.write_bytes(patch(TORCH, e[4] + 20, "<II", 1 << 30, 1 << 30))


@case("pt-stored-size-mismatch.pt", "a stored record whose compressed and uncompressed sizes differ",
      r"different compressed and uncompressed sizes")
def _(p):
    e = ZipInfo(TORCH).entry("data/2")
    p.write_bytes(patch(TORCH, e[4] + 24, "<I", 8))


@case("pt-local-bad-signature.pt", "a tensor record's local header has a bad signature",
      r"local header of 'base/data/0' has a bad signature")
def _(p):
    e = ZipInfo(TORCH).entry("data/0")
    p.write_bytes(patch(TORCH, e[1], "<I", 0x04034B5F))


@case("pt-entries-overlap.pt", "two tensor records point at the same local header (overlapping entries)",
      r"entries 'base/data/[01]' and 'base/data/[01]' overlap")
def _(p):
    zi = ZipInfo(TORCH)
    e0, e1 = zi.entry("data/0"), zi.entry("data/1")
    # data/1 now claims data/0's local header and its first 8 bytes.
    data = patch(TORCH, e1[4] + 42, "<I", e0[1])
    p.write_bytes(data)


@case("pt-entry-overlaps-central-dir.pt", "the last record's size runs 200 bytes into the central directory",
      r"entry 'base/\.data/serialization_id' overlaps the central directory")
def _(p):
    zi = ZipInfo(TORCH)
    e = zi.entries[-1]
    grow = zi.cd_offset - e[2] + 200
    p.write_bytes(patch(TORCH, e[4] + 20, "<II", grow, grow))


@case("pt-duplicate-entry-name.pt", "two zip entries named base/data/0", r"duplicate entry name 'base/data/0'")
def _(p):
    recs = torch_records()
    p.write_bytes(write_stored_zip(recs + [("base/data/0", recs[-1][1])]))


@case("pt-zip64-locator-outside.pt", "zip64 locator points past the end of the file", r"zip64 locator points outside the file")
def _(p):
    data = rebuild(zip64=True)
    zi = ZipInfo(data)
    p.write_bytes(patch(data, zi.zip64_locator + 8, "<Q", 1 << 62))


@case("pt-zip64-end-bad-signature.pt", "zip64 end record with a bad signature",
      r"zip64 end-of-central-directory record has a bad signature")
def _(p):
    data = rebuild(zip64=True)
    zi = ZipInfo(data)
    p.write_bytes(patch(data, zi.zip64_end, "<I", 0x06064B5F))


@case("pt-zip64-cd-offset-huge.pt", "zip64 end record: directory offset 2^63 (overflows offset + size)",
      r"central directory lies outside the file")
def _(p):
    data = rebuild(zip64=True)
    zi = ZipInfo(data)
    p.write_bytes(patch(data, zi.zip64_end + 40, "<QQ", 1 << 63, 1 << 63))


@case("pt-zip64-entry-count-huge.pt", "zip64 end record: 2^40 entries", r"central directory is too small for its entry count")
def _(p):
    data = rebuild(zip64=True)
    zi = ZipInfo(data)
    p.write_bytes(patch(data, zi.zip64_end + 24, "<QQ", 1 << 40, 1 << 40))


@case("pt-zip64-short-extra.pt", "an entry with 0xFFFFFFFF sizes but no zip64 extra field to give the real ones",
      r"entry 'base/data/2' extends past the end of the file")
def _(p):
    e = ZipInfo(TORCH).entry("data/2")
    p.write_bytes(patch(TORCH, e[4] + 20, "<II", 0xFFFFFFFF, 0xFFFFFFFF))


@case("pt-encrypted-entry.pt", "data.pkl flagged as encrypted", r"entry 'base/data\.pkl' is encrypted")
def _(p):
    zi = ZipInfo(TORCH)
    p.write_bytes(patch(TORCH, zi.entries[0][4] + 8, "<H", 1))


@case("pt-pickle-compressed.pt", "data.pkl deflate-compressed", r"record 'base/data\.pkl' is compressed \(method 8\); only stored records are supported")
def _(p):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, payload in torch_records():
            z.writestr(name, payload, zipfile.ZIP_DEFLATED if name.endswith("data.pkl") else zipfile.ZIP_STORED)
    p.write_bytes(buf.getvalue())


@case("pt-record-compressed.pt", "a tensor record deflate-compressed", r"record base/data/0 is compressed \(method 8\); tensor data must be stored uncompressed")
def _(p):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, payload in torch_records():
            z.writestr(name, payload, zipfile.ZIP_DEFLATED if name.endswith("data/0") else zipfile.ZIP_STORED)
    p.write_bytes(buf.getvalue())


# =============================================================================================
# torch: missing records, wrong dtypes, overflowing shapes and strides
# =============================================================================================


@case("pt-missing-data-pkl.pt", "zip without data.pkl", r"not a torch\.save archive: no base/data\.pkl")
def _(p):
    p.write_bytes(rebuild(drop=("data.pkl",)))


@case("pt-missing-tensor-record.pt", "the pickle references record data/1, which is missing", r"the pickle references storage '1' but the archive has no record base/data/1")
def _(p):
    p.write_bytes(rebuild(drop=("data/1",)))


@case("pt-record-too-short.pt", "record data/0 holds 40 bytes, the pickle says 12 float32 (48)", r"holds 40 bytes but the pickle says 48")
def _(p):
    recs = dict(torch_records())
    p.write_bytes(rebuild(replace={"data/0": recs["base/data/0"][:40]}))


@case("pt-unknown-storage-dtype.pt", "storage type torch.EvilStorage", r"storage class torch\.EvilStorage is not supported")
def _(p):
    p.write_bytes(rebuild(hand_pickle(storage="EvilStorage")))


@case("pt-storage-numel-overflow.pt", "storage numel 2^62 float32 (numel*itemsize overflows 64 bits)",
      r"storage '0' size overflows")
def _(p):
    p.write_bytes(rebuild(hand_pickle(numel=1 << 62)))


@case("pt-shape-numel-overflow.pt", "shape (2^32, 2^32, 16): numel overflows 64 bits", r"tensor shape overflows")
def _(p):
    p.write_bytes(rebuild(hand_pickle(size=(1 << 32, 1 << 32, 16), stride=(1, 1, 1))))


@case("pt-stride-overflow.pt", "stride 2^62 on a dimension of 8: the last element's offset overflows",
      r"tensor strides overflow")
def _(p):
    p.write_bytes(rebuild(hand_pickle(size=(8, 1), stride=(1 << 62, 1))))


@case("pt-storage-offset-huge.pt", "storage offset 2^63-1", r"tensor reads past the end of storage '0' \(48 bytes\)")
def _(p):
    p.write_bytes(rebuild(hand_pickle(offset=(1 << 63) - 1, size=(1,), stride=(1,))))


@case("pt-view-past-storage.pt", "a (4, 4) view of a 12-element storage", r"tensor reads past the end of storage '0' \(48 bytes\)")
def _(p):
    p.write_bytes(rebuild(hand_pickle(size=(4, 4), stride=(4, 1))))


@case("pt-negative-dim.pt", "shape (-1, 12)", r"tensor rebuild call has a malformed offset or size")
def _(p):
    p.write_bytes(rebuild(hand_pickle(size=(-1, 12), stride=(12, 1))))


@case("pt-negative-stride.pt", "stride (-4, 1)", r"tensor with negative or malformed strides")
def _(p):
    p.write_bytes(rebuild(hand_pickle(size=(3, 4), stride=(-4, 1))))


@case("pt-size-stride-rank-mismatch.pt", "size of 2 dimensions, stride of 3", r"tensor with negative or malformed strides")
def _(p):
    p.write_bytes(rebuild(hand_pickle(size=(3, 4), stride=(4, 1, 1))))


@case("pt-rebuild-too-few-args.pt", "_rebuild_tensor_v2 called with only the storage", r"tensor rebuild call has a malformed offset or size")
def _(p):
    p.write_bytes(rebuild(hand_pickle(args=[])))


@case("pt-rebuild-storage-not-persistent.pt", "_rebuild_tensor_v2 of an integer instead of a persistent storage",
      r"tensor storage is not a \('storage', \.\.\.\) persistent id")
def _(p):
    call = pglobal("torch._utils", "_rebuild_tensor_v2") + ptuple(
        [pint(7), pint(0), ptuple([pint(12)]), ptuple([pint(1)]), b"\x89", pglobal("collections", "OrderedDict") + b")R"]
    ) + b"R"
    p.write_bytes(rebuild(pdict([(pstr("w"), call)])))


# =============================================================================================
# pickle: truncation, bad opcodes, memo abuse, recursion bombs, duplicate keys
# =============================================================================================


@case("pkl-trunc-mid-opcode.pt", "data.pkl cut inside a BINUNICODE length field", r"base/data\.pkl: pickle: truncated pickle at byte 6")
def _(p):
    pk = good_pickle()
    at = pk.index(b"X\x01\x00\x00\x00w")
    p.write_bytes(rebuild(pk[: at + 3]))


@case("pkl-trunc-mid-string.pt", "data.pkl cut inside a string's bytes", r"base/data\.pkl: pickle: truncated pickle at byte 14")
def _(p):
    pk = good_pickle()
    at = pk.index(b"_rebuild_tensor_v2")
    p.write_bytes(rebuild(pk[: at + 5]))


@case("pkl-no-stop.pt", "data.pkl without its final STOP opcode", r"base/data\.pkl: pickle: pickle ends without STOP at byte \d+")
def _(p):
    p.write_bytes(rebuild(good_pickle()[:-1]))


@case("pkl-empty.pt", "data.pkl of zero bytes", r"base/data\.pkl: pickle: pickle ends without STOP at byte 0")
def _(p):
    p.write_bytes(rebuild(b""))


@case("pkl-unknown-opcode.pt", "opcode 0xff in the middle of data.pkl", r"base/data\.pkl: pickle: unknown opcode 0xff at byte 6")
def _(p):
    p.write_bytes(rebuild(b"\x80\x02}q\x00(\xff" + good_pickle()[7:]))


@case("pkl-stack-underflow.pt", "REDUCE on an empty stack", r"base/data\.pkl: pickle: stack underflow at byte 2")
def _(p):
    p.write_bytes(rebuild(b"\x80\x02R."))


@case("pkl-tuple-without-mark.pt", "TUPLE with no MARK on the stack", r"base/data\.pkl: pickle: MARK expected at byte 6")
def _(p):
    p.write_bytes(rebuild(b"\x80\x02K\x01K\x02t."))


@case("pkl-stop-leaves-stack.pt", "STOP with three values on the stack", r"base/data\.pkl: pickle: STOP with a malformed stack at byte 8")
def _(p):
    p.write_bytes(rebuild(b"\x80\x02K\x01K\x02K\x03."))


@case("pkl-binget-unset.pt", "BINGET of memo slot 7, never set", r"base/data\.pkl: pickle: memo key 7 was never stored at byte 12")
def _(p):
    p.write_bytes(rebuild(b"\x80\x02}q\x00(X\x01\x00\x00\x00wh\x07u."))


@case("pkl-long-binget-huge.pt", "LONG_BINGET of memo index 2^32-1", r"base/data\.pkl: pickle: memo key \d+ was never stored at byte 12")
def _(p):
    p.write_bytes(rebuild(b"\x80\x02}q\x00(X\x01\x00\x00\x00wj\xff\xff\xff\xffu."))


@case("pkl-long-binput-huge.pt", "LONG_BINPUT at memo index 2^32-1, then a GET of an unset slot (sparse memo)",
      r"base/data\.pkl: pickle: memo key 5 was never stored at byte 15")
def _(p):
    p.write_bytes(rebuild(b"\x80\x02}r\xff\xff\xff\xff(X\x01\x00\x00\x00wh\x05u."))


@case("pkl-memoize-flood.pt", "50,000 MEMOIZE of one value then GET of an unset index", r"base/data\.pkl: pickle: memo key \d+ was never stored at byte \d+")
def _(p):
    p.write_bytes(rebuild(b"\x80\x04}" + b"\x94" * 50_000 + b"j\x00\x00\x00\x10."))


@case("pkl-binunicode-length-lie.pt", "BINUNICODE claiming 2^32-1 bytes in a 40-byte pickle",
      r"base/data\.pkl: pickle: length runs past the end of the pickle at byte 6")
def _(p):
    p.write_bytes(rebuild(b"\x80\x02}q\x00(X\xff\xff\xff\xffabcdefgh"))


@case("pkl-binunicode8-length-overflow.pt", "BINUNICODE8 claiming 2^64-1 bytes (offset + length overflows)",
      r"base/data\.pkl: pickle: length runs past the end of the pickle at byte 4")
def _(p):
    p.write_bytes(rebuild(b"\x80\x04}(\x8d" + b"\xff" * 8 + b"abc"))


@case("pkl-frame-length-lie.pt", "FRAME of 2^63 bytes", r"base/data\.pkl: pickle: frame of \d+ bytes runs past the end of the pickle at byte 2")
def _(p):
    p.write_bytes(rebuild(b"\x80\x04\x95" + struct.pack("<Q", 1 << 63) + b"}."))


@case("pkl-long4-huge.pt", "LONG4 claiming 2^31-1 bytes", r"base/data\.pkl: pickle: length runs past the end of the pickle at byte 2")
def _(p):
    p.write_bytes(rebuild(b"\x80\x02\x8b\xff\xff\xff\x7f\x01\x02."))


@case("pkl-nested-list-100k.pt", "lists nested 100,000 deep (EMPTY_LIST ... APPEND)", r"objects nested deeper than 256 levels")
def _(p):
    n = 100_000
    p.write_bytes(rebuild(b"\x80\x02}(X\x01\x00\x00\x00x" + b"]" * n + b"a" * (n - 1) + b"u."))


@case("pkl-nested-tuple-300k.pt", "tuples nested 300,000 deep (TUPLE1)", r"objects nested deeper than 256 levels")
def _(p):
    n = 300_000
    p.write_bytes(rebuild(b"\x80\x02}(X\x01\x00\x00\x00xN" + b"\x85" * n + b"u."))


@case("pkl-nested-dict-1m.pt", "dicts nested 1,000,000 deep ({None: {None: ...}})", r"objects nested deeper than 256 levels")
def _(p):
    n = 1_000_000
    p.write_bytes(rebuild(b"\x80\x02" + b"}N" * n + b"}" + b"s" * n + b"."))


@case("pkl-self-referencing-list.pt", "a list that contains itself (BINGET + APPEND cycle)", r"objects nested deeper than 256 levels \(a cycle\?\)")
def _(p):
    p.write_bytes(rebuild(b"\x80\x02}(X\x01\x00\x00\x00x]q\x01h\x01au."))


@case("pkl-duplicate-dict-key.pt", "state dict with the key 'w' twice (two different tensors)", r"two tensors flatten to the same key 'w'")
def _(p):
    p.write_bytes(
        rebuild(
            pdict(
                [
                    (pstr("w"), ptensor()),
                    (pstr("w"), ptensor(key="2", storage="LongStorage", numel=5, size=(5,), stride=(1,))),
                ]
            )
        )
    )


# =============================================================================================
# objects that hold tensors in a form the reader does not understand (doc/FORMATS.md, "Objects
# that hold tensors"): refused with the key, never served in part or as zero tensors
# =============================================================================================

NOT_UNDERSTOOD = r"; ckptfs does not know how to serve it$"


def pcall(module, name, args) -> bytes:
    return pglobal(module, name) + ptuple(args) + b"R"


def wrapper_subclass(module: str, name: str) -> bytes:
    """_rebuild_from_type_v2(_rebuild_wrapper_subclass, <class>, (float32,), state holding an
    inner tensor): how torch pickles a wrapper tensor subclass (DTensor's form)."""
    state = b"}" + pstr("_local_tensor") + ptensor() + b"s"
    return rebuild(pdict([(pstr("w"), pcall("torch._tensor", "_rebuild_from_type_v2", [
        pglobal("torch._utils", "_rebuild_wrapper_subclass"), pglobal(module, name),
        ptuple([pglobal("torch", "float32")]), state]))]))


@case("obj-wrapper-subclass.pt", "a wrapper tensor subclass ckptfs does not know (torchao's quantized tensor) as torch "
      "pickles it: _rebuild_from_type_v2(_rebuild_wrapper_subclass, <class>, ..., state holding the inner tensor)",
      r"'w': a tensor of class torchao\.dtypes\.affine_quantized_tensor\.AffineQuantizedTensor rebuilt by "
      r"torch\._utils\._rebuild_wrapper_subclass" + NOT_UNDERSTOOD)
def _(p):
    p.write_bytes(wrapper_subclass("torchao.dtypes.affine_quantized_tensor", "AffineQuantizedTensor"))


@case("obj-dtensor-malformed.pt", "a DTensor whose wrapper arguments lack the global shape, strides and device",
      r"'w': DTensor with malformed wrapper arguments")
def _(p):
    p.write_bytes(wrapper_subclass("torch.distributed.tensor", "DTensor"))


@case("obj-unknown-rebuild.pt", "a quantized tensor: torch._utils._rebuild_qtensor over a storage",
      r"'w': a tensor rebuilt by torch\._utils\._rebuild_qtensor" + NOT_UNDERSTOOD)
def _(p):
    pid = ptuple([pstr("storage"), pglobal("torch", "QInt8Storage"), pstr("0"), pstr("cpu"), pint(12)]) + b"Q"
    p.write_bytes(rebuild(pdict([(pstr("w"), pcall("torch._utils", "_rebuild_qtensor", [
        pid, pint(0), ptuple([pint(12)]), ptuple([pint(1)]), ptuple([pglobal("torch", "per_tensor_affine")]), b"\x89",
        pglobal("collections", "OrderedDict") + b")R"]))])))


@case("obj-class-args-hold-tensor.pt", "an object of an unknown class called with a tensor argument (a namedtuple's form)",
      r"'w': an object of class mod\.Pair holding tensors" + NOT_UNDERSTOOD)
def _(p):
    p.write_bytes(rebuild(pdict([(pstr("w"), pcall("mod", "Pair", [ptensor(), pint(1)]))])))


@case("obj-distributed-attribute-tensor.pt", "a torch.distributed object (a DeviceMesh) whose attributes hold a tensor",
      r"'w': an object of class torch\.distributed\.device_mesh\.DeviceMesh holding tensors" + NOT_UNDERSTOOD)
def _(p):
    p.write_bytes(rebuild(pdict([(pstr("w"), pglobal("torch.distributed.device_mesh", "DeviceMesh") + b")\x81"
                                  + b"}" + pstr("_rank_map") + ptensor() + b"sb")])))


@case("obj-tensor-attribute-tensor.pt", "a parameter whose Python attributes (_rebuild_parameter_with_state) hold a tensor",
      r"'w': tensors among the Python attributes of a tensor" + NOT_UNDERSTOOD)
def _(p):
    state = b"}" + pstr("scale") + ptensor() + b"s"
    p.write_bytes(rebuild(pdict([(pstr("w"), pcall("torch._utils", "_rebuild_parameter_with_state", [
        ptensor(), b"\x88", pglobal("collections", "OrderedDict") + b")R", state]))])))


@case("obj-mapping-attribute-tensor.pt", "an OrderedDict whose attributes (BUILD) hold a tensor beside its items",
      r"'w': tensors in a mapping's attributes or arguments, not among its items" + NOT_UNDERSTOOD)
def _(p):
    p.write_bytes(rebuild(pdict([(pstr("w"), pglobal("collections", "OrderedDict") + b")R"
                                  + b"}" + pstr("_extra") + ptensor() + b"sb")])))


@case("obj-python2-ordered-dict-triples.pt", "a Python 2 OrderedDict called with [key, tensor, x] triples, which Python refuses",
      r"'w': tensors in a mapping's attributes or arguments, not among its items" + NOT_UNDERSTOOD)
def _(p):
    triple = b"](" + b"U\x01k" + ptensor() + pint(0) + b"e"
    p.write_bytes(rebuild(pdict([(pstr("w"), pglobal("collections", "OrderedDict") + b"](" + triple + b"e\x85R")])))


@case("obj-tensor-as-key.pt", "a dict keyed by a tensor", r"'w': a tensor where ckptfs serves none \(a dict key, or an item of an object\)" + NOT_UNDERSTOOD)
def _(p):
    p.write_bytes(rebuild(pdict([(pstr("w"), b"}" + ptensor() + pint(1) + b"s")])))


@case("obj-storage-alone.pt", "a storage outside any tensor (torch.save of tensor.untyped_storage())",
      r"'w': a storage outside any tensor" + NOT_UNDERSTOOD)
def _(p):
    pid = ptuple([pstr("storage"), pglobal("torch", "FloatStorage"), pstr("0"), pstr("cpu"), pint(12)]) + b"Q"
    p.write_bytes(rebuild(pdict([(pstr("w"), pid)])))


@case("obj-records-but-no-tensor.pt", "the real file's storage records under a pickle that serves no tensor",
      r"holds 3 storage records but no tensor ckptfs can serve: the object that holds them is not one it understands$")
def _(p):
    p.write_bytes(rebuild(pdict([(pstr("epoch"), pint(3))])))


@case("leg-object-holding-storage.pt", "legacy stream: the object pickle hides both storages in an unknown class's arguments",
      r"'w': an object of class mod\.Opaque holding tensors" + NOT_UNDERSTOOD)
def _(p):
    import pickletools

    # The real stream's object pickle ({'w': ..., 'b': ..., 't': ...}) wrapped: {'w': mod.Opaque(<it>)}.
    data = real_legacy_bytes()
    starts, storages_at, _ = legacy_parts()
    obj = data[starts[3]:starts[4]]
    body = obj[2:-1]  # without PROTO 2 and STOP
    assert obj[:2] == b"\x80\x02" and obj[-1:] == b"."
    pickletools.dis(obj, out=io.StringIO())  # a whole pickle, as cut
    p.write_bytes(legacy_with(obj=b"\x80\x02}" + pstr("w") + pglobal("mod", "Opaque") + b"(" + body + b"tRs."))


# =============================================================================================
# safetensors
# =============================================================================================


def st_split():
    n = struct.unpack_from("<Q", ST)[0]
    return n, json.loads(ST[8 : 8 + n]), ST[8 + n :]


def st_write(p, header, data=None, *, header_len=None, raw=None):
    n, _, buf = st_split()
    body = raw if raw is not None else json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    p.write_bytes(struct.pack("<Q", len(body) if header_len is None else header_len) + body + (buf if data is None else data))


def st_header():
    return st_split()[1]


@case("st-empty.safetensors", "empty file", r"shorter than its 8-byte header length")
def _(p):
    p.write_bytes(b"")


@case("st-trunc-in-length.safetensors", "cut inside the 8-byte header length", r"shorter than its 8-byte header length")
def _(p):
    p.write_bytes(ST[:5])


@case("st-trunc-after-length.safetensors", "only the 8-byte header length", r"runs past the end of the file")
def _(p):
    p.write_bytes(ST[:8])


@case("st-trunc-mid-header.safetensors", "cut in the middle of the JSON header", r"runs past the end of the file")
def _(p):
    n = st_split()[0]
    p.write_bytes(ST[: 8 + n // 2])


@case("st-trunc-after-header.safetensors", "header complete, no data", r"cover \d+ bytes but the data buffer holds 0")
def _(p):
    n = st_split()[0]
    p.write_bytes(ST[: 8 + n])


@case("st-trunc-mid-data.safetensors", "cut in the middle of the last tensor's data", r"cover \d+ bytes but the data buffer holds")
def _(p):
    p.write_bytes(ST[:-7])


@case("st-header-len-2e40.safetensors", "header length 2^40", r"header length 1099511627776 exceeds the limit")
def _(p):
    p.write_bytes(struct.pack("<Q", 1 << 40) + ST[8:])


@case("st-header-len-above-limit.safetensors", "header length 100,000,001: one byte over the default limit",
      r"header length 100000001 exceeds the limit of 100000000")
def _(p):
    p.write_bytes(struct.pack("<Q", 100_000_001) + ST[8:])


@case("st-header-len-max.safetensors", "header length 2^64-1", r"header length 18446744073709551615 exceeds the limit")
def _(p):
    p.write_bytes(b"\xff" * 8 + ST[8:])


@case("st-header-len-short.safetensors", "header length 3 bytes shorter than the JSON", r"header is not a JSON object")
def _(p):
    n, _, _ = st_split()
    p.write_bytes(struct.pack("<Q", n - 3) + ST[8:])


@case("st-header-not-json.safetensors", "header of garbage bytes", r"header is not a JSON object")
def _(p):
    st_write(p, None, raw=b"\x00\x01{not json")


@case("st-header-json-array.safetensors", "header is a JSON array", r"header is not a JSON object")
def _(p):
    st_write(p, [1, 2, 3])


@case("st-header-nested-100k.safetensors", "header nested 100,000 arrays deep", r"tensor 'x' lacks dtype, shape or data_offsets")
def _(p):
    st_write(p, None, raw=b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}")


@case("st-duplicate-key.safetensors", "tensor 'a' appears twice in the header (same offsets)", r"key 'a' appears twice in the header")
def _(p):
    h = st_header()
    a = json.dumps(h["a"])
    body = json.dumps(h)[:-1] + ', "a": ' + a + "}"
    st_write(p, None, raw=body.encode())


@case("st-duplicate-key-conflict.safetensors", "tensor 'c' twice, the second entry with another dtype",
      r"key 'c' appears twice in the header")
def _(p):
    h = st_header()
    c = dict(h["c"], dtype="F64")
    body = json.dumps(h)[:-1] + ', "c": ' + json.dumps(c) + "}"
    st_write(p, None, raw=body.encode())


@case("st-unknown-dtype.safetensors", "dtype 'F33'", r"tensor 'a' has an unknown dtype \"F33\"")
def _(p):
    h = st_header()
    h["a"]["dtype"] = "F33"
    st_write(p, h)


@case("st-dtype-not-string.safetensors", "dtype 4 (a number)", r"tensor 'a' has an unknown dtype 4")
def _(p):
    h = st_header()
    h["a"]["dtype"] = 4
    st_write(p, h)


@case("st-wrong-dtype-size.safetensors", "dtype I32 on 3 int64 values (12 bytes needed, 24 present)",
      r"tensor 'c' spans 24 bytes but its dtype and shape need 12")
def _(p):
    h = st_header()
    h["c"]["dtype"] = "I32"
    st_write(p, h)


@case("st-shape-negative.safetensors", "shape [-2, 3]", r"tensor 'a' has a malformed shape")
def _(p):
    h = st_header()
    h["a"]["shape"] = [-2, 3]
    st_write(p, h)


@case("st-shape-float.safetensors", "shape [2.0, 3]", r"tensor 'a' has a malformed shape")
def _(p):
    h = st_header()
    h["a"]["shape"] = [2.0, 3]
    st_write(p, h)


@case("st-shape-numel-overflow.safetensors", "shape [2^32, 2^32, 2]: numel overflows 64 bits", r"tensor 'a' shape overflows")
def _(p):
    h = st_header()
    h["a"]["shape"] = [1 << 32, 1 << 32, 2]
    st_write(p, h)


@case("st-nbytes-overflow.safetensors", "shape [2^62] of F32: numel*itemsize overflows 64 bits", r"tensor 'a' size overflows")
def _(p):
    h = st_header()
    h["a"]["shape"] = [1 << 62]
    st_write(p, h)


@case("st-offsets-reversed.safetensors", "data_offsets [24, 0]", r"tensor 'a' has malformed data_offsets")
def _(p):
    h = st_header()
    h["a"]["data_offsets"] = [24, 0]
    st_write(p, h)


@case("st-offsets-three.safetensors", "data_offsets with three numbers", r"tensor 'a' has malformed data_offsets")
def _(p):
    h = st_header()
    h["a"]["data_offsets"] = [0, 24, 48]
    st_write(p, h)


@case("st-offsets-overlap.safetensors", "the second tensor in the buffer starts 4 bytes inside the first",
      r"starts at \d+, overlapping the previous tensor")
def _(p):
    h = st_header()
    first, second = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])[:2]
    n = h[second]["data_offsets"][1] - h[second]["data_offsets"][0]
    start = h[first]["data_offsets"][1] - 4
    h[second]["data_offsets"] = [start, start + n]
    st_write(p, h)


@case("st-offsets-gap.safetensors", "8 unused bytes between two tensors", r"leaving a gap after the previous tensor")
def _(p):
    h = st_header()
    n, _, buf = st_split()
    order = sorted(h.items(), key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1)
    last_key = order[-1][0]
    o0, o1 = h[last_key]["data_offsets"]
    h[last_key]["data_offsets"] = [o0 + 8, o1 + 8]
    st_write(p, h, buf[:o0] + b"\0" * 8 + buf[o0:])


@case("st-offsets-past-file.safetensors", "last tensor's offsets point 2^40 past the data", r"safetensors: tensor 'b' starts at \d+, leaving a gap after the previous tensor \(expected 48\)")
def _(p):
    h = st_header()
    for k, v in h.items():
        if k != "__metadata__" and v["data_offsets"][1] == max(
            x["data_offsets"][1] for kk, x in h.items() if kk != "__metadata__"
        ):
            n = v["data_offsets"][1] - v["data_offsets"][0]
            v["data_offsets"] = [1 << 40, (1 << 40) + n]
    st_write(p, h)


@case("st-trailing-bytes.safetensors", "64 bytes after the last tensor", r"cover \d+ bytes but the data buffer holds")
def _(p):
    p.write_bytes(ST + b"\0" * 64)


@case("st-missing-dtype.safetensors", "tensor entry without dtype", r"tensor 'b' lacks dtype, shape or data_offsets")
def _(p):
    h = st_header()
    del h["b"]["dtype"]
    st_write(p, h)


@case("st-metadata-not-string.safetensors", "__metadata__ value 3 (not a string)", r"__metadata__ value of 'format' is not a string")
def _(p):
    h = st_header()
    h["__metadata__"]["format"] = 3
    st_write(p, h)


# =============================================================================================
# folders (sharded safetensors with an index)
# =============================================================================================


def folder(p: Path, index) -> None:
    p.mkdir()
    (p / "model-00001-of-00001.safetensors").write_bytes(ST)
    (p / "model.safetensors.index.json").write_text(json.dumps(index))


@case("dir-index-shard-outside/", "index weight_map names ../../etc/passwd", r"weight_map names shard '\.\./\.\./etc/passwd' outside the folder")
def _(p):
    folder(p, {"metadata": {}, "weight_map": {"a": "../../etc/passwd", "b": "model-00001-of-00001.safetensors",
                                              "c": "model-00001-of-00001.safetensors"}})


@case("dir-index-missing-shard/", "index names a shard file that does not exist", r"model-00002-of-00002\.safetensors")
def _(p):
    folder(p, {"metadata": {}, "weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00001.safetensors",
                                              "c": "model-00001-of-00001.safetensors"}})


@case("dir-index-not-json/", "index file is not JSON", r"index is not a JSON object with a weight_map")
def _(p):
    p.mkdir()
    (p / "model-00001-of-00001.safetensors").write_bytes(ST)
    (p / "model.safetensors.index.json").write_text("{weight_map: oops")


@case("dir-index-tensor-missing/", "index lists tensor 'zz' that no shard holds", r"tensor 'zz' is missing from model-\d+-of-\d+\.safetensors")
def _(p):
    folder(p, {"metadata": {}, "weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors",
                                              "c": "model-00001-of-00001.safetensors", "zz": "model-00001-of-00001.safetensors"}})


# Folders with subfolders (the folders reader): a tree whose parts contradict each other, or
# whose model is damaged, is refused whole.
@case("tree-key-in-model-folder/", "a top-level tensor key that starts with a model subfolder's path",
      r"tensor 'unet/a' would be served in the model folder unet/: its key starts with that folder's path")
def _(p):
    import torch
    from safetensors.torch import save

    (p / "unet").mkdir(parents=True)
    (p / "model.safetensors").write_bytes(save({"unet/a": torch.ones(2)}, metadata={"format": "pt"}))
    (p / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(ST)


@case("tree-cut-component/", "a pipeline whose unet/ weights file is cut short",
      r"diffusion_pytorch_model\.safetensors: safetensors: tensors cover \d+ bytes but the data buffer holds \d+")
def _(p):
    (p / "unet").mkdir(parents=True)
    (p / "model_index.json").write_text('{"_class_name": "LDMPipeline", "unet": ["diffusers", "UNet2DModel"]}\n')
    (p / "unet" / "config.json").write_text("{}\n")
    (p / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(ST[:-5])


# A pickled nn.Module whose state_dict() depends on running a hook.
@case("module-state-dict-hook.pt", "a pickled module with a state_dict hook",
      r"'0'.*_state_dict_hooks")
def _(p):
    import functools

    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    net[0]._register_state_dict_hook(functools.partial(print))
    torch.save(net, p)


# =============================================================================================
# DeepSpeed ZeRO: metadata that disagrees with the rank files
# =============================================================================================


@case("zero-s2-missing-rank-file/", "stage 2, world size 2: rank 1's optimizer file deleted",
      r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: missing: the checkpoint was saved by 2 data-parallel ranks")
def _(p):
    tag = zero_copy("s2", p)
    (tag / OPTIM.format(1)).unlink()


@case("zero-s2-world-size-mismatch/", "stage 2: rank 1's file says partition_count 4, rank 0's says 2",
      r"was saved by 4 data-parallel ranks, rank 0 by 2")
def _(p):
    tag = zero_copy("s2", p)

    def edit(obj):
        osd = obj["optimizer_state_dict"]
        osd["partition_count"] = [4 for _ in osd["partition_count"]]

    zero_edit(tag / OPTIM.format(1), edit)


@case("zero-s2-world-size-says-3/", "stage 2: rank 0 says 3 ranks, 2 rank files present",
      r"zero_pp_rank_2_mp_rank_00_optim_states\.pt: missing: the checkpoint was saved by 3")
def _(p):
    tag = zero_copy("s2", p)

    def edit(obj):
        osd = obj["optimizer_state_dict"]
        osd["partition_count"] = [3 for _ in osd["partition_count"]]

    zero_edit(tag / OPTIM.format(0), edit)


@case("zero-s2-extra-rank-file/", "stage 2: a third rank file in a world-size-2 checkpoint",
      r"zero_pp_rank_2_mp_rank_00_optim_states\.pt: unexpected: rank 0 says the world size is 2")
def _(p):
    tag = zero_copy("s2", p)
    shutil.copyfile(tag / OPTIM.format(1), tag / OPTIM.format(2))


@case("zero-s2-partitions-short/", "stage 2: rank 1's flat fp32 partition cut to half: partition sizes do not sum",
      r"parameter 'fc1\.weight' runs past the end of the flat partitions")
def _(p):
    tag = zero_copy("s2", p)

    def edit(obj):
        groups = obj["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        groups[0] = groups[0][: groups[0].numel() // 2].clone()

    zero_edit(tag / OPTIM.format(1), edit)


@case("zero-s2-param-shapes-too-big/", "stage 2: param_shapes gives a parameter 1000x its numel",
      r"parameter 'embed\.weight' runs past the end of the flat partitions")
def _(p):
    tag = zero_copy("s2", p)
    import torch

    def edit(obj):
        group = obj["param_shapes"][0]
        name = next(iter(group))
        group[name] = torch.Size([1000, *group[name]])

    zero_edit(tag / MODEL2, edit)


@case("zero-s2-param-shapes-overflow/", "stage 2: a param_shapes entry whose numel overflows 64 bits",
      r"param_shapes entry .* has a shape whose size overflows")
def _(p):
    tag = zero_copy("s2", p)
    import torch

    def edit(obj):
        group = obj["param_shapes"][0]
        name = next(iter(group))
        # 2^32 * 2^32 * 2^0 wraps to 0 elements in 64-bit arithmetic.
        group[name] = torch.Size([1 << 32, 1 << 32])

    zero_edit(tag / MODEL2, edit)


@case("zero-s2-param-shapes-wrap/", "stage 2: a param_shapes entry whose numel wraps around 2^64 to the true element count",
      r"param_shapes entry 'embed\.weight' has a shape whose size overflows")
def _(p):
    tag = zero_copy("s2", p)
    import torch

    def edit(obj):
        group = obj["param_shapes"][0]
        name = next(iter(group))
        n = group[name].numel()
        # a * b == n (mod 2^64) with a odd and b < 2^63: the wrapped count matches the flat
        # partition exactly, so only the overflow itself is wrong.
        for a in range(3, 1000, 2):
            b = n * pow(a, -1, 1 << 64) % (1 << 64)
            if b < 1 << 63 and a * b != n:
                break
        group[name] = torch.Size([a, b])

    zero_edit(tag / MODEL2, edit)


@case("zero-s2-groups-mismatch/", "stage 2: param_shapes lists 3 groups, the partitions hold 2",
      r"holds \d+ parameter groups but param_shapes lists \d+")
def _(p):
    tag = zero_copy("s2", p)

    def edit(obj):
        obj["param_shapes"].append({"ghost.weight": obj["param_shapes"][0][next(iter(obj["param_shapes"][0]))]})

    zero_edit(tag / MODEL2, edit)


@case("zero-s2-missing-model-states/", "stage 2: mp_rank_00_model_states.pt deleted",
      r"mp_rank_00_model_states\.pt: missing model-states file")
def _(p):
    tag = zero_copy("s2", p)
    (tag / MODEL2).unlink()


@case("zero-s2-missing-buffer/", "stage 2: buffer_names lists a buffer the module does not hold",
      r"buffer 'ghost_buffer' in module is not a tensor")
def _(p):
    tag = zero_copy("s2", p)

    def edit(obj):
        obj["buffer_names"] = list(obj["buffer_names"]) + ["ghost_buffer"]

    zero_edit(tag / MODEL2, edit)


@case("zero-s2-bad-stage/", "stage 2: zero_stage 7", r"unsupported ZeRO stage")
def _(p):
    tag = zero_copy("s2", p)

    def edit(obj):
        obj["optimizer_state_dict"]["zero_stage"] = 7

    zero_edit(tag / OPTIM.format(0), edit)


@case("zero-s2-no-optimizer-state/", "stage 2: rank 0's file without optimizer_state_dict",
      r"no optimizer_state_dict: not a DeepSpeed ZeRO optimizer file")
def _(p):
    tag = zero_copy("s2", p)

    def edit(obj):
        del obj["optimizer_state_dict"]

    zero_edit(tag / OPTIM.format(0), edit)


@case("zero-s2-latest-missing-tag/", "latest names global_step99, which does not exist", r"the tag named by 'latest' does not exist")
def _(p):
    zero_copy("s2", p)
    (p / "latest").write_text("global_step99")


@case("zero-s2-latest-dotdot/", "latest holds '..'", r"latest: does not name a checkpoint tag")
def _(p):
    zero_copy("s2", p)
    (p / "latest").write_text("..")


@case("zero-s2-truncated-rank-file/", "stage 2: rank 1's optimizer file cut in half",
      r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: not a zip archive")
def _(p):
    tag = zero_copy("s2", p)
    f = tag / OPTIM.format(1)
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


@case("zero-s3-missing-model-rank/", "stage 3: rank 1's model-states file deleted",
      r"zero_pp_rank_1_mp_rank_00_model_states\.pt: missing: stage-3 checkpoints have one model-states file per rank")
def _(p):
    tag = zero_copy("s3", p)
    (tag / MODEL3.format(1)).unlink()


@case("zero-s3-subgroup-size-differs/", "stage 3: rank 1's first fp32 sub-group shorter than rank 0's",
      r"sub-group 0 differs in size from rank 0's")
def _(p):
    tag = zero_copy("s3", p)

    def edit(obj):
        groups = obj["optimizer_state_dict"]["fp32_flat_groups"]
        groups[0] = groups[0][:-1].clone()

    zero_edit(tag / OPTIM.format(1), edit)


@case("zero-s3-param-shapes-too-big/", "stage 3: param_shapes numel larger than the flat partitions",
      r"parameters run past the flat groups")
def _(p):
    tag = zero_copy("s3", p)
    import torch

    def edit(obj):
        group = obj["param_shapes"][-1]
        name = list(group)[-1]
        group[name] = torch.Size([64, *group[name]])

    zero_edit(tag / MODEL3.format(0), edit)


@case("zero-s3-world-size-mismatch/", "stage 3: rank 1 says partition_count 8",
      r"was saved by 8 data-parallel ranks, rank 0 by 2")
def _(p):
    tag = zero_copy("s3", p)

    def edit(obj):
        obj["optimizer_state_dict"]["partition_count"] = 8

    zero_edit(tag / OPTIM.format(1), edit)


@case("zero-s3-flat-group-not-tensor/", "stage 3: rank 0's fp32_flat_groups[1] is a string",
      r"fp32_flat_groups\[1\] is not a tensor")
def _(p):
    tag = zero_copy("s3", p)

    def edit(obj):
        obj["optimizer_state_dict"]["fp32_flat_groups"][1] = "not a tensor"

    zero_edit(tag / OPTIM.format(0), edit)


# =============================================================================================
# DeepSpeed universal checkpoints: parameter files that disagree with the model states
# =============================================================================================

UNIVERSAL_DIR = None  # the fixture cache's entry of make_universal_checkpoints.py
UNIVERSAL_STEP = "global_step2_universal"


def universal_copy(case_name: str, dest: Path) -> Path:
    """DEST/latest_universal + DEST/<step>/ of a real ds_to_universal output: the model-states
    files, zero/optimizer_state.pt and every zero/<name>/fp32.pt (the moment and step files
    left out: only -o moments reads them)."""
    src = UNIVERSAL_DIR / case_name / UNIVERSAL_STEP
    dest.mkdir(parents=True)
    (dest / "latest_universal").write_text(UNIVERSAL_STEP)
    step = dest / UNIVERSAL_STEP
    (step / "zero").mkdir(parents=True)
    for f in sorted(src.glob("*.pt")):
        shutil.copyfile(f, step / f.name)
    shutil.copyfile(src / "zero" / "optimizer_state.pt", step / "zero" / "optimizer_state.pt")
    for f in sorted(src.glob("zero/*/fp32.pt")):
        (step / "zero" / f.parent.name).mkdir()
        shutil.copyfile(f, step / "zero" / f.parent.name / f.name)
    return step


@case("universal-s2-shape-differs/", "stage 2: zero/fc1.weight/fp32.pt holds a [10, 13] tensor, param_shapes says [13, 10]",
      r"zero/fc1\.weight/fp32\.pt: key 'param': shape \[10, 13\] disagrees with \[13, 10\]")
def _(p):
    import torch

    step = universal_copy("w2-s2-bf16", p)
    f = step / "zero" / "fc1.weight" / "fp32.pt"
    torch.save({"cat_dim": 0, "param": torch.load(f)["param"].reshape(10, 13).clone()}, f)


@case("universal-s3-flat-size-differs/", "stage 3: zero/fc2.weight/fp32.pt holds 129 elements, param_shapes says [10, 13]",
      r"zero/fc2\.weight/fp32\.pt: the saved object: shape \[129\] disagrees with \[10, 13\]")
def _(p):
    import torch

    step = universal_copy("w2-s3-bf16-sg8", p)
    f = step / "zero" / "fc2.weight" / "fp32.pt"
    torch.save(torch.load(f)[:129].clone(), f)


@case("universal-s2-key-not-understood/", "stage 2: zero/gate/fp32.pt's dict has a key ds_to_universal never writes",
      r"zero/gate/fp32\.pt: key 'scale_factor' is not understood")
def _(p):
    import torch

    step = universal_copy("w2-s2-bf16", p)
    f = step / "zero" / "gate" / "fp32.pt"
    torch.save({**torch.load(f), "scale_factor": 2}, f)


@case("universal-s2-folder-of-no-parameter/", "stage 2: zero/gate2/ names no tensor of the model states",
      r"zero/gate2: names no parameter of .*mp_rank_00_model_states\.pt")
def _(p):
    step = universal_copy("w2-s2-bf16", p)
    shutil.copytree(step / "zero" / "gate", step / "zero" / "gate2")


# =============================================================================================
# the rest of the torch family: legacy torch.save streams, TorchScript archives, .pt2 packages
# =============================================================================================


@functools.cache
def real_legacy_bytes() -> bytes:
    """A real legacy torch.save stream (_use_new_zipfile_serialization=False) of two storages:
    w (12 float32, and its transpose t) and b (4 float16)."""
    import torch

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buf = io.BytesIO()
    torch.save({"w": base, "b": torch.ones(4, dtype=torch.float16), "t": base.t()}, buf,
               _use_new_zipfile_serialization=False)
    return buf.getvalue()


def legacy_parts():
    """(pickle start offsets [magic, protocol, sys_info, object, keys], storage start offset,
    storage keys in file order) of the real legacy stream, found with pickletools (nothing run)."""
    import pickletools

    data = real_legacy_bytes()
    f = io.BytesIO(data)
    starts = []
    for _ in range(5):
        starts.append(f.tell())
        for op, arg, pos in pickletools.genops(f):
            if op.name == "STOP":
                break
    keys = [arg for op, arg, pos in pickletools.genops(io.BytesIO(data[starts[4]:])) if op.name == "BINUNICODE"]
    return starts, f.tell(), keys


def legacy_with(*, obj=None, keys=None, sys_info=None, protocol=None) -> bytes:
    """The real legacy stream with one of its pickles replaced (opcode bytes, STOP included)."""
    data = real_legacy_bytes()
    starts, storages_at, _ = legacy_parts()
    parts = [data[starts[i]:(starts + [storages_at])[i + 1]] for i in range(5)]
    for i, new in ((1, protocol), (2, sys_info), (3, obj), (4, keys)):
        if new is not None:
            parts[i] = new
    return b"".join(parts) + data[storages_at:]


def plist_of_str(items) -> bytes:
    return b"\x80\x02](" + b"".join(pstr(k) for k in items) + b"e."


@case("leg-trunc-mid-object-pickle.pt", "legacy stream cut inside the object pickle",
      r"object pickle \(at byte \d+\): pickle: (truncated pickle|pickle ends without STOP)")
def _(p):
    starts, _, _ = legacy_parts()
    p.write_bytes(real_legacy_bytes()[: starts[3] + 40])


@case("leg-trunc-before-storages.pt", "legacy stream cut right after the storage key list",
      r"file ends at byte \d+ before the header of storage '\d+' \(truncated\?\)")
def _(p):
    _, storages_at, _ = legacy_parts()
    p.write_bytes(real_legacy_bytes()[:storages_at])


@case("leg-trunc-mid-storage.pt", "legacy stream cut in the middle of the last storage's bytes",
      r"storage '\d+' \(\d+ elements of \d+ bytes at byte \d+\) runs past the end of the file")
def _(p):
    p.write_bytes(real_legacy_bytes()[:-3])


@case("leg-storage-count-lie.pt", "the first storage's 8-byte element count says 1000",
      r"storage '\d+' at byte \d+ holds 1000 elements but the pickle says \d+")
def _(p):
    _, storages_at, _ = legacy_parts()
    p.write_bytes(patch(real_legacy_bytes(), storages_at, "<q", 1000))


@case("leg-key-list-extra.pt", "the storage key list names a third storage the pickle never uses",
      r"the storage key list names 3 storages but the pickle uses 2")
def _(p):
    _, _, keys = legacy_parts()
    p.write_bytes(legacy_with(keys=plist_of_str(keys + ["999"])))


@case("leg-key-list-short.pt", "the storage key list leaves out a storage the pickle uses",
      r"the storage key list names 1 storages but the pickle uses 2")
def _(p):
    _, _, keys = legacy_parts()
    p.write_bytes(legacy_with(keys=plist_of_str(keys[:1])))


@case("leg-key-list-unknown.pt", "the storage key list names a key the pickle never uses",
      r"the storage key list names storage '999', which the pickle never uses")
def _(p):
    _, _, keys = legacy_parts()
    p.write_bytes(legacy_with(keys=plist_of_str(keys[:1] + ["999"])))


@case("leg-key-list-twice.pt", "the storage key list names one storage twice",
      r"the storage key list names storage '\d+' twice")
def _(p):
    _, _, keys = legacy_parts()
    p.write_bytes(legacy_with(keys=plist_of_str([keys[0], keys[0]])))


@case("leg-os-system.pt", "the object pickle calls os.system",
      r"object pickle \(at byte \d+\): pickle references os\.system, which would run code when loaded")
def _(p):
    p.write_bytes(legacy_with(obj=b"\x80\x02" + pglobal("os", "system") + ptuple([pstr("touch /tmp/ckptfs-pwned")]) + b"R."))


@case("leg-bad-magic.pt", "a pickle stream whose first pickle is not torch's magic number",
      r"not a legacy torch\.save file: its first pickle is not torch's magic number")
def _(p):
    p.write_bytes(b"\x80\x02" + pint(12345) + b"." + real_legacy_bytes()[legacy_parts()[0][1]:])


@case("leg-protocol-version.pt", "protocol version pickle says 1002", r"legacy torch\.save protocol version 1002; only 1001 is known")
def _(p):
    p.write_bytes(legacy_with(protocol=b"\x80\x02" + pint(1002) + b"."))


@case("leg-big-endian.pt", "system info says the writer was big-endian", r"written on a big-endian machine")
def _(p):
    p.write_bytes(legacy_with(sys_info=pdict([(pstr("protocol_version"), pint(1001)), (pstr("little_endian"), b"\x89")])))


@case("leg-tar.pt", "a tar archive (the torch <= 0.3 format)", r"the tar-based torch\.save format of torch <= 0\.3 is not supported")
def _(p):
    import tarfile

    with tarfile.open(p, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("sys_info", "pickle", "storages", "tensors"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"\x00"))


@functools.cache
def real_torchscript_records():
    """[(name, bytes)] of a real torch.jit.save of a traced nn.Sequential (its constants
    table holds a tensor)."""
    import torch

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.lin(x) * torch.tensor([2.0, 3.0])

    torch.manual_seed(0)
    traced = torch.jit.trace(Scaled(), torch.randn(1, 3), check_trace=False)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ts.pt"
        traced.save(str(path))
        z = zipfile.ZipFile(path)
        return [(i.filename, z.read(i.filename)) for i in z.infolist()]


def torchscript_with(replace=None, drop=()) -> bytes:
    entries = [(n, (replace or {}).get(n.split("/", 1)[1], b)) for n, b in real_torchscript_records()
               if n.split("/", 1)[1] not in drop]
    return write_stored_zip(entries)


HOSTILE_PICKLE = b"\x80\x02" + pglobal("os", "system") + ptuple([pstr("touch /tmp/ckptfs-pwned")]) + b"R."


@case("ts-os-system.pt", "TorchScript data.pkl calls os.system", r"ts/data\.pkl: pickle references os\.system")
def _(p):
    p.write_bytes(torchscript_with({"data.pkl": HOSTILE_PICKLE}))


@case("ts-constants-os-system.pt", "TorchScript constants.pkl calls os.system", r"ts/constants\.pkl: pickle references os\.system")
def _(p):
    p.write_bytes(torchscript_with({"constants.pkl": HOSTILE_PICKLE}))


@case("ts-record-too-short.pt", "a TorchScript data/ record 4 bytes shorter than its storage",
      r"record ts/data/0 holds \d+ bytes but the pickle says \d+")
def _(p):
    p.write_bytes(torchscript_with({"data/0": dict((n.split("/", 1)[1], b) for n, b in real_torchscript_records())["data/0"][:-4]}))


@case("ts-missing-constant-record.pt", "the constants table names a record constants/0 that is missing",
      r"the pickle references storage '0' but the archive has no record ts/constants/0")
def _(p):
    p.write_bytes(torchscript_with(drop=("constants/0",)))


@case("ts-truncated.pt", "a TorchScript archive cut in half", r"not a zip archive: no end-of-central-directory record")
def _(p):
    data = torchscript_with()
    p.write_bytes(data[: len(data) // 2])


@functools.cache
def real_pt2_records():
    """[(name, bytes)] of a real torch.export.save package of a small model."""
    import torch

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            self.register_buffer("scale", torch.tensor([2.0]))

        def forward(self, x):
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    program = torch.export.export(Small(), (torch.randn(1, 3),))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ep.pt2"
        torch.export.save(program, str(path))
        z = zipfile.ZipFile(path)
        return [(i.filename, z.read(i.filename)) for i in z.infolist()]


WEIGHTS_CONFIG = "data/weights/model_weights_config.json"


def pt2_with(replace=None, drop=(), extra=()) -> bytes:
    entries = [(n, (replace or {}).get(n.split("/", 1)[1], b)) for n, b in real_pt2_records()
               if n.split("/", 1)[1] not in drop]
    return write_stored_zip(entries + [("ep/" + n, b) for n, b in extra])


def pt2_config_edit(edit) -> bytes:
    config = json.loads(dict((n.split("/", 1)[1], b) for n, b in real_pt2_records())[WEIGHTS_CONFIG])
    edit(config["config"])
    return pt2_with({WEIGHTS_CONFIG: json.dumps(config).encode()})


@case("pt2-pickled-os-system.pt2", "a weight stored pickled (use_pickle) whose record calls os.system",
      r"record ep/data/weights/weight_0 \(lin\.weight\) is a pickled object")
def _(p):
    def edit(c):
        c["lin.weight"]["use_pickle"] = True
    data = pt2_config_edit(edit)
    records = [(n, HOSTILE_PICKLE if n.endswith("/weight_0") else b) for n, b in zipfile_records(data)]
    p.write_bytes(write_stored_zip(records))


def zipfile_records(data: bytes):
    z = zipfile.ZipFile(io.BytesIO(data))
    return [(i.filename, z.read(i.filename)) for i in z.infolist()]


@case("pt2-record-too-short.pt2", "lin.weight's record holds 8 of its 24 bytes",
      r"tensor reads past the end of storage 'data/weights/weight_0' \(8 bytes\)")
def _(p):
    p.write_bytes(pt2_with({"data/weights/weight_0": b"\x00" * 8}))


@case("pt2-missing-record.pt2", "the weights config names a record the package does not hold",
      r"names the record ep/data/weights/weight_9, which the package does not hold")
def _(p):
    def edit(c):
        c["lin.weight"]["path_name"] = "weight_9"
    p.write_bytes(pt2_config_edit(edit))


@case("pt2-symbolic-size.pt2", "a weight whose size is a symbolic expression",
      r"record ep/data/weights/weight_0 \(lin\.weight\) has a symbolic or malformed size or stride")
def _(p):
    def edit(c):
        c["lin.weight"]["tensor_meta"]["sizes"][0] = {"as_expr": {"expr_str": "s0"}}
    p.write_bytes(pt2_config_edit(edit))


@case("pt2-unknown-dtype.pt2", "a weight of ScalarType 99", r"\(lin\.weight\) has the unsupported dtype 99")
def _(p):
    def edit(c):
        c["lin.weight"]["tensor_meta"]["dtype"] = 99
    p.write_bytes(pt2_config_edit(edit))


@case("pt2-config-not-json.pt2", "the weights config is not JSON",
      r"record ep/data/weights/model_weights_config\.json is not a payload config")
def _(p):
    p.write_bytes(pt2_with({WEIGHTS_CONFIG: b"{not json"}))


@case("pt2-truncated.pt2", "a torch.export package cut in half", r"not a zip archive: no end-of-central-directory record")
def _(p):
    data = pt2_with()
    p.write_bytes(data[: len(data) // 2])


# --- driver ---------------------------------------------------------------------------------


# --- torch.distributed.checkpoint ----------------------------------------------------------

DCP_DIR = None  # the fixture cache's entry of make_dcp_checkpoints.py
DCP_VICTIM = "model.0.weight"  # [22, 13] in two row chunks of 11; chunk 1 is in __1_0.distcp
# The command the os.system case's pickle would run; test_corpus.py checks its file never
# appears (expected.json "never_created").
DCP_SENTINEL = "/tmp/ckptfs-corpus-dcp-os-system-ran"


def dcp_copy(case_name: str, dest: Path):
    """A copy of a real DCP save of tests/dcp (.metadata and the .distcp files) at DEST, its
    .metadata loaded: returns (metadata, save), SAVE() writing it back with pickle.dump after a
    case changed it. storage_meta gets fixed values (the real one holds a random save id and
    the fixture cache's path)."""
    import pickle

    import torch.distributed.checkpoint.metadata as dcp_metadata

    shutil.copytree(DCP_DIR / case_name, dest)
    with open(dest / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    metadata.storage_meta = dcp_metadata.StorageMeta(checkpoint_id=None, save_id="ckptfs-corpus", load_id=None)

    def save():
        with open(dest / ".metadata", "wb") as f:
            pickle.dump(metadata, f, protocol=4)  # dcp.save's pickle.dump default on Python 3.8-3.13

    save()
    return metadata, save


def dcp_move_chunk(metadata, fqn: str, chunk_index: int, **changes) -> None:
    """Replace a chunk's offsets and/or sizes, re-keying its storage entry (MetadataIndex
    compares fqn and offset only)."""
    import dataclasses

    import torch.distributed.checkpoint.metadata as dcp_metadata

    chunks = metadata.state_dict_metadata[fqn].chunks
    old = chunks[chunk_index]
    chunks[chunk_index] = new = dataclasses.replace(old, **changes)
    info = metadata.storage_data.pop(dcp_metadata.MetadataIndex(fqn, old.offsets))
    metadata.storage_data[dcp_metadata.MetadataIndex(fqn, new.offsets)] = info


class _RunsShellCommand:
    """Unpickling this calls os.system(COMMAND)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        import os

        return (os.system, (self.command,))


# =============================================================================================
@case("dcp-missing-distcp/", "FSDP2 ws2: __1_0.distcp deleted",
      r"__1_0\.distcp: .*data file of 'model\.0\.weight' \(named by .*\.metadata\) is missing")
def _(p):
    dcp_copy("fsdp2_ws2", p)
    (p / "__1_0.distcp").unlink()


@case("dcp-truncated-distcp/", "FSDP2 ws2: __1_0.distcp cut in half",
      r"__1_0\.distcp: '[\w.]+': slice \[\d+, \d+\+\d+\) lies outside the file")
def _(p):
    dcp_copy("fsdp2_ws2", p)
    f = p / "__1_0.distcp"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


@case("dcp-metadata-size-lie/", ".metadata says chunk 0 of model.0.weight has 10 rows where 11 are stored",
      r"__0_0\.distcp \[bytes \d+\.\.\d+\): 'model\.0\.weight': the chunk's shape differs from its sizes in \.metadata")
def _(p):
    import torch

    metadata, save = dcp_copy("fsdp2_ws2", p)
    dcp_move_chunk(metadata, DCP_VICTIM, 0, sizes=torch.Size([10, 13]))
    save()


@case("dcp-overlapping-chunks/", "model.0.weight's chunk 1 moved up a row: it overlaps chunk 0",
      r"\.metadata: tensor 'model\.0\.weight': .*overlap")
def _(p):
    import torch

    metadata, save = dcp_copy("fsdp2_ws2", p)
    dcp_move_chunk(metadata, DCP_VICTIM, 1, offsets=torch.Size([10, 0]))
    save()


@case("dcp-missing-chunk/", "model.0.weight's chunk 1 and its storage entry removed: rows 11..21 are a hole",
      r"\.metadata: tensor 'model\.0\.weight': elements .* are not covered by any box")
def _(p):
    import torch.distributed.checkpoint.metadata as dcp_metadata

    metadata, save = dcp_copy("fsdp2_ws2", p)
    chunk = metadata.state_dict_metadata[DCP_VICTIM].chunks.pop(1)
    del metadata.storage_data[dcp_metadata.MetadataIndex(DCP_VICTIM, chunk.offsets)]
    save()


@case("dcp-unknown-transform/", "model.0.weight's chunk 1 stored with a transform descriptor ckptfs does not know",
      r"\.metadata: 'model\.0\.weight' is stored with transforms \(ckptfs-corpus-unknown-codec\)")
def _(p):
    import dataclasses

    import torch.distributed.checkpoint.metadata as dcp_metadata

    metadata, save = dcp_copy("fsdp2_ws2", p)
    key = dcp_metadata.MetadataIndex(DCP_VICTIM, metadata.state_dict_metadata[DCP_VICTIM].chunks[1].offsets)
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key],
                                                     transform_descriptors=["ckptfs-corpus-unknown-codec"])
    save()


@case("dcp-metadata-os-system/", f".metadata whose planner_data entry of model.0.weight calls os.system('touch {DCP_SENTINEL}')",
      # Refused as a whole, before any entry is read: the line names the file, not an fqn.
      r"\.metadata: pickle references posix\.system, which would run code when loaded")
def _(p):
    metadata, save = dcp_copy("fsdp2_ws2", p)
    # planner_data is read to re-nest the fqns: the payload sits where a reader must look.
    metadata.planner_data[DCP_VICTIM] = _RunsShellCommand(f"touch {DCP_SENTINEL}")
    save()
    assert b"system" in (p / ".metadata").read_bytes()


# Megatron's mcore_data (megatron-core before 0.14 adds it to the Metadata: the real shape of
# a tensor saved as reformulated flattened fragments) that disagrees with the DCP layout.
@case("dcp-mcore-rank-mismatch/", "mcore_data gives model.0.weight [22, 13] the real shape (13, 22): a reformulated shape needs one more dimension",
      r"\.metadata: 'model\.0\.weight': Megatron flattened fragments of real shape \[13, 22\] cannot be served: "
      r"its real shape has 2 dimensions, so the reformulated shape should have 3, not 2")
def _(p):
    metadata, save = dcp_copy("fsdp2_ws2", p)
    metadata.mcore_data = {DCP_VICTIM: {"nd_reformulated_orig_global_shape": (13, 22)}}
    save()


@case("dcp-mcore-fragment-spans-chunks/", "mcore_data gives model.0.weight [22, 13] the real shape (286,): its 11-row chunks would each span 11 Megatron chunks",
      r"\.metadata: 'model\.0\.weight': a fragment spans 11 chunks along dimension 0")
def _(p):
    metadata, save = dcp_copy("fsdp2_ws2", p)
    metadata.mcore_data = {DCP_VICTIM: {"nd_reformulated_orig_global_shape": (286,)}}
    save()


@case("dcp-mcore-unknown-record/", "mcore_data of model.0.weight holds a record other than nd_reformulated_orig_global_shape",
      r"\.metadata: 'model\.0\.weight': mcore_data \(Megatron's\) holds 'ckptfs_corpus_layout', which ckptfs does not know")
def _(p):
    metadata, save = dcp_copy("fsdp2_ws2", p)
    metadata.mcore_data = {DCP_VICTIM: {"ckptfs_corpus_layout": 1}}
    save()


@case("dcp-st-saved-offsets-lie/", "safetensors form: the blob's DCP_SHARDING_INFO puts model.0.weight's rank-1 chunk at row 10, .metadata at row 11",
      r"__1_0\.distcp \[bytes \d+\.\.\d+\): 'model\.0\.weight': saved_offsets \[10,0\] in DCP_SHARDING_INFO differ")
def _(p):
    dcp_copy("st_fsdp2_ws2", p)
    f = p / "__1_0.distcp"
    data = f.read_bytes()
    old = b'\\"model.0.weight\\": {\\"saved_offsets\\": [11, 0]}'
    assert data.count(old) == 1, "the blob's DCP_SHARDING_INFO is not as expected"
    f.write_bytes(data.replace(old, old.replace(b"[11, 0]", b"[10, 0]")))  # same length: offsets stay


def main(argv=None) -> int:
    global TORCH, ST, ZERO_DIR, DCP_DIR, UNIVERSAL_DIR
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", metavar="PREFIX", action="append",
                    help="(re)generate only the cases whose names start with PREFIX (repeatable), keeping the "
                         "other committed cases and their expected.json entries as they are")
    only = ap.parse_args(argv).only
    TORCH = real_torch_bytes()
    ST = real_safetensors_bytes()
    if only:
        ZERO_DIR = DCP_DIR = None  # no ZeRO or DCP case may be asked for alone
        kept = json.loads(EXPECTED.read_text())
        cases = [c for c in CASES if any(c[0].startswith(prefix) for prefix in only)]
        assert cases and not any(c[0].startswith(("zero-", "dcp-")) for c in cases), "no such case, or a folder case"
        for name, *_ in cases:
            path = CASES_DIR / name.rstrip("/")
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        order = [c[0] for c in CASES]
        expected = {name: kept[name] for name in order if name in kept}
        for name, fault, error, builder in cases:
            path = CASES_DIR / name.rstrip("/")
            builder(path)
            assert path.exists(), name
            expected[name] = {"fault": fault, "error": error}
        expected = {name: expected[name] for name in order if name in expected}
        EXPECTED.write_text(json.dumps(expected, indent=1) + "\n")
        print(f"{len(cases)} cases written, {len(expected)} in {EXPECTED.name}")
        return 0
    ZERO_DIR = cached_fixtures(ZERO_CHECKPOINTS)
    UNIVERSAL_DIR = cached_fixtures(UNIVERSAL_CHECKPOINTS, inputs=(ZERO_CHECKPOINTS,))
    DCP_DIR = cached_fixtures(DCP_CHECKPOINTS)
    if CASES_DIR.exists():
        shutil.rmtree(CASES_DIR)
    CASES_DIR.mkdir()
    expected = {}
    for name, fault, error, builder in CASES:
        assert name not in expected, name
        path = CASES_DIR / name.rstrip("/")
        builder(path)
        assert path.exists(), name
        expected[name] = {"fault": fault, "error": error}
        if name == "dcp-metadata-os-system/":
            expected[name]["never_created"] = DCP_SENTINEL
    EXPECTED.write_text(json.dumps(expected, indent=1) + "\n")
    total = sum(f.stat().st_size for f in CASES_DIR.rglob("*") if f.is_file())
    print(f"{len(expected)} cases, {total / 1e6:.2f} MB in {CASES_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
