// What the DeepSpeed readers share: the rank files of a tag folder, the fields of the
// optimizer and model-states pickles both read, and the tensors the model-states files give
// (buffers, frozen parameters, tied aliases) in zero_to_fp32's order. The ZeRO reader
// (zero.cpp) adds the trainable parameters from the optimizer partitions, the universal reader
// (zero_universal.cpp) from the per-parameter files of ds_to_universal.
// Keys and layouts: doc/FORMATS.md, "DeepSpeed files" to "DeepSpeed universal checkpoints".
#ifndef CKPTFS_FORMAT_DEEPSPEED_ZERO_FILES_HPP_
#define CKPTFS_FORMAT_DEEPSPEED_ZERO_FILES_HPP_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/env.hpp"
#include "ckptfs/limits.hpp"
#include "ckptfs/status.hpp"
#include "format/deepspeed/zero_layout.hpp"
#include "format/torch/torch_archive.hpp"

namespace ckptfs {

// One model-parallel rank's files.
struct ZeroMpRankFiles {
  std::map<uint64_t, std::string> optim;        // dp rank -> optimizer file name
  std::map<uint64_t, std::string> zero3_model;  // dp rank -> stage-3 model-states file
  std::string model;                            // mp_rank_XX_model_states.pt (stage <= 2)
};

struct ZeroLayerFile {
  uint64_t layer = 0;
  int64_t model_rank = -1;  // -1: no "-model_YY" part
  std::string name;
};

struct ZeroTagListing {
  std::map<uint64_t, ZeroMpRankFiles> mp;  // by parsed mp rank
  std::vector<ZeroLayerFile> layers;       // by (model rank, layer)
};

// Sorts the files of a tag folder by role, with ranks parsed from the names (never
// lexicographic order: rank_10 comes after rank_9). Mixture-of-experts files and an NVMe
// swap folder are refused (NotSupported) by name.
Status ListZeroTag(Env& env, const std::string& tag_dir, ZeroTagListing* out);

// The tag a `latest` or `latest_universal` file names: its text without surrounding
// whitespace, a single path component. `dir` holds the file; the tag must be a folder of it.
Status ReadZeroTagFile(Env& env, const std::string& dir, const std::string& file_name, const ReadLimits& limits,
                       std::string* tag);

// An optimizer state dict's zero_stage: 1, 2, 3, or -1 when absent (the BF16_Optimizer).
// ZeroStageEnum pickles as EnumClass(n), as getattr(EnumClass, "name") (Python 3.11.2), or as a
// plain int (DeepSpeed < 0.7); any other value is refused, naming `where`.
Status ZeroStageOf(const PyValue* osd, const std::string& where, int* stage);

// The data-parallel world size an optimizer state dict was saved with: partition_count, an
// int (stage 3) or one per param group (stage 1/2); 0 when absent.
uint64_t ZeroPartitionCount(const PyValue* osd);

// One model-parallel rank's model-states files and what rank 0's says about the parameters.
struct ZeroModelStates {
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

// Opens the model-states files of one mp rank (`mp_text`: "00") of tag folder `tag_dir`:
// stage 3 (`stage` 3) one per data-parallel rank 0..world-1, else mp_rank_XX_model_states.pt.
Status OpenZeroModelStates(const std::string& tag_dir, const ZeroMpRankFiles& files, const std::string& mp_text,
                           int stage, uint64_t world, SourceFiles* source_files, const ReadLimits& limits,
                           ZeroModelStates* model);

// The catalog a DeepSpeed reader fills, with every key added once.
class ZeroTensors {
 public:
  ZeroTensors(std::string where, Catalog* catalog) : where_(std::move(where)), catalog_(catalog) {}
  // Adds `t` as `prefix + name`; a key added before is refused, naming `where`.
  Status Add(const std::string& prefix, const std::string& name, TensorEntry t);
  Catalog* catalog() const { return catalog_; }

 private:
  std::string where_;
  Catalog* catalog_;
  std::unordered_set<std::string> keys_;
};

// Buffers, in their stored dtype (zero_to_fp32 casts float buffers to fp32; serving the
// stored bytes keeps them byte ranges of the files).
Status AddZeroBuffers(const std::string& prefix, const ZeroModelStates& model, ZeroTensors* out);

// Frozen parameters, 16-bit as stored: frozen_param_fragments where frozen_param_shapes lists
// them (stage 3: each of `world` ranks holds a chunk), else (stage 1 and the BF16_Optimizer,
// `stage` 1 or -1) the `module` entries that are neither trainable, nor buffers, nor aliases.
Status AddZeroFrozen(const std::string& prefix, int stage, uint64_t world, const ZeroModelStates& model,
                     ZeroTensors* out);

// Tied aliases (shared_params) read their owner's bytes; both get one storage id so consumers
// see them tied. Owners are trainable parameters: catalog entries from `first_trainable` on.
Status AddZeroTiedAliases(const std::string& prefix, const ZeroModelStates& model, size_t first_trainable,
                          ZeroTensors* out);

// metadata["deepspeed"]: the tag, stage (`stage` -1: the BF16_Optimizer), optimizer, world
// size, DeepSpeed version, global steps and the dtypes served. Returns it for more fields.
nlohmann::json& DescribeZeroRun(const std::string& tag, int stage, uint64_t world, const ZeroModelStates& model,
                                Catalog* catalog);

// A save folder's own files (a Hugging Face Trainer's config.json, tokenizer, generation
// config) served beside model.safetensors; `marker` (the file naming the tag) is not served,
// and sub-folders (the tag folders) are not either.
Status AddZeroSaveFolderFiles(Env& env, const std::string& dir, const std::string& marker, Catalog* catalog);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_DEEPSPEED_ZERO_FILES_HPP_
