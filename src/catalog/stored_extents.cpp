// Whether a tensor's stored bytes are byte ranges of source files, and which ranges: what
// the catalog says of its storage. How a view serves a tensor is the view's (RouteOf,
// src/view/route.cpp).
#include <algorithm>

#include "catalog/tiling.hpp"
#include "ckptfs/catalog.hpp"

namespace ckptfs {

bool StoredAsExtents(const TensorEntry& tensor) {
  // A box of rank 0 or 1 is always one run of what it tiles: only higher ranks need the
  // dims (most tensors are one range, and this runs for each of them while a view is built).
  std::vector<uint64_t> dims;
  for (const Box& box : tensor.boxes) {
    if (box.numel() == 0) continue;
    if (!StoredRowMajor(box)) return false;
    if (box.rank() < 2) continue;
    if (dims.empty()) dims = TiledDims(tensor);
    if (!CoversRun(box, dims)) return false;
  }
  return true;
}

std::vector<Extent> ExtentsOf(const TensorEntry& tensor) {
  const uint64_t itemsize = Info(tensor.dtype).itemsize;
  if (tensor.boxes.size() == 1) {  // most tensors
    const Box& box = tensor.boxes[0];
    if (box.numel() == 0) return {};
    return {Extent{box.file, box.base_offset, box.numel() * itemsize}};
  }
  const std::vector<uint64_t> dims = TiledDims(tensor);
  // Each box is one run of the tensor's row-major order; the runs in order of their first
  // element concatenate to the tensor.
  struct Run {
    uint64_t first = 0;
    Extent bytes;
  };
  std::vector<Run> runs;
  runs.reserve(tensor.boxes.size());
  for (const Box& box : tensor.boxes) {
    const uint64_t n = box.numel();
    if (n > 0) runs.push_back(Run{RowMajorPosition(box.offset, dims), Extent{box.file, box.base_offset, n * itemsize}});
  }
  std::stable_sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.first < b.first; });
  std::vector<Extent> extents;
  extents.reserve(runs.size());
  for (const Run& run : runs) {
    const Extent& e = run.bytes;
    if (!extents.empty() && extents.back().file == e.file && extents.back().offset + extents.back().length == e.offset)
      extents.back().length += e.length;  // one read where the file allows it
    else
      extents.push_back(e);
  }
  return extents;
}

}  // namespace ckptfs
