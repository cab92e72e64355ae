"""torch.save files of DTensors (FSDP2, tensor parallel, HSDP) and ShardedTensors (FSDP1
SHARDED_STATE_DICT), one per rank, as torch itself writes them (make_fsdp_rank_files.py, gloo
ranks on the CPU, world sizes 2 and 3 with uneven and empty shards).

- A single rank file serves each distributed tensor's local shards as <key>.local_shards.<i>,
  bit for bit what to_local() / local_shards() give, never the DTensor's internals, and
  describes the tensor in metadata.json.
- A folder of one save's rank files serves the full tensors, bit for bit what full_tensor() /
  ShardedTensor.gather() / FSDP1's FULL_STATE_DICT give (export, cat, a mount).
- A missing rank, a file in the wrong place, shards that disagree or overlap, and Partial /
  _StridedShard placements are refused with one line naming the file and what is wrong.
"""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ckptfs_testlib import assert_bitwise_equal, cached_fixtures_or_fail, check_safetensors_file

import make_fsdp_rank_files as gen

GENERATOR = Path(gen.__file__)
ASSEMBLED = ["fsdp2_ws2", "fsdp2_ws3", "fsdp1_ws2", "fsdp1_ws3", "tp_ws2", "tp_ws3", "hsdp_ws2"]
# What a DTensor pickles besides its local tensor: none of it is a tensor of the checkpoint.
INTERNALS = ("_rank_map", "mesh", "_spec", "_local_tensor", "_layout", "shards_metadata", ".tensor")


@pytest.fixture(scope="module")
def root() -> Path:
    return cached_fixtures_or_fail(GENERATOR)


def rank_file(root: Path, case: str, part: str, rank: int) -> Path:
    group = gen.MODEL_GROUP if part == "model" else gen.OPTIM_GROUP
    return root / case / part / group.format(world=gen.CASES[case], rank=rank)


def node_at(tree: dict, key: str):
    """The metadata.json node at flattened KEY (its path's elements may hold dots)."""
    if key in tree:
        return tree[key]
    for name, child in tree.items():
        if key.startswith(name + ".") and isinstance(child, dict):
            found = node_at(child, key[len(name) + 1 :])
            if found is not None:
                return found
    return None


def exported(run_ckptfs, source: Path, out: Path) -> dict:
    run_ckptfs("export", source, out)
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize("case", ["fsdp2_ws3", "fsdp1_ws3", "tp_ws3", "hsdp_ws2", "partial_ws2", "strided_ws2"])
def test_single_rank_file_serves_its_local_shards(case, root, run_ckptfs, tmp_path):
    world = gen.CASES[case]
    parts = ["model"] + (["optim"] if (root / case / "optim").is_dir() else [])
    for rank in range(world):
        want_local = load_file(root / case / "local" / f"rank{rank}.safetensors")
        served_local = {}
        for part in parts:
            source = rank_file(root, case, part, rank)
            got = exported(run_ckptfs, source, tmp_path / f"{part}{rank}")
            for key in got:
                assert not any(word in key for word in INTERNALS), f"{source.name}: internals served as {key}"
            served_local.update({k: v for k, v in got.items() if ".local_shards." in k})
            meta = json.loads((tmp_path / f"{part}{rank}" / "metadata.json").read_text())
            described = [k for k in want_local if (k.startswith("state.") == (part == "optim"))]
            for key in described:
                tensor_key = key[: key.index(".local_shards.")]
                d = node_at(meta, tensor_key)["$distributed_tensor"]
                assert key in [s["key"] for s in d["local_shards"]], d
                assert d["rank"] == rank and d["world_size"] == world, d
        assert set(served_local) == set(want_local), f"{case} rank {rank}: local shard keys"
        for key, tensor in want_local.items():
            assert_bitwise_equal(served_local[key], tensor, f"{case} rank {rank} {key}")


def test_single_rank_file_describes_the_layout(root, run_ckptfs):
    meta = json.loads(run_ckptfs("cat", rank_file(root, "tp_ws3", "model", 2), "metadata.json").stdout)
    d = meta["head.weight"]["$distributed_tensor"]
    assert d["class"] == "DTensor" and d["placements"] == ["Shard(1)"] and d["shape"] == [2, 7], d
    assert d["mesh_shape"] == [3] and d["coordinate"] == [2], d
    # torch.chunk of 7 columns into 3: 3, 3, 1.
    assert d["local_shards"] == [{"key": "head.weight.local_shards.0", "offsets": [0, 6], "shape": [2, 1]}], d
    meta = json.loads(run_ckptfs("cat", rank_file(root, "fsdp1_ws3", "model", 2), "metadata.json").stdout)
    d = meta["head.bias"]["$distributed_tensor"]
    # 2 rows over 3 ranks: rank 2 holds no shard, and its metadata lists the other two.
    assert d["class"] == "ShardedTensor" and d["local_shards"] == [], d
    assert [s["rank"] for s in d["shards"]] == [0, 1], d


@pytest.mark.parametrize("part", ["model", "optim"])
@pytest.mark.parametrize("case", ASSEMBLED)
def test_rank_set_consolidates_to_the_full_tensors(case, part, root, run_ckptfs, tmp_path):
    want = load_file(root / case / f"{part}.reference.safetensors")
    folder = root / case / part
    run_ckptfs("export", folder, tmp_path / "out")
    check_safetensors_file(tmp_path / "out" / "model.safetensors", want)
    info = json.loads(run_ckptfs("info", "--json", folder).stdout)
    assert info["format"] == "torch-ranks", info
    summary = info["metadata"]["rank_files"]
    assert summary["world_size"] == gen.CASES[case], summary
    assert summary["distributed_tensors"] > 0 and summary["kinds"] == ("sharded_tensor" if "fsdp1" in case else "dtensor")


def test_cat_of_one_tensor_and_non_tensor_values(root, run_ckptfs, tmp_path):
    folder = root / "fsdp2_ws3" / "optim"
    want = load_file(root / "fsdp2_ws3" / "optim.reference.safetensors")
    out = tmp_path / "t.safetensors"
    out.write_bytes(run_ckptfs("cat", folder, "tensors/state.4.exp_avg.safetensors").stdout)
    assert_bitwise_equal(load_file(out)["state.4.exp_avg"], want["state.4.exp_avg"], "cat of state.4.exp_avg")
    meta = json.loads(run_ckptfs("cat", folder, "metadata.json").stdout)
    assert meta["param_groups"][0]["lr"] == 0.01 and meta["param_groups"][0]["params"] == [0, 1, 2, 3, 4], meta


@pytest.mark.timeout(120)
def test_mounted_rank_set_reads_the_full_tensors(root, mounts):
    want = load_file(root / "fsdp1_ws3" / "model.reference.safetensors")
    mnt = mounts.mount(root / "fsdp1_ws3" / "model")
    check_safetensors_file(mnt / "model.safetensors", want)


def refused(run_ckptfs, source) -> str:
    res = run_ckptfs("ls", source, check=False)
    assert res.returncode not in (0, None), f"ckptfs ls {source} was not refused"
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def copy_set(root: Path, case: str, part: str, dest: Path, ranks=None, names=None) -> Path:
    dest.mkdir()
    for rank in ranks if ranks is not None else range(gen.CASES[case]):
        src = rank_file(root, case, part, rank)
        shutil.copy(src, dest / (names.format(rank=rank) if names else src.name))
    return dest


def test_missing_rank_file_is_named(root, run_ckptfs, tmp_path):
    folder = copy_set(root, "fsdp2_ws3", "model", tmp_path / "m", ranks=[0, 2])
    line = refused(run_ckptfs, folder)
    assert "model_world_size_3_rank_1.pt" in line and "missing" in line, line


@pytest.mark.parametrize("case", ["fsdp2_ws3", "fsdp1_ws3"])
def test_missing_last_rank_found_from_the_tensors(case, root, run_ckptfs, tmp_path):
    # Names without the world size: the mesh / process group says 3 ranks.
    folder = copy_set(root, case, "model", tmp_path / "m", ranks=[0, 1], names="rank{rank}.pt")
    line = refused(run_ckptfs, folder)
    assert "rank0.pt" in line and "3 ranks" in line and "missing" in line, line


@pytest.mark.parametrize("case", ["fsdp2_ws2", "fsdp1_ws2"])
def test_file_in_the_place_of_another_rank(case, root, run_ckptfs, tmp_path):
    folder = copy_set(root, case, "model", tmp_path / "m", ranks=[0])
    shutil.copy(rank_file(root, case, "model", 0), folder / rank_file(root, case, "model", 1).name)
    line = refused(run_ckptfs, folder)
    assert "rank_1.pt" in line and "saved by rank 0" in line, line


def test_shards_of_different_layouts(root, run_ckptfs, tmp_path):
    folder = copy_set(root, "fsdp2_ws2", "model", tmp_path / "m", ranks=[0])
    # HSDP's rank 1: (Replicate(), Shard(0)) on a (2, 1) mesh where FSDP2's is (Shard(0)) on (2,).
    shutil.copy(rank_file(root, "hsdp_ws2", "model", 1), folder / rank_file(root, "fsdp2_ws2", "model", 1).name)
    line = refused(run_ckptfs, folder)
    assert "rank_1.pt" in line and "placements" in line, line


def test_overlapping_shards(root, run_ckptfs, tmp_path):
    # Both files' metadata moved to place rank 1's proj.weight shard at row 3 (rank 0 holds
    # rows 0-3): a pickled integer patched in place, lengths unchanged.
    folder = copy_set(root, "fsdp1_ws2", "model", tmp_path / "m")
    patched = 0
    for f in folder.iterdir():
        data = f.read_bytes()
        patched += data.count(b"(K\x04K\x00e")
        f.write_bytes(data.replace(b"(K\x04K\x00e", b"(K\x03K\x00e"))
    assert patched == 3, "the shard offsets [4, 0] were not where expected"
    line = refused(run_ckptfs, folder)
    assert "proj.weight" in line and "overlap" in line, line


@pytest.mark.parametrize("case,placement", [("partial_ws2", "Partial(sum)"), ("strided_ws2", "_StridedShard")])
def test_placements_that_are_not_blocks_are_refused(case, placement, root, run_ckptfs):
    line = refused(run_ckptfs, root / case / "model")
    assert "'odd'" in line and placement in line and "not assembled" in line, line


def test_fsdp1_local_state_dict(root, run_ckptfs, tmp_path):
    """LOCAL_STATE_DICT: a rank file serves its shard of the flat parameter; the set is refused,
    since the per-parameter tensors are views of that shard whose place is not recorded."""
    folder = root / "fsdp1_ws2" / "local_state_dict"
    for rank in range(2):
        want = load_file(root / "fsdp1_ws2" / "local" / f"rank{rank}.flat.safetensors")
        assert list(want) == ["_flat_param.local_shards.0"], list(want)
        got = exported(run_ckptfs, folder / gen.MODEL_GROUP.format(world=2, rank=rank), tmp_path / str(rank))
        assert_bitwise_equal(got["_flat_param.local_shards.0"], want["_flat_param.local_shards.0"], f"rank {rank}")
    line = refused(run_ckptfs, folder)
    assert "views the local shard of '_flat_param'" in line, line
