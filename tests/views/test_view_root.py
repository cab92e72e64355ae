"""`--root PREFIX` / `-o root=PREFIX`: only the tensors whose key starts with `PREFIX.`, the
prefix removed (PREFIX may be dotted); metadata.json becomes the PREFIX subtree of the
metadata when there is one; an unknown prefix exits 1 with one stderr line listing the
top-level prefixes. A training checkpoint mounted with -o root=model loads with
AutoModel.from_pretrained."""

import json

import pytest
import torch

from ckptfs_testlib import flatten_tensors
from viewtools import (
    NON_WEIGHT_FILES,
    assert_same_embeddings,
    expected_nbytes,
    parse_safetensors,
    served_form,
    tensor_bytes,
)


def sub_dict(flat: dict, prefix: str) -> dict:
    p = prefix + "."
    return {k[len(p):]: v for k, v in flat.items() if k.startswith(p)}


def check_export(out, want: dict, what: str) -> None:
    """model.safetensors and tensors/ of the export OUT hold exactly WANT ({key: tensor})."""
    parsed = parse_safetensors((out / "model.safetensors").read_bytes(), f"{what}: model.safetensors")
    assert list(parsed) and set(parsed) == set(want), (
        f"{what}: keys differ: missing {sorted(set(want) - set(parsed))[:5]}, "
        f"extra {sorted(set(parsed) - set(want))[:5]}"
    )
    for key, tensor in want.items():
        assert parsed[key][2] == tensor_bytes(served_form(tensor)), f"{what}: bytes of {key}"
    manifest = json.loads((out / "manifest.json").read_text())
    assert [t["key"] for t in manifest["tensors"]] == list(parsed), (
        f"{what}: manifest keys are not those of model.safetensors, in its order"
    )
    on_disk = {p.relative_to(out).as_posix() for p in (out / "tensors").rglob("*.safetensors")}
    assert on_disk == {t["file"] for t in manifest["tensors"]}, f"{what}: tensors/ differs"
    for t in manifest["tensors"]:
        one = parse_safetensors((out / t["file"]).read_bytes(), f"{what}: {t['file']}")
        assert list(one) == [t["key"]], f"{what}: {t['file']} holds {list(one)}"
        assert one[t["key"]][2] == tensor_bytes(served_form(want[t["key"]])), t["file"]


# --- a synthetic nested checkpoint ------------------------------------------------------


@pytest.fixture(scope="module")
def nested_ckpt(tmp_path_factory):
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ckpt = {
        "a": {
            "b": {"w": r(3, 4), "cfg": {"x": 1, "name": "deep"}, "c": {"v": r(5)}},
            "bb": {"w": r(2)},
            "other": 2,
        },
        "ab": {"w": r(6)},
        "layer": {"1": {"w": r(7), "x": {"y": r(2, 2)}}, "10": {"w": r(8)}},
        "model": {"encoder.layer.0.w": r(4), "encoder.layer.1.w": r(3), "decoder.w": r(2),
                  "encoderx.w": r(1)},
        "step": 9,
    }
    path = tmp_path_factory.mktemp("nested") / "nested.pt"
    torch.save(ckpt, path)
    return path, flatten_tensors(torch.load(path, weights_only=True))


@pytest.mark.parametrize(
    "prefix, keys",
    [
        ("a", ["b.w", "b.c.v", "bb.w"]),
        ("a.b", ["w", "c.v"]),  # not a.bb.w, not ab.w
        ("a.b.c", ["v"]),
        ("layer.1", ["w", "x.y"]),  # not layer.10.w
        ("model.encoder", ["layer.0.w", "layer.1.w"]),  # dotted state-dict keys; not encoderx
        ("model", ["encoder.layer.0.w", "encoder.layer.1.w", "decoder.w", "encoderx.w"]),
    ],
)
def test_root_selects_and_strips(prefix, keys, nested_ckpt, run_ckptfs, ls_json, tmp_path):
    source, flat = nested_ckpt
    want = sub_dict(flat, prefix)
    assert sorted(want) == sorted(keys)  # the fixture itself

    listed = json.loads(run_ckptfs("ls", "--json", "--root", prefix, source).stdout)
    full_order = [k[len(prefix) + 1:] for k in (e["key"] for e in ls_json(source)) if k.startswith(prefix + ".")]
    assert [e["key"] for e in listed] == full_order, f"ls --root {prefix}: keys or order"
    for e in listed:
        assert e["nbytes"] == expected_nbytes(want[e["key"]]), e["key"]
        assert e["file"] == f"tensors/{e['key']}.safetensors", (
            f"ls --root {prefix}: file {e['file']} for key {e['key']}"
        )

    info = json.loads(run_ckptfs("info", "--json", "--root", prefix, source).stdout)
    assert info["tensor_count"] == len(want)
    assert info["total_bytes"] == sum(expected_nbytes(t) for t in want.values())

    out = tmp_path / "out"
    run_ckptfs("export", "--write", "all", "--root", prefix, source, out)
    check_export(out, want, f"export --root {prefix}")
    assert run_ckptfs("cat", "--root", prefix, source, "model.safetensors").stdout == (
        out / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    "prefix, metadata",
    [
        ("a", {"b": {"cfg": {"x": 1, "name": "deep"}}, "other": 2}),
        ("a.b", {"cfg": {"x": 1, "name": "deep"}}),
    ],
)
def test_root_narrows_metadata(prefix, metadata, nested_ckpt, run_ckptfs):
    source, _ = nested_ckpt
    full = json.loads(run_ckptfs("cat", source, "metadata.json").stdout)
    assert full["step"] == 9 and full["a"]["other"] == 2  # the unnarrowed metadata
    got = json.loads(run_ckptfs("cat", "--root", prefix, source, "metadata.json").stdout)
    assert got == metadata, f"metadata.json with --root {prefix}"


def test_root_metadata_without_subtree_is_json(nested_ckpt, run_ckptfs):
    source, _ = nested_ckpt
    got = json.loads(run_ckptfs("cat", "--root", "layer.1", source, "metadata.json").stdout)
    assert isinstance(got, dict)


@pytest.mark.parametrize("command", ["ls", "info", "cat", "export", "hash"])
@pytest.mark.parametrize("prefix", ["nope", "mod", "a.b.w", "layer.2", "step"])
def test_unknown_root_is_refused(command, prefix, nested_ckpt, run_ckptfs, tmp_path):
    """`mod` is not a component (model.), `a.b.w` is a whole key, `step` is not a tensor."""
    source, flat = nested_ckpt
    extra = {"cat": ["model.safetensors"], "export": [tmp_path / "out"]}.get(command, [])
    res = run_ckptfs(command, "--root", prefix, source, *extra, check=False)
    err = res.stderr.decode(errors="replace")
    assert res.returncode == 1, f"{command} --root {prefix}: exit {res.returncode}, stderr {err!r}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"{command} --root {prefix}: stderr {err!r}"
    for top in sorted({k.split(".")[0] for k in flat}):
        assert top in lines[0], f"{command} --root {prefix}: {top!r} not listed in {lines[0]!r}"
    assert res.stdout == b"", f"{command} --root {prefix}: wrote to stdout"


# --- MiniLM training checkpoint -----------------------------------------------------------


def test_root_model_of_training_checkpoint_cli(minilm_training_folder, minilm, run_ckptfs, tmp_path):
    folder, ckpt = minilm_training_folder
    model, _, _ = minilm
    flat = flatten_tensors(ckpt)
    want = sub_dict(flat, "model")
    assert set(want) == set(model.state_dict())
    assert any(k.startswith("optimizer.") for k in flat)

    out = tmp_path / "out"
    run_ckptfs("export", "--write", "all", "--root", "model", folder, out)
    check_export(out, want, "export --root model (MiniLM training folder)")
    for name in NON_WEIGHT_FILES:
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    full = json.loads(run_ckptfs("cat", folder, "metadata.json").stdout)
    narrowed = json.loads((out / "metadata.json").read_text())
    if isinstance(full.get("model"), dict):
        assert narrowed == full["model"]
    assert "step" not in narrowed and "optimizer" not in narrowed, (
        "metadata.json under --root model still holds the top level"
    )
    opt = json.loads(run_ckptfs("cat", "--root", "optimizer", folder, "metadata.json").stdout)
    assert opt == full["optimizer"], "metadata.json under --root optimizer"
    assert opt["param_groups"][0]["lr"] == 1e-4


@pytest.mark.timeout(180)
def test_mount_root_model_loads_with_transformers(minilm_training_folder, minilm, mounts):
    folder, _ = minilm_training_folder
    _, _, want = minilm
    mnt = mounts.mount(folder, "root=model")
    names = {p.name for p in mnt.iterdir()}
    assert "model.safetensors" in names and "pytorch_model.bin" not in names, sorted(names)
    for name in NON_WEIGHT_FILES:
        assert (mnt / name).read_bytes() == (folder / name).read_bytes(), name
    header = parse_safetensors((mnt / "model.safetensors").read_bytes(), "mounted model.safetensors")
    assert not any(k.startswith(("model.", "optimizer.")) for k in header), "prefix not removed"
    assert_same_embeddings(mnt, want, "mount -o root=model")


def test_mount_unknown_root_mounts_nothing(minilm_training_folder, mounts):
    from fusetools import mount_entry

    folder, _ = minilm_training_folder
    mnt, res = mounts.try_mount(folder, "root=nope")
    assert res.returncode == 1, res.describe()
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and "model" in lines[0] and "optimizer" in lines[0], res.describe()
    assert mount_entry(mnt) is None, "an unknown root still mounted"
