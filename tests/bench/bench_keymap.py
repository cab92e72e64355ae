#!/usr/bin/env python3
"""Benchmark (keymap): what a key map (-o map=..., doc/MAPS.md) costs, side by side with the
same source unmapped.

Checkpoints (torch.distributed.checkpoint.save in one process, Megatron-core's key names, a
Megatron-Bridge run_config.yaml beside .metadata giving the model config, so `-o map=auto`
picks the llama map; generated under --workdir, deleted afterwards unless --keep):
  count   a Llama-like GPT saved with per-layer keys (`decoder.layers.{n}.…`, what megatron-core
          writes for non-homogeneous blocks): 6 tensors per layer, 16,667 layers = 100,002
          source tensors of a few hundred bytes, 150,003 served with the map (--quick: 1,667
          layers)
  rate    the same model at hidden 2048, 16 heads in 4 query groups, 8 layers stacked on a
          leading axis as megatron-core saves them by default (fp32, ~0.7 GB; --quick: hidden
          512), and the same saved with per-layer keys

Figures, each the median of --repeats with the alternatives taking turns:
  keymap.mount_ls   `ckptfs SRC MNT -o map=llama` then `ls MNT` and `ls MNT/tensors`, against
                    the same without the map (goal: ratio <= 1.1); split into
  keymap.mount      the mount command alone: reading the catalog, the map, laying out the tree
                    (goal <= 1.1), and
  keymap.ls         the two listings alone (no goal: the mapped tree lists half as many files
                    again, a fused QKV being three tensors and a fused fc1 two)
  keymap.rss        the daemon's peak RSS after mount + ls (goal <= 1.5: what a mount holds per
                    tensor grows with the tree served, 1.5x the tensors, but no second catalog)
  keymap.unstacked  MB/s reading every layer's `mlp.down_proj.weight` file of the stacked save
                    mapped (one index of the stacked fc2), against every layer's
                    `decoder.layers.{i}.mlp.linear_fc2.weight` file of the per-layer save
                    unmapped (goal >= 0.9x)
  keymap.qkv        MB/s reading every layer's q/k/v_proj files (row groups of the stacked fused
                    QKV), against every layer's fused `linear_qkv.weight` file of the per-layer
                    save unmapped (goal >= 0.7x)
Reads are first reads through the mount (its files' pages evicted before each) with the
source in the page cache (one untimed read first): what is measured is the daemon's work per
byte, not the disk's nor the mount's page cache.

    python tests/bench/bench_keymap.py --ckptfs build/ckptfs [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

MOUNT_TIMEOUT_S = 600


def run_config(layers, hidden, heads, groups, head_dim, ffn, vocab) -> str:
    """A Megatron-Bridge run_config.yaml model: section (the fields the llama map reads)."""
    model = {
        "_target_": "megatron.bridge.models.llama.llama_provider.LlamaModelProvider",
        "num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn, "num_attention_heads": heads,
        "num_query_groups": groups, "kv_channels": head_dim, "normalization": "RMSNorm",
        "layernorm_epsilon": 1.0e-05, "gated_linear_unit": True,
        "activation_func": {"_call_": False, "_target_": "torch.nn.functional.silu"},
        "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": False,
        "share_embeddings_and_output_weights": False, "position_embedding_type": "rope",
        "rotary_base": 10000, "rotary_percent": 1.0, "seq_length": 4096, "vocab_size": vocab,
        "should_pad_vocab": False, "make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 1,
        "params_dtype": {"_call_": False, "_target_": "torch.float32"}, "bf16": False, "fp16": False,
    }
    lines = ["_target_: megatron.bridge.training.config.ConfigContainer", "model:"]
    for k, v in sorted(model.items()):
        if isinstance(v, dict):
            lines.append(f"  {k}:")
            lines += [f"    {kk}: {json.dumps(vv) if isinstance(vv, bool) else vv}" for kk, vv in sorted(v.items())]
        else:
            lines.append(f"  {k}: {json.dumps(v) if isinstance(v, (bool, str)) else v}")
    return "\n".join(lines) + "\n"


def generate(out: Path, layers: int, hidden: int, heads: int, groups: int, head_dim: int, ffn: int, vocab: int,
             stacked: bool) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    if (out / ".metadata").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    qkv_rows = (heads + 2 * groups) * head_dim

    def t(*shape):
        return torch.randn(*shape, generator=g)

    per_layer = {
        "self_attention.linear_qkv.layer_norm_weight": (hidden,),
        "self_attention.linear_qkv.weight": (qkv_rows, hidden),
        "self_attention.linear_proj.weight": (hidden, heads * head_dim),
        "mlp.linear_fc1.layer_norm_weight": (hidden,),
        "mlp.linear_fc1.weight": (2 * ffn, hidden),
        "mlp.linear_fc2.weight": (hidden, ffn),
    }
    sd = {"embedding.word_embeddings.weight": t(vocab, hidden), "decoder.final_layernorm.weight": t(hidden),
          "output_layer.weight": t(vocab, hidden)}
    for name, shape in per_layer.items():
        if stacked:
            sd[f"decoder.layers.{name}"] = t(layers, *shape)
        else:
            for i in range(layers):
                sd[f"decoder.layers.{i}.{name}"] = t(*shape)
    dcp.save(sd, checkpoint_id=str(out), no_dist=True)
    (out / "run_config.yaml").write_text(run_config(layers, hidden, heads, groups, head_dim, ffn, vocab))


def mount_ls(binary: Path, src: Path, mnt: Path, args: list[str]) -> tuple[float, float, int]:
    """Seconds to mount (the command returns once the tree is served) and then to list the
    root and tensors/, and the daemon's peak RSS (KiB) after both."""
    started = time.monotonic()
    subprocess.run([str(binary), str(src), str(mnt), *args], check=True, timeout=MOUNT_TIMEOUT_S)
    try:
        mounted = time.monotonic()
        for path in (mnt, mnt / "tensors"):
            subprocess.run(["ls", str(path)], check=True, stdout=subprocess.DEVNULL, timeout=MOUNT_TIMEOUT_S)
        listed = time.monotonic()
        return mounted - started, listed - mounted, max(benchlib.vm_hwm_kib(p) for p in benchlib.daemon_pids(mnt))
    finally:
        benchlib.unmount(mnt)


def read_pieces(pieces: list[tuple[Path, int, int | None]]) -> tuple[float, int]:
    """Seconds and bytes to read each (file, offset, length or None for to the end), one open
    per piece, 1 MiB at a time."""
    started = time.monotonic()
    total = 0
    for path, offset, length in pieces:
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            left = length if length is not None else 1 << 62
            while left > 0 and (chunk := f.read(min(1 << 20, left))):
                total += len(chunk)
                left -= len(chunk)
    return time.monotonic() - started, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_common_args(ap)
    ap.add_argument("--generate-only", action="store_true", help="write the checkpoints and stop")
    args = ap.parse_args()
    found = benchlib.workdir_and_binary(args)
    if found is None:
        return 2
    workdir, binary = found
    repeats = args.repeats or (2 if args.quick else 5)
    layers = 1_667 if args.quick else 16_667
    count = workdir / f"keymap-count-{layers}"
    generate(count, layers, hidden=8, heads=2, groups=1, head_dim=4, ffn=8, vocab=16, stacked=False)
    hidden = 512 if args.quick else 2048
    rate = workdir / f"keymap-rate-{hidden}"
    generate(rate, 8, hidden=hidden, heads=16, groups=4, head_dim=hidden // 16, ffn=hidden, vocab=256, stacked=True)
    per_layer = workdir / f"keymap-rate-layers-{hidden}"
    generate(per_layer, 8, hidden=hidden, heads=16, groups=4, head_dim=hidden // 16, ffn=hidden, vocab=256,
             stacked=False)
    if args.generate_only:
        return 0
    res = benchlib.Results("keymap", args.json_out)
    try:
        measure(binary, workdir, count, rate, per_layer, layers, repeats, res)
    finally:
        if not args.keep:
            for folder in (count, rate, per_layer):
                shutil.rmtree(folder, ignore_errors=True)
    return 0 if all(r["met"] is not False for r in res.rows) else 1


def measure(binary: Path, workdir: Path, count: Path, rate: Path, per_layer: Path, layers: int, repeats: int,
            res) -> None:
    mnt = workdir / "keymap-mnt"
    mnt.mkdir(exist_ok=True)
    # Warm: one untimed mount of each form first.
    mount_ls(binary, count, mnt, [])
    mount_ls(binary, count, mnt, ["-o", "map=llama"])
    plain, mapped = [], []
    for _ in range(repeats):
        plain.append(mount_ls(binary, count, mnt, []))
        mapped.append(mount_ls(binary, count, mnt, ["-o", "map=llama"]))
    served = f"{layers * 6 + 3:,} Megatron tensors ({layers * 9 + 3:,} served with the map)"
    for fig, pick, goal, what, unit in (
            ("keymap.mount_ls", lambda t: t[0] + t[1], 1.1, "mount + ls", "s"),
            ("keymap.mount", lambda t: t[0], 1.1, "mount alone (catalog, map, layout)", "s"),
            ("keymap.ls", lambda t: t[1], None, "ls of the root and tensors/ alone", "s"),
            ("keymap.rss", lambda t: t[2] / 1024, 1.5, "daemon peak RSS after mount + ls", "MiB")):
        p = benchlib.median([pick(t) for t in plain])
        m = benchlib.median([pick(t) for t in mapped])
        res.add(fig, f"{what}, {served}, -o map=llama", m, p, unit, alt_name="no map",
                goal=f"<= {goal}" if goal else "info (1.5x the files listed)",
                met=None if goal is None else m / p <= goal,
                detail={"map": [pick(t) for t in mapped], "none": [pick(t) for t in plain]})

    unmapped_mnt, mapped_mnt = workdir / "keymap-plain", workdir / "keymap-mapped"
    unmapped_mnt.mkdir(exist_ok=True)
    mapped_mnt.mkdir(exist_ok=True)
    subprocess.run([str(binary), str(per_layer), str(unmapped_mnt)], check=True, timeout=MOUNT_TIMEOUT_S)
    try:
        subprocess.run([str(binary), str(rate), str(mapped_mnt), "-o", "map=llama"], check=True,
                       timeout=MOUNT_TIMEOUT_S)
        try:
            # The mapped tensors of the stacked save against the same tensors saved per layer and
            # served unmapped: files of the same sizes and count for the unstacked ones, and for
            # q/k/v three files per layer against the layer's fused QKV file. What differs is the
            # map's route (a layer's byte range of the stacked tensor; row groups gathered).
            def files(root, names):
                return [root / "tensors" / f"{n}.safetensors" for n in names]

            cases = {
                "keymap.unstacked": (files(unmapped_mnt, [f"decoder.layers.{i}.mlp.linear_fc2.weight" for i in range(8)]),
                                     files(mapped_mnt, [f"model.layers.{i}.mlp.down_proj.weight" for i in range(8)]),
                                     0.9, "unstacked down_proj"),
                "keymap.qkv": (files(unmapped_mnt, [f"decoder.layers.{i}.self_attention.linear_qkv.weight"
                                                    for i in range(8)]),
                               files(mapped_mnt, [f"model.layers.{i}.self_attn.{x}_proj.weight"
                                                  for i in range(8) for x in "qkv"]),
                               0.7, "q/k/v_proj row groups"),
            }
            def first_read(pieces):
                for path in {p for p, _, _ in pieces}:
                    benchlib.evict(path)
                return read_pieces(pieces)

            for fig, (src_files, map_files, goal, what) in cases.items():
                src_pieces = [(f, 0, None) for f in src_files]
                map_pieces = [(f, 0, None) for f in map_files]
                read_pieces(src_pieces), read_pieces(map_pieces)  # the source's pages cached
                plain_rates, mapped_rates = [], []
                for _ in range(repeats):
                    s, sn = first_read(src_pieces)
                    t, tn = first_read(map_pieces)
                    plain_rates.append(sn / s / 1e6)
                    mapped_rates.append(tn / t / 1e6)
                p, m = benchlib.median(plain_rates), benchlib.median(mapped_rates)
                res.add(fig, f"first-read rate, {what} ({len(map_files)} files, map of the stacked save) vs the "
                        f"per-layer save unmapped ({len(src_files)} files)", m, p, "MB/s", alt_name="per-layer, no map", goal=f">= {goal}",
                        met=m / p >= goal, detail={"map": mapped_rates, "none": plain_rates})
        finally:
            benchlib.unmount(mapped_mnt)
    finally:
        benchlib.unmount(unmapped_mnt)


if __name__ == "__main__":
    sys.exit(main())
