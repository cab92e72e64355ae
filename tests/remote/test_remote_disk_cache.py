"""The on-disk block cache (-o cache_dir) with a size bound (-o cache_dir_size), shared by two
mounts of the same object on a real nginx: both serve exactly the bytes of the local mount
while they fill and evict the one folder, the folder ends within the bound, and a later
mount serves the blocks that stayed from disk and fetches the evicted ones again; a bound
without a folder is refused."""

import threading

import pytest

from conftest import save_random_pt
from fusetools import mount_entry

MiB = 1 << 20


def folder_bytes(folder) -> int:
    """What the cache files take on disk (the measure the bound applies to)."""
    return sum(p.stat().st_blocks * 512 for p in folder.iterdir() if p.suffix in (".data", ".map"))


def read_in_chunks(path, backwards: bool) -> bytes:
    """The whole file in 1 MiB reads, front to back or back to front."""
    size = path.stat().st_size
    offsets = list(range(0, size, MiB))
    if backwards:
        offsets.reverse()
    parts = {}
    with open(path, "rb", buffering=0) as f:
        for off in offsets:
            f.seek(off)
            parts[off] = f.read(MiB)
    return b"".join(parts[off] for off in sorted(parts))


@pytest.fixture(scope="module")
def bounded_pt(www):
    """~24 MiB: three times the bound the test sets."""
    return save_random_pt(www / "bounded.pt", count=6, seed=21)


@pytest.mark.timeout(180)
def test_bounded_cache_shared_by_two_mounts(bounded_pt, nginx, mounts, tmp_path):
    want = (mounts.mount(bounded_pt) / "model.safetensors").read_bytes()
    cache = tmp_path / "cache"
    bound = 8 * MiB
    url = nginx.url("bounded.pt")
    options = ("-o", f"cache_dir={cache},cache_dir_size={bound}")
    first = mounts.mount(url, None, *options)
    second = mounts.mount(url, None, *options)
    got, errors = {}, []

    def reader(name, root, backwards):
        try:
            for rounds in range(2):
                got[(name, rounds)] = read_in_chunks(root / "model.safetensors", backwards)
        except Exception as error:  # reported below, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=reader, args=("first", first, False)),
               threading.Thread(target=reader, args=("second", second, True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 4
    for key, data in got.items():
        assert data == want, key
    assert folder_bytes(cache) <= bound
    mounts.unmount(first)
    mounts.unmount(second)

    # A third mount: the blocks that stayed come from disk, the evicted ones from nginx.
    mark = nginx.log_mark()
    third = mounts.mount(url, None, *options)
    assert (third / "model.safetensors").read_bytes() == want
    fetched = nginx.bytes_since(mark, "/bounded.pt")
    size = bounded_pt.stat().st_size
    assert 0 < fetched < size, (fetched, size)
    assert folder_bytes(cache) <= bound


@pytest.mark.timeout(60)
def test_unbounded_cache_keeps_every_block(bounded_pt, nginx, mounts, tmp_path):
    cache = tmp_path / "cache"
    root = mounts.mount(nginx.url("bounded.pt"), None, "-o", f"cache_dir={cache}")
    (root / "model.safetensors").read_bytes()
    assert folder_bytes(cache) >= bounded_pt.stat().st_size


@pytest.mark.timeout(60)
def test_a_bound_without_a_folder_is_one_line_and_no_mount(nginx, mounts):
    mp = mounts.new_mountpoint()
    res = mounts.start([mounts.binary, nginx.url("bounded.pt"), mp, "-o", "cache_dir_size=1GiB"], mp, timeout=20)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "cache_dir_size" in lines[0] and "cache_dir" in lines[0], res.stderr
    assert mount_entry(mp) is None
