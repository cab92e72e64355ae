// Reader for DeepSpeed universal checkpoints, the folders ds_to_universal writes: one
// zero/<parameter>/ folder per trainable parameter holding its full fp32 weight (fp32.pt) and
// Adam moments (exp_avg.pt, exp_avg_sq.pt) as separate torch.save files, beside copies of the
// ZeRO save's model-states files. Each parameter is the byte range of its own file; the
// buffers, frozen parameters and tied aliases come from the model-states files exactly as the
// ZeRO reader takes them (format/deepspeed/zero_files.hpp). Layout: doc/FORMATS.md, "DeepSpeed universal
// checkpoints".
#include <algorithm>
#include <set>
#include <string_view>

#include "format/deepspeed/zero_files.hpp"
#include "format/deepspeed/zero_layout.hpp"
#include "format/readers.hpp"
#include "format/torch/torch_archive.hpp"

namespace ckptfs {
namespace {

using json = nlohmann::json;
using Kind = PyValue::Kind;

constexpr const char* kMarker = "latest_universal";

bool IsA(Env& env, const std::string& path, PathType want) {
  PathType type;
  return env.Stat(path, &type).ok() && type == want;
}

// A step folder of ds_to_universal: model-states files, a zero/ folder, and no optimizer rank
// files (a ZeRO tag folder with a stray zero/ folder stays the ZeRO reader's).
bool IsUniversalStep(Env& env, const std::string& dir) {
  if (!IsA(env, JoinPath(dir, "zero"), PathType::kFolder)) return false;
  ZeroTagListing listing;
  if (!ListZeroTag(env, dir, &listing).ok() || listing.mp.empty() || !listing.layers.empty()) return false;
  for (const auto& [mp, files] : listing.mp)
    if (!files.optim.empty()) return false;
  return true;
}

// The keys a parameter file's dict may hold besides `param`: how ds_to_universal merged
// tensor-parallel slices (cat_dim, param_n_sub_params, sub_param_shape) and whether vocabulary
// padding was cut off (vocab_tensor). None of them changes what the tensor holds.
constexpr std::string_view kLayoutKeys[] = {"cat_dim", "param_n_sub_params", "sub_param_shape", "vocab_tensor"};

class UniversalReader {
 public:
  UniversalReader(std::string step_dir, std::string tag, const SourceOptions& options, Catalog* catalog)
      : step_dir_(std::move(step_dir)), tag_(std::move(tag)), options_(options), catalog_(catalog) {}

  Status Read();

 private:
  Status ReadOptimizerState(const ZeroMpRankFiles& files);
  Status CheckParameterFolders(const ZeroModelStates& model);
  Status ParameterFile(const std::string& name, const char* state, const std::vector<uint64_t>& shape,
                       const std::string& shapes_file, TensorEntry* out);
  Status AddState(const std::string& key_prefix, const char* state, const ZeroModelStates& model);

  std::string ZeroDir() const { return JoinPath(step_dir_, "zero"); }

  std::string step_dir_, tag_;
  SourceOptions options_;
  Catalog* catalog_;
  ZeroTensors out_{step_dir_, catalog_};
  uint64_t vocab_rows_ = 0;  // rows the last ParameterFile kept of a vocabulary (0: none cut)
  json vocab_cut_ = json::object();  // name -> [rows served, rows in param_shapes]
  int stage_ = 0;       // -1: the BF16_Optimizer
  uint64_t world_ = 0;  // data-parallel ranks of the save (stage 3: its model-states files)
};

// zero/optimizer_state.pt holds what the optimizer files had besides their partitions: the
// stage and the data-parallel world size. The stage must agree with the model-states files
// (stage 3 has one per rank, named zero_pp_rank_R_mp_rank_XX).
Status UniversalReader::ReadOptimizerState(const ZeroMpRankFiles& files) {
  const std::string path = JoinPath(ZeroDir(), "optimizer_state.pt");
  if (!IsA(catalog_->files->env(), path, PathType::kFile))
    return Status::NotFound(path, "missing: ds_to_universal writes the optimizer's common state there");
  TorchArchive archive;
  CKPTFS_RETURN_IF_ERROR(archive.Open(path, catalog_->files.get(), options_.limits));
  const PyValue* osd = AsMapping(archive.root());
  if (!osd) return archive.Bad("not a dict: not what ds_to_universal writes");
  CKPTFS_RETURN_IF_ERROR(ZeroStageOf(osd, path, &stage_));
  // No zero_stage: the BF16_Optimizer's state, which has group_paddings as stage 1/2's has.
  if (stage_ < 0 && !Find(osd, "group_paddings"))
    return archive.Bad("key 'zero_stage' is missing (and no group_paddings: not the state of a ZeRO optimizer)");
  const bool stage3_files = !files.zero3_model.empty();
  if ((stage_ == 3) != stage3_files || (stage3_files && !files.model.empty()))
    return archive.Bad("key 'zero_stage': stage " + std::to_string(stage_ < 0 ? 1 : stage_) +
                       " disagrees with the model-states files beside zero/ (" +
                       (stage3_files ? "one per rank, as stage 3 writes them" : "one, as stage 1 and 2 write it") + ")");
  world_ = ZeroPartitionCount(osd);
  if (stage_ == 3 && world_ == 0) world_ = files.zero3_model.size();
  return Status::OK();
}

// Every folder in zero/ names a tensor of the model states: a folder of another checkpoint
// mixed in would otherwise go unnoticed. (ds_to_universal also writes one for each buffer,
// frozen parameter and alias of `module`, holding its 16-bit value cast to fp32; those are
// served from the model states instead, in their stored dtype.)
Status UniversalReader::CheckParameterFolders(const ZeroModelStates& model) {
  std::set<std::string, std::less<>> known(model.buffers.begin(), model.buffers.end());
  for (const auto& group : model.param_shapes)
    for (const auto& [name, shape] : group) known.insert(name);
  for (const PyValue* mapping : {model.module, model.shared, model.frozen_shapes})
    if (mapping)
      for (const auto& [k, v] : mapping->entries())
        if (k->kind() == Kind::kStr) known.emplace(k->s());
  std::vector<FolderEntry> entries;
  CKPTFS_RETURN_IF_ERROR(catalog_->files->env().ListFolder(ZeroDir(), &entries));
  for (const FolderEntry& entry : entries)
    if (entry.type == PathType::kFolder && !known.count(entry.name))
      return Status::Corruption(JoinPath(ZeroDir(), entry.name),
                                "names no parameter of " + model.rank0().path() + " (a folder of another checkpoint?)");
  return Status::OK();
}

// zero/<name>/<state>.pt: a dict whose `param` is the full tensor (stage 1 and 2), or the bare
// tensor flattened to 1-D (stage 3). Served as the file's bytes, with the shape param_shapes
// gives it; vocabulary tensors keep the rows ds_to_universal left after cutting the padding.
Status UniversalReader::ParameterFile(const std::string& name, const char* state, const std::vector<uint64_t>& shape,
                                      const std::string& shapes_file, TensorEntry* out) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos || name.find('\0') != std::string::npos)
    return Status::NotSupported(shapes_file, "parameter '" + name + "' cannot name a folder of zero/");
  const std::string path = JoinPath(JoinPath(ZeroDir(), name), std::string(state) + ".pt");
  if (!IsA(catalog_->files->env(), path, PathType::kFile))
    return Status::NotFound(path, std::string("missing: ds_to_universal writes ") + state +
                                      ".pt for every trainable parameter of " + shapes_file);
  TorchArchive archive;
  CKPTFS_RETURN_IF_ERROR(archive.Open(path, catalog_->files.get(), options_.limits));
  const PyValue* value = archive.root();
  bool in_dict = false;
  vocab_rows_ = 0;
  bool vocab = false;
  if (const PyValue* dict = AsMapping(value)) {
    in_dict = true;
    value = nullptr;
    for (const auto& [k, v] : dict->entries()) {
      const std::string_view key = k->kind() == Kind::kStr ? k->s() : std::string_view("(not a string)");
      if (key == "param") {
        value = v;
      } else if (key == "vocab_tensor") {
        vocab = v->b();
      } else if (key == "is_expert_param" || key.rfind("ep_", 0) == 0) {
        return Status::NotSupported(path, "key '" + std::string(key) + "': expert-parallel (AutoEP) parameters are not supported");
      } else if (std::find(std::begin(kLayoutKeys), std::end(kLayoutKeys), key) == std::end(kLayoutKeys)) {
        return archive.Bad("key '" + std::string(key) + "' is not understood");
      }
    }
    if (!value) return archive.Bad("key 'param' is missing");
  }
  const std::string what = in_dict ? "key 'param'" : "the saved object";
  TensorEntry t;
  bool is_tensor = false;
  CKPTFS_RETURN_IF_ERROR(archive.AsTensor(value, &t, &is_tensor));
  if (!is_tensor) return archive.Bad(what + " is not a tensor");
  if (!Info(t.dtype).is_float) return archive.Bad(what + " is not a floating-point tensor");
  if (!StoredAsExtents(t)) return archive.Bad(what + " is not a contiguous tensor");
  const std::vector<uint64_t> stored = t.shape.to_vector();
  const bool same_rest = stored.size() == shape.size() && !shape.empty() &&
                         std::equal(stored.begin() + 1, stored.end(), shape.begin() + 1);
  if (stored == shape) {
    *out = std::move(t);
  } else if (vocab && same_rest && stored[0] <= shape[0]) {
    vocab_rows_ = stored[0];
    *out = std::move(t);  // the vocabulary without its padding rows, as the file holds it
  } else if (!in_dict && stored.size() == 1 && stored[0] == ZeroNumel(shape)) {
    out->dtype = t.dtype;
    out->shape = shape;
    CKPTFS_RETURN_IF_ERROR(SliceBoxes(t, path, 0, stored[0], out));
  } else {
    return archive.Bad(what + ": shape " + ShapeText(stored) + " disagrees with " + ShapeText(shape) +
                       ", the shape of '" + name + "' in " + shapes_file);
  }
  return Status::OK();
}

// One state (fp32, exp_avg, exp_avg_sq) of every trainable parameter, in param_shapes order.
Status UniversalReader::AddState(const std::string& key_prefix, const char* state, const ZeroModelStates& model) {
  for (const auto& group : model.param_shapes)
    for (const auto& [name, shape] : group) {
      TensorEntry t;
      CKPTFS_RETURN_IF_ERROR(ParameterFile(name, state, shape, model.rank0().path(), &t));
      if (vocab_rows_ && std::string_view(state) == "fp32") vocab_cut_[name] = {vocab_rows_, shape[0]};
      CKPTFS_RETURN_IF_ERROR(out_.Add(key_prefix, name, std::move(t)));
    }
  return Status::OK();
}

// The tensors in the ZeRO reader's order: buffers, frozen parameters, trainable parameters,
// tied aliases, then on request the Adam moments.
Status UniversalReader::Read() {
  if (!IsUniversalStep(catalog_->files->env(), step_dir_))
    return Status::InvalidArgument(step_dir_, "not a DeepSpeed universal checkpoint (no zero/ folder beside model-states files)");
  ZeroTagListing listing;
  CKPTFS_RETURN_IF_ERROR(ListZeroTag(catalog_->files->env(), step_dir_, &listing));
  if (listing.mp.size() != 1 || listing.mp.begin()->first != 0)
    return Status::NotSupported(step_dir_, "universal checkpoints of " + std::to_string(listing.mp.size()) +
                                               " model-parallel ranks are not supported (each rank's model states "
                                               "describe its own slices, not the merged parameters)");
  const ZeroMpRankFiles& files = listing.mp.begin()->second;
  CKPTFS_RETURN_IF_ERROR(ReadOptimizerState(files));
  ZeroModelStates model;
  CKPTFS_RETURN_IF_ERROR(
      OpenZeroModelStates(step_dir_, files, "00", stage_, world_, catalog_->files.get(), options_.limits, &model));
  // OpenZeroModelStates found ranks 0..world-1; any other is of another save.
  if (stage_ == 3 && files.zero3_model.size() != world_)
    return Status::Corruption(JoinPath(step_dir_, files.zero3_model.rbegin()->second),
                              "unexpected: zero/optimizer_state.pt says the world size is " + std::to_string(world_));
  CKPTFS_RETURN_IF_ERROR(CheckParameterFolders(model));
  CKPTFS_RETURN_IF_ERROR(AddZeroBuffers("", model, &out_));
  CKPTFS_RETURN_IF_ERROR(AddZeroFrozen("", stage_, world_, model, &out_));
  const size_t first_trainable = catalog_->tensors.size();
  CKPTFS_RETURN_IF_ERROR(AddState("", "fp32", model));
  CKPTFS_RETURN_IF_ERROR(AddZeroTiedAliases("", model, first_trainable, &out_));
  if (options_.zero_moments) {
    CKPTFS_RETURN_IF_ERROR(AddState("exp_avg.", "exp_avg", model));
    CKPTFS_RETURN_IF_ERROR(AddState("exp_avg_sq.", "exp_avg_sq", model));
  }
  json& info = DescribeZeroRun(tag_, stage_, world_, model, catalog_);
  info["universal"] = true;
  if (!vocab_cut_.empty()) info["vocab_padding_cut"] = vocab_cut_;
  info["mp_world_size"] = 1;
  return Status::OK();
}

}  // namespace

bool IsDeepSpeedUniversalFolder(Env& env, const std::string& dir) {
  // A save folder with both markers is the ZeRO save `latest` names (the ZeRO reader's).
  if (IsA(env, JoinPath(dir, "latest"), PathType::kFile)) return false;
  return IsA(env, JoinPath(dir, kMarker), PathType::kFile) || IsUniversalStep(env, dir);
}

Status ReadDeepSpeedUniversal(const std::string& dir, const SourceOptions& options, Catalog* catalog) {
  Env& env = catalog->files->env();
  catalog->format = "deepspeed-universal";
  if (!IsA(env, JoinPath(dir, kMarker), PathType::kFile)) {
    UniversalReader reader(dir, dir.substr(dir.rfind('/') + 1), options, catalog);
    return reader.Read();
  }
  std::string tag;
  CKPTFS_RETURN_IF_ERROR(ReadZeroTagFile(env, dir, kMarker, options.limits, &tag));
  UniversalReader reader(JoinPath(dir, tag), tag, options, catalog);
  CKPTFS_RETURN_IF_ERROR(reader.Read());
  return AddZeroSaveFolderFiles(env, dir, kMarker, catalog);
}

extern const ReaderEntry kDeepSpeedUniversalReader = {
    "deepspeed-universal", "DeepSpeed universal checkpoint folder (ds_to_universal)", {"deepspeed-universal"},
    DetectFolderOf<IsDeepSpeedUniversalFolder>, ReadFolderOf<ReadDeepSpeedUniversal>};

}  // namespace ckptfs
