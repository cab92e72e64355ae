"""transformers loads the Llama case straight from a mount (`-o root=model`, config.json beside
it) and computes exactly the logits of the same model loaded from dcp_to_torch_save's
output; with `-o dtype=bf16`, exactly those of that model cast to bfloat16."""

import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from make_dcp_checkpoints import LLAMA_CASE

ATTENTION = "sdpa"  # the same kernels on both sides


def input_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))


def reference_model(case, dtype: torch.dtype):
    """The model of dcp_to_torch_save's state dict, its weights cast to DTYPE. Built in DTYPE
    rather than cast with .to(DTYPE) afterwards: .to() would also cast the rotary embedding's
    inv_freq buffer, which transformers keeps in fp32 when it builds a bf16 model (as
    from_pretrained does), and the logits would differ for a reason that is not ckptfs's."""
    config = AutoConfig.from_pretrained(case.config_dir)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION, dtype=dtype)
    weights = {key: tensor.to(dtype) for key, tensor in case.reference["model"].items()}
    missing, unexpected = model.load_state_dict(weights, strict=True)
    assert not missing and not unexpected
    return model.eval()


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
    want_model = reference_model(case, dtype)
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
