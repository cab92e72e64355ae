"""The oldest torch the package supports (pyproject.toml, doc/PYTHON.md): Debian 12's
python3-torch 1.13, which scripts/install-deps.sh installs. The installed wheel goes into a
venv of the system python with its site packages; safe_open, get_tensors, slices and
ckptfs.torch.load_file there read what this torch wrote, and a dtype that torch lacks is an
error only for the tensor of that dtype."""

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import save_file

SYSTEM_PYTHON = "/usr/bin/python3"
OLDEST_TORCH = "1.13"

# Run in the old torch's venv: prints what it read as JSON (values as lists).
SCRIPT = r"""
import json, sys
import torch, ckptfs, ckptfs.torch
path, out = sys.argv[1], {"torch": torch.__version__, "module": ckptfs.__file__}
with ckptfs.safe_open(path, "pt") as f:
    out["keys"], out["offset_keys"] = f.keys(), f.offset_keys()
    out["tensors"] = {k: f.get_tensor(k).float().tolist() for k in ("w", "h", "b")}
    out["slice"] = f.get_slice("w")[1:, ::2].tolist()
    try:
        f.get_tensor("e8m0")
    except ckptfs.CkptfsError as e:
        out["e8m0"] = str(e)
    try:
        f.get_tensors()
    except ckptfs.CkptfsError as e:
        out["get_tensors"] = str(e)
out["load_file"] = {k: t.float().tolist() for k, t in ckptfs.torch.load_file(sys.argv[2]).items()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def old_torch_python(tmp_path_factory):
    """The python of a venv over the system python (its torch), with the wheel installed."""
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True) if os.access(SYSTEM_PYTHON, os.X_OK) else None
    if probe is None or probe.returncode != 0:
        pytest.skip("Debian's python3-torch is not installed (scripts/install-deps.sh installs it)")
    assert probe.stdout.startswith(OLDEST_TORCH), probe.stdout
    venv = tmp_path_factory.mktemp("old-torch") / "venv"
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--disable-pip-version-check", os.environ["CKPTFS_PYPKG_WHEEL"]], check=True, timeout=120)
    return venv / "bin" / "python"


def test_oldest_torch_reads_and_refuses_only_what_it_lacks(old_torch_python, tmp_path):
    state = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 3,
        "h": torch.linspace(-1, 1, 5, dtype=torch.bfloat16),
        "b": torch.tensor([True, False]),
        "e8m0": torch.arange(4, dtype=torch.uint8).view(torch.float8_e8m0fnu),
    }
    path, plain = tmp_path / "mixed.safetensors", tmp_path / "plain.safetensors"
    save_file(state, path)
    save_file({k: state[k] for k in ("w", "h")}, plain)
    res = subprocess.run([str(old_torch_python), "-c", SCRIPT, str(path), str(plain)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["torch"].startswith(OLDEST_TORCH)
    assert got["module"].startswith(str(old_torch_python.parents[1])), "the wheel, not this environment's"
    assert got["keys"] == sorted(state)
    for key in ("w", "h", "b"):
        assert got["tensors"][key] == state[key].float().tolist(), key
    assert got["slice"] == state["w"][1:, ::2].tolist()
    lacking = f"torch {got['torch']} has no dtype for F8_E8M0"
    assert got["e8m0"] == lacking
    assert got["get_tensors"] == lacking
    assert got["load_file"] == {k: state[k].float().tolist() for k in ("h", "w")}
