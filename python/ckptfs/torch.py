"""safetensors.torch's readers for every checkpoint ckptfs reads:

    from ckptfs.torch import load_file
    state = load_file("ck.pt")                     # like safetensors.torch.load_file
    state = load_file("global_step10/", dtype="bf16", root="module")

Importing this module imports torch."""

from __future__ import annotations

import os
import tempfile

import torch  # noqa: F401  (this module is torch's, as safetensors.torch is)

from ._safe_open import safe_open


def load_file(filename: str | os.PathLike, device="cpu", *, backend: str = "mmap", dtype=None,
              root: str | None = None, **options) -> dict:
    """Loads a checkpoint into torch tensors, as `safetensors.torch.load_file` does, for every
    source ckptfs reads.

    Args:
        filename (`str`, or `os.PathLike`):
            The checkpoint: a file or a folder.
        device (`str`, `int` or `torch.device`, defaults to `"cpu"`):
            The device where the tensors need to be located after load.
        backend (`str`, defaults to `"mmap"`):
            `"mmap"` or `"pread"`, as safe_open takes it.
        dtype, root, **options:
            ckptfs's view options, as safe_open takes them.

    Returns:
        (`Dict[str, torch.Tensor]`): the tensors, in the checkpoint's order.
    """
    with safe_open(filename, framework="pt", device=device, backend=backend, dtype=dtype, root=root,
                   **options) as f:
        return f.get_tensors()


def load(data: bytes, *, dtype=None, root: str | None = None, **options) -> dict:
    """Loads a checkpoint held in memory (the bytes of a safetensors or torch.save file) into
    CPU tensors, as `safetensors.torch.load` does for safetensors bytes. The bytes go to an
    anonymous file (memfd) that libckptfs reads; the tensors are copies, never maps of it."""
    fd = os.memfd_create("ckptfs-load")
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            f.write(data)
        with tempfile.TemporaryDirectory() as folder:
            # A name the format detection reads by its contents, and a path to open.
            path = os.path.join(folder, "data")
            os.symlink(f"/proc/self/fd/{fd}", path)
            with safe_open(path, framework="pt", backend="pread", dtype=dtype, root=root, **options) as f:
                return f.get_tensors()
    finally:
        os.close(fd)


__all__ = ["load_file", "load"]
