// Reader for DeepSpeed ZeRO checkpoints (stage 1, 2, 3, the BF16_Optimizer, and pipeline
// per-layer files). Every consolidated parameter becomes the ordered list of byte ranges,
// across the rank files, that zero_to_fp32 would concatenate; nothing is read or copied.
// File layouts and keys: doc/FORMATS.md, "DeepSpeed files" to "DeepSpeed reader"; the
// extent arithmetic lives in format/zero_layout.cpp.
#include <algorithm>
#include <map>
#include <memory>

#include "codec/byte_reader.hpp"
#include "format/deepspeed/zero_files.hpp"
#include "format/deepspeed/zero_layout.hpp"
#include "format/readers.hpp"
#include "format/torch/torch_archive.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;
using Kind = PyValue::Kind;

// The per-group Adam moment tensors of one rank (doc/FORMATS.md, "DeepSpeed Adam moments"):
// stage 3 keeps them in the inner optimizer's state, one per sub-group; stage 1/2 in
// base_optimizer_state, one per group (a dict with "state", or in elastic checkpoints a
// list of per-group dicts).
Status MomentTensors(const TorchArchive& a, int stage, size_t groups, const char* moment, std::vector<TensorEntry>* out) {
  const PyValue* osd = AsMapping(Find(AsMapping(a.root()), "optimizer_state_dict"));
  const PyValue* base = stage == 3 ? Find(osd, "optimizer_state_dict") : Find(osd, "base_optimizer_state");
  const PyValue* state = AsMapping(Find(AsMapping(base), "state"));
  for (size_t g = 0; g < groups; ++g) {
    const PyValue* group_state = nullptr;
    if (state) {
      for (const auto& [k, v] : state->entries())
        if (k->kind() == Kind::kInt && k->i() == static_cast<int64_t>(g)) group_state = v;
    } else if (base && base->kind() == Kind::kList && g < base->items().size()) {
      group_state = base->items()[g];
    }
    const PyValue* t = Find(AsMapping(group_state), moment);
    TensorEntry entry;
    bool is_tensor = false;
    if (t) CKPTFS_RETURN_IF_ERROR(a.AsTensor(t, &entry, &is_tensor));
    if (!is_tensor || entry.shape.size() != 1 || !StoredAsExtents(entry))
      return a.Bad(std::string("no flat ") + moment + " tensor for parameter group " + std::to_string(g) +
                   " (an optimizer other than Adam?)");
    out->push_back(std::move(entry));
  }
  return Status::OK();
}


class ZeroReader {
 public:
  ZeroReader(std::string tag_dir, std::string tag, const SourceOptions& options, Catalog* catalog)
      : tag_dir_(std::move(tag_dir)), tag_(std::move(tag)), options_(options), catalog_(catalog) {}

  Status Read();

 private:
  // One mp rank's optimizer files: what rank 0's says about the run, and every rank's flat
  // fp32 partitions.
  struct OptimizerRanks {
    int stage = 0;       // as ZeroLayout::stage: -1 for the BF16_Optimizer
    uint64_t world = 0;  // data-parallel ranks, from rank 0's partition_count
    const PyValue* rank0_state = nullptr;  // rank 0's optimizer_state_dict
    std::vector<std::unique_ptr<TorchArchive>> archives;  // by dp rank
    std::vector<ZeroRankFlats> fp32;  // by dp rank: fp32 flat groups (stage 3: sub-groups)
    bool bf16_optimizer() const { return stage < 0; }
  };
  Status Open(const std::string& name, std::unique_ptr<TorchArchive>* out);
  Status ReadMpRank(uint64_t mp, const ZeroMpRankFiles& files, const std::string& prefix);
  Status OpenOptimizerRanks(const ZeroMpRankFiles& files, const std::string& mp_text, OptimizerRanks* ranks);
  Status ReadStageAndWorld(const ZeroMpRankFiles& files, OptimizerRanks* ranks);
  Status CheckRankFileSet(const ZeroMpRankFiles& files, const std::string& mp_text, const OptimizerRanks& ranks);
  Status ReadFlatPartitions(const ZeroMpRankFiles& files, OptimizerRanks* ranks);
  Status AddTrainable(const std::string& prefix, const OptimizerRanks& ranks, ZeroLayout* layout);
  Status AddMoments(const std::string& prefix, const OptimizerRanks& ranks, const ZeroLayout& layout);
  Status ReadLayers(const std::vector<ZeroLayerFile>& layers);
  Status FlatGroups(const TorchArchive& a, const PyValue* list, const std::string& what, std::vector<TensorEntry>* out);
  Status Tensor(const TorchArchive& a, const PyValue* v, const std::string& what, TensorEntry* t);

  std::string Path(const std::string& name) const { return tag_dir_ + "/" + name; }

  std::string tag_dir_, tag_;
  SourceOptions options_;
  Catalog* catalog_;
  ZeroTensors out_{tag_dir_, catalog_};
};

Status ZeroReader::Open(const std::string& name, std::unique_ptr<TorchArchive>* out) {
  *out = std::make_unique<TorchArchive>();
  return (*out)->Open(Path(name), catalog_->files.get(), options_.limits);
}

Status ZeroReader::Tensor(const TorchArchive& a, const PyValue* v, const std::string& what, TensorEntry* t) {
  bool is_tensor = false;
  if (v) CKPTFS_RETURN_IF_ERROR(a.AsTensor(v, t, &is_tensor));
  if (!is_tensor) return a.Bad(what + " is not a tensor");
  return Status::OK();
}

Status ZeroReader::FlatGroups(const TorchArchive& a, const PyValue* list, const std::string& what,
                              std::vector<TensorEntry>* out) {
  if (!list || (list->kind() != Kind::kList && list->kind() != Kind::kTuple)) return a.Bad("no " + what + " list");
  for (size_t g = 0; g < list->items().size(); ++g) {
    TensorEntry t;
    CKPTFS_RETURN_IF_ERROR(Tensor(a, list->items()[g], what + "[" + std::to_string(g) + "]", &t));
    if (t.shape.size() != 1 || !StoredAsExtents(t)) return a.Bad(what + "[" + std::to_string(g) + "] is not a flat 1-D tensor");
    out->push_back(std::move(t));
  }
  return Status::OK();
}

// One mp rank: its optimizer and model-states files, then the tensors in zero_to_fp32's
// order (buffers, frozen parameters, trainable parameters, tied aliases), the Adam moments
// on request, and the run's metadata.
Status ZeroReader::ReadMpRank(uint64_t mp, const ZeroMpRankFiles& files, const std::string& prefix) {
  char mp_text[16];
  std::snprintf(mp_text, sizeof mp_text, "%02llu", static_cast<unsigned long long>(mp));
  if (files.optim.empty()) return Status::Corruption(tag_dir_, std::string("no optimizer files for mp_rank_") + mp_text);
  OptimizerRanks ranks;
  CKPTFS_RETURN_IF_ERROR(OpenOptimizerRanks(files, mp_text, &ranks));
  ZeroModelStates model;
  CKPTFS_RETURN_IF_ERROR(OpenZeroModelStates(tag_dir_, files, mp_text, ranks.stage, ranks.world, catalog_->files.get(),
                                             options_.limits, &model));
  CKPTFS_RETURN_IF_ERROR(AddZeroBuffers(prefix, model, &out_));
  CKPTFS_RETURN_IF_ERROR(AddZeroFrozen(prefix, ranks.stage, ranks.world, model, &out_));
  const size_t first_trainable = catalog_->tensors.size();
  ZeroLayout layout;  // takes over the shapes: no later step reads them from `model`
  layout.shapes = std::move(model.param_shapes);
  CKPTFS_RETURN_IF_ERROR(AddTrainable(prefix, ranks, &layout));
  CKPTFS_RETURN_IF_ERROR(AddZeroTiedAliases(prefix, model, first_trainable, &out_));
  if (options_.zero_moments) CKPTFS_RETURN_IF_ERROR(AddMoments(prefix, ranks, layout));
  DescribeZeroRun(tag_, ranks.stage, ranks.world, model, catalog_);
  return Status::OK();
}

Status ZeroReader::OpenOptimizerRanks(const ZeroMpRankFiles& files, const std::string& mp_text, OptimizerRanks* ranks) {
  CKPTFS_RETURN_IF_ERROR(ReadStageAndWorld(files, ranks));
  CKPTFS_RETURN_IF_ERROR(CheckRankFileSet(files, mp_text, *ranks));
  return ReadFlatPartitions(files, ranks);
}

// Rank 0's optimizer file says the stage and the data-parallel world size.
Status ZeroReader::ReadStageAndWorld(const ZeroMpRankFiles& files, OptimizerRanks* ranks) {
  const std::string& first = files.optim.begin()->second;
  if (files.optim.begin()->first != 0) return Status::Corruption(Path(first), "rank 0's optimizer file is missing");
  ranks->archives.resize(1);
  CKPTFS_RETURN_IF_ERROR(Open(first, &ranks->archives[0]));
  const TorchArchive& rank0 = *ranks->archives[0];
  const PyValue* osd = AsMapping(Find(AsMapping(rank0.root()), "optimizer_state_dict"));
  if (!osd) return rank0.Bad("no optimizer_state_dict: not a DeepSpeed ZeRO optimizer file");
  ranks->rank0_state = osd;
  CKPTFS_RETURN_IF_ERROR(ZeroStageOf(osd, Path(first), &ranks->stage));
  if (ranks->bf16_optimizer() && !Find(osd, "single_partition_of_fp32_groups"))
    return rank0.Bad("not a ZeRO checkpoint (no zero_stage)");
  ranks->world = ZeroPartitionCount(osd);
  if (ranks->world == 0) return rank0.Bad("no valid partition_count");
  return Status::OK();
}

// Exactly ranks 0..W-1, named by parsed rank numbers.
Status ZeroReader::CheckRankFileSet(const ZeroMpRankFiles& files, const std::string& mp_text, const OptimizerRanks& ranks) {
  const std::string& first = files.optim.begin()->second;
  const std::string prefix16 = first.rfind("bf16_", 0) == 0 ? "bf16_" : "";
  for (uint64_t r = 0; r < ranks.world; ++r)
    if (!files.optim.count(r))
      return Status::Corruption(Path(prefix16 + "zero_pp_rank_" + std::to_string(r) + "_mp_rank_" + mp_text + "_optim_states.pt"),
                                "missing: the checkpoint was saved by " + std::to_string(ranks.world) + " data-parallel ranks");
  if (files.optim.size() != ranks.world)
    return Status::Corruption(Path(files.optim.rbegin()->second),
                              "unexpected: rank 0 says the world size is " + std::to_string(ranks.world));
  return Status::OK();
}

// Opens ranks 1..W-1 and reads every rank's flat fp32 partitions, checking each rank
// agrees with rank 0 on the world size and the group count.
Status ZeroReader::ReadFlatPartitions(const ZeroMpRankFiles& files, OptimizerRanks* ranks) {
  const uint64_t world = ranks->world;
  ranks->archives.resize(world);
  for (uint64_t r = 1; r < world; ++r) CKPTFS_RETURN_IF_ERROR(Open(files.optim.at(r), &ranks->archives[r]));
  const char* flat_key = ranks->stage == 3 ? "fp32_flat_groups" : "single_partition_of_fp32_groups";
  ranks->fp32.resize(world);
  for (uint64_t r = 0; r < world; ++r) {
    const TorchArchive& archive = *ranks->archives[r];
    ZeroRankFlats& flats = ranks->fp32[r];
    flats.path = archive.path();
    const PyValue* rosd = AsMapping(Find(AsMapping(archive.root()), "optimizer_state_dict"));
    if (!rosd) return archive.Bad("no optimizer_state_dict");
    if (const uint64_t w = ZeroPartitionCount(rosd); w != world)
      return archive.Bad("was saved by " + std::to_string(w) + " data-parallel ranks, rank 0 by " + std::to_string(world) +
                         " (files of different checkpoints mixed?)");
    CKPTFS_RETURN_IF_ERROR(FlatGroups(archive, Find(rosd, flat_key), flat_key, &flats.groups));
    if (flats.groups.size() != ranks->fp32[0].groups.size())
      return archive.Bad("has " + std::to_string(flats.groups.size()) + " parameter groups, rank 0 has " +
                         std::to_string(ranks->fp32[0].groups.size()));
  }
  return Status::OK();
}

// Trainable parameters from the fp32 partitions. Completes `layout` (which holds the
// parameter shapes) for the moments.
Status ZeroReader::AddTrainable(const std::string& prefix, const OptimizerRanks& ranks, ZeroLayout* layout) {
  layout->stage = ranks.stage;
  layout->world = ranks.world;
  if (const PyValue* pads = Find(ranks.rank0_state, "param_alignment_paddings"); pads && pads->kind() == Kind::kList)
    for (const PyValue* g : pads->items()) AsUintTuple(g, &layout->align_pads.emplace_back());
  CKPTFS_RETURN_IF_ERROR(CheckZeroPartitions(ranks.fp32, layout));
  std::vector<TensorEntry> params;
  CKPTFS_RETURN_IF_ERROR(WalkZeroTrainable(*layout, ranks.fp32, &params));
  for (TensorEntry& t : params) {
    std::string name = t.key;
    CKPTFS_RETURN_IF_ERROR(out_.Add(prefix, name, std::move(t)));
  }
  return Status::OK();
}

// The Adam moments of every trainable parameter, laid out exactly like the fp32 partitions
// (doc/FORMATS.md, "DeepSpeed Adam moments"), under "exp_avg." and "exp_avg_sq.".
Status ZeroReader::AddMoments(const std::string& prefix, const OptimizerRanks& ranks, const ZeroLayout& layout) {
  for (const char* moment : {"exp_avg", "exp_avg_sq"}) {
    std::vector<ZeroRankFlats> flats(ranks.world);
    for (uint64_t r = 0; r < ranks.world; ++r) {
      flats[r].path = ranks.fp32[r].path;
      CKPTFS_RETURN_IF_ERROR(
          MomentTensors(*ranks.archives[r], ranks.stage, ranks.fp32[r].groups.size(), moment, &flats[r].groups));
    }
    std::vector<TensorEntry> moments;
    CKPTFS_RETURN_IF_ERROR(WalkZeroTrainable(layout, flats, &moments));
    for (TensorEntry& t : moments) {
      std::string name = std::string(moment) + "." + t.key;
      CKPTFS_RETURN_IF_ERROR(out_.Add(prefix, name, std::move(t)));
    }
  }
  return Status::OK();
}

// Pipeline per-layer files (doc/FORMATS.md, "DeepSpeed pipeline layer files"): each holds
// one layer's 16-bit state_dict; keys get the global layer index in front, as DeepSpeed
// names them in param_shapes.
Status ZeroReader::ReadLayers(const std::vector<ZeroLayerFile>& layers) {
  const bool several_model_ranks = !layers.empty() && layers.front().model_rank != layers.back().model_rank;
  for (const ZeroLayerFile& lf : layers) {
    std::unique_ptr<TorchArchive> a;
    CKPTFS_RETURN_IF_ERROR(Open(lf.name, &a));
    const PyValue* sd = AsMapping(a->root());
    if (!sd) return a->Bad("layer file does not hold a state_dict");
    char prefix[48];
    if (several_model_ranks)
      // Named after the files' "-model_YY": DeepSpeed's mp_rank_XX numbering counts stages too.
      std::snprintf(prefix, sizeof prefix, "model_%02lld.%llu.", static_cast<long long>(lf.model_rank),
                    static_cast<unsigned long long>(lf.layer));
    else
      std::snprintf(prefix, sizeof prefix, "%llu.", static_cast<unsigned long long>(lf.layer));
    for (const auto& [k, v] : sd->entries()) {
      if (k->kind() != Kind::kStr) continue;
      TensorEntry t;
      bool is_tensor = false;
      CKPTFS_RETURN_IF_ERROR(a->AsTensor(v, &t, &is_tensor));
      if (is_tensor) CKPTFS_RETURN_IF_ERROR(out_.Add(prefix, std::string(k->s()), std::move(t)));
    }
  }
  json& info = catalog_->metadata["deepspeed"];
  info["tag"] = tag_;
  info["pipeline_layer_files"] = layers.size();
  return Status::OK();
}

Status ZeroReader::Read() {
  ZeroTagListing listing;
  CKPTFS_RETURN_IF_ERROR(ListZeroTag(catalog_->files->env(), tag_dir_, &listing));
  if (!listing.layers.empty()) {
    catalog_->format = "deepspeed-pipeline";
    return ReadLayers(listing.layers);
  }
  if (listing.mp.empty()) return Status::InvalidArgument(tag_dir_, "no DeepSpeed checkpoint files in this folder");
  catalog_->format = "deepspeed-zero";
  // Several model-parallel ranks: one subtree each.
  const bool several = listing.mp.size() > 1;
  for (const auto& [mp, files] : listing.mp) {
    char prefix[24] = "";
    if (several) std::snprintf(prefix, sizeof prefix, "mp_rank_%02llu.", static_cast<unsigned long long>(mp));
    CKPTFS_RETURN_IF_ERROR(ReadMpRank(mp, files, prefix));
  }
  catalog_->metadata["deepspeed"]["mp_world_size"] = listing.mp.size();
  return Status::OK();
}

}  // namespace

bool IsDeepSpeedFolder(Env& env, const std::string& dir) {
  PathType latest;
  if (env.Stat(JoinPath(dir, "latest"), &latest).ok() && latest == PathType::kFile) return true;
  ZeroTagListing listing;
  Status s = ListZeroTag(env, dir, &listing);
  // MoE or NVMe-offloaded DeepSpeed files: the DeepSpeed reader refuses them by name.
  if (s.code() == Status::Code::kNotSupported) return true;
  return s.ok() && (!listing.mp.empty() || !listing.layers.empty());
}

Status ReadDeepSpeedCheckpoint(const std::string& dir, const SourceOptions& options, Catalog* catalog) {
  Env& env = catalog->files->env();
  std::string tag_dir = dir, tag = dir.substr(dir.rfind('/') + 1);
  const std::string latest_path = JoinPath(dir, "latest");
  PathType type;
  if (env.Stat(latest_path, &type).ok() && type == PathType::kFile) {
    CKPTFS_RETURN_IF_ERROR(ReadZeroTagFile(env, dir, "latest", options.limits, &tag));
    tag_dir = JoinPath(dir, tag);
  }
  ZeroReader reader(tag_dir, tag, options, catalog);
  CKPTFS_RETURN_IF_ERROR(reader.Read());
  return tag_dir == dir ? Status::OK() : AddZeroSaveFolderFiles(env, dir, "latest", catalog);
}

extern const ReaderEntry kDeepSpeedReader = {
    "deepspeed", "DeepSpeed ZeRO 1/2/3 or pipeline folder", {"deepspeed-zero", "deepspeed-pipeline"},
    DetectFolderOf<IsDeepSpeedFolder>, ReadFolderOf<ReadDeepSpeedCheckpoint>};

}  // namespace ckptfs
