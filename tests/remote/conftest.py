"""Fixtures for the remote-source suite: real servers on loopback (nginx from Debian, moto's
S3 server from PyPI), started once per session and stopped at its end, serving checkpoints
written by the real torch.save, safetensors and transformers. Every mount has a timeout and
is unmounted in teardown (tests/ckptfs_mounts.py)."""

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from ckptfs_checkpoints import remote_checkpoint  # noqa: E402
from ckptfs_testlib import ckptfs_bin, run_ckptfs  # noqa: E402,F401  (shared fixtures)
from minilm import NON_WEIGHT_FILES, minilm_dir  # noqa: E402,F401
from remote_servers import MotoS3, Nginx  # noqa: E402


@pytest.fixture(scope="session")
def www(tmp_path_factory) -> Path:
    """The folder nginx serves; tests put (or link) what they serve under it."""
    return tmp_path_factory.mktemp("www")


@pytest.fixture(scope="session")
def nginx(www, tmp_path_factory):
    server = Nginx(www, tmp_path_factory.mktemp("nginx"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nginx_tls(www, tmp_path_factory):
    """The same folder over https://, with a self-signed certificate (nginx_tls.ca_file)."""
    server = Nginx(www, tmp_path_factory.mktemp("nginx-tls"), tls=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    server = MotoS3(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


def save_training_pt(path: Path, seed: int = 0, scale: int = 1) -> None:
    """ckptfs_checkpoints.remote_checkpoint(SEED, SCALE) by the real torch.save."""
    import torch

    torch.save(remote_checkpoint(seed, scale), path)


def save_random_pt(path: Path, count: int, seed: int) -> Path:
    """`count` 4 MiB float32 tensors by the real torch.save: large enough that the catalog's
    reads and the readahead do not fetch all of it."""
    import torch

    g = torch.Generator().manual_seed(seed)
    torch.save({f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(count)}, path)
    return path


@pytest.fixture(scope="session")
def training_pt(www) -> Path:
    path = www / "training.pt"
    save_training_pt(path)
    return path


@pytest.fixture(scope="session")
def minilm_sharded(minilm_dir, www) -> Path:
    """all-MiniLM-L6-v2 saved again by transformers' save_pretrained in 5 MB safetensors shards
    with a model.safetensors.index.json, plus its tokenizer files."""
    from transformers import AutoModel

    folder = www / "minilm-sharded"
    model = AutoModel.from_pretrained(minilm_dir)
    model.save_pretrained(folder, max_shard_size="5MB", safe_serialization=True)
    for name in NON_WEIGHT_FILES:
        shutil.copy2(minilm_dir / name, folder / name)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.fixture(scope="session")
def minilm_bin(minilm_dir, www) -> Path:
    """all-MiniLM-L6-v2 as a torch.save'd pytorch_model.bin and its tokenizer files."""
    import torch
    from transformers import AutoModel

    folder = www / "minilm-bin"
    folder.mkdir()
    torch.save(AutoModel.from_pretrained(minilm_dir).state_dict(), folder / "pytorch_model.bin")
    for name in NON_WEIGHT_FILES:
        shutil.copy2(minilm_dir / name, folder / name)
    return folder
