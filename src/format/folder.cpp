// Reader for checkpoint folders: Hugging Face style model folders (sharded or single
// safetensors / torch .bin files, with or without a *.index.json) and plain folders of
// .safetensors files. Everything else in the folder is passed through as a sibling file.
#include <algorithm>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "format/readers.hpp"
#include "format/sibling_files.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}
bool IsSafetensors(std::string_view name) { return EndsWith(name, ".safetensors"); }
bool IsTorchFile(std::string_view name) {
  return EndsWith(name, ".bin") || EndsWith(name, ".pt") || EndsWith(name, ".pth");
}
bool IsIndex(std::string_view name) {
  return EndsWith(name, ".safetensors.index.json") || EndsWith(name, ".bin.index.json");
}

// The shard file names an index maps weights to, and the weight -> shard map itself.
Status ReadIndex(Env& env, const std::string& path, const ReadLimits& limits, std::vector<std::string>* shards,
                 std::unordered_map<std::string, std::string>* weight_map, json* index_metadata) {
  std::string text;
  CKPTFS_RETURN_IF_ERROR(env.ReadSmallFile(path, limits.header_bytes, &text, "index", "max_header"));
  json doc = json::parse(text, nullptr, false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object())
    return Status::Corruption(path, "index is not a JSON object with a weight_map");
  std::set<std::string> unique;
  for (auto& [key, shard] : doc["weight_map"].items()) {
    if (!shard.is_string()) return Status::Corruption(path, "weight_map value of '" + key + "' is not a string");
    const std::string name = shard.get<std::string>();
    if (name.empty() || name[0] == '/' || name.find("..") != std::string::npos)
      return Status::Corruption(path, "weight_map names shard '" + name + "' outside the folder");
    unique.insert(name);
    (*weight_map)[key] = name;
  }
  shards->assign(unique.begin(), unique.end());  // transformers loads sorted(set(values))
  if (doc.contains("metadata")) *index_metadata = doc["metadata"];
  return Status::OK();
}

// Files a Hugging Face model folder holds besides its weights, passed through when present.
constexpr std::string_view kConventionalSiblings[] = {
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "preprocessor_config.json",
    "chat_template.jinja", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"};
// The weight files of that layout, in the order transformers looks for them.
constexpr std::string_view kConventionalWeights[] = {"model.safetensors.index.json", "model.safetensors",
                                                     "pytorch_model.bin.index.json", "pytorch_model.bin"};

// For a folder the Env cannot list (a plain HTTP server): the files the Hugging Face layout
// names that exist, found by asking for each. `index_name`, when given, is the weights' index.
Status ProbeConventionalFiles(Env& env, const std::string& dir, const std::string& index_name,
                              std::vector<std::string>* names) {
  auto exists = [&](std::string_view name, bool* found) {
    PathType type;
    CKPTFS_RETURN_IF_ERROR(env.Stat(JoinPath(dir, name), &type));
    *found = type == PathType::kFile;
    return Status::OK();
  };
  if (!index_name.empty()) {
    names->push_back(index_name);
  } else {
    for (std::string_view w : kConventionalWeights) {
      bool found = false;
      CKPTFS_RETURN_IF_ERROR(exists(w, &found));
      if (found) {
        names->emplace_back(w);
        break;
      }
    }
  }
  for (std::string_view sibling : kConventionalSiblings) {
    bool found = false;
    CKPTFS_RETURN_IF_ERROR(exists(sibling, &found));
    if (found) names->emplace_back(sibling);
  }
  std::sort(names->begin(), names->end());
  return Status::OK();
}

void MergeInto(json* into, const json& from) {
  if (!from.is_object()) return;
  for (auto& [k, v] : from.items()) (*into)[k] = v;
}

// A torch file of a folder: a torch.save zip, or a legacy stream (the pytorch_model.bin of
// Hugging Face models saved before torch 1.6).
Status ReadTorchWeights(const std::string& path, Catalog* catalog, json* meta, const ReadLimits& limits) {
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(catalog->files->Add(path, &file));
  std::string head(std::min<uint64_t>(512, catalog->files->size(file)), '\0');
  CKPTFS_RETURN_IF_ERROR(catalog->files->ReadExact(file, 0, head.size(), head.data()));
  if (IsTorchLegacy(head)) return ReadTorchLegacy(path, head, catalog, meta, limits);
  return ReadTorchZip(path, catalog, meta, limits);
}

}  // namespace

Status ReadCheckpointFolder(const std::string& dir, Catalog* catalog, const ReadLimits& limits,
                            const std::string& index_name) {
  std::vector<std::string> names;
  Env& env = catalog->files->env();
  if (Status listed = ListFolderFiles(env, dir, &names); !listed.ok()) {
    if (!IsFolderNotListable(listed)) return listed;
    names.clear();
    CKPTFS_RETURN_IF_ERROR(ProbeConventionalFiles(env, dir, index_name, &names));
  }
  std::vector<std::string> indexes;
  if (!index_name.empty()) {
    indexes.push_back(index_name);
  } else {
    for (const auto& n : names)
      if (IsIndex(n)) indexes.push_back(n);
  }
  // Prefer safetensors when a folder holds both formats, as transformers does.
  std::sort(indexes.begin(), indexes.end(), [](const std::string& a, const std::string& b) {
    return EndsWith(a, ".safetensors.index.json") > EndsWith(b, ".safetensors.index.json");
  });

  std::vector<std::string> weights;
  std::unordered_map<std::string, std::string> weight_map;
  json index_metadata;
  std::string index_used;
  if (!indexes.empty()) {
    index_used = indexes.front();
    CKPTFS_RETURN_IF_ERROR(ReadIndex(env, JoinPath(dir, index_used), limits, &weights, &weight_map, &index_metadata));
  } else {
    for (const auto& n : names)
      if (IsSafetensors(n)) weights.push_back(n);
    if (weights.empty())
      for (const auto& n : names)
        if (IsTorchFile(n)) weights.push_back(n);
  }
  if (weights.empty())
    return Status::InvalidArgument(dir, "no checkpoint files (.safetensors, .bin, .pt) in this folder");
  catalog->format = IsSafetensors(weights.front()) ? "safetensors-folder" : "torch-zip-folder";

  std::unordered_set<std::string> seen;
  for (const auto& w : weights) {
    const std::string path = JoinPath(dir, w);
    const size_t first = catalog->tensors.size();
    json meta;
    CKPTFS_RETURN_IF_ERROR(IsSafetensors(w) ? ReadSafetensorsFile(path, catalog, &meta, limits)
                                            : ReadTorchWeights(path, catalog, &meta, limits));
    MergeInto(&catalog->metadata, meta);
    for (size_t i = first; i < catalog->tensors.size(); ++i) {
      const std::string& key = catalog->tensors[i].key;
      if (!seen.insert(key).second) return Status::Corruption(path, "tensor '" + key + "' also appears in another file");
      if (!index_used.empty()) {
        auto it = weight_map.find(key);
        if (it == weight_map.end() || it->second != w)
          return Status::Corruption(JoinPath(dir, index_used), "tensor '" + key + "' is in " + w +
                                                                    " but the index maps it to " +
                                                                    (it == weight_map.end() ? "no shard" : it->second));
      }
    }
  }
  if (seen.size() != weight_map.size() && !index_used.empty()) {
    for (const auto& [key, shard] : weight_map)
      if (!seen.count(key))
        return Status::Corruption(JoinPath(dir, index_used), "tensor '" + key + "' is missing from " + shard);
  }
  if (!index_used.empty() && !index_metadata.is_null()) catalog->metadata["index_metadata"] = index_metadata;

  std::unordered_set<std::string> used(weights.begin(), weights.end());
  return AddSiblingFiles(dir, names, [&used](const std::string& n) { return used.count(n) > 0 || IsIndex(n); },
                         catalog);
}

// Any folder the folder readers tried before it did not take, or a weight index: an index
// names its shards relative to its own folder, which is read as a checkpoint folder with that
// index (over HTTP the index is how the shards are found at all).
extern const ReaderEntry kCheckpointFolderReader = {
    .name = "folder",
    .description = "safetensors or torch model folder (Hugging Face layout), or its weight index",
    .formats = {"safetensors-folder", "torch-zip-folder"},
    .number = kCheckpointFolderFormat,
    .reads_through = {"safetensors", "torch-zip", "torch-legacy"},
    .detect = [](SourceProbe& probe, bool* is_format) {
      *is_format = probe.is_folder() || (probe.is_file() && (probe.NameEndsWith(".safetensors.index.json") ||
                                                             probe.NameEndsWith(".bin.index.json")));
      return Status::OK();
    },
    .read = [](SourceProbe& probe, const SourceOptions& options, Catalog* catalog) {
      const std::string& source = probe.source();
      if (probe.is_folder()) return ReadCheckpointFolder(source, catalog, options.limits);
      const size_t slash = source.rfind('/');
      const std::string dir = slash == std::string::npos ? "." : source.substr(0, slash);
      const std::string index_name = slash == std::string::npos ? source : source.substr(slash + 1);
      return ReadCheckpointFolder(dir, catalog, options.limits, index_name);
    },
};

}  // namespace ckptfs
