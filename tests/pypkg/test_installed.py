"""The wheel: what it holds, that none of it names a folder of the machine that built it, its
`ckptfs` console command, and the one version number it shares with the binary and the CMake
project."""

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import ckptfs
from ckptfs_testlib import REPO_ROOT, project_version
from machine_paths import machine_folders, strings_naming

# Every format ckptfs reads, as --help names it.
FORMATS = ("torch .pt/.bin", "legacy torch.save", "TorchScript", "torch.export", "safetensors", "DeepSpeed ZeRO",
           "torch.distributed.checkpoint")


def run(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60)


def test_wheel_holds_binary_library_and_package_only(installed):
    import os

    with zipfile.ZipFile(os.environ["CKPTFS_PYPKG_WHEEL"]) as wheel:
        names = set(wheel.namelist())
    assert {"ckptfs/bin/ckptfs", "ckptfs/libckptfs.so", "ckptfs/__init__.py", "ckptfs/py.typed"} <= names
    # Nothing of the test build: no unit tests, fakes or fuzzers.
    strays = [n for n in names if not n.startswith(("ckptfs/", "ckptfs-"))]
    assert not strays, strays
    assert not [n for n in names if re.search(r"_test$|fake|fuzz", n)]


def test_no_folder_of_the_build_machine(installed, tmp_path):
    """No file in the wheel (the binary, the library, the modules, the metadata) names the
    source tree, the wheel's build folder, the environment it was built in, this one or $HOME."""
    wheel = Path(os.environ["CKPTFS_PYPKG_WHEEL"])
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "wheel")
    # run.sh builds in CKPTFS_PYPKG_DIR/cmake and puts the wheel in CKPTFS_PYPKG_DIR/dist.
    folders = machine_folders(wheel.parents[1], installed, Path(os.environ["CKPTFS_PYTHON"]).parents[1])
    found = strings_naming(tmp_path / "wheel", folders)
    assert not found, f"{found} (looked for {folders})"


def test_console_command_runs_the_bundled_binary(installed):
    command = shutil.which("ckptfs")
    assert command is not None and Path(command).parent == installed / "bin", command
    result = run("ckptfs", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for name in FORMATS:
        assert name in text, f"--help does not name {name}: {text}"
    mount_help = " ".join(run("ckptfs", "mount", "--help").stdout.split())
    for name in FORMATS:
        assert name in mount_help, f"mount --help does not name {name}"
    listed = run("ckptfs", "ls", REPO_ROOT / "tests" / "data" / "sample-mlp-training.pt")
    assert listed.returncode == 0 and "model.0.weight" in listed.stdout


def test_errors_are_one_line_with_exit_1(installed, tmp_path):
    result = run("ckptfs", "ls", tmp_path / "nope.pt")
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "nope.pt" in result.stderr, result.stderr


def test_one_version_number(installed):
    version = project_version()
    assert importlib.metadata.version("ckptfs") == version
    assert ckptfs.__version__ == version
    assert run("ckptfs", "--version").stdout == f"ckptfs {version}\n"


def test_import_loads_neither_torch_nor_numpy(installed):
    code = "import sys, ckptfs; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    assert run(sys.executable, "-c", code).stdout.strip() == "[]"


def test_missing_library_says_how_to_install(installed, tmp_path):
    code = "import ckptfs; ckptfs.list_tensors('x.pt')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={"CKPTFS_LIB": str(tmp_path / "libckptfs.so"), "PATH": "/usr/bin:/bin"})
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ckptfs._lib.CkptfsError: ") and "pip install" in last, last
