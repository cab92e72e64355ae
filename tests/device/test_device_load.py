"""`ckptfs load` and `ckptfs.load()` against every source kind and every --dtype: the bytes
that reach the device are the View's bytes (`ckptfs cat SRC model.safetensors --dtype ...`,
loaded with safetensors), and the tensors equal torch's own (Tensor.to(dtype) for conversions).
Ring buffers of 4 KiB are far smaller than the largest tensors, and ZeRO tensors are split
across the rank files."""

import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import ckptfs
from ckptfs_testlib import assert_bitwise_equal, served_model_tensors
from device_sources import DTYPES, KINDS

# The whole suite drives libckptfs.so through the ckptfs package.
pytestmark = pytest.mark.loads_libckptfs

SOURCES = KINDS
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _dtype_args(dtype):
    return ["--dtype", dtype] if dtype else []


@pytest.fixture(scope="session")
def view_tensors(run_ckptfs, sources, tmp_path_factory):
    """view_tensors(name, dtype) -> {key: tensor} of the view's model file (or shards), by `ckptfs cat`."""
    cache = {}

    def get(name, dtype):
        if (name, dtype) not in cache:
            cache[name, dtype] = served_model_tensors(run_ckptfs, sources[name][0], *_dtype_args(dtype))
        return cache[name, dtype]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SOURCES)
def test_cli_host_backend_verifies(run_ckptfs, sources, name, dtype):
    result = run_ckptfs("load", "--backend", "host", "--verify", "--buffer-size", "4KiB", "--buffers", "3",
                        *_dtype_args(dtype), sources[name][0])
    out = result.stdout.decode()
    assert "verified" in out, out
    assert out.startswith("loaded "), out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SOURCES)
def test_python_load_equals_view(sources, view_tensors, name, dtype):
    want = view_tensors(name, dtype)
    # mmap=False: every tensor goes through the pipeline, none is mapped.
    got = ckptfs.load(sources[name][0], device="cpu", dtype=dtype, buffer_size=4096, buffers=2, io_threads=2,
                      mmap=False)
    assert set(got) == set(want), "keys differ from the view"
    for key, tensor in want.items():
        assert got[key].device.type == "cpu"
        assert_bitwise_equal(got[key], tensor, f"{name}[{key}] dtype={dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ("pt", "safetensors", "sharded"))
def test_python_load_equals_torch(sources, name, dtype):
    source, reference = sources[name]
    got = ckptfs.load(source, device="cpu", dtype=dtype, buffer_size=8192)
    assert set(got) == set(reference)
    for key, tensor in reference.items():
        want = tensor.contiguous()
        if dtype and want.is_floating_point():
            want = want.to(TORCH_DTYPE[dtype])
        assert_bitwise_equal(got[key], want, f"{name}[{key}] dtype={dtype}")


@pytest.mark.parametrize("name", ("zero2", "zero3", "dcp"))
def test_zero_tensors_span_rank_files(run_ckptfs, sources, view_tensors, name):
    """Several rank files back the ZeRO and DCP views; every buffer size gives the same bytes."""
    source = sources[name][0]
    info = run_ckptfs("info", source).stdout.decode()
    assert "rank" in info.lower() or "optim" in info.lower(), info
    want = view_tensors(name, None)
    for size in (4096, 12288, 1 << 20):
        got = ckptfs.load(source, device="cpu", buffer_size=size, buffers=1, mmap=False)
        for key, tensor in want.items():
            assert_bitwise_equal(got[key], tensor, f"{name}[{key}] buffer {size}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SOURCES)
def test_safe_open_equals_view(sources, view_tensors, name, dtype):
    """ckptfs.safe_open: whole tensors (maps of the file where stored as served, else the C
    API's ckptfs_read_tensor) and slices (byte ranges) are the View's bytes. tests/pypkg checks
    the same against each format's own library; this suite also runs under ASan."""
    want = view_tensors(name, dtype)
    with ckptfs.safe_open(sources[name][0], dtype=dtype) as f:
        assert f.keys() == sorted(want)
        for key, tensor in want.items():
            assert_bitwise_equal(f.get_tensor(key), tensor, f"{name}[{key}] dtype={dtype}")
            if tensor.dim():
                part = (slice(tensor.shape[0] // 3, None),) + (slice(None, None, 2),) * (tensor.dim() - 1)
                assert_bitwise_equal(f.get_slice(key)[part], tensor[part].contiguous(), f"{name}[{key}][{part}]")


def test_read_tensor_refuses_ranges_past_the_end(sources):
    import ctypes

    with ckptfs.safe_open(sources["pt"][0]) as f:
        source = f._source
        entry = source.tensors[0]
        out = ctypes.create_string_buffer(16)
        offsets, lengths = (ctypes.c_uint64 * 1)(entry["nbytes"] - 4), (ctypes.c_uint64 * 1)(8)
        assert source.lib.ckptfs_read_tensor(source.ptr, entry["index"], 1, offsets, lengths, out) == -1
        assert "past the tensor" in source.lib.ckptfs_last_error().decode()
        bad_index = (ctypes.c_uint64 * 1)(0)
        assert source.lib.ckptfs_read_tensor(source.ptr, 10**9, 1, bad_index, bad_index, out) == -1


def test_select(sources, view_tensors):
    got = ckptfs.load(sources["pt"][0], device="cpu", select=["model.big*", "model.ids"])
    assert set(got) == {"model.big", "model.big_t", "model.ids"}
    with pytest.raises(ckptfs.CkptfsError, match="nope"):
        ckptfs.load(sources["pt"][0], device="cpu", select="nope*")


def test_stats_and_verify(sources):
    ckptfs.load(sources["safetensors"][0], device="cpu", verify=True)
    stats = ckptfs.last_load_stats()
    assert stats["backend"] == "host"
    assert stats["bytes"] == sum(e["nbytes"] for e in ckptfs.list_tensors(sources["safetensors"][0]))
    assert stats["verified"] is True and stats["tensors"] > 0


def test_missing_source_one_line(run_ckptfs, tmp_path):
    result = run_ckptfs("load", "--backend", "host", tmp_path / "nope.pt", check=False)
    assert result.returncode == 1
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfs: "), lines
    with pytest.raises(ckptfs.CkptfsError):
        ckptfs.load(tmp_path / "nope.pt", device="cpu")


@pytest.mark.parametrize("backend", ("cuda", "auto", "cufile"))
def test_cli_without_gpu_says_so(run_ckptfs, sources, backend):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the no-GPU message cannot be checked here")
    result = run_ckptfs("load", "--backend", backend, sources["pt"][0], check=False)
    assert result.returncode == 1
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("ckptfs: no CUDA device: "), lines[0]
    assert result.stdout == b""


@pytest.mark.parametrize("backend", ("cuda", "auto"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SOURCES)
def test_gpu_load_equals_view(cuda_device, sources, view_tensors, name, dtype, backend):
    want = view_tensors(name, dtype)
    got = ckptfs.load(sources[name][0], device=cuda_device, dtype=dtype, backend=backend, buffer_size=4096, verify=True)
    for key, tensor in want.items():
        assert got[key].device.type == "cuda"
        assert_bitwise_equal(got[key].cpu(), tensor, f"{name}[{key}] on cuda dtype={dtype}")


def test_gpu_cli_load(cuda_device, run_ckptfs, sources):
    out = run_ckptfs("load", "--backend", "cuda", "--verify", sources["zero3"][0]).stdout.decode()
    assert "verified" in out
