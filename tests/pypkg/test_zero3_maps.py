"""ckptfs.load(device="cpu") of ZeRO-3 saves whose parameters are split over the rank files in
whole pages: those tensors are composed of private maps of the rank files (ckptfs_load_mapped),
byte for byte what DeepSpeed's zero_to_fp32 gives, and the maps live exactly as long as the
tensors."""

import gc
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import mapped_file

import ckptfs
from ckptfs._source import Source
from ckptfs_testlib import REPO_ROOT, assert_bitwise_equal, cached_fixtures_or_fail

GENERATOR = REPO_ROOT / "tests" / "pypkg" / "make_zero3_pages.py"
REFUSED_MAPS = REPO_ROOT / "tests" / "pypkg" / "refused_maps.py"
FAILED_READS = REPO_ROOT / "tests" / "pypkg" / "failed_reads.py"
WORLD_SIZES = (2, 4)


@pytest.fixture(scope="session")
def zero3_root() -> Path:
    return cached_fixtures_or_fail(GENERATOR)


def checkpoint(root: Path, world: int) -> tuple[Path, dict]:
    """(the save dir, zero_to_fp32's {key: tensor})."""
    folder = root / f"w{world}"
    return folder / "checkpoint", torch.load(folder / "zero_to_fp32.pt", weights_only=False)


def rank_files(save_dir: Path) -> list[str]:
    """The fp32 master files in rank order, as /proc/self/maps names them."""
    files = [str(p.resolve()) for p in save_dir.glob("global_step*/*optim_states.pt")]
    return sorted(files, key=lambda name: int(Path(name).name.split("_rank_")[1].split("_")[0]))


def maps_of(files: list[str]) -> int:
    """How many mappings of FILES this process has (of a file since deleted or replaced too)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if any(name in line for name in files))


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_split_tensors_are_maps_of_every_rank_file(zero3_root, world):
    save_dir, reference = checkpoint(zero3_root, world)
    files = rank_files(save_dir)
    assert len(files) == world
    entries = {e["key"]: e for e in ckptfs.list_tensors(save_dir)}
    # The embedding's partitions are whole pages on every rank: all of them are maps.
    assert entries["embed.weight"]["maps"] == world
    # A bias of a few elements is read.
    assert "maps" not in entries["fc1.bias"]

    loaded = ckptfs.load(save_dir, device="cpu")
    assert list(loaded) == list(reference)
    for key, want in reference.items():
        assert_bitwise_equal(loaded[key], want, f"w{world}[{key}]")
    # The middle of each rank's share of the embedding is that rank's file.
    embed = loaded["embed.weight"]
    share = embed.nbytes // world
    for rank, name in enumerate(files):
        assert mapped_file(embed.data_ptr() + rank * share + share // 2) == name
    # Bias tensors are not maps of a rank file.
    assert mapped_file(loaded["fc1.bias"].data_ptr()) not in files


def test_safe_open_get_tensor_maps_them_too(zero3_root):
    save_dir, reference = checkpoint(zero3_root, 4)
    files = rank_files(save_dir)
    with ckptfs.safe_open(save_dir) as f:
        fc1 = f.get_tensor("fc1.weight")
        bias = f.get_tensor("fc1.bias")
    assert_bitwise_equal(fc1, reference["fc1.weight"], "fc1.weight")
    assert_bitwise_equal(bias, reference["fc1.bias"], "fc1.bias")
    # The first and last ranks' 64 KiB are maps; the middle ranks' (a page short once cut to
    # whole pages) are read.
    share = fc1.nbytes // 4
    assert mapped_file(fc1.data_ptr() + share // 2) == files[0]
    assert mapped_file(fc1.data_ptr() + 3 * share + share // 2) == files[3]
    assert mapped_file(fc1.data_ptr() + share + share // 2) not in files


def test_partly_mapped_tensors_are_whole(zero3_root):
    """At 2 ranks proj's partitions are 18.75 pages: the first rank's piece is mapped, the
    second's is read into the same tensor."""
    save_dir, reference = checkpoint(zero3_root, 2)
    files = rank_files(save_dir)
    assert {e["key"]: e for e in ckptfs.list_tensors(save_dir)}["proj.weight"]["maps"] == 1
    proj = ckptfs.load(save_dir, device="cpu", select="proj.weight")["proj.weight"]
    assert_bitwise_equal(proj, reference["proj.weight"], "proj.weight")
    assert mapped_file(proj.data_ptr() + 4096) == files[0]
    assert mapped_file(proj.data_ptr() + proj.nbytes - 8) not in files


def test_tensors_outlive_the_load_and_the_maps_go_with_the_last(zero3_root):
    save_dir, reference = checkpoint(zero3_root, 2)
    files = rank_files(save_dir)
    gc.collect()
    assert maps_of(files) == 0
    loaded = ckptfs.load(save_dir, device="cpu")
    assert maps_of(files) > 0
    kept = loaded["fc2.weight"]
    del loaded
    gc.collect()
    # One tensor keeps the whole region (as a file map's tensors keep their file's map).
    assert maps_of(files) > 0
    assert_bitwise_equal(kept, reference["fc2.weight"], "fc2.weight after the others died")
    view = kept[3:5]
    del kept
    gc.collect()
    assert maps_of(files) > 0
    assert_bitwise_equal(view, reference["fc2.weight"][3:5], "a view of it")
    del view
    gc.collect()
    assert maps_of(files) == 0


def test_writes_stay_in_the_process(zero3_root):
    """Private maps: writing to a loaded tensor changes neither the rank files nor another
    load."""
    save_dir, reference = checkpoint(zero3_root, 2)
    digests = {name: hashlib.sha256(Path(name).read_bytes()).hexdigest() for name in rank_files(save_dir)}
    loaded = ckptfs.load(save_dir, device="cpu")
    for tensor in loaded.values():
        tensor.add_(1)
    again = ckptfs.load(save_dir, device="cpu")
    for key, want in reference.items():
        assert_bitwise_equal(again[key], want, f"{key} after another load's tensors were written")
        assert_bitwise_equal(loaded[key], want + 1, f"{key} written")
    assert {name: hashlib.sha256(Path(name).read_bytes()).hexdigest() for name in digests} == digests


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_other_ways_of_loading_agree(zero3_root, world):
    save_dir, reference = checkpoint(zero3_root, world)
    copied = ckptfs.load(save_dir, device="cpu", mmap=False)
    as_bf16 = ckptfs.load(save_dir, device="cpu", dtype="bf16")
    selected = ckptfs.load(save_dir, device="cpu", select=["embed.*", "fc2.weight"])
    assert list(selected) == ["embed.weight", "fc2.weight"]
    files = rank_files(save_dir)
    assert mapped_file(copied["embed.weight"].data_ptr() + 8192) not in files
    for key, want in reference.items():
        assert_bitwise_equal(copied[key], want, f"{key} copied")
        assert_bitwise_equal(as_bf16[key], want.to(torch.bfloat16), f"{key} as bf16")
        if key in selected:
            assert_bitwise_equal(selected[key], want, f"{key} selected")


def test_a_rank_file_changed_before_mapping_is_an_error(zero3_root, tmp_path):
    """The files mapped must be those indexed: a rewritten or replaced rank file is an error
    naming it, never other bytes."""
    source, _ = checkpoint(zero3_root, 2)
    save_dir = tmp_path / "checkpoint"
    for path in source.rglob("*"):
        if path.is_file():
            (save_dir / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (save_dir / path.relative_to(source)).write_bytes(path.read_bytes())
    rank1 = Path(rank_files(save_dir)[1])
    with Source(save_dir, {}) as opened:
        composed = [e for e in opened.tensors if e.get("maps")]
        stat = rank1.stat()
        os.utime(rank1, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        with pytest.raises(ckptfs.CkptfsError, match=f"{rank1.name}.*changed since it was indexed"):
            opened.load_mapped_torch(composed)
    with Source(save_dir, {}) as opened:
        composed = [e for e in opened.tensors if e.get("maps")]
        replacement = tmp_path / "other.pt"
        replacement.write_bytes(rank1.read_bytes())
        replacement.rename(rank1)
        with pytest.raises(ckptfs.CkptfsError, match=f"{rank1.name}.*replaced since it was indexed"):
            opened.load_mapped_torch(composed)
    assert maps_of([str(rank1.resolve())]) == 0


def test_a_refused_map_is_read_instead(zero3_root):
    """Where the kernel refuses a file map (a file system without mmap: ENODEV), libckptfs
    reads those bytes into the memory it reserved: the same tensors, bit for bit, and no map
    of a rank file. refused_maps.py refuses them with a seccomp filter in a process of its own
    and loads once before and once after."""
    save_dir, _ = checkpoint(zero3_root, 2)
    files = rank_files(save_dir)
    result = subprocess.run([sys.executable, str(REFUSED_MAPS), str(save_dir),
                             str(zero3_root / "w2" / "zero_to_fp32.pt"), *files],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    before, refused = report["before"], report["refused"]
    # Without the filter the same load maps both rank files: the filter is what changes.
    assert before["load_stats"]["maps"] > 0 and before["map_tensors_maps"] > 0
    assert before["rank_files_mapped"] == files
    assert before["differing"] == []
    assert refused["load_stats"]["maps"] == 0 and refused["load_stats"]["mapped_bytes"] == 0
    assert refused["load_stats"]["bytes_read"] == refused["load_stats"]["bytes"] > 0
    assert refused["map_tensors_maps"] == 0
    assert refused["map_tensors_read_bytes"] == refused["map_tensors_bytes"] > 0
    assert refused["rank_files_mapped"] == []
    assert refused["differing"] == [], "tensors that differ from zero_to_fp32's after the maps were refused"


def test_a_read_that_fails_after_the_maps_unmaps_them(zero3_root):
    """ckptfs_load_mapped maps rank files' pages first, then preads what no map supplies: when
    that read fails (failed_reads.py makes every pread64 fail with EIO after the open), the
    call fails with one error naming a rank file and leaves no map of any rank file behind."""
    save_dir, _ = checkpoint(zero3_root, 2)
    files = rank_files(save_dir)
    result = subprocess.run([sys.executable, str(FAILED_READS), str(save_dir), *files],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    # Unfiltered, the same call maps and reads: the failing read comes after maps were made.
    assert report["before"]["maps"] > 0 and report["before"]["bytes_read"] > 0, report
    assert report["error"] is not None, "the load succeeded although every pread64 failed"
    assert any(Path(f).name in report["error"] for f in files), report["error"]
    assert "Input/output error" in report["error"] or "I/O error" in report["error"], report["error"]
    assert report["rank_files_mapped"] == [], "the failed load left maps of rank files"
