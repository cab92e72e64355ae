"""Real conversions reported equal: a DCP save against dcp_to_torch_save's output, a ZeRO-3
folder against zero_to_fp32's, a .pt against its `ckptfs export`; and fp32 against its bf16
view, equal only with the tolerance bf16 needs."""

import pytest
import torch

import ckptfs

# These tests load libckptfs.so into the test process.
pytestmark = pytest.mark.loads_libckptfs

# DCP cases whose reference torch can read back itself (<case>.reference.pt), and those
# saved by DCP's safetensors serialization (reference: the default writer's save).
DCP_CASES = ["fsdp2_ws2", "tp_ws2", "tied_ws2"]
DCP_SHARDED_CASES = ["st_fsdp2_ws2", "st_tp_ws2"]
ZERO3_CASES = ["w2-s3-fp32", "w4-s3-bf16", "w2-s3-bf16-sg8"]
# bf16 keeps 8 significant bits: rounding to nearest moves a normal value by at most half a unit
# in its last place, 2^-8 of the magnitude of either the value or its rounding.
BF16_RTOL = 2.0**-8


def assert_reported_equal(code, result, count):
    assert code == 0 and result["equal"] is True, result
    assert result["only_in_a"] == [] and result["only_in_b"] == []
    assert len(result["tensors"]) == count > 0
    assert all(t["status"] in ("identical", "equal") for t in result["tensors"])


@pytest.mark.parametrize("case", DCP_CASES)
def test_dcp_save_equals_dcp_to_torch_save(case, dcp_fixtures_root, diff_json, ls_json):
    code, result = diff_json(dcp_fixtures_root / case, dcp_fixtures_root / f"{case}.reference.pt")
    assert_reported_equal(code, result, len(ls_json(dcp_fixtures_root / case)))


@pytest.mark.parametrize("case", DCP_SHARDED_CASES)
def test_dcp_safetensors_saves_equal_torch_save(case, dcp_fixtures_root, diff_json, ls_json):
    code, result = diff_json(dcp_fixtures_root / case, dcp_fixtures_root / f"{case}.torch_save")
    assert_reported_equal(code, result, len(ls_json(dcp_fixtures_root / case)))


@pytest.mark.parametrize("case", ZERO3_CASES)
def test_zero3_folder_equals_zero_to_fp32(case, zero_fixtures_root, diff_json, ls_json):
    folder = zero_fixtures_root / case
    code, result = diff_json(folder / "checkpoint", folder / "zero_to_fp32.pt")
    assert_reported_equal(code, result, len(ls_json(folder / "checkpoint")))
    # zero_to_fp32 casts float buffers to fp32; ckptfs serves them as stored: equal values
    # of another dtype, which the values (not the bytes) decide.
    for t in result["tensors"]:
        if t["dtype_a"] != t["dtype_b"]:
            assert t["status"] == "equal" and t["differing"] == 0 and t["max_abs"] == 0


def test_pt_equals_its_export(tmp_path, run_ckptfs, diff_json):
    torch.manual_seed(1)
    state = {"emb.weight": torch.randn(64, 32), "fc.bias": torch.randn(32).half(),
             "step": torch.tensor(7), "mask": torch.rand(5) > 0.5, "freq": torch.randn(3, dtype=torch.complex64)}
    torch.save(state, tmp_path / "ck.pt")
    run_ckptfs("export", tmp_path / "ck.pt", tmp_path / "out")
    code, result = diff_json(tmp_path / "ck.pt", tmp_path / "out" / "model.safetensors")
    assert_reported_equal(code, result, len(state))
    assert all(t["status"] == "identical" for t in result["tensors"])


def test_fp32_against_bf16_view_needs_the_bf16_tolerance(tmp_path, run_ckptfs, diff_json):
    torch.manual_seed(2)
    state = {"a": torch.randn(300, 70), "b": torch.randn(1000) * 1e-3, "ids": torch.arange(9)}
    torch.save(state, tmp_path / "ck.pt")
    source = tmp_path / "ck.pt"

    code, result = diff_json("--dtype-b", "bf16", source, source)
    assert code == 1 and result["equal"] is False
    by_key = {t["key"]: t for t in result["tensors"]}
    assert by_key["ids"]["status"] == "identical"
    for key in ("a", "b"):
        t = by_key[key]
        assert t["dtype_b"] == "bfloat16" and t["status"] == "different"
        expected = state[key].double() - state[key].bfloat16().double()
        assert t["differing"] == int((expected != 0).sum())
        assert t["max_abs"] == float(expected.abs().max())

    code, result = diff_json("--dtype-b", "bf16", "--rtol", BF16_RTOL, source, source)
    assert code == 0 and result["equal"] is True
    assert {t["status"] for t in result["tensors"]} == {"equal", "identical"}
    # The same with the mount's -o spelling for side B, and through Python.
    code, _ = diff_json("-b", "dtype=bf16", "--rtol", BF16_RTOL, source, source)
    assert code == 0
    assert ckptfs.diff(source, source, b_options={"dtype": "bf16"}, rtol=BF16_RTOL)["equal"] is True
    assert ckptfs.diff(source, source, b_options={"dtype": "bf16"})["equal"] is False
    # Half the tolerance bf16 needs is not enough.
    code, result = diff_json("--dtype-b", "bf16", "--rtol", BF16_RTOL / 4, source, source)
    assert code == 1
