"""safe_open: the interface of safetensors' safe_open for every checkpoint ckptfs reads."""

from __future__ import annotations

import ctypes
import operator
import os
from typing import Any, Iterator, Sequence

from ._dtypes import numpy_dtype, torch_dtype
from ._lib import CkptfsError, last_error
from ._source import Source, options_json, view_options

FRAMEWORKS = ("pt", "torch", "numpy", "np")


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


def slice_plan(shape: Sequence[int], item: int, index) -> tuple[Any, Any, list[int]]:
    """The byte ranges (offsets, lengths: numpy uint64 arrays, in row-major order of the
    result) of a row-major tensor of SHAPE and element size ITEM that INDEX (integers,
    slices with positive steps, one Ellipsis) selects, and the result's shape. Whole trailing
    dimensions and the first partly selected one with step 1 form one run, so a slice is
    read in as few ranges as its layout allows and no byte outside it is read."""
    import numpy as np

    index = index if isinstance(index, tuple) else (index,)
    if sum(1 for i in index if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1:]
    if len(index) > len(shape):
        raise IndexError(f"too many indices: {len(index)} for a tensor of {len(shape)} dimensions")
    index = index + (slice(None),) * (len(shape) - len(index))

    picks = []  # per dimension: (first, count, step, kept in the result)
    for dim, (i, size) in enumerate(zip(index, shape)):
        if isinstance(i, slice):
            start, stop, step = i.indices(size)
            if step <= 0:
                raise ValueError("slice steps must be positive")
            picks.append((start, len(range(start, stop, step)), step, True))
            continue
        try:
            k = operator.index(i)
        except TypeError:
            raise TypeError(f"unsupported index {i!r}: use integers, slices and '...'") from None
        if not -size <= k < size:
            raise IndexError(f"index {k} is out of bounds for dimension {dim} with size {size}")
        picks.append((k % size, 1, 1, False))
    out_shape = [count for _, count, _, kept in picks if kept]
    if any(count == 0 for _, count, _, _ in picks):
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64), out_shape

    strides, step_bytes = [0] * len(shape), item
    for dim in reversed(range(len(shape))):
        strides[dim] = step_bytes
        step_bytes *= shape[dim]
    run, dim = item, len(shape) - 1
    while dim >= 0 and picks[dim][:3] == (0, shape[dim], 1):
        run *= shape[dim]
        dim -= 1
    offsets = np.zeros(1, np.uint64)
    if dim >= 0 and picks[dim][2] == 1:  # a contiguous part of this dimension: one run
        run *= picks[dim][1]
        offsets += np.uint64(picks[dim][0] * strides[dim])
        dim -= 1
    for outer in range(dim + 1):
        first, count, step, _ = picks[outer]
        positions = (first + step * np.arange(count, dtype=np.uint64)) * np.uint64(strides[outer])
        offsets = (offsets[:, None] + positions[None, :]).reshape(-1)
    return offsets, np.full(len(offsets), run, np.uint64), out_shape


class safe_open:
    """Opens a checkpoint lazily and returns tensors as asked, like safetensors' safe_open, for
    every source ckptfs reads: torch .pt/.bin, safetensors files and folders, DeepSpeed ZeRO
    folders, torch.distributed.checkpoint folders.

    Args:
        source (`str`, or `os.PathLike`):
            The checkpoint: a file or a folder.
        framework (`str`, defaults to `"pt"`):
            `"pt"` (torch tensors) or `"numpy"` (numpy arrays; torch is never imported).
        device (`str` or `int`, defaults to `"cpu"`):
            Where tensors go: `"cpu"`, `"cuda"`, `"cuda:N"` or `N` (framework `"pt"` only).
        dtype (`str` or a torch dtype, *optional*):
            Converts every floating tensor on read: `"bf16"`, `"fp16"`, `"fp32"`,
            `torch.bfloat16`... (bit-identical to `Tensor.to`).
        root (`str`, *optional*):
            Serves only the tensors under this key prefix, prefix removed (`"model"`).
        **options:
            Any other source option of ckptfs (`moments=True` for ZeRO Adam moments,
            `max_pickle="4GiB"`...): the names of `ckptfs.option_table()`.

    On the CPU, a tensor whose bytes are stored in the source as served (one byte range, no
    conversion) is a view of a private memory map of its file, as `torch.load(mmap=True)`
    gives: nothing is read until it is touched, and writes to it never reach the file. Other
    tensors are read by libckptfs into a new tensor.

    Example:
    ```python
    import ckptfs

    with ckptfs.safe_open("checkpoints/global_step100", framework="pt") as f:
        for key in f.keys():
            tensor = f.get_tensor(key)
        rows = f.get_slice("embed.weight")[:1024]
    ```
    """

    def __init__(self, source: str | os.PathLike, framework: str = "pt", device: str | int = "cpu",
                 dtype=None, root: str | None = None, **options):
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, not {framework!r}")
        self._framework = "numpy" if framework in ("numpy", "np") else "pt"
        self._device = device_spec(device)
        if self._framework == "numpy" and self._device != "cpu":
            raise ValueError(f"framework 'numpy' holds tensors on the CPU only, not {self._device!r}")
        self._source = Source(source, view_options(dtype, root, **options))

    # --- the context manager ------------------------------------------------------------

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Releases the checkpoint. Tensors already returned stay valid."""
        self._source.close()

    # --- what it holds ------------------------------------------------------------------

    def keys(self) -> list[str]:
        """The tensor names, sorted (as safetensors' keys() returns them)."""
        return sorted(self._source.by_key)

    def offset_keys(self) -> list[str]:
        """The tensor names in the checkpoint's order (the order of model.safetensors)."""
        return [t["key"] for t in self._source.tensors]

    def metadata(self) -> dict:
        """The checkpoint's non-tensor values, as metadata.json serves them: for a
        safetensors file its `__metadata__` (str -> str), for a training checkpoint the
        epoch, optimizer settings and the like."""
        return self._source.metadata()

    # --- tensors ------------------------------------------------------------------------

    def get_tensor(self, name: str):
        """Returns a full tensor.

        Args:
            name (`str`): the name of the tensor you want.

        Returns:
            (`torch.Tensor` or `numpy.ndarray`): the tensor in the framework you opened the
            source for, on its device.
        """
        entry = self._source.entry(name)
        if self._device == "cpu" and self._source.maps_file(entry):
            if self._framework == "numpy":
                return self._source.mapped_numpy(entry)
            return self._source.mapped_torch(entry)
        if self._device == "cpu" and self._framework == "pt" and entry["cpu"] == "region":
            # Split over files (ZeRO-3): maps of those files where their pages line up.
            return self._source.load_mapped_torch([entry])[0]
        if self._framework == "numpy":
            import numpy as np

            array = np.empty(entry["shape"], numpy_dtype(entry))
            self._source.read_whole(entry, array.ctypes.data)
            return array
        import torch

        device = torch.device(self._device)
        tensor = torch.empty(entry["shape"], dtype=torch_dtype(entry), device=device)
        if device.type == "cpu":
            self._source.read_whole(entry, tensor.data_ptr())
        else:
            index = device.index if device.index is not None else torch.cuda.current_device()
            stream = torch.cuda.current_stream(index).cuda_stream
            load_into_device(self._source, [entry], [tensor], "auto", index, stream, {})
        return tensor

    def get_slice(self, name: str) -> "TensorSlice":
        """Returns a slice view object: index it (`[:, ::8]`, `[3]`, `[..., :4]`) to read that
        part only.

        Args:
            name (`str`): the name of the tensor you want.

        Returns:
            (`TensorSlice`): an object you can slice into to get a real tensor; only the
            bytes of the slice are read (for a converted tensor, the stored elements they
            convert from).
        """
        return TensorSlice(self, self._source.entry(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._source.tensors)


class TensorSlice:
    """One tensor of a safe_open source, read only as far as it is indexed."""

    def __init__(self, opened: safe_open, entry: dict):
        self._opened = opened
        self._entry = entry

    def get_shape(self) -> list[int]:
        """The tensor's shape, as served."""
        return list(self._entry["shape"])

    def get_dtype(self) -> str:
        """The tensor's dtype as safetensors names it ("F32", "BF16", ...), as served."""
        return self._entry["dtype"]

    def __getitem__(self, index):
        entry, opened = self._entry, self._opened
        offsets, lengths, shape = slice_plan(entry["shape"], entry["itemsize"], index)
        if opened._framework == "numpy":
            import numpy as np

            out = np.empty(shape, numpy_dtype(entry))
            address = out.ctypes.data
        else:
            import torch

            out = torch.empty(shape, dtype=torch_dtype(entry))
            address = out.data_ptr()
        if len(offsets):
            opened._source.read(entry["index"], offsets, lengths, address)
        if opened._framework == "pt" and opened._device != "cpu":
            out = out.to(opened._device)
        return out


__all__ = ["safe_open", "TensorSlice", "CkptfsError"]
