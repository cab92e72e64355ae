"""An opened checkpoint (one libckptfs handle): its tensors, metadata and source files, byte
reads of one tensor, and memory maps of the source files for tensors stored as served."""

from __future__ import annotations

import ctypes
import json
import os

from ._dtypes import dtype_option, numpy_dtype, torch_dtype, torch_shape
from ._lib import CkptfsError, _library, last_error


def options_json(options: dict) -> bytes:
    """The JSON object of a libckptfs call's options. Values JSON cannot hold (a numpy
    integer) go as their text, which the library parses like the command line's."""
    return json.dumps(options, default=str).encode()


def view_options(dtype=None, root=None, **options) -> dict:
    """The open options: the view's dtype and root, plus any other option of ckptfs's table
    (moments, max_pickle, ...). Unset options are null, which the library reads as "not
    given"."""
    return {"dtype": dtype_option(dtype), "root": root or None, **options}


class MappedRegion:
    """Memory of ckptfs_load_mapped: private maps of source files over anonymous memory,
    released when this object goes. Tensors over it hold it through their storage's buffer."""

    def __init__(self, lib, address: int, size: int):
        self._lib, self.address, self.size = lib, address, size

    def buffer(self):
        """A writable ctypes array over the region, which keeps the region alive."""
        array = (ctypes.c_char * self.size).from_address(self.address)
        array._region = self
        return array

    def __del__(self):
        if self.address:
            self._lib.ckptfs_unmap(self.address, self.size)
            self.address = 0


class Source:
    """The view of one checkpoint, as `ckptfs ls` lists it: libckptfs's handle, closed by
    close() or the with block."""

    def __init__(self, source, options: dict):
        self.lib = _library()
        self.name = os.fspath(source)
        self.ptr = self.lib.ckptfs_open(os.fsencode(self.name), options_json(options))
        if not self.ptr:
            raise last_error()
        # Each tensor as ckptfs_tensor_info lists it, with how libckptfs has it loaded
        # (ckptfs_tensor_loading: "itemsize", "torch_dtype", "torch_shape", "numpy_dtype",
        # and "cpu", the map-or-copy decision of a CPU load).
        self.tensors: list[dict] = self.listed()
        for entry, loading in zip(self.tensors, json.loads(self.lib.ckptfs_tensor_loading(self.ptr))):
            entry.update(loading)
        self.by_key = {t["key"]: t for t in self.tensors}
        self._maps: dict = {}  # (file index, framework) -> a private mapping of the whole file

    def __del__(self):
        self.close()

    def close(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.ckptfs_close(self.ptr)
            self.ptr = None
        # Tensors already handed out keep their own reference to the mapping.
        getattr(self, "_maps", {}).clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _handle(self):
        if not self.ptr:
            raise CkptfsError(f"{self.name}: closed")
        return self.ptr

    def listed(self) -> list[dict]:
        """The tensors as ckptfs_tensor_info lists them: index, key, dtype, shape, nbytes, and
        "extent" or "maps" where their bytes are ranges of local files as stored."""
        return json.loads(self.lib.ckptfs_tensor_info(self._handle()))

    def select(self, select) -> list[dict]:
        """The entries of the tensors SELECT (a key or glob, a list of them, or None for all)
        names, in the checkpoint's order; a pattern that matches nothing is a CkptfsError."""
        patterns = None if select is None else [select] if isinstance(select, str) else list(select)
        chosen = self.lib.ckptfs_select(self._handle(), json.dumps(patterns).encode())
        if chosen is None:
            raise last_error()
        return [self.tensors[i] for i in json.loads(chosen)]

    def entry(self, key: str) -> dict:
        if key not in self.by_key:
            raise KeyError(f"{self.name}: no tensor {key!r}")
        return self.by_key[key]

    def metadata(self) -> dict:
        return json.loads(self.lib.ckptfs_metadata(self._handle()))

    def read(self, index: int, offsets, lengths, out_address: int) -> None:
        """Reads byte ranges (numpy uint64 arrays OFFSETS, LENGTHS) of tensor INDEX as served
        into the memory at OUT_ADDRESS, one after the other."""
        count = len(offsets)
        u64p = ctypes.POINTER(ctypes.c_uint64)
        rc = self.lib.ckptfs_read_tensor(self._handle(), index, count, offsets.ctypes.data_as(u64p),
                                         lengths.ctypes.data_as(u64p), out_address)
        if rc != 0:
            raise last_error()

    def read_whole(self, entry: dict, out_address: int) -> None:
        import numpy as np

        if entry["nbytes"]:
            self.read(entry["index"], np.array([0], np.uint64), np.array([entry["nbytes"]], np.uint64), out_address)

    # --- memory maps ----------------------------------------------------------------------

    @staticmethod
    def maps_file(entry: dict) -> bool:
        """True when a CPU tensor of ENTRY is a view of a private map of its source file
        (libckptfs's decision: its bytes are one range of a local file as stored, aligned for
        its element type); False when it is read, or placed by load_mapped_torch."""
        return entry["cpu"] == "file_map"

    def _file_descriptor(self, file_index: int) -> int:
        """A descriptor of source file FILE_INDEX, checked by libckptfs to be the file it
        indexed: a file replaced or rewritten since is an error, never other bytes."""
        fd = self.lib.ckptfs_open_source_file(self._handle(), file_index)
        if fd < 0:
            raise last_error()
        return fd

    def _mapping(self, file_index: int, framework: str):
        """A private (copy-on-write) mapping of the whole source file, opened read-only: the
        file is never written, and only the pages a tensor touches are read. For torch an
        UntypedStorage (as torch.load(mmap=True) maps), for numpy an mmap object."""
        key = (file_index, framework)
        if key not in self._maps:
            fd = self._file_descriptor(file_index)
            try:
                size = os.fstat(fd).st_size
                if framework == "pt":
                    import torch

                    # /proc/self/fd/N reaches the inode checked above, whatever the path is now.
                    self._maps[key] = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=False, nbytes=size)
                else:
                    import mmap

                    self._maps[key] = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
        return self._maps[key]

    def mapped_torch(self, entry: dict):
        """ENTRY as a torch tensor over the source file's pages (no copy)."""
        return _torch_over(self._mapping(entry["extent"]["file"], "pt"), entry, entry["extent"]["offset"])

    def load_mapped_torch(self, entries: list) -> list:
        """ENTRIES as torch tensors in one region of private memory (ckptfs_load_mapped): the
        pages of source files that hold them as stored are mapped there (a ZeRO-3 parameter
        is maps of every rank file whose pages line up), and the bytes no map supplies are
        read into place by the library. One call for all of them: per-tensor work in Python
        (an allocation, a read call, a thread hand-off) costs more than the maps
        (tests/bench/README.md)."""
        import numpy as np
        import torch

        if not entries:
            return []
        indices = np.array([e["index"] for e in entries], np.uint64)
        offsets = np.empty(len(entries), np.uint64)
        address, size = ctypes.c_void_p(), ctypes.c_uint64()
        u64p = ctypes.POINTER(ctypes.c_uint64)
        if self.lib.ckptfs_load_mapped(self._handle(), len(entries), indices.ctypes.data_as(u64p),
                                       ctypes.byref(address), ctypes.byref(size), offsets.ctypes.data_as(u64p)) != 0:
            raise last_error()
        if not address.value:  # every tensor is empty
            return [torch.empty(torch_shape(e), dtype=torch_dtype(e)) for e in entries]
        region = MappedRegion(self.lib, address.value, size.value)
        storage = torch.frombuffer(region.buffer(), dtype=torch.uint8).untyped_storage()
        return [_torch_over(storage, entry, offset) for entry, offset in zip(entries, offsets.tolist())]

    def mapped_numpy(self, entry: dict):
        """ENTRY as a numpy array over the source file's pages (no copy)."""
        import numpy as np

        dtype = numpy_dtype(entry)
        count = entry["nbytes"] // dtype.itemsize
        array = np.frombuffer(self._mapping(entry["extent"]["file"], "numpy"), dtype, count, entry["extent"]["offset"])
        return array.reshape(entry["shape"])


def _torch_over(storage, entry: dict, byte_offset: int):
    """A contiguous torch tensor of ENTRY over STORAGE (an UntypedStorage), its first element
    BYTE_OFFSET bytes in."""
    import torch

    shape = torch_shape(entry)
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    tensor = torch.empty(0, dtype=torch_dtype(entry))
    tensor.set_(storage, byte_offset // entry["itemsize"], shape, list(reversed(strides)))
    return tensor
