// The `.metadata` file of a torch.distributed.checkpoint (DCP) folder, parsed without
// executing anything into plain structures: which state-dict entries are tensors (dtype,
// global shape, chunks) and which are pickled objects, where each chunk or object lies
// (file, offset, length), and the nesting path each entry had in the saved state dict.
// Layout facts: doc/FORMATS.md, "DCP layout".
#ifndef CKPTFS_FORMAT_DCP_DCP_METADATA_HPP_
#define CKPTFS_FORMAT_DCP_DCP_METADATA_HPP_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/catalog.hpp"
#include "ckptfs/limits.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// A byte range of one of the folder's data files (a `_StorageInfo`).
struct DcpSlice {
  uint32_t file = 0;  // index into DcpMetadata::files
  uint64_t offset = 0;
  uint64_t length = 0;
};

// A million-chunk save makes a million of these, so a chunk is a slice and 2 x rank numbers
// in one array per tensor rather than two vectors and a path string of its own.
struct DcpItem {
  std::string fqn;                // the flattened state-dict key
  std::vector<PathElement> path;  // planner_data: where it sat in the nested state dict
  bool is_tensor = false;
  // Tensors only.
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  // Chunk k holds elements [offsets(k)[d], offsets(k)[d] + sizes(k)[d]) along each
  // dimension d, stored as a torch.save archive in chunk_slices[k].
  std::vector<DcpSlice> chunk_slices;
  std::vector<uint64_t> chunk_dims;  // per chunk: its offsets, then its sizes (rank each)
  size_t chunk_count() const { return chunk_slices.size(); }
  std::span<const uint64_t> offsets(size_t k) const { return {chunk_dims.data() + 2 * k * shape.size(), shape.size()}; }
  std::span<const uint64_t> sizes(size_t k) const {
    return {chunk_dims.data() + (2 * k + 1) * shape.size(), shape.size()};
  }
  // Non-tensor items: a torch.save of the object.
  DcpSlice object;
  // Megatron's flattened fragments (megatron-core before 0.14): `shape` is the reformulated
  // shape DCP saved and this the real one, from the metadata's
  // `mcore_data[fqn]["nd_reformulated_orig_global_shape"]` (src/format/megatron/megatron_fragments.hpp).
  bool megatron_reformulated = false;
  std::vector<uint64_t> megatron_shape;
};

struct DcpMetadata {
  std::vector<DcpItem> items;      // in state_dict_metadata order
  std::vector<std::string> files;  // data files' paths relative to the folder, as DcpSlice::file numbers them
  std::string version;             // "" for checkpoints older than the version field
  nlohmann::json storage_meta;     // checkpoint_id, save_id, ... (null when absent)
};

// Parses `bytes`, the content of a `.metadata` file (kept while parsing, not copied);
// `where` names it in messages, which also name the fqn concerned. Checks every chunk lies
// inside its tensor and has a storage entry, every relative path stays inside the folder,
// and refuses storage entries with transform descriptors (compressed or otherwise encoded
// slices). Megatron's `mcore_data` (an attribute megatron-core adds to the Metadata) gives
// reformulated tensors their real shapes; an entry of it that names anything else, or a real
// shape for a non-tensor entry, is refused as not understood.
Status ParseDcpMetadata(std::string bytes, std::string_view where, DcpMetadata* out,
                        const ReadLimits& limits = ReadLimits{});

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_DCP_DCP_METADATA_HPP_
