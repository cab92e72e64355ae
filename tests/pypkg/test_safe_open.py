"""ckptfs.safe_open and ckptfs.load against each format's own library: torch.load for .pt,
safetensors.safe_open for safetensors, DeepSpeed's zero_to_fp32 for ZeRO, dcp_to_torch_save
for DCP; key for key, byte for byte."""

import os

import pytest
import torch
from conftest import mapped_file
from safetensors import safe_open as reference_open

import ckptfs
from ckptfs_testlib import assert_bitwise_equal

FORMATS = ("pt", "safetensors", "zero", "dcp-sample", "dcp-sharded", "sample")


@pytest.mark.parametrize("name", FORMATS)
def test_safe_open_equals_reference(sources, name):
    source, reference = sources[name]
    with ckptfs.safe_open(source, framework="pt") as f:
        assert f.keys() == sorted(reference)
        assert set(f.offset_keys()) == set(reference)
        for key, want in reference.items():
            assert_bitwise_equal(f.get_tensor(key), want, f"{name}[{key}]")


def test_zero_order_is_zero_to_fp32s(sources):
    source, reference = sources["zero"]
    with ckptfs.safe_open(source) as f:
        assert f.offset_keys() == list(reference)


def test_safetensors_interface_matches(safetensors_source):
    with reference_open(safetensors_source, framework="pt") as want, ckptfs.safe_open(safetensors_source) as got:
        assert got.keys() == want.keys()
        assert got.metadata() == want.metadata()
        for key in want.keys():
            assert got.get_slice(key).get_shape() == want.get_slice(key).get_shape()
            assert got.get_slice(key).get_dtype() == want.get_slice(key).get_dtype()


@pytest.mark.parametrize("name", ("pt", "zero", "dcp-sharded"))
def test_dtype_converts_like_tensor_to(sources, name):
    source, reference = sources[name]
    with ckptfs.safe_open(source, dtype="bf16") as f:
        for key, want in reference.items():
            if want.is_floating_point():
                want = want.to(torch.bfloat16)
            assert_bitwise_equal(f.get_tensor(key), want, f"{name}[{key}] as bf16")


@pytest.mark.parametrize("name", ("pt", "zero", "dcp-sample"))
def test_numpy_framework_equals_reference(sources, name):
    source, reference = sources[name]
    with ckptfs.safe_open(source, framework="numpy") as f:
        for key, want in reference.items():
            if want.dtype == torch.bfloat16 or (want.is_floating_point() and want.element_size() == 1):
                with pytest.raises(ckptfs.CkptfsError, match="numpy has no dtype"):
                    f.get_tensor(key)
                continue
            got = f.get_tensor(key)
            assert list(got.shape) == list(want.shape), key
            assert got.tobytes() == want.detach().contiguous().numpy().tobytes(), f"{name}[{key}]"


def test_stored_tensors_are_views_of_the_file(sources):
    """On the CPU, a tensor stored as served is the file's own pages (no copy); others are
    filled by the library."""
    source, reference = sources["pt"]
    by_key = {e["key"]: e for e in ckptfs.list_tensors(source)}
    assert "extent" in by_key["model.embed.weight"] and "extent" not in by_key["model.proj.weight_t"]
    with ckptfs.safe_open(source) as f:
        mapped = f.get_tensor("model.embed.weight")
        copied = f.get_tensor("model.proj.weight_t")
    # Still valid after the source is closed.
    assert_bitwise_equal(mapped, reference["model.embed.weight"], "mapped")
    assert mapped_file(mapped.data_ptr()) == str(source.resolve())
    assert mapped_file(copied.data_ptr()) != str(source.resolve())
    # A private mapping: writing to the tensor never reaches the file.
    before = source.read_bytes()
    mapped.zero_()
    assert source.read_bytes() == before
    loaded = ckptfs.load(source, device="cpu")
    assert mapped_file(loaded["model.embed.weight"].data_ptr()) == str(source.resolve())
    assert_bitwise_equal(loaded["model.embed.weight"], reference["model.embed.weight"], "load")


@pytest.mark.parametrize("name", FORMATS)
def test_load_and_load_file_equal_reference(sources, name):
    source, reference = sources[name]
    for got in (ckptfs.load(source, device="cpu"), ckptfs.load_file(source), ckptfs.load(source, "cpu", mmap=False)):
        assert set(got) == set(reference)
        for key, want in reference.items():
            assert_bitwise_equal(got[key], want, f"{name}[{key}]")


def test_a_replaced_file_is_an_error_not_other_bytes(tmp_path, pt_source):
    source = tmp_path / "ck.pt"
    source.write_bytes(pt_source[0].read_bytes())
    with ckptfs.safe_open(source) as f:
        replacement = tmp_path / "other.pt"
        torch.save({"x": torch.zeros(3)}, replacement)
        replacement.rename(source)
        with pytest.raises(ckptfs.CkptfsError, match="ck.pt: file was replaced since it was indexed"):
            f.get_tensor("model.embed.weight")  # mapped
        with pytest.raises(ckptfs.CkptfsError):
            f.get_tensor("model.proj.weight_t")  # read by the library


def test_a_rewritten_file_is_an_error_not_other_bytes(tmp_path, pt_source):
    source = tmp_path / "ck.pt"
    source.write_bytes(pt_source[0].read_bytes())
    with ckptfs.safe_open(source) as f:
        stat = source.stat()
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        with pytest.raises(ckptfs.CkptfsError, match=r"ck.pt: file changed since it was indexed \(size, mtime"):
            f.get_tensor("model.embed.weight")  # mapped


def test_errors(tmp_path, sources):
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        ckptfs.safe_open(tmp_path / "nope.pt")
    with pytest.raises(ckptfs.CkptfsError, match="dtype"):
        ckptfs.safe_open(sources["pt"][0], dtype="int3")
    with ckptfs.safe_open(sources["pt"][0]) as f:
        with pytest.raises(ckptfs.SafetensorError, match="^File does not contain tensor nope$"):
            f.get_tensor("nope")
    with pytest.raises(ckptfs.SafetensorError, match="not supported for framework numpy"):
        ckptfs.safe_open(sources["pt"][0], framework="numpy", device="cuda:0")
