#include "format/chunk_boxes.hpp"

#include <algorithm>

#include "io/checked_math.hpp"

namespace ckptfs {

bool PlaceChunkBoxes(BoxList stored, std::span<const uint64_t> offsets, std::span<const uint64_t> sizes,
                     BoxList* out) {
  for (Box& box : stored) {
    Box placed;
    placed.file = box.file;
    placed.base_offset = box.base_offset;
    placed.offset.assign(offsets.begin(), offsets.end());
    placed.extent.assign(sizes.begin(), sizes.end());
    if (box.rank() == sizes.size()) {
      placed.strides = std::move(box.strides);
    } else {
      // A contiguous chunk is a row-major block of the full tensor; a Box::Range would only
      // describe it along one dimension.
      placed.strides.assign(sizes.size(), 1);
      for (size_t d = sizes.size(); d-- > 1;)
        if (!CheckedMul(placed.strides[d], std::max<uint64_t>(sizes[d], 1), &placed.strides[d - 1])) return false;
    }
    out->push_back(std::move(placed));
  }
  return true;
}

}  // namespace ckptfs
