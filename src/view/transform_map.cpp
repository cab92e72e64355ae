// The `map=` view: the key map engine (src/map/key_map.hpp) applied to what the view serves
// so far, its tensors served in their place, their entries made on first use.
#include <memory>
#include <utility>

#include "map/key_map.hpp"
#include "view/deferred_tensors.hpp"
#include "view/served_edit.hpp"
#include "view/transform.hpp"

namespace ckptfs {
namespace {

// The view's tensors before the map, as the engine reads them: a copy of the set (it shares
// the catalog's entries, not a second list), kept as long as the mapped tensors are served.
class ServedMapInput final : public MapInput {
 public:
  explicit ServedMapInput(ServedTensors before) : before_(std::move(before)) {}
  const Catalog& catalog() const override { return before_.source(); }
  size_t size() const override { return before_.size(); }
  std::string_view key(size_t i) const override { return before_.key(i); }
  const Shape& shape(size_t i) const override { return before_.shape(i); }
  DType stored_dtype(size_t i) const override { return before_.stored_dtype(i); }
  const KeyPath& path(size_t i) const override { return before_.path(i); }
  Status Stored(size_t i, const TensorEntry** out) const override { return before_.Stored(i, out); }
  size_t source_index(size_t i) const override { return before_.source_index(i); }
  Status CheckEntry(const TensorEntry& t, size_t source_index, std::span<const uint32_t> others) const override {
    return CheckServedEntry(before_.source(), t, source_index, others, "map");
  }

 private:
  ServedTensors before_;
};

class MapTransform final : public Transform {
 public:
  explicit MapTransform(const ViewOptions& options)
      : request_{.spec = options.map, .settings = options.map_settings, .dtype = options.dtype} {}

  Status Apply(ServedTensors* served) const override {
    MappedTensors mapped;
    CKPTFS_RETURN_IF_ERROR(ApplyKeyMap(request_, std::make_shared<ServedMapInput>(*served), &mapped));
    DeferredTensors deferred;
    deferred.key_text = std::move(mapped.key_text);
    deferred.key_end = std::move(mapped.key_end);
    deferred.shapes = std::move(mapped.shapes);
    deferred.shape_of = std::move(mapped.shape_of);
    deferred.from_sources = std::move(mapped.from_sources);
    deferred.others = std::move(mapped.others);
    deferred.make = std::move(mapped.make);
    deferred.transform = "map";
    ServedTensorsEditor edit(served);
    // The mapped tensors are one Hugging Face model, served at the root as model.safetensors
    // whatever the source's weight files were named.
    ModelComponent model;
    model.format = served->source().format;
    edit.SetTree({std::move(model)}, served->passed_files(), served->folders());
    edit.ReplaceDeferred(std::move(deferred));
    for (auto& [name, content] : mapped.files) edit.AddFile(name, std::move(content));
    (*edit.mutable_manifest_fields())["map"] = std::move(mapped.record);
    return Status::OK();
  }

 private:
  KeyMapRequest request_;
};

}  // namespace

std::unique_ptr<Transform> MakeMapTransform(const ViewOptions& options) {
  if (options.map.empty() || options.map == "none") return nullptr;
  return std::make_unique<MapTransform>(options);
}

}  // namespace ckptfs
