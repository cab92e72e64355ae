"""Regenerates tests/data/dcp-sample/ and tests/data/dcp-sharded/, small
torch.distributed.checkpoint (DCP) folders for the DCP reader's unit tests.

dcp-sample/ is written by torch.distributed.checkpoint.save itself (world size 1, no
process group): a nested state dict with tensors of several dtypes, a non-contiguous
tensor and non-tensor values (ints, a float, a string, a list, a nested dict).

dcp-sharded/ is what a two-rank save of sharded tensors looks like: each chunk is written
with torch.save into one of two rank files and the .metadata is pickled from DCP's own
Metadata classes, so the files have the real layout without needing a process group.
It has a tensor split along dim 0 (served as extents), one split along dim 1 (gathered),
and one replicated on both ranks (served once).

Run with the test venv's python: python tests/data/make_dcp_sample.py
"""

import io
import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

HERE = Path(__file__).resolve().parent


def sample_state_dict() -> dict:
    # Values are arange-based so the unit test can recompute every byte.
    return {
        "model": {
            "layers": {
                "0": {
                    "weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                    "bias": torch.arange(3, dtype=torch.bfloat16),
                },
            },
            # A transposed view: torch.save keeps its strides.
            "head": torch.arange(6, dtype=torch.int64).reshape(2, 3).t(),
        },
        "optim": {
            "state": {"model.layers.0.weight": {"step": torch.tensor(7.0)}},
            "param_groups": [{"lr": 0.5, "params": ["model.layers.0.weight"]}],
        },
        "step": 5,
        "name": "sample",
    }


def write_sample(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    # A relative checkpoint_id, so .metadata records no path of the machine that wrote it.
    os.chdir(out.parent)
    dcp.save(sample_state_dict(), checkpoint_id=out.name, no_dist=True)


def torch_save_bytes(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def write_sharded(out: Path, variants: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rows = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    cols = torch.arange(2 * 6, dtype=torch.int32).reshape(2, 6)
    replicated = torch.arange(5, dtype=torch.float16)
    # fqn -> full tensor and its chunks as (rank, offsets, sizes).
    plan = {
        "rows": (rows, [(0, (0, 0), (5, 3)), (1, (5, 0), (3, 3))]),
        "cols": (cols, [(0, (0, 0), (2, 4)), (1, (0, 4), (2, 2))]),
        "replicated": (replicated, [(0, (0,), (5,)), (1, (0,), (5,))]),
    }
    files = {0: bytearray(), 1: bytearray()}
    state_dict_metadata, storage_data = {}, {}
    for fqn, (full, chunks) in plan.items():
        metas = []
        for rank, offsets, sizes in chunks:
            piece = full
            for dim, (o, s) in enumerate(zip(offsets, sizes)):
                piece = piece.narrow(dim, o, s)
            data = torch_save_bytes(piece.clone())
            path = f"__{rank}_0.distcp"
            storage_data[MetadataIndex(fqn, offsets)] = _StorageInfo(path, len(files[rank]), len(data))
            files[rank] += data
            metas.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        props = TensorProperties.create_from_tensor(full)
        state_dict_metadata[fqn] = TensorStorageMetadata(props, full.size(), metas)
    for rank, data in files.items():
        (out / f"__{rank}_0.distcp").write_bytes(bytes(data))

    def dump(path: Path, sdm: dict, sd: dict) -> None:
        metadata = Metadata(
            state_dict_metadata=sdm,
            planner_data={fqn: (fqn,) for fqn in sdm},
            storage_data=sd,
            version="1.0.0",
        )
        with open(path, "wb") as f:
            pickle.dump(metadata, f)

    dump(out / ".metadata", state_dict_metadata, storage_data)

    # Broken .metadata files for the sharded folder, each with one fault the reader must
    # name (the unit tests put them in place of .metadata).
    shutil.rmtree(variants, ignore_errors=True)
    variants.mkdir(parents=True)
    rows_index = MetadataIndex("rows", (5, 0))
    rows_info = storage_data[rows_index]

    def with_rows_storage(info: _StorageInfo) -> dict:
        return {**storage_data, rows_index: info}

    dump(variants / "transformed.metadata", state_dict_metadata,
         with_rows_storage(_StorageInfo(rows_info.relative_path, rows_info.offset, rows_info.length, ["zstd"])))
    dump(variants / "escaping.metadata", state_dict_metadata,
         with_rows_storage(_StorageInfo("../__1_0.distcp", rows_info.offset, rows_info.length)))
    dump(variants / "outside.metadata", state_dict_metadata,
         with_rows_storage(_StorageInfo(rows_info.relative_path, rows_info.offset, 1 << 20)))
    dump(variants / "no-storage.metadata", state_dict_metadata,
         {k: v for k, v in storage_data.items() if k != rows_index})
    wrong_dtype = dict(state_dict_metadata)
    wrong_dtype["rows"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float64), rows.size(), state_dict_metadata["rows"].chunks)
    dump(variants / "wrong-dtype.metadata", wrong_dtype, storage_data)
    hole = dict(state_dict_metadata)
    hole["cols"] = TensorStorageMetadata(
        state_dict_metadata["cols"].properties, cols.size(), state_dict_metadata["cols"].chunks[:1])
    dump(variants / "hole.metadata", hole, storage_data)


if __name__ == "__main__":
    write_sample(HERE / "dcp-sample")
    write_sharded(HERE / "dcp-sharded", HERE / "dcp-variants")
