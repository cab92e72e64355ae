#!/usr/bin/env python3
"""Seed corpora for the libFuzzer targets, from files the real libraries write.

    $(scripts/setup-venv.sh)/bin/python tests/fuzz/make_seeds.py [--zero-template]

Writes tests/fuzz/seeds/<target>/ (small files, committed; regenerating them gives equivalent
but not byte-identical files, since torch.save archives carry random record names):

    torch_legacy/ legacy torch.save streams (_use_new_zipfile_serialization=False) of the same objects
    torch/        torch.save files: dtypes, nested dicts/lists, views and strided tensors,
                  shared storages, pickle protocols 2..5, legacy-style _use_new_zipfile_serialization
    zip/          the torch files, plus zipfile archives (stored, zip64, comments, empty)
    pickle/       the data.pkl records of the torch files, plus plain pickles (protocols 0..5)
    (and in torch/, torch_legacy/, pickle/: Python 2's pickle forms, and objects holding tensors
    in forms the readers refuse, from tests/frameworks and tests/corpus; in torch/ and pickle/:
    pickled nn.Modules, torch.save(model))
    safetensors/  safetensors.torch.save_file files (dtypes, empty tensors, __metadata__)
    view/         64 control bytes (view options and read pattern) + a torch or safetensors file
    zero/         1 selector byte (which rank file) + that file's data.pkl, from data/zero/

--zero-template first (re)generates data/zero/, the small real DeepSpeed ZeRO-2 checkpoint
(world size 2) the zero target rewrites, with tests/zero/make_zero_checkpoints.py.
"""

import argparse
import collections
import io
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEEDS = HERE / "seeds"
ZERO_TEMPLATE = HERE / "data" / "zero"


def torch_checkpoints():
    """name -> object to torch.save (small: seeds should mutate fast)."""
    import torch

    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    shared = torch.arange(12, dtype=torch.float32)
    objs = {
        "plain": {"w": torch.randn(3, 4, generator=g), "b": torch.zeros(4)},
        "dtypes": {
            str(dt).split(".")[1]: torch.arange(6).to(dt)
            for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                       torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
        },
        "complex": {"c": torch.complex(torch.ones(3), torch.zeros(3))},
        "nested": {
            "model": collections.OrderedDict(
                [("layer.0.weight", torch.randn(2, 3, generator=g)), ("layer.0.bias", torch.ones(2))]),
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2, 3)}},
                          "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}]},
            "epoch": 3, "name": "run-1", "flags": [True, None, 1.5, b"raw"], "big": 2**70,
        },
        "views": {
            "t": base.t(),                 # transposed: strided
            "slice": base[1:3, 2:5],       # offset + strided
            "row": base[2],                # contiguous view at an offset
            "step": base[:, ::2],          # non-unit stride
            "expand": torch.ones(3, 1).expand(3, 4),  # zero stride
            "base": base,
        },
        "shared": {"a": shared, "b": shared, "c": shared[4:8]},  # tied and overlapping
        "empty": {"e": torch.zeros(0), "s": torch.tensor(5), "e2": torch.zeros(2, 0, 3)},
        "param": {"p": torch.nn.Parameter(torch.ones(2, 2))},
        "tensor_root": torch.arange(5, dtype=torch.int16),
        "list_root": [torch.ones(2), {"x": torch.zeros(1)}],
    }
    return objs


def save_torch(obj, protocol=2):
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf, pickle_protocol=protocol)
    return buf.getvalue()


def write(target, name, data):
    d = SEEDS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def data_pkl(zip_bytes):
    with zipfile.ZipFile(io.BytesIO(zip_bytes)) as z:
        name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        return z.read(name)


def control(rng):
    return bytes(rng.randrange(256) for _ in range(64))


def make_torch_zip_pickle_view(rng):
    objs = torch_checkpoints()
    for name, obj in objs.items():
        for protocol in (2, 4, 5) if name in ("plain", "nested", "views") else (2,):
            data = save_torch(obj, protocol)
            write("torch", f"{name}-p{protocol}.pt", data)
            write("zip", f"{name}-p{protocol}.pt", data)
            write("pickle", f"{name}-p{protocol}.pkl", data_pkl(data))
            write("view", f"{name}-p{protocol}.pt", control(rng) + data)

    # Plain zip archives: stored/deflated records, comments, zip64 records, empty archive.
    for name, kw in (("stored", dict(compression=zipfile.ZIP_STORED)),
                     ("deflated", dict(compression=zipfile.ZIP_DEFLATED))):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", **kw) as z:
            z.writestr("a/data.pkl", pickle.dumps({"k": 1}, protocol=2))
            z.writestr("a/data/0", b"\x00" * 16)
            z.comment = b"a comment"
        write("zip", f"{name}.zip", buf.getvalue())
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
        with z.open("big", "w", force_zip64=True) as f:
            f.write(b"x" * 64)
        z.writestr("small", b"y")
    write("zip", "zip64.zip", buf.getvalue())
    buf = io.BytesIO()
    zipfile.ZipFile(buf, "w").close()
    write("zip", "empty.zip", buf.getvalue())

    # Plain pickles: every protocol, the value kinds the reader knows, memo sharing.
    shared_list = [1, 2]
    value = {"none": None, "t": True, "f": False, "int": -5, "big": -(2**80), "float": 1.25,
             "str": "héllo", "bytes": b"\x00\x01", "tuple": (1, (2, 3)), "list": [shared_list, shared_list],
             "set": {1, 2}, "frozen": frozenset({3}), "od": collections.OrderedDict(a=1),
             "bytearray": bytearray(b"ab"), 7: "int key"}
    for protocol in range(0, 6):
        write("pickle", f"values-p{protocol}.pkl", pickle.dumps(value, protocol=protocol))
    recursive = []
    recursive.append(recursive)
    write("pickle", "recursive.pkl", pickle.dumps(recursive, protocol=2))


def make_safetensors(rng):
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(1)
    files = {
        "plain": {"w": torch.randn(3, 4, generator=g), "b": torch.zeros(4)},
        "dtypes": {str(dt).split(".")[1]: torch.arange(4).to(dt)
                   for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                              torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)},
        "empty": {"e": torch.zeros(0), "s": torch.tensor(2.0)},
        "nested_keys": {"model.layer.0.weight": torch.ones(2, 2), "model.layer.0.bias": torch.ones(2),
                        "optimizer.state.0.exp_avg": torch.zeros(3)},
    }
    for name, tensors in files.items():
        data = save(tensors, metadata={"format": "pt"} if name != "empty" else None)
        write("safetensors", f"{name}.safetensors", data)
        write("view", f"{name}.safetensors", control(rng) + data)


ZERO_FILES = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
              "zero_pp_rank_1_mp_rank_00_optim_states.pt"]


def make_zero_template():
    """A real ZeRO-2 fp32 checkpoint of world size 2, saved by DeepSpeed (CPU, gloo)."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(HERE.parent / "zero" / "make_zero_checkpoints.py"), tmp,
                        "--only", "w2-s2-fp32", "--no-zero-to-fp32"], check=True)
        tag = next(Path(tmp).glob("*/checkpoint/global_step*"))
        if ZERO_TEMPLATE.exists():
            shutil.rmtree(ZERO_TEMPLATE)
        ZERO_TEMPLATE.mkdir(parents=True)
        for name in ZERO_FILES:
            shutil.copy(tag / name, ZERO_TEMPLATE / name)


def make_zero():
    for i, name in enumerate(ZERO_FILES):
        write("zero", f"{Path(name).stem}.seed", bytes([i]) + data_pkl((ZERO_TEMPLATE / name).read_bytes()))


def make_torch_legacy():
    """torch_legacy/: legacy torch.save streams (_use_new_zipfile_serialization=False) of the
    torch target's objects: several storages, shared ones, views, every typed storage class."""
    import torch

    out = SEEDS / "torch_legacy"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name, obj in torch_checkpoints().items():
        buf = io.BytesIO()
        try:
            torch.save(obj, buf, _use_new_zipfile_serialization=False)
        except Exception:  # noqa: BLE001 - objects the legacy writer refuses
            continue
        (out / f"{name}.pt").write_bytes(buf.getvalue())


def make_torch_family_zips():
    """torch/: a TorchScript archive and a torch.export package, read by their own readers
    behind the same PK magic."""
    import warnings

    import torch

    out = SEEDS / "torch"
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.trace(model, torch.randn(1, 3), check_trace=False).save(str(out / "torchscript.pt"))
        torch.export.save(torch.export.export(model, (torch.randn(1, 3),)), str(out / "export.pt2"))


def make_python2_and_refused():
    """torch/, torch_legacy/, pickle/: Python 2's pickle forms (byte strings, escapes, LONG,
    copy_reg objects, OrderedDict from pairs; tests/frameworks/test_legacy_python2.py builds
    them, checked there against torch.load), and objects that hold tensors in forms the readers
    refuse (tests/corpus/cases/obj-*)."""
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE.parent / "frameworks"))
    import test_legacy_python2 as py2

    for target in ("torch", "torch_legacy", "pickle"):
        (SEEDS / target).mkdir(parents=True, exist_ok=True)
    (SEEDS / "torch" / "python2-zip.pt").write_bytes(py2.zip_archive())
    (SEEDS / "torch_legacy" / "python2.pt").write_bytes(py2.legacy_stream())
    (SEEDS / "pickle" / "python2-object.pkl").write_bytes(py2.python2_object(True))
    for case in sorted((HERE.parent / "corpus" / "cases").glob("obj-*.pt")):
        shutil.copyfile(case, SEEDS / "torch" / case.name)


def make_pickled_modules():
    """torch/, pickle/: whole nn.Modules as torch.save(model) writes them (served under their
    state_dict() names): a plain module with a non-persistent buffer and a tensor attribute, and
    one inside a checkpoint dict beside other values."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    net.register_buffer("scratch", torch.zeros(2), persistent=False)
    net[0].stride = torch.tensor([8.0, 16.0])  # a tensor attribute, not in state_dict()
    for name, obj in (("module", net), ("module_in_dict", {"model": net, "ema": None, "epoch": 3})):
        data = save_torch(obj)
        write("torch", f"{name}.pt", data)
        write("pickle", f"{name}-p2.pkl", data_pkl(data))


def make_keymap():
    """Key-map seeds: 16 control bytes (fuzz_keymap.cpp: the map, layout flags, small dims: 2
    layers, 2 query groups of 2 heads, head dim 2, hidden 8, ffn 4, 12 padded vocab rows, the
    experts) then a Megatron-Bridge run_config.yaml whose model: section agrees with them."""
    maps = ["auto", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"]
    provider = "megatron.bridge.models"

    def yaml(target, qkv_bias=False, qk_norm=False, tied=False, experts=0):
        fields = [("_target_", target), ("num_layers", 2), ("hidden_size", 8), ("ffn_hidden_size", 4),
                  ("num_attention_heads", 4), ("num_query_groups", 2), ("kv_channels", 2),
                  ("activation_func", None), ("normalization", "RMSNorm"), ("layernorm_epsilon", "1.0e-05"),
                  ("gated_linear_unit", "true"), ("add_bias_linear", "false"),
                  ("add_qkv_bias", str(qkv_bias).lower()), ("qk_layernorm", str(qk_norm).lower()),
                  ("share_embeddings_and_output_weights", str(tied).lower()), ("position_embedding_type", "rope"),
                  ("rotary_base", 10000), ("rotary_percent", "1.0"), ("seq_length", 64), ("vocab_size", 10),
                  ("should_pad_vocab", "true"), ("make_vocab_size_divisible_by", 4),
                  ("tensor_model_parallel_size", 1)]
        if experts:
            fields += [("num_moe_experts", experts), ("moe_router_topk", 1), ("moe_ffn_hidden_size", 4),
                       ("moe_router_pre_softmax", "false"), ("moe_router_score_function", "softmax")]
        lines = ["_target_: megatron.bridge.training.config.ConfigContainer", "model:"]
        for k, v in fields:
            lines.append(f"  {k}:\n    _call_: false\n    _target_: torch.nn.functional.silu" if v is None
                         else f"  {k}: {v}")
        return ("\n".join(lines) + "\n").encode()

    def control(map_name, flags, experts=0):
        return bytes([maps.index(map_name), flags, 1, 1, 1, 1, 7, 3, 11, experts, 0, 0, 0, 0, 0, 0])

    llama = f"{provider}.llama.llama_provider.LlamaModelProvider"
    # flags: 1 per-layer keys, 2 tied, 4 QKV biases, 8 q/k norms, 16 "module." keys, 32 bf16
    seeds = {
        "llama-stacked": control("auto", 0) + yaml(llama),
        "llama-per-layer-nemo": control("llama", 1 | 16) + yaml(llama),
        "llama-tied": control("llama", 2) + yaml(llama, tied=True),
        "llama-bf16": control("llama", 32) + yaml(llama),
        "mistral": control("mistral", 0) + yaml(f"{provider}.mistral.mistral_provider.MistralModelProvider"),
        "qwen2-bias": control("auto", 4) + yaml(f"{provider}.qwen.qwen_provider.Qwen2ModelProvider", qkv_bias=True),
        "qwen3-norms": control("qwen3", 8 | 1) + yaml(f"{provider}.qwen.qwen_provider.Qwen3ModelProvider", qk_norm=True),
        "mixtral": control("mixtral", 0, 2) + yaml(f"{provider}.mixtral.mixtral_provider.MixtralModelProvider", experts=2),
        "qwen3-moe": control("auto", 8, 2) + yaml(f"{provider}.qwen.qwen_provider.Qwen3MoEModelProvider", qk_norm=True,
                                                  experts=2),
    }
    for name, data in seeds.items():
        write("keymap", name, data)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zero-template", action="store_true", help="regenerate data/zero/ with DeepSpeed")
    args = parser.parse_args()
    rng = random.Random(0)
    for target in ("torch", "zip", "pickle", "safetensors", "view", "zero", "torch_legacy", "keymap"):
        if (SEEDS / target).exists():
            shutil.rmtree(SEEDS / target)
    make_torch_zip_pickle_view(rng)
    make_safetensors(rng)
    make_torch_legacy()
    make_torch_family_zips()
    make_python2_and_refused()
    make_pickled_modules()
    make_keymap()
    if args.zero_template or not ZERO_TEMPLATE.exists():
        make_zero_template()
    make_zero()
    total = sum(f.stat().st_size for f in SEEDS.rglob("*") if f.is_file())
    print(f"make_seeds: {sum(1 for f in SEEDS.rglob('*') if f.is_file())} seeds, {total} bytes under {SEEDS}")


if __name__ == "__main__":
    main()
