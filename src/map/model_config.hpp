// The model configuration a key map reads: the catalog's "model_config" (readers write it
// with Megatron's argument names, doc/MAPS.md) with the values Megatron derives filled in,
// and the user's map.NAME=VALUE settings over it.
#ifndef CKPTFS_MAP_MODEL_CONFIG_HPP_
#define CKPTFS_MAP_MODEL_CONFIG_HPP_

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace ckptfs {

// Fills what Megatron derives when a field is unset: num_query_groups (num_attention_heads
// unless group_query_attention), kv_channels (hidden_size / num_attention_heads), vocab_size
// (padded_vocab_size), num_experts (0).
void NormalizeModelConfig(nlohmann::json* config);

// A map.NAME=VALUE setting's value: an integer, true, false or null as JSON, else the text.
nlohmann::json SettingValue(const std::string& text);

}  // namespace ckptfs

#endif  // CKPTFS_MAP_MODEL_CONFIG_HPP_
