// Consolidating a set of rank files (format/torch/rank_shards.hpp): each file is read once, its
// DTensors and ShardedTensors collected with their local shards' boxes; a full tensor is the
// union of the ranks' shards placed at their offsets, checked like a DCP chunk list.
#include "format/torch/rank_shards.hpp"

#include <algorithm>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "format/chunk_boxes.hpp"
#include "format/torch/torch_distributed.hpp"
#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;

struct Collected {
  std::vector<PathElement> path;
  std::string key;
  DistributedTensor tensor;
  size_t tensors_before = 0;
};

class Collector : public DistributedTensorSink {
 public:
  Status Add(DistributedTensor tensor, const std::vector<PathElement>& path, size_t tensors_before) override {
    Collected c;
    c.path = path;
    c.key = path.empty() ? "tensor" : FlattenKey(path);
    for (LocalShard& s : tensor.local) s.value = nullptr;
    c.tensor = std::move(tensor);
    c.tensors_before = tensors_before;
    items.push_back(std::move(c));
    return Status::OK();
  }
  std::vector<Collected> items;
};

// What one rank file holds.
struct RankContents {
  std::vector<TensorEntry> plain;
  std::vector<Collected> distributed;
  std::unordered_map<std::string, size_t> plain_by_key, distributed_by_key;
};

std::string PlacementsText(const DistributedTensor& t) {
  std::string s = "(";
  for (size_t i = 0; i < t.placements.size(); ++i) s += (i ? ", " : "") + t.placements[i].Describe();
  return s + ")";
}

class Consolidation {
 public:
  Consolidation(const RankFileSet& set, const ReadLimits& limits, Catalog* catalog)
      : set_(set), limits_(limits), catalog_(catalog) {}

  Status Run(json* metadata, RankSetSummary* summary);

 private:
  Status ReadRank(size_t r, json* metadata);
  Status CheckSameKeys(size_t r) const;
  Status Assemble(const Collected& first, TensorEntry* full);
  Status Fail(size_t r, const std::string& key, const std::string& what) const {
    return Status::NotSupported(set_.files[r], (key.empty() ? std::string() : "key '" + key + "': ") + what);
  }

  const RankFileSet& set_;
  const ReadLimits& limits_;
  Catalog* catalog_;
  std::vector<RankContents> ranks_;
};

Status Consolidation::ReadRank(size_t r, json* metadata) {
  Catalog scratch;
  scratch.files = catalog_->files;
  Collector collector;
  json values;
  CKPTFS_RETURN_IF_ERROR(ReadTorchZipDistributed(set_.files[r], &scratch, &values, limits_, &collector));
  if (r == 0) *metadata = std::move(values);
  RankContents& rank = ranks_[r];
  rank.plain = std::move(scratch.tensors);
  rank.distributed = std::move(collector.items);
  for (size_t i = 0; i < rank.plain.size(); ++i) rank.plain_by_key.emplace(rank.plain[i].key, i);
  for (size_t i = 0; i < rank.distributed.size(); ++i)
    if (!rank.distributed_by_key.emplace(rank.distributed[i].key, i).second)
      return Fail(r, rank.distributed[i].key, "two distributed tensors flatten to this key");
  // A plain tensor that views a local shard's storage is a piece of that shard (FSDP1
  // LOCAL_STATE_DICT's per-parameter views of the flat parameter): where it lies in any full
  // tensor is not recorded.
  std::unordered_map<std::string, const std::string*> shard_storage;
  for (const Collected& c : rank.distributed)
    for (const LocalShard& s : c.tensor.local)
      if (!s.tensor.storage_id.empty()) shard_storage.emplace(s.tensor.storage_id, &c.key);
  for (const TensorEntry& t : rank.plain)
    if (auto it = shard_storage.find(t.storage_id); !t.storage_id.empty() && it != shard_storage.end())
      return Fail(r, t.key, "a plain tensor that views the local shard of '" + *it->second +
                                "' (FSDP1 LOCAL_STATE_DICT flat-parameter views): its place in a full tensor is not recorded");
  return Status::OK();
}

Status Consolidation::CheckSameKeys(size_t r) const {
  const RankContents& first = ranks_[0];
  const RankContents& rank = ranks_[r];
  for (const Collected& c : first.distributed)
    if (!rank.distributed_by_key.count(c.key))
      return Fail(r, c.key, std::string(rank.plain_by_key.count(c.key) ? "a plain tensor here but a " : "missing here, a ") +
                                c.tensor.class_name() + " in rank 0's file " + set_.files[0]);
  for (const Collected& c : rank.distributed)
    if (!first.distributed_by_key.count(c.key))
      return Fail(r, c.key, std::string("a ") + c.tensor.class_name() + " here but not in rank 0's file " + set_.files[0]);
  for (const TensorEntry& t : first.plain) {
    auto it = rank.plain_by_key.find(t.key);
    if (it == rank.plain_by_key.end())
      return Fail(r, t.key, "a tensor of rank 0's file " + set_.files[0] + " that this rank file lacks");
    const TensorEntry& mine = rank.plain[it->second];
    if (mine.dtype != t.dtype || mine.shape != t.shape)
      return Fail(r, t.key, "a plain tensor of " + std::string(Info(mine.dtype).torch_name) + " " + ShapeText(mine.shape) +
                                " here but " + std::string(Info(t.dtype).torch_name) + " " + ShapeText(t.shape) +
                                " in rank 0's file: not one value replicated on every rank");
  }
  for (const TensorEntry& t : rank.plain)
    if (!first.plain_by_key.count(t.key))
      return Fail(r, t.key, "a tensor here that rank 0's file " + set_.files[0] + " lacks");
  return Status::OK();
}

Status Consolidation::Assemble(const Collected& first, TensorEntry* full) {
  const DistributedTensor& t0 = first.tensor;
  const std::string& key = first.key;
  const size_t world = set_.files.size();
  if (!t0.not_assembled.empty())
    return Fail(0, key, std::string(t0.class_name()) + " with " + t0.not_assembled +
                            ": not assembled into the full tensor (each rank file alone serves its local shard)");
  if (t0.world_size != world)
    return Fail(0, key, std::string(t0.class_name()) + " saved by " + std::to_string(t0.world_size) + " ranks (" +
                            (t0.kind == DistributedTensor::Kind::kDTensor ? "mesh " + ShapeText(t0.mesh_shape)
                                                                          : std::string("process group")) +
                            ") but the set has " + std::to_string(world) + " rank files" +
                            (t0.world_size > world ? ": the files of ranks " + std::to_string(world) + ".." +
                                                         std::to_string(t0.world_size - 1) + " are missing"
                                                   : ""));
  full->dtype = t0.dtype;
  full->shape = t0.shape;
  std::set<std::vector<uint64_t>> coordinates;
  // ShardedTensor: the blocks the metadata lists, and which of them a rank file holds.
  std::set<std::pair<std::vector<uint64_t>, std::vector<uint64_t>>> held;
  std::vector<std::pair<size_t, const LocalShard*>> placed;  // (rank, shard) of the non-empty shards served
  for (size_t r = 0; r < world; ++r) {
    const DistributedTensor& t = ranks_[r].distributed[ranks_[r].distributed_by_key.at(key)].tensor;
    if (t.kind != t0.kind)
      return Fail(r, key, std::string("a ") + t.class_name() + " here but a " + t0.class_name() + " in rank 0's file");
    if (t.dtype != t0.dtype || t.shape != t0.shape)
      return Fail(r, key, std::string(Info(t.dtype).torch_name) + " " + ShapeText(t.shape) + " here but " +
                              std::string(Info(t0.dtype).torch_name) + " " + ShapeText(t0.shape) + " in rank 0's file");
    if (t.rank >= 0 && static_cast<uint64_t>(t.rank) != r)
      return Fail(r, key, "saved by rank " + std::to_string(t.rank) + ", but the set has this file as rank " +
                              std::to_string(r));
    if (t.world_size != t0.world_size)
      return Fail(r, key, "saved by " + std::to_string(t.world_size) + " ranks here but " +
                              std::to_string(t0.world_size) + " in rank 0's file");
    if (!t.not_assembled.empty())
      return Fail(r, key, std::string(t.class_name()) + " with " + t.not_assembled + ": not assembled into the full tensor");
    if (t.kind == DistributedTensor::Kind::kDTensor) {
      if (PlacementsText(t) != PlacementsText(t0) || t.mesh_shape != t0.mesh_shape)
        return Fail(r, key, "placements " + PlacementsText(t) + " on mesh " + ShapeText(t.mesh_shape) + " here but " +
                                PlacementsText(t0) + " on mesh " + ShapeText(t0.mesh_shape) + " in rank 0's file");
      if (!coordinates.insert(t.coordinate).second)
        return Fail(r, key, "mesh coordinate " + ShapeText(t.coordinate) + " held by another rank file too");
      if (t.replica) continue;
    } else {
      if (t.shards.size() != t0.shards.size())
        return Fail(r, key, "metadata listing " + std::to_string(t.shards.size()) + " shards here but " +
                                std::to_string(t0.shards.size()) + " in rank 0's file");
    }
    for (const LocalShard& s : t.local) {
      if (t.kind == DistributedTensor::Kind::kShardedTensor &&
          !held.emplace(std::vector<uint64_t>(s.offsets.begin(), s.offsets.end()),
                        std::vector<uint64_t>(s.tensor.shape.begin(), s.tensor.shape.end()))
               .second)
        return Fail(r, key, "the shard at " + ShapeText(s.offsets) + " is held by another rank file too");
      if (s.tensor.numel() == 0) continue;
      placed.push_back({r, &s});
    }
  }
  // A shard that is the whole tensor (Replicate on every mesh dimension, a world of one) keeps
  // its stored boxes: a byte range stays a byte range.
  if (placed.size() == 1 && placed[0].second->tensor.shape == full->shape) {
    full->boxes = placed[0].second->tensor.boxes;
  } else {
    for (const auto& [r, s] : placed)
      if (!PlaceChunkBoxes(s->tensor.boxes, s->offsets, s->tensor.shape, &full->boxes))
        return Fail(r, key, "a local shard too large to place");
  }
  if (t0.kind == DistributedTensor::Kind::kShardedTensor)
    for (const DistributedTensor::ShardMeta& m : t0.shards)
      if (!held.count({std::vector<uint64_t>(m.offsets.begin(), m.offsets.end()),
                       std::vector<uint64_t>(m.shape.begin(), m.shape.end())}))
        return Fail(m.rank >= 0 && static_cast<size_t>(m.rank) < world ? static_cast<size_t>(m.rank) : 0, key,
                    "the shard at " + ShapeText(m.offsets) + " of size " + ShapeText(m.shape) +
                        " the metadata places on rank " + std::to_string(m.rank) + " is in no rank file");
  // No hole, no overlap, nothing outside the shape or a file (what DCP's chunk lists must meet).
  full->key = key;
  return ValidateLayout(*full, *catalog_->files, set_.files[0]);
}

Status Consolidation::Run(json* metadata, RankSetSummary* summary) {
  if (set_.files.empty()) return Status::InvalidArgument("rank files", "no rank file given");
  ranks_.resize(set_.files.size());
  for (size_t r = 0; r < set_.files.size(); ++r) CKPTFS_RETURN_IF_ERROR(ReadRank(r, metadata));
  for (size_t r = 1; r < set_.files.size(); ++r) CKPTFS_RETURN_IF_ERROR(CheckSameKeys(r));

  RankSetSummary found;
  found.world_size = set_.files.size();
  bool dtensors = false, sharded = false;
  const size_t first_new = catalog_->tensors.size();
  RankContents& first = ranks_[0];
  auto Append = [&](TensorEntry t, const std::vector<PathElement>& original) {
    std::vector<PathElement> path = set_.prefix;
    path.insert(path.end(), original.begin(), original.end());
    if (set_.select && !set_.select(&path)) return Status::OK();
    if (catalog_->tensors.size() >= limits_.tensors)
      return Status::Refused(set_.files[0], "more than " + std::to_string(limits_.tensors) + " tensors")
          .WithLimitOption("max_tensors");
    t.key = path.empty() ? "tensor" : FlattenKey(path);
    t.path = path;
    catalog_->tensors.push_back(std::move(t));
    return Status::OK();
  };
  // Rank 0's order: its distributed tensors among its plain ones where its walk met them.
  size_t next_plain = 0;
  auto AppendPlainUpTo = [&](size_t end) {
    for (; next_plain < end && next_plain < first.plain.size(); ++next_plain) {
      TensorEntry t = std::move(first.plain[next_plain]);
      std::vector<PathElement> original = t.path;
      t.storage_id.clear();
      CKPTFS_RETURN_IF_ERROR(Append(std::move(t), original));
      ++found.plain_tensors;
    }
    return Status::OK();
  };
  for (const Collected& c : first.distributed) {
    CKPTFS_RETURN_IF_ERROR(AppendPlainUpTo(c.tensors_before));
    TensorEntry full;
    CKPTFS_RETURN_IF_ERROR(Assemble(c, &full));
    CKPTFS_RETURN_IF_ERROR(Append(std::move(full), c.path));
    ++found.distributed_tensors;
    if (c.tensor.kind == DistributedTensor::Kind::kDTensor) {
      if (!dtensors) found.mesh_shape = c.tensor.mesh_shape;
      dtensors = true;
    } else {
      sharded = true;
    }
  }
  CKPTFS_RETURN_IF_ERROR(AppendPlainUpTo(first.plain.size()));
  found.kinds = dtensors && sharded ? "dtensor+sharded_tensor" : dtensors ? "dtensor" : sharded ? "sharded_tensor" : "";
  if (std::optional<size_t> repeated = FindRepeatedKey(catalog_->tensors, first_new))
    return Status::NotSupported(set_.files[0], "two tensors of the rank files flatten to the same key '" +
                                                   catalog_->tensors[*repeated].key + "'");
  if (summary) *summary = std::move(found);
  return Status::OK();
}

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// The decimal number at the start of `s` (its digit count in *length), without overflow.
bool LeadingNumber(std::string_view s, uint64_t* value, size_t* length) {
  size_t n = 0;
  uint64_t v = 0;
  while (n < s.size() && IsDigit(s[n])) {
    if (!CheckedMul(v, 10, &v) || !CheckedAdd(v, static_cast<uint64_t>(s[n] - '0'), &v)) return false;
    ++n;
  }
  *value = v;
  *length = n;
  return n > 0;
}

}  // namespace

json RankSetSummary::ToJson() const {
  json j = {{"world_size", world_size},
            {"distributed_tensors", distributed_tensors},
            {"plain_tensors", plain_tensors},
            {"kinds", kinds}};
  if (!mesh_shape.empty()) j["mesh_shape"] = mesh_shape;
  return j;
}

Status ConsolidateRankFiles(const RankFileSet& set, const ReadLimits& limits, Catalog* catalog, json* metadata,
                            RankSetSummary* summary) {
  json values = json::object();
  Consolidation c(set, limits, catalog);
  const size_t before = catalog->tensors.size();
  Status s = c.Run(&values, summary);
  if (!s.ok()) {
    catalog->tensors.resize(before);
    return s;
  }
  *metadata = std::move(values);
  return Status::OK();
}

bool ParseRankFileName(std::string_view name, RankFileName* out) {
  size_t rank_at = std::string_view::npos, digits_at = 0, digits = 0;
  uint64_t rank = 0;
  for (size_t at = name.find("rank"); at != std::string_view::npos; at = name.find("rank", at + 1)) {
    size_t d = at + 4;
    if (d < name.size() && (name[d] == '_' || name[d] == '-')) ++d;
    uint64_t value;
    size_t length;
    if (!LeadingNumber(name.substr(d), &value, &length)) continue;
    if (rank_at != std::string_view::npos) return false;  // two rank numbers: which one?
    rank_at = at;
    digits_at = d;
    digits = length;
    rank = value;
  }
  if (rank_at == std::string_view::npos) return false;
  RankFileName parsed;
  parsed.rank = rank;
  parsed.group = std::string(name.substr(0, digits_at)) + "{rank}" + std::string(name.substr(digits_at + digits));
  // The world size, where the name says it.
  auto After = [&](std::string_view marker, std::optional<uint64_t>* ws) {
    for (size_t at = name.find(marker); at != std::string_view::npos; at = name.find(marker, at + 1)) {
      if (marker == "ws" && at > 0 && ((name[at - 1] >= 'a' && name[at - 1] <= 'z') || (name[at - 1] >= 'A' && name[at - 1] <= 'Z')))
        continue;
      uint64_t value;
      size_t length;
      if (LeadingNumber(name.substr(at + marker.size()), &value, &length)) {
        *ws = value;
        return;
      }
    }
  };
  for (std::string_view marker : {"world_size_", "world_size", "ws_", "ws"}) {
    if (parsed.world_size) break;
    After(marker, &parsed.world_size);
  }
  if (!parsed.world_size) {
    const std::string_view rest = name.substr(digits_at + digits);
    for (std::string_view of : {"_of_", "-of-"}) {
      uint64_t value;
      size_t length;
      if (rest.substr(0, of.size()) == of && LeadingNumber(rest.substr(of.size()), &value, &length)) parsed.world_size = value;
    }
  }
  *out = std::move(parsed);
  return true;
}

}  // namespace ckptfs
