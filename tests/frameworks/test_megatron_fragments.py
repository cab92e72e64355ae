"""Megatron distributed-optimizer checkpoints of megatron-core before 0.14 (0.13.1, in the
`megatron` overlay): optimizer states saved as flattened_range fragments, which DCP records
in a reformulated shape ([chunks per dim..., chunk numel]). ckptfs serves them with the real
shape megatron-core keeps in the metadata's mcore_data, bit for bit what megatron-core's own
dist_checkpointing.load returns (make_megatron_fragments.py), refuses a reformulation it
cannot map with one line, and serves the step folder's own metadata.json as
metadata.source.json beside its own metadata.json."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptfs_testlib import assert_bitwise_equal, cached_fixtures_or_fail, check_safetensors_file
from fusetools import mount_entry

GENERATOR = Path(__file__).resolve().parent / "make_megatron_fragments.py"
CASES = ("dp2", "tp2_dp2")
SHAPE_KEY = "nd_reformulated_orig_global_shape"


@pytest.fixture(scope="module")
def megatron_root() -> Path:
    # Four gloo ranks of megatron-core on two cores: about 80 s once per machine.
    return cached_fixtures_or_fail(GENERATOR, overlay="megatron", timeout_s=900)


class Case:
    def __init__(self, root: Path, name: str):
        self.dir = root / name
        self.run = self.dir / "run"
        self.fixture = json.loads((self.dir / "fixture.json").read_text())
        self.step = self.run / self.fixture["step_dir"]
        self.reference = load_file(self.dir / "reference.safetensors")
        self.mcore_data = self.fixture["mcore_data"]

    def reformulated(self) -> dict:
        """{key: (real shape, DCP's reformulated shape)} of the fragment tensors."""
        return {k: (v[SHAPE_KEY], self.fixture["dcp_shapes"][k]) for k, v in self.mcore_data.items() if SHAPE_KEY in v}

    def chunks(self, key) -> list:
        """[(offsets, sizes)] of KEY's chunks in .metadata (the generator read them: the pickle
        names megatron-core's classes, which this environment does not have)."""
        return self.fixture["dcp_chunks"][key]


@pytest.fixture(scope="module", params=CASES)
def case(request, megatron_root) -> Case:
    return Case(megatron_root, request.param)


def reformulate(real: torch.Tensor, grid: list) -> torch.Tensor:
    """Megatron's reformulation of a full tensor by definition: chunk c of extents
    real.shape / grid, flattened, at [c..., :]."""
    chunk = [s // g for s, g in zip(real.shape, grid)]
    out = torch.empty(grid + [int(torch.Size(chunk).numel())], dtype=real.dtype)
    for c in torch.cartesian_prod(*[torch.arange(g) for g in grid]).reshape(-1, len(grid)).tolist():
        index = tuple(slice(ci * e, (ci + 1) * e) for ci, e in zip(c, chunk))
        out[tuple(c)] = real[index].flatten()
    return out


def test_fixture_holds_fragments_cut_mid_row(case):
    """What the other tests rely on: fragments in a reformulated shape that is not the real
    one, and a data-parallel cut inside a row of a 2-D linear_proj weight."""
    reformulated = case.reformulated()
    assert len(reformulated) == 18, sorted(reformulated)
    for key, (real, dcp) in reformulated.items():
        assert dcp != real and len(dcp) == len(real) + 1, (key, real, dcp)
    cuts = []
    for key, (real, dcp) in reformulated.items():
        if "linear_proj.weight" not in key:
            continue
        row = real[-1] // dcp[-2]  # a chunk's row length
        for offsets, sizes in case.chunks(key):
            start, length = offsets[-1], sizes[-1]
            cuts += [key for at in (start, start + length) if at % row != 0]
    assert cuts, "no fragment of a linear_proj weight starts or ends mid-row"


def test_fragments_served_with_real_shapes_bit_for_bit(case, run_ckptfs, tmp_path):
    out = tmp_path / "out"
    run_ckptfs("export", case.run, out)
    served = load_file(out / "model.safetensors")
    assert set(served) == set(case.reference)
    for key, want in case.reference.items():
        assert list(served[key].shape) == case.fixture["shapes"][key], key
        assert_bitwise_equal(served[key], want, key)
    # The ones megatron-core saved reformulated are served with mcore_data's shape, not DCP's.
    for key, (real, dcp) in case.reformulated().items():
        assert list(served[key].shape) == real != dcp, key


def test_mount_serves_real_shapes_and_megatron_metadata_json(case, mounts):
    mnt = mounts.mount(case.run, None)
    check_safetensors_file(mnt / "model.safetensors", case.reference)
    # Megatron's own metadata.json (its backends), byte for byte, beside ckptfs's.
    theirs = (case.step / "metadata.json").read_bytes()
    assert json.loads(theirs)["sharded_backend"] == "torch_dist"
    assert (mnt / "metadata.source.json").read_bytes() == theirs
    ours = json.loads((mnt / "metadata.json").read_text())
    assert ours["dcp"]["step_folder"] == case.fixture["step_dir"], ours
    assert (mnt / "common.pt").read_bytes() == (case.step / "common.pt").read_bytes()
    manifest = json.loads((mnt / "manifest.json").read_text())
    assert manifest["renamed_sibling_files"] == {"metadata.json": "metadata.source.json"}
    assert "hidden_sibling_files" not in manifest, manifest.get("hidden_sibling_files")
    shapes = {t["key"]: t["shape"] for t in manifest["tensors"]}
    assert shapes == case.fixture["shapes"]


def test_a_source_file_named_metadata_source_json_keeps_its_name(megatron_root, run_ckptfs, tmp_path):
    """The renamed metadata.json never displaces a source file: that one is served and
    Megatron's is then hidden, as any sibling a generated file displaces."""
    case = Case(megatron_root, "dp2")
    step = tmp_path / "step"
    shutil.copytree(case.step, step)
    (step / "metadata.source.json").write_text('{"mine": true}\n')
    out = tmp_path / "out"
    run_ckptfs("export", "--write", "files", step, out)
    assert (out / "metadata.source.json").read_text() == '{"mine": true}\n'
    assert "dcp" in json.loads((out / "metadata.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["hidden_sibling_files"] == ["metadata.json"], manifest.get("hidden_sibling_files")
    assert "renamed_sibling_files" not in manifest


def test_info_says_how_shapes_were_restored(case, run_ckptfs):
    text = run_ckptfs("info", case.run).stdout.decode()
    assert "megatron_fragments" in text and SHAPE_KEY in text, text
    info = json.loads(run_ckptfs("info", "--json", case.run).stdout)["metadata"]["dcp"]["megatron_fragments"]
    reformulated = case.reformulated()
    # Served as byte ranges exactly when the real tensor's row-major order is the
    # reformulated one's, by Megatron's definition of the reformulation.
    as_ranges = sum(
        torch.equal(reformulate(case.reference[k], dcp[:-1]).flatten(), case.reference[k].flatten())
        for k, (real, dcp) in reformulated.items()
    )
    fragments = sum(len({tuple(offsets) for offsets, _ in case.chunks(k)}) for k in reformulated)
    assert info == {
        "shapes_from": f"mcore_data {SHAPE_KEY}",
        "tensors": len(reformulated),
        "fragments": fragments,
        "served_as_byte_ranges": as_ranges,
        "gathered": len(reformulated) - as_ranges,
    }, info
    # The dim-1 (row-parallel) split leaves linear_proj's chunks apart in the full tensor.
    assert info["gathered"] == (3 if case.fixture["tp"] > 1 else 0), info


def refusal(run_ckptfs, source) -> str:
    res = run_ckptfs("ls", source, check=False)
    assert res.returncode not in (0, None), res.stdout.decode()[-2000:]
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


KEY = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_proj.weight"


@pytest.mark.parametrize(
    "variant,says",
    [
        ("shape_not_split_evenly", "real shape [2, 20, 21] cannot be served: dimension 2 of the real shape (21) "
                                   "is not split into 2 equal chunks"),
        ("chunk_size_disagrees", "real shape [2, 20, 10] cannot be served: a chunk of the real shape holds 200 "
                                 "elements but the reformulated shape gives 400"),
        ("unknown_record", "mcore_data (Megatron's) holds 'some_future_layout', which ckptfs does not know"),
    ],
)
def test_reformulation_ckptfs_cannot_map_is_refused_in_one_line(megatron_root, run_ckptfs, mounts, variant, says):
    """The generator's copies of a step folder with one mcore_data record of KEY changed."""
    step = megatron_root / "variants" / variant
    line = refusal(run_ckptfs, step)
    assert line.startswith(f"ckptfs: {step / '.metadata'}") and f"'{KEY}'" in line and says in line, line
    mnt = mounts.new_mountpoint()
    res = mounts.start([mounts.binary, step, mnt], mnt)
    assert res.returncode != 0, f"the mount accepted it: {res.describe()}"
    assert mount_entry(mnt) is None, f"{mnt} is mounted after a refused mount"
    assert says in res.stderr_bytes.decode(errors="replace"), res.describe()
