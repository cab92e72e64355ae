"""The catalog cache and URL sources, against a real nginx on loopback: a URL's catalog is
never cached (an object's identity is more than its URL: doc/FORMATS.md, "Catalog cache"), so
opening one with the cache on writes no entry, wherever it is opened from, and `ls`, `export`
and a mount serve the same bytes as with the cache off."""

from pathlib import Path

from fusetools import MOUNT_TIMEOUT_S, run_bounded
from served import served


def no_entries(cache: Path) -> bool:
    return not cache.exists() or not any(cache.iterdir())


def test_a_url_source_is_never_cached(training_pt, nginx, ckptfs_bin, tmp_path):
    url = nginx.url("training.pt")
    cache = tmp_path / "cache"
    reference = run_bounded([ckptfs_bin, "ls", "--json", url], MOUNT_TIMEOUT_S)
    assert reference.returncode == 0, reference.describe()
    # Twice from one folder and once from another: a URL made into a path under the current
    # folder would name another entry from each.
    for cwd in (tmp_path / "here", tmp_path / "here", tmp_path / "there"):
        cwd.mkdir(exist_ok=True)
        res = run_bounded([ckptfs_bin, "ls", "--json", "--catalog-cache", cache, url], MOUNT_TIMEOUT_S, cwd=cwd)
        assert res.returncode == 0 and res.stderr == "", res.describe()
        assert res.stdout == reference.stdout
        assert no_entries(cache), sorted(cache.iterdir())
        assert not any(cwd.iterdir()), sorted(cwd.iterdir())


def test_a_url_source_serves_the_same_with_the_cache_on_and_off(training_pt, nginx, mounts, ckptfs_bin, tmp_path):
    url = nginx.url("training.pt")
    cache = tmp_path / "cache"
    off = served(ckptfs_bin, mounts, url, tmp_path / "off")
    assert off["mount"] and off["export"]
    for name in ("first", "second"):
        assert served(ckptfs_bin, mounts, url, tmp_path / name, cache=cache) == off
        assert no_entries(cache)
