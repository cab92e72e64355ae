"""Folders as Hugging Face's training tools write them (make_hf_folders.py: transformers 4.57 and
5.x Trainer, save_pretrained shards, accelerate's save_state, PEFT adapters) are served as the
model the tool itself loads back: the weights found by the tools' own file names, bit for bit
equal to from_pretrained's / load_state's / load_peft_weights' tensors, no optimizer state among
them, and every other file passed through unchanged. A folder with checkpoints only in its
subfolders is refused with a line naming them."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptfs_testlib import assert_bitwise_equal, cached_fixtures_or_fail

GENERATOR = Path(__file__).resolve().parent / "make_hf_folders.py"
TF4_CASES = ["trainer-bin", "trainer-safetensors", "sharded-bin", "sharded-safetensors"]
TF5_CASES = ["trainer", "accelerate-bin", "accelerate-safetensors", "peft-safetensors", "peft-bin"]

# The files each kind of folder holds that are not weights, as the tools name them: each must
# be in the folder the tool wrote (so the case tests what it says) and passed through.
TRAINER_STATE = ["optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "trainer_state.json",
                 "config.json", "generation_config.json"]
PASSED_THROUGH = {
    "trainer-bin": TRAINER_STATE,
    "trainer-safetensors": TRAINER_STATE,
    "trainer": TRAINER_STATE,
    "sharded-bin": ["config.json", "generation_config.json"],
    "sharded-safetensors": ["config.json", "generation_config.json"],
    "accelerate-bin": ["optimizer.bin", "scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"],
    "accelerate-safetensors": ["optimizer.bin", "optimizer_1.bin", "scheduler.bin", "random_states_0.pkl",
                               "custom_checkpoint_0.pkl", "model_1.safetensors"],
    "peft-safetensors": ["adapter_config.json", "README.md"],
    "peft-bin": ["adapter_config.json", "README.md"],
}
# Keys of a torch optimizer's state_dict, flattened as ckptfs flattens them.
OPTIMIZER_PREFIXES = ("state.", "param_groups.")


@pytest.fixture(scope="module")
def tf4_root() -> Path:
    return cached_fixtures_or_fail(GENERATOR, overlay="tf4")


@pytest.fixture(scope="module")
def tf5_root() -> Path:
    return cached_fixtures_or_fail(GENERATOR, overlay="tf5")


@pytest.fixture(scope="module")
def case_dir(request, tf4_root, tf5_root):
    def find(name: str) -> Path:
        root = tf4_root if name in TF4_CASES else tf5_root
        assert name in json.loads((root / "cases.json").read_text()), f"the generator wrote no case {name}"
        return root / name

    return find


def case_info(case: Path) -> tuple[dict, Path]:
    record = json.loads((case / "case.json").read_text())
    return record, case / record["checkpoint"]


def test_each_overlay_ran_its_transformers(tf4_root, tf5_root):
    import transformers

    assert json.loads((tf4_root / "trainer-bin" / "case.json").read_text())["transformers"].startswith("4.57.")
    assert json.loads((tf5_root / "trainer" / "case.json").read_text())["transformers"] == transformers.__version__
    assert transformers.__version__.startswith("5.")


@pytest.mark.parametrize("name", TF4_CASES + TF5_CASES)
def test_folder_serves_what_the_tool_loads(name, case_dir, run_ckptfs, tmp_path):
    case = case_dir(name)
    record, checkpoint = case_info(case)
    for extra in PASSED_THROUGH[name]:
        assert (checkpoint / extra).is_file(), f"{name}: the tool wrote no {extra}; the case tests nothing"
    # export into a path whose parents do not exist yet
    out = tmp_path / "new" / "parents" / "out"
    run_ckptfs("export", checkpoint, out)

    # Served under the names the tool's loader looks for (doc/MOUNT.md, "Weight file names"):
    # an adapter as adapter_model.safetensors, a sharded folder in its own shards and index.
    manifest = json.loads((out / "manifest.json").read_text())
    want_file = ("adapter_model.safetensors" if name.startswith("peft") else
                 "model.safetensors.index.json" if name.startswith("sharded") else "model.safetensors")
    assert manifest["model_file"] == want_file, f"{name}: the model is served as {manifest['model_file']}"
    generated = {want_file}
    if want_file.endswith(".index.json"):
        index = json.loads((out / want_file).read_text())
        shards = sorted(set(index["weight_map"].values()))
        source_shards = sorted(w for w in record["weights"] if not w.endswith(".index.json"))
        assert shards == [w.replace("pytorch_model", "model").replace(".bin", ".safetensors") for w in source_shards]
        generated.update(shards)
        served = {}
        for shard in shards:
            part = load_file(out / shard)
            assert all(index["weight_map"][k] == shard for k in part), f"{name}: {shard} and the index disagree"
            served.update(part)
    else:
        served = load_file(out / want_file)
    assert sorted(served) == sorted(record["keys"]), f"{name}: served keys differ from the weight files' keys"
    assert not [k for k in served if k.startswith(OPTIMIZER_PREFIXES)], f"{name}: optimizer state served as weights"
    reference = load_file(case / "reference.safetensors")
    for key, tensor in served.items():
        assert key in reference, f"{name}: {key} is not in what the tool loads"
        assert_bitwise_equal(tensor, reference[key], f"{name}: {key}")

    # Every other file of the folder, byte for byte; the weight files and indexes are not (a
    # file of a generated name among them is the generated one, compared above).
    for source in checkpoint.iterdir():
        if source.name in generated:
            continue
        if source.name in record["weights"] or source.name.endswith(".index.json"):
            assert not (out / source.name).exists(), f"{name}: {source.name} is read as weights, not passed through"
        else:
            assert (out / source.name).read_bytes() == source.read_bytes(), f"{name}: {source.name} changed"


@pytest.mark.parametrize("name", TF4_CASES + TF5_CASES)
def test_info_says_what_each_file_is(name, case_dir, run_ckptfs):
    record, checkpoint = case_info(case_dir(name))
    info = json.loads(run_ckptfs("info", "--json", checkpoint).stdout)
    files = info["folder"]["files"]
    assert sorted(files) == sorted(p.name for p in checkpoint.iterdir())
    index = record.get("index")
    for file, what in files.items():
        want = "weights" if file in record["weights"] else "index" if file == index else "passed through"
        assert what["role"] == want, f"{name}: {file} is {what}"
        assert what["why"], f"{name}: no reason given for {file}"
    for state in ("optimizer.pt", "optimizer.bin", "rng_state.pth", "random_states_0.pkl"):
        if state in files:
            assert "not the model's weights" in files[state]["why"]
    text = run_ckptfs("info", checkpoint).stdout.decode()
    assert "folder files (weights: " in text
    for file in files:
        assert f"\n  {file} " in text, f"{name}: info does not list {file}"


def test_optimizer_state_is_in_the_trainer_folder(case_dir):
    # The Trainer cases hold an Adam state with tensors (what a reader of every .pt would serve).
    for name in ("trainer-bin", "trainer-safetensors", "trainer"):
        record, _ = case_info(case_dir(name))
        assert record["optimizer_state_tensors"] > 0, name


@pytest.mark.parametrize("name", ["trainer-bin", "trainer"])
def test_output_dir_is_served_as_the_folder_it_is(name, case_dir, run_ckptfs, tmp_path):
    """A Trainer's output_dir holds its checkpoints in checkpoint-N/ subfolders: each is a model
    served in its own folder, its keys under checkpoint-N/ in listings."""
    case = case_dir(name)
    record, checkpoint = case_info(case)
    output_dir = case / record["output_dir"]
    listed = ls_json_of(run_ckptfs, output_dir)
    assert sorted(listed) == sorted(f"{checkpoint.name}/{k}" for k in record["keys"])
    info = json.loads(run_ckptfs("info", "--json", output_dir).stdout)
    assert [m["folder"] for m in info["models"]] == [checkpoint.name]
    out = tmp_path / "out"
    run_ckptfs("export", output_dir, out)
    served = load_file(out / checkpoint.name / "model.safetensors")
    reference = load_file(case / "reference.safetensors")
    assert sorted(served) == sorted(record["keys"])
    for key, tensor in served.items():
        assert_bitwise_equal(tensor, reference[key], f"{name}: {key}")
    for source in checkpoint.iterdir():
        if source.name not in record["weights"]:
            assert (out / checkpoint.name / source.name).read_bytes() == source.read_bytes(), source.name


def ls_json_of(run_ckptfs, source) -> list:
    return [t["key"] for t in json.loads(run_ckptfs("ls", "--json", source).stdout)]


def test_folder_of_training_state_only_is_refused(case_dir, run_ckptfs, tmp_path):
    """A Trainer checkpoint whose model files are gone: its .pt/.pth/.bin files are training
    state, never weights."""
    _, checkpoint = case_info(case_dir("trainer-bin"))
    folder = tmp_path / "state-only"
    folder.mkdir()
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "trainer_state.json"):
        shutil.copy2(checkpoint / name, folder / name)
    done = run_ckptfs("ls", folder, check=False)
    assert done.returncode == 1 and done.stdout == b""
    err = done.stderr.decode().strip()
    assert len(err.splitlines()) == 1
    assert "training state is not weights: optimizer.pt" in err, err


@pytest.mark.timeout(180)
def test_from_pretrained_of_a_mounted_trainer_bin_checkpoint(case_dir, mounts):
    """transformers (the base's 5.x) loads the mount of a 4.57 Trainer checkpoint saved with
    .bin weights: the model the Trainer saved, no key missing or unexpected."""
    import transformers

    case = case_dir("trainer-bin")
    _, checkpoint = case_info(case)
    mnt = mounts.mount(checkpoint)
    names = {p.name for p in mnt.iterdir()}
    assert "model.safetensors" in names and "pytorch_model.bin" not in names and "optimizer.pt" in names
    model, loading = transformers.GPT2LMHeadModel.from_pretrained(mnt, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    reference = load_file(case / "reference.safetensors")
    state = model.state_dict()
    assert sorted(state) == sorted(reference)
    for key, tensor in reference.items():
        assert_bitwise_equal(state[key], tensor, key)
    del model, state
    # The mount's optimizer.pt is the Trainer's, loadable as the Trainer loads it on resume.
    optimizer = torch.load(mnt / "optimizer.pt", map_location="cpu", weights_only=True)
    assert optimizer["state"] and optimizer["param_groups"]
