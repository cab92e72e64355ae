"""veRL FSDP checkpoints as veRL 0.9.1's own FSDPCheckpointManager writes them
(make_verl_checkpoints.py, in the overlay of scripts/setup-venv.sh verl: FSDP1 with DTensors,
FSDP1 with ShardedTensors, FSDP2, a tied model, world sizes 2 and 3 with uneven shards).

- The run folder, a global_step_N/ folder and the actor folder itself serve the consolidated
  model, bit for bit the unsharded model's state_dict (veRL's get_fsdp_full_state_dict), the
  step latest_checkpointed_iteration.txt names.
- With dtype=bf16 the same tensors are bit for bit veRL's model merger output (which casts
  to bf16), where the merger runs.
- from_pretrained of a mounted actor folder (base transformers) gives, bit for bit, the logits
  of the trained model's unsharded state dict loaded the same way, and its tokenizer loads
  from the same mount.
- -o optimizer serves FSDP2's AdamW state under parameter names, bit for bit full_tensor()
  of each state DTensor; FSDP1's flat-parameter state is refused with one line.
- Damaged folders (a missing rank file, a tracker naming a missing step, an fsdp_config.json
  that disagrees) are refused with one line naming the file.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptfs_testlib import assert_bitwise_equal, assert_same_logits, cached_fixtures_or_fail, causal_lm, logits_of

import make_verl_checkpoints as gen

GENERATOR = Path(gen.__file__)
FSDP2 = [c for c, (_, v, _) in gen.CASES.items() if v == 2]
FSDP1 = [c for c, (_, v, _) in gen.CASES.items() if v == 1]
LAST = gen.STEPS[-1]


@pytest.fixture(scope="module")
def root() -> Path:
    return cached_fixtures_or_fail(GENERATOR, overlay="verl", timeout_s=600)


@pytest.fixture(scope="module")
def cases(root) -> dict:
    return json.loads((root / "cases.json").read_text())


def actor(root: Path, case: str, step: int = LAST) -> Path:
    return root / case / "run" / f"global_step_{step}" / "actor"


def exported(run_ckptfs, source: Path, out: Path, *options) -> dict:
    run_ckptfs("export", *options, source, out)
    return load_file(out / "model.safetensors")


def assert_same_tensors(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want) or set(got) == set(want), f"{what}: keys {sorted(set(got) ^ set(want))} differ"
    for key, tensor in want.items():
        assert_bitwise_equal(got[key], tensor, f"{what}: {key}")


def one_line_error(res, *words) -> str:
    assert res.returncode == 1, res
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def copy_tree_of_links(src: Path, dst: Path) -> Path:
    """DST mirrors SRC's folders with symbolic links to its files, to damage without copying."""
    for dirpath, _, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            (dst / rel / name).symlink_to(Path(dirpath) / name)
    return dst


@pytest.mark.parametrize("case", list(gen.CASES))
def test_run_folder_serves_the_unsharded_state_dict_of_the_latest_step(case, root, run_ckptfs, tmp_path):
    want = load_file(root / case / "reference" / "state_dict.safetensors")
    got = exported(run_ckptfs, root / case / "run", tmp_path / "run")
    assert_same_tensors(got, want, f"{case} run folder")
    meta = json.loads((tmp_path / "run" / "metadata.json").read_text())["verl"]
    world, version, options = gen.CASES[case]
    assert meta["step"] == LAST and meta["step_folder"] == f"global_step_{LAST}" and meta["role"] == "actor", meta
    assert meta["world_size"] == world and meta["fsdp_version"] == version, meta
    kind = "sharded_tensor" if options.get("no_mesh") else "dtensor"
    assert meta["rank_files"]["kinds"] == kind, meta
    # Buffers are in every rank file, unsharded: served once.
    assert meta["rank_files"]["plain_tensors"] == (1 if options.get("buffer") else 0), meta
    if options.get("buffer"):
        assert got[gen.BUFFER_NAME].shape == (7,)


@pytest.mark.parametrize("case", ["fsdp2_ws3", "fsdp1_ws2"])
def test_step_and_actor_folders_and_the_tracker(case, root, run_ckptfs, tmp_path):
    step1 = load_file(root / case / "reference" / "step1.safetensors")
    last = load_file(root / case / "reference" / "state_dict.safetensors")
    assert any(not torch.equal(step1[k], last[k]) for k in last), "the two saves must differ"
    assert_same_tensors(exported(run_ckptfs, root / case / "run" / "global_step_1", tmp_path / "s1"), step1, "global_step_1")
    assert_same_tensors(exported(run_ckptfs, actor(root, case, 1), tmp_path / "a1"), step1, "global_step_1/actor")
    assert_same_tensors(exported(run_ckptfs, actor(root, case), tmp_path / "a2"), last, "actor")
    # The tracker, not the highest number, says which step is served.
    run = copy_tree_of_links(root / case / "run", tmp_path / "run")
    (run / "latest_checkpointed_iteration.txt").unlink()
    (run / "latest_checkpointed_iteration.txt").write_text("1")
    assert_same_tensors(exported(run_ckptfs, run, tmp_path / "t1"), step1, "tracker naming step 1")
    (run / "latest_checkpointed_iteration.txt").unlink()
    assert_same_tensors(exported(run_ckptfs, run, tmp_path / "none"), last, "no tracker: the highest step")


@pytest.mark.parametrize("case", list(gen.CASES))
def test_bf16_view_is_the_model_mergers_output(case, root, cases, run_ckptfs, tmp_path):
    error = cases["merger_error"][case]
    if gen.CASES[case][2].get("no_mesh"):
        # veRL's merger cannot load ShardedTensors outside the ranks that saved them.
        assert error and "ShardedTensor" in error, error
        return
    assert error is None, error
    merged = load_file(root / case / "merged" / "model.safetensors")
    got = exported(run_ckptfs, root / case / "run", tmp_path / "bf16", "--dtype", "bf16")
    # The merger leaves out the tied copy (lm_head.weight of a tied model); ckptfs serves both keys.
    assert set(merged) <= set(got), sorted(set(merged) - set(got))
    extra = set(got) - set(merged)
    assert extra == ({"lm_head.weight"} if gen.CASES[case][2].get("tied") else set()), extra
    for key, tensor in merged.items():
        assert_bitwise_equal(got[key], tensor, f"{case} vs veRL's merger: {key}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["fsdp2_ws2", "fsdp1_ws3", "fsdp2_tied_ws3", "fsdp1_sharded_tensor_ws3"])
def test_from_pretrained_of_the_mounted_actor_folder_gives_the_trained_logits(case, root, mounts, tmp_path):
    from transformers import AutoTokenizer

    mnt = mounts.mount(actor(root, case))
    names = set(os.listdir(mnt))
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= names, names
    assert {f"extra_state_world_size_{gen.CASES[case][0]}_rank_{r}.pt" for r in range(gen.CASES[case][0])} <= names
    assert not any(n.startswith(("model_world_size_", "optim_world_size_")) for n in names), names
    for name in ("config.json", "tokenizer.json", "fsdp_config.json"):
        src = actor(root, case) / ("huggingface" if name != "fsdp_config.json" else "") / name
        assert (mnt / name).read_bytes() == src.read_bytes(), name
    # The reference model: the unsharded state dict veRL's own get_fsdp_full_state_dict gave,
    # beside the config veRL saved, loaded in this process the same way as the mount.
    folder = tmp_path / "reference"
    folder.mkdir()
    shutil.copyfile(actor(root, case) / "huggingface" / "config.json", folder / "config.json")
    (folder / "model.safetensors").symlink_to(root / case / "reference" / "state_dict.safetensors")
    stored = load_file(root / case / "reference" / "logits.safetensors")
    model = causal_lm(mnt)
    assert_same_logits(model, folder, stored["input_ids"], f"{case}: logits of from_pretrained(mount)")
    # The generator's logits come from the trained model in another process (veRL's
    # transformers, one thread): they tie the reference to the trained model up to float
    # rounding, not bit for bit.
    torch.testing.assert_close(logits_of(model, stored["input_ids"]), stored["logits"], rtol=1e-4, atol=1e-5)
    # The tokenizer veRL saved loads from the mount as from its own folder.
    tokenizer = AutoTokenizer.from_pretrained(mnt)
    assert tokenizer.convert_tokens_to_ids(["t3", "t7", "<unk>"]) == [3, 7, 100]
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(actor(root, case) / "huggingface").get_vocab()
    del model


@pytest.mark.parametrize("case", FSDP2)
def test_optimizer_option_serves_the_full_adamw_state(case, root, run_ckptfs, tmp_path):
    want = load_file(root / case / "reference" / "optimizer.safetensors")
    got = exported(run_ckptfs, root / case / "run", tmp_path / "o", "--optimizer")
    state = {k: v for k, v in got.items() if k.startswith("optimizer.")}
    assert_same_tensors(state, want, f"{case} -o optimizer")
    model = load_file(root / case / "reference" / "state_dict.safetensors")
    assert_same_tensors({k: v for k, v in got.items() if not k.startswith("optimizer.")}, model, f"{case} model")
    meta = json.loads((tmp_path / "o" / "metadata.json").read_text())
    groups = meta["optimizer"]["param_groups"]
    assert groups[0]["lr"] == 0.01 and groups[0]["betas"] == [0.9, 0.999], groups
    names = meta["optimizer"]["parameter_names"]
    assert len(names) == len(groups[0]["params"]) and f"optimizer.state.{names[0]}.exp_avg" in want
    # Without the option, the model alone.
    assert not any(k.startswith("optimizer.") for k in exported(run_ckptfs, root / case / "run", tmp_path / "m"))


@pytest.mark.parametrize("case", FSDP1)
def test_optimizer_option_refuses_fsdp1_flat_parameter_state(case, root, run_ckptfs):
    res = run_ckptfs("ls", "--optimizer", root / case / "run", check=False)
    one_line_error(res, f"optim_world_size_{gen.CASES[case][0]}_rank_0.pt", "FSDP1", "flat parameter")


def test_optimizer_numbering_that_is_not_the_models_is_refused(root, run_ckptfs, tmp_path):
    # Every rank's optimizer saved by torch without its last parameter: state ids no longer
    # say which parameter they belong to, and ckptfs does not guess.
    folder = copy_tree_of_links(actor(root, "fsdp2_ws2"), tmp_path / "actor")
    for rank in range(2):
        name = f"optim_world_size_2_rank_{rank}.pt"
        state = torch.load(folder / name, weights_only=False)
        last = state["param_groups"][0]["params"].pop()
        del state["state"][last]
        (folder / name).unlink()
        torch.save(state, folder / name)
    run_ckptfs("ls", folder)
    one_line_error(run_ckptfs("ls", "--optimizer", folder, check=False), "optim_world_size_2_rank_0.pt",
                   "numbers 26 parameters but the model file has 27")


def test_missing_rank_file_is_refused(root, run_ckptfs, tmp_path):
    folder = copy_tree_of_links(actor(root, "fsdp2_ws3"), tmp_path / "actor")
    (folder / "model_world_size_3_rank_1.pt").unlink()
    one_line_error(run_ckptfs("ls", folder, check=False), "model_world_size_3_rank_1.pt", "missing")
    folder = copy_tree_of_links(actor(root, "fsdp2_ws3"), tmp_path / "actor2")
    (folder / "optim_world_size_3_rank_2.pt").unlink()
    run_ckptfs("ls", folder)  # the model alone does not need the optimizer files
    one_line_error(run_ckptfs("ls", "--optimizer", folder, check=False), "optim_world_size_3_rank_2.pt", "missing")


def test_tracker_naming_a_missing_step_is_refused(root, run_ckptfs, tmp_path):
    run = copy_tree_of_links(root / "fsdp2_ws2" / "run", tmp_path / "run")
    (run / "latest_checkpointed_iteration.txt").unlink()
    (run / "latest_checkpointed_iteration.txt").write_text("7\n")
    one_line_error(run_ckptfs("ls", run, check=False), "latest_checkpointed_iteration.txt", "step 7")


def test_fsdp_config_that_disagrees_is_refused(root, run_ckptfs, tmp_path):
    folder = copy_tree_of_links(actor(root, "fsdp2_ws2"), tmp_path / "actor")
    (folder / "fsdp_config.json").unlink()
    (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    one_line_error(run_ckptfs("ls", folder, check=False), "fsdp_config.json", "world_size 4")


def test_rank_files_of_two_world_sizes_are_refused(root, run_ckptfs, tmp_path):
    folder = copy_tree_of_links(actor(root, "fsdp2_ws2"), tmp_path / "actor")
    for name in ("model_world_size_3_rank_0.pt",):
        (folder / name).symlink_to(actor(root, "fsdp2_ws3") / name)
    one_line_error(run_ckptfs("ls", folder, check=False), "world sizes 2 and 3")


def test_rank_file_from_another_save_is_refused(root, run_ckptfs, tmp_path):
    # A rank file of a three-rank save under a two-rank name: its tensors say three ranks.
    folder = copy_tree_of_links(actor(root, "fsdp2_ws2"), tmp_path / "actor")
    (folder / "model_world_size_2_rank_1.pt").unlink()
    (folder / "model_world_size_2_rank_1.pt").symlink_to(actor(root, "fsdp2_ws3") / "model_world_size_3_rank_1.pt")
    one_line_error(run_ckptfs("ls", folder, check=False), "model_world_size_2_rank_1.pt")
