"""Faults between ckptfs and a real nginx, made by a fault-injecting proxy (fault_proxy.py):
damaged answers are detected and retried and never served; a stalled or stopped server turns
into EIO after the timeout and retry budget, never a hang, and the mount still unmounts
cleanly; an object replaced on the server while mounted gives EIO, never bytes of two
versions."""

import errno
import os
import shutil
import time

import pytest

from fault_proxy import FaultProxy
from fusetools import tree_files

from conftest import save_random_pt, save_training_pt


@pytest.fixture
def proxy(nginx):
    p = FaultProxy(nginx.port)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def big_pt(www):
    """~16 MB, so a read of its end is never already fetched by the catalog or readahead."""
    return save_random_pt(www / "faults-big.pt", count=4, seed=11)


def unfetched_offset(root) -> int:
    """An offset of model.safetensors inside w1's data: neither the catalog (the zip
    directory at the end, one local header per record) nor a first read fetched it."""
    return (root / "model.safetensors").stat().st_size * 3 // 8


def read_all(root):
    return {name: p.read_bytes() for name, p in tree_files(root).items()}


def expect_eio(fn):
    with pytest.raises(OSError) as info:
        fn()
    assert info.value.errno == errno.EIO, info.value


@pytest.mark.timeout(120)
def test_damaged_answers_are_retried_and_never_served(big_pt, proxy, mounts):
    local = read_all(mounts.mount(big_pt))
    # Every kind of damage, in a row on the same range: the fifth try (remote_retries=4) gets
    # the right answer.
    proxy.inject("truncate", "wrong_range", "error_500", "reset")
    remote_root = mounts.mount(proxy.url(big_pt.name))
    proxy.inject("wrong_range", "truncate", "truncate", "error_500")
    remote = read_all(remote_root)
    assert proxy.applied == ["truncate", "wrong_range", "error_500", "reset",
                             "wrong_range", "truncate", "truncate", "error_500"]
    local.pop("manifest.json")
    remote.pop("manifest.json")
    assert remote == local


@pytest.mark.timeout(120)
def test_damage_past_the_retry_budget_is_eio(big_pt, proxy, mounts):
    root = mounts.mount(proxy.url(big_pt.name), None, "-o", "remote_retries=2")
    proxy.always = "wrong_range"
    with open(root / "model.safetensors", "rb") as f:
        f.seek(unfetched_offset(root))
        expect_eio(lambda: f.read(4096))
    damaged = [r for r in proxy.log if r[2] == "wrong_range"]
    # Each request the read needed was tried three times (remote_retries=2), none served.
    assert damaged and len(damaged) % 3 == 0, proxy.log


@pytest.mark.timeout(120)
def test_stalled_server_times_out(big_pt, proxy, mounts):
    root = mounts.mount(proxy.url(big_pt.name), None, "-o", "remote_timeout=2,remote_retries=1")
    proxy.stall_s = 30
    proxy.stall_all = True
    start = time.monotonic()
    with open(root / "model.safetensors", "rb") as f:
        f.seek(unfetched_offset(root))
        expect_eio(lambda: f.read(4096))
    elapsed = time.monotonic() - start
    # Two tries of 2 s each and a 0.1 s pause, with slack for a loaded machine.
    assert elapsed < 20, f"a stalled read took {elapsed:.1f} s"
    proxy.stall_all = False
    mounts.unmount(root)


@pytest.mark.timeout(120)
def test_server_stopped_mid_read(big_pt, proxy, mounts):
    root = mounts.mount(proxy.url(big_pt.name), None, "-o", "remote_timeout=2,remote_retries=2,readahead=1MiB")
    with open(root / "model.safetensors", "rb") as f:
        assert len(f.read(256 << 10)) == 256 << 10
        proxy.down = True
        start = time.monotonic()
        f.seek(unfetched_offset(root))
        expect_eio(lambda: f.read(4096))
        assert time.monotonic() - start < 20
    mounts.unmount(root)


@pytest.mark.timeout(120)
def test_object_replaced_mid_read_is_eio_never_mixed(big_pt, www, nginx, mounts):
    path = www / "replaced.pt"
    shutil.copy2(big_pt, path)
    local_root = mounts.mount(big_pt)
    old = (local_root / "model.safetensors").read_bytes()
    # A short readahead, so the first read's prefetch stays megabytes short of the second.
    root = mounts.mount(nginx.url("replaced.pt"), None, "-o", "readahead=1MiB")
    size = len(old)
    with open(root / "model.safetensors", "rb") as f:
        f.seek(size // 8)
        head = f.read(4096)
        assert head == old[size // 8 : size // 8 + 4096]
        # Same tensors, other values: the same size, a new ETag (nginx's is mtime and size).
        tmp = save_random_pt(www / "replaced.tmp", count=4, seed=12)
        time.sleep(1.1)  # a different Last-Modified second
        os.utime(tmp)
        os.replace(tmp, path)
        f.seek(size * 5 // 8)  # megabytes past anything fetched so far
        expect_eio(lambda: f.read(4096))
        # Once seen, the change fails every read of that file, cached bytes included.
        f.seek(0)
        expect_eio(lambda: f.read(4096))
    mounts.unmount(root)
