// Tensors served with their entries made on first use (ServedTensorsEditor::ReplaceDeferred):
// what a transform serves when its tensors are many and cheap to describe but not to make (a
// key map's: 100,000 per-layer tensors would be ~40 MB of entries, each made in ~1 us). Their
// keys and shapes come up front, for the layout; each entry is made when something first
// needs its boxes (a read, a load, a checksum). For transforms only: front ends see
// ServedTensors.
#ifndef CKPTFS_VIEW_DEFERRED_TENSORS_HPP_
#define CKPTFS_VIEW_DEFERRED_TENSORS_HPP_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

struct DeferredTensors {
  std::string key_text;                // the keys, one after another
  std::vector<uint64_t> key_end;       // tensor i's key ends at key_end[i] (and starts at key_end[i - 1])
  std::vector<Shape> shapes;           // the distinct shapes
  std::vector<uint32_t> shape_of;      // tensor i's shape: shapes[shape_of[i]]
  std::vector<uint32_t> from_sources;  // tensor i's source tensor (index into source().tensors)
  std::vector<std::vector<uint32_t>> others;  // further source tensors of tensor i, or empty for all
  // Tensor i's entry: its key and shape those above, its stored dtype its source tensor's.
  // Called from any thread, once per tensor unless threads race to make the same one (each
  // call must make the same entry; one is kept).
  std::function<Status(size_t i, TensorEntry* out)> make;
  const char* transform = "";  // names the transform in a refusal of a made entry
};

}  // namespace ckptfs

#endif  // CKPTFS_VIEW_DEFERRED_TENSORS_HPP_
