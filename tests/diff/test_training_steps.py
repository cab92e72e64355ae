"""Two training steps of a real model (all-MiniLM-L6-v2 through transformers, AdamW): the
figures ckptfs diff gives per tensor are torch's, computed from both state dicts."""

import pytest
import torch
from safetensors.torch import save_file

import ckptfs

# These tests load libckptfs.so into the test process.
pytestmark = pytest.mark.loads_libckptfs

REL = 1e-12


def train(model, tokenizer, steps):
    batch = tokenizer(["ckptfs compares checkpoints.", "Two steps of AdamW apart."], padding=True,
                      return_tensors="pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        # The pooler is left out of the loss: its weights get no gradient and stay identical.
        loss = model(**batch).last_hidden_state.pow(2).mean()
        loss.backward()
        optimizer.step()


def state_of(model):
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def two_steps(minilm_dir, tmp_path_factory):
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModel.from_pretrained(str(minilm_dir)).train()
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir))
    folder = tmp_path_factory.mktemp("steps")
    train(model, tokenizer, 1)
    step1 = state_of(model)
    save_file(step1, folder / "step1.safetensors")
    train(model, tokenizer, 2)
    step3 = state_of(model)
    torch.save(step3, folder / "step3.pt")
    return folder / "step1.safetensors", step1, folder / "step3.pt", step3


def test_per_tensor_change_is_torchs(two_steps, diff_json):
    path_a, a, path_b, b = two_steps
    code, result = diff_json(path_a, path_b)
    assert code == 1 and result["equal"] is False
    assert result["only_in_a"] == [] and result["only_in_b"] == []
    assert sorted(t["key"] for t in result["tensors"]) == sorted(a)
    statuses = set()
    for t in result["tensors"]:
        x, y = a[t["key"]].double(), b[t["key"]].double()
        statuses.add(t["status"])
        if torch.equal(x, y):
            assert t["status"] == "identical" and t["rel_l2"] == 0, t
            continue
        assert t["status"] == "different", t
        d = x - y
        assert t["numel"] == x.numel()
        assert t["differing"] == int((d != 0).sum())
        assert t["max_abs"] == float(d.abs().max())
        # torch's float64 sum (cascade summation, within ~1e-16 of math.fsum here); its
        # Tensor.norm kernel drifts by ~1e-12 on the 11.7M-element embedding.
        torch_rel_l2 = float(d.pow(2).sum().sqrt() / x.pow(2).sum().sqrt())
        assert t["rel_l2"] == pytest.approx(torch_rel_l2, rel=REL, abs=0), t["key"]
        assert t["norm_a"] == pytest.approx(float(x.pow(2).sum().sqrt()), rel=REL, abs=0)
        nonzero = x != 0
        assert t["max_rel"] == pytest.approx(float((d[nonzero].abs() / x[nonzero].abs()).max()), rel=REL, abs=0)
    # The step changed the encoder and left the pooler alone: both kinds are exercised.
    assert statuses == {"identical", "different"}


def test_python_returns_the_commands_result(two_steps, diff_json):
    path_a, _, path_b, _ = two_steps
    _, from_command = diff_json(path_a, path_b)
    assert ckptfs.diff(path_a, path_b) == from_command


def test_tolerance_makes_the_steps_equal(two_steps):
    path_a, a, path_b, b = two_steps
    largest = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    assert ckptfs.diff(path_a, path_b, atol=largest)["equal"] is True
    assert ckptfs.diff(path_a, path_b, atol=largest / 2)["equal"] is False
