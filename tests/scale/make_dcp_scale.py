#!/usr/bin/env python3
"""A DCP folder describing 1,000,000 chunks, as a 256-rank FSDP2 save of a ~4,000-parameter
model would: `.metadata` built from torch's own classes and pickled as torch's
FileSystemWriter.finish pickles it (`pickle.dump(metadata, f)`), and 256 `__<rank>_0.distcp`
files holding every chunk where the metadata says.

    python make_dcp_scale.py OUT [--ranks 256] [--layers 444]

No process group: 256 ranks cannot be forked here. What each rank would write is still
torch's own bytes: every chunk is a `torch.save` of a zero tensor of the chunk's shape,
made once per distinct shape by the real torch.save and copied to each offset, except that
its data record is left as a hole, so the files are sparse (the archive's zip records,
about 1.5 KB per chunk, are real bytes; tensor data take no disk space).

FSDP2 shards dimension 0 as torch.chunk does: ceil(rows / ranks) rows per rank, the last
ranks fewer. The model is Llama-shaped (per layer: q, k, v, o, gate, up, down, two norms),
its sizes chosen so that every rank holds a non-empty chunk of every parameter (uneven: 1533 and 1021 rows leave the
last rank fewer).

Writes OUT/.metadata, OUT/__<r>_0.distcp and OUT/expected.json (fqn -> [dtype, shape],
chunk count) for the tests.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import struct
import sys
import time
import zipfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo

# Rows of each parameter (dimension 0, the one FSDP shards); --cols sets the second
# dimension of the matrices. The chunk archives' zip records take ~1.5 KB each whatever the
# shape, and a file system keeps a hole only where whole blocks are zero, so narrow
# matrices (a few rows of --cols elements per chunk) keep the folder small: its size is
# the archives' records, as for a real save, without gigabytes of tensor data.
HIDDEN = 512
INTERMEDIATE = 1533
VOCAB = 1021
KV = 256


def model_shapes(layers: int, cols: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes = [("model.embed_tokens.weight", (VOCAB, cols))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (HIDDEN, cols)),
            (p + "self_attn.k_proj.weight", (KV, cols)),
            (p + "self_attn.v_proj.weight", (KV, cols)),
            (p + "self_attn.o_proj.weight", (HIDDEN, cols)),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, cols)),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, cols)),
            (p + "mlp.down_proj.weight", (HIDDEN, cols)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, cols))]
    return shapes


def shard_rows(rows: int, ranks: int) -> list[tuple[int, int]]:
    """(first row, row count) of each rank's dim-0 shard, as torch.chunk splits."""
    per = -(-rows // ranks)
    out = []
    for r in range(ranks):
        first = min(r * per, rows)
        out.append((first, min(per, rows - first)))
    return out


class ChunkTemplate:
    """torch.save's bytes for a zero tensor of one shape, split around its data record."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        buf = io.BytesIO()
        torch.save(torch.zeros(shape, dtype=dtype), buf)
        raw = buf.getvalue()
        zf = zipfile.ZipFile(io.BytesIO(raw))
        info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
        name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
        start = info.header_offset + 30 + name_len + extra_len
        end = start + info.file_size
        assert raw[start:end] == bytes(info.file_size)
        self.prefix, self.hole, self.suffix = raw[:start], info.file_size, raw[end:]
        self.length = len(raw)


def build(out: Path, ranks: int, layers: int, cols: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.float32
    shapes = model_shapes(layers, cols)
    templates: dict[tuple[int, ...], ChunkTemplate] = {}
    state_dict_metadata = {}
    storage_data = {}
    planner_data = {}
    chunks_total = 0
    # Per rank, the chunks in the order the rank writes them (its state dict order).
    per_rank: list[list[tuple[ChunkTemplate, str, tuple]]] = [[] for _ in range(ranks)]
    for fqn, shape in shapes:
        chunks = []
        for r, (first, count) in enumerate(shard_rows(shape[0], ranks)):
            assert count > 0, (fqn, r)
            sizes = (count,) + shape[1:]
            offsets = (first,) + (0,) * (len(shape) - 1)
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            if sizes not in templates:
                templates[sizes] = ChunkTemplate(sizes, dtype)
            per_rank[r].append((templates[sizes], fqn, offsets))
        chunks_total += len(chunks)
        strides = tuple(int(s) for s in torch.empty(0).new_empty(shape).stride()) if shape else ()
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype, strides=strides),
            size=torch.Size(shape),
            chunks=chunks,
        )
        planner_data[fqn] = tuple(fqn.split(".", 1)) if "." in fqn else (fqn,)

    for r in range(ranks):
        relative_path = f"__{r}_0.distcp"
        with open(out / relative_path, "wb") as f:
            offset = 0
            for template, fqn, offsets in per_rank[r]:
                f.write(template.prefix)
                f.seek(template.hole, os.SEEK_CUR)
                f.write(template.suffix)
                storage_data[MetadataIndex(fqn=fqn, offset=torch.Size(offsets), index=0)] = _StorageInfo(
                    relative_path=relative_path, offset=offset, length=template.length)
                offset += template.length
            f.truncate(offset)

    metadata = Metadata(state_dict_metadata=state_dict_metadata, planner_data=planner_data,
                        storage_data=storage_data,
                        storage_meta=StorageMeta(checkpoint_id=str(out), save_id="scale-fixture"),
                        version="1.0.0")
    with open(out / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    expected = {"chunks": chunks_total, "ranks": ranks,
                "tensors": {fqn: ["F32", list(shape)] for fqn, shape in shapes}}
    (out / "expected.json").write_text(json.dumps(expected))
    return expected


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--layers", type=int, default=444, help="444 layers: 3,999 parameters")
    ap.add_argument("--cols", type=int, default=8, help="second dimension of the matrices")
    args = ap.parse_args()
    t0 = time.perf_counter()
    expected = build(args.out, args.ranks, args.layers, args.cols)
    print(f"{len(expected['tensors'])} tensors, {expected['chunks']} chunks, {args.ranks} ranks "
          f"in {time.perf_counter() - t0:.1f} s; .metadata {os.path.getsize(args.out / '.metadata')} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
