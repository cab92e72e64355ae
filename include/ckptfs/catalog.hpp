// Catalog: what a format reader learned about a checkpoint, without its tensor bytes.
//
// A Catalog is an ordered list of tensors, each with its dtype, shape and the byte
// ranges of the source files that hold it, plus a JSON tree of the checkpoint's
// non-tensor values. It is built once by a format reader and never changes.
#ifndef CKPTFS_CATALOG_HPP_
#define CKPTFS_CATALOG_HPP_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/dtype.hpp"
#include "ckptfs/env.hpp"
#include "ckptfs/limits.hpp"
#include "ckptfs/source_files.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// One step of a tensor's original location: a dict key or a list index / int dict key.
using PathElement = std::variant<std::string, int64_t>;

// `length` bytes of source file `file` starting at `offset`.
struct Extent {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// A non-contiguous tensor: element i (multi-index idx) lives at
// base_offset + itemsize * sum(idx[d] * strides[d]) of `file`. Strides are in elements.
struct StridedLayout {
  uint32_t file = 0;
  uint64_t base_offset = 0;
  std::vector<uint64_t> strides;
};

struct TensorEntry {
  std::string key;                // flattened, e.g. "optimizer.state.0.exp_avg"
  std::vector<PathElement> path;  // where it sat in the original object
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  // Contiguous tensors: extents that concatenate to the row-major bytes.
  std::vector<Extent> extents;
  // Non-contiguous tensors: served contiguous by gathering on read.
  std::optional<StridedLayout> strided;
  // Tensors that view the same storage share a non-empty storage id (tied weights).
  std::string storage_id;
  // Set by a view that converts this tensor on read (e.g. -o dtype=bf16).
  std::optional<DType> convert_to;

  uint64_t numel() const;
  // Bytes as stored in the source.
  uint64_t nbytes() const { return numel() * Info(dtype).itemsize; }
  // Element type and bytes as served.
  DType served_dtype() const { return convert_to.value_or(dtype); }
  uint64_t served_nbytes() const { return numel() * Info(served_dtype()).itemsize; }
};

struct Catalog {
  std::string format;  // "torch-zip", "safetensors", ...
  std::string source;  // the path the user gave
  // Every source file the catalog reads, opened through one Env.
  std::shared_ptr<SourceFiles> files = std::make_shared<SourceFiles>();
  std::vector<TensorEntry> tensors;
  nlohmann::json metadata = nlohmann::json::object();  // non-tensor values
  // Files beside a checkpoint in its folder (config.json, tokenizer...), served as is.
  std::vector<uint32_t> sibling_files;
};

// Joins a path into a flattened key: string elements as they are, ints in decimal,
// separated by '.'.
std::string FlattenKey(const std::vector<PathElement>& path);

// What a reader should include beyond the weights, and its limits (the source options of
// include/ckptfs/options.hpp).
struct SourceOptions {
  // DeepSpeed ZeRO: also serve each trainable parameter's Adam moments, as
  // "exp_avg.<name>" and "exp_avg_sq.<name>" after the weights.
  bool zero_moments = false;
  ReadLimits limits;
  // Where the source lives; null means the local file system (Env::Local()).
  std::shared_ptr<Env> env;
};

// Detects the format of `source` (a file or a folder) and reads its catalog.
Status OpenCatalog(const std::string& source, const SourceOptions& options, std::shared_ptr<const Catalog>* out);
inline Status OpenCatalog(const std::string& source, std::shared_ptr<const Catalog>* out) {
  return OpenCatalog(source, SourceOptions{}, out);
}

}  // namespace ckptfs

#endif  // CKPTFS_CATALOG_HPP_
