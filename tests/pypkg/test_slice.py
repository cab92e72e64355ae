"""get_slice: the same values as indexing the whole tensor (and as safetensors' get_slice),
reading only the bytes of the slice, counted by the kernel (/proc/self/io rchar)."""

import pytest
import torch
from conftest import read_io_counter
from safetensors import safe_open as reference_open

import ckptfs
from ckptfs_testlib import assert_bitwise_equal

INDEXES = [
    (slice(None),),
    (3,),
    (-1,),
    (slice(10, 20),),
    (slice(10, 20), slice(5, 9)),
    (slice(None), 7),
    (slice(1, None, 3), slice(None, None, 5)),
    (Ellipsis, slice(2, 4)),
    (4, Ellipsis),
    (slice(5, 5),),
    (slice(-4, None), slice(None, -90)),
]


@pytest.mark.parametrize("framework", ("pt", "numpy"))
@pytest.mark.parametrize("index", INDEXES, ids=str)
def test_slice_equals_indexing(sources, framework, index):
    source, reference = sources["pt"]
    want = reference["model.embed.weight"][index]
    with ckptfs.safe_open(source, framework=framework) as f:
        got = f.get_slice("model.embed.weight")[index]
    if framework == "numpy":
        got = torch.from_numpy(got)
    assert_bitwise_equal(got, want.contiguous(), f"[{index}]")


@pytest.mark.parametrize("key", ("proj.weight_t", "ids", "mask", "half", "norm.weight"))
def test_slices_of_every_layout_and_dtype(sources, key):
    source, reference = sources["pt"]
    want = reference[key if key in reference else f"model.{key}"]
    name = key if key in reference else f"model.{key}"
    with ckptfs.safe_open(source) as f:
        for index in ((slice(1, 3),), (Ellipsis, slice(None, None, 2)), (0,)):
            assert_bitwise_equal(f.get_slice(name)[index], want[index].contiguous(), f"{name}[{index}]")


@pytest.mark.parametrize("name", ("zero", "dcp-sharded"))
def test_slices_of_sharded_tensors(sources, name):
    """Tensors whose bytes lie in several rank files (ZeRO partitions, DCP chunks)."""
    source, reference = sources[name]
    with ckptfs.safe_open(source) as f:
        for key, want in reference.items():
            if want.dim() == 0:
                continue
            half = (slice(want.shape[0] // 3, None),)
            assert_bitwise_equal(f.get_slice(key)[half], want[half].contiguous(), f"{name}[{key}]")


def test_slice_equals_safetensors_get_slice(safetensors_source):
    with reference_open(safetensors_source, framework="pt") as want, ckptfs.safe_open(safetensors_source) as got:
        for index in ((slice(2, 7), slice(None, None, 4)), (slice(None), 3), (Ellipsis,)):
            assert_bitwise_equal(got.get_slice("model.embed.weight")[index],
                                 want.get_slice("model.embed.weight")[index], f"[{index}]")


def counted_around(call) -> int:
    before = read_io_counter()
    call()
    return read_io_counter() - before


def bytes_read_by(read) -> int:
    """What READ() made this process read through read/pread calls, after a first call that
    loads whatever it imports lazily, less what reading the counter itself adds (reading
    /proc/self/io is a read too)."""
    read()
    return counted_around(read) - counted_around(lambda: None)


@pytest.mark.parametrize("dtype,stored_per_served", ((None, 1), ("bf16", 2)))
def test_slice_reads_only_its_bytes(sources, dtype, stored_per_served):
    """A slice of a 300 x 96 fp32 tensor reads its own bytes, no more: rows 100-109 (one run),
    a column block (one run per row), every 7th row. With dtype=bf16 the library reads the
    fp32 elements it converts: twice the bytes served."""
    source, _ = sources["pt"]
    with ckptfs.safe_open(source, dtype=dtype) as f:
        tensor = f.get_slice("model.embed.weight")
        itemsize = 4 // stored_per_served
        whole = 300 * 96 * itemsize * stored_per_served
        for index, served in (((slice(100, 110),), 10 * 96 * itemsize),
                              ((slice(None), slice(8, 24)), 300 * 16 * itemsize),
                              ((slice(None, None, 7), slice(0, 4)), 43 * 4 * itemsize)):
            read = bytes_read_by(lambda: tensor[index])
            assert read == served * stored_per_served, f"[{index}]: read {read} bytes for a slice of {served}"
            assert read < whole
