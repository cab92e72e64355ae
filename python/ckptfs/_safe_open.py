"""safe_open: the interface of safetensors' safe_open for every checkpoint ckptfs reads."""

from __future__ import annotations

import operator
import os
from typing import Any, Iterator, Sequence

from ._device import device_spec, load_into_device
from ._dtypes import numpy_dtype, torch_dtype, torch_shape
from ._lib import CkptfsError, SafetensorError
from ._load import load_entries
from ._source import Source, view_options

FRAMEWORKS = ("pt", "torch", "numpy", "np")
BACKENDS = ("mmap", "pread")
# The device names safetensors' safe_open accepts, each alone or with ":N".
_DEVICE_TYPES = ("cpu", "cuda", "mps", "npu", "xpu", "xla", "mlu", "hpu", "musa")


def checked_device(device) -> str:
    """DEVICE (a string, an int or a torch.device) as torch names it, or safetensors' error
    for one it does not take."""
    if isinstance(device, bool):
        raise SafetensorError(f"device {device} is invalid")
    text = device_spec(device)
    kind, _, number = text.partition(":")
    if kind not in _DEVICE_TYPES or (number and not number.isdigit()) or (kind == "cpu" and number):
        raise SafetensorError(f"device {text} is invalid")
    return text


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
        raise IndexError(f"too many indices for tensor of dimension {len(shape)}")
    index = index + (slice(None),) * (len(shape) - len(index))

    picks = []  # per dimension: (first, count, step, kept in the result)
    for dim, (i, size) in enumerate(zip(index, shape)):
        if isinstance(i, slice):
            start, stop, step = i.indices(size)
            if step <= 0:
                raise ValueError("step must be greater than zero")
            picks.append((start, len(range(start, stop, step)), step, True))
            continue
        try:
            k = operator.index(i)
        except TypeError:
            raise IndexError("only integers, slices (`:`), ellipsis (`...`), None and long or byte Variables are "
                             f"valid indices (got {type(i).__name__})") from None
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


def numpy_index(shape: Sequence[int], index) -> tuple:
    """INDEX on a tensor of SHAPE as safetensors' numpy framework reads it: integers (negative
    ones counted from the end), slices with positive steps and one Ellipsis; anything else,
    and any index outside the tensor, raises SafetensorError with safetensors' own message.
    Unlike numpy, a slice's stop past the end is an error there too. Returns the index with
    every integer made non-negative and the Ellipsis expanded, for slice_plan."""
    index = index if isinstance(index, tuple) else (index,)
    if sum(1 for i in index if i is Ellipsis) > 1:
        raise SafetensorError("Only one ellipsis (...) is allowed in slice index")
    expanded, ndim = [], len(shape)
    for position, i in enumerate(index):
        if i is Ellipsis:
            expanded += [slice(None)] * max(ndim - (len(index) - 1), 0)
            continue
        if isinstance(i, slice):
            if i.step is not None and operator.index(i.step) <= 0:
                raise SafetensorError(f"Slice step must be a positive integer, got {i.step}")
            expanded.append(i)
            continue
        try:
            k = operator.index(i)
        except TypeError:
            k = None
        if k is None or not -2**63 <= k < 2**63:
            raise SafetensorError(f"Unsupported slice index at position {position}: expected slice, int, or ellipsis")
        dim = len(expanded)
        size = shape[dim] if dim < ndim else 0
        if k < 0:
            if k < -size:
                raise SafetensorError(f"Invalid index {k} for dimension {dim} of size {size}")
            k += size
        expanded.append(k)

    def text(i) -> str:
        if not isinstance(i, slice):
            return str(i)
        part = lambda v: "" if v is None else str(v)  # noqa: E731
        return f"{part(i.start)}:{part(i.stop)}" + ("" if i.step is None else f":{i.step}")

    def failure(why: str) -> SafetensorError:
        return SafetensorError(f"Error during slicing [{', '.join(map(text, expanded))}] with shape "
                               f"[{', '.join(map(str, shape))}]: {why}")

    if len(expanded) > ndim:
        raise failure("more slicing indexes than dimensions in tensor")
    for dim, (i, size) in enumerate(zip(expanded, shape)):
        if isinstance(i, slice):
            start, stop = i.start, i.stop
            # A negative bound keeps Python's meaning (safetensors fails to convert it).
            start = 0 if start is None else operator.index(start)
            stop = size if stop is None else operator.index(stop)
            if start >= size:
                bad = start
            elif stop > size:
                bad = stop - 1
            else:
                continue
        elif i >= size:
            bad = i
        else:
            continue
        raise failure(f"index {bad} out of bounds for tensor dimension #{dim} of size {size}")
    return tuple(expanded)


class safe_open:
    """Opens a checkpoint lazily and returns tensors as asked: safetensors' safe_open (its
    arguments, methods, errors and behaviour after close), for every source ckptfs reads:
    torch .pt/.bin, safetensors files and folders, DeepSpeed ZeRO folders,
    torch.distributed.checkpoint folders.

    Args:
        filename (`str`, or `os.PathLike`):
            The checkpoint: a file or a folder.
        framework (`str`, defaults to `"pt"`):
            `"pt"`/`"torch"` (torch tensors) or `"np"`/`"numpy"` (numpy arrays; torch is
            never imported).
        device (`str`, `int` or `torch.device`, defaults to `"cpu"`):
            Where tensors go: `"cpu"`, `"cuda"`, `"cuda:N"`, `N` (framework `"pt"` only).
        backend (`str`, *keyword-only*, defaults to `"mmap"`):
            How tensors stored as served reach a CPU tensor: `"mmap"`, a view of a private
            map of their file; `"pread"`, read into new memory. Other tensors are always
            read (and converted) by libckptfs.
        dtype (`str` or a torch dtype, *keyword-only*):
            Converts every floating tensor on read: `"bf16"`, `"fp16"`, `"fp32"`,
            `torch.bfloat16`... (bit-identical to `Tensor.to`).
        root (`str`, *keyword-only*):
            Serves only the tensors under this key prefix, prefix removed (`"model"`).
        **options:
            Any other source option of ckptfs (`moments=True` for ZeRO Adam moments,
            `max_pickle="4GiB"`...): the names of `ckptfs.option_table()`.

    Errors are safetensors': a missing path is `FileNotFoundError("No such file or
    directory: NAME")`, the rest `ckptfs.SafetensorError` (a `CkptfsError`, and a
    `safetensors.SafetensorError` where safetensors is installed).

    Example:
    ```python
    import ckptfs

    with ckptfs.safe_open("checkpoints/global_step100", framework="pt") as f:
        for key in f.keys():
            tensor = f.get_tensor(key)
        rows = f.get_slice("embed.weight")[:1024]
    ```
    """

    def __init__(self, filename: str | os.PathLike, framework: str = "pt", device="cpu", *, backend: str = "mmap",
                 dtype=None, root: str | None = None, **options):
        self._source = None
        if framework not in FRAMEWORKS:
            raise SafetensorError(f"framework {framework} is invalid")
        self._framework = "numpy" if framework in ("numpy", "np") else "pt"
        self._device = checked_device(device)
        if backend not in BACKENDS:
            raise SafetensorError(f'backend "{backend}" is invalid (expected one of: "mmap", "pread")')
        self._map = backend == "mmap"
        if self._framework == "numpy" and self._device != "cpu":
            shown = "cuda:0" if self._device == "cuda" else self._device
            raise SafetensorError(f"Device {shown} is not supported for framework numpy")
        name = os.fspath(filename)
        # Remote sources (http://, https://, s3://) are libckptfs's to find.
        if "://" not in str(name) and not os.path.exists(name):
            raise FileNotFoundError(f"No such file or directory: {name}")
        self._source = Source(filename, view_options(dtype, root, **options))

    # --- the context manager ------------------------------------------------------------

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Releases the checkpoint: every method but a slice's then raises "File is closed".
        Tensors and slices already returned stay valid (a slice keeps the source open)."""
        self._source = None

    def _open(self) -> Source:
        if self._source is None:
            raise SafetensorError("File is closed")
        return self._source

    # --- what it holds ------------------------------------------------------------------

    def keys(self) -> list[str]:
        """The tensor names, sorted (as safetensors' keys() returns them)."""
        return sorted(self._open().by_key)

    def offset_keys(self) -> list[str]:
        """The tensor names in the checkpoint's order (the order of model.safetensors)."""
        return [t["key"] for t in self._open().tensors]

    def metadata(self) -> dict | None:
        """The checkpoint's non-tensor values, as metadata.json serves them: for a
        safetensors file its `__metadata__` (str -> str), for a training checkpoint the
        epoch, optimizer settings and the like; None where there are none, as safetensors
        returns for a file without `__metadata__`."""
        return self._open().metadata() or None

    # --- tensors ------------------------------------------------------------------------

    def _entry(self, name: str) -> dict:
        source = self._open()
        if name not in source.by_key:
            raise SafetensorError(f"File does not contain tensor {name}")
        return source.by_key[name]

    def get_tensor(self, name: str):
        """Returns a full tensor.

        Args:
            name (`str`): the name of the tensor you want.

        Returns:
            (`torch.Tensor` or `numpy.ndarray`): the tensor in the framework you opened the
            source for, on its device.
        """
        entry = self._entry(name)
        source = self._source
        if self._device == "cpu" and self._map and source.maps_file(entry):
            if self._framework == "numpy":
                return source.mapped_numpy(entry)
            return source.mapped_torch(entry)
        if self._device == "cpu" and self._map and self._framework == "pt" and entry["cpu"] == "region":
            # Split over files (ZeRO-3): maps of those files where their pages line up.
            return source.load_mapped_torch([entry])[0]
        if self._framework == "numpy":
            import numpy as np

            array = np.empty(entry["shape"], numpy_dtype(entry))
            source.read_whole(entry, array.ctypes.data)
            return array
        import torch

        device = torch.device(self._device)
        tensor = torch.empty(torch_shape(entry), dtype=torch_dtype(entry), device=device)
        if device.type == "cpu":
            source.read_whole(entry, tensor.data_ptr())
        else:
            index = device.index if device.index is not None else torch.cuda.current_device()
            stream = torch.cuda.current_stream(index).cuda_stream
            load_into_device(source, [entry], [tensor], "auto", index, stream, {})
        return tensor

    def get_tensors(self) -> dict:
        """Every tensor, {name: tensor} in offset_keys() order, in one call: for torch through
        the library's bulk load (ckptfs.load's path: maps where stored as served, one pass
        of the pipeline for the rest)."""
        source = self._open()
        if self._framework == "numpy":
            return {t["key"]: self.get_tensor(t["key"]) for t in source.tensors}
        return load_entries(source, list(source.tensors), self._device, mmap=self._map)

    def get_slice(self, name: str) -> "TensorSlice":
        """Returns a slice view object: index it (`[:, ::8]`, `[3]`, `[..., :4]`, `[None]`,
        `[[0, 2]]`) to read that part only.

        Args:
            name (`str`): the name of the tensor you want.

        Returns:
            (`TensorSlice`): an object you can slice into to get a real tensor; only the
            bytes of the slice are read (for a converted tensor, the stored elements they
            convert from).
        """
        return TensorSlice(self, self._entry(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._open().tensors)


def _split_index(index, ndim: int) -> tuple[tuple, list, tuple | None]:
    """INDEX (what `[...]` got) on a tensor of NDIM dimensions as (the basic index, without
    None and lists, for slice_plan; the result dimensions None inserts, in order; for one list
    of integers, (its dimension in slice_plan's result, its dimension in the tensor, the
    positions), or None)."""
    if isinstance(index, list):
        index = (index,)
    index = index if isinstance(index, tuple) else (index,)
    if sum(1 for i in index if i is Ellipsis) == 1:  # several: slice_plan's error
        at = index.index(Ellipsis)
        consumed = sum(1 for i in index if i is not None and i is not Ellipsis)
        index = index[:at] + (slice(None),) * max(ndim - consumed, 0) + index[at + 1:]
    basic, new_axes, gather, produced = [], [], None, 0
    for i in index:
        if i is None:
            new_axes.append(produced)
            produced += 1
        elif isinstance(i, list):
            if gather is not None:
                raise IndexError("only one list of integers per index is supported")
            gather = (produced - len(new_axes), len(basic), [operator.index(k) for k in i])
            basic.append(slice(None))
            produced += 1
        else:
            basic.append(i)
            produced += isinstance(i, slice) or i is Ellipsis
    return tuple(basic), new_axes, gather


class TensorSlice:
    """One tensor of a safe_open source, read only as far as it is indexed. It keeps the
    source open, as safetensors' slices keep their file's map."""

    def __init__(self, opened: safe_open, entry: dict):
        self._source = opened._source
        self._framework, self._device = opened._framework, opened._device
        self._entry = entry

    def get_shape(self) -> list[int]:
        """The tensor's shape, as served (safetensors' header shape)."""
        return list(self._entry["shape"])

    def get_dtype(self) -> str:
        """The tensor's dtype as safetensors names it ("F32", "BF16", ...), as served."""
        return self._entry["dtype"]

    def __getitem__(self, index):
        entry = self._entry
        shape = torch_shape(entry)
        if self._framework == "numpy":
            # safetensors' numpy slices: no None, no integer lists (an empty one reads nothing).
            if isinstance(index, list):
                if index:
                    raise SafetensorError("Non empty lists are not implemented")
                import numpy as np

                return np.empty([0, *shape[1:]], numpy_dtype(entry))
            basic, new_axes, gather = numpy_index(shape, index), [], None
        else:
            basic, new_axes, gather = _split_index(index, len(shape))
        if gather is not None:
            size = shape[gather[1]] if gather[1] < len(shape) else 0
            for k in gather[2]:
                if not -size <= k < size:
                    raise IndexError(f"index {k} is out of bounds for dimension {gather[1]} with size {size}")
        offsets, lengths, out_shape = slice_plan(shape, entry["itemsize"], basic)
        if self._framework == "numpy":
            import numpy as np

            out = np.empty(out_shape, numpy_dtype(entry))
            address = out.ctypes.data
        else:
            import torch

            out = torch.empty(out_shape, dtype=torch_dtype(entry))
            address = out.data_ptr()
        if len(offsets):
            self._source.read(entry["index"], offsets, lengths, address)
        if gather is not None:
            positions = [k % shape[gather[1]] for k in gather[2]]
            if self._framework == "numpy":
                import numpy as np

                out = np.take(out, np.array(positions, dtype=np.int64), axis=gather[0])
            else:
                out = out.index_select(gather[0], torch.tensor(positions, dtype=torch.long))
        for axis in new_axes:
            out = out[(slice(None),) * axis + (None,)]
        if self._framework == "pt" and self._device != "cpu":
            out = out.to(self._device)
        return out


__all__ = ["safe_open", "TensorSlice", "CkptfsError", "SafetensorError"]
