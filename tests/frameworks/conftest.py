"""Fixtures for tests/frameworks: checkpoints as the training frameworks write them (Hugging Face
Trainer and accelerate folders, FSDP rank files, veRL, DeepSpeed universal, older Megatron),
each written by the framework itself from PyPI.

A framework whose versions the base environment cannot hold (transformers 4 beside 5,
megatron-core that wants numpy 1, veRL's pins) runs in an overlay environment
(scripts/setup-venv.sh NAME, tests/requirements-NAME.txt) as the fixture generator's python:
`cached_fixtures_or_fail(GENERATOR, overlay=NAME)`. The generator writes, beside each
checkpoint, what the framework itself loads from it (a safetensors file of the reference
tensors), so the comparison runs here with the base environment's torch, bit for bit.
"""

import sys
from pathlib import Path

SUITE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SUITE_DIR))

from ckptfs_testlib import (  # noqa: E402,F401  (shared fixtures)
    cached_fixtures_or_fail,
    ckptfs_bin,
    ls_json,
    run_ckptfs,
)
