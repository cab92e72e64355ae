// The catalog's value types: element counts of tensors and boxes, flattened keys.
#include "ckptfs/catalog.hpp"

namespace ckptfs {

uint64_t TensorEntry::numel() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;  // readers and ValidateLayout reject shapes whose product overflows
  return n;
}

uint64_t Box::numel() const {
  uint64_t n = 1;
  for (uint64_t e : extent) n *= e;  // a valid box lies inside its tensor's shape
  return n;
}

Box Box::Range(uint32_t file, uint64_t base_offset, uint64_t first_element, uint64_t count) {
  Box box;
  box.file = file;
  box.base_offset = base_offset;
  box.offset = {first_element};
  box.extent = {count};
  box.strides = {1};
  return box;
}

Box Box::Strided(uint32_t file, uint64_t base_offset, std::vector<uint64_t> shape, std::vector<uint64_t> strides) {
  Box box;
  box.file = file;
  box.base_offset = base_offset;
  box.offset.assign(shape.size(), 0);
  box.extent = std::move(shape);
  box.strides = std::move(strides);
  return box;
}

std::string FlattenKey(const std::vector<PathElement>& path) {
  std::string key;
  for (size_t i = 0; i < path.size(); ++i) {
    if (i) key += '.';
    if (const auto* s = std::get_if<std::string>(&path[i])) key += *s;
    else key += std::to_string(std::get<int64_t>(path[i]));
  }
  return key;
}

}  // namespace ckptfs
