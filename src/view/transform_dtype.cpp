// The `dtype=` view: every floating tensor served converted to one type on read (the
// conversion itself is convert.cpp's); other tensors are served as stored. Packed float4
// pairs (F4) are floating but have no conversion, in torch either: a view that asks for one
// is refused rather than served with that tensor left as it was.
#include "view/convert.hpp"
#include "view/transform.hpp"

namespace ckptfs {
namespace {

// Where each `"dtype": "..."` or `"torch_dtype": "..."` member of JSON text `text` has its
// string value: [begin, end) of the value inside its quotes. Keys are told from values by the
// ':' after them; a value that is not a string (null) is left alone.
std::vector<std::pair<size_t, size_t>> DTypeValues(std::string_view text) {
  std::vector<std::pair<size_t, size_t>> at;
  size_t i = 0;
  auto skip_space = [&](size_t k) {
    while (k < text.size() && (text[k] == ' ' || text[k] == '\n' || text[k] == '\r' || text[k] == '\t')) ++k;
    return k;
  };
  // The end (after the closing quote) of the string starting at quote `k`, or npos.
  auto string_end = [&](size_t k) {
    for (++k; k < text.size(); ++k) {
      if (text[k] == '\\') ++k;
      else if (text[k] == '"') return k + 1;
    }
    return std::string_view::npos;
  };
  while ((i = text.find('"', i)) != std::string_view::npos) {
    const size_t end = string_end(i);
    if (end == std::string_view::npos) break;
    const std::string_view token = text.substr(i + 1, end - i - 2);
    size_t next = skip_space(end);
    if ((token == "dtype" || token == "torch_dtype") && next < text.size() && text[next] == ':') {
      next = skip_space(next + 1);
      if (next < text.size() && text[next] == '"') {
        const size_t value_end = string_end(next);
        if (value_end == std::string_view::npos) break;
        at.emplace_back(next + 1, value_end - 1);
        i = value_end;
        continue;
      }
    }
    i = end;
  }
  return at;
}

class DTypeTransform : public Transform {
 public:
  explicit DTypeTransform(DType to) : to_(to) {}

  Status Apply(ServedTensors* served) const override {
    std::vector<bool> converted(served->components().size(), false);
    for (size_t i = 0; i < served->size(); ++i) {
      const DType from = (*served)[i].dtype;
      if (from == DType::kF4x2 && to_ != from)
        return Status::NotSupported(served->source().source,
                                    "tensor '" + std::string((*served)[i].key()) + "' is F4 (float4_e2m1fn_x2, two values a byte), " +
                                        "which has no conversion to " + std::string(Info(to_).safetensors_name) +
                                        " (torch has none either): read it without dtype=");
      if (ConvertsTo(from, to_)) {
        ServedTensorsEditor(served).SetDType(i, to_);
        if (from != to_) converted[served->ComponentOf(i)] = true;
      }
    }
    (*ServedTensorsEditor(served).mutable_manifest_fields())["dtype"] = Info(to_).safetensors_name;
    return RewriteConfigs(converted, served);
  }

 private:
  // Each converted model's config.json says the served dtype where it names one (its "dtype"
  // and "torch_dtype" members, nested configs' too), nothing else of it changed; the values it
  // had are recorded in metadata.json ("served_configs"). A config that describes quantized
  // weights (quantization_config) no longer describes what is served: refused.
  Status RewriteConfigs(const std::vector<bool>& converted, ServedTensors* served) const {
    const SourceFiles& files = *served->source().files;
    nlohmann::json record = nlohmann::json::object();
    for (size_t c = 0; c < converted.size(); ++c) {
      if (!converted[c]) continue;
      const std::string& folder = served->components()[c].folder;
      const std::string path = folder.empty() ? "config.json" : folder + "/config.json";
      const PassedFile* config = nullptr;
      for (const PassedFile& p : served->passed_files())
        if (p.path == path) config = &p;
      if (!config) continue;
      // Configs are small; a large one is not a model config and is passed through.
      constexpr uint64_t kMostConfigBytes = 16 << 20;
      if (files.size(config->file) > kMostConfigBytes) continue;
      std::string text(files.size(config->file), '\0');
      CKPTFS_RETURN_IF_ERROR(files.ReadExact(config->file, 0, text.size(), text.data()));
      const nlohmann::json doc = nlohmann::json::parse(text, nullptr, false);
      if (doc.is_discarded() || !doc.is_object()) continue;
      if (doc.contains("quantization_config"))
        return Status::NotSupported(files.path(config->file),
                                    "its quantization_config describes the stored weights, which dtype=" +
                                        std::string(Info(to_).safetensors_name) +
                                        " would convert: read it without dtype=");
      const auto values = DTypeValues(text);
      if (values.empty()) continue;
      const std::string_view served_name = Info(to_).torch_name;
      nlohmann::json was = nlohmann::json::array();
      for (auto it = values.rbegin(); it != values.rend(); ++it) {
        was.insert(was.begin(), text.substr(it->first, it->second - it->first));
        text.replace(it->first, it->second - it->first, served_name);
      }
      record[path] = {{"dtype_values", std::move(was)}, {"served", served_name}};
      ServedTensorsEditor(served).AddFile(path, std::move(text));
    }
    if (record.empty()) return Status::OK();
    nlohmann::json metadata = served->metadata();
    if (metadata.is_object()) {
      metadata["served_configs"] = record;
      ServedTensorsEditor(served).SetMetadata(std::move(metadata));
    }
    (*ServedTensorsEditor(served).mutable_manifest_fields())["rewritten_configs"] = std::move(record);
    return Status::OK();
  }

 private:
  DType to_;
};

}  // namespace

std::unique_ptr<Transform> MakeDTypeTransform(const ViewOptions& options) {
  if (!options.dtype) return nullptr;
  return std::make_unique<DTypeTransform>(*options.dtype);
}

}  // namespace ckptfs
