"""Where `ckptfs load` finds a CUDA runtime that NVIDIA's wheels installed into a Python
environment. The binary names no folder of the machine that built it, so it looks where it
runs: beside itself in a site-packages (the wheel's layout), then in $VIRTUAL_ENV. The fake
libcudart of tests/fakes stands in for NVIDIA's; each run names the runtime it took in its one
line (the backend's description when the load succeeds, the error when it does not)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfs_testlib import REPO_ROOT


@pytest.fixture(scope="module")
def fake_cudart() -> Path:
    build = Path(os.environ.get("CKPTFS_BUILD_DIR") or REPO_ROOT / "build")
    fake = build / "tests" / "libfake_cudart.so"
    if not fake.is_file():
        pytest.fail(f"{fake} not found: build the fake_cudart target", pytrace=False)
    return fake


def outside_any_environment() -> dict:
    """This environment less what points a program at a CUDA runtime."""
    return {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CKPTFS_CUDART", "LD_LIBRARY_PATH")}


@pytest.fixture(scope="module", autouse=True)
def no_system_cudart():
    """A libcudart the dynamic linker finds by soname comes before any environment's. Asked
    of a fresh interpreter: this one has torch's runtime loaded already."""
    for soname in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        probe = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({soname!r})"],
                               capture_output=True, timeout=60, env=outside_any_environment())
        if probe.returncode == 0:
            pytest.skip(f"the system has {soname}, which comes first")


def load_cuda(binary, source, **env) -> str:
    """`BINARY load --backend cuda SOURCE`'s output, run outside any Python environment
    unless ENV says otherwise."""
    result = subprocess.run([str(binary), "load", "--backend", "cuda", str(source)], capture_output=True, text=True,
                            timeout=60, env={**outside_any_environment(), **env})
    return result.stdout + result.stderr


def install_runtime(fake, site: Path, wheel_lib: str, name: str) -> Path:
    """FAKE as NVIDIA's wheel installs libcudart into SITE (nvidia/<wheel_lib>/NAME)."""
    lib = site / "nvidia" / wheel_lib / "lib"
    lib.mkdir(parents=True)
    return Path(shutil.copy(fake, lib / name))


def test_runtime_of_the_active_environment(ckptfs_bin, sources, fake_cudart, tmp_path):
    venv = tmp_path / "venv"
    runtime = install_runtime(fake_cudart, venv / "lib" / "python3.12" / "site-packages", "cu13", "libcudart.so.13")
    out = load_cuda(ckptfs_bin, sources["pt"][0], VIRTUAL_ENV=str(venv))
    assert str(runtime) in out, out


def test_runtime_beside_the_binary_in_site_packages(ckptfs_bin, sources, fake_cudart, tmp_path):
    """The wheel's layout: the binary at <site-packages>/ckptfs/bin/ckptfs."""
    site = tmp_path / "env" / "lib" / "python3.11" / "site-packages"
    (site / "ckptfs" / "bin").mkdir(parents=True)
    binary = shutil.copy(ckptfs_bin, site / "ckptfs" / "bin" / "ckptfs")
    runtime = install_runtime(fake_cudart, site, "cuda_runtime", "libcudart.so.12")
    out = load_cuda(binary, sources["pt"][0])
    assert str(runtime) in out, out


def test_no_environment_no_wheel_runtime(ckptfs_bin, sources):
    """Outside any environment the binary finds none, not even the test environment's, which
    the build was configured with."""
    out = load_cuda(ckptfs_bin, sources["pt"][0])
    assert "no CUDA device: libcudart.so.12 not found (tried " in out, out
    assert "site-packages" not in out, out
