"""The Debian package built by CPack holds a working ckptfs, its man page and the
mount.ckptfs helper link, depends on fuse3, and names no folder of the machine that built it.

The package is made from the build the suite runs against (CKPTFS_BUILD_DIR): cpack only
installs and packs it (seconds), where scripts/build-deb.sh's clean build would compile
everything again (minutes), for every run of the suite. Both builds use the same build type
and flags (scripts/build.sh's and build-deb.sh's); the suite's build adds the test options
(the test environment's python, the tests), so whatever those options let into an installed
file shows up here, which makes the folder check stricter than it would be on the clean
build. A sanitized build is not what ships: the folder check is skipped there."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ckptfs_testlib import project_version
from machine_paths import machine_folders, strings_naming

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "data" / "sample-mlp-training.pt"


def build_dir() -> Path:
    return Path(os.environ.get("CKPTFS_BUILD_DIR", REPO / "build"))


def cache_value(name: str) -> str:
    """The value of NAME in the build's CMakeCache.txt ("" when unset)."""
    for line in (build_dir() / "CMakeCache.txt").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split("=", 1)[1]
    return ""


@pytest.fixture(scope="module")
def deb(tmp_path_factory):
    build = build_dir()
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
    project = project_version()
    assert field(deb, "Version") == project
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=60)
    out = subprocess.run([str(root / "usr/bin/ckptfs"), "--version"], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    assert out == f"ckptfs {project}\n"


def test_no_folder_of_the_build_machine(deb, tmp_path):
    """No file in the package (the binary, the man page, the examples) names the source tree,
    the build folder, the test environment or $HOME."""
    if cache_value("CKPTFS_SANITIZE"):
        pytest.skip("a sanitized build: the package is built without sanitizers")
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=60)
    python = cache_value("CKPTFS_PYTHON")
    folders = machine_folders(build_dir(), Path(python).parents[1] if python else None)
    found = strings_naming(root, folders)
    assert not found, f"{found} (looked for {folders})"
