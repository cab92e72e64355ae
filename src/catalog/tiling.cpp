#include "catalog/tiling.hpp"

namespace ckptfs {

std::vector<uint64_t> TiledDims(const TensorEntry& tensor) {
  Shape dims;
  TiledDims(tensor, &dims);
  return dims.to_vector();
}

void TiledDims(const TensorEntry& tensor, Shape* dims) {
  if (!tensor.boxes.empty() && tensor.boxes.front().rank() == 1 && tensor.shape.size() != 1)
    *dims = Shape{tensor.numel()};
  else
    *dims = tensor.shape;
}

uint64_t RowMajorPosition(std::span<const uint64_t> index, std::span<const uint64_t> dims) {
  uint64_t position = 0;
  for (size_t d = 0; d < dims.size() && d < index.size(); ++d) position = position * dims[d] + index[d];
  return position;
}

bool StoredRowMajor(const Box& box) {
  uint64_t expected = 1;
  for (size_t d = box.rank(); d-- > 0;) {
    if (box.extent[d] == 0) return true;  // no elements
    if (box.extent[d] != 1 && box.strides[d] != expected) return false;
    expected *= box.extent[d];
  }
  return true;
}

bool CoversRun(const Box& box, std::span<const uint64_t> dims) {
  if (box.rank() != dims.size()) return false;
  size_t whole_from = box.rank();  // dimensions [whole_from, rank) are whole
  while (whole_from > 0 && box.extent[whole_from - 1] == dims[whole_from - 1]) --whole_from;
  // Dimension whole_from - 1 may be cut; every dimension outside it must be a single index.
  for (size_t d = 0; d + 1 < whole_from; ++d)
    if (box.extent[d] != 1) return false;
  return true;
}

}  // namespace ckptfs
