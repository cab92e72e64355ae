// Placing one saved chunk of a sharded tensor (a DCP chunk, a shard file's tensor) into the
// full tensor: the chunk's own boxes, read from its archive or header as if it were a whole
// tensor, become boxes of the full tensor at the chunk's offsets.
#ifndef CKPTFS_FORMAT_CHUNK_BOXES_HPP_
#define CKPTFS_FORMAT_CHUNK_BOXES_HPP_

#include <cstdint>
#include <span>
#include <vector>

#include "ckptfs/catalog.hpp"

namespace ckptfs {

// Appends to `out` the boxes of a chunk of extent `sizes` at `offsets` whose elements
// `stored` holds (boxes of the chunk alone: one strided box of the chunk's rank, or a
// row-major Box::Range). False when the chunk's row-major strides overflow.
bool PlaceChunkBoxes(BoxList stored, std::span<const uint64_t> offsets, std::span<const uint64_t> sizes,
                     BoxList* out);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_CHUNK_BOXES_HPP_
