"""`ckptfs export --write PARTS`: what export writes. By default the model (its weights file,
here the folder's weights.safetensors, or with --shard-size the shards and their index) and the small files
(manifest.json, metadata.json, the source folder's other files); `tensors` adds tensors/,
`all` writes the whole tree as a mount shows it. Every part written is byte for byte the
mount's file of the same name, and nothing else is written."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from viewtools import read_tree

# A model folder as users have them: weights plus files a loader needs beside them.
SIDE_FILES = {"config.json": b'{"model_type": "toy"}\n', "tokenizer.json": b'{"v": 1}\n'}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A safetensors model folder (one weights file, two side files): (path, tensors)."""
    g = torch.Generator().manual_seed(5)
    state = {f"layer.{i}.weight": torch.randn(64, 32 + i, generator=g) for i in range(6)}
    state["bias"] = torch.arange(10, dtype=torch.float16)
    root = tmp_path_factory.mktemp("write-src") / "model"
    root.mkdir()
    save_file(state, root / "weights.safetensors")
    for name, data in SIDE_FILES.items():
        (root / name).write_bytes(data)
    return root, state


def model_part(files: dict) -> set:
    """The model file a loader opens (manifest.json's model_file: the source's weights file
    name, or a shard index) and the shards its index names."""
    model_file = json.loads(files["manifest.json"])["model_file"]
    if not model_file.endswith(".index.json"):
        return {model_file}
    return {model_file, *json.loads(files[model_file])["weight_map"].values()}


def small_part(files: dict) -> set:
    return {p for p in files if "/" not in p} - model_part(files)


@pytest.fixture(scope="module")
def whole_tree(folder, run_ckptfs, tmp_path_factory):
    """{options: the tree `export --write all OPTIONS` wrote} (the reference: checked against
    a mount below)."""
    made = {}

    def get(*options):
        if options not in made:
            out = tmp_path_factory.mktemp("write-all") / "out"
            run_ckptfs("export", "--write", "all", *options, folder[0], out)
            made[options] = read_tree(out)
        return made[options]

    return get


@pytest.mark.parametrize("options", [(), ("--shard-size", "8KB")], ids=["single", "sharded"])
@pytest.mark.parametrize(
    "parts, want",
    [
        (None, {"model", "small"}),
        ("model", {"model"}),
        ("tensors", {"tensors"}),
        ("files", {"small"}),
        ("model,tensors", {"model", "tensors"}),
        ("tensors,files", {"tensors", "small"}),
        ("all", {"model", "tensors", "small"}),
        ("model,files,tensors", {"model", "tensors", "small"}),
    ],
)
def test_write_selects_parts(parts, want, options, folder, whole_tree, run_ckptfs, tmp_path):
    whole = whole_tree(*options)
    groups = {"model": model_part(whole), "small": small_part(whole),
              "tensors": {p for p in whole if p.startswith("tensors/")}}
    assert all(groups.values()), f"the whole tree lacks a part: {groups}"
    if options:
        assert "weights.safetensors.index.json" in groups["model"] and len(groups["model"]) > 2, sorted(whole)
    out = tmp_path / "out"
    run_ckptfs("export", *(["--write", parts] if parts else []), *options, folder[0], out)
    got = read_tree(out)
    expected = set().union(*(groups[w] for w in want))
    assert set(got) == expected, f"--write {parts}: wrote {sorted(got)}, want {sorted(expected)}"
    for path, data in got.items():
        assert data == whole[path], f"--write {parts}: {path} differs from the whole tree's"
    assert not (out / "tensors").exists() or "tensors" in want, "an empty tensors/ was created"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", [(), ("--shard-size", "8KB")], ids=["single", "sharded"])
def test_whole_tree_is_the_mount(options, folder, whole_tree, mounts):
    """--write all writes what a mount with the same options shows, byte for byte."""
    whole = whole_tree(*options)
    mount_opts = [f"shard_size={options[1]}"] if options else []
    mnt = mounts.mount(folder[0], *mount_opts)
    assert read_tree(mnt) == whole


def test_default_export_loads(folder, run_ckptfs, tmp_path):
    """The default export is a model folder: the weights load, the side files are there."""
    root, state = folder
    out = tmp_path / "out"
    run_ckptfs("export", root, out)
    # served under the folder's own weights file name
    loaded = load_file(out / "weights.safetensors")
    assert set(loaded) == set(state)
    for key, tensor in state.items():
        assert torch.equal(loaded[key], tensor), key
    for name, data in SIDE_FILES.items():
        assert (out / name).read_bytes() == data, name
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_file"] == "weights.safetensors"


@pytest.mark.parametrize("bad", ["weights", "model,", "", "model;tensors", "none"])
def test_bad_write_value(bad, folder, run_ckptfs, tmp_path):
    out = tmp_path / "out"
    res = run_ckptfs("export", "--write", bad, folder[0], out, check=False)
    lines = res.stderr.decode(errors="replace").splitlines()
    assert res.returncode == 2, (res.returncode, lines)
    assert len(lines) == 1 and lines[0].startswith("ckptfs: write=") and lines[0].endswith("(see --help)"), lines
    assert not out.exists(), "a refused export created its output folder"


def test_write_is_export_only(folder, run_ckptfs):
    res = run_ckptfs("ls", "--write", "model", folder[0], check=False)
    assert res.returncode == 2 and b"unknown option '--write'" in res.stderr, res.stderr


def test_export_creates_missing_parent_folders(folder, run_ckptfs, tmp_path):
    out = tmp_path / "not" / "yet" / "there" / "out"
    run_ckptfs("export", folder[0], out)
    served = load_file(out / "weights.safetensors")
    assert sorted(served) == sorted(folder[1])
    assert (out / "config.json").read_bytes() == SIDE_FILES["config.json"]


def test_export_under_a_file_is_refused_naming_it(folder, run_ckptfs, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    done = run_ckptfs("export", folder[0], blocker / "out", check=False)
    assert done.returncode == 1
    err = done.stderr.decode().strip()
    assert err.splitlines() == [f"ckptfs: {blocker}: exists and is not a folder"], err
    assert blocker.read_text() == "not a folder\n"
