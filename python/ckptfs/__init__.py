"""ckptfs from Python: read any checkpoint ckptfs reads (torch .pt/.bin, safetensors file or
folder, DeepSpeed ZeRO folder, torch.distributed.checkpoint folder) without a mount.

    import ckptfs

    with ckptfs.safe_open("checkpoints/", framework="pt", dtype="bf16") as f:
        weight = f.get_tensor("model.embed.weight")       # lazily, one tensor
        rows = f.get_slice("model.embed.weight")[:128]     # only these rows are read
    state = ckptfs.load("checkpoints/", device="cuda:0")  # everything, streamed to the GPU
    changed = ckptfs.diff("step100/", "step200/")["tensors"]  # per tensor: differing, rel_l2, ...
    with ckptfs.mount("ck.pt") as path:                    # the FUSE view, unmounted after
        print(sorted(p.name for p in path.iterdir()))

safe_open is safetensors' interface for every format; on the CPU a tensor stored as served
is a view of a private memory map of its file (like torch.load(mmap=True)), others are
filled by libckptfs, converting dtypes on the fly. Nothing is unpickled into Python objects
and nothing in a pickle is run.

The native parts (libckptfs.so, the ckptfs binary) come with the wheel (`pip install .` in
a checkout); a source checkout's build folder works too ($CKPTFS_LIB, $CKPTFS_BIN,
$CKPTFS_BUILD_DIR, <checkout>/build). Importing this package imports neither torch nor
numpy; framework="numpy" never imports torch.
"""

from __future__ import annotations

import json

from ._diff import diff
from ._lib import CkptfsError, SafetensorError, _library, executable_path, library_path
from ._load import list_tensors, load, load_file
from ._mount import mount, unmount
from ._safe_open import TensorSlice, safe_open

__all__ = [
    "safe_open", "TensorSlice", "load", "diff", "load_file", "mount", "unmount", "list_tensors", "option_table",
    "library_path", "executable_path", "last_load_stats", "CkptfsError", "SafetensorError", "__version__",
]


def last_load_stats() -> dict:
    """What the calling thread's last library load moved, with the keys `ckptfs load --json`
    prints (backend, device, tensors, bytes, bytes_read, seconds, gb_per_s, ...), and
    mapped_bytes and maps after a load that composed a region of file maps (backend "map").
    Tensors that load() made views of their file are not counted."""
    return json.loads(_library().ckptfs_last_load_stats())


def option_table() -> list[dict]:
    """Every option libckptfs (and the ckptfs command and mount) takes: name, kind ("switch" or
    "value"), groups, flag (the command line's spelling), value_name, help, front_ends."""
    return json.loads(_library().ckptfs_options())


def __getattr__(name: str):
    # The version is libckptfs's own (the CMake project's VERSION, which the wheel's metadata
    # and the binary carry too): loading the library waits until it is asked for.
    if name == "__version__":
        from ._lib import version

        return version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
