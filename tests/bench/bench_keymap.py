#!/usr/bin/env python3
"""Benchmark (keymap): what a key map (-o map=..., doc/MAPS.md) costs, side by side with the
same source unmapped.

Checkpoints (torch.distributed.checkpoint.save in one process, Megatron-core's key names, a
Megatron-Bridge run_config.yaml beside .metadata giving the model config, so `-o map=auto`
picks the llama map; generated under --workdir):
  count   a Llama-like GPT saved with per-layer keys (`decoder.layers.{n}.…`, what megatron-core
          writes for non-homogeneous blocks): 6 tensors per layer, 16,667 layers = 100,002
          source tensors of a few hundred bytes, 150,003 served with the map (--quick: 1,667
          layers)
  rate    the same model at hidden 2048, 16 heads in 4 query groups, 8 layers stacked on a
          leading axis as megatron-core saves them by default (fp32, ~0.9 GB; --quick: hidden
          512)

Figures, each the median of --repeats with the alternatives taking turns:
  keymap.mount_ls   `ckptfs SRC MNT -o map=llama` then `ls MNT` and `ls MNT/tensors`, against
                    the same without the map (goal: no measurable difference, ratio <= 1.1)
  keymap.unstacked  MB/s reading every layer's `mlp.down_proj.weight` file of the mapped mount
                    (one index of the stacked fc2), against reading the stacked
                    `decoder.layers.mlp.linear_fc2.weight` file unmapped (goal >= 0.9x)
  keymap.qkv        MB/s reading every layer's q/k/v_proj files (row groups of the fused QKV),
                    against the stacked `linear_qkv.weight` file unmapped (goal >= 0.7x)
Reads go through the mount with the source in the page cache (one untimed read first): what
is measured is the daemon's work per byte, not the disk's.

    python tests/bench/bench_keymap.py --ckptfs build/ckptfs [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
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


def mount_ls(binary: Path, src: Path, mnt: Path, args: list[str]) -> float:
    started = time.monotonic()
    subprocess.run([str(binary), str(src), str(mnt), *args], check=True, timeout=MOUNT_TIMEOUT_S)
    try:
        for path in (mnt, mnt / "tensors"):
            subprocess.run(["ls", str(path)], check=True, stdout=subprocess.DEVNULL, timeout=MOUNT_TIMEOUT_S)
        return time.monotonic() - started
    finally:
        benchlib.unmount(mnt)


def read_files(paths: list[Path]) -> tuple[float, int]:
    started = time.monotonic()
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
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
    if args.generate_only:
        return 0
    results = []

    mnt = workdir / "keymap-mnt"
    mnt.mkdir(exist_ok=True)
    # Warm: one untimed mount of each form first.
    mount_ls(binary, count, mnt, [])
    mount_ls(binary, count, mnt, ["-o", "map=llama"])
    plain, mapped = [], []
    for _ in range(repeats):
        plain.append(mount_ls(binary, count, mnt, []))
        mapped.append(mount_ls(binary, count, mnt, ["-o", "map=llama"]))
    p, m = benchlib.median(plain), benchlib.median(mapped)
    results.append(dict(id="keymap.mount_ls", text=f"mount + ls, {layers * 6 + 3:,} Megatron tensors: -o map=llama "
                        "vs no map", ckptfs=m, alternative=p, unit="s", ratio=m / p, goal="<= 1.1",
                        met="yes" if m / p <= 1.1 else "no", samples={"map": mapped, "none": plain}))

    unmapped_mnt, mapped_mnt = workdir / "keymap-plain", workdir / "keymap-mapped"
    unmapped_mnt.mkdir(exist_ok=True)
    mapped_mnt.mkdir(exist_ok=True)
    subprocess.run([str(binary), str(rate), str(unmapped_mnt)], check=True, timeout=MOUNT_TIMEOUT_S)
    try:
        subprocess.run([str(binary), str(rate), str(mapped_mnt), "-o", "map=llama"], check=True,
                       timeout=MOUNT_TIMEOUT_S)
        try:
            def files(root, names):
                return [root / "tensors" / f"{n}.safetensors" for n in names]

            cases = {
                "keymap.unstacked": (files(unmapped_mnt, ["decoder.layers.mlp.linear_fc2.weight"]),
                                     files(mapped_mnt, [f"model.layers.{i}.mlp.down_proj.weight" for i in range(8)]),
                                     0.9),
                "keymap.qkv": (files(unmapped_mnt, ["decoder.layers.self_attention.linear_qkv.weight"]),
                               files(mapped_mnt, [f"model.layers.{i}.self_attn.{x}_proj.weight"
                                                  for i in range(8) for x in "qkv"]), 0.7),
            }
            for fig, (src_files, map_files, goal) in cases.items():
                read_files(src_files), read_files(map_files)  # warm the source's pages
                plain, mapped = [], []
                for _ in range(repeats):
                    s, sn = read_files(src_files)
                    t, tn = read_files(map_files)
                    plain.append(sn / s / 1e6)
                    mapped.append(tn / t / 1e6)
                p, m = benchlib.median(plain), benchlib.median(mapped)
                what = "unstacked down_proj" if fig == "keymap.unstacked" else "q/k/v_proj row groups"
                results.append(dict(id=fig, text=f"read rate, {what} (map) vs the stacked source tensor (no map), warm",
                                    ckptfs=m, alternative=p, unit="MB/s", ratio=m / p, goal=f">= {goal}",
                                    met="yes" if m / p >= goal else "no", samples={"map": mapped, "none": plain}))
        finally:
            benchlib.unmount(mapped_mnt)
    finally:
        benchlib.unmount(unmapped_mnt)

    stamp = benchlib.provenance()
    for r in results:
        r.update(stamp)
        print(f"{r['id']:18} {r['text']}: {benchlib.fmt_value(r['ckptfs'], r['unit'])} vs "
              f"{benchlib.fmt_value(r['alternative'], r['unit'])}, ratio {r['ratio']:.2f} (goal {r['goal']}: {r['met']})")
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(json.dumps(r) + "\n")
    return 0 if all(r["met"] == "yes" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
