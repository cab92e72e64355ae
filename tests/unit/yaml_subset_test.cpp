// The YAML-subset reader (codec/yaml_subset.hpp) on the forms PyYAML's block style writes and on
// what it refuses, and the Megatron model-config normalisation built on it
// (format/megatron/megatron_framework_config.hpp). The full files come from
// tests/frameworks/make_megatron_gpt.py.
#define BOOST_TEST_MODULE yaml_subset
#include <boost/test/unit_test.hpp>

#include <cmath>
#include <string>

#include "codec/yaml_subset.hpp"
#include "format/megatron/megatron_framework_config.hpp"

using ckptfs::ParseYamlSubset;
using ckptfs::Status;
using json = nlohmann::json;

namespace {

json Parse(const std::string& text) {
  json out;
  const Status s = ParseYamlSubset(text, "run_config.yaml", &out);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  return out;
}

// The one-line refusal of `text`.
std::string Refusal(const std::string& text, ckptfs::YamlLimits limits = {}) {
  json out = "untouched";
  const Status s = ParseYamlSubset(text, "cfg.yaml", &out, limits);
  BOOST_REQUIRE_MESSAGE(!s.ok(), "accepted: " + text);
  BOOST_CHECK_EQUAL(out, json("untouched"));
  BOOST_CHECK(s.message().find('\n') == std::string::npos);
  BOOST_CHECK(s.message().rfind("cfg.yaml: ", 0) == 0);
  return s.message();
}

}  // namespace

BOOST_AUTO_TEST_CASE(pyyaml_block_style) {
  // What yaml.safe_dump(default_flow_style=False) writes for a Bridge ConfigContainer.
  const json doc = Parse(
      "_target_: megatron.bridge.training.config.ConfigContainer\n"
      "model:\n"
      "  _target_: megatron.bridge.models.llama.llama_provider.Llama31ModelProvider8B\n"
      "  activation_func:\n"
      "    _call_: false\n"
      "    _target_: torch.nn.functional.silu\n"
      "  attention_backend:\n"
      "    _args_:\n"
      "    - 5\n"
      "    _call_: true\n"
      "  cuda_graph_scope: []\n"
      "  config_logger_dir: ''\n"
      "  layernorm_epsilon: 1.0e-05\n"
      "  init_method_std: 0.02\n"
      "  num_layers: 32\n"
      "  num_query_groups: 8\n"
      "  rotary_base: 500000\n"
      "  moe_layer_freq: 1\n"
      "  seq_len_interpolation_factor: null\n"
      "  tp_comm_overlap_cfg: {}\n"
      "  pipeline_dtype: ~\n"
      "train:\n"
      "  train_iters: 10   # a comment\n"
      "# a whole-line comment\n"
      "\n"
      "list_of_maps:\n"
      "- name: a\n"
      "  value: 1\n"
      "- name: b\n"
      "  value: [1, 2.5, x, 'q', \"d\"]\n"
      "- - nested\n"
      "  - 2\n"
      "- plain\n");
  const json& m = doc["model"];
  BOOST_CHECK_EQUAL(m["_target_"], "megatron.bridge.models.llama.llama_provider.Llama31ModelProvider8B");
  BOOST_CHECK_EQUAL(m["activation_func"]["_target_"], "torch.nn.functional.silu");
  BOOST_CHECK_EQUAL(m["activation_func"]["_call_"], false);
  BOOST_CHECK_EQUAL(m["attention_backend"]["_args_"], json::array({5}));
  BOOST_CHECK_EQUAL(m["cuda_graph_scope"], json::array());
  BOOST_CHECK_EQUAL(m["tp_comm_overlap_cfg"], json::object());
  BOOST_CHECK_EQUAL(m["config_logger_dir"], "");
  BOOST_CHECK(m["layernorm_epsilon"].is_number_float());
  BOOST_CHECK_CLOSE(m["layernorm_epsilon"].get<double>(), 1e-5, 1e-9);
  BOOST_CHECK_EQUAL(m["num_layers"], 32);
  BOOST_CHECK(m["num_layers"].is_number_integer());
  BOOST_CHECK(m["seq_len_interpolation_factor"].is_null());
  BOOST_CHECK(m["pipeline_dtype"].is_null());
  BOOST_CHECK_EQUAL(doc["train"]["train_iters"], 10);
  const json& l = doc["list_of_maps"];
  BOOST_REQUIRE_EQUAL(l.size(), 4u);
  BOOST_CHECK_EQUAL(l[0], json({{"name", "a"}, {"value", 1}}));
  BOOST_CHECK_EQUAL(l[1]["value"], json::parse(R"([1, 2.5, "x", "q", "d"])"));
  BOOST_CHECK_EQUAL(l[2], json::parse(R"(["nested", 2])"));
  BOOST_CHECK_EQUAL(l[3], "plain");
}

BOOST_AUTO_TEST_CASE(scalars_resolve_as_pyyaml_does) {
  const json d = Parse(
      "a: yes\nb: Off\nc: 0x1F\nd: 017\ne: -12\nf: 1_000\ng: 1e5\nh: 1.0e+5\ni: .5\nj: -.inf\nk: 3.\n"
      "l: 12:30\nm: '007'\nn: \"tab\\there \\u00e9\"\no: 'it''s'\np: http://x/y#frag\nq: 9223372036854775807\n"
      "r: -9223372036854775808\ns: NULL\nt: True\n");
  BOOST_CHECK_EQUAL(d["a"], true);
  BOOST_CHECK_EQUAL(d["b"], false);
  BOOST_CHECK_EQUAL(d["c"], 31);
  BOOST_CHECK_EQUAL(d["d"], 15);  // YAML 1.1 octal
  BOOST_CHECK_EQUAL(d["e"], -12);
  BOOST_CHECK_EQUAL(d["f"], 1000);
  BOOST_CHECK_EQUAL(d["g"], "1e5");  // PyYAML's float needs a dot or a signed exponent
  BOOST_CHECK_EQUAL(d["h"].get<double>(), 1e5);
  BOOST_CHECK_EQUAL(d["i"].get<double>(), 0.5);
  BOOST_CHECK(std::isinf(d["j"].get<double>()) && d["j"].get<double>() < 0);
  BOOST_CHECK_EQUAL(d["k"].get<double>(), 3.0);
  BOOST_CHECK_EQUAL(d["l"], "12:30");
  BOOST_CHECK_EQUAL(d["m"], "007");
  BOOST_CHECK_EQUAL(d["n"], "tab\there \xC3\xA9");
  BOOST_CHECK_EQUAL(d["o"], "it's");
  BOOST_CHECK_EQUAL(d["p"], "http://x/y#frag");
  BOOST_CHECK_EQUAL(d["q"], INT64_MAX);
  BOOST_CHECK_EQUAL(d["r"], INT64_MIN);
  BOOST_CHECK(d["s"].is_null());
  BOOST_CHECK_EQUAL(d["t"], true);
}

BOOST_AUTO_TEST_CASE(long_scalars_folded_over_lines) {
  // PyYAML wraps long strings at 80 columns: plain and quoted continuations.
  const json d = Parse(
      "description: a long plain text that PyYAML\n"
      "  wrapped onto a second line\n"
      "quoted: \"first half and\n"
      "  second half\"\n"
      "escaped: \"no\\\n"
      "  space\"\n"
      "next: 1\n");
  BOOST_CHECK_EQUAL(d["description"], "a long plain text that PyYAML wrapped onto a second line");
  BOOST_CHECK_EQUAL(d["quoted"], "first half and second half");
  BOOST_CHECK_EQUAL(d["escaped"], "nospace");
  BOOST_CHECK_EQUAL(d["next"], 1);
}

BOOST_AUTO_TEST_CASE(quoted_scalar_over_many_lines) {
  // The closing quote is looked for in each new line only; '' pairs stay one quote.
  std::string text = "q: 'it''s";
  std::string expect = "it's";
  for (int i = 0; i < 5000; ++i) {
    text += "\n  w" + std::to_string(i);
    expect += " w" + std::to_string(i);
  }
  text += " ''end'''\nnext: 2\n";
  expect += " 'end'";
  const json d = Parse(text);
  BOOST_CHECK_EQUAL(d["q"], expect);
  BOOST_CHECK_EQUAL(d["next"], 2);
}

BOOST_AUTO_TEST_CASE(documents_and_empty) {
  BOOST_CHECK(Parse("").is_null());
  BOOST_CHECK(Parse("# only a comment\n").is_null());
  BOOST_CHECK_EQUAL(Parse("---\na: 1\n...\n"), json({{"a", 1}}));
  BOOST_CHECK_EQUAL(Parse("a:\nb: 2\n"), json::parse(R"({"a": null, "b": 2})"));
  BOOST_CHECK_EQUAL(Parse("a:\n- 1\n- 2\nb: x\n"), json::parse(R"({"a": [1, 2], "b": "x"})"));
  BOOST_CHECK_EQUAL(Parse("\"quoted key\": 1\n'k2': 2\n"), json::parse(R"({"quoted key": 1, "k2": 2})"));
}

BOOST_AUTO_TEST_CASE(refusals_name_the_line) {
  BOOST_CHECK_EQUAL(Refusal("a: 1\nb: &anchor 2\n"), "cfg.yaml: line 2: an anchor ('&') is not read");
  BOOST_CHECK_EQUAL(Refusal("a: *anchor\n"), "cfg.yaml: line 1: an alias ('*') is not read");
  BOOST_CHECK_EQUAL(Refusal("a: !!python/object:x {}\n"), "cfg.yaml: line 1: a tag ('!') is not read");
  BOOST_CHECK_EQUAL(Refusal("a: |\n  text\n"), "cfg.yaml: line 1: a block scalar ('|') is not read");
  BOOST_CHECK_EQUAL(Refusal("a: 1\na: 2\n"), "cfg.yaml: line 2: the key 'a' appears twice in one mapping");
  BOOST_CHECK_EQUAL(Refusal("a:\n\tb: 1\n"), "cfg.yaml: line 2: a tab in the indentation");
  BOOST_CHECK_EQUAL(Refusal("a: 1\n---\nb: 2\n"), "cfg.yaml: line 2: a second document (one is read)");
  BOOST_CHECK_EQUAL(Refusal("? complex\n: v\n"), "cfg.yaml: line 1: a complex mapping key ('?') is not read");
  BOOST_CHECK_EQUAL(Refusal("a:\n    b: 1\n  c: 2\n"), "cfg.yaml: line 3: indented deeper than its mapping's keys");
  BOOST_CHECK_EQUAL(Refusal("a: 1\n  b: 2\n"), "cfg.yaml: line 2: a mapping or sequence inside a scalar's continuation");
  BOOST_CHECK_EQUAL(Refusal("a: [1, 2\n"), "cfg.yaml: line 1: a flow collection that does not end on its line");
  BOOST_CHECK_EQUAL(Refusal("a: \"open\nb: 1\n"), "cfg.yaml: line 1: a quoted scalar that does not end");
  BOOST_CHECK_EQUAL(Refusal("a: 99999999999999999999\n"), "cfg.yaml: line 1: an integer out of the 64-bit range");
  BOOST_CHECK_EQUAL(Refusal("%YAML 1.1\n---\na: 1\n"), "cfg.yaml: line 1: a directive ('%') is not read");
  BOOST_CHECK_EQUAL(Refusal("a: \"\\q\"\n"), "cfg.yaml: line 1: the escape '\\q' is not read");
  BOOST_CHECK_EQUAL(Refusal("- a\nb: 1\n"), "cfg.yaml: line 2: a line outside the document's structure (its indentation)");
}

BOOST_AUTO_TEST_CASE(limits) {
  std::string deep;
  for (int d = 0; d < 10; ++d) deep += std::string(2 * d, ' ') + "k:\n";
  deep += std::string(20, ' ') + "v: 1\n";
  ckptfs::YamlLimits tight;
  tight.depth = 4;
  BOOST_CHECK(Refusal(deep, tight).find("nested deeper than 4 levels") != std::string::npos);
  tight = {};
  tight.nodes = 3;
  BOOST_CHECK(Refusal("a: 1\nb: 2\nc: 3\nd: 4\n", tight).find("more than 3 values") != std::string::npos);
  tight = {};
  tight.bytes = 4;
  BOOST_CHECK_EQUAL(Refusal("a: 12\n", tight), "cfg.yaml: is 6 bytes, over the limit of 4 for a YAML file");
}

BOOST_AUTO_TEST_CASE(model_config_normalised_to_megatron_lm_names) {
  const json section = json::parse(R"({
    "_target_": "megatron.bridge.models.qwen.qwen_provider.Qwen3ModelProvider",
    "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": null,
    "layernorm_epsilon": 1e-6, "share_embeddings_and_output_weights": true, "gated_linear_unit": true,
    "activation_func": {"_target_": "torch.nn.functional.silu", "_call_": false},
    "params_dtype": {"_target_": "torch.bfloat16", "_call_": false}, "num_moe_experts": null,
    "vocab_size": 200, "should_pad_vocab": true, "make_vocab_size_divisible_by": 128,
    "tensor_model_parallel_size": 2, "seq_length": 4096, "rope_scaling": false,
    "layernorm_zero_centered_gamma": false})");
  const json c = ckptfs::NormaliseMegatronConfig(section, false);
  BOOST_CHECK_EQUAL(c["norm_epsilon"], 1e-6);
  BOOST_CHECK_EQUAL(c["untie_embeddings_and_output_weights"], false);
  BOOST_CHECK_EQUAL(c["swiglu"], true);
  BOOST_CHECK_EQUAL(c["params_dtype"], "bfloat16");
  BOOST_CHECK_EQUAL(c["group_query_attention"], true);
  BOOST_CHECK_EQUAL(c["kv_channels"], 16);
  BOOST_CHECK_EQUAL(c["padded_vocab_size"], 256);
  BOOST_CHECK_EQUAL(c["max_position_embeddings"], 4096);
  BOOST_CHECK_EQUAL(c["use_rope_scaling"], false);
  BOOST_CHECK_EQUAL(c["apply_layernorm_1p"], false);
  BOOST_CHECK(c["num_experts"].is_null());
  BOOST_CHECK(!c.contains("_target_"));
  // Gated GELU is no SwiGLU; no num_query_groups is multi-head attention; NeMo keeps its
  // vocab_size as the rows.
  json other = section;
  other["activation_func"]["_target_"] = "torch.nn.functional.gelu";
  other["num_query_groups"] = nullptr;
  const json n = ckptfs::NormaliseMegatronConfig(other, true);
  BOOST_CHECK_EQUAL(n["swiglu"], false);
  BOOST_CHECK_EQUAL(n["num_query_groups"], 4);
  BOOST_CHECK_EQUAL(n["group_query_attention"], false);
  BOOST_CHECK_EQUAL(n["padded_vocab_size"], 200);
  // A short list a map checks is kept (NeMo's sliding window); NeMo's Llama 3.1 RoPE scaling
  // turns scaling on; a should_pad_vocab that is no boolean pads nothing.
  json nemo = section;
  nemo.erase("rope_scaling");
  nemo["window_size"] = json::array({4096, 0});
  nemo["scale_factor"] = 8.0;
  nemo["should_pad_vocab"] = "yes";
  const json w = ckptfs::NormaliseMegatronConfig(nemo, false);
  BOOST_CHECK_EQUAL(w["window_size"], json::array({4096, 0}));
  BOOST_CHECK_EQUAL(w["use_rope_scaling"], true);
  BOOST_CHECK_EQUAL(w["rope_scaling_factor"], 8.0);
  BOOST_CHECK_EQUAL(w["padded_vocab_size"], 200);
}

BOOST_AUTO_TEST_CASE(model_family_of_classes) {
  using ckptfs::ModelFamilyOfClass;
  BOOST_CHECK_EQUAL(ModelFamilyOfClass("megatron.bridge.models.llama.llama_provider.Llama31ModelProvider8B"), "llama");
  BOOST_CHECK_EQUAL(ModelFamilyOfClass("megatron.bridge.models.llama.llama_provider.CodeLlamaModelProvider7B"), "llama");
  BOOST_CHECK_EQUAL(ModelFamilyOfClass("nemo.collections.llm.gpt.model.llama.LlamaModel"), "llama");
  BOOST_CHECK_EQUAL(ModelFamilyOfClass("nemo.collections.llm.gpt.model.llama.Llama4Experts16Config"), "llama4experts16");
  BOOST_CHECK_EQUAL(ModelFamilyOfClass("megatron.bridge.models.qwen.qwen_provider.Qwen25ModelProvider7B"), "qwen2");
  BOOST_CHECK_EQUAL(ModelFamilyOfClass("nemo.collections.llm.gpt.model.qwen3.Qwen3Config"), "qwen3");
  BOOST_CHECK_EQUAL(ModelFamilyOfClass("megatron.bridge.models.qwen.qwen_provider.Qwen3MoEModelProvider30B_A3B"), "qwen3_moe");
  BOOST_CHECK_EQUAL(ModelFamilyOfClass("nemo.collections.llm.gpt.model.mixtral.MixtralConfig8x7B"), "mixtral");
  BOOST_CHECK_EQUAL(ModelFamilyOfClass("megatron.bridge.models.mistral.mistral_provider.MistralModelProvider"), "mistral");
  BOOST_CHECK_EQUAL(ModelFamilyOfClass("megatron.bridge.models.gpt_provider.GPTModelProvider"), "");
  BOOST_CHECK_EQUAL(ModelFamilyOfClass("nemo.collections.llm.gpt.model.base.GPTConfig126M"), "");
  BOOST_CHECK_EQUAL(ModelFamilyOfClass("nemo.collections.llm.gpt.model.gemma2.Gemma2Config2B"), "gemma2");
}
