"""ckptfs on DeepSpeed checkpoints with model, pipeline and expert parallelism, all saved by a
real DeepSpeed (make_parallel_checkpoints.py, four forked CPU ranks over gloo):

- model parallel (2 mp x 2 dp, ZeRO 1/2/3 through deepspeed.initialize(mpu=...)): one
  consolidated subtree per mp rank, keys `mp_rank_XX.<name>`, each bit for bit what
  zero_to_fp32 gives for a folder holding only that mp rank's files renamed to mp_rank_00
  (zero_to_fp32 itself globs every rank and cannot tell mp ranks apart);
- pipeline parallel (deepspeed.pipe.PipelineModule, 2 stages): the per-layer files served as
  one checkpoint, keys `<layer>.<name>`, or `model_YY.<layer>.<name>` when the files carry
  several `-model_YY`; tensors equal torch.load of each layer file;
- mixture of experts: refused, exit 1, one stderr line naming an expert file.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ckptfs_fixture_cache import PARALLEL_CHECKPOINTS
from ckptfs_testlib import assert_bitwise_equal, cached_fixtures_or_fail, check_safetensors_file, scaled

if importlib.util.find_spec("deepspeed") is None:  # imported lazily: it takes seconds
    pytest.skip("tests/zero need deepspeed (tests/requirements.txt)", allow_module_level=True)

COMMAND_TIMEOUT_S = scaled(60)
TAG = "global_step2"  # two training steps in every case


# ---------------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture(scope="module")
def parallel_ckpts() -> Path:
    """OUT/<case>/ save dirs written by DeepSpeed (see make_parallel_checkpoints.py), from the
    machine's fixture cache."""
    return cached_fixtures_or_fail(PARALLEL_CHECKPOINTS)


def run(ckptfs_bin, *args, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(ckptfs_bin), *map(str, args)], capture_output=True, timeout=COMMAND_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise AssertionError(f"ckptfs {' '.join(map(str, args))} -> {proc.returncode}: "
                             f"{proc.stderr.decode(errors='replace')}")
    return proc


def ls_keys(ckptfs_bin, source) -> list:
    return [item["key"] for item in json.loads(run(ckptfs_bin, "ls", "--json", source).stdout)]


def export(ckptfs_bin, source, outdir: Path) -> Path:
    run(ckptfs_bin, "export", "--write", "all", source, outdir)
    return outdir


def check_export(ckptfs_bin, source, outdir: Path, want: dict) -> None:
    """ckptfs export SOURCE: model.safetensors and every tensors/<key> file hold exactly WANT,
    bit for bit; `ls --json` lists WANT's keys in WANT's order."""
    assert ls_keys(ckptfs_bin, source) == list(want), "key order differs"
    export(ckptfs_bin, source, outdir)
    check_safetensors_file(outdir / "model.safetensors", want)
    manifest = json.loads((outdir / "manifest.json").read_text())
    files = {t["key"]: t["file"] for t in manifest["tensors"]}
    assert set(files) == set(want)
    for key, tensor in want.items():
        check_safetensors_file(outdir / files[key], {key: tensor})


def tag_dir(save_dir: Path) -> Path:
    assert (save_dir / "latest").read_text().strip() == TAG
    return save_dir / TAG


def load(path: Path, weights_only=True):
    return torch.load(path, map_location="cpu", weights_only=weights_only)


# ---------------------------------------------------------------------------------------------
# 1. model parallel: one subtree per mp rank


@pytest.fixture(scope="module")
def zero_to_fp32():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint


def single_mp_rank_copy(save_dir: Path, mp: int, dest: Path) -> Path:
    """A save dir holding only mp rank MP's files, renamed to mp_rank_00 (what zero_to_fp32
    can read)."""
    src = tag_dir(save_dir)
    (dest / TAG).mkdir(parents=True)
    shutil.copy(save_dir / "latest", dest / "latest")
    copied = 0
    for f in src.iterdir():
        if f"mp_rank_{mp:02d}" in f.name:
            shutil.copy(f, dest / TAG / f.name.replace(f"mp_rank_{mp:02d}", "mp_rank_00"))
            copied += 1
    assert copied >= 3, f"only {copied} files of mp rank {mp} in {src}"
    return dest


MP_CASES = ["mp-s1", "mp-s2", "mp-s3"]


def test_mp_checkpoints_are_real(parallel_ckpts):
    """The generator's model parallelism is DeepSpeed's own: two mp ranks x two dp ranks per
    stage, and the mp ranks hold different values."""
    for case in MP_CASES:
        names = sorted(p.name for p in tag_dir(parallel_ckpts / case).iterdir())
        optim = [n for n in names if n.endswith("_optim_states.pt")]
        assert optim == [f"bf16_zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt" for dp in (0, 1) for mp in (0, 1)]
        if case == "mp-s3":
            model = [f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt" for dp in (0, 1) for mp in (0, 1)]
        else:
            model = ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
        assert sorted(set(names) - set(optim)) == sorted(model), case
        info = json.loads((parallel_ckpts / case / "case.json").read_text())
        assert "mpu" in info["parallelism"] and info["zero_stage"] == int(case[-1])


@pytest.mark.parametrize("case", MP_CASES)
def test_mp_subtree_per_rank_matches_zero_to_fp32(ckptfs_bin, parallel_ckpts, zero_to_fp32, tmp_path, case):
    save_dir = parallel_ckpts / case
    stage = int(case[-1])
    want = {}
    per_rank = []
    for mp in (0, 1):
        single = single_mp_rank_copy(save_dir, mp, tmp_path / f"only_mp{mp}")
        ref = zero_to_fp32(str(single))
        assert ref, f"zero_to_fp32 gave nothing for mp rank {mp}"
        if stage == 1:
            # Stage 1 records no frozen parameters and zero_to_fp32 drops them; ckptfs serves
            # the 16-bit copies from `module`, right after the buffers (zero_to_fp32's slot).
            ms = load(tag_dir(save_dir) / f"mp_rank_{mp:02d}_model_states.pt", weights_only=False)
            assert "frozen.weight" not in ref
            n_buffers = len(ms["buffer_names"])
            items = list(ref.items())
            frozen = [(k, ms["module"][k]) for k in ("frozen.weight", "frozen.bias")]
            ref = dict(items[:n_buffers] + frozen + items[n_buffers:])
        per_rank.append(ref)
        want.update({f"mp_rank_{mp:02d}.{k}": v for k, v in ref.items()})
    # Not the same model twice: mp rank 1 holds another slice of fc1/fc2.
    assert set(per_rank[0]) == set(per_rank[1])
    assert not torch.equal(per_rank[0]["fc1.weight"], per_rank[1]["fc1.weight"])
    assert not torch.equal(per_rank[0]["pos_scale"], per_rank[1]["pos_scale"])
    check_export(ckptfs_bin, save_dir, tmp_path / "export", want)
    # The tag folder itself is a source too.
    assert ls_keys(ckptfs_bin, tag_dir(save_dir)) == list(want)


@pytest.mark.parametrize("case", MP_CASES)
def test_mp_metadata(ckptfs_bin, parallel_ckpts, case):
    info = json.loads(run(ckptfs_bin, "info", "--json", parallel_ckpts / case).stdout)
    assert info["format"] == "deepspeed-zero"
    ds = info["metadata"]["deepspeed"]
    assert (ds["mp_world_size"], ds["world_size"], ds["stage"], ds["tag"]) == (2, 2, int(case[-1]), TAG)
    # Every rank file of both mp ranks is a source file, and so is every file of the save
    # folder but `latest` (served beside the model: zero_to_fp32.py, a Trainer's config.json).
    save_dir = parallel_ckpts / case
    want = {str(p) for p in tag_dir(save_dir).iterdir()}
    want |= {str(p) for p in save_dir.iterdir() if p.is_file() and p.name != "latest"}
    assert {f["path"] for f in info["source_files"]} == want


# ---------------------------------------------------------------------------------------------
# 2. pipeline parallel: per-layer files

LAYER_FILE = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")


def layer_files(save_dir: Path) -> list:
    """[(layer, model rank or None, path)] sorted by (model rank, layer)."""
    out = []
    for f in tag_dir(save_dir).iterdir():
        m = LAYER_FILE.fullmatch(f.name)
        if m:
            out.append((int(m[1]), None if m[2] is None else int(m[2]), f))
    return sorted(out, key=lambda x: (x[1] or 0, x[0]))


def expected_pipeline(save_dir: Path, prefixed: bool) -> dict:
    want = {}
    for layer, model_rank, path in layer_files(save_dir):
        prefix = f"model_{model_rank:02d}.{layer}." if prefixed else f"{layer}."
        for name, tensor in load(path).items():
            want[prefix + name] = tensor
    return want


def test_pipeline_files_are_real(parallel_ckpts):
    """Layer file names as PipelineModule.ckpt_layer_path writes them: layer 1 is a plain
    function (no file); -model_YY only on topologies with a model axis."""
    names = {case: sorted(f.name for _, _, f in layer_files(parallel_ckpts / case))
             for case in ("pipe", "pipe-tp2", "pipe-tp1")}
    assert names["pipe"] == [f"layer_{i:02d}-model_states.pt" for i in (0, 2, 3, 4)]
    assert names["pipe-tp2"] == [f"layer_{i:02d}-model_{m:02d}-model_states.pt" for i in (0, 2, 3, 4) for m in (0, 1)]
    assert names["pipe-tp1"] == [f"layer_{i:02d}-model_00-model_states.pt" for i in (0, 2, 3, 4)]
    # Tied layers 0 and 4 are saved twice, by both stages; layer 3 keeps its buffer and frozen gate.
    pipe = tag_dir(parallel_ckpts / "pipe")
    l0, l4 = load(pipe / "layer_00-model_states.pt"), load(pipe / "layer_04-model_states.pt")
    assert_bitwise_equal(l4["lin.weight"], l0["lin.weight"], "tied layer 4 vs layer 0")
    assert list(load(pipe / "layer_03-model_states.pt")) == ["gate", "shift", "norm.weight", "norm.bias"]


@pytest.mark.parametrize("case", ["pipe", "pipe-tp1"])
def test_pipeline_layers_one_checkpoint(ckptfs_bin, parallel_ckpts, tmp_path, case):
    """One model rank (no -model_YY, or only -model_00): keys `<layer>.<name>`."""
    save_dir = parallel_ckpts / case
    want = expected_pipeline(save_dir, prefixed=False)
    assert "0.lin.weight" in want and "3.shift" in want and not any(k.startswith("1.") for k in want)
    check_export(ckptfs_bin, save_dir, tmp_path / "export", want)
    assert ls_keys(ckptfs_bin, tag_dir(save_dir)) == list(want)
    info = json.loads(run(ckptfs_bin, "info", "--json", save_dir).stdout)
    assert info["format"] == "deepspeed-pipeline"


def test_pipeline_layers_per_model_rank(ckptfs_bin, parallel_ckpts, tmp_path):
    """Two model ranks (-model_00, -model_01): keys `model_YY.<layer>.<name>` (named after the
    files' -model_YY part; DeepSpeed's own mp_rank_XX numbering counts stages too)."""
    save_dir = parallel_ckpts / "pipe-tp2"
    want = expected_pipeline(save_dir, prefixed=True)
    assert not torch.equal(want["model_00.0.lin.weight"], want["model_01.0.lin.weight"])
    assert not torch.equal(want["model_00.3.shift"], want["model_01.3.shift"])
    check_export(ckptfs_bin, save_dir, tmp_path / "export", want)


def test_pipeline_mount(parallel_ckpts, mounts):
    """The same tensors through a real mount."""
    save_dir = parallel_ckpts / "pipe-tp2"
    want = expected_pipeline(save_dir, prefixed=True)
    mnt = mounts.mount(save_dir)
    check_safetensors_file(mnt / "model.safetensors", want)
    check_safetensors_file(mnt / "tensors" / "model_01.3.gate.safetensors",
                           {"model_01.3.gate": want["model_01.3.gate"]})


def test_pipeline_tag_folder_contents(ckptfs_bin, parallel_ckpts):
    """What DeepSpeed writes next to the layer files, and what ckptfs reads of it: per pipeline
    stage (x model rank) an mp_rank_XX_model_states.pt with module None and the stage's
    param_shapes, and ZeRO-1 optimizer files holding the fp32 master partitions. ckptfs serves
    the (16-bit) layer files only."""
    expect = {
        "pipe": ({f"mp_rank_{s:02d}_model_states.pt" for s in (0, 1)}
                 | {f"bf16_zero_pp_rank_{dp}_mp_rank_{s:02d}_optim_states.pt" for dp in (0, 1) for s in (0, 1)}),
        "pipe-tp2": ({f"mp_rank_{r:02d}_model_states.pt" for r in range(4)}
                     | {f"zero_pp_rank_0_mp_rank_{r:02d}_optim_states.pt" for r in range(4)}),
        "pipe-tp1": ({f"mp_rank_{s:02d}_model_states.pt" for s in (0, 1)}
                     | {f"zero_pp_rank_{dp}_mp_rank_{s:02d}_optim_states.pt" for dp in (0, 1) for s in (0, 1)}),
    }
    for case, others in expect.items():
        tag = tag_dir(parallel_ckpts / case)
        layers = {f.name for _, _, f in layer_files(parallel_ckpts / case)}
        assert {f.name for f in tag.iterdir()} - layers == others, case
        for name in others:
            if name.startswith("mp_rank_"):
                states = load(tag / name, weights_only=False)
                assert states["module"] is None, f"{case}/{name}: module is not None"
                assert states["param_shapes"], f"{case}/{name}: no param_shapes"
        info = json.loads(run(ckptfs_bin, "info", "--json", parallel_ckpts / case).stdout)
        # The layer files, plus the save folder's own files (not `latest`) served beside them.
        save_files = {p.name for p in (parallel_ckpts / case).iterdir() if p.is_file() and p.name != "latest"}
        assert {Path(f["path"]).name for f in info["source_files"]} == layers | save_files, case
    # Stage 0 of `pipe` owns the tied module and layer 2; the fp32 masters are in the optimizer files.
    shapes = load(tag_dir(parallel_ckpts / "pipe") / "mp_rank_00_model_states.pt", weights_only=False)["param_shapes"]
    assert [list(g) for g in shapes] == [["tied_modules.embed.lin.weight", "tied_modules.embed.lin.bias",
                                          "2.lin.weight", "2.lin.bias"]]


# ---------------------------------------------------------------------------------------------
# 3. mixture of experts: refused

MOE_FILE = re.compile(r"(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt"
                      r"|expp_rank_\d+_mp_rank_\d+_optim_states\.pt")


def moe_source(parallel_ckpts: Path, tmp_path: Path, variant: str) -> tuple:
    """(source to open, its tag folder)."""
    if variant in ("moe-s2", "moe-s0"):  # real MoE runs (ZeRO-2; ZeRO off: also expp_rank_*)
        return parallel_ckpts / variant, tag_dir(parallel_ckpts / variant)
    if variant in ("moe-s2/tag", "moe-s0/tag"):  # the tag folder itself, no `latest` to follow
        save = parallel_ckpts / variant.split("/")[0]
        return tag_dir(save), tag_dir(save)
    # A real ZeRO-2 checkpoint (mp-s2's mp rank 0, which ckptfs reads fine) with one real expert
    # file added, under the current or the legacy name.
    name = {"zero+expert": "layer_0_expert_0_mp_rank_00_model_states.pt",
            "zero+legacy-expert": "expert_0_mp_rank_00_model_states.pt"}[variant]
    save = single_mp_rank_copy(parallel_ckpts / "mp-s2", 0, tmp_path / variant)
    shutil.copy(tag_dir(parallel_ckpts / "moe-s2") / "layer_0_expert_0_mp_rank_00_model_states.pt", save / TAG / name)
    return save, save / TAG


MOE_VARIANTS = ["moe-s2", "moe-s0", "moe-s2/tag", "moe-s0/tag", "zero+expert", "zero+legacy-expert"]


def test_moe_files_are_real(parallel_ckpts):
    s2 = sorted(p.name for p in tag_dir(parallel_ckpts / "moe-s2").iterdir())
    experts = [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in (0, 1)]
    assert [n for n in s2 if MOE_FILE.fullmatch(n)] == experts
    assert "zero_pp_rank_3_mp_rank_00_optim_states.pt" in s2
    s0 = sorted(p.name for p in tag_dir(parallel_ckpts / "moe-s0").iterdir())
    assert "expp_rank_0_mp_rank_00_optim_states.pt" in s0


@pytest.mark.parametrize("command", ["ls", "info", "export", "mount"])
@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_moe_refused(ckptfs_bin, parallel_ckpts, tmp_path, variant, command):
    source, tag = moe_source(parallel_ckpts, tmp_path, variant)
    moe_files = {str(tag / f.name) for f in tag.iterdir() if MOE_FILE.fullmatch(f.name)}
    assert moe_files
    target = tmp_path / "target"
    target.mkdir()
    args = {"ls": ["ls", source], "info": ["info", source], "export": ["export", source, target / "out"],
            "mount": [source, target]}[command]
    try:
        proc = run(ckptfs_bin, *args, check=False)
    finally:
        if command == "mount" and os.path.ismount(target):
            subprocess.run(["fusermount3", "-u", str(target)], timeout=COMMAND_TIMEOUT_S, check=False)
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == 1, f"exit {proc.returncode}, stderr: {stderr!r}"
    lines = stderr.splitlines()
    assert len(lines) == 1, f"want one stderr line, got {lines!r}"
    named = [f for f in moe_files if f"ckptfs: {f}: " in lines[0]]
    assert named, f"stderr does not name an MoE file of {tag}: {lines[0]!r}"
    assert proc.stdout == b"", f"stdout: {proc.stdout[:200]!r}"
