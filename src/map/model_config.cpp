// model_config as a key map reads it (model_config.hpp).
#include "map/model_config.hpp"

#include <charconv>

namespace ckptfs {

using json = nlohmann::json;

namespace {

bool Set(const json& c, const char* name) { return c.contains(name) && !c[name].is_null(); }

}  // namespace

void NormalizeModelConfig(json* config) {
  json& c = *config;
  if (!c.is_object()) c = json::object();
  // Megatron uses num_query_groups only with group_query_attention; otherwise every head is
  // its own group (multi-head attention).
  const bool gqa = Set(c, "group_query_attention") ? c["group_query_attention"] == true : Set(c, "num_query_groups");
  if ((!gqa || !Set(c, "num_query_groups")) && Set(c, "num_attention_heads")) c["num_query_groups"] = c["num_attention_heads"];
  if (!Set(c, "kv_channels") && Set(c, "hidden_size") && Set(c, "num_attention_heads") &&
      c["hidden_size"].is_number_integer() && c["num_attention_heads"].is_number_integer()) {
    const int64_t h = c["hidden_size"].get<int64_t>(), n = c["num_attention_heads"].get<int64_t>();
    if (n > 0 && h % n == 0) c["kv_channels"] = h / n;
  }
  if (!Set(c, "vocab_size") && Set(c, "padded_vocab_size")) c["vocab_size"] = c["padded_vocab_size"];
  if (!Set(c, "num_experts")) c["num_experts"] = 0;
}

json SettingValue(const std::string& text) {
  if (text == "true") return true;
  if (text == "false") return false;
  if (text == "null") return nullptr;
  int64_t n = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec == std::errc() && ptr == text.data() + text.size()) return n;
  double d = 0;
  auto [dptr, dec] = std::from_chars(text.data(), text.data() + text.size(), d);
  if (dec == std::errc() && dptr == text.data() + text.size()) return d;
  return text;
}

}  // namespace ckptfs
