"""Every dtype ckptfs reads, compared as float64 values: the figures match torch's."""

import pytest
import torch

from ckptfs_testlib import ALL_DTYPES


def values(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as float64, as the diff takes them (complex: real, imaginary)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.double()


def pair(dtype: torch.dtype, n: int = 4096):
    g = torch.Generator().manual_seed(11)
    if dtype == torch.bool:
        a = torch.rand(n, generator=g) > 0.5
        b = a.clone()
        b[::7] = ~b[::7]
        return a, b
    if not dtype.is_floating_point and not dtype.is_complex:
        hi = 100 if dtype not in (torch.int8, torch.uint8) else 50
        a = torch.randint(0, hi, (n,), generator=g).to(dtype)
        b = a.clone()
        b[::5] = torch.randint(0, hi, b[::5].shape, generator=g).to(dtype)
        return a, b
    real = torch.complex64 if dtype.is_complex else torch.float32
    base = torch.randn(n, generator=g, dtype=real)
    if dtype == torch.float8_e8m0fnu:  # exponent only: positive values
        base = base.abs() + 1e-3
    a = base.to(dtype)
    b = a.clone()
    b[::5] = (base[::5] * 1.5).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_figures_of_every_dtype(dtype, tmp_path, diff_json):
    a, b = pair(dtype)
    torch.save({"t": a}, tmp_path / "a.pt")
    torch.save({"t": b}, tmp_path / "b.pt")
    code, r = diff_json(tmp_path / "a.pt", tmp_path / "b.pt")
    t = r["tensors"][0]
    x, y = values(a), values(b)
    nan_x, nan_y = x.isnan(), y.isnan()
    same = (x == y) | (nan_x & nan_y)
    numbers = ~nan_x & ~nan_y
    d = (x - y)[numbers]
    assert code == 1 and t["status"] == "different", t
    assert t["numel"] == x.numel()
    assert t["differing"] == int((~same).sum())
    assert t["max_abs"] == float(d.abs().max())
    assert t["rel_l2"] == pytest.approx(float(d.pow(2).sum().sqrt() / x[~nan_x].pow(2).sum().sqrt()), rel=1e-12)
    code, r = diff_json(tmp_path / "a.pt", tmp_path / "a.pt")
    assert code == 0 and r["tensors"][0]["status"] == "identical"
