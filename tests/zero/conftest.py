"""Fixtures for tests/zero: real DeepSpeed ZeRO checkpoints, DeepSpeed's own zero_to_fp32 as
the reference, and the ckptfs binary run on them.

The checkpoints are saved by make_zero_checkpoints.py once per machine, into the fixture cache
(tests/ckptfs_fixture_cache.py: a subprocess with a timeout; DeepSpeed forks one process per
rank, and the whole process group is killed if it hangs). The same subprocess runs DeepSpeed's
unmodified deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint() on every
save dir, so DeepSpeed never trains or forks inside the pytest process.

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

import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest
from safetensors.torch import load_file

SUITE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SUITE_DIR))

from ckptfs_testlib import ckptfs_bin, ls_json, run_ckptfs, zero_fixtures_root  # noqa: E402,F401  (shared fixtures)
from zerotools import ZeroCheckpoint  # noqa: E402


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
            run_ckptfs("export", "--write", "all", source, out)
            cache[source] = Served(source, entries, out)
        return cache[source]

    return get


# --- refusals ---------------------------------------------------------------------------


@pytest.fixture
def assert_refused(run_ckptfs, tmp_path):
    """assert_refused(source, *names): `ckptfs ls` and `ckptfs export` both exit 1 with one
    stderr line `ckptfs: ...` that contains one of NAMES; export creates nothing."""

    def check(source: Path, *names) -> str:
        out = tmp_path / "export-out"
        lines = []
        for argv in (["ls", source], ["export", source, out]):
            result = run_ckptfs(*argv, check=False)
            stderr = result.stderr.decode(errors="replace")
            command = f"ckptfs {argv[0]}"
            assert result.returncode == 1, (
                f"{command}: exit status {result.returncode} (negative: killed by a signal); stderr:\n{stderr}"
            )
            assert result.stdout == b"", f"{command} wrote to stdout for a refused source"
            assert len(stderr.splitlines()) == 1, f"{command}: expected one stderr line, got:\n{stderr}"
            line = stderr.splitlines()[0]
            assert line.startswith("ckptfs: "), line
            assert any(str(name) in line for name in names), f"{command}: {line!r} names none of {names}"
            lines.append(line)
        assert not out.exists(), "a refused export left output behind"
        return lines[0]

    return check
