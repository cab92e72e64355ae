// Reader for checkpoint folders: Hugging Face style model folders (sharded or single
// safetensors / torch .bin files, with or without a *.index.json), PEFT adapters, Trainer and
// accelerate checkpoint folders, and plain folders of .safetensors files. Which files are the
// weights follows the frameworks' own names (format/safetensors/folder_weights.hpp); everything else in
// the folder is passed through as a sibling file.
#include <algorithm>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "format/readers.hpp"
#include "format/safetensors/folder_weights.hpp"
#include "format/sibling_files.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}
bool IsSafetensors(std::string_view name) { return EndsWith(name, ".safetensors"); }

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
    "chat_template.jinja", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
    "adapter_config.json"};
// The weight files of that layout, in the order transformers looks for them, then PEFT's.
constexpr std::string_view kConventionalWeights[] = {"model.safetensors",         "model.safetensors.index.json",
                                                     "pytorch_model.bin",         "pytorch_model.bin.index.json",
                                                     "adapter_model.safetensors", "adapter_model.bin"};

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

// Up to `most` names joined with ", ", then how many more there are.
std::string JoinNames(const std::vector<std::string>& names, size_t most) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < most; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > most) out += " and " + std::to_string(names.size() - most) + " more";
  return out;
}

// What each file of the folder is to the mount and why, for metadata.json's "folder" entry
// (which `ckptfs info` prints file by file).
json DescribeFolderFiles(const std::vector<std::string>& names, const FolderWeights& chosen,
                         const std::unordered_set<std::string>& weights) {
  json files = json::object();
  // A folder read without a listing (a plain HTTP server) names only the files probed: the
  // shards of its index are added from the index.
  std::vector<std::string> all = names;
  for (const std::string& w : weights)
    if (std::find(names.begin(), names.end(), w) == names.end()) all.push_back(w);
  for (const std::string& n : all) {
    std::string role, why;
    if (weights.count(n)) {
      role = "weights";
      why = chosen.index.empty() ? chosen.file_why : "a shard that " + chosen.index + " names";
    } else if (n == chosen.index) {
      role = "index";
      why = chosen.file_why;
    } else if (IsWeightIndexName(n)) {
      role = "not served";
      why = "a weight index other than the one read; the mount's own model file (or index) takes its place";
    } else if (std::string known = KnownFrameworkFile(n); !known.empty()) {
      role = "passed through";
      why = IsTrainingStateName(n) ? known + ", not the model's weights" : known;
    } else if (IsWeightFileSuffix(n)) {
      role = "passed through";
      why = "not a weight file by the rule that chose the weights";
    } else {
      role = "passed through";
      why = "not a weight file";
    }
    files[n] = {{"role", role}, {"why", why}};
  }
  return {{"weights_rule", chosen.rule}, {"files", std::move(files)}};
}

// The refusal of a folder none of the rules found weights in: where ckptfs looked and what
// the folder holds instead. (A folder with subfolders is read by the folders reader, which
// looks in them.)
Status NoCheckpointHere(const std::string& dir, const std::vector<std::string>& names, bool listed) {
  if (!listed)
    return Status::InvalidArgument(dir, "no checkpoint here: none of model.safetensors, model.safetensors.index.json, "
                                            "pytorch_model.bin, pytorch_model.bin.index.json, "
                                            "adapter_model.safetensors, adapter_model.bin exists");
  std::string what =
      "no checkpoint at the top level of this folder (looked for DeepSpeed and DCP folders, then model.safetensors, "
      "model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json, adapter_model.safetensors/.bin, "
      "other *.index.json, *.safetensors, and .bin/.pt/.pth files that are not training state)";
  std::vector<std::string> state;
  for (const std::string& n : names)
    if (IsTrainingStateName(n)) state.push_back(n);
  if (!state.empty()) what += "; its training state is not weights: " + JoinNames(state, 4);
  return Status::InvalidArgument(dir, what);
}

// The name the safetensors counterpart of weight file `name` is served under, by the names
// loaders look for: a safetensors file keeps its own; a torch file of a loader's stem gets
// that loader's safetensors name (pytorch_model*.bin -> model*.safetensors, adapter_model.bin
// -> adapter_model.safetensors, diffusion_pytorch_model*.bin ->
// diffusion_pytorch_model*.safetensors); any other torch file has none ("").
std::string ServedWeightName(std::string_view name) {
  if (IsSafetensors(name)) return std::string(name);
  std::string_view stem = name;
  for (std::string_view suffix : {".bin", ".pt", ".pth"})
    if (EndsWith(stem, suffix)) {
      stem.remove_suffix(suffix.size());
      break;
    }
  if (stem.size() == name.size()) return "";
  std::string served(stem);
  if (stem.starts_with("pytorch_model")) served = "model" + served.substr(std::string_view("pytorch_model").size());
  for (std::string_view known : {"model", "adapter_model", "diffusion_pytorch_model"})
    if (served == known || (served.starts_with(known) && served[known.size()] == '-')) return served + ".safetensors";
  return "";
}

// How the folder's weights are served (doc/MOUNT.md, "Weight file names"): under the name
// their loader looks for, in the source's shards when it has several named by an index.
ModelComponent ServedComponent(Catalog& catalog, const std::string& dir, const std::string& index,
                               const std::vector<std::string>& weights) {
  ModelComponent c;
  c.format = catalog.format;
  std::string named;
  if (!index.empty()) named = ServedWeightName(index.substr(0, index.size() - std::string_view(".index.json").size()));
  else if (weights.size() == 1) named = ServedWeightName(weights.front());
  if (named.empty()) return c;  // model.safetensors
  c.weights_name = named;
  if (index.empty() || weights.size() < 2) return c;
  std::set<std::string> taken = {named};
  std::vector<std::pair<uint32_t, std::string>> shards;
  for (const std::string& w : weights) {
    const std::string served = ServedWeightName(w);
    uint32_t file = 0;  // read already: Add gives its index
    // A shard with no name of the loader's: the model is served whole under `named`.
    if (served.empty() || !catalog.files->Add(JoinPath(dir, w), &file).ok() || !taken.insert(served).second) return c;
    shards.emplace_back(file, served);
  }
  c.source_shards = std::move(shards);
  return c;
}

}  // namespace

Status ReadCheckpointFolder(const std::string& dir, Catalog* catalog, const ReadLimits& limits,
                            const std::string& index_name) {
  std::vector<std::string> names;
  Env& env = catalog->files->env();
  bool listed = true;
  if (Status s = ListFolderFiles(env, dir, &names); !s.ok()) {
    if (!IsFolderNotListable(s)) return s;
    listed = false;
    names.clear();
    CKPTFS_RETURN_IF_ERROR(ProbeConventionalFiles(env, dir, index_name, &names));
  }
  // An index given as SOURCE is read whatever else the folder holds; when it is the one the
  // rules choose anyway, the folder is described as it is when given as SOURCE itself.
  FolderWeights chosen = ChooseFolderWeights(names);
  if (!index_name.empty() && chosen.index != index_name) {
    chosen = FolderWeights{};
    chosen.index = index_name;
    chosen.rule = index_name + ", the index given as SOURCE";
    chosen.file_why = "the index given as SOURCE";
  }
  if (chosen.index.empty() && chosen.files.empty()) return NoCheckpointHere(dir, names, listed);

  std::vector<std::string> weights;
  std::unordered_map<std::string, std::string> weight_map;
  json index_metadata;
  const std::string& index_used = chosen.index;
  if (!index_used.empty()) {
    CKPTFS_RETURN_IF_ERROR(ReadIndex(env, JoinPath(dir, index_used), limits, &weights, &weight_map, &index_metadata));
    if (weights.empty()) return Status::Corruption(JoinPath(dir, index_used), "the index maps no tensor to a file");
  } else {
    weights = chosen.files;
  }
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
  // Torch files taken by their suffix alone may be anything torch.save wrote: when none of
  // them holds a tensor, the folder has no weights ckptfs can tell, and an empty tree would
  // pass for a model.
  if (chosen.by_suffix && catalog->tensors.empty() && !IsSafetensors(weights.front()))
    return Status::InvalidArgument(dir, "no tensors in " + JoinNames(weights, 4) + " (taken as the weights: " +
                                            chosen.rule + ")");
  if (!index_used.empty() && !index_metadata.is_null()) catalog->metadata["index_metadata"] = index_metadata;

  std::unordered_set<std::string> used(weights.begin(), weights.end());
  catalog->metadata["folder"] = DescribeFolderFiles(names, chosen, used);
  catalog->components = {ServedComponent(*catalog, dir, index_used, weights)};
  return AddSiblingFiles(dir, names,
                         [&used](const std::string& n) { return used.count(n) > 0 || IsWeightIndexName(n); }, catalog);
}

namespace {

// Any folder the folder readers tried before it did not take, or a weight index: an index
// names its shards relative to its own folder, which is read as a checkpoint folder with that
// index (over HTTP the index is how the shards are found at all).
Status DetectCheckpointFolder(SourceProbe& probe, bool* is_format) {
  *is_format = probe.is_folder() || (probe.is_file() && (probe.NameEndsWith(".safetensors.index.json") ||
                                                         probe.NameEndsWith(".bin.index.json")));
  return Status::OK();
}

Status ReadCheckpointFolderSource(SourceProbe& probe, const SourceOptions& options, Catalog* catalog) {
  const std::string& source = probe.source();
  if (probe.is_folder()) return ReadCheckpointFolder(source, catalog, options.limits);
  const size_t slash = source.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : source.substr(0, slash);
  const std::string index_name = slash == std::string::npos ? source : source.substr(slash + 1);
  return ReadCheckpointFolder(dir, catalog, options.limits, index_name);
}

}  // namespace

extern const ReaderEntry kCheckpointFolderReader = {
    "folder", "safetensors or torch model folder (Hugging Face layout), or its weight index",
    {"safetensors-folder", "torch-zip-folder"}, DetectCheckpointFolder, ReadCheckpointFolderSource};

}  // namespace ckptfs
