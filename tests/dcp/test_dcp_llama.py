"""transformers loads the Llama case straight from a mount (`-o root=model`, config.json beside
it) and computes exactly the logits of the same model loaded, in the same process and the same
way, from dcp_to_torch_save's output; with `-o dtype=bf16`, exactly those of that model loaded
as bfloat16."""

import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from make_dcp_checkpoints import LLAMA_CASE

ATTENTION = "sdpa"  # the same kernels on both sides


def input_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))


def reference_model(case, dtype: torch.dtype, tmp_path):
    """The model of dcp_to_torch_save's state dict, loaded as the mount's is (from_pretrained
    of a folder: the generator's config.json and those tensors, converted to DTYPE on load)."""
    folder = tmp_path / "reference"
    folder.mkdir()
    shutil.copy2(case.config_dir / "config.json", folder / "config.json")
    save_file({key: tensor.contiguous().clone() for key, tensor in case.reference["model"].items()},
              folder / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=ATTENTION, dtype=dtype).eval()


def model_folder(mnt, case, tmp_path):
    """A Hugging Face model folder: the config.json the generator saved, and a symbolic link
    to the mount's model.safetensors (the mount itself has no config.json: a DCP dir holds
    none)."""
    folder = tmp_path / "llama"
    folder.mkdir()
    shutil.copy2(case.config_dir / "config.json", folder / "config.json")
    (folder / "model.safetensors").symlink_to(mnt / "model.safetensors")
    return folder


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype, options", [(torch.float32, ()), (torch.bfloat16, ("-o", "dtype=bf16"))], ids=["fp32", "bf16"])
def test_llama_from_mount_gives_the_reference_logits(dcp_case, mounts, tmp_path, dtype, options):
    case = dcp_case(LLAMA_CASE)
    want_model = reference_model(case, dtype, tmp_path)
    mnt = mounts.mount(case.checkpoint_dir, None, "-o", "root=model", *options)
    got_model = AutoModelForCausalLM.from_pretrained(
        model_folder(mnt, case, tmp_path), attn_implementation=ATTENTION, dtype=dtype
    ).eval()

    got_state, want_state = got_model.state_dict(), want_model.state_dict()
    assert set(got_state) == set(want_state)
    for key, want in want_state.items():
        assert got_state[key].dtype == dtype, f"{key}: loaded as {got_state[key].dtype}"
        torch.testing.assert_close(got_state[key], want, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")

    ids = input_ids(want_model.config.vocab_size)
    with torch.no_grad():
        want = want_model(input_ids=ids).logits
        got = got_model(input_ids=ids).logits
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
