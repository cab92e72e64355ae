"""The checkpoints the device suite and scripts/device-check.sh load: one of every source kind
ckptfs reads, written by the real libraries.

torch.save and safetensors files are written on the spot; the ZeRO and DCP ones come from the
real DeepSpeed and torch.distributed saves of tests/zero and tests/dcp, found in
$CKPTFS_DEVICE_FIXTURES (a device pack, scripts/device-pack.sh: the GPU machine has no
DeepSpeed) or else in this machine's fixture cache (tests/ckptfs_fixture_cache.py).

Importable without pytest."""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

TESTS_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS_DIR))
from ckptfs_checkpoints import device_checkpoint  # noqa: E402

# Two DeepSpeed saves of tests/zero/make_zero_checkpoints.py (ZeRO-2 fp16 and ZeRO-3 fp32, two
# ranks each) and one FSDP2 save of tests/dcp/make_dcp_checkpoints.py (two ranks).
ZERO_FIXTURES = ("w2-s2-fp16", "w2-s3-fp32")
DCP_FIXTURE = "fsdp2_ws2"

# Every kind, in the order reports list them.
KINDS = ("pt", "safetensors", "sharded", "zero2", "zero3", "dcp")
# Every --dtype of `ckptfs load` (None: as stored).
DTYPES = (None, "bf16", "fp16", "fp32")


def framework_fixtures() -> tuple[Path, Path]:
    """(folder of the ZeRO cases, folder of the DCP cases)."""
    packed = os.environ.get("CKPTFS_DEVICE_FIXTURES")
    if packed:
        return Path(packed) / "zero", Path(packed) / "dcp"
    from ckptfs_fixture_cache import DCP_CHECKPOINTS, ZERO_CHECKPOINTS, cached_fixtures

    return cached_fixtures(ZERO_CHECKPOINTS), cached_fixtures(DCP_CHECKPOINTS)


def make_sources(root: Path) -> dict:
    """{kind: (path, torch reference state dict or None)} for every kind in KINDS, written
    under ROOT where they are written here. The reference is what torch holds for the kinds
    whose keys ckptfs serves unchanged; the others are compared with the View."""
    ck = device_checkpoint()
    pt = root / "ck.pt"
    torch.save(ck, pt)
    model = {k: v.contiguous().clone() for k, v in ck["model"].items() if k != "out.weight"}
    st = root / "model.safetensors"
    save_file(model, st)
    sharded = root / "sharded"
    sharded.mkdir()
    keys = sorted(model)
    shards = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    weight_map = {}
    for i, part in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: model[k] for k in part}, sharded / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    flat = {f"model.{k}": v for k, v in ck["model"].items()}
    zero, dcp = framework_fixtures()
    return {
        "pt": (pt, flat),
        "safetensors": (st, model),
        "sharded": (sharded, model),
        "zero2": (zero / ZERO_FIXTURES[0] / "checkpoint", None),
        "zero3": (zero / ZERO_FIXTURES[1] / "checkpoint", None),
        "dcp": (dcp / DCP_FIXTURE, None),
    }
