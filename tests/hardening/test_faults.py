"""Faults:
- the daemon killed with SIGKILL leaves a dead mount that `fusermount3 -u` clears, and a
  remount at the same mountpoint serves the right bytes;
- reads in flight during a lazy unmount, or while the source file is deleted or replaced,
  end with EOF or an error within seconds, never hang, never return wrong bytes;
- `ckptfs export` interrupted half-way (SIGINT, SIGKILL) leaves no partial file under a
  final name (SIGINT leaves no temporary file either).

Readers run in their own processes (killable, with timeouts); every mount is torn down by
the `mounts` fixture."""

import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fusetools import (
    DAEMON_EXIT_S,
    HELPER_TIMEOUT_S,
    _wait_gone,
    daemon_pids,
    mount_entry,
    run_bounded,
)
from ckptfs_checkpoints import medium_checkpoint
from ckptfs_testlib import flatten_tensors

# A reader that loops over PATH until DEADLINE_S: open, read it all in 1 MiB chunks, check
# the SHA-256 of each complete pass against WANT, close, again. Prints one line per pass
# ("PASS" or "MISMATCH") and a last line saying how it ended: "ERROR <errno> <where>" or
# "DEADLINE". It flushes so the parent can see progress while it runs.
READER = r"""
import hashlib, os, sys, time
path, want, deadline = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])
passes = 0
while time.monotonic() < deadline:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        print("ERROR", e.errno, "open", flush=True); sys.exit(0)
    h = hashlib.sha256()
    try:
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            h.update(b)
    except OSError as e:
        print("ERROR", e.errno, "read", flush=True); sys.exit(0)
    finally:
        os.close(fd)
    passes += 1
    print("PASS" if h.hexdigest() == want else "MISMATCH", flush=True)
print("DEADLINE", flush=True)
"""


class Reader:
    """A READER process on PATH; .finish(timeout) -> its output lines (fails on a hang)."""

    def __init__(self, path: Path, want: str, run_for_s: float):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", READER, str(path), want, str(run_for_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def wait_for_passes(self, n: int, timeout: float) -> None:
        """Block until the reader completed N passes (read from its stdout as they come)."""
        self.lines = []
        deadline = time.monotonic() + timeout
        while sum(1 for line in self.lines if line == "PASS") < n:
            assert time.monotonic() < deadline, f"reader made no progress: {self.lines}"
            line = self.proc.stdout.readline().strip()
            assert line, f"reader ended early: {self.proc.stderr.read()}"
            self.lines.append(line)
            assert line == "PASS", f"reader: {self.lines}"

    def finish(self, timeout: float) -> list:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate(timeout=10)
            pytest.fail(f"a read hung: the reader did not finish within {timeout}s (lines so far: {self.lines[-5:]})")
        assert self.proc.returncode == 0, err
        return self.lines + out.split()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
    return h.hexdigest()


def reference_sha(run_ckptfs_bin, source: Path, rel: str) -> str:
    res = run_bounded([run_ckptfs_bin, "cat", source, rel], 120)
    assert res.returncode == 0, res.describe()
    return hashlib.sha256(res.stdout_bytes).hexdigest()


@pytest.fixture(scope="module")
def medium_ckpt(tmp_path_factory):
    """(a ~48 MB torch.save checkpoint (ckptfs_checkpoints.medium_checkpoint), {key: tensor})."""
    state = medium_checkpoint()
    path = tmp_path_factory.mktemp("medium") / "medium.pt"
    torch.save(state, path)
    return path, flatten_tensors(torch.load(path, weights_only=True))


def check_tensors(mountpoint: Path, expected: dict) -> None:
    got = load_file(mountpoint / "model.safetensors")
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v.contiguous()), k


# --- SIGKILL ---------------------------------------------------------------------------


def test_sigkill_daemon_then_fusermount_then_remount(ckptfs_bin, mounts, medium_ckpt):
    source, expected = medium_ckpt
    mnt = mounts.mount(source)
    check_tensors(mnt, expected)
    pids = daemon_pids(mnt, ckptfs_bin)
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    assert not _wait_gone(pids, DAEMON_EXIT_S), "daemon survived SIGKILL"

    # The mount is dead: what reaches the daemon (statfs, readdir; attributes may come from
    # the kernel's cache) fails with ENOTCONN, or ECONNABORTED when the kernel sees the
    # connection aborted while the request is queued. In a subprocess: never block the test.
    probe = run_bounded([sys.executable, "-c", f"import os; os.statvfs({str(mnt)!r})"], HELPER_TIMEOUT_S)
    assert not probe.timed_out and probe.returncode != 0, probe.describe()
    assert ("Transport endpoint is not connected" in probe.stderr
            or "Software caused connection abort" in probe.stderr), probe.stderr
    assert mount_entry(mnt) is not None, "the dead mount should still be listed until it is unmounted"

    res = run_bounded(["fusermount3", "-u", mnt], HELPER_TIMEOUT_S)
    assert res.returncode == 0, res.describe()
    assert mount_entry(mnt) is None

    mounts.mount(source, mnt)  # same mountpoint
    check_tensors(mnt, expected)
    assert len(daemon_pids(mnt, ckptfs_bin)) == 1


# --- reads in flight ---------------------------------------------------------------------

READ_FILE = "tensors/big.safetensors"


def test_reads_in_flight_during_lazy_unmount(ckptfs_bin, mounts, medium_ckpt):
    """fusermount3 -uz while a reader loops over a 32 MB tensor file: open files keep being
    served until closed (that is what lazy means), the next open fails, the reader ends, and
    the daemon exits once the last file is closed."""
    source, _ = medium_ckpt
    mnt = mounts.mount(source)
    want = reference_sha(ckptfs_bin, source, READ_FILE)
    pids = daemon_pids(mnt, ckptfs_bin)
    reader = Reader(mnt / READ_FILE, want, 60)
    reader.wait_for_passes(2, 30)
    res = run_bounded(["fusermount3", "-uz", mnt], HELPER_TIMEOUT_S)
    assert res.returncode == 0, res.describe()
    lines = reader.finish(timeout=20)
    print("reader:", " ".join(lines[-6:]))
    assert "MISMATCH" not in lines, lines
    # The pass in flight completes (its file stays open); the next open fails.
    assert lines[-3:] == ["ERROR", str(errno.ENOENT), "open"], f"the reader never saw the unmount: {lines[-5:]}"
    assert not _wait_gone(pids, DAEMON_EXIT_S), "daemon still running after a lazy unmount with no open files"
    assert mount_entry(mnt) is None


@pytest.mark.parametrize("how", ["delete", "replace"])
def test_reads_in_flight_when_source_changes(ckptfs_bin, mounts, medium_ckpt, tmp_path, how):
    """The source file is deleted (or atomically replaced by a different checkpoint) while a
    reader loops over a tensor file: the reader gets EIO within seconds (never a hang, never
    bytes of another file), and the mount still unmounts cleanly."""
    src, _ = medium_ckpt
    source = tmp_path / "victim.pt"
    shutil.copyfile(src, source)
    mnt = mounts.mount(source)
    want = reference_sha(ckptfs_bin, source, READ_FILE)
    reader = Reader(mnt / READ_FILE, want, 60)
    reader.wait_for_passes(2, 30)
    if how == "delete":
        source.unlink()
    else:
        other = tmp_path / "other.pt"
        torch.save({"big": torch.zeros(8 << 20).reshape(-1, 1024)}, other)
        os.rename(other, source)
    lines = reader.finish(timeout=30)
    print("reader:", " ".join(lines[-6:]))
    assert "MISMATCH" not in lines, lines
    assert lines[-3:-1] == ["ERROR", str(errno.EIO)], f"expected EIO, got {lines[-5:]}"
    mounts.unmount(mnt)


# --- interrupted export -----------------------------------------------------------------


def virtual_sizes(mnt: Path) -> dict:
    return {
        str(p.relative_to(mnt)): p.stat().st_size for p in sorted(mnt.rglob("*")) if p.is_file()
    }


def files_under(root: Path) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def is_temp_name(rel: str) -> bool:
    return ".ckptfs-tmp-" in Path(rel).name and Path(rel).name.startswith(".")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_export_interrupted_leaves_no_partial_file(ckptfs_bin, mounts, large_ckpt, tmp_path, sig):
    out = tmp_path / "out"
    proc = subprocess.Popen([str(ckptfs_bin), "export", "--write", "all", str(large_ckpt), str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    # SIGINT once a temporary file holds 32 MB (half-way through model.safetensors); SIGKILL
    # later, once model.safetensors is in place and a large tensor file is half-written.
    def half_way() -> bool:
        if not out.exists():
            return False
        if sig == signal.SIGKILL and not (out / "model.safetensors").exists():
            return False
        for p in out.rglob(".*ckptfs-tmp-*"):
            try:
                if p.stat().st_size >= (32 << 20 if sig == signal.SIGINT else 8 << 20):
                    return True
            except FileNotFoundError:  # renamed into place meanwhile
                pass
        return False

    deadline = time.monotonic() + 120
    started = time.monotonic()
    try:
        while not half_way():
            assert proc.poll() is None, f"export finished before it could be interrupted: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "export wrote no large temporary file"
            time.sleep(0.01)
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -sig, f"export ended with {proc.returncode}, not by {sig.name}"
    print(f"{sig.name} after {time.monotonic() - started:.1f}s")

    mnt = mounts.mount(large_ckpt)
    sizes = virtual_sizes(mnt)
    written = files_under(out)
    finals = [f for f in written if not is_temp_name(f)]
    temps = [f for f in written if is_temp_name(f)]
    for rel in finals:
        assert rel in sizes, f"unexpected file {rel}"
        assert (out / rel).stat().st_size == sizes[rel], f"{rel} is partial under its final name"
        if sizes[rel] < 1 << 20:
            assert (out / rel).read_bytes() == (mnt / rel).read_bytes(), rel
        else:
            assert sha256(out / rel) == sha256(mnt / rel), rel
    assert len(finals) < len(sizes), "the export completed: nothing was interrupted"
    print(f"{len(finals)} of {len(sizes)} files complete, temporary files left: {temps}")
    if sig == signal.SIGINT:
        assert temps == [], f"SIGINT left temporary files: {temps}"
    else:
        assert len(temps) <= 1, temps  # SIGKILL: the one being written stays, under its temp name
    # A rerun into the same folder completes it (and replaces nothing with a partial file).
    res = run_bounded([ckptfs_bin, "export", "--write", "all", large_ckpt, out], 300)
    assert res.returncode == 0, res.describe()
    assert sorted(f for f in files_under(out) if not is_temp_name(f)) == sorted(sizes)
    for rel in ("model.safetensors", "manifest.json"):
        assert (out / rel).stat().st_size == sizes[rel]
