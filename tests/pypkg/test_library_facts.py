"""What the package takes from libckptfs instead of knowing it itself: the tensors a selection
names, each tensor's torch dtype and item size, how a CPU load places it, and the load
statistics, whose keys are those of `ckptfs load --json`."""

import json
import subprocess

import pytest
import torch
from safetensors import safe_open as reference_open

import ckptfs
from ckptfs._source import Source


def test_select_takes_keys_and_globs_in_checkpoint_order(sources):
    source, reference = sources["pt"]
    keys = list(reference)
    got = ckptfs.load(source, device="cpu", select=["model.proj.*", keys[0]])
    assert list(got) == [k for k in keys if k == keys[0] or k.startswith("model.proj.")]
    assert list(ckptfs.load(source, device="cpu", select="ids")) == ["ids"]
    assert ckptfs.load(source, device="cpu", select=[]) == {}
    with pytest.raises(ckptfs.CkptfsError, match=r"^model\.nope\*: no tensor of .*mixed\.pt matches"):
        ckptfs.load(source, device="cpu", select=["ids", "model.nope*"])


def test_dtypes_and_item_sizes_are_the_reference_tensors(safetensors_source):
    with reference_open(safetensors_source, framework="pt") as f, Source(safetensors_source, {}) as opened:
        assert len(opened.tensors) == len(f.keys())
        for entry in opened.tensors:
            want = f.get_slice(entry["key"])
            dtype = f.get_tensor(entry["key"]).dtype
            assert entry["dtype"] == want.get_dtype(), entry["key"]
            assert getattr(torch, entry["torch_dtype"]) == dtype, entry["key"]
            assert entry["itemsize"] == dtype.itemsize, entry["key"]


def test_cpu_placement_is_the_librarys(sources):
    """A tensor stored as served is a file map, a ZeRO tensor split over rank files a region,
    a gathered one a copy; list_tensors shows the listing only."""
    with Source(sources["pt"][0], {}) as opened:
        assert opened.by_key["model.embed.weight"]["cpu"] == "file_map"
        assert opened.by_key["model.proj.weight_t"]["cpu"] == "copy"
    listed = ckptfs.list_tensors(sources["pt"][0])
    assert all(set(e) <= {"index", "key", "dtype", "shape", "nbytes", "extent", "maps"} for e in listed)
    with Source(sources["zero"][0], {}) as opened:
        assert all(("maps" in e) == (e["cpu"] == "region") for e in opened.tensors)
        assert all(("extent" in e) >= (e["cpu"] == "file_map") for e in opened.tensors)


def test_load_statistics_have_the_keys_of_ckptfs_load_json(sources):
    source = sources["safetensors"][0]
    run = subprocess.run([str(ckptfs.executable_path()), "load", "--backend", "host", "--json", str(source)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    printed = json.loads(run.stdout.strip().splitlines()[-1])
    ckptfs.load(source, device="cpu", backend="host", mmap=False)
    piped = ckptfs.last_load_stats()
    assert set(piped) == set(printed)
    # The same bytes; the package hands the library no empty tensors, so the counts may differ.
    for key in ("backend", "device", "bytes", "verified"):
        assert piped[key] == printed[key], key
    with Source(source, {}) as opened:
        opened.load_mapped_torch(opened.tensors)  # the call of ckptfs.load for ZeRO-3 tensors
    mapped = ckptfs.last_load_stats()
    assert mapped["backend"] == "map"
    assert set(mapped) == set(printed) | {"mapped_bytes", "maps"}
    assert mapped["bytes_read"] + mapped["mapped_bytes"] == mapped["bytes"]
