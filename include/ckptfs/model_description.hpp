// ModelDescription: what a checkpoint says of the model its tensors make, as the readers that
// find it (a Megatron save's args, a framework's run config, the stored tensors themselves)
// hand it to the key maps that serve the model under another framework's names.
//
// The facts are named by Megatron-LM's argument names (doc/MAPS.md, "model_config"), the
// names map files use in their expressions; each keeps where it came from. The catalog's
// metadata.json shows the same description (AddModelDescriptionToMetadata), for people.
#ifndef CKPTFS_MODEL_DESCRIPTION_HPP_
#define CKPTFS_MODEL_DESCRIPTION_HPP_

#include <cstdint>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

namespace ckptfs {

// One fact of a model's configuration.
struct ModelFact {
  enum class Origin : uint8_t {
    kConfig,   // written in the checkpoint's configuration
    kTensors,  // proved by the stored tensors, where the configuration is silent
  };
  nlohmann::json value;  // a number, boolean, string, null or short list
  Origin origin = Origin::kConfig;
  std::string why;  // kTensors: which stored tensors prove it
};

struct ModelDescription {
  // Where the configuration was read ("common.pt args", "run_config.yaml model:"); empty
  // when none was.
  std::string source;
  // Why a configuration beside the weights could not be read; empty when none failed.
  std::string error;
  // The framework's model class (a `_target_`), and the Hugging Face model_type it names
  // ("llama"); empty when not named.
  std::string model_class;
  std::string family;
  // The facts, by Megatron-LM argument name.
  std::map<std::string, ModelFact> facts;
  // Facts the configuration states otherwise than the stored tensors prove: field -> how.
  // A map refuses such a model unless the user decides (map.NAME=VALUE).
  std::map<std::string, std::string> conflicts;

  // The facts' values as one object {name: value}: what map expressions read.
  nlohmann::json Config() const;
  // Sets fact `name` as the configuration states it.
  void SetFromConfig(const std::string& name, nlohmann::json value);
  // The value of fact `name`, or null.
  const nlohmann::json& Value(const std::string& name) const;
};

// Writes `model` into a catalog's `metadata` (metadata.json): "model_config" (Config()),
// "model_config_source", "model_config_error", "model_class", "model_family",
// "model_config_from_tensors" ({field: why} of the facts the tensors gave) and
// "model_config_conflicts", each only when it has something to say.
void AddModelDescriptionToMetadata(const ModelDescription& model, nlohmann::json* metadata);

}  // namespace ckptfs

#endif  // CKPTFS_MODEL_DESCRIPTION_HPP_
