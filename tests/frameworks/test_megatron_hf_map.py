"""Megatron GPT checkpoints written by megatron-core 0.16.1 itself (CPU, gloo; the `megatron16`
overlay, make_megatron_gpt.py) from tiny Hugging Face models, served through the shipped key
maps (`-o map=auto`, doc/MAPS.md) as the Hugging Face model they came from: from_pretrained of
the mount loads with no missing or unexpected key, every tensor equals the HF model's state
dict bit for bit and its logits are those of the HF model's own folder loaded the same way, bit
for bit. The round trip is the reference because
Megatron-Bridge's exporter cannot run without Transformer Engine; the generator checks that
mbridge's own Megatron -> HF conversion of the same DCP tensors gives that state dict too, and
that Megatron's forward agrees with the HF logits.

Cases: Llama-like (GQA, SwiGLU, RoPE, untied) at TP2, Llama tied at TP2+PP2, Qwen2 (QKV biases)
and Qwen3 (q/k norms, head_dim != hidden / heads) at TP2; mixtures of experts (SequentialMLP
experts, tensor-parallel, the allgather dispatcher): Mixtral-like at TP2 with expert parallel 2
(renormalized top-k routing) and Qwen3-MoE-like at TP2 (q/k norms, top k of the full softmax:
norm_topk_prob false). Layouts: Megatron-LM's run folder
(config: common.pt args), Megatron-Bridge's (run_config.yaml), NeMo 2's (weights/ keyed
`module.` + context/model.yaml) and NeMo-RL's step folder (policy/weights/iter_0000000)."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptfs_testlib import assert_bitwise_equal, assert_same_logits, cached_fixtures_or_fail, causal_lm, logits_of

GENERATOR = Path(__file__).resolve().parent / "make_megatron_gpt.py"
CASES = ("llama", "llama_tied_pp2", "qwen2", "qwen3", "mixtral", "qwen3_moe")
LAYOUTS = ("megatron_lm", "bridge", "nemo2", "nemo_rl")
# What each layout's model_config comes from, and the framework the DCP reader recognises.
CONFIG_SOURCES = {"megatron_lm": "common.pt args", "bridge": "run_config.yaml model:",
                  "nemo2": "context/model.yaml", "nemo_rl": "run_config.yaml model:"}
FRAMEWORKS = {"bridge": "Megatron-Bridge", "nemo2": "NeMo 2", "nemo_rl": "NeMo-RL"}


@pytest.fixture(scope="module")
def gpt_root() -> Path:
    # Six cases, 2 and 4 gloo ranks of megatron-core: 30-40 s once per machine.
    return cached_fixtures_or_fail(GENERATOR, overlay="megatron16",
                                   timeout_s=900)


class Case:
    def __init__(self, root: Path, name: str):
        self.name = name
        self.dir = root / name
        self.fixture = json.loads((self.dir / "fixture.json").read_text())
        self.reference = load_file(self.dir / "reference" / "model.safetensors")
        self.hf_config = json.loads((self.dir / "reference" / "config.json").read_text())
        logits = load_file(self.dir / "reference" / "logits.safetensors")
        self.input_ids, self.logits = logits["input_ids"], logits["logits"]
        self.family = self.fixture["family"]
        self.vocab = self.fixture["vocab"]

    def source(self, layout: str) -> Path:
        if layout == "nemo2":
            return self.dir / "nemo2" / self.fixture["nemo_name"]
        if layout == "nemo_rl":
            return self.dir / "nemo_rl" / "step_1"
        return self.dir / layout


@pytest.fixture(scope="module", params=CASES)
def case(request, gpt_root) -> Case:
    return Case(gpt_root, request.param)


def served_rows(name: str, case: Case, layout: str) -> int | None:
    if layout == "nemo2" and name in ("model.embed_tokens.weight", "lm_head.weight"):
        return case.fixture["padded_vocab"]
    return None


def check_tensors(served: dict, case: Case, layout: str) -> None:
    assert set(served) == set(case.reference), (sorted(set(served) ^ set(case.reference)))
    for name, want in case.reference.items():
        got = served[name]
        rows = served_rows(name, case, layout)
        if rows is not None:
            assert got.shape[0] == rows, (name, got.shape)
            got = got[: case.vocab]
        assert_bitwise_equal(got, want, f"{layout}: {name}")


def test_fixture_is_the_models_round_trip(case):
    """What the other tests rely on: megatron-core saved stacked, fused tensors (the map has
    work to do) and its forward agreed with the HF model; mbridge's conversion of the saved
    tensors gave the HF state dict."""
    dcp = case.fixture["cross_check"]["dcp"]
    qkv = dcp["decoder.layers.self_attention.linear_qkv.weight"]
    groups, heads, head_dim = case.fixture["groups"], case.fixture["heads"], case.fixture["head_dim"]
    assert qkv == [case.fixture["layers"], (heads + 2 * groups) * head_dim, case.fixture["hidden"]]
    if "experts" in case.fixture:  # experts stacked per layer, then per expert
        f = case.fixture
        assert dcp["decoder.layers.mlp.router.weight"] == [f["layers"], f["experts"], f["hidden"]]
        assert dcp["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == \
            [f["layers"], f["experts"], 2 * f["moe_ffn"], f["hidden"]]
        assert dcp["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == \
            [f["layers"], f["experts"], f["hidden"], f["moe_ffn"]]
        assert "decoder.layers.mlp.linear_fc1.weight" not in dcp
    else:
        assert dcp["decoder.layers.mlp.linear_fc1.weight"][1] == 2 * case.fixture["ffn"]
    assert dcp["embedding.word_embeddings.weight"][0] == case.fixture["padded_vocab"] > case.vocab
    assert ("output_layer.weight" in dcp) == (not case.fixture["tied"])
    assert case.fixture["megatron_logits"]["max_abs_diff_vs_hf"] < 1e-4
    assert case.fixture["cross_check"]["mbridge_equal"] == len(case.reference)


def test_from_pretrained_of_the_mount(case, mounts):
    """Megatron-LM's run folder mounted with -o map=auto: from_pretrained loads it with no
    missing or unexpected key, the tensors and the logits are the HF model's, bit for bit."""
    import transformers

    mnt = mounts.mount(case.source("megatron_lm"), None, "-o", "map=auto")
    config = json.loads((mnt / "config.json").read_text())
    assert config["model_type"] == case.family
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rms_norm_eps"):
        assert config[key] == case.hf_config[key], key
    # The MoE settings as transformers reads them (5.x stores Qwen3-MoE's num_experts under
    # num_local_experts; its attribute map answers both names).
    moe_keys = {"mixtral": ("num_local_experts", "num_experts_per_tok"),
                "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                              "decoder_sparse_step", "mlp_only_layers")}
    if case.family in moe_keys:
        served = transformers.AutoConfig.from_pretrained(mnt)
        want = transformers.AutoConfig.from_pretrained(case.dir / "reference")
        for key in moe_keys[case.family]:
            assert getattr(served, key) == getattr(want, key), key
    if case.family in ("qwen3", "qwen3_moe"):
        assert config["head_dim"] == case.hf_config["head_dim"] != case.fixture["hidden"] // case.fixture["heads"]
    model, info = causal_lm(mnt, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model).__name__ == case.hf_config["architectures"][0]
    check_tensors(load_file(mnt / "model.safetensors"), case, "megatron_lm")
    # The reference: the HF model's own save_pretrained folder, loaded here the same way.
    assert_same_logits(model, case.dir / "reference", case.input_ids, "logits of the mount vs the HF folder")
    # The generator's logits come from the model it built in memory, in another process (with
    # its own thread count and kernels): they tie the reference folder to the model Megatron's
    # forward was checked against, up to float rounding, not bit for bit.
    torch.testing.assert_close(logits_of(model, case.input_ids), case.logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", ("bridge", "nemo2", "nemo_rl"))
def test_framework_layouts_served_the_same(case, layout, run_ckptfs, tmp_path):
    """Bridge, NeMo 2 and NeMo-RL saves of the same weights, exported with the map (no mount):
    the same HF tensors and config."""
    out = tmp_path / "hf"
    run_ckptfs("export", str(case.source(layout)), str(out), "--map", "auto")
    check_tensors(load_file(out / "model.safetensors"), case, layout)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == case.family
    assert config["num_key_value_heads"] == case.hf_config["num_key_value_heads"]
    assert config["tie_word_embeddings"] == case.hf_config["tie_word_embeddings"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_info_says_which_map_and_why(case, layout, run_ckptfs):
    text = run_ckptfs("info", str(case.source(layout)), "--map", "auto").stdout.decode()
    lines = [line for line in text.splitlines() if line.startswith("map:")]
    assert len(lines) == 1 and re.match(rf"map:\s+{case.family} \(.+\)$", lines[0]), text
    info = json.loads(run_ckptfs("info", "--json", str(case.source(layout)), "--map", "auto").stdout)
    assert info["map"]["name"] == case.family and info["map"]["reason"], info["map"]
    assert info["map"]["parameters"], info["map"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_detected_with_their_model_config(gpt_root, layout, run_ckptfs):
    """Without a map: each layout is read as DCP, its model config found where its framework
    writes it, normalised to Megatron-LM's argument names (doc/FORMATS.md)."""
    case = Case(gpt_root, "qwen3")
    metadata = json.loads(run_ckptfs("cat", str(case.source(layout)), "metadata.json").stdout)
    assert metadata["model_config_source"] == CONFIG_SOURCES[layout]
    if layout in FRAMEWORKS:
        assert metadata["dcp"]["framework"] == FRAMEWORKS[layout]
        assert metadata["model_family"] == "qwen3"
    if layout == "nemo_rl":
        assert metadata["dcp"]["step_folder"] == "policy/weights/iter_0000000"
    c = metadata["model_config"]
    f = case.fixture
    assert (c["num_layers"], c["hidden_size"], c["num_attention_heads"], c["num_query_groups"], c["kv_channels"]) == \
        (f["layers"], f["hidden"], f["heads"], f["groups"], f["head_dim"])
    assert c["qk_layernorm"] is True and c["add_qkv_bias"] is False and c["swiglu"] is True
    assert c["untie_embeddings_and_output_weights"] is True
    assert c["normalization"] == "RMSNorm" and c["position_embedding_type"] == "rope"
    assert c["padded_vocab_size"] == f["padded_vocab"]
    assert c["vocab_size"] == (f["padded_vocab"] if layout == "nemo2" else f["vocab"])
    # The tensors are served as saved (NeMo 2 under its module. prefix).
    keys = {e["key"] for e in json.loads(run_ckptfs("ls", "--json", str(case.source(layout))).stdout)}
    prefix = "module." if layout == "nemo2" else ""
    assert prefix + "decoder.layers.self_attention.linear_qkv.weight" in keys, sorted(keys)


def one_line_refusal(res, *needles) -> str:
    err = res.stderr if hasattr(res, "stderr") else res.stderr_bytes
    err = (err.decode() if isinstance(err, bytes) else err).strip()
    assert res.returncode not in (0, None), res
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_wrong_head_count_refused(gpt_root, run_ckptfs, mounts, tmp_path):
    """A config whose query groups disagree with the QKV rows: refused at mount in one line
    naming the tensor, from a damaged common.pt and from an override alike."""
    damaged = gpt_root / "variants" / "llama_wrong_groups"
    one_line_refusal(run_ckptfs("ls", str(damaged), "--map", "auto", check=False), "linear_qkv")
    llama = Case(gpt_root, "llama").source("megatron_lm")
    one_line_refusal(run_ckptfs("ls", str(llama), "--map", "auto", "--map.num_query_groups=4", check=False),
                     "linear_qkv")
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    res = mounts.start([mounts.binary, damaged, mountpoint, "-o", "map=auto"], mountpoint)
    one_line_refusal(res, "linear_qkv")
    assert not any(mountpoint.iterdir())


def test_moe_mismatches_refused(gpt_root, run_ckptfs):
    """Real MoE saves under parameters that disagree with them: an expert count or an expert
    width the tensors do not have is refused naming the expert tensor; a routing Mixtral cannot
    express (top k of the full softmax) is refused naming the config check."""
    mixtral = Case(gpt_root, "mixtral").source("megatron_lm")

    def ls(*options):
        return run_ckptfs("ls", str(mixtral), "--map", "auto", *options, check=False)

    one_line_refusal(ls("--map.num_experts=8"), "experts.linear_fc1.weight", "experts = 8")
    one_line_refusal(ls("--map.moe_ffn_hidden_size=16"), "experts.linear_fc1.weight", "[32, 64]")
    one_line_refusal(ls("--map.moe_router_pre_softmax=true"), "moe_router_pre_softmax")
    # The same save as it is: served.
    assert ls().returncode == 0
