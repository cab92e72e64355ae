"""rsync of the mounted tensors/ is incremental (stable sizes and mtimes), and the copy is
itself a valid ckptfs source whose tensors equal the original's."""

from safetensors.torch import load_file

from ckptfs_testlib import scaled
from fusetools import assert_bitwise_equal, read_manifest, run_bounded

RSYNC_TIMEOUT_S = scaled(60)


def rsync(rsync_bin, src_dir, dest_dir) -> list:
    """rsync -a --itemize-changes SRC/ DEST/; the itemized lines (one per changed entry)."""
    res = run_bounded(
        [rsync_bin, "-a", "--itemize-changes", f"{src_dir}/", f"{dest_dir}/"], RSYNC_TIMEOUT_S
    )
    assert res.returncode == 0, res.describe()
    return [line for line in res.stdout.splitlines() if line.strip()]


def test_rsync_twice_then_mount_the_copy(training_ckpt, mounts, rsync_bin, tmp_path):
    source, expected = training_ckpt
    mnt = mounts.mount(source)
    manifest = read_manifest(mnt)
    files = sorted(e["file"].removeprefix("tensors/") for e in manifest["tensors"])

    dest = tmp_path / "copy"
    dest.mkdir()
    first = rsync(rsync_bin, mnt / "tensors", dest)
    copied = sorted(line.split(" ", 1)[1] for line in first if line.startswith(">f"))
    assert copied == files, f"first rsync copied {copied}"

    second = rsync(rsync_bin, mnt / "tensors", dest)
    assert second == [], f"second rsync transferred or changed something: {second}"

    # Sizes and mtimes survive a remount too, so rsync stays incremental across mounts.
    mounts.unmount(mnt)
    mnt = mounts.mount(source, mnt)
    third = rsync(rsync_bin, mnt / "tensors", dest)
    assert third == [], f"rsync after a remount transferred or changed something: {third}"

    # The copy (a folder of .safetensors files) mounts, and its model.safetensors holds every
    # tensor of the original checkpoint, bit for bit.
    mnt2 = mounts.mount(dest)
    loaded = load_file(mnt2 / "model.safetensors")
    assert set(loaded) == set(expected)
    for key, tensor in expected.items():
        assert_bitwise_equal(loaded[key], tensor, f"copy's model.safetensors[{key}]")
    assert {e["key"] for e in read_manifest(mnt2)["tensors"]} == set(expected)


