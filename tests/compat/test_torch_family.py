"""The rest of the torch family, written by the real torch and checked against what torch
itself loads: legacy torch.save streams (_use_new_zipfile_serialization=False), TorchScript
archives (torch.jit.save of scripted and traced modules) and torch.export.save packages."""

import functools
import json
import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from ckptfs_testlib import ALL_DTYPES, assert_bitwise_equal, served_form
from test_torch_checkpoints import random_bits, training_checkpoint

SYSTEM_PYTHON = "/usr/bin/python3"


def legacy_save(obj, path: Path):
    """Saves OBJ in the legacy stream format and returns what torch.load reads back."""
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    return torch.load(path, weights_only=True)


def nested(flat: dict) -> dict:
    """{'a.b': t} -> {'a': {'b': t}}: state_dict names as the module tree they come from, so
    the expected paths are the attribute paths ckptfs reports."""
    tree = {}
    for key, value in flat.items():
        node = tree
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree


def read_mounted_model(mnt: Path) -> dict:
    with safe_open(str(mnt / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def check_mount(mnt: Path, expected: dict) -> None:
    """The mount's model.safetensors and each per-tensor file hold EXPECTED, key for key."""
    got = read_mounted_model(mnt)
    assert set(got) == set(expected)
    files = {t["key"]: t["file"] for t in json.loads((mnt / "manifest.json").read_text())["tensors"]}
    for key, tensor in expected.items():
        want = served_form(tensor.detach())
        assert_bitwise_equal(got[key], want, key)
        with safe_open(str(mnt / files[key]), framework="pt") as f:
            assert list(f.keys()) == [key]
            assert_bitwise_equal(f.get_tensor(key), want, f"{files[key]}: {key}")


# --- legacy torch.save streams ------------------------------------------------------------


def test_legacy_flat_state_dict(tmp_path, verify_export):
    torch.manual_seed(0)
    state = {
        "embed.weight": torch.randn(100, 32),
        "layers.0.weight": torch.randn(32, 32),
        "layers.0.bias": torch.randn(32),
        "head.weight": torch.randn(10, 32).half(),
        "big": torch.randn(1 << 18),
    }
    src = tmp_path / "flat.pt"
    expected = legacy_save(state, src)
    assert src.read_bytes()[:2] == b"\x80\x02", "not written in the legacy format"
    verify_export(src, expected)


def test_legacy_training_checkpoint(tmp_path, verify_export, run_ckptfs):
    src = tmp_path / "train.pt"
    expected = legacy_save(training_checkpoint(), src)
    out, by_key = verify_export(src, expected)
    assert "optimizer.state.0.exp_avg" in by_key
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["epoch"] == 3 and meta["config"] == {"lr": 3e-4, "name": "demo"}
    info = run_ckptfs("info", src).stdout.decode()
    assert "format:       torch-legacy" in info


def test_legacy_tied_views_and_transpose(tmp_path, verify_export):
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    state = {
        "w": base,
        "tied": base,  # the same tensor twice
        "tail": base[2:],  # a view with a storage offset
        "col": base[:, 3],  # strided view with an offset
        "t": base.t(),  # transposed: non-contiguous
        "other": torch.ones(3, dtype=torch.int16),
    }
    src = tmp_path / "views.pt"
    expected = legacy_save(state, src)
    assert expected["tail"].storage_offset() == 16
    out, _ = verify_export(src, expected)
    manifest = json.loads((out / "manifest.json").read_text())
    shared = {t["key"]: t.get("shared_storage") for t in manifest["tensors"]}
    group = {shared[k] for k in ("w", "tied", "tail", "col", "t")}
    assert len(group) == 1 and None not in group, shared
    assert shared["other"] is None


def test_legacy_every_dtype(tmp_path, verify_export):
    """Every dtype ckptfs serves that the legacy writer accepts. Dtypes without a typed
    storage class (float8, uint16/32/64, complex32) are written as untyped storages, which
    torch's own legacy loader cannot read back: those are checked against the saved tensors."""
    state = {}
    for i, dtype in enumerate(ALL_DTYPES):
        state[str(dtype).removeprefix("torch.")] = random_bits((3, 5), dtype, seed=i)
    src = tmp_path / "dtypes.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(state, src, _use_new_zipfile_serialization=False)
    try:
        loaded = torch.load(src, weights_only=True)
    except Exception:  # noqa: BLE001 - torch cannot load untyped legacy storages
        loaded = None
    expected = {}
    for name, tensor in state.items():
        single = tmp_path / f"one-{name}.pt"
        torch.save({name: tensor}, single, _use_new_zipfile_serialization=False)
        try:
            expected[name] = torch.load(single, weights_only=True)[name]
        except Exception:  # noqa: BLE001
            expected[name] = tensor
    assert loaded is None or set(loaded) == set(expected)
    verify_export(src, expected)


def test_legacy_mount_serves_torch_load_bytes(tmp_path, mounts):
    torch.manual_seed(3)
    base = torch.randn(16, 4)
    src = tmp_path / "m.pt"
    expected = legacy_save({"a": base, "b": base.t(), "c": torch.randn(7).double()}, src)
    check_mount(mounts.mount(src), expected)


def test_legacy_bin_in_a_model_folder(tmp_path, verify_export, run_ckptfs):
    """Hugging Face folders of the pre-1.6 era: a legacy pytorch_model.bin beside its config,
    sharded with an index."""
    folder = tmp_path / "model"
    folder.mkdir()
    torch.manual_seed(7)
    shards = [{"embed.weight": torch.randn(10, 4)}, {"head.weight": torch.randn(3, 4), "head.bias": torch.randn(3)}]
    weight_map = {}
    expected = {}
    for i, shard in enumerate(shards, 1):
        name = f"pytorch_model-0000{i}-of-00002.bin"
        expected.update(legacy_save(shard, folder / name))
        weight_map.update({k: name for k in shard})
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text('{"model_type": "demo"}')
    out, _ = verify_export(folder, expected)
    assert (out / "config.json").read_text() == '{"model_type": "demo"}'


def rchar_of_run(argv) -> int:
    """Runs ARGV and returns how many bytes it read through read()/pread() (rchar of
    /proc/<pid>/io, taken while the exited child is still a zombie)."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    io = dict(line.split(": ") for line in Path(f"/proc/{proc.pid}/io").read_text().splitlines())
    assert proc.wait() == 0, proc.stderr.read()
    return int(io["rchar"])


def test_legacy_ls_of_1gb_reads_a_few_hundred_kb(tmp_path, ckptfs_bin):
    """Storage offsets come from walking the 8-byte headers, seeking over the data: listing a
    1 GB legacy checkpoint of 256 tensors reads a few KB of it."""
    src = tmp_path / "big.pt"
    state = {f"layers.{i}.weight": torch.zeros(1 << 20) for i in range(256)}  # 256 x 4 MiB
    torch.save(state, src, _use_new_zipfile_serialization=False)
    del state
    size = src.stat().st_size
    assert size > 1 << 30
    empty = tmp_path / "empty.pt"
    torch.save({}, empty, _use_new_zipfile_serialization=False)
    baseline = rchar_of_run([str(ckptfs_bin), "ls", str(empty)])  # what ckptfs reads besides the source
    read = rchar_of_run([str(ckptfs_bin), "ls", str(src)]) - baseline
    print(f"ckptfs ls of a {size} byte legacy checkpoint read {read} bytes of it (rchar)")
    assert 0 < read <= 300 * 1024, read
    src.unlink()


@functools.cache
def _system_torch_version():
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return None
    res = subprocess.run([SYSTEM_PYTHON, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else None


def test_legacy_written_by_debian_torch(tmp_path, verify_export):
    """A second torch version (Debian's python3-torch, installed by scripts/install-deps.sh)
    writes the file; the venv's torch loads the reference."""
    version = _system_torch_version()
    if version is None:
        pytest.skip("Debian's python3-torch is not installed (scripts/install-deps.sh installs it)")
    assert version != torch.__version__
    src = tmp_path / "debian.pt"
    script = f"""
import torch
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 2))
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
m(torch.randn(3, 6)).sum().backward(); opt.step()
base = torch.arange(20, dtype=torch.float64).reshape(4, 5)
torch.save({{"model": m.state_dict(), "optim": opt.state_dict(), "view": base[1:], "t": base.t(),
            "h": torch.ones(3, dtype=torch.float16), "b": torch.tensor([True, False])}},
           {str(src)!r}, _use_new_zipfile_serialization=False)
"""
    subprocess.run([SYSTEM_PYTHON, "-c", script], check=True, env={"PATH": "/usr/bin:/bin"})
    expected = torch.load(src, weights_only=True)
    verify_export(src, expected)


def test_torchscript_written_by_debian_torch(tmp_path, ls_json, export_source):
    """TorchScript archives of the older torch (scripted and traced), loaded by the venv's."""
    if _system_torch_version() is None:
        pytest.skip("Debian's python3-torch is not installed (scripts/install-deps.sh installs it)")
    script = f"""
import warnings
warnings.simplefilter("ignore")
import torch
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).eval()
torch.jit.script(m).save({str(tmp_path / "scripted.pt")!r})
torch.jit.trace(m, torch.randn(1, 4)).save({str(tmp_path / "traced.pt")!r})
"""
    subprocess.run([SYSTEM_PYTHON, "-c", script], check=True, env={"PATH": "/usr/bin:/bin"})
    for name in ("scripted.pt", "traced.pt"):
        src = tmp_path / name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.jit.load(str(src)).state_dict()
        assert {e["key"] for e in ls_json(src)} == set(state), name
        out = export_source(src)
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            for key, tensor in state.items():
                assert_bitwise_equal(f.get_tensor(key), tensor, f"{name}: {key}")


# --- hostile pickles ----------------------------------------------------------------------


class RunsCommand:
    """Pickles as a call of os.system: unpickling it would run COMMAND."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _replace_records(src: Path, dst: Path, replace: dict):
    """DST: the zip SRC with the records named in REPLACE (without the archive folder) replaced."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = replace.get(info.filename.split("/", 1)[1], zin.read(info.filename))
            zout.writestr(info.filename, data)


def test_hostile_pickles_run_nothing(tmp_path, run_ckptfs):
    """A pickle calling os.system in each container: one line, exit 1, nothing run."""
    import pickle

    marker = tmp_path / "pwned"
    evil = RunsCommand(f"touch {marker}")
    cases = {}
    legacy = tmp_path / "legacy-evil.pt"
    torch.save({"w": torch.ones(2), "x": evil}, legacy, _use_new_zipfile_serialization=False)
    cases[legacy] = r"object pickle \(at byte \d+\): pickle references posix\.system"
    scripted = tmp_path / "scripted.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(nn.Linear(2, 2)).save(str(scripted))
    for record in ("data.pkl", "constants.pkl"):
        bad = tmp_path / f"ts-evil-{record}.pt"
        _replace_records(scripted, bad, {record: pickle.dumps(evil, protocol=2)})
        cases[bad] = rf"{record.replace('.', '[.]')}: pickle references posix\.system"
    program = tmp_path / "ep.pt2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(nn.Linear(2, 2), (torch.randn(1, 2),)), str(program))
    import zipfile

    with zipfile.ZipFile(program) as z:
        config = json.loads(z.read("ep/data/weights/model_weights_config.json"))
    config["config"]["weight"]["use_pickle"] = True
    bad_program = tmp_path / "ep-evil.pt2"
    _replace_records(program, bad_program, {
        "data/weights/model_weights_config.json": json.dumps(config).encode(),
        "data/weights/" + config["config"]["weight"]["path_name"]: pickle.dumps(evil, protocol=2),
    })
    cases[bad_program] = r"\(weight\) is a pickled object"
    import re

    for src, pattern in cases.items():
        res = run_ckptfs("ls", src, check=False)
        err = res.stderr.decode()
        assert res.returncode == 1, (src, err)
        assert err.count("\n") == 1 and err.startswith(f"ckptfs: {src}"), err
        assert re.search(pattern, err), (pattern, err)
    assert not marker.exists(), "a pickle ran a command"


# --- TorchScript archives -----------------------------------------------------------------


class Block(nn.Module):
    """A small transformer block."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.ln1 = nn.LayerNorm(8)
        self.ff = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.ln2 = nn.LayerNorm(8)
        self.register_buffer("pos", torch.arange(4.0))

    def forward(self, x):
        a, _ = self.attn(x, x, x)
        x = self.ln1(x + a)
        return self.ln2(x + self.ff(x)) + self.pos[: x.shape[1]].unsqueeze(-1) * torch.tensor([0.5]).sum()


def _sequential():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.BatchNorm1d(12), nn.Linear(12, 3)).eval()


def _block():
    torch.manual_seed(5)
    return Block().eval()


def _jit(kind, model, example):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "scripted":
            return torch.jit.script(model)
        return torch.jit.trace(model, example, check_trace=False)


def _graph_tensor_constants(module) -> list:
    """The tensor constants of a loaded TorchScript module's code (CONSTANTS.c<i>)."""
    found = []
    graphs = [module.inlined_graph] if hasattr(module, "inlined_graph") else []
    for graph in graphs:
        for node in graph.nodes():
            if node.kind() == "prim::Constant" and node.hasAttribute("value") and node.kindOf("value") == "t":
                found.append(node.t("value"))
    return found


@pytest.mark.parametrize("kind", ["scripted", "traced"])
@pytest.mark.parametrize("which", ["sequential", "block"])
def test_torchscript(tmp_path, verify_export, run_ckptfs, kind, which):
    model = _sequential() if which == "sequential" else _block()
    example = torch.randn(2, 6) if which == "sequential" else torch.randn(1, 4, 8)
    src = tmp_path / f"{which}-{kind}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _jit(kind, model, example).save(str(src))
        loaded = torch.jit.load(str(src))
    state = loaded.state_dict()
    assert set(state) == set(model.state_dict())

    entries = {e["key"]: e for e in json.loads(run_ckptfs("ls", "--json", src).stdout)}
    constants = {k for k in entries if k.startswith("CONSTANTS.")}
    assert set(entries) - constants == set(state)
    # verify_export wants the exact key set: the module tree plus the constants table.
    expected = nested(dict(state))
    if constants:
        # Each served constant is one of the code's tensor constants (same dtype, shape, bytes).
        reference = _graph_tensor_constants(loaded)
        export_dir = tmp_path / "constants-export"
        run_ckptfs("export", src, export_dir)
        for key in sorted(constants):
            with safe_open(str(export_dir / "model.safetensors"), framework="pt") as f:
                got = f.get_tensor(key)
            assert any(
                r.dtype == got.dtype and r.shape == got.shape and torch.equal(r.view(-1).view(torch.uint8), got.view(-1).view(torch.uint8))
                for r in reference
            ), f"{key} is none of the code's tensor constants"
            expected.setdefault("CONSTANTS", {})[key.split(".", 1)[1]] = got
    out, _ = verify_export(src, expected)
    meta = json.loads((out / "metadata.json").read_text())
    code = meta["torchscript"]["code_files"]
    assert code and all(name.startswith("code/") for name in code)
    assert "format:       torchscript" in run_ckptfs("info", src).stdout.decode()


@pytest.mark.parametrize("which", ["sequential", "block"])
def test_torchscript_mount(tmp_path, mounts, which):
    src = tmp_path / f"{which}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(_sequential() if which == "sequential" else _block()).save(str(src))
        state = torch.jit.load(str(src)).state_dict()
    check_mount(mounts.mount(src), state)


# --- torch.export packages ----------------------------------------------------------------


class Exported(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.l2 = nn.Linear(8, 3)
        self.l3 = self.l2  # tied
        self.register_buffer("scale", torch.tensor([2.0]))
        self.register_buffer("nonpersistent", torch.ones(3), persistent=False)
        self.table = torch.arange(3.0)  # a plain tensor attribute: a constant

    def forward(self, x):
        return self.l2(torch.relu(self.bn(self.l1(x)))) * self.scale + self.nonpersistent + self.table


def test_torch_export(tmp_path, verify_export, run_ckptfs, mounts):
    torch.manual_seed(6)
    src = tmp_path / "model.pt2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(Exported().eval(), (torch.randn(2, 4),))
        torch.export.save(program, str(src))
        loaded = torch.export.load(str(src))
    expected = dict(loaded.state_dict)
    constants = {k: v for k, v in loaded.constants.items() if isinstance(v, torch.Tensor)}
    assert set(constants) == {"table", "nonpersistent"}
    expected.update(constants)
    out, _ = verify_export(src, expected)
    manifest = json.loads((out / "manifest.json").read_text())
    shared = {t["key"]: t.get("shared_storage") for t in manifest["tensors"]}
    assert shared["l2.weight"] is not None and shared["l2.weight"] == shared["l3.weight"]
    assert "format:       torch-export" in run_ckptfs("info", src).stdout.decode()

    check_mount(mounts.mount(src), expected)
