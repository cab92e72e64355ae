"""The catalog cache and URL sources, against a real nginx on loopback: a URL's catalog is
never cached (an object's identity is more than its URL: doc/FORMATS.md, "Catalog cache"), so
opening one with the cache on writes no entry, wherever it is opened from."""

from pathlib import Path

from fusetools import MOUNT_TIMEOUT_S, run_bounded


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

