"""The Debian package built by CPack holds a working ckptfs, its man page and the
mount.ckptfs helper link, and depends on fuse3."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "data" / "sample-mlp-training.pt"


@pytest.fixture(scope="module")
def deb(tmp_path_factory):
    build = Path(os.environ.get("CKPTFS_BUILD_DIR", REPO / "build"))
    out = tmp_path_factory.mktemp("deb")
    subprocess.run(["cpack", "-G", "DEB", "-B", str(out)], cwd=build, check=True,
                   capture_output=True, timeout=300)
    debs = list(out.glob("ckptfs_*.deb"))
    assert len(debs) == 1, debs
    return debs[0]


def field(deb, name):
    return subprocess.run(["dpkg-deb", "-f", str(deb), name], check=True, capture_output=True,
                          text=True, timeout=60).stdout.strip()


def test_control_fields(deb):
    assert field(deb, "Package") == "ckptfs"
    depends = [d.strip().split(" ")[0] for d in field(deb, "Depends").split(",")]
    assert "fuse3" in depends
    assert "libfuse3-3" in depends


def test_contents_run(deb, tmp_path):
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=60)
    binary = root / "usr/bin/ckptfs"
    assert os.access(binary, os.X_OK)
    assert os.readlink(root / "usr/sbin/mount.ckptfs") == "../bin/ckptfs"
    assert (root / "usr/share/man/man1/ckptfs.1.gz").stat().st_size > 0
    assert (root / "usr/share/doc/ckptfs/examples/mnt-ckpt.mount").is_file()
    # The packaged (stripped) binary runs and reads the sample checkpoint.
    ls = subprocess.run([str(binary), "ls", "--json", str(SAMPLE)], check=True, capture_output=True,
                        text=True, timeout=60)
    assert '"key": "model.0.weight"' in ls.stdout


@pytest.mark.skipif(shutil.which("man") is None, reason="man is not installed")
def test_man_page_renders(deb, tmp_path):
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=60)
    text = subprocess.run(["man", "-l", "-P", "cat", str(root / "usr/share/man/man1/ckptfs.1.gz")],
                          check=True, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MANWIDTH": "80"}).stdout
    text = " ".join(text.split())  # man justifies and wraps lines
    assert "mount machine-learning checkpoints" in text
    assert "fuse.ckptfs" in text


def test_one_version(deb, tmp_path):
    """The .deb, the binary it holds and the CMake project carry one version number."""
    project = re.search(r"project\(ckptfs\s+VERSION\s+([0-9.]+)", (REPO / "CMakeLists.txt").read_text()).group(1)
    assert field(deb, "Version") == project
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=60)
    out = subprocess.run([str(root / "usr/bin/ckptfs"), "--version"], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    assert out == f"ckptfs {project}\n"
