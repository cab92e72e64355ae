"""The overlay environments the framework fixtures run in hold what their requirements pin,
over the base environment's torch (scripts/setup-venv.sh NAME)."""

import subprocess

import pytest

from ckptfs_fixture_cache import overlay_python, overlay_requirements, TESTS_DIR


def pins(overlay: str) -> dict:
    out = {}
    for line in overlay_requirements(overlay).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[name.strip().split("[")[0]] = version.strip()
    return out


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("overlay", sorted(p.stem.removeprefix("requirements-") for p in TESTS_DIR.glob("requirements-*.txt")))
def test_overlay_has_its_pins_and_the_base_torch(overlay):
    python = overlay_python(overlay)
    want = pins(overlay)
    assert want, f"requirements-{overlay}.txt pins nothing"
    script = (
        "import importlib.metadata as m, json, torch, sys\n"
        f"names = {sorted(want)!r}\n"
        "print(json.dumps({'torch': torch.__version__, **{n: m.version(n) for n in names}}))\n"
    )
    done = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    import json
    import torch

    got = json.loads(done.stdout)
    assert got.pop("torch") == torch.__version__
    assert got == want
