"""Fixtures for tests/views: the view options (dtype conversion, root subtree, Hugging Face
shards, XXH3 checksums) through the CLI (`ckptfs export|ls|cat|hash --dtype/--root/...`) and
through real mounts (`ckptfs SOURCE MNT -o dtype=...,root=...,shard_size=...,checksums`).

Mounts follow the rules of tests/fuse (the `mounts` fixture of tests/ckptfs_mounts.py, built
on tests/fusetools.py): every command has a timeout, every test body has a pytest-timeout
deadline, and every mount a test started is unmounted in teardown (fusermount3 -u, then -uz,
then the daemon is killed). Only the tests that mount are skipped, and only on a machine
without /dev/fuse or fusermount3."""

import os
import shutil
from pathlib import Path

import pytest

# transformers must never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from ckptfs_testlib import ckptfs_bin, ls_json, run_ckptfs  # noqa: E402,F401  (shared fixtures)
from fusetools import Mounts  # noqa: E402
from minilm import NON_WEIGHT_FILES, SENTENCES, embed, load_model  # noqa: E402
from minilm import minilm_dir  # noqa: E402,F401  (shared fixture)

# --- mounts ----------------------------------------------------------------------------


class ViewMounts(Mounts):
    """fusetools.Mounts that take view options: mount(SOURCE, *OPTIONS) mounts with
    `-o OPTION,OPTION...`."""

    def try_mount(self, source, *options):
        """`ckptfs SOURCE MNT [-o OPTIONS]` with a timeout: (mountpoint, Bounded result).
        The mountpoint is registered for teardown before anything runs."""
        mountpoint = self.new_mountpoint()
        return mountpoint, self.start(self._argv(source, mountpoint, options), mountpoint)

    def mount(self, source, *options) -> Path:
        """Mount SOURCE with -o OPTIONS; fails the test unless the command exits 0 and the
        mount shows in /proc/mounts. Returns the mountpoint."""
        mountpoint, res = self.try_mount(source, *options)
        self.check_mounted(mountpoint, res)
        return mountpoint

    def _argv(self, source, mountpoint, options) -> list:
        argv = [self.binary, source, mountpoint]
        if options:
            argv += ["-o", ",".join(options)]
        return argv


@pytest.fixture
def mounts_class():
    """The `mounts` fixture of this suite is a ViewMounts."""
    return ViewMounts


# --- tools and data ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def xxhsum_bin() -> str:
    path = shutil.which("xxhsum")
    if path is None:
        pytest.fail("xxhsum is not installed (Debian package xxhash)", pytrace=False)
    return path


@pytest.fixture(scope="session")
def hf_split():
    """huggingface_hub.split_torch_state_dict_into_shards (installed with transformers)."""
    try:
        from huggingface_hub import split_torch_state_dict_into_shards
    except ImportError as e:  # pragma: no cover - the reference is part of the test environment
        pytest.fail(f"huggingface_hub is not importable ({e}); it comes with transformers",
                    pytrace=False)
    return split_torch_state_dict_into_shards


@pytest.fixture(scope="session")
def minilm(minilm_dir):
    """(model, tokenizer, reference embeddings) of the original MiniLM folder."""
    model, tokenizer = load_model(minilm_dir)
    return model, tokenizer, embed(model, tokenizer)


@pytest.fixture(scope="session")
def minilm_training_folder(minilm, minilm_dir, tmp_path_factory):
    """A model folder whose pytorch_model.bin is a whole training checkpoint,
    {"model": state_dict, "optimizer": Adam state after one step, "step": 7}, beside the
    config and tokenizer files of the package folder. Returns (folder, the saved checkpoint
    as torch.load reads it back)."""
    import torch

    model, tokenizer, _ = minilm
    # A copy to train: the reference model stays untouched.
    from transformers import AutoModel

    trainee = AutoModel.from_pretrained(str(minilm_dir)).train()
    opt = torch.optim.Adam(trainee.parameters(), lr=1e-4)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    trainee(**batch).last_hidden_state.pow(2).mean().backward()
    opt.step()

    folder = tmp_path_factory.mktemp("minilm-training")
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7}
    torch.save(ckpt, folder / "pytorch_model.bin")
    for name in NON_WEIGHT_FILES:
        shutil.copy2(minilm_dir / name, folder / name)
    del trainee, opt, ckpt
    loaded = torch.load(folder / "pytorch_model.bin", weights_only=True)
    return folder, loaded
