"""Mounting the way system tools do: mount.fuse3 with -t fuse.ckptfs, mount(8), and the
mount.ckptfs helper mode (argv[0] == mount.ckptfs, as mount(8) runs it for type ckptfs).
Each mount must appear in /proc/mounts as type fuse.ckptfs, named by the absolute source."""

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from fusetools import mount_entry, wait_for_mount

# dash's PATH when none is set: what `sh -c ckptfs ...` searches under mount(8), which
# removes PATH from its environment before running helpers (util-linux sanitize_env).
SH_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def helper_env(ckptfs_bin) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{ckptfs_bin.parent}{os.pathsep}{env.get('PATH', SH_DEFAULT_PATH)}"
    return env


def assert_ckptfs_mount(mnt, source: Path, served_model: bytes):
    entry = mount_entry(mnt)
    assert entry is not None, f"{mnt} is not in /proc/mounts"
    assert entry["fstype"] == "fuse.ckptfs", entry
    assert entry["source"] == os.path.realpath(source), entry
    assert "ro" in entry["options"], entry
    assert (Path(mnt) / "model.safetensors").read_bytes() == served_model


@pytest.fixture
def sample(training_ckpt, run_ckptfs):
    """(a relative SOURCE, its directory to run from, the model.safetensors it serves)."""
    source, _ = training_ckpt
    return Path(source.name), source.parent, run_ckptfs("cat", source, "model.safetensors").stdout


def test_mount_fuse3_with_subtype(sample, mounts, ckptfs_bin):
    rel, cwd, model = sample
    mnt = mounts.new_mountpoint()
    mounts.mount(
        None,
        mnt,
        argv=["mount.fuse3", rel, mnt, "-t", "fuse.ckptfs", "-o", "ro"],
        env=helper_env(ckptfs_bin),
        cwd=cwd,
    )
    assert_ckptfs_mount(mnt, cwd / rel, model)


def test_mount8_fuse_subtype(sample, mounts, ckptfs_bin, tmp_path):
    """`mount -t fuse.ckptfs SRC MNT -o ro`: mount(8) -> mount.fuse3 -> sh -c 'ckptfs ...'.

    mount(8) strips PATH from its helpers' environment (util-linux sanitize_env), so the
    shell finds ckptfs only in its default PATH. When the binary under test is not installed
    there, the test runs in a private mount namespace (unshare -m) in which /usr/local/bin is
    a folder holding just `ckptfs` -> the binary under test, mounts, records /proc/mounts and
    model.safetensors, and unmounts, all inside the namespace."""
    rel, cwd, model = sample
    mnt = mounts.new_mountpoint()
    found = shutil.which("ckptfs", path=SH_DEFAULT_PATH)
    if found is not None and os.path.realpath(found) == str(ckptfs_bin):
        mounts.mount(None, mnt, argv=["mount", "-t", "fuse.ckptfs", rel, mnt, "-o", "ro"], cwd=cwd)
        assert_ckptfs_mount(mnt, cwd / rel, model)
        return
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip(
            "mount(8) strips PATH from its helpers' environment, so `mount -t fuse.ckptfs` "
            f"runs the ckptfs in the default PATH ({SH_DEFAULT_PATH}): that is "
            f"{found or 'nothing'}, not {ckptfs_bin}, and without root and unshare this test "
            "cannot put it there privately"
        )
    fake_bin = tmp_path / "usr-local-bin"
    fake_bin.mkdir()
    (fake_bin / "ckptfs").symlink_to(ckptfs_bin)
    copy = tmp_path / "model-copy"
    script = (
        f"mount --bind '{fake_bin}' /usr/local/bin && "
        f"mount -t fuse.ckptfs '{rel}' '{mnt}' -o ro && "
        f"grep -F ' {mnt} ' /proc/self/mounts && "
        f"cat '{mnt}/model.safetensors' > '{copy}'; "
        f"status=$?; fusermount3 -u '{mnt}'; exit $status"
    )
    res = mounts.start(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script], mnt, cwd=cwd
    )
    assert res.returncode == 0, res.describe()
    fields = res.stdout.split()
    assert fields[:3] == [str(cwd / rel), str(mnt), "fuse.ckptfs"], res.stdout
    assert "ro" in fields[3].split(","), res.stdout
    assert copy.read_bytes() == model


def test_mount8_fuse_program_path(sample, mounts, ckptfs_bin):
    """`mount -t fuse 'PROGRAM#SRC' MNT` names the daemon by absolute path, so mount(8)'s
    sanitized PATH does not matter; ckptfs sets the fuse.ckptfs subtype itself."""
    rel, cwd, model = sample
    mnt = mounts.new_mountpoint()
    source = cwd / rel
    mounts.mount(None, mnt, argv=["mount", "-t", "fuse", f"{ckptfs_bin}#{source}", mnt], cwd=cwd)
    assert_ckptfs_mount(mnt, source, model)


def test_mount_ckptfs_helper_mode(sample, mounts, ckptfs_bin, tmp_path):
    """What mount(8) runs for fstab type `ckptfs`: mount.ckptfs SRC DIR [-sfnv] -o OPTS, with
    mount(8)'s own flags and fstab-only options ignored; it must still daemonize."""
    rel, cwd, model = sample
    helper = tmp_path / "mount.ckptfs"
    helper.symlink_to(ckptfs_bin)
    mnt = mounts.new_mountpoint()
    mounts.mount(
        None,
        mnt,
        argv=[helper, rel, mnt, "-n", "-s", "-f", "-v", "-o",
              "rw,noauto,user,_netdev,nofail,x-systemd.automount"],
        cwd=cwd,
    )
    assert_ckptfs_mount(mnt, cwd / rel, model)


def test_mount_is_ready_when_the_command_returns(training_ckpt, mounts, ckptfs_bin):
    """No polling: the mount is in /proc/mounts and serves files the moment ckptfs exits."""
    source, _ = training_ckpt
    mnt = mounts.new_mountpoint()
    res = mounts.start([ckptfs_bin, source, mnt], mnt)
    assert res.returncode == 0, res.describe()
    assert res.stderr == "" and res.stdout == "", res.describe()
    entry = mount_entry(mnt)
    assert entry is not None, "ckptfs returned before the mount existed"
    assert entry["fstype"] == "fuse.ckptfs", entry
    assert entry["source"] == os.path.realpath(source), entry
    assert "manifest.json" in os.listdir(mnt)


def run_foreground_then_sigterm(source, mounts, ckptfs_bin):
    """Mount with -f, check it serves, SIGTERM the daemon; (exit status, stderr)."""
    mnt = mounts.new_mountpoint()
    mounts.register(mnt)
    proc = subprocess.Popen(
        [str(ckptfs_bin), str(source), str(mnt), "-f"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        assert wait_for_mount(mnt, daemon=proc) is not None, "foreground mount did not appear"
        assert proc.poll() is None, "ckptfs -f exited while mounted"
        assert (mnt / "model.safetensors").stat().st_size > 0
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("ckptfs -f did not exit within 15s of SIGTERM")
        assert mount_entry(mnt) is None, "still mounted after the daemon exited"
        return proc.returncode, err.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)


def test_foreground_daemon_unmounts_on_sigterm(training_ckpt, mounts, ckptfs_bin):
    """-f keeps the daemon in the foreground; SIGTERM makes it unmount and exit."""
    run_foreground_then_sigterm(training_ckpt[0], mounts, ckptfs_bin)


def test_foreground_daemon_exit_status_after_sigterm(training_ckpt, mounts, ckptfs_bin):
    """A requested, clean shutdown is a success: exit status 0 (a service manager running
    `ckptfs -f` would otherwise record every stop as a failure)."""
    status, err = run_foreground_then_sigterm(training_ckpt[0], mounts, ckptfs_bin)
    assert status == 0, f"ckptfs -f exited {status} after SIGTERM and a clean unmount; stderr: {err!r}"
