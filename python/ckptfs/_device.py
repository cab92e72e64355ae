"""Tensors filled by libckptfs's load pipeline (ckptfs_load_into_stream), for ckptfs.load and
safe_open alike."""

from __future__ import annotations

import ctypes

from ._lib import last_error
from ._source import Source, options_json


def device_spec(device) -> str:
    """A device as torch names it: 0 -> "cuda:0", "cuda" -> "cuda", "cpu" -> "cpu"."""
    if isinstance(device, int):
        return f"cuda:{device}"
    return str(device)


def load_into_device(source: Source, entries: list, tensors: list, backend: str, device_index: int, stream,
                     load_options: dict) -> None:
    """Has libckptfs fill TENSORS (allocated, one per entry of ENTRIES) through its pipeline
    of bounded buffers: BACKEND "host" for CPU memory, else a CUDA back end."""
    ptrs, indices, sizes = [], [], []
    for entry, tensor in zip(entries, tensors):
        if entry["nbytes"]:
            ptrs.append(tensor.data_ptr())
            indices.append(entry["index"])
            sizes.append(entry["nbytes"])
    n = len(ptrs)
    rc = source.lib.ckptfs_load_into_stream(
        source._handle(), n, (ctypes.c_uint64 * n)(*indices), (ctypes.c_void_p * n)(*ptrs),
        (ctypes.c_uint64 * n)(*sizes), backend.encode(), int(device_index), stream, options_json(load_options),
    )
    if rc != 0:
        raise last_error()
