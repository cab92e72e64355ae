// ServedTensors: the tensors a view serves, as handles into the catalog's entries or into
// entries a transform made.
#include <algorithm>

#include "ckptfs/view.hpp"

namespace ckptfs {

ServedTensors::ServedTensors(std::shared_ptr<const Catalog> source)
    : source_(std::move(source)),
      // Aliasing pointers: they keep the catalog alive and point into it (no copy).
      stored_(source_, &source_->tensors),
      metadata_(source_, &source_->metadata) {}

void ServedTensors::Replace(std::vector<TensorEntry> stored, const std::vector<uint32_t>& from) {
  std::vector<uint32_t> source_index(from.size());
  std::vector<DType> dtypes;
  if (!dtypes_.empty()) dtypes.resize(from.size());
  for (size_t k = 0; k < from.size(); ++k) {
    source_index[k] = static_cast<uint32_t>(this->source_index(from[k]));
    if (!dtypes_.empty()) dtypes[k] = dtypes_[from[k]];
  }
  stored_ = std::make_shared<const std::vector<TensorEntry>>(std::move(stored));
  source_index_ = std::move(source_index);
  dtypes_ = std::move(dtypes);
  other_sources_.clear();
}

void ServedTensors::ReplaceFromSources(std::vector<TensorEntry> stored, std::vector<uint32_t> from_sources,
                                       std::vector<std::vector<uint32_t>> others) {
  stored_ = std::make_shared<const std::vector<TensorEntry>>(std::move(stored));
  source_index_ = std::move(from_sources);
  dtypes_.clear();
  other_sources_ = std::move(others);
  if (std::all_of(other_sources_.begin(), other_sources_.end(), [](const auto& o) { return o.empty(); }))
    other_sources_.clear();
}

std::span<const uint32_t> ServedTensors::other_sources(size_t i) const {
  if (other_sources_.empty()) return {};
  return other_sources_[i];
}

void ServedTensors::SetDType(size_t i, DType dtype) {
  if (dtypes_.empty()) {
    if (dtype == (*stored_)[i].dtype) return;
    dtypes_.resize(stored_->size());
    for (size_t k = 0; k < stored_->size(); ++k) dtypes_[k] = (*stored_)[k].dtype;
  }
  dtypes_[i] = dtype;
}

void ServedTensors::SetMetadata(nlohmann::json metadata) {
  metadata_ = std::make_shared<const nlohmann::json>(std::move(metadata));
}

}  // namespace ckptfs
