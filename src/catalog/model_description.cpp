// The model description's values and its place in metadata.json (model_description.hpp).
#include "ckptfs/model_description.hpp"

#include <utility>

namespace ckptfs {

using json = nlohmann::json;

json ModelDescription::Config() const {
  json config = json::object();
  for (const auto& [name, fact] : facts) config[name] = fact.value;
  return config;
}

void ModelDescription::SetFromConfig(const std::string& name, json value) {
  ModelFact& fact = facts[name];
  fact.value = std::move(value);
  fact.origin = ModelFact::Origin::kConfig;
  fact.why.clear();
}

const json& ModelDescription::Value(const std::string& name) const {
  static const json kNull;
  auto it = facts.find(name);
  return it == facts.end() ? kNull : it->second.value;
}

void AddModelDescriptionToMetadata(const ModelDescription& model, json* metadata) {
  json& m = *metadata;
  if (!model.source.empty()) {
    m["model_config"] = model.Config();
    m["model_config_source"] = model.source;
  }
  if (!model.error.empty()) m["model_config_error"] = model.error;
  if (!model.model_class.empty()) m["model_class"] = model.model_class;
  if (!model.family.empty()) m["model_family"] = model.family;
  json from_tensors = json::object();
  for (const auto& [name, fact] : model.facts)
    if (fact.origin == ModelFact::Origin::kTensors) from_tensors[name] = fact.why;
  if (!from_tensors.empty()) m["model_config_from_tensors"] = std::move(from_tensors);
  if (!model.conflicts.empty()) m["model_config_conflicts"] = model.conflicts;
}

}  // namespace ckptfs
