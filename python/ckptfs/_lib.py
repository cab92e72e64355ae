"""Finding and binding the native parts: libckptfs.so (through ctypes) and the ckptfs binary.

Both are looked for in the installed package first (the wheel puts libckptfs.so beside these
modules and the binary in bin/), then in a CMake build folder of a source checkout, which is
how the test suites use the package without installing it."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

# The C API version this package calls (include/ckptfs/c_api.h): ckptfs_read_tensor,
# ckptfs_source_files, ckptfs_metadata and the tensors' "extent" arrived in 3;
# ckptfs_map_tensors, ckptfs_unmap and the tensors' "maps" in 4; ckptfs_load_mapped in 5;
# ckptfs_tensor_loading, ckptfs_select, ckptfs_open_source_file and the load statistics of
# `ckptfs load --json` in 6.
REQUIRED_API_VERSION = 8

_PACKAGE_DIR = Path(__file__).resolve().parent
_REPO = _PACKAGE_DIR.parents[1]  # python/ckptfs -> the checkout, when run from one
_INSTALL_HINT = "install the package with `pip install .` in a ckptfs checkout, or build one (cmake --build build)"

_lib = None
_lib_lock = threading.Lock()


class CkptfsError(RuntimeError):
    """A ckptfs failure. The message is ckptfs's one line: the file and the problem."""


def _safetensors_error_bases() -> tuple:
    # Code written for safetensors catches its SafetensorError: ckptfs's errors are that class
    # too when safetensors is installed (its module is native code only; it imports no torch).
    try:
        from safetensors import SafetensorError as reference
    except ImportError:
        return (CkptfsError,)
    return (CkptfsError, reference)


SafetensorError = type("SafetensorError", _safetensors_error_bases(), {
    "__module__": "ckptfs",
    "__doc__": "A ckptfs failure: a CkptfsError, and a safetensors.SafetensorError where safetensors is installed.",
})


def _build_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("CKPTFS_BUILD_DIR"):
        dirs.append(Path(os.environ["CKPTFS_BUILD_DIR"]))
    return dirs + [_REPO / "build", _REPO / "build-dev"]


def _first_file(candidates: list[Path], what: str) -> Path:
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise CkptfsError(f"{what} not found ({_INSTALL_HINT}); looked in " + ", ".join(str(c) for c in candidates))


def library_path() -> Path:
    """The libckptfs.so this package loads: $CKPTFS_LIB, else the one installed with the
    package, else one in a build folder ($CKPTFS_BUILD_DIR, <checkout>/build, build-dev)."""
    if os.environ.get("CKPTFS_LIB"):
        return Path(os.environ["CKPTFS_LIB"])
    return _first_file([_PACKAGE_DIR / "libckptfs.so"] + [d / "libckptfs.so" for d in _build_dirs()], "libckptfs.so")


def executable_path() -> Path:
    """The ckptfs binary the `ckptfs` command and mount() run: $CKPTFS_BIN, else the one
    installed with the package, else one in a build folder."""
    if os.environ.get("CKPTFS_BIN"):
        return Path(os.environ["CKPTFS_BIN"])
    return _first_file([_PACKAGE_DIR / "bin" / "ckptfs"] + [d / "ckptfs" for d in _build_dirs()], "the ckptfs binary")


def _declare(lib) -> None:
    c = ctypes
    u64p = c.POINTER(c.c_uint64)
    signatures = {
        "ckptfs_api_version": (c.c_int, []),
        "ckptfs_version": (c.c_char_p, []),
        "ckptfs_open": (c.c_void_p, [c.c_char_p, c.c_char_p]),
        "ckptfs_close": (None, [c.c_void_p]),
        "ckptfs_tensor_count": (c.c_size_t, [c.c_void_p]),
        "ckptfs_tensor_info": (c.c_char_p, [c.c_void_p]),
        "ckptfs_source_files": (c.c_char_p, [c.c_void_p]),
        "ckptfs_metadata": (c.c_char_p, [c.c_void_p]),
        "ckptfs_read_tensor": (c.c_int, [c.c_void_p, c.c_uint64, c.c_size_t, u64p, u64p, c.c_void_p]),
        "ckptfs_load_into": (c.c_int, [c.c_void_p, c.c_size_t, u64p, c.POINTER(c.c_void_p), u64p, c.c_char_p,
                                       c.c_int, c.c_char_p]),
        "ckptfs_load_into_stream": (c.c_int, [c.c_void_p, c.c_size_t, u64p, c.POINTER(c.c_void_p), u64p,
                                              c.c_char_p, c.c_int, c.c_void_p, c.c_char_p]),
        "ckptfs_last_error": (c.c_char_p, []),
        "ckptfs_last_load_stats": (c.c_char_p, []),
        "ckptfs_options": (c.c_char_p, []),
        "ckptfs_map_tensors": (c.c_char_p, [c.c_void_p, c.c_size_t, u64p, c.POINTER(c.c_void_p), u64p]),
        "ckptfs_load_mapped": (c.c_int, [c.c_void_p, c.c_size_t, u64p, c.POINTER(c.c_void_p), u64p, u64p]),
        "ckptfs_unmap": (c.c_int, [c.c_void_p, c.c_uint64]),
        "ckptfs_tensor_loading": (c.c_char_p, [c.c_void_p]),
        "ckptfs_select": (c.c_char_p, [c.c_void_p, c.c_char_p]),
        "ckptfs_open_source_file": (c.c_int, [c.c_void_p, c.c_uint32]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes


def _library():
    """libckptfs.so, loaded and declared once per process."""
    global _lib
    with _lib_lock:
        if _lib is None:
            path = library_path()
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                raise CkptfsError(f"{path}: cannot load ({e}); {_INSTALL_HINT}") from None
            if not hasattr(lib, "ckptfs_version") or lib.ckptfs_api_version() < REQUIRED_API_VERSION:
                raise CkptfsError(f"{path}: C API version {lib.ckptfs_api_version()}, this package needs "
                                  f"{REQUIRED_API_VERSION}; rebuild it or reinstall the package")
            _declare(lib)
            _lib = lib
        return _lib


def last_error() -> CkptfsError:
    """The calling thread's last libckptfs failure as a SafetensorError (a CkptfsError)."""
    return SafetensorError(_library().ckptfs_last_error().decode(errors="replace"))


def version() -> str:
    """The ckptfs version libckptfs.so was built as (the CMake project's VERSION)."""
    return _library().ckptfs_version().decode()
