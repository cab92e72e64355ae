"""Bad input: ckptfs must refuse it with one stderr line naming the file and exit status 1,
never crash, hang or execute anything from a pickle."""

import json
import pickle
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# Pickle protocol 2 opcodes, as torch.save writes them (reference section A.4).
PROTO_2 = b"\x80\x02"
MARK = b"("
TUPLE = b"t"
EMPTY_TUPLE = b")"
EMPTY_DICT = b"}"
EMPTY_LIST = b"]"
APPENDS = b"e"
SETITEMS = b"u"
REDUCE = b"R"
BINPERSID = b"Q"
NEWFALSE = b"\x89"
STOP = b"."


def pickle_str(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def pickle_global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def pickle_int(value: int) -> bytes:
    if 0 <= value < 1 << 8:
        return b"K" + bytes([value])
    if 0 <= value < 1 << 16:
        return b"M" + struct.pack("<H", value)
    if -(1 << 31) <= value < 1 << 31:
        return b"J" + struct.pack("<i", value)
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data  # LONG1


def pickle_tuple(items) -> bytes:
    return MARK + b"".join(items) + TUPLE


def pickle_tensor(storage: str, key: str, numel: int, offset: int, size, stride) -> bytes:
    """_rebuild_tensor_v2(<persistent storage>, offset, size, stride, False, OrderedDict())."""
    persistent_id = (
        pickle_tuple(
            [
                pickle_str("storage"),
                pickle_global("torch", storage),
                pickle_str(key),
                pickle_str("cpu"),
                pickle_int(numel),
            ]
        )
        + BINPERSID
    )
    args = pickle_tuple(
        [
            persistent_id,
            pickle_int(offset),
            pickle_tuple(map(pickle_int, size)),
            pickle_tuple(map(pickle_int, stride)),
            NEWFALSE,
            pickle_global("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE,
        ]
    )
    return pickle_global("torch._utils", "_rebuild_tensor_v2") + args + REDUCE


def pickle_dict(items: dict) -> bytes:
    """A protocol-2 pickle of {str key: value given as pickle opcodes}."""
    body = b"".join(pickle_str(key) + value for key, value in items.items())
    return PROTO_2 + EMPTY_DICT + MARK + body + SETITEMS + STOP


def make_torch_zip(path: Path, pickle_bytes: bytes, records: dict) -> Path:
    """A minimal torch zip (reference section C): archive/data.pkl, one archive/data/<key> per
    RECORDS entry, byteorder and version, all stored uncompressed."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle_bytes)
        archive.writestr("archive/byteorder", "little")
        for key, data in records.items():
            archive.writestr(f"archive/data/{key}", data)
        archive.writestr("archive/version", "3\n")
    return path


def float_records(count: int) -> dict:
    return {"0": struct.pack(f"<{count}f", *range(count))}


def write_raw_safetensors(path: Path, header, data: bytes = b"", header_len: int | None = None):
    """A safetensors file from a header (dict or raw bytes) and data, with an optional lie
    in the 8-byte length prefix."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    length = len(body) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + body + data)
    return path


def assert_refused(result, *names) -> None:
    """Exit 1 (not a signal), exactly one stderr line `ckptfs: ...` naming one of NAMES."""
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 1, (
        f"exit status {result.returncode} (negative means killed by a signal); stderr:\n{stderr}"
    )
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{stderr}"
    assert lines[0].startswith("ckptfs: "), lines[0]
    assert any(str(name) in lines[0] for name in names), f"{lines[0]!r} names none of {names}"


@pytest.fixture
def refuses(run_ckptfs):
    """refuses(source, *names): `ckptfs ls SOURCE` fails cleanly, naming one of NAMES
    (SOURCE itself by default)."""

    def check(source: Path, *names) -> None:
        assert_refused(run_ckptfs("ls", source, check=False), *(names or (source,)))

    return check


@pytest.fixture
def saved_checkpoint(tmp_path) -> Path:
    path = tmp_path / "good.pt"
    torch.save({"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(8)}, path)
    return path


# --- controls: the hand-built files are right, so the bad variants fail for the right reason


def test_hand_built_torch_zip_is_valid(tmp_path, verify_export):
    pickled = pickle_dict({"w": pickle_tensor("FloatStorage", "0", 6, 0, (2, 3), (3, 1))})
    src = make_torch_zip(tmp_path / "minimal.pt", pickled, float_records(6))
    expected = torch.load(src, weights_only=True)
    assert torch.equal(expected["w"], torch.arange(6.0).reshape(2, 3))
    verify_export(src, expected)


def test_hand_built_safetensors_is_valid(tmp_path, verify_export):
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
    }
    src = write_raw_safetensors(tmp_path / "ok.safetensors", header, struct.pack("<4f", 1, 2, 3, 4))
    verify_export(src, load_file(src))


# --- torch zip container


@pytest.mark.parametrize("keep", [0, 3, 30, 0.5, -100, -50, -23, -1], ids=lambda k: f"keep{k}")
def test_truncated_pt(saved_checkpoint, refuses, keep):
    data = saved_checkpoint.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    saved_checkpoint.write_bytes(data[:cut])
    refuses(saved_checkpoint)


def test_hole_in_data_region(saved_checkpoint, refuses):
    # The directory survives intact but every offset in it now points at the wrong bytes.
    data = saved_checkpoint.read_bytes()
    start = data.find(b"/data/0") + 100
    saved_checkpoint.write_bytes(data[:start] + data[start + 128 :])
    refuses(saved_checkpoint)


def corrupt_eocd_signature(data: bytearray) -> None:
    data[data.rfind(b"PK\x05\x06")] ^= 0xFF


def corrupt_central_header_signature(data: bytearray) -> None:
    data[data.find(b"PK\x01\x02") + 1] ^= 0xFF


def corrupt_central_directory_offset(data: bytearray) -> None:
    # Both the classic and the zip64 end record, so neither can be used to recover.
    eocd = data.rfind(b"PK\x05\x06")
    data[eocd + 16 : eocd + 20] = struct.pack("<I", 0x7FFFFFF0)
    zip64_eocd = data.rfind(b"PK\x06\x06")
    if zip64_eocd >= 0:
        data[zip64_eocd + 48 : zip64_eocd + 56] = struct.pack("<Q", 1 << 60)


def corrupt_data_local_offset(data: bytearray) -> None:
    # The central entry of data/0 points its local header past the end of the file.
    entry = data.find(b"PK\x01\x02")
    while entry >= 0:
        name_len = struct.unpack_from("<H", data, entry + 28)[0]
        if data[entry + 46 : entry + 46 + name_len].endswith(b"/data/0"):
            data[entry + 42 : entry + 46] = struct.pack("<I", 0x7FFFFFF0)
            return
        entry = data.find(b"PK\x01\x02", entry + 4)
    raise AssertionError("no central entry for data/0")


@pytest.mark.parametrize(
    "corrupt",
    [
        corrupt_eocd_signature,
        corrupt_central_header_signature,
        corrupt_central_directory_offset,
        corrupt_data_local_offset,
    ],
    ids=lambda f: f.__name__.removeprefix("corrupt_"),
)
def test_corrupt_zip_directory(saved_checkpoint, refuses, corrupt):
    data = bytearray(saved_checkpoint.read_bytes())
    corrupt(data)
    saved_checkpoint.write_bytes(data)
    refuses(saved_checkpoint)


def test_deflated_data_record(saved_checkpoint, tmp_path, refuses):
    # torch.load reads deflated records, but their bytes cannot be served as file ranges.
    deflated = tmp_path / "deflated.pt"
    with zipfile.ZipFile(saved_checkpoint) as source, zipfile.ZipFile(deflated, "w") as target:
        for name in source.namelist():
            method = zipfile.ZIP_DEFLATED if "/data/" in name else zipfile.ZIP_STORED
            target.writestr(name, source.read(name), compress_type=method)
    assert torch.load(deflated, weights_only=True)["w"].shape == (8, 8)
    refuses(deflated)


def big_endian_zip(path: Path, byteorder: str) -> Path:
    pickled = pickle_dict({"w": pickle_tensor("FloatStorage", "0", 6, 0, (2, 3), (3, 1))})
    make_torch_zip(path, pickled, {"0": struct.pack(">6f", *range(6))})
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    members["archive/byteorder"] = byteorder.encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def test_big_endian_is_swapped_or_refused(tmp_path, run_ckptfs, verify_export):
    # torch.load byte-swaps these; serving the raw bytes would silently corrupt every value.
    src = big_endian_zip(tmp_path / "big-endian.pt", "big")
    expected = torch.load(src, weights_only=True)
    assert torch.equal(expected["w"], torch.arange(6.0).reshape(2, 3))
    result = run_ckptfs("ls", src, check=False)
    if result.returncode == 0:
        verify_export(src, expected)
    else:
        assert_refused(result, src)


def test_unknown_byteorder(tmp_path, refuses):
    refuses(big_endian_zip(tmp_path / "middle-endian.pt", "middle"))


def test_legacy_format_is_served(tmp_path, run_ckptfs, verify_export):
    # The pre-1.6 pickle-stream format, which torch.load still reads (tests/compat/test_torch_family.py
    # covers it in depth).
    src = tmp_path / "legacy.pt"
    torch.save({"w": torch.randn(3, 2)}, src, _use_new_zipfile_serialization=False)
    verify_export(src, torch.load(src, weights_only=True))


def test_torchscript_archive_is_served(tmp_path, ls_json):
    # torch.jit.save writes a zip with data.pkl too; its module tree is served by state-dict name.
    src = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 2)), src)
    assert {entry["key"] for entry in ls_json(src)} == {"weight", "bias"}


# --- storages and tensors that do not fit their records

BAD_TENSORS = {
    # The pid claims 100 floats; the record holds 6.
    "storage_larger_than_record": ("FloatStorage", 100, 0, (2, 3), (3, 1)),
    # The record has 6 floats; the tensor would need elements 4..9.
    "offset_past_storage": ("FloatStorage", 6, 4, (2, 3), (3, 1)),
    "shape_past_storage": ("FloatStorage", 6, 0, (4, 3), (3, 1)),
    "stride_past_storage": ("FloatStorage", 6, 0, (2, 3), (5, 1)),
    "negative_offset": ("FloatStorage", 6, -1, (2, 3), (3, 1)),
    "size_overflows": ("FloatStorage", 6, 0, (1 << 62, 1 << 62), (1, 1)),
    "stride_overflows": ("FloatStorage", 6, 0, (2, 3), (1 << 62, 1)),
    # 8 * (2**61 + 3) wraps to 24 in 64 bits: exactly the record size if unchecked.
    "storage_bytes_overflow": ("DoubleStorage", (1 << 61) + 3, 0, (3,), (1,)),
}


@pytest.mark.parametrize("storage,numel,offset,size,stride", BAD_TENSORS.values(), ids=BAD_TENSORS)
def test_tensor_outside_its_record(tmp_path, refuses, storage, numel, offset, size, stride):
    pickled = pickle_dict({"w": pickle_tensor(storage, "0", numel, offset, size, stride)})
    refuses(make_torch_zip(tmp_path / "bad-tensor.pt", pickled, float_records(6)))


def test_missing_record(tmp_path, refuses):
    pickled = pickle_dict({"w": pickle_tensor("FloatStorage", "7", 6, 0, (2, 3), (3, 1))})
    refuses(make_torch_zip(tmp_path / "missing-record.pt", pickled, float_records(6)))


@pytest.mark.parametrize("where", ["after_proto", "before_stop"])
def test_unknown_pickle_opcode(tmp_path, refuses, where):
    pickled = pickle_dict({"w": pickle_tensor("FloatStorage", "0", 6, 0, (2, 3), (3, 1))})
    at = len(PROTO_2) if where == "after_proto" else len(pickled) - 1
    pickled = pickled[:at] + b"\xff" + pickled[at:]
    refuses(make_torch_zip(tmp_path / "opcode.pt", pickled, float_records(6)))


def test_truncated_pickle(tmp_path, refuses):
    pickled = pickle_dict({"w": pickle_tensor("FloatStorage", "0", 6, 0, (2, 3), (3, 1))})
    refuses(
        make_torch_zip(tmp_path / "short-pickle.pt", pickled[: len(pickled) // 2], float_records(6))
    )


# --- pickles that would run code if unpickled


def code_execution_payload(module: str, name: str, marker: Path) -> bytes:
    """Pickle opcodes calling module.name(...) so that it creates MARKER."""
    if name == "check_call":
        argument = EMPTY_LIST + MARK + pickle_str("touch") + pickle_str(str(marker)) + APPENDS
    elif name == "eval":
        argument = pickle_str(f"__import__('pathlib').Path({str(marker)!r}).touch()")
    else:
        argument = pickle_str(f"touch {marker}")
    return pickle_global(module, name) + pickle_tuple([argument]) + REDUCE


CODE_EXECUTION_GLOBALS = [
    ("os", "system"),
    ("posix", "system"),
    ("subprocess", "check_call"),
    ("__builtin__", "eval"),  # protocol 2 spells builtins this way
]


@pytest.mark.parametrize("module,name", CODE_EXECUTION_GLOBALS, ids=lambda v: v)
def test_payload_is_live(tmp_path, module, name):
    # Control: plain pickle really does run the payload, so its absence below means something.
    marker = tmp_path / "marker"
    pickle.loads(PROTO_2 + code_execution_payload(module, name, marker) + STOP)
    assert marker.exists()


@pytest.mark.parametrize("module,name", CODE_EXECUTION_GLOBALS, ids=lambda v: v)
def test_code_execution_global_is_refused(tmp_path, refuses, module, name):
    marker = tmp_path / "marker"
    pickled = pickle_dict(
        {
            "w": pickle_tensor("FloatStorage", "0", 6, 0, (2, 3), (3, 1)),
            "evil": code_execution_payload(module, name, marker),
        }
    )
    src = make_torch_zip(tmp_path / "evil.pt", pickled, float_records(6))
    refuses(src)
    assert not marker.exists(), "ckptfs executed code from the pickle"


# --- safetensors headers

F32_PAIR = struct.pack("<6f", *range(6))

BAD_SAFETENSORS = {
    "overlapping_offsets": (
        {
            "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
        },
        F32_PAIR,
        None,
    ),
    "header_length_2_pow_62": (
        {"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}},
        F32_PAIR,
        1 << 62,
    ),
    "header_length_past_file": (
        {"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}},
        F32_PAIR,
        4096,
    ),
    "header_not_json": (b"this is not json at all", F32_PAIR, None),
    "header_not_an_object": (b"[1, 2, 3]", F32_PAIR, None),
    "unknown_dtype": (
        {"a": {"dtype": "F13", "shape": [6], "data_offsets": [0, 24]}},
        F32_PAIR,
        None,
    ),
    "offsets_past_file": (
        {"a": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}},
        F32_PAIR,
        None,
    ),
    "offsets_disagree_with_shape": (
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 24]}},
        F32_PAIR,
        None,
    ),
    "negative_shape": (
        {"a": {"dtype": "F32", "shape": [-6], "data_offsets": [0, 24]}},
        F32_PAIR,
        None,
    ),
    "shape_overflows": (
        {"a": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 24]}},
        F32_PAIR,
        None,
    ),
}


@pytest.mark.parametrize("header,data,header_len", BAD_SAFETENSORS.values(), ids=BAD_SAFETENSORS)
def test_bad_safetensors(tmp_path, refuses, header, data, header_len):
    src = write_raw_safetensors(tmp_path / "bad.safetensors", header, data, header_len)
    refuses(src)


def test_safetensors_shorter_than_length_prefix(tmp_path, refuses):
    src = tmp_path / "tiny.safetensors"
    src.write_bytes(b"\x01\x02\x03")
    refuses(src)


# --- folders and paths


def test_bad_shard_in_folder_is_named(tmp_path, refuses):
    folder = tmp_path / "sharded"
    folder.mkdir()
    write_raw_safetensors(
        folder / "model-00001-of-00002.safetensors",
        {"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}},
        F32_PAIR,
    )
    bad = write_raw_safetensors(folder / "model-00002-of-00002.safetensors", b"not json", F32_PAIR)
    index = {
        "metadata": {"total_size": 48},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": bad.name},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    refuses(folder, bad)


def test_index_names_missing_shard(tmp_path, refuses):
    folder = tmp_path / "sharded"
    folder.mkdir()
    write_raw_safetensors(
        folder / "model-00001-of-00002.safetensors",
        {"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}},
        F32_PAIR,
    )
    missing = "model-00002-of-00002.safetensors"
    index = {
        "metadata": {"total_size": 48},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": missing},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    refuses(folder, missing)


def test_missing_source(tmp_path, refuses):
    refuses(tmp_path / "does-not-exist.pt")


def test_folder_without_checkpoints(tmp_path, refuses):
    (tmp_path / "empty").mkdir()
    refuses(tmp_path / "empty")


def test_not_a_checkpoint(tmp_path, refuses):
    src = tmp_path / "notes.pt"
    src.write_text("just some text, not a checkpoint\n")
    refuses(src)


@pytest.mark.parametrize("command", ["info", "export", "cat"])
def test_other_commands_refuse_too(saved_checkpoint, run_ckptfs, tmp_path, command):
    data = bytearray(saved_checkpoint.read_bytes())
    corrupt_central_header_signature(data)
    saved_checkpoint.write_bytes(data)
    extra = {"info": [], "export": [tmp_path / "out"], "cat": ["model.safetensors"]}[command]
    result = run_ckptfs(command, saved_checkpoint, *extra, check=False)
    assert_refused(result, saved_checkpoint)
    assert result.stdout == b"", "nothing may be written to stdout for a refused source"


@pytest.mark.parametrize(
    "argv",
    [["ls"], ["frobnicate", "x"], ["cat", "only-one-arg"]],
    ids=["ls-without-source", "unknown-command", "cat-without-vpath"],
)
def test_usage_error(run_ckptfs, argv):
    assert run_ckptfs(*argv, check=False).returncode == 2
