"""XXH3-64 checksums of the tensor files, checked against the real `xxhsum -H3`:
- `ckptfs hash SOURCE` prints `XXH3 (tensors/<file>) = <16 hex>` per tensor, exactly what
  xxhsum -H3 prints for the exported files (cwd = the export dir);
- `--checksums` / `-o checksums` add `"xxh3"` to each manifest.json tensor entry;
- on a mount, the xattr user.ckptfs.xxh3 of each tensors/*.safetensors file."""

import json
import os

import pytest
import torch

from ckptfs_testlib import flatten_tensors
from fusetools import run_bounded
from viewtools import parse_xxh3_lines


@pytest.fixture(scope="module")
def hash_ckpt(tmp_path_factory):
    """Keys that escape ('/', '%'), a key too long for a file name, several dtypes, a
    subtree to select with --root."""
    g = torch.Generator().manual_seed(29)
    ckpt = {
        "model": {
            "embed.weight": torch.randn(50, 16, generator=g),
            "layers/0%w": torch.randn(16, 16, generator=g).to(torch.bfloat16),
            "n" * 300: torch.randn(9, generator=g, dtype=torch.float64),
            "ids": torch.arange(40, dtype=torch.int64),
            "special": torch.tensor([float("nan"), -0.0, float("inf"), 1e-40, 65520.0]),
        },
        "optimizer": {"state": {0: {"exp_avg": torch.randn(50, 16, generator=g)}}},
        "step": 3,
    }
    path = tmp_path_factory.mktemp("hash") / "hash.pt"
    torch.save(ckpt, path)
    return path, flatten_tensors(torch.load(path, weights_only=True))


def xxhsum_tree(xxhsum_bin, root, files) -> dict:
    """{relative path: hex} from `xxhsum -H3 FILES...` run inside ROOT."""
    res = run_bounded([xxhsum_bin, "-H3", *files], 60, cwd=root)
    assert res.returncode == 0, res.describe()
    return parse_xxh3_lines(res.stdout, "xxhsum -H3")


VIEWS = [
    [],
    ["--dtype", "bf16"],
    ["--dtype", "fp16", "--root", "model"],
    ["--root", "model", "--shard-size", "2KB"],
]


@pytest.mark.parametrize("options", VIEWS, ids=lambda o: " ".join(o) or "plain")
def test_hash_matches_xxhsum_of_export(options, hash_ckpt, run_ckptfs, xxhsum_bin, tmp_path):
    source, _ = hash_ckpt
    out = tmp_path / "out"
    run_ckptfs("export", "--write", "all", "--checksums", *options, source, out)
    listed = json.loads(run_ckptfs("ls", "--json", *options, source).stdout)
    files = [e["file"] for e in listed]
    assert len(files) == len({f for f in files})
    on_disk = sorted(p.relative_to(out).as_posix() for p in (out / "tensors").iterdir())
    assert on_disk == sorted(files)

    reference = xxhsum_tree(xxhsum_bin, out, files)
    res = run_ckptfs("hash", *options, source)
    assert res.stderr == b"", res.stderr
    lines = res.stdout.decode().splitlines()
    assert len(lines) == len(files), f"hash printed {len(lines)} lines for {len(files)} tensors"
    hashed = parse_xxh3_lines(res.stdout.decode(), f"ckptfs hash {' '.join(options)}")
    assert set(hashed) == set(files), "hash names other files than ls --json"
    for f in files:
        assert hashed[f] == reference[f], f"{f}: ckptfs hash {hashed[f]}, xxhsum -H3 {reference[f]}"

    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["tensors"]) == len(files)
    for t in manifest["tensors"]:
        assert t.get("xxh3") == reference[t["file"]], (
            f"manifest xxh3 of {t['file']}: {t.get('xxh3')!r}, xxhsum -H3 {reference[t['file']]}"
        )


def test_manifest_has_no_checksums_without_the_option(hash_ckpt, run_ckptfs):
    source, _ = hash_ckpt
    manifest = json.loads(run_ckptfs("cat", source, "manifest.json").stdout)
    assert not [t["key"] for t in manifest["tensors"] if "xxh3" in t]
    with_sums = json.loads(run_ckptfs("cat", "--checksums", source, "manifest.json").stdout)
    assert all(len(t["xxh3"]) == 16 for t in with_sums["tensors"])


@pytest.mark.parametrize("options", [[], ["dtype=fp16"], ["dtype=bf16", "root=model", "checksums"]],
                         ids=lambda o: ",".join(o) or "plain")
def test_mount_xattr_is_xxh3_of_the_file(options, hash_ckpt, mounts, run_ckptfs, xxhsum_bin):
    source, _ = hash_ckpt
    mnt = mounts.mount(source, *options)
    files = sorted(p.relative_to(mnt).as_posix() for p in (mnt / "tensors").iterdir())
    assert files
    reference = xxhsum_tree(xxhsum_bin, mnt, files)
    cli = [a for o in options for a in (
        ["--checksums"] if o == "checksums" else ["--" + o.split("=")[0], o.split("=")[1]])]
    hashed = parse_xxh3_lines(run_ckptfs("hash", *cli, source).stdout.decode(), "ckptfs hash")
    for f in files:
        path = mnt / f
        assert "user.ckptfs.xxh3" in os.listxattr(path), f"{f}: xattrs {os.listxattr(path)}"
        value = os.getxattr(path, "user.ckptfs.xxh3").decode()
        assert value == reference[f], f"{f}: xattr {value!r}, xxhsum -H3 of the mounted file {reference[f]}"
        assert os.getxattr(path, "user.ckptfs.xxh3").decode() == value, f"{f}: second request differs"
        assert hashed[f] == value, f"{f}: ckptfs hash {hashed[f]}, xattr {value}"

    manifest_bytes = (mnt / "manifest.json").read_bytes()
    assert (mnt / "manifest.json").stat().st_size == len(manifest_bytes), "st_size of manifest.json"
    manifest = json.loads(manifest_bytes)
    for t in manifest["tensors"]:
        if "checksums" in options:
            assert t.get("xxh3") == reference[t["file"]], f"manifest xxh3 of {t['file']}"
        else:
            assert "xxh3" not in t, f"manifest has xxh3 without -o checksums: {t['file']}"
