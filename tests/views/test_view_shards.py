"""`--shard-size SIZE` / `-o shard_size=SIZE`: model-0000k-of-0000N.safetensors plus
model.safetensors.index.json instead of model.safetensors, split in catalog order exactly as
huggingface_hub.split_torch_state_dict_into_shards splits the same ordered state dict (a
tensor over the limit alone in its shard); one shard -> just model.safetensors, no index.
SIZE: bytes, KB/MB/GB (decimal), KiB/MiB/GiB (binary), case-insensitive."""

import json

import pytest
import torch
from safetensors.torch import load_file

from ckptfs_testlib import flatten_tensors
from viewtools import (
    SHARD_NAME,
    TARGETS,
    assert_same_embeddings,
    check_sharded_tree,
    converted,
    parse_safetensors,
    read_tree,
    served_form,
    tensor_bytes,
)


def split_state(g) -> dict:
    """Untied tensors of chosen byte sizes in a chosen order: exact fits, one byte over,
    oversize tensors between small ones (huggingface_hub emits those shards first), mixed
    dtypes and odd sizes."""
    sizes_f32 = {  # key: element count of a float32 tensor (bytes = 4x)
        "s.000": 150, "s.001": 100,  # 1000 bytes: exactly fills a 1000 limit
        "s.002": 1,  # 4 bytes: tips over
        "big.0": 2000,  # 8000 bytes: over every small limit
        "s.003": 60, "s.004": 190,
        "big.1": 300,  # 1200 bytes
        "s.005": 256,  # 1024 bytes: exactly a KiB
        "s.006": 5,
    }
    state = {}
    for key, n in sizes_f32.items():
        state[key] = torch.randn(n, generator=g)
        if key == "s.001":
            state["z.empty"] = torch.zeros(0)  # 0 bytes right after an exactly full shard
    state["m.bf16"] = torch.randn(499, generator=g).to(torch.bfloat16)  # 998 bytes
    state["m.i64"] = torch.arange(3, dtype=torch.int64)  # 24 bytes
    state["m.bool"] = torch.ones(3, dtype=torch.bool)  # 3 bytes
    state["m.f16"] = torch.randn(7, 3, generator=g).to(torch.float16)  # 42 bytes
    state["big.2"] = torch.randn(40, 40, generator=g)  # 6400 bytes, last
    return state


@pytest.fixture(scope="module")
def split_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("split") / "split.pt"
    torch.save(split_state(torch.Generator().manual_seed(17)), path)
    return path, flatten_tensors(torch.load(path, weights_only=True))


@pytest.mark.parametrize("limit", [1, 3, 1000, 1003, 1024, 1200, 2050, 8000, 7999, 20000, 10**6])
def test_split_matches_huggingface(limit, split_ckpt, hf_split, ls_json, run_ckptfs, tmp_path):
    source, flat = split_ckpt
    order = [e["key"] for e in ls_json(source)]
    out = tmp_path / "out"
    run_ckptfs("export", "--write", "all", "--shard-size", str(limit), source, out)
    files = read_tree(out)
    want = {k: served_form(t) for k, t in flat.items()}
    check_sharded_tree(files, want, order, limit, hf_split, f"--shard-size {limit}")

    # The per-tensor files and the manifest still describe every tensor; the manifest points
    # into the shard that holds it.
    manifest = json.loads(files["manifest.json"])
    index = json.loads(files.get("model.safetensors.index.json", "null"))
    for t in manifest["tensors"]:
        model_file = index["weight_map"][t["key"]] if index else "model.safetensors"
        assert t["model_file"] == model_file, (t["key"], t["model_file"], model_file)
        start, end = t["model_offsets"]
        assert files[model_file][start:end] == tensor_bytes(want[t["key"]]), t["key"]
        one = parse_safetensors(files[t["file"]], t["file"])
        assert one[t["key"]][2] == tensor_bytes(want[t["key"]]), t["file"]

    # The real loader reads every shard.
    for name in files:
        if SHARD_NAME.match(name):
            for key, tensor in load_file(out / name).items():
                assert torch.equal(tensor.view(torch.uint8), want[key].contiguous().view(torch.uint8)), key


def test_cat_serves_shards_and_index(split_ckpt, run_ckptfs, tmp_path):
    source, _ = split_ckpt
    out = tmp_path / "out"
    run_ckptfs("export", "--shard-size", "1200", source, out)
    names = sorted(p.name for p in out.iterdir() if SHARD_NAME.match(p.name)) + ["model.safetensors.index.json"]
    assert len(names) > 2
    for name in names:
        assert run_ckptfs("cat", "--shard-size", "1200", source, name).stdout == (out / name).read_bytes(), name
    res = run_ckptfs("cat", "--shard-size", "1200", source, "model.safetensors", check=False)
    assert res.returncode == 1, "a sharded view still serves model.safetensors"


# Sizes around the decimal/binary boundaries: these tensors split differently at 1000 and
# 1024 bytes, and at 1 MB and 1 MiB.
UNIT_STATE_BYTES = {"u.0": 600, "u.1": 424, "u.2": 100, "u.3": 500_000, "u.4": 500_000, "u.5": 40_000}


@pytest.fixture(scope="module")
def unit_ckpt(tmp_path_factory):
    g = torch.Generator().manual_seed(23)
    state = {k: torch.randint(0, 256, (n,), generator=g, dtype=torch.int32).to(torch.uint8)
             for k, n in UNIT_STATE_BYTES.items()}
    path = tmp_path_factory.mktemp("units") / "units.pt"
    torch.save(state, path)
    return path, flatten_tensors(torch.load(path, weights_only=True))


@pytest.mark.parametrize(
    "spelling, limit",
    [
        ("1000", 1000), ("1KB", 1000), ("1kb", 1000), ("1Kb", 1000),
        ("1024", 1024), ("1KiB", 1024), ("1kib", 1024), ("1KIB", 1024),
        ("1MB", 10**6), ("1mb", 10**6), ("1000000", 10**6),
        ("1MiB", 2**20), ("1mib", 2**20),
        ("1GB", 10**9), ("1gib", 2**30), ("5GB", 5 * 10**9),
    ],
)
def test_size_units(spelling, limit, unit_ckpt, hf_split, ls_json, run_ckptfs, tmp_path):
    source, flat = unit_ckpt
    out = tmp_path / "out"
    run_ckptfs("export", "--write", "all", "--shard-size", spelling, source, out)
    order = [e["key"] for e in ls_json(source)]
    check_sharded_tree(read_tree(out), flat, order, limit, hf_split, f"--shard-size {spelling}")


@pytest.mark.parametrize("target", ["bf16", "fp16"])
def test_split_uses_converted_sizes(target, split_ckpt, hf_split, ls_json, run_ckptfs, tmp_path):
    source, flat = split_ckpt
    tgt = TARGETS[target]
    out = tmp_path / "out"
    run_ckptfs("export", "--write", "all", "--dtype", target, "--shard-size", "1000", source, out)
    want = {k: converted(t, tgt) for k, t in flat.items()}
    order = [e["key"] for e in ls_json(source)]
    check_sharded_tree(read_tree(out), want, order, 1000, hf_split, f"--dtype {target} --shard-size 1000")


# --- MiniLM ------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_mount_minilm_shards_load_with_transformers(minilm_dir, minilm, mounts, hf_split, ls_json):
    _, _, want_embeddings = minilm
    mnt = mounts.mount(minilm_dir, "shard_size=20MB")
    names = sorted(p.name for p in mnt.iterdir())
    shards = [n for n in names if SHARD_NAME.match(n)]
    assert len(shards) >= 4, f"MiniLM (90 MB) in 20 MB shards: {names}"
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names, names
    assert (mnt / "tensors").is_dir() and (mnt / "config.json").is_file()
    for n in shards:
        k, total = map(int, SHARD_NAME.match(n).groups())
        assert total == len(shards) and 1 <= k <= total, n
        assert (mnt / n).stat().st_size == len((mnt / n).read_bytes()), f"st_size of {n}"

    original = load_file(minilm_dir / "model.safetensors")
    order = [e["key"] for e in ls_json(minilm_dir)]
    files = {n: (mnt / n).read_bytes() for n in shards + ["model.safetensors.index.json"]}
    files.update({f"tensors/{p.name}": b"" for p in (mnt / "tensors").iterdir()})
    check_sharded_tree(files, original, order, 20 * 10**6, hf_split, "mount -o shard_size=20MB")

    assert_same_embeddings(mnt, want_embeddings, "mount -o shard_size=20MB")
