// Megatron's distributed-optimizer fragments (megatron-core before 0.14, `torch_dist`
// backend): a parameter's optimizer state is saved as 1-D fragments (`flattened_range`) of
// the parameter's model-parallel chunks, which DCP records as a reformulated tensor
//   [F_0, ..., F_{N-1}, n]
// where F_d is the number of chunks along dimension d of the real tensor, n the number of
// elements of one chunk (extents e_d = real_d / F_d, n = prod e_d), and each fragment a DCP
// chunk at offsets (c_0, ..., c_{N-1}, s) with sizes (1, ..., 1, len): elements [s, s + len)
// of chunk c in the chunk's own row-major order. The real shape is only in the metadata's
// `mcore_data` (`nd_reformulated_orig_global_shape`). Layout facts: doc/FORMATS.md,
// "Megatron flattened fragments".
#ifndef CKPTFS_FORMAT_MEGATRON_MEGATRON_FRAGMENTS_HPP_
#define CKPTFS_FORMAT_MEGATRON_MEGATRON_FRAGMENTS_HPP_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ckptfs/catalog.hpp"

namespace ckptfs {

// How a reformulated tensor's fragments map onto the real tensor.
struct MegatronReformulation {
  std::vector<uint64_t> real;   // the real global shape (rank N)
  std::vector<uint64_t> grid;   // F: chunks along each real dimension
  std::vector<uint64_t> chunk;  // e: a chunk's extent along each real dimension
  uint64_t chunk_numel = 0;     // n
  // True when the real tensor's row-major order is the reformulated tensor's (the chunks
  // split one dimension, every dimension before it has chunk extent 1 and every one after
  // it is whole): each fragment is then one run of the real tensor, served as a byte range.
  // Otherwise fragments are placed as boxes of the real tensor and gathered on read.
  bool row_major = false;
};

// Checks that `reformulated` (DCP's size) is the reformulation of `real` (rank N + 1, the
// first N numbers dividing `real` exactly, the last their chunk's element count) and fills
// `out`. On failure returns false with `why` saying what disagrees.
bool PlanMegatronReformulation(std::span<const uint64_t> real, std::span<const uint64_t> reformulated,
                               MegatronReformulation* out, std::string* why);

// Appends to `out` the boxes of one fragment: the DCP chunk at `offsets` with `sizes` (of the
// reformulated tensor), its elements stored contiguously from byte `base` of `file`,
// `itemsize` bytes each. Rank-1 ranges of the real tensor when `plan.row_major`, else boxes
// of the real tensor's rank (at most 2N - 1 per fragment). False with `why` when the chunk
// is not a fragment of one Megatron chunk or the arithmetic overflows.
bool PlaceMegatronFragment(const MegatronReformulation& plan, std::span<const uint64_t> offsets,
                           std::span<const uint64_t> sizes, uint32_t file, uint64_t base, uint64_t itemsize,
                           BoxList* out, std::string* why);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_MEGATRON_MEGATRON_FRAGMENTS_HPP_
