// What transforms change of the served tensors (src/view/transform.hpp): front ends read a
// ServedTensors; only the view's transforms make a new one, through this editor.
#ifndef CKPTFS_VIEW_SERVED_EDIT_HPP_
#define CKPTFS_VIEW_SERVED_EDIT_HPP_

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/view.hpp"
#include "view/deferred_tensors.hpp"

namespace ckptfs {

class ServedTensorsEditor {
 public:
  explicit ServedTensorsEditor(ServedTensors* served) : s_(*served) {}

  // Tensor k becomes `stored[k]`, serving elements of what tensor from[k] served (its source
  // tensor, its served dtype); `stored` and `from` have one entry per tensor served from here on.
  void Replace(std::vector<TensorEntry> stored, const std::vector<uint32_t>& from);
  // The same, where tensor k also serves elements of the source tensors (indices into
  // source().tensors) others[k]; `from` must then hold source indices too, as must every
  // transform's before this one (a key map runs on the catalog's own or a selection of them).
  void ReplaceFromSources(std::vector<TensorEntry> stored, std::vector<uint32_t> from_sources,
                          std::vector<std::vector<uint32_t>> others);
  // The set becomes the tensors of `deferred`, their entries made on first use; the entries
  // before are not served any more, and each entry is checked for the sub-box invariant when
  // it is made (CheckServedEntry).
  void ReplaceDeferred(DeferredTensors deferred);
  // A file added at `path` of the tree (a key map's config.json, a rewritten config); it
  // hides a passed file at that path, and replaces a file added there before.
  void AddFile(std::string path, std::string content);
  // The models, passed files and folders of the tree (a selection of one component).
  void SetTree(std::vector<ModelComponent> components, std::vector<PassedFile> passed,
               std::vector<std::string> folders);
  // Tensor i is served as `dtype`.
  void SetDType(size_t i, DType dtype);
  // The metadata served (metadata.json).
  void SetMetadata(nlohmann::json metadata);
  // What the transforms record in manifest.json (e.g. "dtype", "root"); an object.
  nlohmann::json* mutable_manifest_fields() { return &s_.manifest_fields_; }

 private:
  ServedTensors& s_;
};

}  // namespace ckptfs

#endif  // CKPTFS_VIEW_SERVED_EDIT_HPP_
