// Reader for veRL's FSDP checkpoints: an actor (or critic) folder of per-rank torch.save files
// (model_world_size_W_rank_R.pt, optim_..., extra_state_...) with fsdp_config.json and a
// huggingface/ folder of config and tokenizer, the global_step_N/ folder that holds it, or
// the run folder whose latest_checkpointed_iteration.txt names the step. The model rank files
// are consolidated into full tensors under their Hugging Face names (format/torch/rank_shards.hpp);
// the huggingface/ files are served beside model.safetensors so that from_pretrained opens
// the mount. Layout facts: doc/FORMATS.md, "veRL checkpoints".
#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>

#include "format/readers.hpp"
#include "format/sibling_files.hpp"
#include "format/torch/rank_shards.hpp"
#include "format/torch/torch_distributed.hpp"
#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

constexpr const char* kTracker = "latest_checkpointed_iteration.txt";
constexpr const char* kFsdpConfig = "fsdp_config.json";
constexpr const char* kHfFolder = "huggingface";
constexpr const char* kStepPrefix = "global_step_";
// The roles veRL's trainer saves under a step folder, in the order one is served.
constexpr const char* kRoles[] = {"actor", "critic"};
// The kinds of rank file veRL's FSDPCheckpointManager writes.
constexpr const char* kModel = "model";
constexpr const char* kOptim = "optim";
constexpr const char* kExtra = "extra_state";

bool AllDigits(std::string_view s) {
  return !s.empty() && s.size() <= 18 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// "<kind>_world_size_<W>_rank_<R>.pt", exactly as veRL names its rank files.
bool ParseVerlRankName(std::string_view name, std::string_view kind, uint64_t* world, uint64_t* rank) {
  const std::string head = std::string(kind) + "_world_size_";
  if (name.substr(0, head.size()) != head || name.size() < head.size() + 3) return false;
  name.remove_prefix(head.size());
  if (name.substr(name.size() - 3) != ".pt") return false;
  name.remove_suffix(3);
  const size_t sep = name.find("_rank_");
  if (sep == std::string_view::npos) return false;
  const std::string_view w = name.substr(0, sep), r = name.substr(sep + 6);
  if (!AllDigits(w) || !AllDigits(r)) return false;
  *world = std::stoull(std::string(w));
  *rank = std::stoull(std::string(r));
  return true;
}

bool IsRankFileOf(std::string_view name, std::string_view kind) {
  uint64_t w, r;
  return ParseVerlRankName(name, kind, &w, &r);
}

// A folder of model rank files with something only veRL's manager writes beside them: its
// fsdp_config.json, huggingface/ folder, or optim/extra_state rank files. Model rank files
// alone are a plain set of rank files (the torch-ranks reader serves the same tensors).
bool IsActorFolder(Env& env, const std::string& dir) {
  std::vector<FolderEntry> entries;
  if (!env.ListFolder(dir, &entries).ok()) return false;
  bool model = false, veRL = false;
  for (const FolderEntry& e : entries) {
    if (e.type == PathType::kFile) {
      model = model || IsRankFileOf(e.name, kModel);
      veRL = veRL || e.name == kFsdpConfig || IsRankFileOf(e.name, kOptim) || IsRankFileOf(e.name, kExtra);
    } else if (e.type == PathType::kFolder && e.name == kHfFolder) {
      veRL = true;
    }
  }
  return model && veRL;
}

// The role folders of a step folder that are actor folders, in kRoles order.
std::vector<std::string> RoleFolders(Env& env, const std::string& dir) {
  std::vector<std::string> roles;
  for (const char* role : kRoles) {
    PathType type;
    const std::string sub = JoinPath(dir, role);
    if (env.Stat(sub, &type).ok() && type == PathType::kFolder && IsActorFolder(env, sub)) roles.push_back(role);
  }
  return roles;
}

std::optional<uint64_t> StepOf(std::string_view name) {
  if (name.substr(0, 12) != kStepPrefix || !AllDigits(name.substr(12))) return std::nullopt;
  return std::stoull(std::string(name.substr(12)));
}

// The global_step_N subfolders of a run folder that hold a role folder, by step.
std::map<uint64_t, std::string> StepFolders(Env& env, const std::string& dir) {
  std::map<uint64_t, std::string> steps;
  std::vector<FolderEntry> entries;
  if (!env.ListFolder(dir, &entries).ok()) return steps;
  for (const FolderEntry& e : entries)
    if (std::optional<uint64_t> n = StepOf(e.name); n && e.type == PathType::kFolder &&
                                                       !RoleFolders(env, JoinPath(dir, e.name)).empty())
      steps.emplace(*n, e.name);
  return steps;
}

bool IsVerlFolder(Env& env, const std::string& dir) {
  return IsActorFolder(env, dir) || !RoleFolders(env, dir).empty() || !StepFolders(env, dir).empty();
}

std::string Trim(std::string s) {
  const char* ws = " \t\r\n";
  s.erase(s.find_last_not_of(ws) + 1);
  s.erase(0, s.find_first_not_of(ws));
  return s;
}

// The actor (or critic) folder `dir` stands for; `info` records the step and role chosen.
Status ResolveActorFolder(Env& env, const std::string& dir, std::string* actor, json* info) {
  if (IsActorFolder(env, dir)) {
    *actor = dir;
    return Status::OK();
  }
  std::string step_dir = dir;
  if (RoleFolders(env, dir).empty()) {
    const std::map<uint64_t, std::string> steps = StepFolders(env, dir);
    if (steps.empty()) return Status::NotFound(dir, "no veRL rank files in the folder, its actor/ or global_step_N/");
    const std::string tracker = JoinPath(dir, kTracker);
    PathType type;
    CKPTFS_RETURN_IF_ERROR(env.Stat(tracker, &type));
    std::string chosen;
    if (type == PathType::kFile) {
      // veRL's trainer writes the last step it saved in full here.
      std::string text;
      CKPTFS_RETURN_IF_ERROR(env.ReadSmallFile(tracker, 4096, &text, "the iteration file"));
      text = Trim(text);
      if (!AllDigits(text)) return Status::Corruption(tracker, "names '" + text + "', not a step number");
      auto it = steps.find(std::stoull(text));
      if (it == steps.end())
        return Status::NotFound(tracker, "names step " + text + " but there is no " + kStepPrefix + text +
                                             "/ with an actor or critic folder of rank files");
      chosen = it->second;
    } else {
      chosen = steps.rbegin()->second;  // the highest step
    }
    (*info)["step_folder"] = chosen;
    (*info)["step"] = *StepOf(chosen);
    step_dir = JoinPath(dir, chosen);
  }
  const std::vector<std::string> roles = RoleFolders(env, step_dir);
  if (roles.empty()) return Status::NotFound(step_dir, "no actor or critic folder of veRL rank files");
  (*info)["role"] = roles.front();
  if (roles.size() > 1) (*info)["other_roles"] = std::vector<std::string>(roles.begin() + 1, roles.end());
  *actor = JoinPath(step_dir, roles.front());
  return Status::OK();
}

// The rank files of one kind in `names`, checked to be one complete save of `world` ranks.
Status RankFiles(const std::string& dir, const std::vector<std::string>& names, std::string_view kind,
                 uint64_t world, std::vector<std::string>* files) {
  std::map<uint64_t, std::string> by_rank;
  for (const std::string& name : names) {
    uint64_t w, r;
    if (!ParseVerlRankName(name, kind, &w, &r)) continue;
    if (w != world)
      return Status::NotSupported(JoinPath(dir, name), "a rank file of world size " + std::to_string(w) +
                                                           " beside model files of world size " + std::to_string(world) +
                                                           ": two saves in one folder");
    if (r >= world)
      return Status::Corruption(JoinPath(dir, name), "rank " + std::to_string(r) + " of a world of " +
                                                         std::to_string(world));
    by_rank.emplace(r, name);
  }
  files->clear();
  for (uint64_t r = 0; r < world; ++r) {
    auto it = by_rank.find(r);
    const std::string expected =
        std::string(kind) + "_world_size_" + std::to_string(world) + "_rank_" + std::to_string(r) + ".pt";
    if (it == by_rank.end())
      return Status::NotFound(JoinPath(dir, expected), "missing: the save has " + std::to_string(world) + " ranks");
    files->push_back(JoinPath(dir, it->second));
  }
  return Status::OK();
}

// The distributed tensors of rank 0's model file, in its order: the parameters an FSDP
// optimizer numbers (it is built over model.parameters(), which FSDP turns into DTensors and
// which lists a tied parameter once).
class ParameterLister : public DistributedTensorSink {
 public:
  Status Add(DistributedTensor tensor, const std::vector<PathElement>& path, size_t) override {
    std::string storage;
    for (const LocalShard& s : tensor.local)
      if (!s.tensor.storage_id.empty()) storage = s.tensor.storage_id;
    // A tied parameter is one object saved under two keys: its local shard is one storage.
    if (!storage.empty() && !storages_.insert(storage).second) return Status::OK();
    names.push_back(path.empty() ? "tensor" : FlattenKey(path));
    shapes.push_back(tensor.shape);
    return Status::OK();
  }
  std::vector<std::string> names;
  std::vector<Shape> shapes;

 private:
  std::set<std::string> storages_;
};

class VerlReader {
 public:
  VerlReader(std::string actor, const SourceOptions& options, Catalog* catalog)
      : actor_(std::move(actor)), options_(options), catalog_(catalog) {}

  Status Read(json* info);

 private:
  Status ReadFsdpConfig(uint64_t world, json* info);
  Status AddOptimizer(const std::vector<std::string>& names, uint64_t world, json* info);
  Status AddSiblings(const std::vector<std::string>& names);

  std::string actor_;
  const SourceOptions& options_;
  Catalog* catalog_;
  std::optional<int64_t> fsdp_version_;
};

Status VerlReader::ReadFsdpConfig(uint64_t world, json* info) {
  const std::string path = JoinPath(actor_, kFsdpConfig);
  PathType type;
  CKPTFS_RETURN_IF_ERROR(catalog_->files->env().Stat(path, &type));
  if (type != PathType::kFile) return Status::OK();  // veRL releases before it wrote none
  std::string text;
  CKPTFS_RETURN_IF_ERROR(catalog_->files->env().ReadSmallFile(path, 1 << 16, &text, "the FSDP config"));
  json config = json::parse(text, nullptr, false);
  if (!config.is_object()) return Status::Corruption(path, "not a JSON object");
  if (config.contains("world_size")) {
    if (!config["world_size"].is_number_unsigned() || config["world_size"].get<uint64_t>() != world)
      return Status::Corruption(path, "world_size " + config["world_size"].dump() + " but the model rank files are " +
                                          std::to_string(world));
  }
  if (config.contains("FSDP_version")) {
    if (!config["FSDP_version"].is_number_integer())
      return Status::Corruption(path, "FSDP_version " + config["FSDP_version"].dump() + " is not a number");
    fsdp_version_ = config["FSDP_version"].get<int64_t>();
    (*info)["fsdp_version"] = *fsdp_version_;
  }
  return Status::OK();
}

Status VerlReader::Read(json* info) {
  std::vector<std::string> names;
  CKPTFS_RETURN_IF_ERROR(ListFolderFiles(catalog_->files->env(), actor_, &names));
  std::set<uint64_t> worlds;
  for (const std::string& name : names) {
    uint64_t w, r;
    if (ParseVerlRankName(name, kModel, &w, &r)) worlds.insert(w);
  }
  if (worlds.empty()) return Status::NotFound(actor_, "no model_world_size_W_rank_R.pt files");
  if (worlds.size() > 1)
    return Status::NotSupported(actor_, "model rank files of world sizes " + std::to_string(*worlds.begin()) + " and " +
                                            std::to_string(*worlds.rbegin()) + ": two saves in one folder");
  const uint64_t world = *worlds.begin();
  if (world == 0) return Status::Corruption(actor_, "model rank files of world size 0");
  (*info)["world_size"] = world;
  CKPTFS_RETURN_IF_ERROR(ReadFsdpConfig(world, info));

  RankFileSet model;
  CKPTFS_RETURN_IF_ERROR(RankFiles(actor_, names, kModel, world, &model.files));
  json values;
  RankSetSummary summary;
  CKPTFS_RETURN_IF_ERROR(ConsolidateRankFiles(model, options_.limits, catalog_, &values, &summary));
  // Plain tensors in every rank file of a sharded save would be served from rank 0 alone:
  // right for replicated buffers, wrong for anything each rank holds its own part of. A
  // save with no distributed tensor at all is not the form veRL writes for several ranks.
  if (world > 1 && summary.distributed_tensors == 0)
    return Status::NotSupported(model.files[0], "none of the " + std::to_string(summary.plain_tensors) +
                                                    " tensors is a DTensor or ShardedTensor, but the save has " +
                                                    std::to_string(world) + " ranks: which rank holds what is not recorded");
  (*info)["rank_files"] = summary.ToJson();
  if (!values.empty() && !values.is_null()) catalog_->metadata["model"] = std::move(values);

  if (options_.optimizer_state) CKPTFS_RETURN_IF_ERROR(AddOptimizer(names, world, info));
  (*info)["optimizer"] = options_.optimizer_state;
  return AddSiblings(names);
}

Status VerlReader::AddOptimizer(const std::vector<std::string>& names, uint64_t world, json* info) {
  RankFileSet optim;
  CKPTFS_RETURN_IF_ERROR(RankFiles(actor_, names, kOptim, world, &optim.files));
  if (fsdp_version_ && *fsdp_version_ == 1)
    return Status::NotSupported(optim.files[0], "FSDP1 keeps the optimizer state per flat parameter (1-D shards of "
                                                "the concatenated parameters) and the files do not record which "
                                                "parameter lies where in it: -o optimizer serves FSDP2 saves only");
  ParameterLister params;
  {
    Catalog scratch;
    scratch.files = catalog_->files;
    json ignored;
    std::vector<std::string> model_files;
    CKPTFS_RETURN_IF_ERROR(RankFiles(actor_, names, kModel, world, &model_files));
    CKPTFS_RETURN_IF_ERROR(ReadTorchZipDistributed(model_files[0], &scratch, &ignored, options_.limits, &params));
  }
  // The optimizer numbers its parameters 0..N-1 in the order of its param groups, which veRL
  // builds over model.parameters(): the order the model file lists its DTensors in.
  Catalog peek;
  peek.files = catalog_->files;
  json groups;
  {
    class Ignore : public DistributedTensorSink {
     public:
      Status Add(DistributedTensor, const std::vector<PathElement>&, size_t) override { return Status::OK(); }
    } ignore;
    CKPTFS_RETURN_IF_ERROR(ReadTorchZipDistributed(optim.files[0], &peek, &groups, options_.limits, &ignore));
  }
  const json* param_groups = groups.is_object() && groups.contains("param_groups") ? &groups["param_groups"] : nullptr;
  auto IsList = [](const json* j) { return j && (j->is_array() || j->is_object()); };
  if (!IsList(param_groups))
    return Status::NotSupported(optim.files[0], "no param_groups: not a torch optimizer state_dict");
  std::set<int64_t> listed;
  uint64_t count = 0;
  for (const auto& [index, group] : param_groups->items()) {
    const json* ids = group.is_object() && group.contains("params") ? &group["params"] : nullptr;
    if (!IsList(ids))
      return Status::NotSupported(optim.files[0], "param_groups." + index + ".params is not a list of parameter ids");
    for (const auto& [position, id] : ids->items()) {
      if (!id.is_number_integer())
        return Status::NotSupported(optim.files[0], "param_groups." + index + ".params." + position + " is not an id");
      listed.insert(id.get<int64_t>());
      ++count;
    }
  }
  const uint64_t n = params.names.size();
  if (count != n || listed.size() != n || (n > 0 && (*listed.begin() != 0 || *listed.rbegin() != static_cast<int64_t>(n) - 1)))
    return Status::NotSupported(optim.files[0], "the optimizer numbers " + std::to_string(count) +
                                                    " parameters but the model file has " + std::to_string(n) +
                                                    " distributed ones: which state belongs to which parameter is not recorded");

  // optimizer.state.<id>.<entry> -> optimizer.state.<parameter name>.<entry>
  std::string bad_path;
  optim.prefix = {std::string("optimizer")};
  optim.select = [&](std::vector<PathElement>* path) {
    if (path->size() >= 3 && std::get_if<std::string>(&(*path)[1]) && std::get<std::string>((*path)[1]) == "state") {
      // torch numbers the parameters; a state keyed otherwise (by name) is not what this maps.
      const int64_t* id = std::get_if<int64_t>(&(*path)[2]);
      if (!id || *id < 0 || static_cast<uint64_t>(*id) >= n) {
        if (bad_path.empty()) bad_path = FlattenKey(*path);
        return false;
      }
      (*path)[2] = params.names[*id];
    }
    return true;
  };
  const size_t first = catalog_->tensors.size();
  json values;
  RankSetSummary summary;
  CKPTFS_RETURN_IF_ERROR(ConsolidateRankFiles(optim, options_.limits, catalog_, &values, &summary));
  if (!bad_path.empty())
    return Status::NotSupported(optim.files[0], "key '" + bad_path + "': a state entry for no parameter of the model");
  std::unordered_map<std::string, size_t> param_index;
  for (size_t i = 0; i < n; ++i) param_index.emplace(params.names[i], i);
  for (size_t i = first; i < catalog_->tensors.size(); ++i) {
    const TensorEntry& t = catalog_->tensors[i];
    std::vector<PathElement> path(t.path.begin(), t.path.end());
    if (path.size() < 3 || std::get_if<std::string>(&path[1]) == nullptr ||
        std::get<std::string>(path[1]) != "state")
      continue;
    // A parameter's state tensor is the parameter's shape (exp_avg) or a scalar (step).
    const std::string* name = std::get_if<std::string>(&path[2]);
    auto p = name ? param_index.find(*name) : param_index.end();
    if (p == param_index.end())
      return Status::NotSupported(optim.files[0], "key '" + t.key + "': a state entry for no parameter of the model");
    if (!t.shape.empty() && t.shape != params.shapes[p->second])
      return Status::NotSupported(optim.files[0], "key '" + t.key + "': a state tensor whose shape is not its parameter's (" +
                                                      params.names[p->second] + "): not a per-parameter state");
  }
  if (values.is_object()) {
    values.erase("state");
    // What the ids of param_groups stand for, as the state's keys were renamed.
    values["parameter_names"] = params.names;
  }
  catalog_->metadata["optimizer"] = std::move(values);
  (*info)["optimizer_rank_files"] = summary.ToJson();
  return Status::OK();
}

Status VerlReader::AddSiblings(const std::vector<std::string>& names) {
  // The huggingface/ folder's files first (config.json, the tokenizer, generation_config.json),
  // then the actor folder's own (fsdp_config.json, extra_state_*.pt): a name both have is
  // served from huggingface/.
  std::set<std::string> served;
  const std::string hf = JoinPath(actor_, kHfFolder);
  PathType type;
  CKPTFS_RETURN_IF_ERROR(catalog_->files->env().Stat(hf, &type));
  if (type == PathType::kFolder) {
    std::vector<std::string> hf_names;
    CKPTFS_RETURN_IF_ERROR(ListFolderFiles(catalog_->files->env(), hf, &hf_names));
    CKPTFS_RETURN_IF_ERROR(AddSiblingFiles(hf, hf_names, {}, catalog_));
    served.insert(hf_names.begin(), hf_names.end());
  }
  return AddSiblingFiles(
      actor_, names,
      [&](const std::string& name) {
        return served.count(name) || IsRankFileOf(name, kModel) || IsRankFileOf(name, kOptim);
      },
      catalog_);
}

Status ReadVerlCheckpoint(const std::string& dir, const SourceOptions& options, Catalog* catalog) {
  catalog->format = "verl";
  json info = json::object();
  std::string actor;
  CKPTFS_RETURN_IF_ERROR(ResolveActorFolder(catalog->files->env(), dir, &actor, &info));
  if (actor != dir) info["folder"] = actor.substr(dir.size() + (dir.empty() || dir.back() == '/' ? 0 : 1));
  VerlReader reader(actor, options, catalog);
  CKPTFS_RETURN_IF_ERROR(reader.Read(&info));
  catalog->layout_file = actor;
  catalog->metadata[catalog->metadata.contains("verl") ? "$verl" : "verl"] = std::move(info);
  return Status::OK();
}

}  // namespace

extern const ReaderEntry kVerlReader = {
    "verl", "veRL FSDP checkpoint: an actor/critic folder of rank files, its global_step_N/ or the run folder",
    {"verl"}, DetectFolderOf<IsVerlFolder>, ReadFolderOf<ReadVerlCheckpoint>};

}  // namespace ckptfs
