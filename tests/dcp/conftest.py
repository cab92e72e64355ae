"""Fixtures for tests/dcp: real torch.distributed.checkpoint saves, torch's own
dcp_to_torch_save() as the reference, and the ckptfs binary run on them.

make_dcp_checkpoints.py saves every case once per machine into the fixture cache
(tests/ckptfs_fixture_cache.py, keyed by the generator and the torch and transformers
versions): forked gloo ranks on the CPU. The same subprocess runs
torch.distributed.checkpoint.format_utils.dcp_to_torch_save() on every save and keeps its
output beside it, so the references are cached with the checkpoints and nothing trains or
forks inside pytest. For the cases torch cannot read back itself (st_*: DCP's safetensors
serialization; hf_*: the Hugging Face writer's shards) the reference is dcp_to_torch_save of
the same state saved by the default writer at the same moment (<case>.torch_save/).

What ckptfs must serve for a DCP checkpoint dir (compared bit for bit):
- every tensor of dcp_to_torch_save's nested state dict, under the dotted key DCP gives it
  (dict keys and list indices joined with '.'), with its dtype, shape and bytes;
- every non-tensor leaf (ints, floats, strings, bools, lists of them) in metadata.json at its
  nested path, with the same value.
"""

import json
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest
import torch

SUITE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SUITE_DIR))

from ckptfs_fixture_cache import DCP_CHECKPOINTS  # noqa: E402
from ckptfs_testlib import (  # noqa: E402,F401  (shared fixtures)
    cached_fixtures_or_fail,
    ckptfs_bin,
    flatten_tensors_with_paths,
    ls_json,
    run_ckptfs,
)
from make_dcp_checkpoints import LLAMA_CONFIG_DIR, REFERENCE_SUFFIX  # noqa: E402


@pytest.fixture(scope="session")
def dcp_fixtures_root() -> Path:
    """The folder make_dcp_checkpoints.py filled (<case>/, <case>.reference.pt, cases.json),
    generated once per machine."""
    return cached_fixtures_or_fail(DCP_CHECKPOINTS)


def non_tensor_leaves(obj, path=()) -> dict:
    """{path tuple: value} of every non-tensor leaf of a nested state dict, where DCP's
    traversal stops: dicts are always descended, lists only when they hold a tensor or a
    dict, anything else is one value."""
    if isinstance(obj, torch.Tensor):
        return {}
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict)) for v in obj):
        items = enumerate(obj)
    else:
        return {path: obj}
    leaves = {}
    for name, value in items:
        leaves.update(non_tensor_leaves(value, path + (name,)))
    return leaves


@dataclass
class DcpCase:
    name: str
    root: Path  # the fixture cache entry

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / self.name

    @property
    def config_dir(self) -> Path:
        """config.json of the Llama case."""
        return self.root / LLAMA_CONFIG_DIR

    @cached_property
    def reference(self) -> dict:
        """dcp_to_torch_save's output, loaded (it holds the non-tensor values DCP pickled, so
        not weights_only)."""
        return torch.load(self.root / f"{self.name}{REFERENCE_SUFFIX}", weights_only=False)

    @cached_property
    def tensors_with_paths(self) -> dict:
        """{dotted key: (path, tensor)}: DCP's fqns are the same joins of the nested keys."""
        return flatten_tensors_with_paths(self.reference)

    @cached_property
    def tensors(self) -> dict:
        return {key: tensor for key, (_, tensor) in self.tensors_with_paths.items()}

    @cached_property
    def non_tensor_values(self) -> dict:
        return non_tensor_leaves(self.reference)


@pytest.fixture(scope="session")
def dcp_case(dcp_fixtures_root):
    """dcp_case(name) -> DcpCase; skips, with the generator's reason, a case it could not
    save with this torch on CPU/gloo."""
    info = json.loads((dcp_fixtures_root / "cases.json").read_text())
    cache = {}

    def get(name: str) -> DcpCase:
        if name in info["skipped"]:
            pytest.skip(f"{name} not generated: {info['skipped'][name]}")
        assert name in info["generated"], f"{name}: not in {dcp_fixtures_root / 'cases.json'}"
        if name not in cache:
            cache[name] = DcpCase(name, dcp_fixtures_root)
        return cache[name]

    return get
