"""Fixtures for the FUSE suite: real `ckptfs SOURCE MOUNTPOINT` mounts of real checkpoints,
read with the real torch, safetensors, transformers and rsync.

A hung FUSE mount must never hang the run:
- every command (ckptfs, fusermount3, mount, rsync, pgrep) runs with a timeout;
- every test body has a pytest-timeout deadline (pytest.ini), so a read that blocks on a
  broken mount turns into a test failure (tests/ckptfs_mounts.py frees a body stuck in the
  kernel);
- the `mounts` fixture (tests/ckptfs_mounts.py) always tears its mounts down, also when the
  test failed or timed out: fusermount3 -u, else fusermount3 -uz, then the daemon (found with
  pgrep -f on the mountpoint) is waited for and killed if it lingers, which also frees
  blocked readers.

The whole suite is skipped only when the machine has no /dev/fuse or no fusermount3."""

import os
import shutil
from pathlib import Path

import pytest

# transformers must never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from ckptfs_testlib import ckptfs_bin, run_ckptfs, small_mixed_tensors  # noqa: E402,F401  (shared fixtures)
from minilm import minilm_dir  # noqa: E402,F401  (shared fixture)


@pytest.fixture(autouse=True)
def every_test_mounts(requires_fuse):
    """Every test of this suite is about mounts: all of them skip where FUSE is unavailable."""


# --- checkpoints -----------------------------------------------------------------------


def make_training_checkpoint(path: Path) -> None:
    """A nested training checkpoint written by the real torch.save: model with a tied
    weight, real Adam state after two steps, several dtypes, a transposed (non-contiguous)
    tensor, a view with a storage offset, and keys that contain '/' and '%'."""
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.proj = nn.Linear(16, 32)
            self.norm = nn.LayerNorm(32)
            self.out = nn.Linear(32, 16)
            self.head = nn.Linear(16, 64, bias=False)
            self.head.weight = self.embed.weight  # tied

        def forward(self, ids):
            h = self.out(torch.relu(self.norm(self.proj(self.embed(ids)))))
            return self.head(h)

    torch.manual_seed(1234)
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        ids = torch.randint(0, 64, (4, 8))
        loss = nn.functional.cross_entropy(model(ids).reshape(-1, 64), ids.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    base = torch.randn(24, 40)
    flat = torch.randn(100)
    ckpt = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 3,
        "global_step": 2,
        "extra": {
            "bf16": torch.randn(12, 20).to(torch.bfloat16),
            "fp16": torch.randn(9, 7).to(torch.float16),
            "int64": torch.arange(-30, 30, dtype=torch.int64).reshape(6, 10),
            "mask": torch.rand(10, 6) > 0.5,
            "transposed": base.t(),  # (40, 24) view with strides (1, 40)
            "full": flat,
            "window": flat[10:50].view(5, 8),  # shares `full`'s storage at offset 10
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "special": torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-40]),
        },
        "layers/with/slashes": {"w%1": torch.randn(5, 6)},
    }
    torch.save(ckpt, path)


@pytest.fixture(scope="session")
def training_ckpt(tmp_path_factory):
    """(path of the .pt, {flattened key: tensor} as torch.load reads it back)."""
    import torch

    from fusetools import flatten_tensors

    path = tmp_path_factory.mktemp("training") / "training-state.pt"
    make_training_checkpoint(path)
    expected = flatten_tensors(torch.load(path, weights_only=True))
    assert len(expected) > 20
    return path, expected


def make_big_checkpoint(path: Path) -> None:
    """About 36 MB over 300+ tensors: large ones so reads span many FUSE requests, a
    transposed one (served by gathering elements), and many small ones of mixed dtypes so
    random ranges of model.safetensors cross many segment boundaries."""
    import torch

    g = torch.Generator().manual_seed(7)
    state = {
        "big.f32": torch.randn(1024, 4096, generator=g),
        "big.transposed": torch.randn(1024, 1024, generator=g).t(),
        "big.f16": torch.randn(2048, 1024, generator=g).to(torch.float16),
        "big.bf16": torch.randn(2048, 1024, generator=g).to(torch.bfloat16),
        "big.i64": torch.randint(-(2**40), 2**40, (256 * 1024,), generator=g),
    }
    dtypes = [torch.float32, torch.float16, torch.int8, torch.bool, torch.float64, torch.int32]
    state.update(small_mixed_tensors(g, 320, 6000, dtypes))
    torch.save({"state": state, "note": "concurrency test"}, path)


@pytest.fixture(scope="session")
def big_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "big.pt"
    make_big_checkpoint(path)
    return path


@pytest.fixture(scope="session")
def rsync_bin():
    path = shutil.which("rsync")
    if path is None:
        pytest.fail("rsync is not installed (Debian package rsync)", pytrace=False)
    return path
