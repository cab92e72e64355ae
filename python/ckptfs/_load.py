"""load / load_file: every tensor of a checkpoint at once, on a GPU or the CPU."""

from __future__ import annotations

import os

from ._dtypes import torch_dtype, torch_shape
from ._device import device_spec, load_into_device
from ._source import Source, view_options


def list_tensors(source: str | os.PathLike, dtype=None, root: str | None = None, moments: bool = False) -> list[dict]:
    """[{index, key, dtype (safetensors name as served), shape, nbytes}] of SOURCE's view, in
    the checkpoint's order; "extent" where a tensor is one byte range of a file as stored."""
    with Source(source, view_options(dtype, root, moments=moments)) as opened:
        return opened.listed()


def load(source: str | os.PathLike, device: str | int = "cuda:0", dtype=None, select=None, backend: str = "auto",
         root: str | None = None, moments: bool = False, buffer_size=None, buffers=None, io_threads=None,
         direct_io=None, verify: bool = False, mmap: bool = True) -> dict:
    """Loads every tensor of a checkpoint (any source ckptfs reads) onto a device, without
    unpickling anything.

    Args:
        source (`str`, or `os.PathLike`):
            The checkpoint: a file or a folder.
        device (`str` or `int`, defaults to `"cuda:0"`):
            `"cuda:N"`, `N` or `"cpu"`.
        dtype (`str` or a torch dtype, *optional*):
            Converts every floating tensor: `"bf16"`, `"fp16"`, `"fp32"`, `torch.bfloat16`
            (bit-identical to `Tensor.to`).
        select (`str` or a list of them, *optional*):
            Keys or globs of the tensors to load (`"model.*"`).
        backend (`str`, defaults to `"auto"`):
            For CUDA devices: `"auto"` (cuFile, else pinned buffers), `"cuda"` or `"cufile"`.
            On the CPU, `"auto"` reads each tensor straight into place, `"host"` streams them
            through the ring of buffers that GPU loads use (so do its tuning options).
        root (`str`, *optional*), moments (`bool`):
            View options, as `safe_open` takes them.
        buffer_size, buffers, io_threads, direct_io:
            The ring of (pinned) buffers libckptfs streams through (`"16MiB"`, 4, 2, True).
        verify (`bool`):
            Re-reads every tensor and compares (every tensor is then loaded by the library).
        mmap (`bool`, defaults to `True`):
            On the CPU, tensors stored as served are views of a private memory map of their
            file, as `torch.load(mmap=True)` gives; `False` copies them too.

    Returns:
        (`Dict[str, torch.Tensor]`): the tensors, in the checkpoint's order. A bad source or
        option is a `CkptfsError` with ckptfs's one line.

    Tensors the library fills are allocated with `torch.empty` on the device and streamed
    from the source extents through bounded buffers (or cuFile), like safetensors'
    `load_file(path, device="cuda:0")`; nothing is unpickled and no host copy of the
    checkpoint is made. `last_load_stats()` describes that part of the load.
    """
    with Source(source, view_options(dtype, root, moments=moments)) as opened:
        return load_entries(opened, opened.select(select), device, backend, mmap, verify,
                            {"buffer_size": buffer_size, "buffers": buffers, "io_threads": io_threads,
                             "direct_io": None if direct_io is None else bool(direct_io)})


def load_entries(opened: Source, entries: list, device, backend: str = "auto", mmap: bool = True,
                 verify: bool = False, tuning: dict | None = None) -> dict:
    """ENTRIES of the open source OPENED as torch tensors on DEVICE, in one pass: load()'s
    body, which safe_open's get_tensors() shares. TUNING: the pipeline's buffer_size,
    buffers, io_threads, direct_io (None where not given)."""
    import torch

    tuning = tuning or {}
    dev = torch.device(device_spec(device))
    if dev.type == "cpu":
        backend_name, index = "host", 0
    elif dev.type == "cuda":
        if backend == "host":
            raise ValueError("backend 'host' loads into CPU memory: use device='cpu'")
        backend_name = backend
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    else:
        raise ValueError(f"device must be cuda[:N] or cpu, not {device!r}")
    # Checked by the library (its option table), as `ckptfs load` checks its flags.
    load_options = {"verify": bool(verify), **tuning}
    map_stored = dev.type == "cpu" and mmap and not verify
    # On the CPU the pipeline (a ring of buffers, worker copies, O_DIRECT) only adds a copy:
    # tensors are read straight into place unless it is asked for by its options.
    pipeline = dev.type == "cuda" or backend == "host" or verify or any(v is not None for v in tuning.values())

    # Tensors split over several files (ZeRO-3) are composed of maps of those files'
    # pages: a copy into new memory costs several times more (a zeroed page and a fault
    # per 4 KiB), see tests/bench/README.md. The tensors read beside them go into the
    # same region, in the same library call.
    in_region = map_stored and not pipeline and any(e["cpu"] == "region" for e in entries)
    out, filled, tensors, composed = {}, [], [], []
    for entry in entries:
        if map_stored and opened.maps_file(entry):
            out[entry["key"]] = opened.mapped_torch(entry)
            continue
        if in_region:
            out[entry["key"]] = None  # keeps the checkpoint's order; set below
            composed.append(entry)
            continue
        tensor = torch.empty(torch_shape(entry), dtype=torch_dtype(entry), device=dev)
        out[entry["key"]] = tensor
        filled.append(entry)
        tensors.append(tensor)
    for entry, tensor in zip(composed, opened.load_mapped_torch(composed)):
        out[entry["key"]] = tensor
    if not pipeline:
        _read_into(opened, filled, tensors)
        return out
    # torch.empty's memory may still be in use by kernels queued on the current stream
    # (the caching allocator reuses blocks in stream order): the load waits for them. It
    # returns with every write completed, so later work on that stream sees the data.
    stream = torch.cuda.current_stream(index).cuda_stream if dev.type == "cuda" else None
    load_into_device(opened, filled, tensors, backend_name, index, stream, load_options)
    return out


# Threads reading tensors into CPU memory at once: each ckptfs_read_tensor call preads (and
# converts) outside the GIL, so two keep two cores busy with conversions.
_READ_THREADS = 2


def _read_into(opened: Source, entries: list, tensors: list) -> None:
    """Fills CPU TENSORS with ENTRIES' bytes as served: buffered preads straight into place
    (conversions through the library's small per-thread scratch), largest first."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = sorted(zip(entries, tensors), key=lambda job: -job[0]["nbytes"])
    if len(jobs) < 2:
        for entry, tensor in jobs:
            opened.read_whole(entry, tensor.data_ptr())
        return
    with ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
        for done in [pool.submit(opened.read_whole, entry, tensor.data_ptr()) for entry, tensor in jobs]:
            done.result()


def load_file(filename: str | os.PathLike, device: str | int = "cpu", *, dtype=None, root: str | None = None,
              select=None, **options) -> dict:
    """Loads a checkpoint into torch tensors: safetensors' `load_file` with its argument
    names, for every source ckptfs reads.

    Args:
        filename (`str`, or `os.PathLike`):
            The checkpoint: a file or a folder.
        device (`str` or `int`, defaults to `"cpu"`):
            The device where the tensors need to be located after load.
        dtype, root, select, **options:
            As `ckptfs.load` takes them.

    Returns:
        (`Dict[str, torch.Tensor]`): dictionary that contains name as key, value as `torch.Tensor`

    Example:
    ```python
    from ckptfs import load_file

    loaded = load_file("checkpoints/global_step100", dtype="bf16")
    ```
    """
    return load(filename, device=device, dtype=dtype, root=root, select=select, **options)
