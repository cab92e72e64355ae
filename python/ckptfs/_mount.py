"""mount: a ckptfs FUSE mount for the length of a with block."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from ._lib import CkptfsError, executable_path

# Starting a mount indexes the source first; a large checkpoint takes seconds.
DEFAULT_TIMEOUT_S = 120.0


def _option_text(name: str, value) -> str | None:
    """NAME=VALUE as -o takes it; a switch is its name alone (True) or nothing (False/None).
    fuse_opt reads ',' and '\\' in values as separators and escapes."""
    if value is None or value is False:
        return None
    if value is True:
        return name
    text = str(value).replace("\\", "\\\\").replace(",", "\\,")
    return f"{name}={text}"


def is_mounted(path: str | os.PathLike) -> bool:
    """True when PATH is a mount point (/proc/self/mounts; reading it never waits on a FUSE
    daemon)."""
    target = os.path.realpath(path)
    with open("/proc/self/mounts", encoding="utf-8", errors="surrogateescape") as mounts:
        for line in mounts:
            fields = line.split(" ")
            # The kernel writes space, tab, newline and backslash as \ooo.
            if len(fields) > 1 and re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1]) == target:
                return True
    return False


def _run(argv: list, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([str(a) for a in argv], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, None, "", f"{argv[0]}: timed out after {timeout:.0f}s")


def _one_line(result: subprocess.CompletedProcess) -> str:
    lines = (result.stderr or "").strip().splitlines()
    line = lines[-1] if lines else f"exit status {result.returncode}"
    return line.removeprefix("ckptfs: ")


def unmount(mountpoint: str | os.PathLike, timeout: float = 30.0) -> None:
    """Unmounts a ckptfs mount: `fusermount3 -u`, and when the mount is busy (a file still
    open) or the daemon does not answer, a lazy `fusermount3 -u -z`, which detaches it at
    once (the daemon exits when the last file is closed). Raises CkptfsError if it stays."""
    fusermount = shutil.which("fusermount3")
    if fusermount is None:
        raise CkptfsError(f"{mountpoint}: fusermount3 not found (Debian package fuse3); cannot unmount")
    result = _run([fusermount, "-u", mountpoint], timeout)
    if result.returncode != 0 and is_mounted(mountpoint):
        result = _run([fusermount, "-u", "-z", mountpoint], timeout)
    deadline = time.monotonic() + timeout
    while is_mounted(mountpoint):
        if time.monotonic() >= deadline:
            raise CkptfsError(f"{mountpoint}: still mounted after fusermount3 -u -z ({_one_line(result)})")
        time.sleep(0.05)


@contextlib.contextmanager
def mount(source: str | os.PathLike, mountpoint: str | os.PathLike | None = None, *,
          timeout: float = DEFAULT_TIMEOUT_S, **options) -> Iterator[Path]:
    """Mounts SOURCE read-only with the bundled ckptfs binary and yields the mount point; the
    mount is always undone when the block ends, an exception included.

    Args:
        source (`str`, or `os.PathLike`):
            The checkpoint: a file or a folder.
        mountpoint (`str`, or `os.PathLike`, *optional*):
            An existing empty folder; by default a new temporary folder, removed afterwards.
        timeout (`float`, defaults to 120):
            Seconds the mount (which indexes the source first) and the unmount may take.
        **options:
            Mount options (`-o`): `dtype="bf16"`, `root="model"`, `shard_size="2GiB"`,
            `allow_other=True`, ... (`ckptfs.option_table()`, `ckptfs mount --help`).

    Example:
    ```python
    import ckptfs
    from safetensors.torch import load_file

    with ckptfs.mount("ck.pt", dtype="bf16") as path:
        state = load_file(path / "model.safetensors")
    ```
    """
    made = None
    if mountpoint is None:
        made = Path(tempfile.mkdtemp(prefix="ckptfs-mount-"))
        mountpoint = made
    mountpoint = Path(mountpoint)
    texts = [t for t in (_option_text(k, v) for k, v in options.items()) if t]
    argv = [executable_path(), "mount", os.fspath(source), mountpoint] + (["-o", ",".join(texts)] if texts else [])
    try:
        result = _run(argv, timeout)
        if result.returncode != 0:
            raise CkptfsError(_one_line(result))
        yield mountpoint
    finally:
        try:
            # Also after a failed or timed-out start, which may have left a mount.
            if is_mounted(mountpoint):
                unmount(mountpoint, timeout)
        finally:
            if made is not None:
                with contextlib.suppress(OSError):
                    made.rmdir()
