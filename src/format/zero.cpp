// Reader for DeepSpeed ZeRO checkpoints (stage 1, 2, 3, the BF16_Optimizer, and pipeline
// per-layer files). Every consolidated parameter becomes the ordered list of byte ranges,
// across the rank files, that zero_to_fp32 would concatenate; nothing is read or copied.
// File layouts and keys: doc/FORMATS.md, "DeepSpeed files" to "DeepSpeed reader"; the
// extent arithmetic lives in format/zero_layout.cpp.
#include <algorithm>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <unordered_set>

#include "format/byte_reader.hpp"
#include "format/readers.hpp"
#include "format/sibling_files.hpp"
#include "format/torch_archive.hpp"
#include "format/zero_layout.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;
using Kind = PyValue::Kind;

// One model-parallel rank's files.
struct MpRankFiles {
  std::map<uint64_t, std::string> optim;         // dp rank -> optimizer file name
  std::map<uint64_t, std::string> zero3_model;   // dp rank -> stage-3 model-states file
  std::string model;                             // mp_rank_XX_model_states.pt (stage <= 2)
};

struct LayerFile {
  uint64_t layer = 0;
  int64_t model_rank = -1;  // -1: no "-model_YY" part
  std::string name;
};

struct TagListing {
  std::map<uint64_t, MpRankFiles> mp;  // by parsed mp rank
  std::vector<LayerFile> layers;
};

bool ParseUint(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 18) return false;
  *out = std::stoull(s);
  return true;
}

// Sorts the files of a tag folder by role, with ranks parsed from the names (never
// lexicographic order: rank_10 comes after rank_9).
Status ListTag(Env& env, const std::string& tag_dir, TagListing* out) {
  static const std::regex kOptim(R"((bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  static const std::regex kZero3Model(R"(zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  static const std::regex kModel(R"(mp_rank_(\d+)_model_states\.pt)");
  static const std::regex kLayer(R"(layer_(\d+)(-model_(\d+))?-model_states\.pt)");
  static const std::regex kExpert(R"((layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt|expp_rank_\d+_mp_rank_\d+_optim_states\.pt)");
  std::vector<FolderEntry> entries;
  CKPTFS_RETURN_IF_ERROR(env.ListFolder(tag_dir, &entries));
  for (const FolderEntry& entry : entries) {
    const std::string& name = entry.name;
    std::smatch m;
    uint64_t a = 0, b = 0;
    if (name == "offloaded_tensors")
      return Status::NotSupported(tag_dir + "/" + name,
                                  "optimizer states offloaded to NVMe are not supported (the fp32 weights are not in the rank files)");
    if (std::regex_match(name, kExpert))
      return Status::NotSupported(tag_dir + "/" + name, "mixture-of-experts checkpoints are not supported");
    if (std::regex_match(name, m, kOptim) && ParseUint(m[2], &a) && ParseUint(m[3], &b)) {
      out->mp[b].optim[a] = name;
    } else if (std::regex_match(name, m, kZero3Model) && ParseUint(m[1], &a) && ParseUint(m[2], &b)) {
      out->mp[b].zero3_model[a] = name;
    } else if (std::regex_match(name, m, kModel) && ParseUint(m[1], &b)) {
      out->mp[b].model = name;
    } else if (std::regex_match(name, m, kLayer) && ParseUint(m[1], &a)) {
      LayerFile lf{a, -1, name};
      if (m[3].matched) lf.model_rank = static_cast<int64_t>(std::stoull(m[3]));
      out->layers.push_back(lf);
    }
  }
  std::sort(out->layers.begin(), out->layers.end(), [](const LayerFile& x, const LayerFile& y) {
    return std::tie(x.model_rank, x.layer) < std::tie(y.model_rank, y.layer);
  });
  return Status::OK();
}

std::string Trim(std::string s) {
  const char* ws = " \t\r\n";
  s.erase(s.find_last_not_of(ws) + 1);
  s.erase(0, s.find_first_not_of(ws));
  return s;
}

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

// The data-parallel world size an optimizer file was saved with: partition_count, an int
// (stage 3) or one per param group (stage 1/2); 0 when absent.
uint64_t PartitionCount(const PyValue* osd) {
  uint64_t world = 0;
  const PyValue* pc = Find(osd, "partition_count");
  if (!AsUint(pc, &world) && pc && pc->kind() == Kind::kList)
    for (const PyValue* x : pc->items()) {
      uint64_t w;
      if (AsUint(x, &w)) world = std::max(world, w);
    }
  return world;
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
  // One mp rank's model-states files and what rank 0's says about the parameters.
  struct ModelStates {
    // Stage 3: one file per dp rank (each holds its chunks of the frozen parameters);
    // otherwise rank 0's only.
    std::vector<std::unique_ptr<TorchArchive>> archives;
    const PyValue* root = nullptr;           // rank 0's top-level dict
    const PyValue* module = nullptr;         // its 16-bit state_dict, when a mapping
    const PyValue* shared = nullptr;         // shared_params: alias -> owner
    const PyValue* frozen_shapes = nullptr;  // frozen_param_shapes: name -> shape
    ZeroParamShapes param_shapes;            // the trainable parameters, per group
    std::vector<std::string> buffers;        // buffer_names
    const TorchArchive& rank0() const { return *archives[0]; }
  };

  Status Open(const std::string& name, std::unique_ptr<TorchArchive>* out);
  Status ReadMpRank(uint64_t mp, const MpRankFiles& files, const std::string& prefix);
  Status OpenOptimizerRanks(const MpRankFiles& files, const std::string& mp_text, OptimizerRanks* ranks);
  Status ReadStageAndWorld(const MpRankFiles& files, OptimizerRanks* ranks);
  Status CheckRankFileSet(const MpRankFiles& files, const std::string& mp_text, const OptimizerRanks& ranks);
  Status ReadFlatPartitions(const MpRankFiles& files, OptimizerRanks* ranks);
  Status OpenModelStates(const MpRankFiles& files, const std::string& mp_text, const OptimizerRanks& ranks,
                         ModelStates* model);
  Status AddBuffers(const std::string& prefix, const ModelStates& model);
  Status AddFrozen(const std::string& prefix, const OptimizerRanks& ranks, const ModelStates& model);
  Status AddFrozenFragments(const std::string& prefix, const OptimizerRanks& ranks, const ModelStates& model);
  Status AddUnlistedModuleEntries(const std::string& prefix, const ModelStates& model);
  Status AddTrainable(const std::string& prefix, const OptimizerRanks& ranks, ZeroLayout* layout);
  Status AddTiedAliases(const std::string& prefix, const ModelStates& model, size_t first_trainable);
  Status AddMoments(const std::string& prefix, const OptimizerRanks& ranks, const ZeroLayout& layout);
  void DescribeRun(const OptimizerRanks& ranks, const ModelStates& model);
  Status ReadLayers(const std::vector<LayerFile>& layers);
  Status ZeroStage(const PyValue* osd, const std::string& where, int* stage);
  Status FlatGroups(const TorchArchive& a, const PyValue* list, const std::string& what, std::vector<TensorEntry>* out);
  Status Add(const std::string& prefix, const std::string& name, TensorEntry t);
  Status Tensor(const TorchArchive& a, const PyValue* v, const std::string& what, TensorEntry* t);

  std::string Path(const std::string& name) const { return tag_dir_ + "/" + name; }

  std::string tag_dir_, tag_;
  SourceOptions options_;
  Catalog* catalog_;
  std::unordered_set<std::string> keys_;
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

Status ZeroReader::Add(const std::string& prefix, const std::string& name, TensorEntry t) {
  t.key = prefix + name;
  t.path = {t.key};
  if (!keys_.insert(t.key).second) return Status::Corruption(tag_dir_, "parameter '" + t.key + "' appears twice");
  catalog_->tensors.push_back(std::move(t));
  return Status::OK();
}

// ZeroStageEnum pickles as EnumClass(n), as getattr(EnumClass, "name") (Python 3.11.2),
// or as a plain int (DeepSpeed < 0.7).
Status ZeroReader::ZeroStage(const PyValue* osd, const std::string& where, int* stage) {
  const PyValue* v = Find(osd, "zero_stage");
  *stage = -1;  // absent: BF16_Optimizer
  if (!v) return Status::OK();
  uint64_t n;
  if (AsUint(v, &n) || (v->kind() == Kind::kObject && AsUint(Arg(v, 0), &n))) {
    *stage = static_cast<int>(n);
  } else if (IsCall(v, "__builtin__.getattr") || IsCall(v, "builtins.getattr")) {
    const PyValue* member = Arg(v, 1);
    static const std::map<std::string_view, int> kNames = {
        {"disabled", 0}, {"optimizer_states", 1}, {"gradients", 2}, {"weights", 3}, {"max_stage", 3}};
    auto it = member ? kNames.find(member->s()) : kNames.end();
    if (it != kNames.end()) *stage = it->second;
  }
  if (*stage < 1 || *stage > 3) return Status::NotSupported(where, "unsupported ZeRO stage");
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

// One (name -> shape) mapping per group, in flat-buffer order (doc/FORMATS.md, "DeepSpeed keys").
Status ParamShapes(const TorchArchive& a, const PyValue* v,
                   std::vector<std::vector<std::pair<std::string, std::vector<uint64_t>>>>* out) {
  std::vector<const PyValue*> groups;
  if (AsMapping(v)) groups.push_back(v);  // before DeepSpeed 0.5.4: a single mapping
  else if (v && v->kind() == Kind::kList) groups = {v->items().begin(), v->items().end()};
  else return a.Bad("model states have no param_shapes (not a ZeRO checkpoint?)");
  for (const PyValue* g : groups) {
    const PyValue* m = AsMapping(g);
    if (!m) return a.Bad("param_shapes entry is not a mapping");
    auto& dst = out->emplace_back();
    for (const auto& [k, s] : m->entries()) {
      std::vector<uint64_t> shape;
      if (k->kind() != Kind::kStr || !AsUintTuple(s, &shape)) return a.Bad("malformed param_shapes entry");
      if (!ZeroShapeFits(shape)) return a.Bad("param_shapes entry '" + std::string(k->s()) + "' has a shape whose size overflows");
      dst.emplace_back(std::string(k->s()), std::move(shape));
    }
  }
  return Status::OK();
}

std::vector<std::string> StringList(const PyValue* v) {
  std::vector<std::string> out;
  if (v && (v->kind() == Kind::kList || v->kind() == Kind::kTuple || v->kind() == Kind::kSet))
    for (const PyValue* s : v->items())
      if (s->kind() == Kind::kStr) out.emplace_back(s->s());
  return out;
}

// One mp rank: its optimizer and model-states files, then the tensors in zero_to_fp32's
// order (buffers, frozen parameters, trainable parameters, tied aliases), the Adam moments
// on request, and the run's metadata.
Status ZeroReader::ReadMpRank(uint64_t mp, const MpRankFiles& files, const std::string& prefix) {
  char mp_text[16];
  std::snprintf(mp_text, sizeof mp_text, "%02llu", static_cast<unsigned long long>(mp));
  if (files.optim.empty()) return Status::Corruption(tag_dir_, std::string("no optimizer files for mp_rank_") + mp_text);
  OptimizerRanks ranks;
  CKPTFS_RETURN_IF_ERROR(OpenOptimizerRanks(files, mp_text, &ranks));
  ModelStates model;
  CKPTFS_RETURN_IF_ERROR(OpenModelStates(files, mp_text, ranks, &model));
  CKPTFS_RETURN_IF_ERROR(AddBuffers(prefix, model));
  CKPTFS_RETURN_IF_ERROR(AddFrozen(prefix, ranks, model));
  const size_t first_trainable = catalog_->tensors.size();
  ZeroLayout layout;  // takes over the shapes: no later step reads them from `model`
  layout.shapes = std::move(model.param_shapes);
  CKPTFS_RETURN_IF_ERROR(AddTrainable(prefix, ranks, &layout));
  CKPTFS_RETURN_IF_ERROR(AddTiedAliases(prefix, model, first_trainable));
  if (options_.zero_moments) CKPTFS_RETURN_IF_ERROR(AddMoments(prefix, ranks, layout));
  DescribeRun(ranks, model);
  return Status::OK();
}

Status ZeroReader::OpenOptimizerRanks(const MpRankFiles& files, const std::string& mp_text, OptimizerRanks* ranks) {
  CKPTFS_RETURN_IF_ERROR(ReadStageAndWorld(files, ranks));
  CKPTFS_RETURN_IF_ERROR(CheckRankFileSet(files, mp_text, *ranks));
  return ReadFlatPartitions(files, ranks);
}

// Rank 0's optimizer file says the stage and the data-parallel world size.
Status ZeroReader::ReadStageAndWorld(const MpRankFiles& files, OptimizerRanks* ranks) {
  const std::string& first = files.optim.begin()->second;
  if (files.optim.begin()->first != 0) return Status::Corruption(Path(first), "rank 0's optimizer file is missing");
  ranks->archives.resize(1);
  CKPTFS_RETURN_IF_ERROR(Open(first, &ranks->archives[0]));
  const TorchArchive& rank0 = *ranks->archives[0];
  const PyValue* osd = AsMapping(Find(AsMapping(rank0.root()), "optimizer_state_dict"));
  if (!osd) return rank0.Bad("no optimizer_state_dict: not a DeepSpeed ZeRO optimizer file");
  ranks->rank0_state = osd;
  CKPTFS_RETURN_IF_ERROR(ZeroStage(osd, Path(first), &ranks->stage));
  if (ranks->bf16_optimizer() && !Find(osd, "single_partition_of_fp32_groups"))
    return rank0.Bad("not a ZeRO checkpoint (no zero_stage)");
  ranks->world = PartitionCount(osd);
  if (ranks->world == 0) return rank0.Bad("no valid partition_count");
  return Status::OK();
}

// Exactly ranks 0..W-1, named by parsed rank numbers.
Status ZeroReader::CheckRankFileSet(const MpRankFiles& files, const std::string& mp_text, const OptimizerRanks& ranks) {
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
Status ZeroReader::ReadFlatPartitions(const MpRankFiles& files, OptimizerRanks* ranks) {
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
    if (const uint64_t w = PartitionCount(rosd); w != world)
      return archive.Bad("was saved by " + std::to_string(w) + " data-parallel ranks, rank 0 by " + std::to_string(world) +
                         " (files of different checkpoints mixed?)");
    CKPTFS_RETURN_IF_ERROR(FlatGroups(archive, Find(rosd, flat_key), flat_key, &flats.groups));
    if (flats.groups.size() != ranks->fp32[0].groups.size())
      return archive.Bad("has " + std::to_string(flats.groups.size()) + " parameter groups, rank 0 has " +
                         std::to_string(ranks->fp32[0].groups.size()));
  }
  return Status::OK();
}

// The model-states files: rank 0's carries the names and shapes (doc/FORMATS.md,
// "DeepSpeed keys"); at stage 3 every rank's carries its chunks of the frozen parameters.
Status ZeroReader::OpenModelStates(const MpRankFiles& files, const std::string& mp_text, const OptimizerRanks& ranks,
                                   ModelStates* model) {
  model->archives.resize(ranks.stage == 3 ? ranks.world : 1);
  if (ranks.stage == 3) {
    for (uint64_t r = 0; r < ranks.world; ++r) {
      auto it = files.zero3_model.find(r);
      if (it == files.zero3_model.end())
        return Status::Corruption(Path("zero_pp_rank_" + std::to_string(r) + "_mp_rank_" + mp_text + "_model_states.pt"),
                                  "missing: stage-3 checkpoints have one model-states file per rank");
      CKPTFS_RETURN_IF_ERROR(Open(it->second, &model->archives[r]));
    }
  } else {
    if (files.model.empty())
      return Status::Corruption(Path("mp_rank_" + mp_text + "_model_states.pt"), "missing model-states file");
    CKPTFS_RETURN_IF_ERROR(Open(files.model, &model->archives[0]));
  }
  const TorchArchive& rank0 = model->rank0();
  model->root = AsMapping(rank0.root());
  if (!model->root || !Find(model->root, "buffer_names"))
    return rank0.Bad("not a DeepSpeed model-states file (no buffer_names)");
  model->module = AsMapping(Find(model->root, "module"));
  CKPTFS_RETURN_IF_ERROR(ParamShapes(rank0, Find(model->root, "param_shapes"), &model->param_shapes));
  model->buffers = StringList(Find(model->root, "buffer_names"));
  model->shared = AsMapping(Find(model->root, "shared_params"));
  model->frozen_shapes = AsMapping(Find(model->root, "frozen_param_shapes"));
  return Status::OK();
}

// Buffers, in their stored dtype (zero_to_fp32 casts float buffers to fp32; serving the
// stored bytes keeps them byte ranges of the files).
Status ZeroReader::AddBuffers(const std::string& prefix, const ModelStates& model) {
  for (const std::string& name : model.buffers) {
    TensorEntry t;
    CKPTFS_RETURN_IF_ERROR(Tensor(model.rank0(), Find(model.module, name), "buffer '" + name + "' in module", &t));
    CKPTFS_RETURN_IF_ERROR(Add(prefix, name, std::move(t)));
  }
  return Status::OK();
}

// Frozen parameters, 16-bit as stored (doc/FORMATS.md, "DeepSpeed frozen parameters, tied
// weights, buffers").
Status ZeroReader::AddFrozen(const std::string& prefix, const OptimizerRanks& ranks, const ModelStates& model) {
  if (model.frozen_shapes) return AddFrozenFragments(prefix, ranks, model);
  // Stage 1 and the BF16_Optimizer record no frozen parameters; the 16-bit copies in
  // `module` are all there is. Stage 2 and 3 without frozen_param_shapes have none.
  if (ranks.stage == 1 || ranks.bf16_optimizer()) return AddUnlistedModuleEntries(prefix, model);
  return Status::OK();
}

// Stage 2: each frozen_param_fragments entry is the whole parameter. Stage 3: rank r's
// holds elements [r·P, r·P + P) of the padded parameter, the first len_r of them real.
Status ZeroReader::AddFrozenFragments(const std::string& prefix, const OptimizerRanks& ranks, const ModelStates& model) {
  for (const auto& [k, s] : model.frozen_shapes->entries()) {
    const std::string name(k->s());
    std::vector<uint64_t> shape;
    if (k->kind() != Kind::kStr || !AsUintTuple(s, &shape)) return model.rank0().Bad("malformed frozen_param_shapes");
    if (!ZeroShapeFits(shape))
      return model.rank0().Bad("frozen_param_shapes entry '" + name + "' has a shape whose size overflows");
    TensorEntry t;
    t.shape = shape;
    const uint64_t n = ZeroNumel(shape);
    for (uint64_t r = 0; r < model.archives.size(); ++r) {
      const TorchArchive& archive = *model.archives[r];
      TensorEntry fragment;
      CKPTFS_RETURN_IF_ERROR(Tensor(archive, Find(AsMapping(Find(AsMapping(archive.root()), "frozen_param_fragments")), name),
                                    "frozen_param_fragments['" + name + "']", &fragment));
      t.dtype = fragment.dtype;
      if (ranks.stage == 3) {
        if (!StoredAsExtents(fragment)) return archive.Bad("frozen fragment of '" + name + "' is not contiguous");
        CKPTFS_RETURN_IF_ERROR(
            SliceBoxes(fragment, archive.path(), 0, ZeroRealChunkElements(n, ranks.world, r), &t));
      } else {
        if (fragment.numel() != n) return model.rank0().Bad("frozen parameter '" + name + "' does not match its shape");
        t.boxes = fragment.boxes;
      }
    }
    CKPTFS_RETURN_IF_ERROR(Add(prefix, name, std::move(t)));
  }
  return Status::OK();
}

// The `module` entries that are neither trainable parameters, nor buffers, nor tied
// aliases: the frozen parameters of a run that does not list them.
Status ZeroReader::AddUnlistedModuleEntries(const std::string& prefix, const ModelStates& model) {
  if (!model.module) return Status::OK();
  std::set<std::string> listed(model.buffers.begin(), model.buffers.end());
  for (const auto& group : model.param_shapes)
    for (const auto& [name, shape] : group) listed.insert(name);
  if (model.shared)
    for (const auto& [k, v] : model.shared->entries())
      if (k->kind() == Kind::kStr) listed.emplace(k->s());
  for (const auto& [k, v] : model.module->entries()) {
    if (k->kind() != Kind::kStr) continue;
    const std::string name(k->s());
    if (listed.count(name)) continue;
    TensorEntry t;
    CKPTFS_RETURN_IF_ERROR(Tensor(model.rank0(), v, "module['" + name + "']", &t));
    CKPTFS_RETURN_IF_ERROR(Add(prefix, name, std::move(t)));
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
    CKPTFS_RETURN_IF_ERROR(Add(prefix, name, std::move(t)));
  }
  return Status::OK();
}

// Tied aliases read their owner's bytes; both get one storage id so consumers see them
// tied. Owners are trainable parameters (catalog entries from `first_trainable` on).
Status ZeroReader::AddTiedAliases(const std::string& prefix, const ModelStates& model, size_t first_trainable) {
  if (!model.shared) return Status::OK();
  for (const auto& [k, v] : model.shared->entries()) {
    if (k->kind() != Kind::kStr || v->kind() != Kind::kStr) continue;
    // The owner's key is built outside the lambda: clang before 16 cannot capture a
    // structured binding (the fuzz build uses Debian's clang 14).
    const std::string owner_key = prefix + std::string(v->s());
    auto owner = std::find_if(catalog_->tensors.begin() + first_trainable, catalog_->tensors.end(),
                              [&](const TensorEntry& t) { return t.key == owner_key; });
    if (owner == catalog_->tensors.end()) continue;
    owner->storage_id = "zero:" + owner->key;
    TensorEntry alias = *owner;
    CKPTFS_RETURN_IF_ERROR(Add(prefix, std::string(k->s()), std::move(alias)));
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
      CKPTFS_RETURN_IF_ERROR(Add(prefix, name, std::move(t)));
    }
  }
  return Status::OK();
}

// metadata["deepspeed"]: the run as DeepSpeed describes it, and the dtypes served.
void ZeroReader::DescribeRun(const OptimizerRanks& ranks, const ModelStates& model) {
  json& info = catalog_->metadata["deepspeed"];
  info["tag"] = tag_;
  info["stage"] = ranks.bf16_optimizer() ? 1 : ranks.stage;
  info["optimizer"] = ranks.bf16_optimizer() ? "BF16_Optimizer"
                      : ranks.stage == 3     ? "DeepSpeedZeroOptimizer_Stage3"
                                             : "DeepSpeedZeroOptimizer";
  info["world_size"] = ranks.world;
  if (const PyValue* v = Find(model.root, "ds_version"); v && v->kind() == Kind::kStr) info["ds_version"] = std::string(v->s());
  if (uint64_t steps; AsUint(Find(model.root, "global_steps"), &steps)) info["global_steps"] = steps;
  json dtypes = json::object();
  for (const TensorEntry& t : catalog_->tensors) dtypes[std::string(Info(t.dtype).torch_name)] = true;
  info["dtypes"] = json::array();
  for (auto& [name, _] : dtypes.items()) info["dtypes"].push_back(name);
}

// Pipeline per-layer files (doc/FORMATS.md, "DeepSpeed pipeline layer files"): each holds
// one layer's 16-bit state_dict; keys get the global layer index in front, as DeepSpeed
// names them in param_shapes.
Status ZeroReader::ReadLayers(const std::vector<LayerFile>& layers) {
  const bool several_model_ranks = !layers.empty() && layers.front().model_rank != layers.back().model_rank;
  for (const LayerFile& lf : layers) {
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
      if (is_tensor) CKPTFS_RETURN_IF_ERROR(Add(prefix, std::string(k->s()), std::move(t)));
    }
  }
  json& info = catalog_->metadata["deepspeed"];
  info["tag"] = tag_;
  info["pipeline_layer_files"] = layers.size();
  return Status::OK();
}

Status ZeroReader::Read() {
  TagListing listing;
  CKPTFS_RETURN_IF_ERROR(ListTag(catalog_->files->env(), tag_dir_, &listing));
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

// A save folder written by the Hugging Face Trainer (checkpoint-N/) holds config.json, the
// tokenizer and the generation config beside `latest` and the tag folder: served next to
// model.safetensors, they make the mount a model folder that from_pretrained opens as it is.
// `latest` only names the tag; sub-folders (the tag folders) are not served.
Status AddSaveFolderFiles(Env& env, const std::string& dir, Catalog* catalog) {
  std::vector<std::string> names;
  CKPTFS_RETURN_IF_ERROR(ListFolderFiles(env, dir, &names));
  return AddSiblingFiles(dir, names, [](const std::string& name) { return name == "latest"; }, catalog);
}

}  // namespace

bool IsDeepSpeedFolder(Env& env, const std::string& dir) {
  PathType latest;
  if (env.Stat(JoinPath(dir, "latest"), &latest).ok() && latest == PathType::kFile) return true;
  TagListing listing;
  Status s = ListTag(env, dir, &listing);
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
    std::string text;
    CKPTFS_RETURN_IF_ERROR(
        env.ReadSmallFile(latest_path, options.limits.header_bytes, &text, "'latest'", "max_header"));
    tag = Trim(text);
    if (tag.empty() || tag.find('/') != std::string::npos || tag == "." || tag == "..")
      return Status::Corruption(latest_path, "does not name a checkpoint tag");
    tag_dir = JoinPath(dir, tag);
    if (!env.Stat(tag_dir, &type).ok() || type != PathType::kFolder)
      return Status::NotFound(tag_dir, "the tag named by 'latest' does not exist");
  }
  ZeroReader reader(tag_dir, tag, options, catalog);
  CKPTFS_RETURN_IF_ERROR(reader.Read());
  return tag_dir == dir ? Status::OK() : AddSaveFolderFiles(env, dir, catalog);
}

extern const ReaderEntry kDeepSpeedReader = {
    .name = "deepspeed",
    .description = "DeepSpeed ZeRO 1/2/3 or pipeline folder",
    .formats = {"deepspeed-zero", "deepspeed-pipeline"},
    .number = kDeepSpeedFormat,
    .detect = [](SourceProbe& probe, bool* is_format) {
      *is_format = probe.is_folder() && IsDeepSpeedFolder(probe.env(), probe.source());
      return Status::OK();
    },
    .read = [](SourceProbe& probe, const SourceOptions& options, Catalog* catalog) {
      return ReadDeepSpeedCheckpoint(probe.source(), options, catalog);
    },
};

}  // namespace ckptfs
