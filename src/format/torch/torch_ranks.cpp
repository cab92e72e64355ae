// Reader for a folder of torch.save rank files of one distributed save: every torch file of
// the folder is named with a rank number (format/torch/rank_shards.hpp, ParseRankFileName), all in
// one group, and they hold DTensors or ShardedTensors. The folder is served as the full
// tensors the rank files consolidate into; its other files beside them. A folder whose rank
// files hold no distributed tensor is an ordinary checkpoint folder.
#include <algorithm>
#include <map>

#include "format/readers.hpp"
#include "format/sibling_files.hpp"
#include "format/torch/rank_shards.hpp"
#include "format/torch/torch_distributed.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

bool IsTorchFileName(std::string_view name) {
  auto ends = [&](std::string_view suffix) {
    return name.size() > suffix.size() && name.substr(name.size() - suffix.size()) == suffix;
  };
  return ends(".pt") || ends(".pth") || ends(".bin");
}

// The folder's torch files by rank when they are all rank files of one group.
struct RankFolder {
  std::string group;
  std::map<uint64_t, std::string> by_rank;
  std::optional<uint64_t> world_size;  // from the names
  std::vector<std::string> others;     // the folder's other files
};

Status ListRankFolder(Env& env, const std::string& dir, RankFolder* out, bool* is_rank_folder) {
  *is_rank_folder = false;
  std::vector<std::string> names;
  CKPTFS_RETURN_IF_ERROR(ListFolderFiles(env, dir, &names));
  for (std::string& name : names) {
    if (!IsTorchFileName(name)) {
      out->others.push_back(std::move(name));
      continue;
    }
    RankFileName parsed;
    if (!ParseRankFileName(name, &parsed)) return Status::OK();
    if (out->by_rank.empty()) out->group = parsed.group;
    if (parsed.group != out->group) return Status::OK();  // several groups: not one save
    if (parsed.world_size) {
      if (out->world_size && *out->world_size != *parsed.world_size) return Status::OK();
      out->world_size = parsed.world_size;
    }
    if (!out->by_rank.emplace(parsed.rank, std::move(name)).second) return Status::OK();
  }
  *is_rank_folder = !out->by_rank.empty();
  return Status::OK();
}

bool IsRankFolder(Env& env, const std::string& dir) {
  RankFolder folder;
  bool is_rank_folder = false;
  return ListRankFolder(env, dir, &folder, &is_rank_folder).ok() && is_rank_folder;
}

// Whether the torch file `path` holds a DTensor or ShardedTensor.
class Counter : public DistributedTensorSink {
 public:
  Status Add(DistributedTensor, const std::vector<PathElement>&, size_t) override {
    ++count;
    return Status::OK();
  }
  size_t count = 0;
};

Status ReadRankFolder(const std::string& dir, const SourceOptions& options, Catalog* catalog) {
  RankFolder folder;
  bool is_rank_folder = false;
  CKPTFS_RETURN_IF_ERROR(ListRankFolder(catalog->files->env(), dir, &folder, &is_rank_folder));
  if (!is_rank_folder) return Status::NotSupported(dir, "not a folder of rank files");
  const std::string& lowest = folder.by_rank.begin()->second;
  {
    Catalog scratch;
    scratch.files = catalog->files;
    json values;
    Counter counter;
    CKPTFS_RETURN_IF_ERROR(
        ReadTorchZipDistributed(JoinPath(dir, lowest), &scratch, &values, options.limits, &counter));
    if (counter.count == 0) {
      // Rank-numbered files of plain tensors: an ordinary folder of torch files.
      catalog->format = "torch-zip-folder";
      return ReadCheckpointFolder(dir, catalog, options.limits);
    }
  }
  catalog->format = "torch-ranks";
  const uint64_t world = std::max<uint64_t>(folder.world_size.value_or(0), folder.by_rank.rbegin()->first + 1);
  RankFileSet set;
  for (uint64_t r = 0; r < world; ++r) {
    auto it = folder.by_rank.find(r);
    if (it == folder.by_rank.end()) {
      std::string missing = folder.group;
      missing.replace(missing.find("{rank}"), 6, std::to_string(r));
      return Status::NotFound(JoinPath(dir, missing),
                              "the rank file of rank " + std::to_string(r) + " of " + std::to_string(world) +
                                  " is missing (its name follows " + folder.group + ")");
    }
    set.files.push_back(JoinPath(dir, it->second));
  }
  json values;
  RankSetSummary summary;
  CKPTFS_RETURN_IF_ERROR(ConsolidateRankFiles(set, options.limits, catalog, &values, &summary));
  catalog->metadata = values.is_object() ? std::move(values) : json{{"value", std::move(values)}};
  json info = summary.ToJson();
  info["group"] = folder.group;
  catalog->metadata["rank_files"] = std::move(info);
  catalog->layout_file = dir;
  return AddSiblingFiles(dir, folder.others, {}, catalog);
}

}  // namespace

extern const ReaderEntry kTorchRanksReader = {
    "torch-ranks", "a folder of torch.save rank files of DTensors / ShardedTensors (FSDP2, FSDP1)",
    {"torch-ranks"}, DetectFolderOf<IsRankFolder>, ReadFolderOf<ReadRankFolder>};

}  // namespace ckptfs
