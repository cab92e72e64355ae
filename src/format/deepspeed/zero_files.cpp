// What the DeepSpeed readers share (format/deepspeed/zero_files.hpp): rank files, optimizer and
// model-states fields, and the tensors of the model-states files.
#include "format/deepspeed/zero_files.hpp"

#include <algorithm>
#include <regex>
#include <set>

#include "format/sibling_files.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;
using Kind = PyValue::Kind;

bool ParseUint(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 18) return false;
  *out = std::stoull(s);
  return true;
}

std::string Trim(std::string s) {
  const char* ws = " \t\r\n";
  s.erase(s.find_last_not_of(ws) + 1);
  s.erase(0, s.find_first_not_of(ws));
  return s;
}

// One (name -> shape) mapping per group, in flat-buffer order (doc/FORMATS.md, "DeepSpeed keys").
Status ParamShapes(const TorchArchive& a, const PyValue* v, ZeroParamShapes* out) {
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

Status Tensor(const TorchArchive& a, const PyValue* v, const std::string& what, TensorEntry* t) {
  bool is_tensor = false;
  if (v) CKPTFS_RETURN_IF_ERROR(a.AsTensor(v, t, &is_tensor));
  if (!is_tensor) return a.Bad(what + " is not a tensor");
  return Status::OK();
}

// Stage 2: each frozen_param_fragments entry is the whole parameter. Stage 3: rank r's
// holds elements [r·P, r·P + P) of the padded parameter, the first len_r of them real.
Status AddFrozenFragments(const std::string& prefix, int stage, uint64_t world, const ZeroModelStates& model,
                          ZeroTensors* out) {
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
      if (stage == 3) {
        if (!StoredAsExtents(fragment)) return archive.Bad("frozen fragment of '" + name + "' is not contiguous");
        CKPTFS_RETURN_IF_ERROR(SliceBoxes(fragment, archive.path(), 0, ZeroRealChunkElements(n, world, r), &t));
      } else {
        if (fragment.numel() != n) return model.rank0().Bad("frozen parameter '" + name + "' does not match its shape");
        t.boxes = fragment.boxes;
      }
    }
    CKPTFS_RETURN_IF_ERROR(out->Add(prefix, name, std::move(t)));
  }
  return Status::OK();
}

// The `module` entries that are neither trainable parameters, nor buffers, nor tied
// aliases: the frozen parameters of a run that does not list them.
Status AddUnlistedModuleEntries(const std::string& prefix, const ZeroModelStates& model, ZeroTensors* out) {
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
    CKPTFS_RETURN_IF_ERROR(out->Add(prefix, name, std::move(t)));
  }
  return Status::OK();
}

}  // namespace

Status ListZeroTag(Env& env, const std::string& tag_dir, ZeroTagListing* out) {
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
      ZeroLayerFile lf{a, -1, name};
      if (m[3].matched) lf.model_rank = static_cast<int64_t>(std::stoull(m[3]));
      out->layers.push_back(lf);
    }
  }
  std::sort(out->layers.begin(), out->layers.end(), [](const ZeroLayerFile& x, const ZeroLayerFile& y) {
    return std::tie(x.model_rank, x.layer) < std::tie(y.model_rank, y.layer);
  });
  return Status::OK();
}

Status ReadZeroTagFile(Env& env, const std::string& dir, const std::string& file_name, const ReadLimits& limits,
                       std::string* tag) {
  const std::string path = JoinPath(dir, file_name);
  std::string text;
  CKPTFS_RETURN_IF_ERROR(env.ReadSmallFile(path, limits.header_bytes, &text, "'" + file_name + "'", "max_header"));
  *tag = Trim(text);
  if (tag->empty() || tag->find('/') != std::string::npos || *tag == "." || *tag == "..")
    return Status::Corruption(path, "does not name a checkpoint tag");
  PathType type;
  const std::string tag_dir = JoinPath(dir, *tag);
  if (!env.Stat(tag_dir, &type).ok() || type != PathType::kFolder)
    return Status::NotFound(tag_dir, "the tag named by '" + file_name + "' does not exist");
  return Status::OK();
}

Status ZeroStageOf(const PyValue* osd, const std::string& where, int* stage) {
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

uint64_t ZeroPartitionCount(const PyValue* osd) {
  uint64_t world = 0;
  const PyValue* pc = Find(osd, "partition_count");
  if (!AsUint(pc, &world) && pc && pc->kind() == Kind::kList)
    for (const PyValue* x : pc->items()) {
      uint64_t w;
      if (AsUint(x, &w)) world = std::max(world, w);
    }
  return world;
}

Status OpenZeroModelStates(const std::string& tag_dir, const ZeroMpRankFiles& files, const std::string& mp_text,
                           int stage, uint64_t world, SourceFiles* source_files, const ReadLimits& limits,
                           ZeroModelStates* model) {
  auto open = [&](const std::string& name, std::unique_ptr<TorchArchive>* out) {
    *out = std::make_unique<TorchArchive>();
    return (*out)->Open(JoinPath(tag_dir, name), source_files, limits);
  };
  model->archives.resize(stage == 3 ? world : 1);
  if (stage == 3) {
    for (uint64_t r = 0; r < world; ++r) {
      auto it = files.zero3_model.find(r);
      if (it == files.zero3_model.end())
        return Status::Corruption(JoinPath(tag_dir, "zero_pp_rank_" + std::to_string(r) + "_mp_rank_" + mp_text + "_model_states.pt"),
                                  "missing: stage-3 checkpoints have one model-states file per rank");
      CKPTFS_RETURN_IF_ERROR(open(it->second, &model->archives[r]));
    }
  } else {
    if (files.model.empty())
      return Status::Corruption(JoinPath(tag_dir, "mp_rank_" + mp_text + "_model_states.pt"), "missing model-states file");
    CKPTFS_RETURN_IF_ERROR(open(files.model, &model->archives[0]));
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

Status ZeroTensors::Add(const std::string& prefix, const std::string& name, TensorEntry t) {
  t.key = prefix + name;
  t.path = {t.key};
  if (!keys_.insert(t.key).second) return Status::Corruption(where_, "parameter '" + t.key + "' appears twice");
  catalog_->tensors.push_back(std::move(t));
  return Status::OK();
}

Status AddZeroBuffers(const std::string& prefix, const ZeroModelStates& model, ZeroTensors* out) {
  for (const std::string& name : model.buffers) {
    TensorEntry t;
    CKPTFS_RETURN_IF_ERROR(Tensor(model.rank0(), Find(model.module, name), "buffer '" + name + "' in module", &t));
    CKPTFS_RETURN_IF_ERROR(out->Add(prefix, name, std::move(t)));
  }
  return Status::OK();
}

Status AddZeroFrozen(const std::string& prefix, int stage, uint64_t world, const ZeroModelStates& model,
                     ZeroTensors* out) {
  if (model.frozen_shapes) return AddFrozenFragments(prefix, stage, world, model, out);
  // Stage 1 and the BF16_Optimizer record no frozen parameters; the 16-bit copies in
  // `module` are all there is. Stage 2 and 3 without frozen_param_shapes have none.
  if (stage == 1 || stage < 0) return AddUnlistedModuleEntries(prefix, model, out);
  return Status::OK();
}

Status AddZeroTiedAliases(const std::string& prefix, const ZeroModelStates& model, size_t first_trainable,
                          ZeroTensors* out) {
  if (!model.shared) return Status::OK();
  std::vector<TensorEntry>& tensors = out->catalog()->tensors;
  for (const auto& [k, v] : model.shared->entries()) {
    if (k->kind() != Kind::kStr || v->kind() != Kind::kStr) continue;
    // The owner's key is built outside the lambda: clang before 16 cannot capture a
    // structured binding (the fuzz build uses Debian's clang 14).
    const std::string owner_key = prefix + std::string(v->s());
    auto owner = std::find_if(tensors.begin() + first_trainable, tensors.end(),
                              [&](const TensorEntry& t) { return t.key == owner_key; });
    if (owner == tensors.end()) continue;
    owner->storage_id = "zero:" + owner->key;
    TensorEntry alias = *owner;
    CKPTFS_RETURN_IF_ERROR(out->Add(prefix, std::string(k->s()), std::move(alias)));
  }
  return Status::OK();
}

json& DescribeZeroRun(const std::string& tag, int stage, uint64_t world, const ZeroModelStates& model,
                      Catalog* catalog) {
  json& info = catalog->metadata["deepspeed"];
  info["tag"] = tag;
  info["stage"] = stage < 0 ? 1 : stage;
  info["optimizer"] = stage < 0 ? "BF16_Optimizer" : stage == 3 ? "DeepSpeedZeroOptimizer_Stage3" : "DeepSpeedZeroOptimizer";
  info["world_size"] = world;
  if (const PyValue* v = Find(model.root, "ds_version"); v && v->kind() == Kind::kStr) info["ds_version"] = std::string(v->s());
  if (uint64_t steps; AsUint(Find(model.root, "global_steps"), &steps)) info["global_steps"] = steps;
  json dtypes = json::object();
  for (const TensorEntry& t : catalog->tensors) dtypes[std::string(Info(t.dtype).torch_name)] = true;
  info["dtypes"] = json::array();
  for (auto& [name, _] : dtypes.items()) info["dtypes"].push_back(name);
  return info;
}

Status AddZeroSaveFolderFiles(Env& env, const std::string& dir, const std::string& marker, Catalog* catalog) {
  std::vector<std::string> names;
  CKPTFS_RETURN_IF_ERROR(ListFolderFiles(env, dir, &names));
  return AddSiblingFiles(dir, names, [&marker](const std::string& name) { return name == marker; }, catalog);
}

}  // namespace ckptfs
