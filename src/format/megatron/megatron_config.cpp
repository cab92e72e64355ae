// Megatron-LM's args from common.pt as model_config (megatron_config.hpp). The pickle is
// decoded by the torch reader (nothing is run); only the Namespace's plain values are taken.
#include "format/megatron/megatron_config.hpp"

#include "format/readers.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

// The args a key map or a Hugging Face config needs (Megatron-LM's names).
constexpr const char* kModelFields[] = {
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "add_qkv_bias", "add_bias_linear", "qk_layernorm",
    "untie_embeddings_and_output_weights", "rotary_base", "rotary_percent", "rotary_interleaved",
    "use_rope_scaling", "rope_scaling_factor", "position_embedding_type", "normalization", "swiglu",
    "padded_vocab_size", "vocab_size", "norm_epsilon", "max_position_embeddings", "seq_length",
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "bf16", "fp16", "make_vocab_size_divisible_by",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "window_size", "apply_layernorm_1p",
    "init_method_std", "multi_latent_attention", "mtp_num_layers", "attention_output_gate",
    "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
    "moe_router_num_groups", "moe_router_group_topk", "moe_aux_loss_coeff", "moe_grouped_gemm",
};

// torch.bfloat16 (a pickled global) -> "bfloat16".
json DTypeName(const json& v) {
  if (v.is_object() && v.contains("$global") && v["$global"].is_string()) {
    std::string name = v["$global"];
    if (name.starts_with("torch.")) return name.substr(6);
  }
  return nullptr;
}

}  // namespace

void AddMegatronModelConfig(const std::string& dir, const ReadLimits& limits, Catalog* catalog) {
  if (catalog->model && !catalog->model->source.empty()) return;  // the framework's own config came first
  Env& env = catalog->files->env();
  const std::string path = JoinPath(dir, "common.pt");
  PathType type;
  if (!env.Stat(path, &type).ok() || type != PathType::kFile) return;
  Catalog scratch;
  scratch.files = std::make_shared<SourceFiles>(catalog->files->shared_env());
  json common;
  if (Status s = ReadTorchZip(path, &scratch, &common, limits); !s.ok()) {
    if (!catalog->model) catalog->model.emplace();
    catalog->model->error = s.message();
    return;
  }
  if (!common.is_object() || !common.contains("args")) return;
  const json& args = common["args"];
  if (!args.is_object() || args.value("$class", json()) != "argparse.Namespace" || !args.contains("state") ||
      !args["state"].is_object())
    return;
  const json& state = args["state"];
  json config = json::object();
  for (const char* field : kModelFields) {
    if (!state.contains(field)) continue;
    const json& v = state[field];
    if (v.is_primitive()) config[field] = v;
    // window_size is a (left, right) tuple, which the decoder gives as a list.
    else if (v.is_array() && v.size() <= 8) config[field] = v;
  }
  if (state.contains("params_dtype")) config["params_dtype"] = DTypeName(state["params_dtype"]);
  if (config.empty()) return;
  if (!catalog->model) catalog->model.emplace();
  for (const auto& [name, value] : config.items()) catalog->model->SetFromConfig(name, value);
  catalog->model->source = "common.pt args";
}

}  // namespace ckptfs
