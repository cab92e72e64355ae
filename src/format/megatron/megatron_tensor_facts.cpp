// Facts of a Megatron-core GPT model proved by its stored tensors (megatron_tensor_facts.hpp).
// Key names: doc/MAPS.md, "Facts the tensors prove".
#include "format/megatron/megatron_tensor_facts.hpp"

#include <array>
#include <cctype>
#include <string>
#include <string_view>

namespace ckptfs {
namespace {

using json = nlohmann::json;

// The layer tensors and top-level tensors the facts rest on, by their name inside a decoder
// layer ("decoder.layers.3." per layer, "decoder.layers." stacked) or under the model.
enum LayerName { kQkvWeight, kQkvBias, kQNorm, kKNorm, kProjWeight, kProjBias, kFc1Weight, kRouter, kExpertBias,
                 kLayerNames };
constexpr std::array<std::string_view, kLayerNames> kLayerKeys = {
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "self_attention.q_layernorm.weight",
    "self_attention.k_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    "mlp.linear_fc1.weight",            "mlp.router.weight",              "mlp.router.expert_bias"};
enum TopName { kEmbedding, kOutputLayer, kTopNames };
constexpr std::array<std::string_view, kTopNames> kTopKeys = {"embedding.word_embeddings.weight",
                                                              "output_layer.weight"};

// The first stored tensor of each name (nullptr when there is none), under the model
// prefixes the shipped maps know ("" and NeMo's "module.").
struct ModelTensors {
  std::array<const TensorEntry*, kLayerNames> layer{};
  std::array<const TensorEntry*, kTopNames> top{};
};

ModelTensors FindModelTensors(const Catalog& catalog) {
  constexpr std::string_view kLayers = "decoder.layers.";
  ModelTensors found;
  for (const TensorEntry& t : catalog.tensors) {
    std::string_view k = t.key;
    if (k.starts_with("module.")) k.remove_prefix(7);
    if (k.starts_with(kLayers)) {
      k.remove_prefix(kLayers.size());
      size_t digits = 0;
      while (digits < k.size() && std::isdigit(static_cast<unsigned char>(k[digits]))) ++digits;
      if (digits > 0 && digits < k.size() && k[digits] == '.') k.remove_prefix(digits + 1);
      for (size_t n = 0; n < kLayerNames; ++n)
        if (k == kLayerKeys[n] && !found.layer[n]) found.layer[n] = &t;
    } else {
      for (size_t n = 0; n < kTopNames; ++n)
        if (k == kTopKeys[n] && !found.top[n]) found.top[n] = &t;
    }
  }
  return found;
}

std::string Stored(const TensorEntry* t) { return t->key + " is stored"; }

class Facts {
 public:
  explicit Facts(ModelDescription* model) : model_(*model) {}

  // The tensors prove `field` is `value` (`why` says how). `checked`: a config that says the
  // opposite is a conflict (false for facts a framework may legitimately store otherwise).
  void Prove(const char* field, bool value, std::string why, bool checked = true) {
    const json& stated = model_.Value(field);
    if (stated.is_null()) {
      model_.facts[field] = ModelFact{value, ModelFact::Origin::kTensors, std::move(why)};
    } else if (checked && stated.is_boolean() && stated.get<bool>() != value) {
      model_.conflicts[field] = "the config says " + std::string(stated.get<bool>() ? "true" : "false") + ", but " + why;
    }
  }
  // `field` is true when `stored` is there; false when it is not but `beside` is (`what`
  // names the missing tensor); undecided when neither is.
  void ProveStored(const char* field, const TensorEntry* stored, const TensorEntry* beside, std::string_view what,
                   std::string_view and_also = "", bool checked = true) {
    if (stored)
      Prove(field, true, Stored(stored) + std::string(and_also), checked);
    else if (beside)
      Prove(field, false, "no " + std::string(what) + " is stored beside " + beside->key, checked);
  }
  bool Is(const char* field, bool value) const {
    const json& v = model_.Value(field);
    return v.is_boolean() && v.get<bool>() == value;
  }
  const json& Value(const char* field) const { return model_.Value(field); }

 private:
  ModelDescription& model_;
};

}  // namespace

void AddMegatronTensorFacts(Catalog* catalog) {
  if (!catalog->model || catalog->model->source.empty()) return;
  const ModelTensors t = FindModelTensors(*catalog);
  Facts facts(&*catalog->model);
  const auto& layer = t.layer;

  // Each fact: true when its tensor is stored, false when it is not but the tensor it would
  // sit beside is.
  facts.ProveStored("qk_layernorm", layer[kQNorm] ? layer[kQNorm] : layer[kKNorm], layer[kQkvWeight],
                    "q_layernorm or k_layernorm weight");
  facts.ProveStored("add_bias_linear", layer[kProjBias], layer[kProjWeight], "bias");
  // Megatron gives linear_qkv a bias when add_bias_linear or add_qkv_bias is set: the bias
  // proves add_qkv_bias only in a model without linear biases.
  if (facts.Is("add_bias_linear", false))
    facts.ProveStored("add_qkv_bias", layer[kQkvBias], layer[kQkvWeight], "bias", ", and no other linear bias is");
  facts.ProveStored("moe_router_enable_expert_bias", layer[kExpertBias], layer[kRouter], "expert_bias");
  // A tied output layer is saved under the embedding's key. Not checked against the config:
  // a framework may also store a tied copy, whose values are the embedding's.
  facts.ProveStored("untie_embeddings_and_output_weights", t.top[kOutputLayer], t.top[kEmbedding],
                    "output_layer.weight", "", /*checked=*/false);
  // SwiGLU's linear_fc1 holds the gate and up projections: twice ffn_hidden_size rows
  // (the second-to-last dimension, per layer or stacked).
  const json& ffn = facts.Value("ffn_hidden_size");
  if (const TensorEntry* fc1 = layer[kFc1Weight];
      fc1 && ffn.is_number_integer() && ffn.get<int64_t>() > 0 && fc1->shape.size() >= 2) {
    const uint64_t f = ffn.get<uint64_t>(), rows = fc1->shape[fc1->shape.size() - 2];
    const std::string why = fc1->key + " has " + std::to_string(rows) + " rows and ffn_hidden_size is " + std::to_string(f);
    if (rows % 2 == 0 && rows / 2 == f) facts.Prove("swiglu", true, why + ": gate and up");
    else if (rows == f) facts.Prove("swiglu", false, why);
  }
}

}  // namespace ckptfs
