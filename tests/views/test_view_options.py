"""The view options combine (dtype + root + shard_size), and bad values are refused: the CLI
exits 1 or 2 with one stderr line, a mount exits 1 with one stderr line and mounts nothing."""

import json
import os
import random

import pytest
import torch
from safetensors.torch import save_file

from ckptfs_testlib import flatten_tensors
from fusetools import daemon_pids, mount_entry
from viewtools import (
    NON_WEIGHT_FILES,
    SHARD_NAME,
    TARGETS,
    assert_same_embeddings,
    check_sharded_tree,
    converted,
    embed,
    load_model,
    read_tree,
)


def model_subtree(ckpt: dict) -> dict:
    return {k.removeprefix("model."): v for k, v in flatten_tensors(ckpt).items() if k.startswith("model.")}


@pytest.mark.parametrize("target", ["bf16", "fp16", "fp32"])
def test_cli_dtype_root_shards(target, minilm_training_folder, hf_split, ls_json, run_ckptfs, tmp_path):
    folder, ckpt = minilm_training_folder
    tgt = TARGETS[target]
    want = {k: converted(t, tgt) for k, t in model_subtree(ckpt).items()}
    options = ["--dtype", target, "--root", "model", "--shard-size", "10MB"]
    out = tmp_path / "out"
    run_ckptfs("export", "--write", "all", *options, folder, out)
    order = [e["key"].removeprefix("model.") for e in ls_json(folder) if e["key"].startswith("model.")]
    files = read_tree(out)
    check_sharded_tree(files, want, order, 10**7, hf_split, " ".join(options))
    for name in NON_WEIGHT_FILES:
        assert files[name] == (folder / name).read_bytes(), name

    listed = json.loads(run_ckptfs("ls", "--json", *options, folder).stdout)
    assert [e["key"] for e in listed] == order
    for e in listed:
        assert e["nbytes"] == want[e["key"]].numel() * want[e["key"]].element_size(), e["key"]


@pytest.fixture(scope="module")
def bf16_reference_embeddings(minilm_training_folder, tmp_path_factory):
    """Embeddings of a real model folder holding the bf16 weights (written by safetensors
    from torch's own conversion) beside the same config and tokenizer."""
    folder, ckpt = minilm_training_folder
    ref = tmp_path_factory.mktemp("minilm-bf16")
    save_file({k: t.to(torch.bfloat16).contiguous() for k, t in model_subtree(ckpt).items()},
              ref / "model.safetensors", metadata={"format": "pt"})
    for name in NON_WEIGHT_FILES:
        (ref / name).write_bytes((folder / name).read_bytes())
    model, tokenizer = load_model(ref)
    return embed(model, tokenizer)


@pytest.mark.timeout(180)
def test_mount_dtype_root_shards_loads_with_transformers(
    minilm_training_folder, bf16_reference_embeddings, mounts, hf_split, ls_json
):
    folder, ckpt = minilm_training_folder
    mnt = mounts.mount(folder, "dtype=bf16", "root=model", "shard_size=10MB", "checksums")
    names = sorted(p.name for p in mnt.iterdir())
    shards = [n for n in names if SHARD_NAME.match(n)]
    assert shards and "model.safetensors" not in names and "pytorch_model.bin" not in names, names

    want = {k: converted(t, torch.bfloat16) for k, t in model_subtree(ckpt).items()}
    order = [e["key"].removeprefix("model.") for e in ls_json(folder) if e["key"].startswith("model.")]
    files = {n: (mnt / n).read_bytes() for n in shards + ["model.safetensors.index.json"]}
    files.update({f"tensors/{p.name}": b"" for p in (mnt / "tensors").iterdir()})
    check_sharded_tree(files, want, order, 10**7, hf_split, "mount -o dtype=bf16,root=model,shard_size=10MB")

    # Partial reads of converted shards at unaligned offsets.
    rng = random.Random(3)
    for name in shards:
        data = files[name]
        fd = os.open(mnt / name, os.O_RDONLY)
        try:
            for _ in range(40):
                off = rng.randrange(0, len(data))
                n = rng.choice([1, 3, 4095, 65537, (1 << 20) + 3])
                assert os.pread(fd, n, off) == data[off : off + n], f"{name}: pread({n} at {off})"
        finally:
            os.close(fd)

    manifest = json.loads((mnt / "manifest.json").read_bytes())
    assert all(len(t["xxh3"]) == 16 for t in manifest["tensors"])
    assert_same_embeddings(mnt, bf16_reference_embeddings, "mount -o dtype=bf16,root=model,shard_size=10MB")


BAD_CLI = [
    ["--dtype", "int8"],
    ["--dtype", "fp64"],
    ["--dtype", ""],
    ["--shard-size", "abc"],
    ["--shard-size", "0"],
    ["--shard-size", "0MB"],
    ["--shard-size", "-5"],
    ["--shard-size", "10XB"],
]


@pytest.mark.parametrize("command", ["ls", "info", "cat", "export", "hash"])
@pytest.mark.parametrize("bad", BAD_CLI, ids=lambda b: "=".join(b))
def test_cli_bad_values(command, bad, run_ckptfs, tmp_path):
    source = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(3)}, source)
    extra = {"cat": ["model.safetensors"], "export": [tmp_path / "out"]}.get(command, [])
    res = run_ckptfs(command, *bad, source, *extra, check=False)
    err = res.stderr.decode(errors="replace")
    assert res.returncode in (1, 2), f"{command} {bad}: exit {res.returncode}, stderr {err!r}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip(), (
        f"{command} {' '.join(bad)}: expected one stderr line, got {len(lines)}: {err!r}"
    )
    assert res.stdout == b"", f"{command} {bad}: wrote to stdout"


@pytest.mark.parametrize(
    "option", ["dtype=int8", "dtype=", "shard_size=abc", "shard_size=0", "shard_size=-1", "root=nope"]
)
def test_mount_bad_values_mount_nothing(option, mounts, tmp_path):
    source = tmp_path / "w.safetensors"
    save_file({"model.w": torch.ones(3)}, source)
    mnt, res = mounts.try_mount(source, option)
    assert res.returncode == 1, f"-o {option}: {res.describe()}"
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"-o {option}: stderr {res.stderr!r}"
    assert mount_entry(mnt) is None, f"-o {option}: something was mounted"
    assert daemon_pids(mnt, mounts.binary) == [], f"-o {option}: a daemon is left running"
