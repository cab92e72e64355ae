"""The mount is the folder: the frameworks' own loaders, pointed at a mount, compute what they
compute from the original folder (doc/MOUNT.md). The folders are written by the frameworks'
save code (make_folder_models.py, in the `folders` overlay: diffusers, PEFT, Ultralytics over
the base's transformers and sentence-transformers); the loaders run in the same overlay
(check_folder_loaders.py), against the original and the mount side by side.

Also here: the weight file names each folder is served under, configs that say the served
dtype, pickled modules under their state_dict() names, a tree recognized only in part, and the
permissions a mount serves (a test that switches user)."""

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptfs_fixture_cache import overlay_python
from ckptfs_testlib import assert_bitwise_equal, cached_fixtures_or_fail, run_bounded, scaled

SUITE_DIR = Path(__file__).resolve().parent
GENERATOR = SUITE_DIR / "make_folder_models.py"
CHECKER = SUITE_DIR / "check_folder_loaders.py"
CHECK_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def models() -> Path:
    return cached_fixtures_or_fail(GENERATOR, overlay="folders", timeout_s=1200)


@pytest.fixture(scope="module")
def folders_python() -> str:
    return overlay_python("folders")


def run_check(python: str, *args) -> str:
    """check_folder_loaders.py ARGS in the overlay; fails the test unless it says identical."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["HF_HUB_OFFLINE"] = "1"  # a loader that misses a file must fail, not fetch
    env["TRANSFORMERS_OFFLINE"] = "1"
    done = run_bounded([python, CHECKER, *map(str, args)], scaled(CHECK_TIMEOUT_S), env=env)
    assert not done.timed_out, f"check_folder_loaders.py {args[0]} ran past its deadline"
    assert done.returncode == 0, f"check {args}: {done.stderr[-3000:]}"
    return done.stdout


def tree_of(root: Path) -> set:
    return {str(p.relative_to(root)) for p in root.rglob("*") if not str(p.relative_to(root)).startswith("tensors/")}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", ["diffusers-safetensors", "diffusers-bin"])
def test_diffusers_pipeline_loads_from_the_mount(case, models, folders_python, mounts):
    original = models / case
    mnt = mounts.mount(original)
    # Every folder at its path, each component's weights in it under the loader's name.
    served = tree_of(mnt)
    for name in ("model_index.json", "scheduler/scheduler_config.json", "unet/config.json", "vqvae/config.json",
                 "unet/diffusion_pytorch_model.safetensors", "vqvae/diffusion_pytorch_model.safetensors"):
        assert name in served, f"{case}: {name} missing from the mount: {sorted(served)}"
    assert not [n for n in served if n.endswith(".bin")], f"{case}: torch files served as they are"
    for name in ("model_index.json", "scheduler/scheduler_config.json", "unet/config.json"):
        assert (mnt / name).read_bytes() == (original / name).read_bytes()
    assert "identical" in run_check(folders_python, "diffusers", original, mnt)


@pytest.mark.timeout(900)
def test_diffusers_pipeline_in_fp16(models, folders_python, mounts):
    original = models / "diffusers-safetensors"
    mnt = mounts.mount(original, None, "-o", "dtype=fp16")
    header_len = int.from_bytes((mnt / "unet/diffusion_pytorch_model.safetensors").read_bytes()[:8], "little")
    header = json.loads((mnt / "unet/diffusion_pytorch_model.safetensors").read_bytes()[8:8 + header_len])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"F16"}
    assert "identical" in run_check(folders_python, "diffusers", original, mnt, "fp16")


def test_component_addressed_and_selected(models, run_ckptfs, mounts):
    original = models / "diffusers-safetensors"
    keys = [t["key"] for t in json.loads(run_ckptfs("ls", "--json", original).stdout)]
    unet = load_file(original / "unet/diffusion_pytorch_model.safetensors")
    vqvae = load_file(original / "vqvae/diffusion_pytorch_model.safetensors")
    assert sorted(keys) == sorted([f"unet/{k}" for k in unet] + [f"vqvae/{k}" for k in vqvae])
    info = json.loads(run_ckptfs("info", "--json", original).stdout)
    assert [(m["folder"], m["weights_name"]) for m in info["models"]] == [
        ("unet", "diffusion_pytorch_model.safetensors"), ("vqvae", "diffusion_pytorch_model.safetensors")]
    # cat addresses a component's tensor by its key
    key = next(iter(unet))
    one = run_ckptfs("cat", original, f"tensors/unet%2F{key}.safetensors").stdout
    assert len(one) > 8
    # root= selects one component: the mount is that folder
    mnt = mounts.mount(original, None, "-o", "root=unet")
    assert sorted(p.name for p in mnt.iterdir()) == sorted(
        ["config.json", "diffusion_pytorch_model.safetensors", "manifest.json", "metadata.json", "tensors"])
    served = load_file(mnt / "diffusion_pytorch_model.safetensors")
    assert sorted(served) == sorted(unet)
    for k, t in unet.items():
        assert_bitwise_equal(served[k], t, k)


@pytest.mark.timeout(600)
def test_sentence_transformers_loads_from_the_mount(models, folders_python, mounts):
    original = models / "sentence-transformers"
    mnt = mounts.mount(original)
    for sub in ("1_Pooling/config.json", "2_Normalize/config.json", "modules.json"):
        assert (mnt / sub).read_bytes() == (original / sub).read_bytes()
    assert "identical" in run_check(folders_python, "sentence-transformers", original, mnt)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["peft-safetensors", "peft-bin"])
def test_peft_adapter_loads_from_the_mount(case, models, folders_python, mounts):
    original = models / case
    mnt = mounts.mount(original)
    assert (mnt / "adapter_model.safetensors").is_file()
    assert (mnt / "adapter_config.json").read_bytes() == (original / "adapter_config.json").read_bytes()
    assert "identical" in run_check(folders_python, "peft", models / "llama", original, mnt)


@pytest.mark.timeout(600)
def test_config_says_the_served_dtype(models, folders_python, mounts):
    original = models / "llama"
    mnt = mounts.mount(original, None, "-o", "dtype=bf16")
    before = json.loads((original / "config.json").read_text())
    after = json.loads((mnt / "config.json").read_text())
    assert before["dtype"] == "float32" and after["dtype"] == "bfloat16"
    # nothing else of it changed, byte for byte
    assert (mnt / "config.json").read_bytes() == (original / "config.json").read_bytes().replace(
        b'"dtype": "float32"', b'"dtype": "bfloat16"')
    meta = json.loads((mnt / "metadata.json").read_text())
    assert meta["served_configs"]["config.json"]["dtype_values"] == ["float32"]
    assert "identical" in run_check(folders_python, "transformers-bf16", original, mnt)


def test_quantized_config_refuses_a_dtype_view(models, run_ckptfs, tmp_path):
    folder = tmp_path / "quantized"
    shutil.copytree(models / "llama", folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    done = run_ckptfs("ls", "--dtype", "bf16", folder, check=False)
    assert done.returncode == 1 and done.stdout == b""
    err = done.stderr.decode().strip()
    assert len(err.splitlines()) == 1 and str(folder / "config.json") in err and "quantization_config" in err, err
    assert run_ckptfs("ls", folder).returncode == 0  # served as stored, it is what the config says


def test_ultralytics_model_under_state_dict_names(models, run_ckptfs, tmp_path):
    source = models / "yolo" / "yolo.pt"
    reference = load_file(models / "yolo" / "reference.safetensors")
    listed = json.loads(run_ckptfs("ls", "--json", source).stdout)
    keys = [t["key"] for t in listed if not t["key"].startswith("$attributes.")]
    assert sorted(keys) == sorted(reference)
    attributes = [t["key"] for t in listed if t["key"].startswith("$attributes.")]
    assert attributes and all(k.rsplit(".", 1)[-1] in ("stride", "anchors", "strides") for k in attributes)
    out = tmp_path / "out"
    run_ckptfs("export", source, out)
    served = load_file(out / "model.safetensors")
    for key, tensor in reference.items():
        assert_bitwise_equal(served[key], tensor, key)


def test_partly_recognized_tree_says_what_it_did_not_serve(models, run_ckptfs, tmp_path, mounts):
    folder = tmp_path / "pipeline"
    shutil.copytree(models / "diffusers-safetensors", folder)
    # A folder whose torch file holds no tensors is no model ckptfs can tell: its files are
    # passed through, and that is said.
    broken = folder / "text_encoder"
    broken.mkdir()
    (broken / "config.json").write_text("{}\n")
    torch.save({"step": 3, "note": "no tensors here"}, broken / "model.pt")
    done = run_ckptfs("info", "--json", folder)
    info = json.loads(done.stdout)
    assert [n["path"] for n in info["not_served"]] == ["text_encoder/"], info.get("not_served")
    text = run_ckptfs("info", folder).stdout.decode()
    assert "not served:   text_encoder/" in text
    mountpoint = mounts.new_mountpoint()
    res = mounts.start([mounts.binary, folder, mountpoint], mountpoint)
    mounts.check_mounted(mountpoint, res)
    notes = [line for line in res.stderr.splitlines() if "not served" in line]
    assert len(notes) == 1 and "text_encoder/" in notes[0], res.stderr
    assert (mountpoint / "text_encoder/model.pt").read_bytes() == (broken / "model.pt").read_bytes()
    assert (mountpoint / "unet/diffusion_pytorch_model.safetensors").is_file()


def test_damaged_component_refuses_the_tree(models, run_ckptfs, tmp_path):
    folder = tmp_path / "pipeline"
    shutil.copytree(models / "diffusers-safetensors", folder)
    weights = folder / "vqvae/diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])  # cut short: the header promises more
    done = run_ckptfs("ls", folder, check=False)
    assert done.returncode == 1 and done.stdout == b""
    err = done.stderr.decode().strip()
    assert len(err.splitlines()) == 1 and str(weights) in err, err


def as_user(uid: int, argv) -> subprocess.CompletedProcess:
    def drop():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    return subprocess.run([str(a) for a in argv], capture_output=True, timeout=scaled(60), preexec_fn=drop)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting with allow_other for another user needs root")
@pytest.mark.parametrize("mode,readable", [(0o600, False), (0o644, True)])
def test_permissions_are_the_sources(mode, readable, models, mounts):
    other = 65534  # nobody
    source_dir = Path(tempfile.mkdtemp(prefix="ckptfs-perm-"))
    mount_dir = Path(tempfile.mkdtemp(prefix="ckptfs-perm-mnt-"))
    try:
        os.chmod(mount_dir, 0o755)
        folder = source_dir / "llama"
        shutil.copytree(models / "llama", folder)
        for p in folder.iterdir():
            os.chmod(p, mode)
        mnt = mounts.mount(folder, mount_dir, "-o", "allow_other")
        files = [mnt / "model.safetensors", mnt / "config.json", mnt / "metadata.json", mnt / "manifest.json",
                 next((mnt / "tensors").iterdir())]
        for f in files:
            st = f.stat()
            assert stat.S_IMODE(st.st_mode) == mode & 0o555, f"{f}: {oct(st.st_mode)}"
            assert st.st_uid == 0
        for f in files:
            done = as_user(other, ["cat", f])
            assert (done.returncode == 0) == readable, f"{f} as uid {other}: {done.returncode} {done.stderr}"
            if readable:
                assert done.stdout == f.read_bytes()
    finally:
        shutil.rmtree(source_dir, ignore_errors=True)
