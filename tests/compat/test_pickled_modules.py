"""Whole modules saved by torch.save(model) (or anywhere inside a saved object) are served as
their state_dict() names them: parameters and persistent buffers, children by attribute name,
non-persistent buffers and None entries left out. Tensors a module keeps as plain attributes
(not parameters or buffers) are served apart, under "$attributes." and the module's path, never
among the state dict's keys. Checked against state_dict() of the module torch.load unpickles,
key for key and byte for byte, on modules written by the real torch and transformers."""

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from ckptfs_testlib import assert_bitwise_equal, served_form


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("scratch", torch.arange(2.0), persistent=False)
        self.register_buffer("kept", torch.ones(3))
        self.register_parameter("absent", None)
        self.stride = torch.tensor([8.0, 16.0])  # a tensor attribute, as a detection head keeps one
        self.label = "block"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(Block(), nn.ReLU(), Block())
        self.head = nn.Linear(4, 2)
        self.empty = None


def state_dict_hook(module, state_dict, prefix, local_metadata):
    return state_dict


def served_tensors(folder) -> dict:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def check_served(export_source, ls_json, path, expected: dict) -> dict:
    """PATH's tensors as ckptfs serves them are EXPECTED, byte for byte (export), the state
    dict's in its order (ls); returns the metadata."""
    keys = [e["key"] for e in ls_json(path)]
    state_keys = [k for k in expected if not k.startswith("$attributes.")]
    assert [k for k in keys if not k.startswith("$attributes.")] == state_keys
    assert sorted(keys) == sorted(expected)
    out = export_source(path)
    got = served_tensors(out)
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert_bitwise_equal(got[key], served_form(tensor.detach()), key)
    return json.loads((out / "metadata.json").read_text())


def module_with_attributes(module: nn.Module, prefix: str = "") -> dict:
    """state_dict(), then the tensor attributes under $attributes.<module path>."""
    expected = {prefix + k: v for k, v in module.state_dict().items()}
    for name, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and not attr.startswith("_"):
                expected["$attributes." + prefix + (name + "." if name else "") + attr] = value
    return expected


def test_whole_module_is_served_as_its_state_dict(tmp_path, export_source, ls_json):
    torch.manual_seed(0)
    net = Net()
    torch.save(net, tmp_path / "net.pt")
    loaded = torch.load(tmp_path / "net.pt", weights_only=False)
    state = loaded.state_dict()
    assert "layers.0.scratch" not in state and "layers.0.kept" in state
    metadata = check_served(export_source, ls_json, tmp_path / "net.pt", module_with_attributes(loaded))
    # The module's classes and plain attributes are metadata; the state dict's tensors are not.
    assert metadata["$class"].endswith("Net")
    block = metadata["modules"]["layers"]["modules"]["0"]
    assert block["attributes"]["label"] == "block"
    assert "scratch" not in json.dumps(metadata)


def test_module_inside_a_checkpoint_dict_keeps_its_key(tmp_path, export_source, ls_json):
    torch.manual_seed(1)
    net = Net()
    torch.save({"model": net, "epoch": 4}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    metadata = check_served(export_source, ls_json, tmp_path / "ckpt.pt",
                            module_with_attributes(loaded["model"], "model."))
    assert metadata["epoch"] == 4


def test_transformers_model_saved_whole(tmp_path, export_source, ls_json):
    """A tied Llama: its state_dict names lm_head.weight and the embedding (one storage), and
    leaves out the rotary inv_freq buffer, which transformers registers as non-persistent."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(config)
    torch.save(model, tmp_path / "llama.pt")
    loaded = torch.load(tmp_path / "llama.pt", weights_only=False)
    state = loaded.state_dict()
    assert not any("inv_freq" in k for k in state)
    check_served(export_source, ls_json, tmp_path / "llama.pt", module_with_attributes(loaded))


def test_module_with_state_dict_hooks_is_refused(tmp_path, run_ckptfs):
    """A state_dict hook may rename or replace entries: what it gives is known only by running it."""
    net = Net()
    net.head._register_state_dict_hook(state_dict_hook)
    torch.save(net, tmp_path / "hooked.pt")
    res = run_ckptfs("ls", tmp_path / "hooked.pt", check=False)
    assert res.returncode != 0
    err = res.stderr.decode()
    assert "hooked.pt" in err and "head" in err and "_state_dict_hooks" in err, err
    assert len(err.strip().splitlines()) == 1, err
