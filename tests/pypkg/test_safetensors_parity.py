"""ckptfs.safe_open as a drop-in for safetensors' safe_open: the same cases run against both
on files safetensors.torch.save_file wrote, with equal results (values, dtypes, devices, key
order, metadata, exception types and messages); safetensors' own readers and transformers'
from_pretrained with ckptfs.safe_open patched in, on every source format; and the packed and
exponent-only dtypes (F4, F8_E8M0) through `ckptfs ls`, the mount and safe_open."""

import json
import subprocess

import pytest
import safetensors
import safetensors.torch
import torch
from safetensors.torch import save_file

import ckptfs
import ckptfs.torch
from ckptfs_testlib import assert_bitwise_equal
from minilm import encode, load_model, minilm_dir  # noqa: F401  (shared fixture)

OPENERS = {"safetensors": safetensors.safe_open, "ckptfs": ckptfs.safe_open}

# Every index form safetensors' slices take, with the reads and shapes they give.
INDEXES = [
    (), [], 1, -1, slice(None, None, 2), (Ellipsis, 1), (1, 2), slice(5, 10), (slice(None), slice(1, None, 3)),
    (None,), (1, None), (None, Ellipsis, None, 1), torch.tensor(1), [0, 2], [-1], (slice(None), [3, 0]),
    (slice(1, 3), Ellipsis), (Ellipsis, slice(None, None, 5)),
]
BAD_INDEXES = [7, (1, 2, 3), slice(None, None, -1), 1.5, (0, -9)]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """{name: path} of safetensors files save_file wrote: with metadata and without, of mixed
    dtypes, the keys not in offset order."""
    folder = tmp_path_factory.mktemp("parity")
    mixed = {
        "z.weight": torch.arange(60, dtype=torch.float32).reshape(5, 12) / 7,
        "a.bias": torch.arange(6, dtype=torch.bfloat16),
        "m.ids": torch.arange(-4, 8, dtype=torch.int64).reshape(3, 4),
        "b.mask": torch.tensor([True, False, True]),
        "c.half": torch.linspace(-2, 2, 24, dtype=torch.float16).reshape(2, 3, 4),
        "e.empty": torch.zeros(0, 3),
        "s.scalar": torch.tensor(3.5),
    }
    paths = {"mixed": folder / "mixed.safetensors", "plain": folder / "plain.safetensors"}
    save_file(mixed, paths["mixed"], metadata={"format": "pt", "note": "parity"})
    save_file({"w": torch.arange(12.0).reshape(3, 4), "v": torch.ones(2)}, paths["plain"])
    return paths


def outcome(call):
    """("ok", value) or ("raised", exception type, message) of CALL."""
    try:
        return ("ok", call())
    except Exception as e:  # noqa: BLE001  (the exception is what is compared)
        return ("raised", type(e).__name__, str(e))


def same(got, want, what):
    assert type(got) is type(want), f"{what}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.device == want.device, what
        assert_bitwise_equal(got, want, what)
    elif isinstance(want, dict):
        assert list(got) == list(want), what
        for key in want:
            same(got[key], want[key], f"{what}[{key}]")
    else:
        assert got == want, what


def both(call):
    """CALL(opener) for safetensors and ckptfs: equal outcomes, values compared bitwise."""
    want, got = outcome(lambda: call(OPENERS["safetensors"])), outcome(lambda: call(OPENERS["ckptfs"]))
    assert got[0] == want[0], f"ckptfs {got}, safetensors {want}"
    if want[0] == "raised":
        assert got == want
    else:
        same(got[1], want[1], "value")
    return got


@pytest.mark.parametrize("name", ["mixed", "plain"])
@pytest.mark.parametrize("framework", ["pt", "torch"])
def test_listing_and_tensors_equal(written, name, framework):
    def read(opener):
        with opener(written[name], framework) as f:
            # safetensors' metadata is a hash map: its order is no part of what it says.
            metadata = f.metadata()
            return {"keys": f.keys(), "offset_keys": f.offset_keys(),
                    "metadata": (type(metadata).__name__, sorted((metadata or {}).items())),
                    "tensors": {k: f.get_tensor(k) for k in f.keys()}, "all": f.get_tensors(),
                    "shapes": {k: f.get_slice(k).get_shape() for k in f.keys()},
                    "dtypes": {k: f.get_slice(k).get_dtype() for k in f.keys()}}

    both(read)


@pytest.mark.parametrize("framework", ["np", "numpy"])
def test_numpy_frameworks_equal(written, framework):
    def read(opener):
        with opener(written["plain"], framework) as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
            return {k: (a.dtype.str, a.shape, a.tobytes()) for k, a in got.items()}, list(f.get_tensors())

    both(read)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_backends_and_devices_equal(written, backend, device):
    both(lambda opener: opener(written["mixed"], "pt", device, backend=backend).get_tensors())


@pytest.mark.parametrize("index", INDEXES + BAD_INDEXES, ids=repr)
def test_slices_equal(written, index):
    def read(opener):
        with opener(written["mixed"], "pt") as f:
            return f.get_slice("z.weight")[index]

    both(read)


# safetensors' numpy slices refuse more than torch's: an index or a slice's stop past the end
# (on any dimension, counted from either end), None, lists, floats; each with its own message.
NUMPY_INDEXES = [
    i for i in INDEXES + BAD_INDEXES if not isinstance(i, torch.Tensor)
] + [
    (slice(2, None), -6), (slice(2, None), 11), (slice(2, None), 12), slice(None, 20), (Ellipsis, 12), (Ellipsis, -13),
    (Ellipsis, -12), -5, -6, (1, 2, -9), slice(12, 15), slice(0, 20, 2), slice(5, 5), slice(4, 5),
    (slice(3, None, 2), slice(None, 13)), (slice(1, 3), 11, Ellipsis), (Ellipsis, Ellipsis), (None, 1), (1, None),
    (0, 1.5), [], (slice(None), []), 2**70, slice(None, None, 0), True, (1, -1), (-1, slice(2, 12, 3)),
]


@pytest.mark.parametrize("index", NUMPY_INDEXES, ids=repr)
def test_numpy_slices_equal(written, index):
    def read(opener):
        with opener(written["mixed"], "np") as f:
            array = f.get_slice("z.weight")[index]
            return (type(array).__name__, array.dtype.str, array.shape, array.tobytes())

    both(read)


def test_numpy_slice_out_of_range_is_safetensors_error(tmp_path):
    """safetensors' own test of numpy slices: [2:, -6] of a [10, 5] tensor."""
    import numpy as np
    from safetensors.numpy import save_file as save_numpy

    path = tmp_path / "a.safetensors"
    save_numpy({"a": np.arange(50, dtype=np.float32).reshape(10, 5)}, str(path))
    with ckptfs.safe_open(path, "np") as f:
        with pytest.raises(safetensors.SafetensorError) as raised:
            f.get_slice("a")[2:, -6]
    assert str(raised.value) == "Invalid index -6 for dimension 1 of size 5"
    assert np.array_equal(ckptfs.safe_open(path, "np").get_slice("a")[2:, -5], np.arange(50).reshape(10, 5)[2:, -5])


def test_slices_of_every_dtype_equal(written):
    def read(opener):
        with opener(written["mixed"], "pt") as f:
            return {k: f.get_slice(k)[1:] for k in f.keys() if f.get_slice(k).get_shape()}

    both(read)


@pytest.mark.parametrize("case", [
    lambda o, w: o(w / "missing.safetensors", "pt"),
    lambda o, w: o(w / "mixed.safetensors", "tf2"),
    lambda o, w: o(w / "mixed.safetensors", "pt", device="xyz"),
    lambda o, w: o(w / "mixed.safetensors", "pt", backend="foo"),
    lambda o, w: o(w / "mixed.safetensors", "np", device="cuda"),
    lambda o, w: o(w / "mixed.safetensors", "np", device="cuda:1"),
    lambda o, w: o(w / "mixed.safetensors", "pt").get_tensor("nope"),
    lambda o, w: o(w / "mixed.safetensors", "pt").get_slice("nope"),
], ids=["missing", "framework", "device", "backend", "numpy-cuda", "numpy-cuda1", "tensor", "slice"])
def test_errors_equal(written, case):
    got = both(lambda opener: case(opener, written["mixed"].parent))
    assert got[0] == "raised"


def test_errors_are_both_classes(written):
    with pytest.raises(safetensors.SafetensorError), ckptfs.safe_open(written["plain"], "pt") as f:
        f.get_tensor("nope")
    with pytest.raises(ckptfs.CkptfsError):
        ckptfs.safe_open(written["plain"], "pt").get_tensor("nope")


@pytest.mark.parametrize("call", [
    lambda f, s: f.keys(), lambda f, s: f.offset_keys(), lambda f, s: f.metadata(),
    lambda f, s: f.get_tensor("w"), lambda f, s: f.get_tensors(), lambda f, s: f.get_slice("w"),
    lambda f, s: s[1:], lambda f, s: s.get_shape(),
], ids=["keys", "offset_keys", "metadata", "get_tensor", "get_tensors", "get_slice", "slice-read", "slice-shape"])
def test_after_close_equal(written, call):
    def after_close(opener):
        with opener(written["plain"], "pt") as f:
            piece = f.get_slice("w")
        return call(f, piece)

    both(after_close)


# --- safetensors' and transformers' readers with ckptfs.safe_open patched in --------------


@pytest.fixture
def patched(monkeypatch):
    """safetensors.safe_open, as safetensors.torch and transformers use it, is ckptfs's."""
    import transformers.modeling_utils

    for module in (safetensors, safetensors.torch, transformers.modeling_utils):
        monkeypatch.setattr(module, "safe_open", ckptfs.safe_open)


@pytest.mark.parametrize("name", ["safetensors", "pt", "zero", "dcp-sample", "dcp-sharded"])
def test_safetensors_load_file_reads_every_format(patched, sources, name):
    """The references: safetensors for its files, torch.load for .pt, the fixture's
    zero_to_fp32 output for ZeRO, dcp_to_torch_save for DCP (tests/pypkg/conftest.py)."""
    source, reference = sources[name]
    got = safetensors.torch.load_file(source)
    assert list(got) == list(ckptfs.safe_open(source, "pt").offset_keys())
    assert set(got) == set(reference)
    for key, want in reference.items():
        assert_bitwise_equal(got[key], want, f"{name}[{key}]")
    mine = ckptfs.torch.load_file(source, backend="pread")
    for key, want in reference.items():
        assert_bitwise_equal(mine[key], want, f"ckptfs.torch {name}[{key}]")


def test_torch_load_of_bytes_equals_safetensors(written):
    data = written["mixed"].read_bytes()
    got, want = ckptfs.torch.load(data), safetensors.torch.load(data)
    # safetensors.torch.load's order is its header map's (by hash): ckptfs's is the file's.
    assert list(got) == ckptfs.safe_open(written["mixed"], "pt").offset_keys()
    same(dict(sorted(got.items())), dict(sorted(want.items())), "load(bytes)")


def test_from_pretrained_logits_identical(minilm_dir, tmp_path, monkeypatch):  # noqa: F811
    model, tokenizer = load_model(minilm_dir)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ids, want = encode(*load_model(tmp_path))
    import transformers.modeling_utils

    opened = []

    def counting_open(*args, **kwargs):
        opened.append(args[0])
        return ckptfs.safe_open(*args, **kwargs)

    for module in (safetensors, safetensors.torch, transformers.modeling_utils):
        monkeypatch.setattr(module, "safe_open", counting_open)
    got_ids, got = encode(*load_model(tmp_path))
    assert opened, "transformers read the weights through ckptfs.safe_open"
    assert torch.equal(got_ids, ids)
    assert torch.equal(got, want)


# --- F4 and F8_E8M0 ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed_file(tmp_path_factory):
    """A safetensors file with F4 (float4_e2m1fn_x2, two values a byte) and F8_E8M0 tensors,
    every byte value, as safetensors writes them; and {key: tensor}."""
    def every():
        return torch.arange(256, dtype=torch.uint8)

    state = {
        "f4": every().reshape(16, 16).view(torch.float4_e2m1fn_x2),
        "e8m0": every().view(torch.float8_e8m0fnu).reshape(4, 64),
        "plain": torch.arange(8, dtype=torch.float32),
    }
    path = tmp_path_factory.mktemp("packed") / "packed.safetensors"
    save_file(state, path)
    return path, state


def test_packed_dtypes_through_safe_open(packed_file):
    path, state = packed_file
    with safetensors.safe_open(path, "pt") as want, ckptfs.safe_open(path, "pt") as got:
        for key in state:
            assert got.get_slice(key).get_shape() == want.get_slice(key).get_shape()
            assert got.get_slice(key).get_dtype() == want.get_slice(key).get_dtype()
            same(got.get_tensor(key), want.get_tensor(key), key)
            assert_bitwise_equal(got.get_tensor(key), state[key], key)
        same(got.get_tensors(), want.get_tensors(), "get_tensors")
        assert_bitwise_equal(got.get_slice("f4")[3:5], state["f4"][3:5], "f4 rows")


def test_packed_dtypes_through_ls(packed_file):
    path, state = packed_file
    listed = subprocess.run([str(ckptfs.executable_path()), "ls", "--json", str(path)], capture_output=True,
                            text=True, timeout=60, check=True)
    got = {t["key"]: t for t in json.loads(listed.stdout)}
    assert (got["f4"]["dtype"], got["f4"]["torch_dtype"], got["f4"]["shape"]) == ("F4", "float4_e2m1fn_x2", [16, 32])
    assert (got["e8m0"]["dtype"], got["e8m0"]["torch_dtype"], got["e8m0"]["shape"]) == ("F8_E8M0", "float8_e8m0fnu",
                                                                                          [4, 64])
    assert got["f4"]["nbytes"] == 256


def test_packed_dtypes_through_the_mount(packed_file, requires_fuse):
    path, state = packed_file
    with ckptfs.mount(path) as mounted:
        with safetensors.safe_open(mounted / "model.safetensors", "pt") as f:
            for key, want in state.items():
                assert_bitwise_equal(f.get_tensor(key), want, key)


def test_dtype_option_refuses_f4_and_converts_e8m0_like_torch(packed_file, tmp_path):
    path, state = packed_file
    with pytest.raises(ckptfs.CkptfsError, match=r"tensor 'f4' is F4 .* no conversion to F32 \(torch has none either\)"):
        ckptfs.safe_open(path, "pt", dtype="fp32")
    with pytest.raises(NotImplementedError):  # torch's own refusal, which ckptfs's mirrors
        state["f4"].to(torch.float32)
    e8m0_only = tmp_path / "e8m0.safetensors"
    save_file({"e8m0": state["e8m0"]}, e8m0_only)
    with ckptfs.safe_open(e8m0_only, "pt", dtype="fp32") as f:
        assert_bitwise_equal(f.get_tensor("e8m0"), state["e8m0"].to(torch.float32), "e8m0 as Tensor.to")


def test_diff_compares_packed_bytes(packed_file, tmp_path):
    path, state = packed_file
    changed = dict(state)
    raw = state["f4"].view(torch.uint8).clone()
    raw[2, 5] ^= 0x11  # both float4 values of one byte
    changed["f4"] = raw.view(torch.float4_e2m1fn_x2)
    other = tmp_path / "changed.safetensors"
    save_file(changed, other)
    assert ckptfs.diff(path, path)["equal"]
    tensors = {t["key"]: t for t in ckptfs.diff(path, other)["tensors"]}
    assert tensors["f4"]["differing"] == 1
    assert tensors["e8m0"]["differing"] == 0


def test_numpy_of_a_dtype_numpy_lacks_says_how(written):
    with ckptfs.safe_open(written["mixed"], "np") as f:
        with pytest.raises(safetensors.SafetensorError, match=r'^numpy has no dtype for BF16: use framework="pt"'):
            f.get_tensor("a.bias")
        assert f.get_tensor("z.weight").dtype.str == "<f4"


def test_a_remote_source_is_the_librarys_to_find():
    # No local path check for a URL: the library's error names the source and the failure.
    with pytest.raises(ckptfs.SafetensorError, match=r"^http://127\.0\.0\.1:9/x\.safetensors: .*connect"):
        ckptfs.safe_open("http://127.0.0.1:9/x.safetensors", "pt")


def test_packed_dtypes_of_a_torch_save(packed_file, tmp_path):
    _, state = packed_file
    path = tmp_path / "packed.pt"
    torch.save(state, path)
    with ckptfs.safe_open(path, "pt") as f:
        assert f.get_slice("f4").get_shape() == [16, 32]  # served as safetensors counts: values
        for key, want in state.items():
            assert_bitwise_equal(f.get_tensor(key), want, key)
