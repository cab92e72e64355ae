"""Push-ahead (src/fuse/push_ahead.hpp): while a reader faults on a served file, the daemon stores
the bytes that follow into the kernel's cache (FUSE notify_store). Checked through a real mount
read by page faults of a mapping, as loaders read: the bytes are the served file's (`ckptfs cat`),
pushes happen (the daemon's count at unmount), and when the kernel refuses a store the daemon
stops pushing and READs serve everything. Push-ahead is on (256 MiB) unless
CKPTFS_PUSH_AHEAD_MIB=0. The daemon runs in the foreground so its log is read."""

import mmap
import os
import random
import re
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckptfs_testlib import scaled
from fusetools import wait_for_mount

PAGE = 4096
PUSHED = re.compile(r"ckptfs: pushed (\d+) bytes in (\d+) stores")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 40 MiB safetensors file of pseudo-random float32 tensors (pages differ)."""
    rng = np.random.default_rng(14)
    tensors = {f"layer.{i}.weight": rng.standard_normal((1024, 1280), dtype=np.float32) for i in range(8)}
    path = tmp_path_factory.mktemp("push-src") / "model.safetensors"
    save_file(tensors, str(path))
    return path


def mount_foreground(ckptfs_bin, mounts, source, log_path, env_extra, options=()):
    mnt = mounts.new_mountpoint()
    mounts.register(mnt)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTFS_")}
    env.update(env_extra)
    log = open(log_path, "wb")
    proc = subprocess.Popen([str(ckptfs_bin), str(source), str(mnt), "-f", *options], stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)
    log.close()
    assert wait_for_mount(mnt, daemon=proc) is not None, f"the mount did not appear: {log_path.read_text(errors='replace')}"
    return mnt, proc


def read_by_faults(path, size) -> bytes:
    """The file's bytes as a loader reads them: a private mapping, page faults only. The first
    4 MiB page by page (READs in order: a stream the daemon pushes for), a pause (its first
    window lands whatever the machine's load), a scatter of pages (more streams), then
    everything in order."""
    with open(path, "rb") as f:
        with mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as m:
            for off in range(0, 4 << 20, PAGE):
                assert len(m[off:off + 1]) == 1
            time.sleep(0.5)
            pages = list(range(0, size, PAGE))
            for off in random.Random(14).sample(pages, 64):
                assert len(m[off:off + 1]) == 1
            return bytes(m[:])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["default", "on", "refused", "off"])
def test_mapped_reads_with_push_ahead(ckptfs_bin, mounts, run_ckptfs, source, tmp_path, case):
    # On by default (src/fuse/daemon.cpp says why); CKPTFS_PUSH_AHEAD_MIB=0 turns it off.
    env = {"on": {"CKPTFS_PUSH_AHEAD_MIB": "256"},
           "refused": {"CKPTFS_PUSH_AHEAD_MIB": "256", "CKPTFS_TEST_PUSH_REFUSED": "1"},
           "off": {"CKPTFS_PUSH_AHEAD_MIB": "0"}}.get(case, {})
    log_path = tmp_path / "daemon.log"
    mnt, proc = mount_foreground(ckptfs_bin, mounts, source, log_path, env)
    served = mnt / "model.safetensors"
    size = served.stat().st_size
    try:
        got = read_by_faults(served, size)
    finally:
        mounts.unmount(mnt)
        proc.wait(timeout=scaled(30))
    log = log_path.read_text(errors="replace")
    expected = run_ckptfs("cat", source, "model.safetensors").stdout
    assert len(expected) == size > 32 << 20
    assert got == expected, f"{case}: the mapped bytes differ from ckptfs cat's"
    pushed = PUSHED.search(log)
    if case == "off":
        assert pushed is None, log
        return
    assert pushed, f"no push count in the daemon's log:\n{log}"
    pushed_bytes, stores = int(pushed.group(1)), int(pushed.group(2))
    if case == "refused":
        assert "the kernel refused pushed data (Invalid argument); reading on request only" in log, log
        assert pushed_bytes == 0 and stores == 0, log
        assert "the kernel refused one; pushing stopped" in log, log
    else:
        assert "refused" not in log, log
        assert 0 < pushed_bytes <= size and stores > 0, log


@pytest.mark.timeout(180)
def test_files_released_and_opened_again_while_a_chunk_is_pushed(ckptfs_bin, mounts, run_ckptfs, tmp_path):
    # The pusher reads a claimed chunk without its lock; a file released and opened again
    # meanwhile has a fresh state with no READ yet, which the pusher must not index
    # (PushAhead::Unread). A 150,000-tensor file makes the header's first chunks slow to serve
    # (they are rendered on a fresh mount's first reads): each round reads the start of the
    # header in steps (a stream the daemon pushes for), closes, and opens the file again
    # without reading for a moment. Without the guard the daemon crashed on 4 of 6 fresh
    # mounts, nearly always in the first round, so the rounds go to 8 fresh mounts (it then
    # failed 3 runs in 3). The catalog cache keeps the fresh mounts quick on the sanitizer
    # builds: the first mount parses the header and stores its catalog, the others read it
    # back, and the window stays (the served header is rendered by the View, cache or not).
    names = [f"w.{i}" for i in range(150_000)]
    path = tmp_path / "many.safetensors"
    save_file({k: np.full((1,), i, dtype=np.float32) for i, k in enumerate(names)}, str(path))
    expected = run_ckptfs("cat", path, "model.safetensors").stdout
    for attempt in range(8):
        log_path = tmp_path / f"daemon-{attempt}.log"
        mnt, proc = mount_foreground(ckptfs_bin, mounts, path, log_path, {"CKPTFS_PUSH_AHEAD_MIB": "256"},
                                     ("-o", f"catalog_cache={tmp_path / 'catalogs'}"))
        served = mnt / "model.safetensors"
        try:
            for _ in range(3):
                with open(served, "rb", buffering=0) as f:
                    for _ in range(16):
                        f.read(128 << 10)
                with open(served, "rb", buffering=0) as f:
                    time.sleep(0.02)
                    f.read(8)
                fd = os.open(served, os.O_RDONLY)  # the next round reads from the daemon again
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                assert proc.poll() is None, log_path.read_text(errors="replace")
            whole = served.read_bytes()
        finally:
            mounts.unmount(mnt)
            proc.wait(timeout=scaled(30))
        log = log_path.read_text(errors="replace")
        assert proc.returncode == 0, log
        assert whole == expected
        pushed = PUSHED.search(log)
        assert pushed and int(pushed.group(2)) > 0, log
