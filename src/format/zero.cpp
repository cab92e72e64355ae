// Reader for DeepSpeed ZeRO checkpoints (stage 1, 2, 3, the BF16_Optimizer, and pipeline
// per-layer files). Every consolidated parameter becomes the ordered list of byte ranges,
// across the rank files, that zero_to_fp32 would concatenate; nothing is read or copied.
// File layouts, keys and the extent arithmetic: ../shared/reference/deepspeed-zero.md
// (section numbers below refer to it).
#include <algorithm>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <unordered_set>

#include "format/byte_reader.hpp"
#include "format/limit_hint.hpp"
#include "format/readers.hpp"
#include "format/torch_archive.hpp"

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

uint64_t Numel(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
}

// Whether a shape from the metadata has a byte size that fits in 64 bits (at 8 bytes an
// element, the widest ZeRO dtype). Numel() wraps otherwise, and a wrapped count can match
// the flat partition exactly, which served a tensor whose header shape did not match its
// bytes (issue #6, corpus case zero-s2-param-shapes-wrap).
bool ShapeFits(const std::vector<uint64_t>& shape) {
  uint64_t n = 8;
  for (uint64_t d : shape)
    if (!CheckedMul(n, d, &n)) return false;
  return true;
}

// The element range [start, start+count) of a contiguous 1-D tensor, appended to
// `target`'s rank-1 boxes where its last box ends.
Status SliceBoxes(const TensorEntry& flat, const std::string& where, uint64_t start, uint64_t count,
                  TensorEntry* target) {
  if (count == 0) return Status::OK();
  if (!StoredAsExtents(flat) || start + count > flat.numel() || start + count < start)
    return Status::Corruption(where, "a flat partition is shorter than its parameters need");
  if (flat.dtype != target->dtype) return Status::Corruption(where, "a flat partition's dtype differs from its parameter's");
  const uint64_t itemsize = Info(flat.dtype).itemsize;
  std::vector<Box>& out = target->boxes;
  uint64_t skip = start * itemsize, want = count * itemsize;
  for (const Extent& e : ExtentsOf(flat)) {
    if (skip >= e.length) {
      skip -= e.length;
      continue;
    }
    const uint64_t take = std::min(e.length - skip, want);
    Box* last = out.empty() ? nullptr : &out.back();
    if (last && last->file == e.file && last->base_offset + last->extent[0] * itemsize == e.offset + skip)
      last->extent[0] += take / itemsize;  // adjacent ranges of one file merge into one read
    else
      out.push_back(Box::Range(e.file, e.offset + skip, last ? last->offset[0] + last->extent[0] : 0, take / itemsize));
    want -= take;
    skip = 0;
    if (want == 0) break;
  }
  return Status::OK();
}

// How trainable parameters are laid out in the flat partitions of one mp rank.
struct Layout {
  int stage;       // 1, 2, 3; -1 for the BF16_Optimizer (laid out as stage 1/2)
  uint64_t world;  // data-parallel ranks
  const std::vector<std::vector<std::pair<std::string, std::vector<uint64_t>>>>* shapes;
  std::vector<std::vector<uint64_t>> align_pads;  // stage 1/2 parameter_alignment pads, per group
  // Stage 1/2: lengths[g][r], rank r's saved share of group g (the fp32 partitions';
  // moments keep their padding). Stage 3: lengths[j][0], sub-group j's size on every rank.
  std::vector<std::vector<uint64_t>> lengths;
};

// Checks the fp32 partitions agree with each other and records their lengths.
Status CheckPartitions(const Layout& layout, const std::vector<const TorchArchive*>& archives,
                       const std::vector<std::vector<const TensorEntry*>>& fp32,
                       std::vector<std::vector<uint64_t>>* lengths) {
  const size_t groups = fp32[0].size();
  if (layout.stage != 3 && layout.shapes->size() != groups)
    return archives[0]->Bad("holds " + std::to_string(groups) + " parameter groups but param_shapes lists " +
                            std::to_string(layout.shapes->size()));
  lengths->assign(groups, {});
  for (size_t g = 0; g < groups; ++g) {
    for (uint64_t r = 0; r < layout.world; ++r) {
      if (layout.stage == 3 && fp32[r][g]->numel() != fp32[0][g]->numel())
        return archives[r]->Bad("sub-group " + std::to_string(g) + " differs in size from rank 0's");
      (*lengths)[g].push_back(fp32[r][g]->numel());
    }
  }
  return Status::OK();
}

// The boxes of every trainable parameter, in param_shapes order, in per-rank flat tensors
// `flats[r][g]` laid out like the fp32 partitions (the partitions themselves, or the Adam
// moments). Each returned entry's key is the bare parameter name.
Status WalkTrainable(const Layout& layout, const std::vector<const TorchArchive*>& archives,
                     const std::vector<std::vector<const TensorEntry*>>& flats, std::vector<TensorEntry>* out) {
  const uint64_t world = layout.world;
  if (layout.stage == 3) {
    // Section 4.3: each parameter is split into W chunks of P = ceil(n/W) elements; rank r's
    // sub-group tensors concatenate its chunks. Walk the rank-local address space.
    std::vector<uint64_t> bounds = {0};
    for (const auto& len : layout.lengths) bounds.push_back(bounds.back() + len[0]);
    uint64_t offset = 0;
    for (const auto& g : *layout.shapes)
      for (const auto& [name, shape] : g) {
        TensorEntry t;
        t.key = name;
        t.shape = shape;
        t.dtype = flats[0].empty() ? DType::kF32 : flats[0][0]->dtype;
        const uint64_t n = Numel(shape), per_rank = (n + world - 1) / world;
        for (uint64_t r = 0; r < world; ++r) {
          uint64_t len = std::min(per_rank, n > r * per_rank ? n - r * per_rank : 0);
          // A chunk never straddles sub-groups in practice; split it there if it does.
          for (uint64_t at = offset; len > 0;) {
            const size_t j = std::upper_bound(bounds.begin(), bounds.end(), at) - bounds.begin() - 1;
            if (j >= flats[r].size()) return archives[r]->Bad("parameters run past the flat groups");
            const uint64_t take = std::min(len, bounds[j + 1] - at);
            CKPTFS_RETURN_IF_ERROR(SliceBoxes(*flats[r][j], archives[r]->path(), at - bounds[j], take, &t));
            at += take;
            len -= take;
          }
        }
        offset += per_rank;
        out->push_back(std::move(t));
      }
    if (offset != bounds.back())
      return archives[0]->Bad("parameters use " + std::to_string(offset) + " elements per rank but the flat groups hold " +
                              std::to_string(bounds.back()));
    return Status::OK();
  }
  // Section 4.2: per group, the ranks' partitions concatenate to the group's flat vector.
  for (size_t g = 0; g < layout.shapes->size(); ++g) {
    std::vector<uint64_t> starts = {0};  // C_r: where rank r's share starts in the group
    for (uint64_t r = 0; r < world; ++r) starts.push_back(starts.back() + layout.lengths[g][r]);
    const std::vector<uint64_t> no_pads;
    const auto& pads = g < layout.align_pads.size() ? layout.align_pads[g] : no_pads;
    uint64_t a = 0;
    const auto& params = (*layout.shapes)[g];
    for (size_t i = 0; i < params.size(); ++i) {
      TensorEntry t;
      t.key = params[i].first;
      t.shape = params[i].second;
      t.dtype = flats[0][g]->dtype;
      const uint64_t n = Numel(t.shape);
      if (a + n > starts[world])
        return archives[0]->Bad("parameter '" + t.key + "' runs past the end of the flat partitions");
      for (uint64_t r = 0; r < world; ++r) {
        const uint64_t lo = std::max(a, starts[r]), hi = std::min(a + n, starts[r + 1]);
        if (lo < hi)
          CKPTFS_RETURN_IF_ERROR(SliceBoxes(*flats[r][g], archives[r]->path(), lo - starts[r], hi - lo, &t));
      }
      a += n + (i < pads.size() ? pads[i] : 0);
      out->push_back(std::move(t));
    }
    // zero_to_fp32's check: both totals agree once rounded up to the 2*W alignment.
    const uint64_t align = 2 * world;
    auto round_up = [align](uint64_t x) { return (x + align - 1) / align * align; };
    if (layout.stage < 0 ? a > starts[world] : round_up(a) != round_up(starts[world]))
      return archives[0]->Bad("group " + std::to_string(g) + ": parameters use " + std::to_string(a) +
                              " elements but the partitions hold " + std::to_string(starts[world]));
  }
  return Status::OK();
}

// The per-group Adam moment tensors of one rank (section 4.7): stage 3 keeps them in the
// inner optimizer's state, one per sub-group; stage 1/2 in base_optimizer_state, one per
// group (a dict with "state", or in elastic checkpoints a list of per-group dicts).
Status MomentTensors(const TorchArchive& a, int stage, size_t groups, const char* moment, std::vector<TensorEntry>* out) {
  const PyValue* osd = AsMapping(Find(AsMapping(a.root()), "optimizer_state_dict"));
  const PyValue* base = stage == 3 ? Find(osd, "optimizer_state_dict") : Find(osd, "base_optimizer_state");
  const PyValue* state = AsMapping(Find(AsMapping(base), "state"));
  for (size_t g = 0; g < groups; ++g) {
    const PyValue* group_state = nullptr;
    if (state) {
      for (const auto& [k, v] : state->entries)
        if (k->kind == Kind::kInt && k->i == static_cast<int64_t>(g)) group_state = v;
    } else if (base && base->kind == Kind::kList && g < base->items.size()) {
      group_state = base->items[g];
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
  if (!AsUint(pc, &world) && pc && pc->kind == Kind::kList)
    for (const PyValue* x : pc->items) {
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
  struct Partition {
    std::unique_ptr<TorchArchive> archive;
    std::vector<TensorEntry> groups;  // fp32 flat groups (stage 3: sub-groups) of this rank
  };

  Status Open(const std::string& name, std::unique_ptr<TorchArchive>* out);
  Status ReadMpRank(uint64_t mp, const MpRankFiles& files, const std::string& prefix);
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
  if (AsUint(v, &n) || (v->kind == Kind::kObject && AsUint(Arg(v, 0), &n))) {
    *stage = static_cast<int>(n);
  } else if (IsCall(v, "__builtin__.getattr") || IsCall(v, "builtins.getattr")) {
    const PyValue* member = Arg(v, 1);
    static const std::map<std::string_view, int> kNames = {
        {"disabled", 0}, {"optimizer_states", 1}, {"gradients", 2}, {"weights", 3}, {"max_stage", 3}};
    auto it = member ? kNames.find(member->s) : kNames.end();
    if (it != kNames.end()) *stage = it->second;
  }
  if (*stage < 1 || *stage > 3) return Status::NotSupported(where, "unsupported ZeRO stage");
  return Status::OK();
}

Status ZeroReader::FlatGroups(const TorchArchive& a, const PyValue* list, const std::string& what,
                              std::vector<TensorEntry>* out) {
  if (!list || (list->kind != Kind::kList && list->kind != Kind::kTuple)) return a.Bad("no " + what + " list");
  for (size_t g = 0; g < list->items.size(); ++g) {
    TensorEntry t;
    CKPTFS_RETURN_IF_ERROR(Tensor(a, list->items[g], what + "[" + std::to_string(g) + "]", &t));
    if (t.shape.size() != 1 || !StoredAsExtents(t)) return a.Bad(what + "[" + std::to_string(g) + "] is not a flat 1-D tensor");
    out->push_back(std::move(t));
  }
  return Status::OK();
}

// One (name -> shape) mapping per group, in flat-buffer order (section 2.1, param_shapes).
Status ParamShapes(const TorchArchive& a, const PyValue* v,
                   std::vector<std::vector<std::pair<std::string, std::vector<uint64_t>>>>* out) {
  std::vector<const PyValue*> groups;
  if (AsMapping(v)) groups.push_back(v);  // before DeepSpeed 0.5.4: a single mapping
  else if (v && v->kind == Kind::kList) groups = {v->items.begin(), v->items.end()};
  else return a.Bad("model states have no param_shapes (not a ZeRO checkpoint?)");
  for (const PyValue* g : groups) {
    const PyValue* m = AsMapping(g);
    if (!m) return a.Bad("param_shapes entry is not a mapping");
    auto& dst = out->emplace_back();
    for (const auto& [k, s] : m->entries) {
      std::vector<uint64_t> shape;
      if (k->kind != Kind::kStr || !AsUintTuple(s, &shape)) return a.Bad("malformed param_shapes entry");
      if (!ShapeFits(shape)) return a.Bad("param_shapes entry '" + std::string(k->s) + "' has a shape whose size overflows");
      dst.emplace_back(std::string(k->s), std::move(shape));
    }
  }
  return Status::OK();
}

std::vector<std::string> StringList(const PyValue* v) {
  std::vector<std::string> out;
  if (v && (v->kind == Kind::kList || v->kind == Kind::kTuple || v->kind == Kind::kSet))
    for (const PyValue* s : v->items)
      if (s->kind == Kind::kStr) out.emplace_back(s->s);
  return out;
}

Status ZeroReader::ReadMpRank(uint64_t mp, const MpRankFiles& files, const std::string& prefix) {
  char mp_text[16];
  std::snprintf(mp_text, sizeof mp_text, "%02llu", static_cast<unsigned long long>(mp));
  if (files.optim.empty()) return Status::Corruption(tag_dir_, std::string("no optimizer files for mp_rank_") + mp_text);
  // Rank 0's optimizer file says the stage and the data-parallel world size.
  std::vector<Partition> ranks(1);
  const std::string& first = files.optim.begin()->second;
  if (files.optim.begin()->first != 0) return Status::Corruption(Path(first), "rank 0's optimizer file is missing");
  CKPTFS_RETURN_IF_ERROR(Open(first, &ranks[0].archive));
  const PyValue* osd = Find(AsMapping(ranks[0].archive->root()), "optimizer_state_dict");
  osd = AsMapping(osd);
  if (!osd) return ranks[0].archive->Bad("no optimizer_state_dict: not a DeepSpeed ZeRO optimizer file");
  int stage;
  CKPTFS_RETURN_IF_ERROR(ZeroStage(osd, Path(first), &stage));
  const bool bf16_optimizer = stage < 0;
  if (bf16_optimizer && !Find(osd, "single_partition_of_fp32_groups"))
    return ranks[0].archive->Bad("not a ZeRO checkpoint (no zero_stage)");
  uint64_t world = PartitionCount(osd);
  if (world == 0) return ranks[0].archive->Bad("no valid partition_count");

  // Exactly ranks 0..W-1, named by parsed rank numbers.
  const std::string prefix16 = first.rfind("bf16_", 0) == 0 ? "bf16_" : "";
  for (uint64_t r = 0; r < world; ++r)
    if (!files.optim.count(r))
      return Status::Corruption(Path(prefix16 + "zero_pp_rank_" + std::to_string(r) + "_mp_rank_" + mp_text + "_optim_states.pt"),
                                "missing: the checkpoint was saved by " + std::to_string(world) + " data-parallel ranks");
  if (files.optim.size() != world)
    return Status::Corruption(Path(files.optim.rbegin()->second),
                              "unexpected: rank 0 says the world size is " + std::to_string(world));
  ranks.resize(world);
  for (uint64_t r = 1; r < world; ++r) CKPTFS_RETURN_IF_ERROR(Open(files.optim.at(r), &ranks[r].archive));

  // Flat fp32 partitions of every rank.
  const char* flat_key = stage == 3 ? "fp32_flat_groups" : "single_partition_of_fp32_groups";
  for (uint64_t r = 0; r < world; ++r) {
    const PyValue* rosd = AsMapping(Find(AsMapping(ranks[r].archive->root()), "optimizer_state_dict"));
    if (!rosd) return ranks[r].archive->Bad("no optimizer_state_dict");
    if (const uint64_t w = PartitionCount(rosd); w != world)
      return ranks[r].archive->Bad("was saved by " + std::to_string(w) + " data-parallel ranks, rank 0 by " +
                                   std::to_string(world) + " (files of different checkpoints mixed?)");
    CKPTFS_RETURN_IF_ERROR(FlatGroups(*ranks[r].archive, Find(rosd, flat_key), flat_key, &ranks[r].groups));
    if (ranks[r].groups.size() != ranks[0].groups.size())
      return ranks[r].archive->Bad("has " + std::to_string(ranks[r].groups.size()) + " parameter groups, rank 0 has " +
                                   std::to_string(ranks[0].groups.size()));
  }

  // Model states: rank 0's carries the shapes and names (section 2).
  std::vector<std::unique_ptr<TorchArchive>> models(stage == 3 ? world : 1);
  if (stage == 3) {
    for (uint64_t r = 0; r < world; ++r) {
      auto it = files.zero3_model.find(r);
      if (it == files.zero3_model.end())
        return Status::Corruption(Path("zero_pp_rank_" + std::to_string(r) + "_mp_rank_" + mp_text + "_model_states.pt"),
                                  "missing: stage-3 checkpoints have one model-states file per rank");
      CKPTFS_RETURN_IF_ERROR(Open(it->second, &models[r]));
    }
  } else {
    if (files.model.empty())
      return Status::Corruption(Path(std::string("mp_rank_") + mp_text + "_model_states.pt"), "missing model-states file");
    CKPTFS_RETURN_IF_ERROR(Open(files.model, &models[0]));
  }
  const TorchArchive& model = *models[0];
  const PyValue* mroot = AsMapping(model.root());
  if (!mroot || !Find(mroot, "buffer_names")) return model.Bad("not a DeepSpeed model-states file (no buffer_names)");
  const PyValue* module = AsMapping(Find(mroot, "module"));
  std::vector<std::vector<std::pair<std::string, std::vector<uint64_t>>>> shapes;
  CKPTFS_RETURN_IF_ERROR(ParamShapes(model, Find(mroot, "param_shapes"), &shapes));
  const std::vector<std::string> buffers = StringList(Find(mroot, "buffer_names"));
  const PyValue* shared = AsMapping(Find(mroot, "shared_params"));
  const PyValue* frozen_shapes = AsMapping(Find(mroot, "frozen_param_shapes"));

  // 1. Buffers, in their stored dtype (zero_to_fp32 casts float buffers to fp32).
  for (const std::string& name : buffers) {
    TensorEntry t;
    CKPTFS_RETURN_IF_ERROR(Tensor(model, Find(module, name), "buffer '" + name + "' in module", &t));
    CKPTFS_RETURN_IF_ERROR(Add(prefix, name, std::move(t)));
  }

  // 2. Frozen parameters, 16-bit as stored (section 4.4).
  std::set<std::string> trainable;
  for (const auto& g : shapes)
    for (const auto& [name, shape] : g) trainable.insert(name);
  std::set<std::string> aliases;
  if (shared)
    for (const auto& [k, v] : shared->entries)
      if (k->kind == Kind::kStr) aliases.emplace(k->s);
  if (frozen_shapes) {
    for (const auto& [k, s] : frozen_shapes->entries) {
      const std::string name(k->s);
      std::vector<uint64_t> shape;
      if (k->kind != Kind::kStr || !AsUintTuple(s, &shape)) return model.Bad("malformed frozen_param_shapes");
      if (!ShapeFits(shape)) return model.Bad("frozen_param_shapes entry '" + name + "' has a shape whose size overflows");
      TensorEntry t;
      t.shape = shape;
      const uint64_t n = Numel(shape);
      const uint64_t per_rank = (n + world - 1) / world;
      for (size_t r = 0; r < models.size(); ++r) {
        TensorEntry frag;
        CKPTFS_RETURN_IF_ERROR(Tensor(*models[r], Find(AsMapping(Find(AsMapping(models[r]->root()), "frozen_param_fragments")), name),
                                      "frozen_param_fragments['" + name + "']", &frag));
        t.dtype = frag.dtype;
        if (stage == 3) {  // rank r holds elements [r*P, r*P+P) of the padded parameter
          const uint64_t len = std::min(per_rank, n > r * per_rank ? n - r * per_rank : 0);
          if (!StoredAsExtents(frag)) return models[r]->Bad("frozen fragment of '" + name + "' is not contiguous");
          CKPTFS_RETURN_IF_ERROR(SliceBoxes(frag, models[r]->path(), 0, len, &t));
        } else {
          if (frag.numel() != n) return model.Bad("frozen parameter '" + name + "' does not match its shape");
          t.boxes = frag.boxes;
        }
      }
      CKPTFS_RETURN_IF_ERROR(Add(prefix, name, std::move(t)));
    }
  } else if (stage == 1 || bf16_optimizer) {
    // Stage 1 records no frozen parameters; the 16-bit copies in `module` are all there is.
    std::set<std::string> buffer_set(buffers.begin(), buffers.end());
    for (const auto& [k, v] : module ? module->entries : decltype(module->entries){}) {
      if (k->kind != Kind::kStr) continue;
      const std::string name(k->s);
      if (trainable.count(name) || buffer_set.count(name) || aliases.count(name)) continue;
      TensorEntry t;
      CKPTFS_RETURN_IF_ERROR(Tensor(model, v, "module['" + name + "']", &t));
      CKPTFS_RETURN_IF_ERROR(Add(prefix, name, std::move(t)));
    }
  }

  // 3. Trainable parameters from the fp32 partitions.
  const size_t first_trainable = catalog_->tensors.size();
  Layout layout{stage, world, &shapes, {}, {}};
  if (const PyValue* pads = Find(osd, "param_alignment_paddings"); pads && pads->kind == Kind::kList)
    for (const PyValue* g : pads->items) AsUintTuple(g, &layout.align_pads.emplace_back());
  std::vector<std::vector<const TensorEntry*>> fp32(world);
  std::vector<const TorchArchive*> archives(world);
  for (uint64_t r = 0; r < world; ++r) {
    archives[r] = ranks[r].archive.get();
    for (const TensorEntry& g : ranks[r].groups) fp32[r].push_back(&g);
  }
  CKPTFS_RETURN_IF_ERROR(CheckPartitions(layout, archives, fp32, &layout.lengths));
  std::vector<TensorEntry> params;
  CKPTFS_RETURN_IF_ERROR(WalkTrainable(layout, archives, fp32, &params));
  for (TensorEntry& t : params) {
    std::string name = t.key;
    CKPTFS_RETURN_IF_ERROR(Add(prefix, name, std::move(t)));
  }

  // 4. Tied aliases read the owner's bytes (section 4.5).
  if (shared) {
    for (const auto& [k, v] : shared->entries) {
      if (k->kind != Kind::kStr || v->kind != Kind::kStr) continue;
      // The owner's key is built outside the lambda: clang before 16 cannot capture a
      // structured binding (the fuzz build uses Debian's clang 14).
      const std::string owner_key = prefix + std::string(v->s);
      auto owner = std::find_if(catalog_->tensors.begin() + first_trainable, catalog_->tensors.end(),
                                [&](const TensorEntry& t) { return t.key == owner_key; });
      if (owner == catalog_->tensors.end()) continue;
      owner->storage_id = "zero:" + owner->key;
      TensorEntry alias = *owner;
      CKPTFS_RETURN_IF_ERROR(Add(prefix, std::string(k->s), std::move(alias)));
    }
  }

  // 5. On request, the Adam moments of every trainable parameter, laid out exactly like the
  // fp32 partitions (section 4.7), under "exp_avg." and "exp_avg_sq.".
  if (options_.zero_moments) {
    for (const char* moment : {"exp_avg", "exp_avg_sq"}) {
      std::vector<std::vector<TensorEntry>> owned(world);
      std::vector<std::vector<const TensorEntry*>> flats(world);
      for (uint64_t r = 0; r < world; ++r) {
        CKPTFS_RETURN_IF_ERROR(MomentTensors(*archives[r], stage, ranks[r].groups.size(), moment, &owned[r]));
        for (const TensorEntry& t : owned[r]) flats[r].push_back(&t);
      }
      std::vector<TensorEntry> moments;
      CKPTFS_RETURN_IF_ERROR(WalkTrainable(layout, archives, flats, &moments));
      for (TensorEntry& t : moments) {
        std::string name = std::string(moment) + "." + t.key;
        CKPTFS_RETURN_IF_ERROR(Add(prefix, name, std::move(t)));
      }
    }
  }

  json& info = catalog_->metadata["deepspeed"];
  info["tag"] = tag_;
  info["stage"] = bf16_optimizer ? 1 : stage;
  info["optimizer"] = bf16_optimizer ? "BF16_Optimizer" : (stage == 3 ? "DeepSpeedZeroOptimizer_Stage3" : "DeepSpeedZeroOptimizer");
  info["world_size"] = world;
  if (const PyValue* v = Find(mroot, "ds_version"); v && v->kind == Kind::kStr) info["ds_version"] = std::string(v->s);
  if (uint64_t steps; AsUint(Find(mroot, "global_steps"), &steps)) info["global_steps"] = steps;
  json dtypes = json::object();
  for (const TensorEntry& t : catalog_->tensors) dtypes[std::string(Info(t.dtype).torch_name)] = true;
  info["dtypes"] = json::array();
  for (auto& [name, _] : dtypes.items()) info["dtypes"].push_back(name);
  return Status::OK();
}

// Pipeline per-layer files (section 1.3): each holds one layer's 16-bit state_dict; keys
// get the global layer index in front, as DeepSpeed names them in param_shapes.
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
    for (const auto& [k, v] : sd->entries) {
      if (k->kind != Kind::kStr) continue;
      TensorEntry t;
      bool is_tensor = false;
      CKPTFS_RETURN_IF_ERROR(a->AsTensor(v, &t, &is_tensor));
      if (is_tensor) CKPTFS_RETURN_IF_ERROR(Add(prefix, std::string(k->s), std::move(t)));
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
        env.ReadSmallFile(latest_path, options.limits.header_bytes, &text, "'latest'", LimitHint("max_header")));
    tag = Trim(text);
    if (tag.empty() || tag.find('/') != std::string::npos || tag == "." || tag == "..")
      return Status::Corruption(latest_path, "does not name a checkpoint tag");
    tag_dir = JoinPath(dir, tag);
    if (!env.Stat(tag_dir, &type).ok() || type != PathType::kFolder)
      return Status::NotFound(tag_dir, "the tag named by 'latest' does not exist");
  }
  ZeroReader reader(tag_dir, tag, options, catalog);
  return reader.Read();
}

}  // namespace ckptfs
