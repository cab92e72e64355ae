"""Legacy pickles written by Python 2, read as torch.load(..., encoding="latin1") reads them
(doc/FORMATS.md, "Python 2 pickles").

- The real case: the pretrained weights the lpips package ships on PyPI (scripts/setup-venv.sh
  lpips), legacy torch.save streams pickled by Python 2, whose state dict is an OrderedDict
  called with a list of [key, tensor] lists.
- Python 2's other forms, in streams built opcode by opcode (no Python 2 is at hand): its byte
  strings (SHORT_BINSTRING, BINSTRING, STRING with escapes, latin1 bytes), ints (INT, LONG,
  LONG1), `__builtin__` and `copy_reg` names, copy_reg._reconstructor objects, storages with
  str type names, in a legacy stream and in a torch.save zip alike.

Each is compared with what torch.load itself returns: tensors bit for bit, keys in order,
the values of metadata.json."""

import io
import json
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptfs_fixture_cache import overlay_python
from ckptfs_testlib import assert_bitwise_equal, flatten_tensors


def export(run_ckptfs, source: Path, out: Path) -> tuple[dict, dict]:
    """({key: tensor} in the order ckptfs lists them, metadata.json) of SOURCE's export."""
    run_ckptfs("export", str(source), str(out))
    order = [entry["key"] for entry in json.loads(run_ckptfs("ls", "--json", str(source)).stdout)]
    tensors = load_file(out / "model.safetensors")
    assert sorted(order) == sorted(tensors)
    return {key: tensors[key] for key in order}, json.loads((out / "metadata.json").read_text())


def assert_served_as_loaded(served: dict, loaded: dict) -> None:
    assert list(served) == list(loaded), f"keys or their order differ: {list(served)} != {list(loaded)}"
    for key, tensor in loaded.items():
        assert_bitwise_equal(served[key], tensor, key)


# --- the lpips package's weights -------------------------------------------------------------


@pytest.fixture(scope="module")
def lpips_weights() -> list[Path]:
    python = overlay_python("lpips")
    # find_spec of a top-level package locates it without importing it.
    done = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('lpips').submodule_search_locations[0])"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    files = sorted((Path(done.stdout.strip()) / "weights").glob("v0.*/*.pth"))
    assert len(files) == 6, f"lpips ships six weight files, found {files}"
    return files


def test_lpips_weights_are_python2_legacy_streams(lpips_weights):
    # What makes them the case: a legacy stream (the magic number's pickle first) whose object
    # pickle is an OrderedDict called with a list of pairs, keys as SHORT_BINSTRING.
    import pickletools

    f = io.BytesIO(lpips_weights[0].read_bytes())
    pickles = []
    for _ in range(4):  # magic number, protocol version, system info, the object
        pickles.append([op.name for op, _, _ in pickletools.genops(f)])
    obj = pickles[3]
    assert obj[:2] == ["PROTO", "GLOBAL"] and "SHORT_BINSTRING" in obj and "BINUNICODE" not in obj
    assert obj[-3:] == ["REDUCE", "BINPUT", "STOP"] or obj[-2:] == ["REDUCE", "STOP"]


@pytest.mark.parametrize("index", range(6), ids=["v0.0-alex", "v0.0-squeeze", "v0.0-vgg", "v0.1-alex", "v0.1-squeeze", "v0.1-vgg"])
def test_lpips_weights_serve_what_torch_load_returns(lpips_weights, run_ckptfs, tmp_path, index):
    path = lpips_weights[index]
    # The package's own files, loaded in full: weights_only ignores `encoding`.
    loaded = torch.load(path, map_location="cpu", encoding="latin1", weights_only=False)
    assert len(loaded) in (5, 7)
    served, metadata = export(run_ckptfs, path, tmp_path / "out")
    assert_served_as_loaded(served, loaded)
    assert metadata == {}


# --- Python 2 forms built opcode by opcode ----------------------------------------------------

MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little") + b"."


def short_binstring(s: bytes) -> bytes:
    return b"U" + bytes([len(s)]) + s


def binstring(s: bytes) -> bytes:
    return b"T" + struct.pack("<I", len(s)) + s


def glob(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def storage_pid(key: bytes, numel: int, cls: str, legacy: bool) -> bytes:
    # ('storage', torch.<cls>, key, 'cuda:0', numel[, None]) with Python 2's str and long; a
    # legacy stream's ids end with the view (None), a zip archive's do not.
    return (b"(" + short_binstring(b"storage") + glob("torch", cls) + short_binstring(key) + short_binstring(b"cuda:0")
            + b"\x8a\x01" + bytes([numel]) + (b"N" if legacy else b"") + b"t" + b"Q")


def tensor(key: bytes, numel: int, size, stride, cls, legacy) -> bytes:
    def ints(values):
        return b"(" + b"".join(b"K" + bytes([v]) for v in values) + b"t"
    return (glob("torch._utils", "_rebuild_tensor_v2") + b"(" + storage_pid(key, numel, cls, legacy) + b"K\x00" + ints(size)
            + ints(stride) + b"\x89" + glob("collections", "OrderedDict") + b")R" + b"tR")


def python2_object(legacy: bool) -> bytes:
    """A training checkpoint as Python 2 pickled it (protocol 2, no framing), every Python 2
    form at once."""
    pairs = [
        (short_binstring(b"model.weight"), tensor(b"140001", 6, (2, 3), (3, 1), "FloatStorage", legacy)),
        (short_binstring(b"model.caf\xe9"), tensor(b"140002", 4, (4,), (1,), "DoubleStorage", legacy)),  # latin1 key
        (binstring(b"model.t"), tensor(b"140001", 6, (3, 2), (1, 3), "FloatStorage", legacy)),  # a view of the first
    ]
    state = glob("collections", "OrderedDict") + b"]("
    state += b"".join(b"]" + b"(" + k + v + b"e" for k, v in pairs[:2])
    state += b"(" + pairs[2][0] + pairs[2][1] + b"t"  # a tuple pair
    state += b"e\x85R"
    # argparse-like options of a Python 2 class: copy_reg._reconstructor(cls, object, None) + BUILD.
    options = (glob("copy_reg", "_reconstructor") + b"(" + glob("argparse", "Namespace") + glob("__builtin__", "object")
               + b"NtR" + b"}(" + short_binstring(b"lr") + b"G" + struct.pack(">d", 0.5)
               + short_binstring(b"name") + b"S'r\\xe9sum\\xe9\\n\\'q\\''\n"
               + short_binstring(b"steps") + b"L12345678901234567890L\n"
               + short_binstring(b"epoch") + b"I7\n"
               + short_binstring(b"note") + b"Vna\\u00efve\n"
               + b"ub")
    return (b"\x80\x02}(" + short_binstring(b"state_dict") + state + short_binstring(b"args") + options
            + short_binstring(b"tag") + short_binstring(b"\xff\xfe") + b"u.")


STORAGES = {b"140001": struct.pack("<6f", *range(6)), b"140002": struct.pack("<4d", 1.5, -2.0, 3.25, 0.0)}


def legacy_stream() -> bytes:
    sys_info = (b"\x80\x02}(" + short_binstring(b"protocol_version") + b"M\xe9\x03" + short_binstring(b"little_endian")
                + b"\x88" + short_binstring(b"type_sizes") + b"}(" + short_binstring(b"int") + b"K\x04u" + b"u.")
    keys = b"\x80\x02](" + b"".join(short_binstring(k) for k in sorted(STORAGES)) + b"e."
    out = MAGIC + b"\x80\x02M\xe9\x03." + sys_info + python2_object(True) + keys
    for k in sorted(STORAGES):
        data = STORAGES[k]
        out += struct.pack("<q", len(data) // (4 if k == b"140001" else 8)) + data
    return out


def zip_archive() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", python2_object(False))
        z.writestr("archive/byteorder", "little")
        for k, data in STORAGES.items():
            z.writestr(f"archive/data/{k.decode()}", data)
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


@pytest.mark.parametrize("container", ["legacy", "zip"])
def test_python2_forms_serve_what_torch_load_returns(run_ckptfs, tmp_path, container):
    path = tmp_path / f"python2-{container}.pt"
    path.write_bytes(legacy_stream() if container == "legacy" else zip_archive())
    # Our own bytes, loaded in full (a Namespace is not among weights_only's classes).
    loaded = torch.load(path, map_location="cpu", encoding="latin1", weights_only=False)
    served, metadata = export(run_ckptfs, path, tmp_path / "out")
    assert_served_as_loaded(served, flatten_tensors(loaded))
    assert list(served)[1] == "state_dict.model.café"
    args = vars(loaded["args"])
    assert metadata["args"]["$class"] == "argparse.Namespace"
    assert metadata["args"]["state"] == {
        "lr": args["lr"], "name": args["name"], "steps": {"$int": str(args["steps"])}, "epoch": args["epoch"],
        "note": args["note"]}
    assert args["name"] == "résumé\n'q'" and args["note"] == "naïve"
    assert metadata["tag"] == loaded["tag"] == "\xff\xfe"
