// Key maps (doc/MAPS.md) as a stage of their own: a map serves new tensors made from the
// tensors it is given, each the boxes of rows, slices or layers of source tensors
// (key_map_ops.hpp), with the files the mapped model needs beside them (config.json). The map
// is data (map_spec.hpp): a shipped one (maps/, shipped_maps.hpp) or a file; map=auto picks a
// shipped one by the catalog's ModelDescription.
//
// The engine knows tensors and catalogs, not views: it reads its input through MapInput and
// hands back MappedTensors, which the view's map transform (src/view/transform_map.cpp)
// serves.
//
// Never a silently wrong tree: a parameter that disagrees with a tensor's shape, a source
// tensor no rule uses and the map does not ignore, a rule whose source is missing, a layer
// axis of the wrong length: each refuses the map with one line naming the tensor.
#ifndef CKPTFS_MAP_KEY_MAP_HPP_
#define CKPTFS_MAP_KEY_MAP_HPP_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/catalog.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// The tensors a key map is applied to (a view's, before the map), as the map reads them.
// Thread-safety: const methods may be called concurrently.
class MapInput {
 public:
  virtual ~MapInput() = default;
  // The catalog the tensors come from: its model description decides map=auto.
  virtual const Catalog& catalog() const = 0;
  virtual size_t size() const = 0;
  virtual std::string_view key(size_t i) const = 0;
  virtual const Shape& shape(size_t i) const = 0;
  virtual DType stored_dtype(size_t i) const = 0;
  virtual const KeyPath& path(size_t i) const = 0;
  // Tensor i's elements as stored (key, shape and boxes).
  virtual Status Stored(size_t i, const TensorEntry** out) const = 0;
  // The index in catalog().tensors of tensor i's source tensor.
  virtual size_t source_index(size_t i) const = 0;
  // Whether entry `t`, made from catalog tensor `source_index` and `others`, may be served:
  // the consumer's invariant (a view's: every box a view of a box of its sources).
  virtual Status CheckEntry(const TensorEntry& t, size_t source_index, std::span<const uint32_t> others) const = 0;
};

// What a key map serves: every tensor's key and shape up front; each tensor's entry made by
// `make` when it is first needed (a map of 100,000 per-layer tensors would spend ~40 MB and
// ~0.1 s making entries nobody reads).
struct MappedTensors {
  std::string key_text;                       // the keys, one after another
  std::vector<uint64_t> key_end;              // tensor i's key ends at key_end[i]
  std::vector<Shape> shapes;                  // the distinct shapes
  std::vector<uint32_t> shape_of;             // tensor i's shape: shapes[shape_of[i]]
  std::vector<uint32_t> from_sources;         // tensor i's source tensor (index into the catalog)
  std::vector<std::vector<uint32_t>> others;  // further source tensors of tensor i, or empty for all
  // Tensor i's entry: its key and shape the ones above, its stored dtype its source's. May be
  // called from any thread.
  std::function<Status(size_t, TensorEntry*)> make;
  // Files the mapped model needs (config.json, generation_config.json): name -> content.
  std::vector<std::pair<std::string, std::string>> files;
  // What manifest.json's "map" says of it: the map, why it was chosen, its parameters.
  nlohmann::json record;
};

// What a user asks of a map (the view options map, map.NAME=VALUE and dtype).
struct KeyMapRequest {
  // "auto", a shipped map's name, or an absolute path of a map file.
  std::string spec;
  std::vector<std::pair<std::string, std::string>> settings;
  // The dtype the tensors will be served in, for config.json.
  std::optional<DType> dtype;
};

// Applies the map `request` names to `input`. `input` is kept as long as *out's `make` lives.
Status ApplyKeyMap(const KeyMapRequest& request, std::shared_ptr<const MapInput> input, MappedTensors* out);

}  // namespace ckptfs

#endif  // CKPTFS_MAP_KEY_MAP_HPP_
