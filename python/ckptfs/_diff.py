"""ckptfs.diff: two checkpoints compared tensor by tensor in libckptfs (ckptfs_diff), the
result `ckptfs diff --json` prints, as data."""

from __future__ import annotations

import ctypes
import json
import os

from ._lib import CkptfsError, _library, last_error
from ._source import Source, view_options

# ckptfs_diff arrived in C API version 7.
_DIFF_API_VERSION = 7


def _declared_diff(lib):
    if lib.ckptfs_api_version() < _DIFF_API_VERSION:
        raise CkptfsError(f"libckptfs C API version {lib.ckptfs_api_version()} has no ckptfs_diff "
                          f"(needs {_DIFF_API_VERSION}); rebuild it or reinstall the package")
    function = lib.ckptfs_diff
    function.restype = ctypes.c_char_p
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p]
    return function


def _open_side(source, options: dict) -> Source:
    """The view of one side; an error that does not name the source is prefixed with it, so
    the message says which side could not be read."""
    name = os.fspath(source)
    try:
        return Source(source, options)
    except CkptfsError as e:
        message = str(e)
        raise CkptfsError(message if message.startswith(name + ":") else f"{name}: {message}") from None


def diff(a: str | os.PathLike, b: str | os.PathLike, *, atol: float = 0.0, rtol: float = 0.0, dtype=None,
         root: str | None = None, a_options: dict | None = None, b_options: dict | None = None,
         threads: int | None = None, **options) -> dict:
    """Compares every tensor of checkpoint A with the tensor of the same key in B (any
    formats ckptfs reads), as `ckptfs diff A B --json` does, and returns the same object:

        {"equal": bool, "a": {"source", "tensors"}, "b": {...}, "atol", "rtol",
         "counts": {"identical", "equal", "different", "shape", "incomparable",
                    "only_in_a", "only_in_b"},
         "only_in_a": [key, ...], "only_in_b": [key, ...],
         "tensors": [{"key", "status", "dtype_a", "dtype_b", "shape_a", "shape_b",
                      "numel", "differing", "max_abs", "max_rel", "rel_l2",
                      "norm_a", "norm_diff"}, ...]}

    Args:
        a, b: the checkpoints (files, folders or URLs).
        atol, rtol: elements a, b are equal when |a - b| <= atol + rtol * |b|
            (torch.isclose(A, B)); 0 and 0 ask for equal values.
        dtype, root, **options: view and source options of both sides (ckptfs.option_table()).
        a_options, b_options: options of one side only ({"dtype": "bf16"}), over the shared ones.
        threads: worker threads (default: one per core, at most 8).

    A figure that is infinite (a relative difference where A is 0) is None. Raises
    CkptfsError with one line naming the side that could not be read.
    """
    lib = _library()
    function = _declared_diff(lib)
    shared = {"dtype": dtype, "root": root, **options}
    side_a = _open_side(a, view_options(**{**shared, **(a_options or {})}))
    try:
        side_b = _open_side(b, view_options(**{**shared, **(b_options or {})}))
        try:
            diff_options = {"atol": float(atol), "rtol": float(rtol)}
            if threads is not None:
                diff_options["threads"] = int(threads)
            text = function(side_a._handle(), side_b._handle(), json.dumps(diff_options).encode())
            if text is None:
                raise last_error()
            return json.loads(text)
        finally:
            side_b.close()
    finally:
        side_a.close()
