"""A remote side: a checkpoint served by nginx (range requests) against local files."""

import shutil

import pytest
import torch

from remote_servers import Nginx


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    server = Nginx(root, tmp_path_factory.mktemp("nginx"))
    yield root, server
    server.stop()


def test_http_source_against_local(served, tmp_path, diff_json):
    root, server = served
    torch.manual_seed(7)
    state = {"w": torch.randn(1_500_000), "b": torch.randn(10)}
    torch.save(state, tmp_path / "a.pt")
    shutil.copy(tmp_path / "a.pt", root / "a.pt")
    original = state["b"].clone()
    state["b"][3] += 0.5
    torch.save(state, tmp_path / "b.pt")
    moved = float((state["b"].double() - original.double()).abs().max())
    code, r = diff_json(server.url("a.pt"), tmp_path / "a.pt")
    assert code == 0 and {t["status"] for t in r["tensors"]} == {"identical"}
    code, r = diff_json(server.url("a.pt"), tmp_path / "b.pt")
    t = {x["key"]: x for x in r["tensors"]}
    assert code == 1 and t["b"]["differing"] == 1 and t["b"]["max_abs"] == moved > 0.4
    assert t["w"]["status"] == "identical"


def test_unreachable_remote_side_exit_2(served, tmp_path, run_ckptfs):
    _, server = served
    torch.save({"w": torch.randn(3)}, tmp_path / "a.pt")
    missing = server.url("missing.pt")
    res = run_ckptfs("diff", tmp_path / "a.pt", missing, check=False)
    err = res.stderr.decode()
    assert res.returncode == 2 and err.count("\n") == 1 and err.startswith(f"ckptfs: {missing}: "), err
