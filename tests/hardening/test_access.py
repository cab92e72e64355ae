"""Access:
- a default mount is usable by the mounting user only (root here; another uid gets EACCES);
- `-o allow_other` opens it to other users, and permission bits apply (ckptfs always mounts
  with default_permissions): files 0444, folders 0555, owned by the mounting user, so other
  users can read but never write or execute;
- keys containing `..`, `/`, NUL, control characters, `.` alone or nothing at all never
  produce a path outside the mount, nor an entry named `.` or `..`, and read back right.

Other users are simulated with `setpriv --reuid=65534 --regid=65534 --clear-groups` (nobody),
in subprocesses with timeouts."""

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save_file

from fusetools import HELPER_TIMEOUT_S, mount_entry, run_bounded

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (setpriv)")


def as_nobody(*argv) -> "subprocess.CompletedProcess":
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv is not installed (Debian package util-linux)", pytrace=False)
    return run_bounded([setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv], HELPER_TIMEOUT_S)


# What nobody runs: prints one JSON object with the outcome of each probe (errno names).
PROBE = r"""
import errno, json, os, sys
root = sys.argv[1]
f = os.path.join(root, "model.safetensors")
out = {}
def attempt(name, fn):
    try:
        out[name] = ["ok", fn()]
    except OSError as e:
        out[name] = ["error", errno.errorcode.get(e.errno, str(e.errno))]
attempt("listdir", lambda: sorted(os.listdir(root)))
attempt("stat", lambda: oct(os.stat(f).st_mode))
attempt("read", lambda: open(f, "rb").read().hex())
attempt("write", lambda: os.open(f, os.O_WRONLY) and "opened")
attempt("create", lambda: os.open(os.path.join(root, "new"), os.O_WRONLY | os.O_CREAT, 0o644) and "created")
out["access_r"] = os.access(f, os.R_OK)
out["access_w"] = os.access(f, os.W_OK)
out["access_x"] = os.access(f, os.X_OK)
print(json.dumps(out))
"""


@pytest.fixture
def public_dir():
    """A folder every user can reach (pytest's tmp dirs are 0700), removed afterwards; ask
    for it before `mounts` so that it outlives the mounts' teardown."""
    d = Path(tempfile.mkdtemp(prefix="ckptfs-access-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    for sub in d.iterdir():
        if mount_entry(sub) is None:
            shutil.rmtree(sub, ignore_errors=True)
    if not any(d.iterdir()):
        d.rmdir()


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("access") / "small.pt"
    torch.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(4)}, path)
    return path


def mount_public(mounts, public_dir, source, *opts) -> Path:
    mnt = public_dir / "mnt"
    mnt.mkdir()
    mnt.chmod(0o755)
    args = ["-o", ",".join(opts)] if opts else []
    return mounts.mount(source, mnt, *args)


def probe_as_nobody(mnt: Path) -> dict:
    res = as_nobody(sys.executable, "-S", "-c", PROBE, mnt)
    assert res.returncode == 0 and not res.timed_out, res.describe()
    return json.loads(res.stdout)


def test_default_mount_is_private(ckptfs_bin, public_dir, mounts, small_ckpt):
    mnt = mount_public(mounts, public_dir, small_ckpt)
    entry = mount_entry(mnt)
    assert "allow_other" not in entry["options"]
    assert "default_permissions" in entry["options"]
    # The owner (root) reads it...
    assert (mnt / "model.safetensors").read_bytes()[:8]
    # ...nobody else even sees inside.
    got = probe_as_nobody(mnt)
    for probe in ("listdir", "stat", "read"):
        assert got[probe] == ["error", "EACCES"], (probe, got)
    assert not got["access_r"]


def test_allow_other_opens_read_only_access(ckptfs_bin, public_dir, mounts, small_ckpt):
    mnt = mount_public(mounts, public_dir, small_ckpt, "allow_other")
    entry = mount_entry(mnt)
    assert "allow_other" in entry["options"] and "default_permissions" in entry["options"]
    got = probe_as_nobody(mnt)
    assert got["listdir"][0] == "ok" and "model.safetensors" in got["listdir"][1], got
    assert got["read"] == ["ok", (mnt / "model.safetensors").read_bytes().hex()]
    assert int(got["stat"][1], 8) == stat.S_IFREG | 0o444
    # Permission bits apply (default_permissions): no write, no execute, no new files.
    assert got["access_r"] and not got["access_w"] and not got["access_x"]
    assert got["write"][0] == "error" and got["write"][1] in ("EACCES", "EROFS"), got
    assert got["create"][0] == "error" and got["create"][1] in ("EACCES", "EROFS"), got


def test_allow_other_with_default_permissions_attributes(ckptfs_bin, public_dir, mounts, small_ckpt):
    """-o allow_other,default_permissions (what the README recommends): owner is the
    mounting user, files 0444, folders 0555, everywhere in the tree."""
    mnt = mount_public(mounts, public_dir, small_ckpt, "allow_other", "default_permissions")
    entry = mount_entry(mnt)
    assert "allow_other" in entry["options"] and "default_permissions" in entry["options"]
    assert entry["options"][0] == "ro"
    for path in [mnt, *mnt.rglob("*")]:
        st = path.stat()
        assert (st.st_uid, st.st_gid) == (os.getuid(), os.getgid()), path
        want = (stat.S_IFDIR | 0o555) if path.is_dir() else (stat.S_IFREG | 0o444)
        assert st.st_mode == want, (path, oct(st.st_mode))
    got = probe_as_nobody(mnt)
    assert got["read"][0] == "ok" and not got["access_w"] and not got["access_x"], got


# --- hostile keys -----------------------------------------------------------------------

HOSTILE_KEYS = [
    "..", ".", "", "...", "../escape", "a/../../etc/passwd", "/abs/path", "a/b", "//", "%2F", "%",
    "x\x00y", "\x00", "nl\nkey", "cr\rkey", "ctl\x01", "del\x7f", "tab\tkey", "esc\x1b[2J",
    "../" * 100,  # long, and its escaped name is shortened with a hash suffix
]


def hostile_state():
    return {k: torch.full((2, 3), float(i)) for i, k in enumerate(HOSTILE_KEYS)}


def check_tree(mnt: Path, expected: dict) -> None:
    """Every entry stays inside MNT, no entry is `.`/`..`/has a `/`, and the manifest maps
    every key to a file holding its bytes."""
    root = os.path.realpath(mnt)
    seen = 0
    for dirpath, dirnames, filenames in os.walk(mnt):
        assert os.path.realpath(dirpath).startswith(root)
        with os.scandir(dirpath) as it:
            names = [e.name for e in it]
        assert sorted(names) == sorted(dirnames + filenames)
        for name in names:
            assert name not in (".", "..") and "/" not in name and "\0" not in name and name, repr(name)
            full = os.path.join(dirpath, name)
            real = os.path.realpath(full)
            assert real == os.path.join(os.path.realpath(dirpath), name), repr(full)
            assert os.path.commonpath([root, real]) == root, repr(full)
            assert not os.path.islink(full)
            seen += 1
    assert seen > len(expected)
    manifest = json.loads((mnt / "manifest.json").read_bytes())
    by_key = {t["key"]: t for t in manifest["tensors"]}
    assert set(by_key) == set(expected), set(by_key) ^ set(expected)
    for key, tensor in expected.items():
        rel = by_key[key]["file"]
        assert rel.startswith("tensors/") and "/" not in rel[len("tensors/"):], repr(rel)
        path = mnt / rel
        assert os.path.realpath(path).startswith(root + "/tensors/")
        loaded = load(path.read_bytes())
        assert list(loaded) == [key]
        assert torch.equal(loaded[key], tensor), repr(key)
    model = load((mnt / "model.safetensors").read_bytes())
    assert set(model) == set(expected)


def test_hostile_keys_torch(ckptfs_bin, mounts, tmp_path):
    state = hostile_state()
    nested = {"..": torch.ones(2), "": torch.zeros(3), "/": torch.full((1,), 7.0)}
    src = tmp_path / "hostile.pt"
    torch.save({**state, "sub": nested}, src)
    expected = dict(state)
    expected.update({"sub." + k: v for k, v in nested.items()})
    check_tree(mounts.mount(src), expected)


def test_hostile_keys_safetensors(ckptfs_bin, mounts, tmp_path):
    src = tmp_path / "hostile.safetensors"
    save_file(hostile_state(), src)
    check_tree(mounts.mount(src), hostile_state())
