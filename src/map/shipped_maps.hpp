// The key maps built into ckptfs: the files of maps/ (doc/MAPS.md, "Shipped maps"),
// embedded at build time by cmake/embed_maps.cmake, in the order `map=auto` tries them.
#ifndef CKPTFS_MAP_SHIPPED_MAPS_HPP_
#define CKPTFS_MAP_SHIPPED_MAPS_HPP_

#include <span>
#include <string_view>

namespace ckptfs {

struct ShippedMap {
  std::string_view name;  // the file's name without .json: the Hugging Face model_type
  std::string_view text;  // its JSON
};

std::span<const ShippedMap> ShippedMaps();

}  // namespace ckptfs

#endif  // CKPTFS_MAP_SHIPPED_MAPS_HPP_
