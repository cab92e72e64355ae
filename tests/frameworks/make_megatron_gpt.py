#!/usr/bin/env python3
"""Megatron GPT checkpoints written by megatron-core itself (tests/requirements-megatron16.txt:
megatron-core 0.16.1, mbridge 0.15.1) on the CPU with gloo, from tiny Hugging Face models: the
round trip HF -> Megatron -> (ckptfs with a key map) -> HF, for tests/frameworks.

    python make_megatron_gpt.py OUT        (run by the overlay's python)

For each case a tiny random Hugging Face model (transformers of the base environment) is built
and kept as the reference: its state dict, config.json and its logits on fixed input ids. The
matching megatron-core GPTModel (local layer spec: Transformer Engine needs CUDA; MoE layers
with SequentialMLP experts and the allgather token dispatcher, which run without CUDA) is built
in TP x PP gloo ranks, its parameters are loaded from the HF weights with the conversion rules
below (ours), its forward logits are checked against the HF logits (proof that the rules are
the models' own correspondence), and megatron-core's dist_checkpointing.save writes its
sharded_state_dict() (torch_dist: DCP underneath) in the layouts of the frameworks that train
with it. Then, in this process, the saved DCP is read back with torch.distributed.checkpoint
and converted to HF twice, by our rules inverted and by mbridge's own Megatron -> HF functions
(`Bridge._weight_to_hf_format`, pure torch), and both must equal the HF state dict bit for bit:
the reference a key map must reproduce is the HF model the weights came from.

Conversion rules (HF Llama/Qwen2/Qwen3/Mixtral/Qwen3-MoE -> Megatron, per layer; P = heads per query group,
D = head dim): linear_qkv rows, for each query group g: its P query heads' rows of q_proj,
then key head g's rows of k_proj, then value head g's rows of v_proj (biases alike);
linear_fc1 = [gate_proj; up_proj] along rows; layer norms go into the fused linears'
`layer_norm_weight` (the local spec's input_layernorm / pre_mlp_layernorm, which
megatron-core saves under those names); embedding and output layer padded with rows to
Megatron's padded vocabulary (random rows, so that a map that forgets to cut them is seen).
Mixture-of-experts layers (Mixtral `block_sparse_moe.*`, Qwen3-MoE `mlp.*`): the router is the
HF gate as is; expert e's linear_fc1 = [gate (w1); up (w3)], its linear_fc2 = down (w2), under
the local spec's SequentialMLP (`mlp.experts.local_experts.{e}`), which megatron-core saves
stacked per layer and per expert (`mlp.experts.experts.linear_fc1.weight` [L, E, 2F, H]).
Tensor-parallel shards: column-parallel weights (qkv, fc1, embedding, output layer) split
rows, row-parallel ones (linear_proj, fc2) columns; fc1's local shard is [gate_r; up_r]
(each expert's too: experts are split over the expert tensor-parallel group, of the TP size).
Expert parallel EP (the Mixtral case: EP2, so 4 ranks, the dense layers replicated on 2
data-parallel ranks): rank r of the expert group holds experts [r * E / EP, (r + 1) * E / EP)
as its local_experts.{0..}.

Layouts, each under OUT/<case>/ (SOURCE given to ckptfs in the tests):
    megatron_lm/                    Megatron-LM's run folder: latest_checkpointed_iteration.txt,
                                    iter_0000001/ (common.pt holds `args`, an argparse.Namespace
                                    with Megatron-LM's argument names, and the iteration, as
                                    Megatron-LM's training loop saves them)
    bridge/                         Megatron-Bridge's save folder: iter_0000001/ with
                                    run_config.yaml (the ConfigContainer as Bridge's to_yaml
                                    renders it: model: is the provider with every field),
                                    train_state.pt; latest_train_state.pt and
                                    latest_checkpointed_iteration.txt beside it
    nemo2/<name>/                   a NeMo 2 checkpoint: weights/ (keys prefixed `module.`, as
                                    NeMo's MegatronParallel wraps the model) and context/model.yaml
                                    (the model's config with defaults, NeMo's io_dump rendering)
    nemo_rl/step_1/                 a NeMo-RL Megatron-backend step: config.yaml,
                                    training_info.json, policy/weights/ (a Bridge save of
                                    iteration 0: iter_0000000/ with run_config.yaml)
    reference/model.safetensors     the HF model's state dict (save_pretrained: a tied lm_head
                                    is not stored), reference/config.json
    reference/logits.safetensors    input_ids and the HF model's logits (eager attention, fp32)
    fixture.json                    the case, the Megatron-vs-HF logits difference, the
                                    cross-checks, the DCP keys and shapes, versions
Variants (OUT/variants/): llama_wrong_groups/ is the llama case's Megatron-LM run folder whose
common.pt args say num_query_groups=1 (the weights have 2 groups): a map must refuse it.

Only megatron-core writes the DCP folders and common.pt. Written by this script from the
frameworks' sources (neither NeMo nor Megatron-Bridge runs here: both need Transformer Engine
and GPUs): run_config.yaml, context/model.yaml (their renderers' rules applied to megatron-core's
real TransformerConfig of the model, plus the provider's own fields), train_state.pt, NeMo-RL's
config.yaml and training_info.json, and the common state NeMo's Lightning checkpoint adds.
"""

import argparse
import contextlib
import dataclasses
import enum
import functools
import inspect
import json
import os
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for ckptfs_ranks
from ckptfs_ranks import run_ranks_per_world_size  # noqa: E402

LAYERS, HIDDEN, HEADS, GROUPS, FFN = 4, 64, 4, 2, 96
VOCAB = 200  # Megatron pads it to a multiple of 128 * TP: 256 rows stored
SEQ = 8
ITERATION = 1
# name -> the model: HF family, parallelism, head dim, tied output, QKV biases, q/k norms
CASES = {
    "llama": dict(family="llama", tp=2, pp=1, head_dim=16, tied=False, qkv_bias=False, qk_norm=False),
    "llama_tied_pp2": dict(family="llama", tp=2, pp=2, head_dim=16, tied=True, qkv_bias=False, qk_norm=False),
    "qwen2": dict(family="qwen2", tp=2, pp=1, head_dim=16, tied=False, qkv_bias=True, qk_norm=False),
    # head_dim 24 != hidden / heads: a config that forgets head_dim loads the wrong shapes
    "qwen3": dict(family="qwen3", tp=2, pp=1, head_dim=24, tied=False, qkv_bias=False, qk_norm=True),
    # Mixture of experts (SequentialMLP experts, the allgather dispatcher: what runs on the CPU),
    # Mixtral's experts also expert-parallel (EP2: 4 ranks).
    # Mixtral renormalizes the top-k routing weights (Megatron: softmax over the top-k logits);
    # the Qwen3-MoE case takes the other routing, the top k of the full softmax
    # (moe_router_pre_softmax, HF norm_topk_prob false), so both are checked by the logits.
    "mixtral": dict(family="mixtral", tp=2, pp=1, ep=2, head_dim=16, tied=False, qkv_bias=False, qk_norm=False,
                    experts=4, topk=2, moe_ffn=32, pre_softmax=False),
    "qwen3_moe": dict(family="qwen3_moe", tp=2, pp=1, head_dim=24, tied=False, qkv_bias=False, qk_norm=True,
                      experts=4, topk=2, moe_ffn=32, pre_softmax=True),
}
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
# What the frameworks call each family's model (their config classes).
BRIDGE_PROVIDERS = {"llama": "megatron.bridge.models.llama.llama_provider.LlamaModelProvider",
                    "qwen2": "megatron.bridge.models.qwen.qwen_provider.Qwen2ModelProvider",
                    "qwen3": "megatron.bridge.models.qwen.qwen_provider.Qwen3ModelProvider",
                    "mixtral": "megatron.bridge.models.mixtral.mixtral_provider.MixtralModelProvider",
                    "qwen3_moe": "megatron.bridge.models.qwen.qwen_provider.Qwen3MoEModelProvider"}
NEMO_MODELS = {"llama": ("nemo.collections.llm.gpt.model.llama.LlamaModel", "nemo.collections.llm.gpt.model.llama.LlamaConfig"),
               "qwen2": ("nemo.collections.llm.gpt.model.qwen2.Qwen2Model", "nemo.collections.llm.gpt.model.qwen2.Qwen2Config"),
               "qwen3": ("nemo.collections.llm.gpt.model.qwen3.Qwen3Model", "nemo.collections.llm.gpt.model.qwen3.Qwen3Config"),
               "mixtral": ("nemo.collections.llm.gpt.model.mixtral.MixtralModel",
                           "nemo.collections.llm.gpt.model.mixtral.MixtralConfig"),
               "qwen3_moe": ("nemo.collections.llm.gpt.model.qwen3.Qwen3Model",
                             "nemo.collections.llm.gpt.model.qwen3.Qwen3MoEConfig")}
NEMO_NAME = "megatron_gpt--reduced_train_loss=5.5400-epoch=0-consumed_samples=8.0"
HF_MODELS = {}  # case -> (hf state dict, hf config), built before the ranks fork


def world_size(c):
    """Ranks of a case: expert parallelism spans data-parallel replicas of the dense layers."""
    return c["tp"] * c["pp"] * c.get("ep", 1)


def padded_vocab(tp):
    multiple = 128 * tp
    return -(-VOCAB // multiple) * multiple


def cpu_only():
    """What megatron-core needs to run without CUDA (its save path syncs and asks the current
    device; a tied output layer on the last pipeline stage is moved with .cuda(); the MoE
    router's gating looks for Transformer Engine's GEMM)."""
    import torch

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    # The MoE router's gating tests a name that megatron-core 0.16 binds only when Transformer
    # Engine imports; unset, torch's own matmul runs.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_hf(name):
    import torch
    import transformers

    c = CASES[name]
    conf_cls, model_cls = HF_CLASSES[c["family"]]
    moe = {}
    if c["family"] == "mixtral":  # its intermediate_size is each expert's
        moe = dict(intermediate_size=c["moe_ffn"], num_local_experts=c["experts"], num_experts_per_tok=c["topk"])
    elif c["family"] == "qwen3_moe":
        moe = dict(moe_intermediate_size=c["moe_ffn"], num_experts=c["experts"], num_experts_per_tok=c["topk"],
                   norm_topk_prob=not c["pre_softmax"], decoder_sparse_step=1, mlp_only_layers=[])
    config = getattr(transformers, conf_cls)(**{**dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=c["head_dim"], rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=c["tied"], hidden_act="silu",
        torch_dtype="float32"), **moe})
    config._attn_implementation = "eager"
    torch.manual_seed(zlib.crc32(name.encode()))
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{pname}".encode()))
            r = torch.randn(p.shape, generator=g) * 0.2
            p.copy_(1.0 + r if "norm" in pname else r)
    return model


def to_megatron(hf, c, tp):
    """HF state dict -> {megatron name with {i} for the layer: full tensor per global layer}."""
    import torch

    D, P = c["head_dim"], HEADS // GROUPS
    vp = padded_vocab(tp)
    g = torch.Generator().manual_seed(7)
    pad = torch.randn(vp - VOCAB, HIDDEN, generator=g)
    out = {"embedding.word_embeddings.weight": torch.cat([hf["model.embed_tokens.weight"], pad]),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not c["tied"]:
        out["output_layer.weight"] = torch.cat([hf["lm_head.weight"], pad * 0.5])
    for i in range(LAYERS):
        h = f"model.layers.{i}."
        m = f"decoder.layers.{i}."

        def fused(suffix):
            q, k, v = (hf[h + f"self_attn.{x}_proj.{suffix}"] for x in "qkv")
            parts = []
            for grp in range(GROUPS):
                parts += [q[grp * P * D:(grp + 1) * P * D], k[grp * D:(grp + 1) * D], v[grp * D:(grp + 1) * D]]
            return torch.cat(parts)

        out[m + "self_attention.linear_qkv.weight"] = fused("weight")
        if c["qkv_bias"]:
            out[m + "self_attention.linear_qkv.bias"] = fused("bias")
        if c["qk_norm"]:
            out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        if "experts" in c:
            for e in range(c["experts"]):
                gate, up, down = (hf[h + name.format(e=e)] for name in expert_keys(c))
                out[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat([gate, up])
                out[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = down
            out[m + "mlp.router.weight"] = hf[h + router_key(c)]
            continue
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    return out


def expert_keys(c):
    """An MoE layer's HF keys (under model.layers.{i}.) of expert {e}'s gate, up and down
    projections, as save_pretrained writes them (transformers 5 fuses them in memory only)."""
    if c["family"] == "mixtral":
        return tuple("block_sparse_moe.experts.{e}.%s.weight" % w for w in ("w1", "w3", "w2"))
    return tuple("mlp.experts.{e}.%s_proj.weight" % w for w in ("gate", "up", "down"))


def router_key(c):
    return "block_sparse_moe.gate.weight" if c["family"] == "mixtral" else "mlp.gate.weight"


def to_hf(mg, c):
    """Megatron full tensors as saved in DCP (layers stacked on dim 0) -> HF state dict: the
    rules of to_megatron inverted, as plain tensor indexing."""
    D, P = c["head_dim"], HEADS // GROUPS
    hf = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][:VOCAB],
          "model.norm.weight": mg["decoder.final_layernorm.weight"]}
    if not c["tied"]:
        hf["lm_head.weight"] = mg["output_layer.weight"][:VOCAB]
    for i in range(LAYERS):
        h = f"model.layers.{i}."
        s = "decoder.layers."

        def split(t):
            t = t.reshape(GROUPS, (P + 2) * D, *t.shape[1:])
            return (t[:, :P * D].reshape(-1, *t.shape[2:]), t[:, P * D:(P + 1) * D].reshape(-1, *t.shape[2:]),
                    t[:, (P + 1) * D:].reshape(-1, *t.shape[2:]))

        for x, t in zip("qkv", split(mg[s + "self_attention.linear_qkv.weight"][i])):
            hf[h + f"self_attn.{x}_proj.weight"] = t
        if c["qkv_bias"]:
            for x, t in zip("qkv", split(mg[s + "self_attention.linear_qkv.bias"][i])):
                hf[h + f"self_attn.{x}_proj.bias"] = t
        if c["qk_norm"]:
            hf[h + "self_attn.q_norm.weight"] = mg[s + "self_attention.q_layernorm.weight"][i]
            hf[h + "self_attn.k_norm.weight"] = mg[s + "self_attention.k_layernorm.weight"][i]
        hf[h + "self_attn.o_proj.weight"] = mg[s + "self_attention.linear_proj.weight"][i]
        hf[h + "input_layernorm.weight"] = mg[s + "self_attention.linear_qkv.layer_norm_weight"][i]
        hf[h + "post_attention_layernorm.weight"] = mg[s + "mlp.linear_fc1.layer_norm_weight"][i]
        if "experts" in c:
            F = c["moe_ffn"]
            fc1, fc2 = (mg[s + f"mlp.experts.experts.linear_fc{n}.weight"][i] for n in (1, 2))
            for e in range(c["experts"]):
                for name, t in zip(expert_keys(c), (fc1[e][:F], fc1[e][F:], fc2[e])):
                    hf[h + name.format(e=e)] = t
            hf[h + router_key(c)] = mg[s + "mlp.router.weight"][i]
            continue
        fc1 = mg[s + "mlp.linear_fc1.weight"][i]
        hf[h + "mlp.gate_proj.weight"] = fc1[:FFN]
        hf[h + "mlp.up_proj.weight"] = fc1[FFN:]
        hf[h + "mlp.down_proj.weight"] = mg[s + "mlp.linear_fc2.weight"][i]
    return hf


def transformer_config(c):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
        ffn_hidden_size=FFN, kv_channels=c["head_dim"], use_cpu_initialization=True, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, layernorm_epsilon=1e-6,
        add_qkv_bias=c["qkv_bias"], qk_layernorm=c["qk_norm"], hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=c["tp"], pipeline_model_parallel_size=c["pp"],
        expert_model_parallel_size=c.get("ep", 1), **moe_config(c))


def moe_config(c):
    """TransformerConfig's MoE fields: SequentialMLP experts (grouped GEMM needs CUDA) and the
    allgather dispatcher (alltoall makes a CUDA stream)."""
    if "experts" not in c:
        return {}
    return dict(num_moe_experts=c["experts"], moe_router_topk=c["topk"], moe_ffn_hidden_size=c["moe_ffn"],
                moe_router_pre_softmax=c["pre_softmax"], moe_token_dispatcher_type="allgather",
                moe_grouped_gemm=False, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)


def megatron_lm_args(c, config, **changes):
    """The argparse.Namespace Megatron-LM's training keeps in common.pt (its argument names)."""
    import torch

    args = dict(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=GROUPS, kv_channels=c["head_dim"],
        max_position_embeddings=64, seq_length=64, position_embedding_type="rope", rotary_base=10000,
        rotary_percent=1.0, rotary_interleaved=False, use_rope_scaling=False, rope_scaling_factor=8.0,
        normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, add_bias_linear=False,
        add_qkv_bias=c["qkv_bias"], qk_layernorm=c["qk_norm"],
        untie_embeddings_and_output_weights=not c["tied"], vocab_size=VOCAB,
        padded_vocab_size=padded_vocab(c["tp"]), make_vocab_size_divisible_by=128,
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model="tiny-" + c["family"],
        transformer_impl="local", apply_layernorm_1p=False, num_experts=c.get("experts"), moe_router_topk=c.get("topk", 2),
        moe_ffn_hidden_size=c.get("moe_ffn"), moe_router_pre_softmax=c.get("pre_softmax", False),
        moe_router_score_function="softmax", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01 if "experts" in c else 0.0, moe_router_topk_scaling_factor=None,
        moe_router_enable_expert_bias=False, moe_router_num_groups=None, moe_router_group_topk=None,
        moe_shared_expert_intermediate_size=None, moe_layer_freq=1, moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather", expert_model_parallel_size=c.get("ep", 1),
        expert_tensor_parallel_size=c["tp"], init_method_std=0.02, attention_dropout=0.0, hidden_dropout=0.0,
        params_dtype=torch.float32, bf16=False, fp16=False,
        tensor_model_parallel_size=c["tp"], pipeline_model_parallel_size=c["pp"],
        ckpt_format="torch_dist", use_dist_ckpt=True, iteration=ITERATION, train_iters=ITERATION,
        micro_batch_size=1, global_batch_size=8, lr=1e-4, seed=1234, save="checkpoints",
        world_size=world_size(c), data_parallel_size=world_size(c) // (c["tp"] * c["pp"]))
    args.update(changes)
    return argparse.Namespace(**args)


def yaml_value(value, style):
    """A Python value rendered the way Megatron-Bridge's (style "bridge") or NeMo's ("nemo")
    YAML representers render it: dataclasses as mappings with `_target_`, functions and
    classes as {_target_, _call_: false}, enums (Bridge) with `_args_`, dtypes by name (Bridge;
    NeMo's fallback renders the dtype's class)."""
    import torch

    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [yaml_value(v, style) for v in value]
    if isinstance(value, dict):
        return {str(k): yaml_value(v, style) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return {"_target_": str(value), "_call_": False} if style == "bridge" else {"_target_": "torch.dtype", "_call_": True}
    if isinstance(value, enum.Enum):
        cls = type(value)
        target = f"{cls.__module__}.{cls.__qualname__}"
        return {"_target_": target, "_call_": True, "_args_": [yaml_value(value.value, style)]} if style == "bridge" \
            else {"_target_": target, "_call_": True}
    if isinstance(value, functools.partial):
        f = value.func
        out = {"_target_": f"{inspect.getmodule(f).__name__}.{f.__qualname__}", "_partial_": True,
               "_args_": [yaml_value(a, style) for a in value.args]}
        out.update({k: yaml_value(v, style) for k, v in value.keywords.items()})
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclass_yaml(value, f"{type(value).__module__}.{type(value).__qualname__}", style)
    module = inspect.getmodule(value)
    if hasattr(value, "__qualname__") and module is not None:
        return {"_target_": f"{module.__name__}.{value.__qualname__}", "_call_": False}
    cls = type(value)
    return {"_target_": f"{inspect.getmodule(cls).__name__}.{cls.__qualname__}", "_call_": True}


def dataclass_yaml(obj, target, style, extra=None):
    out = {"_target_": target} if style == "bridge" else {}
    for f in dataclasses.fields(obj):
        if f.name.startswith("_"):
            continue
        out[f.name] = yaml_value(getattr(obj, f.name), style)
    out.update(extra or {})
    if style == "nemo":
        out["_target_"] = target  # NeMo's io_dump sets it after the arguments
    return out


def provider_fields(c, style):
    """The fields a Bridge GPTModelProvider / NeMo GPTConfig adds to TransformerConfig (their
    names; values of this model)."""
    import torch.nn.functional as F

    fields = dict(
        fp16_lm_cross_entropy=False, parallel_output=True, share_embeddings_and_output_weights=c["tied"],
        make_vocab_size_divisible_by=128, position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
        seq_len_interpolation_factor=None, seq_length=64, attention_softmax_in_fp32=False,
        masked_softmax_fusion=True, cross_entropy_loss_fusion=True, gradient_accumulation_fusion=False,
        vocab_size=VOCAB, should_pad_vocab=True, hf_model_id=None, scatter_embedding_sequence_parallel=True,
        tp_comm_overlap_cfg=None, use_transformer_engine_full_layer_spec=False, rope_scaling=False,
        rope_scaling_factor=8.0)
    if style == "bridge":
        fields["generation_config"] = None
    else:
        # NeMo builds the model with a set vocab_size as it is: the padded rows.
        fields["vocab_size"] = padded_vocab(c["tp"])
        for bridge_only in ("should_pad_vocab", "hf_model_id"):
            del fields[bridge_only]
        fields["transformer_layer_spec"] = {"_target_": "nemo.collections.llm.gpt.model.base.default_layer_spec",
                                            "_call_": False}
        fields["forward_step_fn"] = {"_target_": "nemo.collections.llm.gpt.model.base.gpt_forward_step", "_call_": False}
        fields["data_step_fn"] = {"_target_": "nemo.collections.llm.gpt.model.base.gpt_data_step", "_call_": False}
        fields["activation_func"] = yaml_value(F.silu, style)
    return fields


def bridge_run_config(c, config, save_dir):
    import yaml

    model = dataclass_yaml(config, BRIDGE_PROVIDERS[c["family"]], "bridge", provider_fields(c, "bridge"))
    container = {
        "_target_": "megatron.bridge.training.config.ConfigContainer",
        "model": model,
        "train": {"_target_": "megatron.bridge.training.config.TrainingConfig", "train_iters": ITERATION,
                  "global_batch_size": 8, "micro_batch_size": 1, "eval_iters": 0, "exit_signal_handler": False},
        "checkpoint": {"_target_": "megatron.bridge.training.config.CheckpointConfig", "save": save_dir,
                       "save_interval": 1, "ckpt_format": "torch_dist", "fully_parallel_save": True,
                       "async_save": False, "load": None, "pretrained_checkpoint": None},
        "tokenizer": {"_target_": "megatron.bridge.training.tokenizers.config.TokenizerConfig",
                      "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "tiny-" + c["family"],
                      "vocab_size": None},
        "optimizer": {"_target_": "megatron.core.optimizer.optimizer_config.OptimizerConfig", "optimizer": "adam",
                      "lr": 0.0001, "weight_decay": 0.01, "bf16": False, "fp16": False, "use_distributed_optimizer": True},
        "rng": {"_target_": "megatron.bridge.training.config.RNGConfig", "seed": 1234},
        "dist": {"_target_": "megatron.bridge.training.config.DistributedInitConfig", "distributed_backend": "nccl"},
        "logger": {"_target_": "megatron.bridge.training.config.LoggerConfig", "log_interval": 1,
                   "tensorboard_dir": None, "wandb_project": None},
    }
    return yaml.safe_dump(container, default_flow_style=False)


def nemo_model_yaml(c, config):
    import yaml

    model_target, config_target = NEMO_MODELS[c["family"]]
    cfg = dataclass_yaml(config, config_target, "nemo", provider_fields(c, "nemo"))
    model = {"config": cfg,
             "optim": {"config": {"optimizer": "adam", "lr": 0.0001, "bf16": False, "fp16": False,
                                  "params_dtype": {"_target_": "torch.dtype", "_call_": True},
                                  "use_distributed_optimizer": True,
                                  "_target_": "megatron.core.optimizer.optimizer_config.OptimizerConfig"},
                       "lr_scheduler": None, "no_weight_decay_cond": None, "scale_lr_cond": None,
                       "lr_mult": 1.0,
                       "_target_": "nemo.lightning.pytorch.optim.megatron.MegatronOptimizerModule"},
             "tokenizer": {"pretrained_model_name": "tiny-" + c["family"], "vocab_file": None, "merges_file": None,
                           "use_fast": True, "trust_remote_code": False,
                           "_target_": "nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer"},
             "model_transform": None,
             "_target_": model_target}
    return yaml.safe_dump(model, default_flow_style=False, sort_keys=False)


def local_shard(name, param, full, c, tp_rank):
    """The slice of FULL that PARAM (a local parameter of this TP rank) holds."""
    import torch

    tp = c["tp"]
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):  # [gate_r; up_r] in memory (each expert's too)
        ffn = c["moe_ffn"] if ".experts." in name else FFN
        gate, up = full[:ffn], full[ffn:]
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])
    return full.chunk(tp, dim=dim)[tp_rank]


def run_case(name, rank, out):
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    c = CASES[name]
    tp, pp = c["tp"], c["pp"]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=c.get("ep", 1))
    # DotProductAttention forks the CUDA RNG tracker (dropout), which cannot be seeded on CPU.
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(1234)
    config = transformer_config(c)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    # Expert parallel: this rank holds experts [ep_rank * E / EP, ...) as local_experts.{0..}, each
    # split over the expert tensor-parallel group.
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    local_experts = c.get("experts", 0) // c.get("ep", 1)
    spec = get_gpt_layer_local_spec(num_experts=c.get("experts"), moe_grouped_gemm=False, qk_layernorm=c["qk_norm"],
                                    normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=padded_vocab(tp), max_sequence_length=64, pre_process=pp_rank == 0,
                     post_process=pp_rank == pp - 1, share_embeddings_and_output_weights=c["tied"],
                     position_embedding_type="rope", rotary_base=10000, parallel_output=False).eval()
    hf_sd, _ = HF_MODELS[name]
    full = to_megatron(hf_sd, c, tp)
    offset = {j: layer.layer_number - 1 for j, layer in enumerate(model.decoder.layers)}
    loaded = 0
    with torch.no_grad():
        for pname, p in model.named_parameters():
            key = pname
            if pname.startswith("decoder.layers."):
                j, rest = pname[len("decoder.layers."):].split(".", 1)
                key = f"decoder.layers.{offset[int(j)]}.{rest}"
            if ".local_experts." in key:
                head, tail = key.split(".local_experts.")
                e, tail = tail.split(".", 1)
                key = f"{head}.local_experts.{ep_rank * local_experts + int(e)}.{tail}"
            if key == "output_layer.weight" and c["tied"]:
                key = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
            shard = local_shard(pname, p, full[key], c, etp_rank if ".local_experts." in key else tp_rank)
            if tuple(shard.shape) != tuple(p.shape):
                raise SystemExit(f"{name}: {pname}: shard {tuple(shard.shape)} != parameter {tuple(p.shape)}")
            p.copy_(shard)
            loaded += 1

    # Forward on fixed ids; the last stage gets the hidden states of the first over gloo.
    ids = HF_MODELS[name][1]["ids"]
    pos = torch.arange(SEQ).unsqueeze(0)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        if pp == 1:
            logits = model(ids, pos, mask)
        else:
            if pp_rank == 0:
                hidden = model(ids, pos, mask)
                dist.send(hidden.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
                logits = None
            else:
                hidden = torch.empty(SEQ, 1, HIDDEN)
                dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(hidden)
                logits = model(None, pos, mask)
    case_dir = Path(out) / name
    if logits is not None and tp_rank == 0 and parallel_state.get_data_parallel_rank() == 0:  # compared with the HF logits by main()
        from safetensors.torch import save_file

        save_file({"logits": logits[..., :VOCAB].contiguous()}, case_dir / "megatron_logits.safetensors")
        (case_dir / "megatron_logits.json").write_text(json.dumps(
            {"shape": list(logits.shape), "parameters_loaded_on_rank": loaded}))

    metadata = {"singleton_local_shards": False}  # what Megatron-LM and Bridge pass

    def save(folder, state, content_metadata=metadata):
        folder = Path(folder)
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(state, str(folder), content_metadata=content_metadata)
        dist.barrier()

    def model_sd(prefix=""):
        return model.sharded_state_dict(prefix=prefix, metadata=metadata)

    step = f"iter_{ITERATION:07d}"
    # Megatron-LM: args and iteration in the common state.
    mlm = case_dir / "megatron_lm"
    save(mlm / step, {"model": model_sd(), "args": megatron_lm_args(c, config), "iteration": ITERATION,
                      "checkpoint_version": 3.0, "num_floating_point_operations_so_far": 0})
    if name == "llama":
        wrong = Path(out) / "variants" / "llama_wrong_groups"
        save(wrong / step, {"model": model_sd(), "args": megatron_lm_args(c, config, num_query_groups=1),
                            "iteration": ITERATION, "checkpoint_version": 3.0})
    # Megatron-Bridge: the config in run_config.yaml, the train state beside the weights.
    bridge = case_dir / "bridge"
    save(bridge / step, {"model": model_sd(), "checkpoint_version": 3.0, "iteration": ITERATION})
    # NeMo 2: the Lightning checkpoint's state around the model keyed module.*
    nemo = case_dir / "nemo2" / NEMO_NAME
    save(nemo / "weights", {"state_dict": model_sd("module."), "epoch": 0, "global_step": ITERATION,
                            "pytorch-lightning_version": "2.5.1", "loops": {}, "callbacks": {},
                            "hparams_name": "kwargs", "hyper_parameters": {}}, content_metadata=None)
    # NeMo-RL (Megatron backend): a Bridge save of iteration 0 under policy/weights.
    rl_weights = case_dir / "nemo_rl" / "step_1" / "policy" / "weights"
    save(rl_weights / "iter_0000000", {"model": model_sd(), "checkpoint_version": 3.0, "iteration": 0})

    if rank == 0:
        for folder in (mlm, Path(out) / "variants" / "llama_wrong_groups" if name == "llama" else None):
            if folder is not None:
                (folder / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        write_bridge_files(bridge, step, c, config, ITERATION)
        write_bridge_files(rl_weights, "iter_0000000", c, config, 0)
        context = nemo / "context"
        context.mkdir(parents=True)
        (context / "model.yaml").write_text(nemo_model_yaml(c, config))
        rl_step = case_dir / "nemo_rl" / "step_1"
        (rl_step / "config.yaml").write_text(nemo_rl_config(c))
        (rl_step / "training_info.json").write_text(json.dumps({"step": 1, "consumed_samples": 8}))
    dist.barrier()
    parallel_state.destroy_model_parallel()


def write_bridge_files(save_dir, step, c, config, iteration):
    import torch

    (save_dir / step / "run_config.yaml").write_text(bridge_run_config(c, config, save_dir.name))
    state = {"step": torch.tensor(iteration), "consumed_train_samples": torch.tensor(8 * iteration),
             "skipped_train_samples": torch.tensor(0), "consumed_valid_samples": torch.tensor(0),
             "floating_point_operations_so_far": torch.tensor(0.0), "do_train": torch.tensor(True),
             "do_valid": torch.tensor(False), "do_test": torch.tensor(False)}
    torch.save(state, save_dir / step / "train_state.pt")
    torch.save(state, save_dir / "latest_train_state.pt")
    (save_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def nemo_rl_config(c):
    import yaml

    return yaml.safe_dump({
        "grpo": {"max_num_steps": 1, "num_prompts_per_step": 8},
        "checkpointing": {"enabled": True, "checkpoint_dir": "results/grpo", "save_period": 1},
        "policy": {"model_name": "tiny-" + c["family"], "tokenizer": {"name": "tiny-" + c["family"]},
                   "precision": "float32",
                   "dtensor_cfg": {"enabled": False},
                   "megatron_cfg": {"enabled": True, "tensor_model_parallel_size": c["tp"],
                                    "pipeline_model_parallel_size": c["pp"], "context_parallel_size": 1,
                                    "sequence_parallel": False}},
    }, default_flow_style=False, sort_keys=False)


def rank_main(rank, world_size, names, out):
    import torch.distributed as dist

    cpu_only()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for name in names:
        run_case(name, rank, out)
    dist.destroy_process_group()


def read_dcp(folder):
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load

    md = FileSystemReader(str(folder)).read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
          for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
    load(sd, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return sd


def mbridge_names(prefix, rest, t, c):
    """A layer's saved tensor under the per-layer names mbridge converts (its names are the
    Transformer Engine spec's: an MoE layer's pre-MLP norm stands alone, expert e's weights
    are `weight{e}` of the grouped experts)."""
    if "experts" in c and rest == "mlp.linear_fc1.layer_norm_weight":
        return [(prefix + "pre_mlp_layernorm.weight", t)]
    if rest.startswith("mlp.experts.experts."):
        name = rest[len("mlp.experts.experts."):]
        return [(prefix + f"mlp.experts.{name}{e}", t[e]) for e in range(c["experts"])]
    return [(prefix + rest, t)]


def cross_check(out):
    """Each case's saves read back by torch DCP: our inverse rules and mbridge's conversion
    both give the HF state dict bit for bit."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from mbridge import AutoBridge

    cpu_only()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(__import__("ckptfs_ranks").free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    results = {}
    for name, c in CASES.items():
        hf_sd, extra = HF_MODELS[name]
        case_dir = Path(out) / name
        mg = read_dcp(case_dir / "megatron_lm" / f"iter_{ITERATION:07d}")
        ours = to_hf(mg, c)
        expected = {k: v for k, v in hf_sd.items() if not (c["tied"] and k == "lm_head.weight")}
        if set(ours) != set(expected):
            raise SystemExit(f"{name}: our rules give keys {sorted(set(ours) ^ set(expected))} differently")
        for k, v in expected.items():
            if not torch.equal(ours[k], v):
                raise SystemExit(f"{name}: {k}: our rules do not give the HF tensor back")
        bridge = AutoBridge.from_config(extra["config"], dtype=torch.float32)
        # What mbridge's get_model sets when it builds the model with a padded vocabulary.
        bridge.make_vocab_size_divisible_by = 128 * c["tp"]
        bridge.vocab_size, bridge.padded_vocab_size = VOCAB, padded_vocab(c["tp"])
        theirs = {}
        for key, t in mg.items():
            if key.startswith("decoder.layers."):
                rest = key[len("decoder.layers."):]
                for i in range(LAYERS):
                    for per_layer, tensor in mbridge_names(f"decoder.layers.{i}.", rest, t[i], c):
                        names, tensors = bridge._weight_to_hf_format(per_layer, tensor)
                        theirs.update(zip(names, tensors))
            else:
                names, tensors = bridge._weight_to_hf_format(key, t)
                theirs.update(zip(names, tensors))
        missing = sorted(k for k in expected if k not in theirs)
        differ = sorted(k for k in expected if k in theirs and not torch.equal(theirs[k].contiguous(), expected[k]))
        if missing or differ:
            raise SystemExit(f"{name}: mbridge's conversion: missing {missing}, differs on {differ}")
        results[name] = {"tensors": len(expected), "mbridge_equal": len(expected),
                         "dcp": {k: list(v.shape) for k, v in mg.items()}}
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return results


def main():
    out = Path(sys.argv[1])
    import importlib.metadata

    import torch
    from safetensors.torch import load_file, save_file

    for name, c in CASES.items():
        model = build_hf(name)
        case_dir = out / name
        ref = case_dir / "reference"
        model.save_pretrained(ref)  # config.json, generation_config.json, model.safetensors
        ids = (torch.arange(SEQ) * 37 % VOCAB).unsqueeze(0)
        # The state dict as stored (a tied lm_head left out; MoE experts one key per expert and
        # projection: transformers 5 fuses them in memory only).
        sd = load_file(ref / "model.safetensors")
        HF_MODELS[name] = (sd, {"ids": ids, "model": model, "config": model.config})
    by_world = {}
    for name, c in CASES.items():
        by_world.setdefault(world_size(c), []).append(name)
    run_ranks_per_world_size(rank_main, by_world, out)
    # The HF forwards run after the ranks: a parent that has run a parallel region of torch's
    # OpenMP pool before forking leaves the children's pool hung (seen with the MoE models).
    for name in CASES:
        ref = out / name / "reference"
        extra = HF_MODELS[name][1]
        with torch.no_grad():
            logits = extra["model"](input_ids=extra["ids"]).logits
        save_file({"input_ids": extra["ids"], "logits": logits.contiguous()}, ref / "logits.safetensors")
        megatron = load_file(out / name / "megatron_logits.safetensors")["logits"]
        diff = (megatron - logits).abs().max().item()
        summary = json.loads((out / name / "megatron_logits.json").read_text())
        summary["max_abs_diff_vs_hf"] = diff
        (out / name / "megatron_logits.json").write_text(json.dumps(summary))
        if not diff < 1e-4:
            raise SystemExit(f"{name}: megatron logits differ from the HF model's by {diff}")
    checks = cross_check(out)
    versions = {p: importlib.metadata.version(p) for p in ("megatron-core", "mbridge", "torch", "transformers")}
    for name, c in CASES.items():
        case_dir = out / name
        fixture = dict(case=name, **c, layers=LAYERS, hidden=HIDDEN, heads=HEADS, groups=GROUPS, ffn=FFN,
                       vocab=VOCAB, padded_vocab=padded_vocab(c["tp"]), iteration=ITERATION, nemo_name=NEMO_NAME,
                       megatron_logits=json.loads((case_dir / "megatron_logits.json").read_text()),
                       cross_check=checks[name], versions=versions)
        (case_dir / "fixture.json").write_text(json.dumps(fixture, indent=1))
    print("cases:", ", ".join(CASES), flush=True)


if __name__ == "__main__":
    main()
