"""A DeepSpeed save folder as the Hugging Face Trainer leaves it (checkpoint-N/: `latest`, the
tag folder, config.json, tokenizer files, sometimes its own model.safetensors) mounts as a
model folder: the save folder's files are served beside the consolidated model.safetensors,
`latest` is not, and a file whose name ckptfs generates is hidden and named in the manifest."""

import json
import os
import shutil

from zerotools import TAG

CONFIG = {"architectures": ["Net"], "model_type": "test", "hidden_size": 8}
SIDE_FILES = {
    "config.json": json.dumps(CONFIG).encode(),
    "tokenizer_config.json": b'{"model_max_length": 16}',
    "trainer_state.json": b'{"global_step": 2}',
}


def hf_style_save_folder(ckpt, tmp_path):
    """A copy of the fixture's save folder with the files the Trainer writes beside it."""
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(ckpt.save_dir, folder)
    for name, data in SIDE_FILES.items():
        (folder / name).write_bytes(data)
    # A 16-bit model the Trainer saved itself: the consolidated model.safetensors wins.
    (folder / "model.safetensors").write_bytes(b"not the consolidated model")
    return folder


def test_save_folder_files_are_served_beside_the_model(zero_checkpoint, served, run_ckptfs, tmp_path):
    ckpt = zero_checkpoint("w2-s2-bf16")
    folder = hf_style_save_folder(ckpt, tmp_path)
    view = served(folder)
    assert view.keys == ckpt.expected_order
    plain = served(ckpt.save_dir)
    assert (view.export_dir / "model.safetensors").read_bytes() == (plain.export_dir / "model.safetensors").read_bytes()
    for name, data in SIDE_FILES.items():
        assert (view.export_dir / name).read_bytes() == data, name
    assert not (view.export_dir / "latest").exists()
    assert not (view.export_dir / TAG).exists()
    manifest = json.loads((view.export_dir / "manifest.json").read_text())
    assert manifest["hidden_sibling_files"] == ["model.safetensors"]
    info = json.loads(run_ckptfs("info", "--json", folder).stdout)
    sources = {f["path"] for f in info["source_files"]}
    assert {str(folder / n) for n in SIDE_FILES} <= sources
    assert str(folder / "latest") not in sources


def test_mounted_save_folder_reads_like_a_model_folder(zero_checkpoint, mounts, tmp_path):
    ckpt = zero_checkpoint("w2-s2-bf16")
    folder = hf_style_save_folder(ckpt, tmp_path)
    mnt = mounts.mount(folder)
    names = set(os.listdir(mnt))
    assert set(SIDE_FILES) | {"model.safetensors", "manifest.json", "metadata.json", "tensors"} <= names
    assert "latest" not in names and TAG not in names
    for name, data in SIDE_FILES.items():
        assert (mnt / name).read_bytes() == data, name


def test_tag_folder_serves_no_save_folder_files(zero_checkpoint, run_ckptfs):
    """Pointed at the tag folder, only the rank files are sources (the save folder is its
    parent, not part of the source)."""
    ckpt = zero_checkpoint("w2-s2-bf16")
    info = json.loads(run_ckptfs("info", "--json", ckpt.tag_dir).stdout)
    assert {f["path"] for f in info["source_files"]} == {str(p) for p in ckpt.tag_dir.iterdir()}
