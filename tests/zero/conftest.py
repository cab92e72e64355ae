"""Fixtures for tests/zero: real DeepSpeed ZeRO checkpoints, DeepSpeed's own zero_to_fp32 as
the reference, and the ckptfs binary run on them.

The checkpoints are saved once per session by make_zero_checkpoints.py (a subprocess with a
timeout: DeepSpeed forks one process per rank, and the whole process group is killed if it
hangs). The same subprocess runs DeepSpeed's unmodified
deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint() on every save dir, so
DeepSpeed never trains or forks inside the pytest process.

Set CKPTFS_ZERO_FIXTURES=DIR to keep the fixtures in DIR and reuse them in later runs (DIR is
filled once; delete it to rebuild).

What ckptfs must serve for a ZeRO save dir (the tests compare bit for bit, never loosely):
- the keys of zero_to_fp32's state dict, in its order: persistent buffers (in the module's
  order), frozen parameters, trainable parameters (param group by param group, in DeepSpeed's
  param_shapes order), then tied aliases;
- trainable parameters as zero_to_fp32 rebuilds them (fp32 master weights), frozen parameters
  and aliases likewise;
- buffers in their stored dtype (deliberate difference: zero_to_fp32 casts float buffers to
  fp32; the tests check that the two agree after that cast);
- stage 1: zero_to_fp32 drops frozen parameters (DeepSpeed saves no frozen_param_shapes for
  stage 1); ckptfs serves their 16-bit copies from the model states' `module`, in the place
  zero_to_fp32 gives frozen parameters for stages 2 and 3 (after the buffers);
- stage 1 with BF16_Optimizer, which zero_to_fp32 refuses ("not a zero checkpoint"): the same
  layout, with the trainable values taken from the live engine at save time.
"""

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest
from safetensors.torch import load_file

SUITE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SUITE_DIR))

from ckptfs_testlib import REPO_ROOT, ckptfs_bin, ls_json, run_ckptfs  # noqa: E402,F401  (shared fixtures)
from make_zero_checkpoints import FIXTURES  # noqa: E402
from zerotools import DEEPSPEED_VERSION, ZeroCheckpoint  # noqa: E402

GENERATE_TIMEOUT_S = 300  # about 45 s on two cores

# --- generation ---------------------------------------------------------------------------


def _generate(out: Path) -> None:
    """Run the generator into OUT; pytest.fail with its log if it fails or hangs."""
    log_path = out / "generate.log"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    started = time.monotonic()
    with open(log_path, "wb") as log:
        # A new session, so that a hang can be ended by killing the generator and every rank
        # it forked (its process group), and nothing else.
        process = subprocess.Popen(
            [sys.executable, str(SUITE_DIR / "make_zero_checkpoints.py"), str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        try:
            returncode = process.wait(timeout=GENERATE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    if returncode == 0:
        (out / ".complete").write_text(f"{time.monotonic() - started:.1f}s\n")
        return
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
    problem = f"timed out after {GENERATE_TIMEOUT_S}s" if returncode is None else f"exited {returncode}"
    pytest.fail(
        f"DeepSpeed could not save the ZeRO test checkpoints: make_zero_checkpoints.py {problem} "
        f"(needs deepspeed=={DEEPSPEED_VERSION} from tests/requirements.txt, running on the CPU "
        f"with gloo). Full log: {log_path}\n--- last lines ---\n{tail}",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def zero_fixtures_root(tmp_path_factory) -> Path:
    """The folder holding every fixture of make_zero_checkpoints.FIXTURES."""
    kept = os.environ.get("CKPTFS_ZERO_FIXTURES")
    out = Path(kept) if kept else tmp_path_factory.mktemp("zero-fixtures")
    complete = (out / ".complete").exists() and all((out / f.name / "fixture.json").exists() for f in FIXTURES)
    if not complete:
        if kept and out.exists() and any(out.iterdir()):
            pytest.fail(f"CKPTFS_ZERO_FIXTURES={out} is incomplete: delete it to rebuild", pytrace=False)
        out.mkdir(parents=True, exist_ok=True)
        _generate(out)
    return out


@pytest.fixture(scope="session")
def zero_checkpoint(zero_fixtures_root):
    """zero_checkpoint(name) -> the ZeroCheckpoint of a generated fixture (cached)."""
    cache = {}

    def get(name: str) -> ZeroCheckpoint:
        if name not in cache:
            cache[name] = ZeroCheckpoint(name, zero_fixtures_root / name)
        return cache[name]

    return get


# --- running ckptfs -------------------------------------------------------------------------


@dataclass
class Served:
    """What ckptfs serves for one source: `ls --json`, and `export` into a folder."""

    source: Path
    entries: list  # ls --json
    export_dir: Path

    @property
    def keys(self) -> list[str]:
        return [entry["key"] for entry in self.entries]

    @cached_property
    def tensors(self) -> dict:
        """model.safetensors, loaded."""
        return load_file(self.export_dir / "model.safetensors")


@pytest.fixture(scope="session")
def served(run_ckptfs, ls_json, tmp_path_factory):
    """served(source) -> Served, one ls + export per source per session."""
    cache = {}

    def get(source: Path) -> Served:
        source = Path(source)
        if source not in cache:
            entries = ls_json(source)
            out = tmp_path_factory.mktemp("export") / "out"
            run_ckptfs("export", source, out)
            cache[source] = Served(source, entries, out)
        return cache[source]

    return get
