"""Fixtures for tests/hardening: fault injection, access control and a load test on real
mounts. The mount machinery is the `mounts` fixture of tests/ckptfs_mounts.py: every command
has a timeout, every test body has a pytest-timeout deadline, every mount is torn down, also
after a failure."""

from pathlib import Path

import pytest

from ckptfs_testlib import ckptfs_bin, small_mixed_tensors  # noqa: F401  (shared fixture)


def make_large_checkpoint(path: Path, megabytes: int = 256) -> None:
    """A torch.save checkpoint of about MEGABYTES: big float32, float16, bfloat16 and int64
    tensors, a transposed (non-contiguous, served by gathering) float32 matrix, a view with a
    storage offset, and a few hundred small tensors of mixed dtypes so that ranges of
    model.safetensors cross many segment boundaries."""
    import torch

    g = torch.Generator().manual_seed(606)
    unit = megabytes * (1 << 20) // 16  # bytes per share
    state = {
        "big.f32": torch.randn(unit * 5 // 4, generator=g).reshape(-1, 1024),  # 5 shares
        "big.f16": torch.randn(unit * 3 // 2, generator=g).to(torch.float16).reshape(-1, 512),  # 3
        "big.bf16": torch.randn(unit * 3 // 2, generator=g).to(torch.bfloat16).reshape(-1, 256),  # 3
        "big.i64": torch.randint(-(2**40), 2**40, (unit * 2 // 8,), generator=g),  # 2
        "big.transposed": torch.randn(1024, unit * 2 // 4 // 1024, generator=g).t(),  # 2, strides (1, n)
    }
    flat = torch.randn(unit // 4, generator=g)  # 1 share
    state["window.full"] = flat
    state["window.view"] = flat[1000:1000 + 4096 * 8].view(4096, 8)  # offset into full's storage
    dtypes = [torch.float32, torch.float16, torch.int8, torch.bool, torch.float64, torch.int32, torch.bfloat16]
    state.update(small_mixed_tensors(g, 300, 5000, dtypes))
    torch.save({"state": state, "step": 7}, path)


@pytest.fixture(scope="session")
def large_ckpt(tmp_path_factory):
    """A ~256 MB torch.save checkpoint (make_large_checkpoint)."""
    path = tmp_path_factory.mktemp("large") / "large.pt"
    make_large_checkpoint(path)
    return path
