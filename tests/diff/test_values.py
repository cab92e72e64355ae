"""What ckptfs diff reports, against torch's own arithmetic: keys on one side only, shapes,
dtypes, NaN, integers, tensors compared in several chunks on several threads; the summary,
and the exit status."""

import os
import pty
import select
import subprocess

import pytest
import torch
from safetensors.torch import save_file

import ckptfs

# These tests load libckptfs.so into the test process.
pytestmark = pytest.mark.loads_libckptfs


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm())


def test_keys_shapes_and_dtypes(tmp_path, diff_json):
    torch.manual_seed(3)
    a = {"same": torch.randn(10), "gone": torch.randn(2), "reshaped": torch.randn(4, 6), "cast": torch.randn(8),
         "ints": torch.arange(20, dtype=torch.int32), "flags": torch.tensor([True, False])}
    b = {"same": a["same"].clone(), "new": torch.zeros(3), "reshaped": a["reshaped"].reshape(6, 4).clone(),
         "cast": a["cast"].double(), "ints": a["ints"] + (torch.arange(20) == 7).int() * 5,
         "flags": torch.tensor([True, True])}
    torch.save(a, tmp_path / "a.pt")
    save_file(b, tmp_path / "b.safetensors")
    code, r = diff_json(tmp_path / "a.pt", tmp_path / "b.safetensors")
    assert code == 1 and r["equal"] is False
    assert r["only_in_a"] == ["gone"] and r["only_in_b"] == ["new"]
    t = {x["key"]: x for x in r["tensors"]}
    assert [x["key"] for x in r["tensors"]] == ["same", "reshaped", "cast", "ints", "flags"]
    assert t["same"]["status"] == "identical"
    assert t["reshaped"]["status"] == "shape" and t["reshaped"]["shape_a"] == [4, 6] and t["reshaped"]["shape_b"] == [6, 4]
    assert "differing" not in t["reshaped"]
    # float32 widened to float64 is the same value: equal, though no byte is.
    assert t["cast"]["status"] == "equal" and (t["cast"]["dtype_a"], t["cast"]["dtype_b"]) == ("float32", "float64")
    assert t["ints"]["status"] == "different" and t["ints"]["differing"] == 1 and t["ints"]["max_abs"] == 5
    assert t["ints"]["rel_l2"] == pytest.approx(5 / float(a["ints"].double().norm()), rel=1e-15)
    assert t["flags"]["differing"] == 1 and t["flags"]["max_rel"] is None  # 0 -> 1: infinite
    assert r["counts"] == {"identical": 1, "equal": 1, "different": 2, "shape": 1, "incomparable": 0,
                           "only_in_a": 1, "only_in_b": 1}


def test_chunks_on_threads_match_torch(tmp_path, diff_json):
    # 3.5M floats: four chunks of 4 MiB. The first three are identical on both sides (they
    # skip the arithmetic), the last differs, so ||A|| must still cover the whole tensor.
    torch.manual_seed(4)
    a = {"big": torch.randn(3_500_000), "small": torch.randn(5)}
    b = {"big": a["big"].clone(), "small": a["small"] * 2}
    b["big"][-1000:] += torch.linspace(-1, 1, 1000)
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    for threads in ("1", "3"):
        code, r = diff_json("--threads", threads, tmp_path / "a.pt", tmp_path / "b.pt")
        t = {x["key"]: x for x in r["tensors"]}
        d = a["big"].double() - b["big"].double()
        assert code == 1
        assert t["big"]["differing"] == int((d != 0).sum())
        assert t["big"]["max_abs"] == float(d.abs().max())
        assert t["big"]["rel_l2"] == pytest.approx(rel_l2(a["big"], b["big"]), rel=1e-12, abs=0)
        assert t["small"]["rel_l2"] == pytest.approx(1.0, rel=1e-15)


def test_nan_equals_nan_and_not_a_number(tmp_path, diff_json):
    a = {"x": torch.tensor([1.0, float("nan"), float("nan"), 0.0, float("inf")])}
    b = {"x": torch.tensor([1.0, float("nan"), 2.0, -0.0, float("inf")])}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    code, r = diff_json(tmp_path / "a.pt", tmp_path / "b.pt")
    x = r["tensors"][0]
    # NaN against NaN, 0 against -0 and inf against inf are equal; NaN against 2 is not.
    assert code == 1 and x["differing"] == 1 and x["max_abs"] == 0
    code, r = diff_json(tmp_path / "a.pt", tmp_path / "a.pt")
    assert code == 0 and r["tensors"][0]["status"] == "identical"


def test_summary_lists_the_worst_first(tmp_path, run_ckptfs):
    torch.manual_seed(5)
    a = {f"layer{i}": torch.randn(100) for i in range(5)}
    b = {k: v.clone() for k, v in a.items()}
    b["layer1"] += 1e-3
    b["layer3"] += 1.0
    b["layer4"] = torch.randn(3)
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    res = run_ckptfs("diff", tmp_path / "a.pt", tmp_path / "b.pt", check=False)
    assert res.returncode == 1
    lines = res.stdout.decode().splitlines()
    rows = [line.split()[-1] for line in lines if len(line.split()) > 4 and line.startswith(("different", "shape"))]
    assert rows == ["layer4", "layer3", "layer1"]
    assert lines[-1] == "different"
    assert "2 identical" in res.stdout.decode()
    res = run_ckptfs("diff", tmp_path / "a.pt", tmp_path / "a.pt")
    assert res.stdout.decode().splitlines()[-1] == "equal"


@pytest.mark.parametrize("side", ["A", "B"])
@pytest.mark.parametrize("bad", ["missing", "not_a_checkpoint", "truncated"])
def test_unreadable_side_exit_2_one_line(side, bad, tmp_path, run_ckptfs):
    torch.save({"w": torch.randn(1000)}, tmp_path / "good.pt")
    bad_path = tmp_path / f"{bad}.pt"
    if bad == "not_a_checkpoint":
        bad_path.write_text("hello\n")
    elif bad == "truncated":
        data = (tmp_path / "good.pt").read_bytes()
        bad_path.write_bytes(data[: len(data) // 2])
    args = [tmp_path / "good.pt", bad_path] if side == "B" else [bad_path, tmp_path / "good.pt"]
    res = run_ckptfs("diff", *args, check=False)
    err = res.stderr.decode()
    assert res.returncode == 2 and res.stdout == b""
    assert err.count("\n") == 1 and err.startswith(f"ckptfs: {bad_path}: "), err
    with pytest.raises(ckptfs.CkptfsError, match="^" + str(bad_path) + ": "):
        ckptfs.diff(*args)


def test_usage_errors_exit_2(tmp_path, run_ckptfs):
    torch.save({"w": torch.randn(3)}, tmp_path / "a.pt")
    for args in (["diff", tmp_path / "a.pt"], ["diff", "--rtol", "-1", tmp_path / "a.pt", tmp_path / "a.pt"],
                 ["diff", "--bogus-a", "x", tmp_path / "a.pt", tmp_path / "a.pt"]):
        res = run_ckptfs(*args, check=False)
        assert res.returncode == 2 and res.stderr.decode().count("\n") == 1, res.stderr


def test_root_per_side(tmp_path, diff_json):
    torch.manual_seed(6)
    inner = {"w": torch.randn(4), "b": torch.randn(2)}
    torch.save({"model": inner, "step": torch.tensor(3)}, tmp_path / "full.pt")
    save_file(inner, tmp_path / "model.safetensors")
    code, r = diff_json("--root-a", "model", tmp_path / "full.pt", tmp_path / "model.safetensors")
    assert code == 0 and {t["key"] for t in r["tensors"]} == {"w", "b"}
    code, r = diff_json(tmp_path / "full.pt", tmp_path / "model.safetensors")
    assert code == 1 and set(r["only_in_a"]) == {"model.w", "model.b", "step"}
    assert set(r["only_in_b"]) == {"w", "b"}


def test_progress_only_on_a_terminal(tmp_path, ckptfs_bin):
    torch.save({"w": torch.randn(2_000_000)}, tmp_path / "a.pt")
    argv = [str(ckptfs_bin), "diff", str(tmp_path / "a.pt"), str(tmp_path / "a.pt")]
    leader, follower = pty.openpty()
    try:
        res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=follower, timeout=60)
        os.close(follower)
        follower = -1
        drawn = b""
        while select.select([leader], [], [], 0.5)[0]:
            try:
                chunk = os.read(leader, 4096)
            except OSError:
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)
    assert res.returncode == 0
    assert b"100.0%" in drawn and b"\r[" in drawn
    res = subprocess.run(argv, capture_output=True, timeout=60)
    assert res.returncode == 0 and res.stderr == b""
