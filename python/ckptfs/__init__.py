"""ckptfs from Python: load any checkpoint ckptfs reads (torch .pt/.bin, safetensors file or
folder, DeepSpeed ZeRO folder) straight into torch tensors on a GPU or the CPU.

    import ckptfs
    state = ckptfs.load("checkpoints/", device="cuda:0", dtype="bf16")

Like safetensors' load_file(path, device="cuda:0"): every tensor is allocated on the target
device with torch.empty and filled by libckptfs.so, which streams the source extents through
pinned buffers (or cuFile) to the device; nothing is unpickled and no full host copy is made.

libckptfs.so is found through $CKPTFS_LIB (a file), next to this package, or in a build
directory ($CKPTFS_BUILD_DIR, <repo>/build, <repo>/build-dev).
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

__all__ = ["load", "list_tensors", "option_table", "library_path", "last_load_stats", "CkptfsError"]


class CkptfsError(RuntimeError):
    """A ckptfs failure; the message is ckptfs's one line (file: problem)."""


_REPO = Path(__file__).resolve().parents[2]
_lib = None


def library_path() -> Path:
    env = os.environ.get("CKPTFS_LIB")
    if env:
        return Path(env)
    candidates = [Path(__file__).resolve().parent / "libckptfs.so"]
    if os.environ.get("CKPTFS_BUILD_DIR"):
        candidates.append(Path(os.environ["CKPTFS_BUILD_DIR"]) / "libckptfs.so")
    candidates += [_REPO / "build" / "libckptfs.so", _REPO / "build-dev" / "libckptfs.so"]
    for c in candidates:
        if c.is_file():
            return c
    raise CkptfsError(
        "libckptfs.so not found (set CKPTFS_LIB, or build it: cmake --build build); looked in "
        + ", ".join(str(c) for c in candidates)
    )


def _library():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(library_path()))
        lib.ckptfs_open.restype = ctypes.c_void_p
        lib.ckptfs_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        lib.ckptfs_close.argtypes = [ctypes.c_void_p]
        lib.ckptfs_tensor_count.restype = ctypes.c_size_t
        lib.ckptfs_tensor_count.argtypes = [ctypes.c_void_p]
        lib.ckptfs_tensor_info.restype = ctypes.c_char_p
        lib.ckptfs_tensor_info.argtypes = [ctypes.c_void_p]
        lib.ckptfs_load_into.restype = ctypes.c_int
        lib.ckptfs_load_into.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
        ]
        lib.ckptfs_load_into_stream.restype = ctypes.c_int
        lib.ckptfs_load_into_stream.argtypes = [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p,
        ]
        lib.ckptfs_last_error.restype = ctypes.c_char_p
        lib.ckptfs_last_load_stats.restype = ctypes.c_char_p
        lib.ckptfs_options.restype = ctypes.c_char_p
        _lib = lib
    return _lib


def _error(lib) -> CkptfsError:
    return CkptfsError(lib.ckptfs_last_error().decode(errors="replace"))


def _dtype_option(dtype) -> str | None:
    """The dtype option's text: a torch dtype by its name (torch.bfloat16 -> "bfloat16").
    libckptfs validates it, as it does every option (its option table)."""
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str):
    import torch

    table = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
        "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
        "BOOL": torch.bool, "C64": torch.complex64,
    }
    if table.get(name) is None:
        raise CkptfsError(f"torch has no dtype for {name}")
    return table[name]


def _options_json(options: dict) -> bytes:
    # Values JSON cannot hold (a numpy integer) go as their text, which the library parses
    # like the command line's.
    return json.dumps(options, default=str).encode()


class _Handle:
    def __init__(self, source, options: dict):
        self.lib = _library()
        self.ptr = self.lib.ckptfs_open(os.fsencode(str(source)), _options_json(options))
        if not self.ptr:
            raise _error(self.lib)

    def info(self) -> list:
        return json.loads(self.lib.ckptfs_tensor_info(self.ptr))

    def close(self):
        if self.ptr:
            self.lib.ckptfs_close(self.ptr)
            self.ptr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _view_options(dtype, root, moments) -> dict:
    # Unset options are null, which the library reads as "not given".
    return {"dtype": _dtype_option(dtype), "root": root or None, "moments": bool(moments)}


def list_tensors(source, dtype=None, root=None, moments=False) -> list[dict]:
    """[{index, key, dtype (safetensors name as served), shape, nbytes}] of SOURCE's view."""
    with _Handle(source, _view_options(dtype, root, moments)) as h:
        return h.info()


def _selected(entries: list, select) -> list:
    if select is None:
        return entries
    import fnmatch

    patterns = [select] if isinstance(select, str) else list(select)
    picked = set()
    for pattern in patterns:
        hits = {e["index"] for e in entries if e["key"] == pattern or fnmatch.fnmatchcase(e["key"], pattern)}
        if not hits:
            raise CkptfsError(f"{pattern}: no tensor matches")
        picked |= hits
    return [e for e in entries if e["index"] in picked]


def load(source, device="cuda:0", dtype=None, select=None, backend="auto", root=None, moments=False,
         buffer_size=None, buffers=None, io_threads=None, direct_io=None, verify=False) -> dict:
    """{key: torch.Tensor} of SOURCE's tensors on DEVICE ("cuda:N" or "cpu").

    dtype: None (as stored), "bf16", "fp16", "fp32" or the torch dtype: floating tensors are
    converted (bit-identical to Tensor.to). select: a key, a glob, or a list of them.
    backend: for CUDA devices "auto" (cuFile, else pinned buffers), "cuda" or "cufile"; a CPU
    device always uses the host back end. buffer_size/buffers/io_threads/direct_io tune the
    ring of pinned buffers; verify re-reads every tensor and compares. A bad option is a
    CkptfsError with libckptfs's one line.
    """
    import torch

    dev = torch.device(device)
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
    load_options = {"verify": bool(verify), "buffer_size": buffer_size, "buffers": buffers,
                    "io_threads": io_threads, "direct_io": None if direct_io is None else bool(direct_io)}

    with _Handle(source, _view_options(dtype, root, moments)) as h:
        entries = _selected(h.info(), select)
        out = {}
        ptrs, indices, sizes = [], [], []
        for e in entries:
            t = torch.empty(e["shape"], dtype=_torch_dtype(e["dtype"]), device=dev)
            out[e["key"]] = t
            if e["nbytes"]:
                ptrs.append(t.data_ptr())
                indices.append(e["index"])
                sizes.append(e["nbytes"])
        n = len(ptrs)
        # torch.empty's memory may still be in use by kernels queued on the current stream
        # (the caching allocator reuses blocks in stream order): the load waits for them. It
        # returns with every write completed, so later work on that stream sees the data.
        stream = torch.cuda.current_stream(index).cuda_stream if dev.type == "cuda" else None
        rc = h.lib.ckptfs_load_into_stream(
            h.ptr, n, (ctypes.c_uint64 * n)(*indices), (ctypes.c_void_p * n)(*ptrs), (ctypes.c_uint64 * n)(*sizes),
            backend_name.encode(), int(index), stream, _options_json(load_options),
        )
        if rc != 0:
            raise _error(h.lib)
        return out


def last_load_stats() -> dict:
    """What the calling thread's last load moved: tensors, bytes, seconds, backend, ..."""
    return json.loads(_library().ckptfs_last_load_stats())


def option_table() -> list[dict]:
    """Every option libckptfs (and the ckptfs command and mount) takes: name, kind ("switch" or
    "value"), groups, flag (the command line's spelling), value_name, help, front_ends."""
    return json.loads(_library().ckptfs_options())
