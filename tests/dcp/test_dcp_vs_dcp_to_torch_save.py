"""Every DCP case, served by ckptfs (a real mount, `ckptfs export`, `ckptfs ls --json`), against
torch's own dcp_to_torch_save() of the same checkpoint dir: the same tensors under the same
keys, bit for bit, and the same non-tensor values in metadata.json."""

import json

import pytest

from ckptfs_testlib import SERVED_DTYPE, check_safetensors_file, json_strings
from make_dcp_checkpoints import CASES


def sub_tree(tensors: dict, prefix: str) -> dict:
    """The entries under PREFIX., with the prefix removed (what --root PREFIX serves)."""
    return {key[len(prefix) + 1 :]: value for key, value in tensors.items() if key.startswith(prefix + ".")}


def json_form(value):
    """VALUE as JSON gives it back (tuples become lists)."""
    if isinstance(value, (list, tuple)):
        return [json_form(v) for v in value]
    if isinstance(value, dict):
        return {str(k): json_form(v) for k, v in value.items()}
    return value


def assert_same_json_value(got, want, where: str) -> None:
    """Equal with the same JSON types: 0 (an int) is not 0.0, True is not 1."""
    assert type(got) is type(want), f"{where}: {got!r} ({type(got).__name__}) != {want!r} ({type(want).__name__})"
    if isinstance(want, list):
        assert len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_json_value(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def value_at(metadata, path: tuple, where: str):
    node = metadata
    for part in path:
        if isinstance(node, dict):
            assert str(part) in node, f"{where}: metadata.json has no {part!r} (keys {sorted(node)})"
            node = node[str(part)]
        else:
            assert isinstance(node, list) and isinstance(part, int) and part < len(node), (
                f"{where}: metadata.json has no [{part!r}] in {node!r}"
            )
            node = node[part]
    return node


def check_metadata(metadata: dict, values: dict, prefix: tuple = ()) -> int:
    """Every simple non-tensor value of VALUES ({path: value}) under PREFIX is in METADATA
    (metadata.json of a view rooted at PREFIX) at its path. Returns how many were checked."""
    checked = 0
    for path, value in values.items():
        if path[: len(prefix)] != prefix:
            continue
        value = json_form(value)
        where = ".".join(map(str, path))
        assert_same_json_value(value_at(metadata, path[len(prefix) :], where), value, where)
        checked += 1
    return checked


@pytest.fixture(scope="module")
def exported(dcp_case, run_ckptfs, tmp_path_factory):
    """exported(case, *options) -> the folder `ckptfs export [OPTIONS] CASE OUT` wrote."""
    cache = {}

    def export(name: str, *options) -> object:
        if (name, options) not in cache:
            out = tmp_path_factory.mktemp("export") / "out"
            run_ckptfs("export", *options, dcp_case(name).checkpoint_dir, out)
            cache[name, options] = out
        return cache[name, options]

    return export


@pytest.mark.parametrize("name", list(CASES))
def test_export_matches_dcp_to_torch_save(name, dcp_case, exported):
    case = dcp_case(name)
    out = exported(name)
    check_safetensors_file(out / "model.safetensors", case.tensors)
    metadata = json.loads((out / "metadata.json").read_text())
    # Every case has at least its optimizer's param_groups.
    assert check_metadata(metadata, case.non_tensor_values) > 0


@pytest.mark.parametrize("name", list(CASES))
def test_ls_json_matches_dcp_to_torch_save(name, dcp_case, ls_json):
    case = dcp_case(name)
    entries = {entry["key"]: entry for entry in ls_json(case.checkpoint_dir)}
    assert set(entries) == set(case.tensors), (
        f"missing {sorted(set(case.tensors) - set(entries))}, extra {sorted(set(entries) - set(case.tensors))}"
    )
    for key, (path, tensor) in case.tensors_with_paths.items():
        entry = entries[key]
        # The path keeps what the key's dots hide: `model` then the module fqn `0.weight`, and
        # list positions as numbers.
        assert entry["path"] == path, f"{key}: path {entry['path']} != {path}"
        assert entry["dtype"] == SERVED_DTYPE[tensor.dtype], f"{key}: dtype {entry['dtype']} != {tensor.dtype}"
        assert entry["shape"] == list(tensor.shape), f"{key}: shape {entry['shape']} != {list(tensor.shape)}"
        assert entry["nbytes"] == tensor.numel() * tensor.element_size(), f"{key}: nbytes {entry['nbytes']}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(CASES))
def test_mount_matches_dcp_to_torch_save(name, dcp_case, mounts):
    case = dcp_case(name)
    mnt = mounts.mount(case.checkpoint_dir)
    check_safetensors_file(mnt / "model.safetensors", case.tensors)
    metadata = json.loads((mnt / "metadata.json").read_text())
    check_metadata(metadata, case.non_tensor_values)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(CASES))
def test_mount_root_model(name, dcp_case, mounts):
    """-o root=model serves the model's state dict under its module fqns, as the model's own
    state_dict() names them."""
    case = dcp_case(name)
    want = sub_tree(case.tensors, "model")
    assert want, f"{name}: no model.* tensors in the reference"
    mnt = mounts.mount(case.checkpoint_dir, None, "-o", "root=model")
    check_safetensors_file(mnt / "model.safetensors", want)
    metadata = json.loads((mnt / "metadata.json").read_text())
    check_metadata(metadata, case.non_tensor_values, prefix=("model",))
    # Narrowed to the model: nothing of the optimizer's or the top level's values.
    assert "param_groups" not in json_strings(metadata), metadata


@pytest.mark.parametrize("name", ["plain_ws1", "fsdp2_ws3", "fsdp_tp_2d_ws4"])
def test_export_root_optim(name, dcp_case, exported):
    """--root optim: the optimizer's state under `state.<fqn>.<moment>` and its param_groups
    in metadata.json."""
    case = dcp_case(name)
    out = exported(name, "--root", "optim")
    check_safetensors_file(out / "model.safetensors", sub_tree(case.tensors, "optim"))
    metadata = json.loads((out / "metadata.json").read_text())
    assert check_metadata(metadata, case.non_tensor_values, prefix=("optim",)) > 0, (
        "the reference has no optimizer param_groups to compare"
    )


def test_plain_case_covers_what_it_claims(dcp_case):
    """The plain case holds the value kinds the tests above are meant to cover: a guard
    against a generator change that silently drops them."""
    case = dcp_case("plain_ws1")
    kinds = {type(v) for v in case.non_tensor_values.values()}
    assert {int, float, str, list} <= kinds, kinds
    assert case.non_tensor_values[("optim", "param_groups", 1, "lr")] == 2.5e-4
    # DCP's planner_data keeps each fqn's path: dict keys as strings (DCP saves the int keys
    # of optim.state as "0", "1") and list positions as ints, which `path` of ls --json must
    # reproduce.
    paths = {tuple(p) for p, _ in case.tensors_with_paths.values()}
    assert ("optim", "state", "0", "exp_avg") in paths and ("buffers", 1) in paths, sorted(paths)
