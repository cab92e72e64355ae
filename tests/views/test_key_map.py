"""Key maps (doc/MAPS.md): a Megatron-core GPT torch_dist save served as the Hugging Face
model it came from. Each fixture is a round trip: a tiny Hugging Face model (transformers'
own class, seeded) has its state dict rewritten into Megatron's layout (stacked layers, QKV
rows interleaved by query group, [gate; up] fused, padded vocabulary, norms inside the fused
linears), saved with torch.distributed.checkpoint beside a common.pt holding Megatron-LM's
args Namespace, in Megatron's run-folder layout. The mapped tree must give back the original
state dict byte for byte, and transformers' from_pretrained of it the logits of the original's
save_pretrained folder loaded the same way (ckptfs_testlib.causal_lm).
megatron-core's own multi-rank saves are covered by tests/frameworks/test_megatron_hf_map.py;
here the chunk layout is one box per tensor, and tests/unit/key_map_test.cpp covers boxes
split by tensor-parallel ranks."""

import argparse
import json

import pytest

from ckptfs_testlib import assert_same_logits, causal_lm
from fusetools import daemon_pids, mount_entry

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

VOCAB, PADDED = 100, 128


def hf_config(kind, tied):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tied)
    if kind == "llama":
        return transformers.LlamaConfig(head_dim=8, **common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    # Qwen3 with a head_dim that is not hidden_size / heads.
    return transformers.Qwen3Config(head_dim=12, **common)


def megatron_state(sd, cfg, prefix=""):
    """The HF state dict in Megatron-core's DCP keys and layout (stacked layers)."""
    L, NH, NG = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // NH
    P = NH // NG
    out = {}

    def pad(t):
        return torch.cat([t, torch.full((PADDED - t.shape[0], t.shape[1]), 7.0, dtype=t.dtype)])

    def fused(layer, what):
        q, k, v = (sd[f"model.layers.{layer}.self_attn.{n}_proj.{what}"] for n in "qkv")
        rows = []
        for g in range(NG):
            rows += [q[g * P * D:(g + 1) * P * D], k[g * D:(g + 1) * D], v[g * D:(g + 1) * D]]
        return torch.cat(rows)

    def stack(fn):
        return torch.stack([fn(i) for i in range(L)])

    lay = "decoder.layers."
    out["embedding.word_embeddings.weight"] = pad(sd["model.embed_tokens.weight"])
    out[lay + "self_attention.linear_qkv.weight"] = stack(lambda i: fused(i, "weight"))
    if f"model.layers.0.self_attn.q_proj.bias" in sd:
        out[lay + "self_attention.linear_qkv.bias"] = stack(lambda i: fused(i, "bias"))
    if f"model.layers.0.self_attn.q_norm.weight" in sd:
        out[lay + "self_attention.q_layernorm.weight"] = stack(lambda i: sd[f"model.layers.{i}.self_attn.q_norm.weight"])
        out[lay + "self_attention.k_layernorm.weight"] = stack(lambda i: sd[f"model.layers.{i}.self_attn.k_norm.weight"])
    out[lay + "self_attention.linear_proj.weight"] = stack(lambda i: sd[f"model.layers.{i}.self_attn.o_proj.weight"])
    out[lay + "self_attention.linear_qkv.layer_norm_weight"] = stack(lambda i: sd[f"model.layers.{i}.input_layernorm.weight"])
    out[lay + "mlp.linear_fc1.layer_norm_weight"] = stack(lambda i: sd[f"model.layers.{i}.post_attention_layernorm.weight"])
    if "model.layers.0.mlp.gate_proj.weight" in sd:
        out[lay + "mlp.linear_fc1.weight"] = stack(
            lambda i: torch.cat([sd[f"model.layers.{i}.mlp.gate_proj.weight"], sd[f"model.layers.{i}.mlp.up_proj.weight"]]))
        out[lay + "mlp.linear_fc2.weight"] = stack(lambda i: sd[f"model.layers.{i}.mlp.down_proj.weight"])
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = pad(sd["lm_head.weight"])
    return {prefix + k: v.contiguous() for k, v in out.items()}


def megatron_args(cfg, kind, drop=(), **over):
    """Megatron-LM's args as its training loop pickles them into common.pt (without the fields
    DROP names: an older Megatron-LM's, which predate them)."""
    fields = dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                  ffn_hidden_size=cfg.intermediate_size, num_attention_heads=cfg.num_attention_heads,
                  group_query_attention=True, num_query_groups=cfg.num_key_value_heads,
                  kv_channels=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                  add_qkv_bias=kind == "qwen2", add_bias_linear=False, qk_layernorm=kind == "qwen3",
                  untie_embeddings_and_output_weights=not cfg.tie_word_embeddings, normalization="RMSNorm",
                  swiglu=True, position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
                  rotary_interleaved=False, norm_epsilon=1e-6, max_position_embeddings=64, seq_length=64,
                  padded_vocab_size=PADDED, vocab_size=VOCAB, num_experts=None, params_dtype=torch.float32,
                  bf16=False, fp16=False, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1,
                  lr=3e-4, train_iters=10)
    fields.update(over)
    for name in drop:
        del fields[name]
    return argparse.Namespace(**fields)


def save_megatron(folder, state, args):
    """Megatron-LM's run folder: iter_0000005/ (DCP + common.pt) and its tracker file."""
    step = folder / "iter_0000005"
    dcp.save(state, checkpoint_id=str(step), no_dist=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 5}, step / "common.pt")
    (step / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (folder / "latest_checkpointed_iteration.txt").write_text("5")
    return folder


def build(tmp_path_factory, kind, tied, prefix="", drop=(), **over):
    """(the Megatron run folder, the HF model as from_pretrained loads its save_pretrained
    folder (model.name_or_path), its state dict)."""
    import transformers

    torch.manual_seed({"llama": 1, "qwen2": 2, "qwen3": 3}[kind])
    cfg = hf_config(kind, tied)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    # Norm weights start at 1: make them differ so a swap of two norms cannot pass.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    folder = save_megatron(tmp_path_factory.mktemp(f"megatron-{kind}"), megatron_state(sd, cfg, prefix),
                           megatron_args(cfg, kind, drop, **over))
    hf = tmp_path_factory.mktemp(f"hf-{kind}")
    model.save_pretrained(str(hf))
    return folder, causal_lm(hf), sd


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build(tmp_path_factory, "llama", tied=False)


@pytest.fixture(scope="module")
def qwen2_tied(tmp_path_factory):
    return build(tmp_path_factory, "qwen2", tied=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build(tmp_path_factory, "qwen3", tied=False)


def expected_keys(sd):
    # Tied: the HF state dict lists lm_head, the saved model does not (transformers ties it).
    return {k for k in sd if not k.startswith("lm_head") or "lm_head" in k and k in sd}


def export(run_ckptfs, source, out, *options):
    run_ckptfs("export", str(source), str(out), *options)
    return load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("case", ["llama", "qwen2_tied", "qwen3"])
def test_round_trip_is_the_hf_model(case, request, run_ckptfs, tmp_path):
    """map=auto picks the family from common.pt's args; every served tensor equals the HF
    original bit for bit; from_pretrained of the export gives the original logits."""
    folder, model, sd = request.getfixturevalue(case)
    kind = case.split("_")[0]
    info = run_ckptfs("info", str(folder), "--map", "auto").stdout.decode()
    assert f"map:          {kind} (common.pt args: " in info
    got, config = export(run_ckptfs, folder, tmp_path / "out", "--map", "auto")
    tied = model.config.tie_word_embeddings
    want = {k: v for k, v in sd.items() if not (tied and k == "lm_head.weight")}
    assert list(got) == [k for k in sd if k in want], "keys or their order differ from the HF state dict"
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    assert config["model_type"] == kind and config["tie_word_embeddings"] == tied
    assert config["vocab_size"] == VOCAB and config["num_key_value_heads"] == 2 and config["torch_dtype"] == "float32"
    ids = torch.tensor([[1, 5, 9, 42, 77, 99, 3]])
    assert_same_logits(causal_lm(tmp_path / "out"), model.name_or_path, ids, f"{case}: the export vs the HF folder")


# Megatron-LM args that predate a switch the maps need; what the tensors prove in its place.
QK_NORMS = "decoder.layers.self_attention.q_layernorm.weight is stored"
NO_QK_NORMS = "no q_layernorm or k_layernorm weight is stored beside decoder.layers.self_attention.linear_qkv.weight"
OLDER_ARGS = {
    "llama": (False, ("qk_layernorm",), {"qk_layernorm": (False, NO_QK_NORMS)}),
    "qwen3": (False, ("qk_layernorm",), {"qk_layernorm": (True, QK_NORMS)}),
    # Every switch the tensors prove left out, on a tied model with QKV biases.
    "qwen2": (True, ("qk_layernorm", "add_qkv_bias", "add_bias_linear", "untie_embeddings_and_output_weights",
                     "swiglu"),
              {"qk_layernorm": (False, NO_QK_NORMS),
               "add_bias_linear": (False, "no bias is stored beside decoder.layers.self_attention.linear_proj.weight"),
               "add_qkv_bias": (True, "decoder.layers.self_attention.linear_qkv.bias is stored, and no other linear bias is"),
               "untie_embeddings_and_output_weights": (
                   False, "no output_layer.weight is stored beside embedding.word_embeddings.weight"),
               "swiglu": (True, "decoder.layers.mlp.linear_fc1.weight has 160 rows and ffn_hidden_size is 80: "
                                "gate and up")}),
}


@pytest.mark.parametrize("kind", OLDER_ARGS)
def test_args_of_an_older_megatron_are_completed_by_the_tensors(kind, tmp_path_factory, run_ckptfs, tmp_path):
    """An args Namespace without qk_layernorm (and the other switches Megatron-LM added over
    time): map=auto decides them from the stored tensors, says so in info, and serves the HF
    model exactly."""
    tied, drop, facts = OLDER_ARGS[kind]
    folder, model, sd = build(tmp_path_factory, kind, tied=tied, drop=drop)
    text = run_ckptfs("info", str(folder), "--map", "auto").stdout.decode()
    assert f"map:          {kind} (common.pt args: " in text, text
    for field, (value, why) in facts.items():
        assert f"from tensors: {field} = {json.dumps(value)} ({why})" in text, text
    info = json.loads(run_ckptfs("info", "--json", str(folder), "--map", "auto").stdout)
    assert info["map"]["model_config_from_tensors"] == {f: {"value": v, "why": w} for f, (v, w) in facts.items()}
    got, config = export(run_ckptfs, folder, tmp_path / "out", "--map", "auto")
    want = {k: v for k, v in sd.items() if not (tied and k == "lm_head.weight")}
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert config["tie_word_embeddings"] == tied
    ids = torch.tensor([[1, 5, 9, 42, 77, 99, 3]])
    assert_same_logits(causal_lm(tmp_path / "out"), model.name_or_path, ids, f"{kind}: the export vs the HF folder")


def test_args_that_contradict_the_tensors_are_refused(tmp_path_factory, run_ckptfs):
    """args saying there are no q/k norms beside stored q/k norms would make map=auto serve
    Llama without them: refused in one line, unless the user decides with map.qk_layernorm."""
    folder, _, _ = build(tmp_path_factory, "qwen3", tied=False, qk_layernorm=False)
    res = run_ckptfs("ls", str(folder), "--map", "auto", check=False)
    err = res.stderr.decode()
    assert res.returncode != 0 and res.stdout == b"" and len(err.strip().splitlines()) == 1, err
    assert ("map=auto: common.pt args disagrees with the stored tensors on qk_layernorm: the config says false, but "
            f"{QK_NORMS} (give map.qk_layernorm=VALUE to decide)") in err, err
    text = run_ckptfs("info", str(folder), "--map", "auto", "--map.qk-layernorm=true").stdout.decode()
    assert "map:          qwen3 (" in text, text


def test_info_json_names_the_map_and_its_parameters(llama, run_ckptfs):
    folder, _, _ = llama
    info = json.loads(run_ckptfs("info", "--json", str(folder), "--map", "auto").stdout)
    m = info["map"]
    assert m["name"] == "llama" and m["reason"].startswith("common.pt args: ")
    assert m["parameters"]["groups"] == 2 and m["parameters"]["q_rows"] == 24 and m["parameters"]["vocab"] == VOCAB
    assert info["metadata"]["model_config_source"] == "common.pt args"


def test_mount_loads_with_from_pretrained_and_dtype_composes(llama, mounts):
    """The mount itself, map then dtype: bf16 tensors equal to torch's .to(bfloat16), and a
    config.json that says so."""
    import transformers

    folder, model, sd = llama
    mnt = mounts.mount(str(folder), "map=auto", "dtype=bf16")
    assert json.loads((mnt / "config.json").read_text())["torch_dtype"] == "bfloat16"
    got = load_file(str(mnt / "model.safetensors"))
    for k, v in sd.items():
        assert torch.equal(got[k], v.to(torch.bfloat16)), k
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(mnt), dtype=torch.float32)
    assert type(loaded) is type(model)


def test_nemo_prefix_and_per_layer_keys(tmp_path_factory, run_ckptfs, tmp_path):
    """Keys under NeMo 2's `module.` prefix and per-layer keys (decoder.layers.N....) map the same."""
    import transformers

    folder, model, sd = build(tmp_path_factory, "llama", tied=False, prefix="module.")
    got, _ = export(run_ckptfs, folder, tmp_path / "a", "--map", "llama")
    assert all(torch.equal(got[k], v) for k, v in sd.items())

    cfg = model.config
    stacked = megatron_state(sd, cfg)
    per_layer = {}
    for k, v in stacked.items():
        if k.startswith("decoder.layers."):
            for i in range(cfg.num_hidden_layers):
                per_layer[k.replace("decoder.layers.", f"decoder.layers.{i}.")] = v[i].clone()
        else:
            per_layer[k] = v
    folder2 = save_megatron(tmp_path_factory.mktemp("per-layer"), per_layer, megatron_args(cfg, "llama"))
    got2, _ = export(run_ckptfs, folder2, tmp_path / "b", "--map", "auto")
    assert list(got2) == list(sd) and all(torch.equal(got2[k], v) for k, v in sd.items())
    assert isinstance(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "b")), type(model))


@pytest.mark.parametrize("options, message", [
    # A head count that disagrees with the fused QKV rows: refused naming the tensor.
    (["--map.num-attention-heads=12"],
     "map llama: 'decoder.layers.self_attention.linear_qkv.weight' (for 'model.layers.0.self_attn.q_proj.weight'): "
     "row_groups: dimension 0 of shape [80, 48] is 80 long, not groups * size = 2 * 64 = 128"),
    (["--map.num-layers=4"], "L takes 3 values in [0, 2], the map expects layers = 4 (0 to 3)"),
    (["--map.ffn-hidden-size=60"], "'decoder.layers.mlp.linear_fc1.weight' (for 'model.layers.0.mlp.gate_proj.weight') "
                                   "has shape [160, 48], the map's parameters give [2 * ffn, hidden] = [120, 48]"),
    (["--map.vocab-size=200"], "slice: [0, 200) of dimension 0 of shape [128, 48] is out of range"),
    (["--map.normalization=LayerNorm"], "fails 'normalization == 'RMSNorm'': LlamaForCausalLM normalizes with RMSNorm"),
    (["--map.qk-layernorm=true"], "map=auto picks qwen3"),
])
def test_parameters_that_disagree_with_the_tensors_are_refused(llama, run_ckptfs, options, message):
    folder, _, _ = llama
    res = run_ckptfs("ls", str(folder), "--map", "auto", *options, check=False)
    err = res.stderr.decode()
    if message == "map=auto picks qwen3":
        # The config now names q/k norms: the Qwen3 map is picked and finds none.
        assert res.returncode != 0 and "map qwen3: 'model.layers.{L}.self_attn.q_norm.weight' needs" in err
        return
    assert res.returncode != 0 and res.stdout == b"" and len(err.strip().splitlines()) == 1, err
    assert message in err, err


@pytest.mark.parametrize("bias, message", [
    ("mlp.linear_fc2.bias", "tensor 'decoder.layers.mlp.linear_fc2.bias' [3, 48] is used by no rule"),
    # A bias the args deny (add_bias_linear false) is caught first, as a config the tensors contradict.
    ("self_attention.linear_proj.bias", "disagrees with the stored tensors on add_bias_linear: the config says false, "
                                        "but decoder.layers.self_attention.linear_proj.bias is stored"),
])
def test_a_tensor_the_map_does_not_know_is_refused(tmp_path_factory, run_ckptfs, mounts, bias, message):
    """A Megatron model with linear biases has tensors Llama has no place for: refused by
    name, at mount too (no mount), never dropped."""
    import transformers

    torch.manual_seed(4)
    cfg = hf_config("llama", False)
    sd = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()
    state = megatron_state(sd, cfg)
    state["decoder.layers." + bias] = torch.zeros(3, 48)
    folder = save_megatron(tmp_path_factory.mktemp("bias"), state, megatron_args(cfg, "llama"))
    res = run_ckptfs("ls", str(folder), "--map", "llama", check=False)
    assert res.returncode != 0
    assert message in res.stderr.decode(), res.stderr.decode()
    mountpoint, bounded = mounts.try_mount(str(folder), "map=llama")
    assert bounded.returncode == 1 and len(bounded.stderr.splitlines()) == 1, bounded.describe()
    assert bias in bounded.stderr.splitlines()[0]
    assert mount_entry(mountpoint) is None and daemon_pids(mountpoint, mounts.binary) == []


def test_auto_without_a_config_and_unknown_names(tmp_path, run_ckptfs, llama):
    folder, _, sd = llama
    plain = tmp_path / "plain.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(plain))
    err = run_ckptfs("ls", str(plain), "--map", "auto", check=False).stderr.decode()
    assert "map=auto: the checkpoint has no model_config" in err
    err = run_ckptfs("ls", str(folder), "--map", "gpt5", check=False).stderr.decode()
    assert "no shipped map of that name (shipped: llama, mistral, qwen2, qwen3" in err
    err = run_ckptfs("ls", str(folder), "--map", "rel/m.json", check=False).stderr.decode()
    assert "needs an absolute file path" in err


def test_a_map_file(tmp_path, run_ckptfs, llama):
    """A user's map: renames, a select, a transpose (served by gathering), a concat of two
    source tensors; and a map file with a typo is refused naming the entry."""
    folder, _, sd = llama
    m = {
        "ckptfs_map": 1, "name": "mine",
        "tensors": [
            {"to": "emb", "from": "embedding.word_embeddings.weight"},
            {"to": "norm.{L}", "from": "decoder.layers.self_attention.linear_qkv.layer_norm_weight[L]"},
            {"to": "o1.T", "from": "decoder.layers.self_attention.linear_proj.weight",
             "ops": [{"op": "select", "dim": 0, "index": 1}, {"op": "transpose", "dims": [0, 1]}]},
            {"to": "both_norms", "concat": {"dim": 0, "parts": [
                {"from": "decoder.layers.mlp.linear_fc1.layer_norm_weight"},
                {"from": "decoder.final_layernorm.weight", "ops": []}]}},
        ],
        "ignore": ["decoder.*", "output_layer.*"],
    }
    # the final norm is [48] and the stacked norms [3, 48]: make them join as [4, 48]
    m["tensors"][3]["concat"]["parts"][1] = {"from": "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                                              "ops": [{"op": "slice", "dim": 0, "start": 0, "stop": 1}]}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(m))
    got, _ = None, None
    run_ckptfs("export", str(folder), str(tmp_path / "out"), "--map", str(path))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert list(got) == ["emb", "norm.0", "norm.1", "norm.2", "o1.T", "both_norms"]
    assert torch.equal(got["emb"][:VOCAB], sd["model.embed_tokens.weight"]) and got["emb"].shape[0] == PADDED
    assert torch.equal(got["norm.2"], sd["model.layers.2.input_layernorm.weight"])
    assert torch.equal(got["o1.T"], sd["model.layers.1.self_attn.o_proj.weight"].t())
    post = torch.stack([sd[f"model.layers.{i}.post_attention_layernorm.weight"] for i in range(3)])
    assert torch.equal(got["both_norms"], torch.cat([post, sd["model.layers.0.input_layernorm.weight"][None]]))
    assert not (tmp_path / "out" / "config.json").exists()

    m["tensors"][0]["form"] = "x"
    path.write_text(json.dumps(m))
    err = run_ckptfs("ls", str(folder), "--map", str(path), check=False).stderr.decode()
    assert f"map {path}: tensors[0].form: not a field of a rule" in err
    del m["tensors"][0]["form"]

    # A config template's $when that is a number, and parameters defined through a chain of
    # 100 others: each one line, no crash.
    path.write_text(json.dumps({**m, "config": {"a": {"$when": 1, "b": 2}}}))
    res = run_ckptfs("ls", str(folder), "--map", str(path), check=False)
    assert res.returncode != 0 and "$when" in res.stderr.decode(), res.stderr.decode()
    chain = {"p0": "1", **{f"p{i}": f"p{i - 1}" for i in range(1, 100)}}
    path.write_text(json.dumps({**m, "parameters": chain, "config": {"x": "=p99"}}))
    res = run_ckptfs("ls", str(folder), "--map", str(path), check=False)
    err = res.stderr.decode()
    assert res.returncode != 0 and "is defined through more than 64 other parameters" in err, err


# Mixture of experts: Megatron's router [L, E, H] and experts stacked [L, E, ...] (fc1 of each
# expert [gate; up]), from Hugging Face's on-disk per-expert keys (what save_pretrained writes
# and from_pretrained reads, in transformers 4 and 5 alike).
MOE = {
    "mixtral": ("model.layers.{i}.block_sparse_moe.", "gate.weight", "experts.{e}.w1.weight", "experts.{e}.w3.weight",
                "experts.{e}.w2.weight"),
    "qwen3_moe": ("model.layers.{i}.mlp.", "gate.weight", "experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight",
                  "experts.{e}.down_proj.weight"),
}


def moe_state(disk, cfg, kind, per_expert_keys=False):
    out = megatron_state(disk, cfg)
    L, E = cfg.num_hidden_layers, 4
    base, router, gate, up, down = MOE[kind]

    def get(i, e, what):
        return disk[(base + what).format(i=i, e=e)]

    lay = "decoder.layers."
    out[lay + "mlp.router.weight"] = torch.stack([disk[(base + router).format(i=i)] for i in range(L)])
    fc1 = [[torch.cat([get(i, e, gate), get(i, e, up)]) for e in range(E)] for i in range(L)]
    fc2 = [[get(i, e, down) for e in range(E)] for i in range(L)]
    if per_expert_keys:
        # Megatron's per-layer, per-expert keys (a non-homogeneous block, SequentialMLP names).
        for i in range(L):
            for e in range(E):
                out[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1[i][e]
                out[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2[i][e]
    else:
        out[lay + "mlp.experts.experts.linear_fc1.weight"] = torch.stack([torch.stack(r) for r in fc1])
        out[lay + "mlp.experts.experts.linear_fc2.weight"] = torch.stack([torch.stack(r) for r in fc2])
    return {k: v.contiguous() for k, v in out.items()}


def build_moe(tmp_path_factory, kind, pre_softmax, per_expert_keys=False):
    """A tiny HF MoE model, its save_pretrained tensors, and its Megatron save (common.pt args)."""
    import transformers

    torch.manual_seed({"mixtral": 5, "qwen3_moe": 6}[kind])
    common = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  num_experts_per_tok=2)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=40, num_local_experts=4, head_dim=8, **common)
    else:
        cfg = transformers.Qwen3MoeConfig(intermediate_size=80, moe_intermediate_size=40, num_experts=4, head_dim=12,
                                          norm_topk_prob=not pre_softmax, **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf = tmp_path_factory.mktemp(f"hf-{kind}")
    model.save_pretrained(str(hf))
    model = causal_lm(hf)
    disk = load_file(str(hf / "model.safetensors"))
    ffn = cfg.intermediate_size if kind == "mixtral" else cfg.moe_intermediate_size
    args = megatron_args(cfg, "qwen3" if kind == "qwen3_moe" else "llama", num_layers=2, num_experts=4,
                         moe_router_topk=2, moe_ffn_hidden_size=ffn, moe_router_pre_softmax=pre_softmax,
                         moe_router_score_function="softmax", moe_shared_expert_intermediate_size=None,
                         moe_layer_freq=1, ffn_hidden_size=cfg.intermediate_size)
    folder = save_megatron(tmp_path_factory.mktemp(f"megatron-{kind}"), moe_state(disk, cfg, kind, per_expert_keys),
                           args)
    return folder, model, disk


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return build_moe(tmp_path_factory, "mixtral", pre_softmax=False)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    # A softmax before the top-k, not renormalized: Qwen3-MoE's norm_topk_prob false.
    return build_moe(tmp_path_factory, "qwen3_moe", pre_softmax=True)


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe"])
def test_moe_round_trip_is_the_hf_model(case, request, run_ckptfs, mounts):
    """map=auto picks the MoE map from the experts in common.pt's args; the mount serves the
    router and every expert's gate/up/down as save_pretrained wrote them, bit for bit, and
    from_pretrained of the mount gives the original logits (routing included)."""
    folder, model, disk = request.getfixturevalue(case)
    info = run_ckptfs("info", str(folder), "--map", "auto").stdout.decode()
    assert f"map:          {case} (common.pt args: a mixture of experts" in info
    mnt = mounts.mount(str(folder), "map=auto")
    got = load_file(str(mnt / "model.safetensors"))
    assert set(got) == set(disk)
    for k, v in disk.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    base, router, gate, up, down = MOE[case]
    # Served in the module's order: per layer, each expert's projections together.
    keys = list(got)
    first = keys.index((base + router).format(i=0))
    names = [gate, down, up] if case == "mixtral" else [gate, up, down]
    assert keys[first + 1:first + 4] == [(base + n).format(i=0, e=0) for n in names]
    config = json.loads((mnt / "config.json").read_text())
    assert config["model_type"] == case and config["num_experts_per_tok"] == 2
    if case == "qwen3_moe":
        assert config["norm_topk_prob"] is False and config["moe_intermediate_size"] == 40 and config["num_experts"] == 4
    else:
        assert config["num_local_experts"] == 4 and config["intermediate_size"] == 40
    ids = torch.tensor([[1, 5, 9, 42, 77, 99, 3]])
    assert_same_logits(causal_lm(mnt), model.name_or_path, ids, f"{case}: the mount vs the HF folder")


def test_moe_per_expert_keys(tmp_path_factory, run_ckptfs, tmp_path, qwen3_moe):
    """Per-layer, per-expert keys (decoder.layers.N.mlp.experts.local_experts.E....) map the same."""
    _, model, disk = qwen3_moe
    folder = save_megatron(tmp_path_factory.mktemp("moe-per-expert"),
                           moe_state(disk, model.config, "qwen3_moe", per_expert_keys=True),
                           megatron_args(model.config, "qwen3", num_layers=2, num_experts=4, moe_router_topk=2,
                                         moe_ffn_hidden_size=40, moe_router_pre_softmax=True,
                                         ffn_hidden_size=model.config.intermediate_size))
    got, _ = export(run_ckptfs, folder, tmp_path / "out", "--map", "auto")
    assert set(got) == set(disk) and all(torch.equal(got[k], v) for k, v in disk.items())


@pytest.mark.parametrize("options, message", [
    (["--map.moe-router-pre-softmax=true"],
     "map mixtral: the checkpoint's config (common.pt args) fails '!(moe_router_pre_softmax ?? false)': Mixtral "
     "renormalizes the top-k routing weights"),
    (["--map.moe-router-score-function=sigmoid"], "sigmoid scores are another model"),
    (["--map.moe-router-enable-expert-bias=true"], "router has no expert bias"),
    (["--map.moe-shared-expert-intermediate-size=64"], "MixtralForCausalLM has no shared experts"),
    (["--map.num-experts=8"], "E takes 4 values in [0, 3], the map expects experts = 8 (0 to 7)"),
    (["--map.moe-ffn-hidden-size=30"],
     "'decoder.layers.mlp.experts.experts.linear_fc1.weight' (for 'model.layers.0.block_sparse_moe.experts.0.w1.weight') "
     "has shape [80, 48], the map's parameters give [2 * moe_ffn, hidden] = [60, 48]"),
])
def test_moe_configs_the_map_cannot_serve_are_refused(mixtral, run_ckptfs, options, message):
    folder, _, _ = mixtral
    res = run_ckptfs("ls", str(folder), "--map", "auto", *options, check=False)
    err = res.stderr.decode()
    assert res.returncode != 0 and res.stdout == b"" and len(err.strip().splitlines()) == 1, err
    assert message in err, err


def test_moe_tensors_a_map_has_no_place_for_are_refused(tmp_path_factory, run_ckptfs, mixtral):
    """A router expert bias or shared experts saved beside the experts: refused by name."""
    folder, model, disk = mixtral
    state = moe_state(disk, model.config, "mixtral")
    state["decoder.layers.mlp.router.expert_bias"] = torch.zeros(2, 4)
    args = megatron_args(model.config, "llama", num_layers=2, num_experts=4, moe_router_topk=2,
                         moe_ffn_hidden_size=40, ffn_hidden_size=40)
    bias = save_megatron(tmp_path_factory.mktemp("moe-bias"), state, args)
    err = run_ckptfs("ls", str(bias), "--map", "auto", check=False).stderr.decode()
    # The args (older than the switch) say nothing of an expert bias: the stored one proves it.
    assert ("fails '!(moe_router_enable_expert_bias ?? false)': MixtralForCausalLM's router has no expert bias "
            "(moe_router_enable_expert_bias from the tensors: decoder.layers.mlp.router.expert_bias is stored)") in err, err
    # Args that deny it are contradicted by the tensor.
    args.moe_router_enable_expert_bias = False
    denied = save_megatron(tmp_path_factory.mktemp("moe-bias-denied"), state, args)
    err = run_ckptfs("ls", str(denied), "--map", "auto", check=False).stderr.decode()
    assert "disagrees with the stored tensors on moe_router_enable_expert_bias" in err, err
    # The dense map refuses an MoE config before it looks at tensors.
    err = run_ckptfs("ls", str(folder), "--map", "llama", check=False).stderr.decode()
    assert "fails '(num_experts ?? 0) == 0'" in err, err


def bridge_folder(folder, state, cfg, **fields):
    """A Megatron-Bridge iteration folder: the DCP save and a run_config.yaml whose model:
    section (the provider's fields, as Bridge renders them) says `fields` over the llama
    config `cfg`; a field given as a string is written as the YAML text itself."""
    model = dict(_target_="megatron.bridge.models.llama.llama_provider.LlamaModelProvider",
                 num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                 ffn_hidden_size=cfg.intermediate_size, num_attention_heads=cfg.num_attention_heads,
                 num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, normalization="RMSNorm",
                 layernorm_epsilon="1.0e-06", gated_linear_unit="true",
                 activation_func="\n    _call_: false\n    _target_: torch.nn.functional.silu",
                 add_bias_linear="false", add_qkv_bias="false", qk_layernorm="false",
                 share_embeddings_and_output_weights="false", position_embedding_type="rope", rotary_base=10000,
                 rotary_percent="1.0", seq_length=64, vocab_size=VOCAB, should_pad_vocab="true",
                 make_vocab_size_divisible_by=PADDED, tensor_model_parallel_size=1)
    model.update(fields)
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    lines = ["_target_: megatron.bridge.training.config.ConfigContainer", "model:"]
    lines += [f"  {k}:{v}" if str(v).startswith("\n") else f"  {k}: {v}" for k, v in model.items()]
    (folder / "run_config.yaml").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def llama_state():
    import transformers

    torch.manual_seed(5)
    cfg = hf_config("llama", False)
    sd = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()
    return cfg, sd, megatron_state(sd, cfg)


def refusal(run_ckptfs, folder, *options):
    res = run_ckptfs("ls", str(folder), *options, check=False)
    err = res.stderr.decode()
    assert res.returncode != 0 and len(err.strip().splitlines()) == 1, err
    return err


def test_bridge_config_fields_a_map_must_see(tmp_path, run_ckptfs, llama_state):
    """Fields of a Bridge/NeMo config that change the model reach the map: a sliding window
    given as a list refuses the map; NeMo's Llama 3.1 RoPE scaling (scale_factor and its
    factors, no switch of its own) becomes config.json's rope_scaling."""
    cfg, sd, state = llama_state
    window = bridge_folder(tmp_path / "window", state, cfg, window_size="\n  - 4096\n  - 0")
    err = refusal(run_ckptfs, window, "--map", "auto")
    assert "fails '(window_size ?? null) == null'" in err, err
    scaled = bridge_folder(tmp_path / "scaled", state, cfg, scale_factor="32.0", low_freq_factor="1.0",
                           high_freq_factor="4.0", old_context_len=8192)
    run_ckptfs("export", str(scaled), str(tmp_path / "scaled-hf"), "--map", "auto")
    config = json.loads((tmp_path / "scaled-hf" / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_a_config_that_cannot_be_read_is_named_by_the_map(tmp_path, run_ckptfs, llama_state):
    """A run_config.yaml the reader refuses leaves the tensors served as saved; a map that
    needs the config says why there is none. A field of another type than Bridge writes is no
    crash."""
    cfg, sd, state = llama_state
    folder = bridge_folder(tmp_path / "anchor", state, cfg, num_layers=f"&n {cfg.num_hidden_layers}")
    assert run_ckptfs("ls", str(folder)).returncode == 0
    err = refusal(run_ckptfs, folder, "--map", "auto")
    assert "the checkpoint has no model_config" in err and "run_config.yaml" in err and "anchor" in err, err
    err = refusal(run_ckptfs, folder, "--map", "llama")
    assert "run_config.yaml" in err and "anchor" in err, err
    odd = bridge_folder(tmp_path / "odd", state, cfg, should_pad_vocab="'yes'")
    res = run_ckptfs("info", str(odd), check=False)
    assert res.returncode == 0, res.stderr.decode()


def test_a_lying_layer_axis_is_refused_before_it_is_unstacked(tmp_path, run_ckptfs, llama_state):
    """A stacked tensor whose layer axis claims 10^11 layers (no storage needed: another
    dimension is 0) is refused by its length, not enumerated."""
    cfg, sd, state = llama_state
    lying = dict(state)
    lying["decoder.layers.self_attention.linear_qkv.layer_norm_weight"] = torch.empty(10**11, 0)
    folder = bridge_folder(tmp_path / "lying", lying, cfg)
    err = refusal(run_ckptfs, folder, "--map", "llama")
    assert ("L takes 100000000000 values in [0, 99999999999], the map expects layers = 3 (0 to 2)") in err, err


def test_moe_a_missing_expert_is_refused(tmp_path_factory, run_ckptfs, qwen3_moe):
    """Per-expert keys with one expert's fc1 missing from one layer: refused, never served as a
    model whose expert from_pretrained would fill with random weights."""
    _, model, disk = qwen3_moe
    state = moe_state(disk, model.config, "qwen3_moe", per_expert_keys=True)
    missing = [k for k in state if ".1.mlp.experts.local_experts.1.linear_fc1." in k]
    assert len(missing) == 1
    del state[missing[0]]
    folder = save_megatron(tmp_path_factory.mktemp("moe-missing"), state,
                           megatron_args(model.config, "qwen3", num_layers=2, num_experts=4, moe_router_topk=2,
                                         moe_ffn_hidden_size=40, moe_router_pre_softmax=True,
                                         ffn_hidden_size=model.config.intermediate_size))
    err = refusal(run_ckptfs, folder, "--map", "auto")
    assert "the checkpoint has 7 of the 8 combinations of L, E the map expects" in err, err
