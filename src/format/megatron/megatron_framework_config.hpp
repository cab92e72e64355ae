// The model configuration of a Megatron-core checkpoint as Megatron-Bridge, NeMo-RL or NeMo 2
// wrote it beside the weights (Megatron-LM's common.pt args: format/megatron/megatron_config.hpp),
// for the key maps (doc/FORMATS.md, "Megatron model configs"):
//   - Megatron-Bridge and NeMo-RL: `run_config.yaml` in the iteration folder, section `model:`
//     (the model provider: TransformerConfig's fields and the provider's);
//   - NeMo 2: `context/model.yaml` beside `weights/`, section `config:` (the model's config
//     dataclass with its defaults).
// The section is normalised to Megatron-LM's argument names (the names of common.pt's `args`)
// and becomes the catalog's ModelDescription: its facts, its source (which file and section),
// its model_class (the `_target_` class) and family (the Hugging Face model_type the class
// names, when it names one).
#ifndef CKPTFS_FORMAT_MEGATRON_MEGATRON_FRAMEWORK_CONFIG_HPP_
#define CKPTFS_FORMAT_MEGATRON_MEGATRON_FRAMEWORK_CONFIG_HPP_

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ckptfs/env.hpp"
#include "ckptfs/model_description.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// The folder of a NeMo-RL step (`step_N/`) that holds its Megatron weights as a Bridge save.
inline constexpr const char* kNemoRlWeights = "policy/weights";

// True when `dir` is a NeMo 2 checkpoint: `weights/` beside `context/`.
bool IsNemo2Checkpoint(Env& env, const std::string& dir);

// Finds the model config of the DCP folder `folder` served for SOURCE `dir` (run_config.yaml
// in `folder`; context/model.yaml of `dir` when `folder` is its weights/), and describes it
// in `*model`. `*framework` names the layout recognised ("Megatron-Bridge", "NeMo 2", "" when
// neither). A config file that cannot be read is no refusal of the tensors (they are served
// as saved): its one-line reason goes into model->error, which a map that needs the config
// reports.
Status AddFrameworkModelConfig(Env& env, const std::string& dir, const std::string& folder, ModelDescription* model,
                               std::string* framework);

// The normalisation itself, for tests: a provider / config `section` (TransformerConfig field
// names) to Megatron-LM argument names. `nemo`: NeMo 2's rules (its vocab_size is the rows
// the model was built with); otherwise Bridge's (vocab_size is the tokenizer's, padded when
// should_pad_vocab).
nlohmann::json NormaliseMegatronConfig(const nlohmann::json& section, bool nemo);

// The Hugging Face model_type a framework's model or config class names
// ("...llama_provider.Llama31ModelProvider8B" -> "llama", "...qwen3.Qwen3Config" -> "qwen3");
// "" for a generic GPT class; the class's own lower-case stem for a family no shipped map has.
std::string ModelFamilyOfClass(std::string_view target);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_MEGATRON_MEGATRON_FRAMEWORK_CONFIG_HPP_
