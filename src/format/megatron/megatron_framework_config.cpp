// Model configs of Megatron-Bridge, NeMo-RL and NeMo 2 checkpoints
// (format/megatron/megatron_framework_config.hpp). Layout facts: doc/FORMATS.md, "Megatron model
// configs".
#include "format/megatron/megatron_framework_config.hpp"

#include <algorithm>

#include <cctype>

#include "codec/yaml_subset.hpp"
#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

constexpr const char* kRunConfig = "run_config.yaml";
constexpr const char* kNemoModelYaml = "context/model.yaml";
constexpr uint64_t kConfigBytes = 16u << 20;

bool IsFile(Env& env, const std::string& path) {
  PathType type;
  return env.Stat(path, &type).ok() && type == PathType::kFile;
}

bool IsFolder(Env& env, const std::string& path) {
  PathType type;
  return env.Stat(path, &type).ok() && type == PathType::kFolder;
}

// The `_target_` of a rendered object ({_target_: torch.bfloat16, _call_: false}), or "".
std::string Target(const json& v) {
  if (v.is_object()) {
    auto it = v.find("_target_");
    if (it != v.end() && it->is_string()) return it->get<std::string>();
  }
  return "";
}

bool IsUnsigned(const json& v) { return v.is_number_integer() && v.get<int64_t>() > 0; }

}  // namespace

std::string ModelFamilyOfClass(std::string_view target) {
  std::string_view base = target.substr(target.rfind('.') == std::string_view::npos ? 0 : target.rfind('.') + 1);
  std::string stem;
  for (char ch : base) stem += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  // The part before the class kind: Llama31ModelProvider8B, Qwen3Config, LlamaModel.
  for (std::string_view kind : {"modelprovider", "provider", "config", "model"}) {
    const size_t at = stem.find(kind);
    if (at != std::string::npos && at > 0) {
      stem.resize(at);
      break;
    }
  }
  auto digits_only = [](std::string_view s) {
    for (char ch : s)
      if (!std::isdigit(static_cast<unsigned char>(ch))) return false;
    return true;
  };
  if (stem.empty() || stem == "gpt" || stem == "mcoregpt") return "";
  for (std::string_view llama : {"codellama", "llama"})
    if (stem.rfind(llama, 0) == 0) {
      std::string_view version = std::string_view(stem).substr(llama.size());
      // Llama 2, 3, 3.1, 3.2, 3.3 are the Llama architecture; Llama 4 is not.
      if (digits_only(version) && (version.empty() || version[0] != '4')) return "llama";
    }
  if (stem == "mistral" || stem == "mixtral") return stem;
  if (stem == "qwen2" || stem == "qwen25") return "qwen2";
  if (stem == "qwen3") return "qwen3";
  if (stem == "qwen3moe") return "qwen3_moe";
  if (stem == "qwen2moe") return "qwen2_moe";
  return stem;
}

json NormaliseMegatronConfig(const json& section, bool nemo) {
  json c = json::object();
  // Every scalar field under its own name: TransformerConfig's names are mostly Megatron-LM's.
  // Short lists of scalars too (NeMo's window_size [4096, 0]), as Megatron-LM's args are kept: a
  // field a map checks must not vanish because of its type.
  auto scalars = [](const json& v) {
    return std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_primitive(); });
  };
  for (auto it = section.begin(); it != section.end(); ++it)
    if (it.key() != "_target_" && (it.value().is_primitive() || (it.value().is_array() && it.value().size() <= 8 &&
                                                                  scalars(it.value()))))
      c[it.key()] = it.value();
  // Dtypes and functions are rendered as {_target_: ...}: kept by name.
  for (const char* name : {"params_dtype", "pipeline_dtype", "autocast_dtype"}) {
    const std::string t = Target(section.value(name, json()));
    if (t.rfind("torch.", 0) == 0 && t != "torch.dtype") c[name] = t.substr(6);
  }
  const std::string activation = Target(section.value("activation_func", json()));
  if (!activation.empty()) c["activation_func"] = activation;

  auto rename = [&](const char* from, const char* to) {
    if (c.contains(from) && !c.contains(to)) c[to] = c[from];
  };
  rename("layernorm_epsilon", "norm_epsilon");
  rename("num_moe_experts", "num_experts");
  rename("layernorm_zero_centered_gamma", "apply_layernorm_1p");
  if (c.contains("share_embeddings_and_output_weights") && c["share_embeddings_and_output_weights"].is_boolean())
    c["untie_embeddings_and_output_weights"] = !c["share_embeddings_and_output_weights"].get<bool>();
  if (c.contains("rope_scaling") && c["rope_scaling"].is_boolean()) c["use_rope_scaling"] = c["rope_scaling"];
  // NeMo's Llama 3.1 / 3.2 configs scale RoPE (llama3 rules) from scale_factor, low_freq_factor,
  // high_freq_factor and old_context_len, with no switch of their own.
  if (c.contains("scale_factor") && c["scale_factor"].is_number() && !c.contains("use_rope_scaling")) {
    c["use_rope_scaling"] = true;
    c["rope_scaling_factor"] = c["scale_factor"];
  }
  if (c.contains("gated_linear_unit") && c["gated_linear_unit"].is_boolean())
    c["swiglu"] = c["gated_linear_unit"].get<bool>() && activation == "torch.nn.functional.silu";
  const json heads = c.value("num_attention_heads", json());
  if (IsUnsigned(heads)) {
    const json groups = c.value("num_query_groups", json());
    if (!IsUnsigned(groups)) c["num_query_groups"] = heads;
    c["group_query_attention"] = IsUnsigned(groups) && groups != heads;
    const json hidden = c.value("hidden_size", json());
    if (!IsUnsigned(c.value("kv_channels", json())) && IsUnsigned(hidden) &&
        hidden.get<int64_t>() % heads.get<int64_t>() == 0)
      c["kv_channels"] = hidden.get<int64_t>() / heads.get<int64_t>();
  }
  // The provider's seq_length is the model's max_sequence_length (its position range).
  if (!c.contains("max_position_embeddings") && IsUnsigned(c.value("seq_length", json())))
    c["max_position_embeddings"] = c["seq_length"];
  // The rows the embedding was built with.
  const json vocab = c.value("vocab_size", json());
  if (IsUnsigned(vocab)) {
    if (nemo) {
      // NeMo builds the model with a config's vocab_size as it is (the tokenizer's size padded
      // only when it is null); which rows are tokens is then the tokenizer's to say.
      c["padded_vocab_size"] = vocab;
    } else if (c.value("should_pad_vocab", json()) == true) {
      const json divisor = c.value("make_vocab_size_divisible_by", json());
      const json tp = c.value("tensor_model_parallel_size", json(1));
      uint64_t multiple = 0, padded = 0;
      if (IsUnsigned(divisor) && IsUnsigned(tp) &&
          CheckedMul(divisor.get<uint64_t>(), tp.get<uint64_t>(), &multiple) &&
          CheckedAdd(vocab.get<uint64_t>(), multiple - 1, &padded))
        c["padded_vocab_size"] = padded / multiple * multiple;
    } else {
      c["padded_vocab_size"] = vocab;
    }
  }
  return c;
}

bool IsNemo2Checkpoint(Env& env, const std::string& dir) {
  return IsFolder(env, JoinPath(dir, "weights")) && IsFolder(env, JoinPath(dir, "context"));
}

Status AddFrameworkModelConfig(Env& env, const std::string& dir, const std::string& folder, ModelDescription* model,
                               std::string* framework) {
  framework->clear();
  std::string path, source, section_name;
  bool nemo = false;
  if (IsFile(env, JoinPath(folder, kRunConfig))) {
    path = JoinPath(folder, kRunConfig);
    *framework = "Megatron-Bridge";
    section_name = "model";
    source = std::string(kRunConfig) + " model:";
  } else if (folder == JoinPath(dir, "weights") && IsNemo2Checkpoint(env, dir)) {
    *framework = "NeMo 2";
    if (!IsFile(env, JoinPath(dir, kNemoModelYaml))) {
      model->error = JoinPath(dir, kNemoModelYaml) + ": not found (NeMo 2's context/ holds the model's config there)";
      return Status::OK();
    }
    path = JoinPath(dir, kNemoModelYaml);
    section_name = "config";
    source = kNemoModelYaml;
    nemo = true;
  } else {
    return Status::OK();
  }
  std::string text;
  json doc;
  Status s = env.ReadSmallFile(path, kConfigBytes, &text, "a model config file");
  if (s.ok()) s = ParseYamlSubset(text, path, &doc);
  if (s.ok() && !(doc.is_object() && doc.contains(section_name) && doc[section_name].is_object()))
    s = Status::Corruption(path, "no '" + section_name + ":' mapping at the top level");
  if (!s.ok()) {
    // Reading failed for a reason of the file (I/O errors are errors of the source).
    if (s.code() == Status::Code::kIOError) return s;
    model->error = s.message();
    return Status::OK();
  }
  const json& section = doc[section_name];
  std::string target = Target(section);
  if (nemo && ModelFamilyOfClass(target).empty()) target = Target(doc);  // GPTConfig inside a LlamaModel
  const json config = NormaliseMegatronConfig(section, nemo);
  for (const auto& [name, value] : config.items()) model->SetFromConfig(name, value);
  model->source = source;
  if (!target.empty()) {
    model->model_class = target;
    model->family = ModelFamilyOfClass(target);
  }
  return Status::OK();
}

}  // namespace ckptfs
