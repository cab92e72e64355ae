// Where a tensor's boxes sit in it: the dimensions they tile and the row-major positions
// of their elements. Shared by the read-route decision, layout validation and the View's
// gather, so all three read the box geometry of doc/FORMATS.md ("Tensor layout") alike.
#ifndef CKPTFS_CATALOG_TILING_HPP_
#define CKPTFS_CATALOG_TILING_HPP_

#include <cstdint>
#include <span>
#include <vector>

#include "ckptfs/catalog.hpp"

namespace ckptfs {

// The dimensions the boxes of `tensor` tile: its shape, or {numel} when its boxes are rank 1
// and tile its flattened elements. For a rank-1 tensor the two are the same.
std::vector<uint64_t> TiledDims(const TensorEntry& tensor);
// The same into an inline Shape, without allocating (checked for every tensor of a catalog).
void TiledDims(const TensorEntry& tensor, Shape* dims);

// The row-major position in `dims` of the element at multi-index `index`.
uint64_t RowMajorPosition(std::span<const uint64_t> index, std::span<const uint64_t> dims);

// Whether `box`'s elements lie in its file in row-major order without gaps, from
// base_offset on (strides along dimensions of extent 1 do not matter).
bool StoredRowMajor(const Box& box);

// Whether `box`'s elements are one contiguous run of the row-major order of `dims`: the
// dimensions inside the outermost one it cuts are whole, those outside it have extent 1.
bool CoversRun(const Box& box, std::span<const uint64_t> dims);

}  // namespace ckptfs

#endif  // CKPTFS_CATALOG_TILING_HPP_
