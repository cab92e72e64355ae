"""What a source serves through each front end, as bytes, so that two ways of opening it
(the catalog cache on and off) can be compared whole: `ckptfs ls --json`, every file
`ckptfs export --write all` writes, and every file of a real mount. Each command has a
timeout; each mount is made and unmounted through the suite's `mounts` fixture
(tests/ckptfs_mounts.py), which also tears it down if the test fails midway."""

import os
from pathlib import Path

from fusetools import MOUNT_TIMEOUT_S, run_bounded


def tree(root: Path) -> dict:
    """{relative path: bytes} of every file under ROOT, and {relative path: None} of every
    folder."""
    root = Path(root)
    out = {}
    for folder, subfolders, files in os.walk(root):
        here = Path(folder)
        for name in subfolders:
            out[str((here / name).relative_to(root))] = None
        for name in files:
            out[str((here / name).relative_to(root))] = (here / name).read_bytes()
    return out


def run_quietly(binary, *args) -> bytes:
    """Stdout of `BINARY ARGS...`, which must exit 0 within the timeout and print nothing on
    stderr (a cache entry ignored, or one that could not be written, says so there)."""
    res = run_bounded([binary, *args], MOUNT_TIMEOUT_S)
    assert res.returncode == 0 and res.stderr == "", res.describe()
    return res.stdout_bytes


def served(binary, mounts, source, workdir: Path, cache: Path = None) -> dict:
    """{"ls": the JSON listing's bytes, "export": tree(OUTDIR), "mount": tree(mountpoint)}
    of SOURCE, with the catalog cache in CACHE (off when None). WORKDIR must not exist."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True)
    flags = [] if cache is None else ["--catalog-cache", cache]
    out = {"ls": run_quietly(binary, "ls", "--json", *flags, source)}
    run_quietly(binary, "export", "--write", "all", *flags, source, workdir / "export")
    out["export"] = tree(workdir / "export")
    mount_options = [] if cache is None else ["-o", f"catalog_cache={cache}"]
    mountpoint = mounts.mount(source, None, *mount_options)
    try:
        out["mount"] = tree(mountpoint)
    finally:
        mounts.unmount(mountpoint)
    return out
