// ServedTensors: the tensors a view serves, as handles into the catalog's entries, into
// entries a transform made, or into a transform's description of them whose entries are made
// on first use (DeferredTensors).
#include <algorithm>
#include <atomic>

#include "ckptfs/view.hpp"
#include "view/deferred_tensors.hpp"
#include "view/served_edit.hpp"
#include "view/transform.hpp"

namespace ckptfs {

struct ServedTensors::DeferredState {
  // Tensor i's entry once made is made[i / kBlock][i % kBlock]; the blocks are allocated as
  // their first entry is made (a mount that is only listed holds none of them).
  static constexpr size_t kBlock = 1024;
  using Entry = std::atomic<TensorEntry*>;

  explicit DeferredState(DeferredTensors d)
      : deferred(std::move(d)),
        blocks((deferred.key_end.size() + kBlock - 1) / kBlock),
        made(new std::atomic<Entry*>[blocks]) {
    for (size_t b = 0; b < blocks; ++b) made[b].store(nullptr, std::memory_order_relaxed);
  }
  ~DeferredState() {
    for (size_t b = 0; b < blocks; ++b) {
      Entry* block = made[b].load(std::memory_order_relaxed);
      if (!block) continue;
      for (size_t k = 0; k < kBlock; ++k) delete block[k].load(std::memory_order_relaxed);
      delete[] block;
    }
  }
  DeferredState(const DeferredState&) = delete;
  DeferredState& operator=(const DeferredState&) = delete;

  // The place of tensor i's entry, its block allocated if need be. Set once: the first of
  // racing makers wins, the others' are dropped.
  Entry& Slot(size_t i) const {
    std::atomic<Entry*>& at = made[i / kBlock];
    Entry* block = at.load(std::memory_order_acquire);
    if (!block) {
      Entry* fresh = new Entry[kBlock];
      for (size_t k = 0; k < kBlock; ++k) fresh[k].store(nullptr, std::memory_order_relaxed);
      if (at.compare_exchange_strong(block, fresh, std::memory_order_acq_rel, std::memory_order_acquire)) block = fresh;
      else delete[] fresh;  // another thread's block is in place
    }
    return block[i % kBlock];
  }

  DeferredTensors deferred;
  size_t blocks;
  std::unique_ptr<std::atomic<Entry*>[]> made;
};

namespace {
const std::string kNoStorageId;
}  // namespace

ServedTensors::ServedTensors(std::shared_ptr<const Catalog> source)
    : source_(std::move(source)),
      // Aliasing pointers: they keep the catalog alive and point into it (no copy).
      stored_(source_, &source_->tensors),
      metadata_(source_, &source_->metadata) {
  components_ = source_->components;
  if (components_.empty()) {
    ModelComponent whole;
    whole.format = source_->format;
    components_.push_back(std::move(whole));
  }
  const std::vector<uint32_t>& siblings = source_->sibling_files;
  const std::vector<std::string>& paths = source_->sibling_paths;
  passed_files_.reserve(siblings.size());
  for (size_t k = 0; k < siblings.size(); ++k) {
    std::string path;
    if (paths.size() == siblings.size()) {
      path = paths[k];
    } else {
      const std::string& whole = source_->files->path(siblings[k]);
      path = whole.substr(whole.rfind('/') + 1);
    }
    passed_files_.push_back(PassedFile{std::move(path), siblings[k]});
  }
  folders_ = source_->folders;
}

size_t ServedTensors::ComponentOf(size_t i) const {
  if (components_.size() == 1 && components_[0].folder.empty()) return 0;
  // The component whose folder is the longest one the key starts with (then "/"); the
  // root's, "", when none.
  const std::string_view k = key(i);
  size_t best = components_.size(), best_length = 0;
  for (size_t c = 0; c < components_.size(); ++c) {
    const std::string& folder = components_[c].folder;
    if (folder.empty()) {
      if (best == components_.size()) best = c;
      continue;
    }
    if (folder.size() >= best_length && k.size() > folder.size() && k[folder.size()] == '/' && k.starts_with(folder)) {
      best = c;
      best_length = folder.size();
    }
  }
  return best == components_.size() ? 0 : best;
}

size_t ServedTensors::size() const {
  if (deferred_) return deferred_->deferred.key_end.size();
  return stored_ ? stored_->size() : 0;
}

std::string_view ServedTensors::key(size_t i) const {
  if (!deferred_) return (*stored_)[i].key;
  const DeferredTensors& d = deferred_->deferred;
  const uint64_t begin = i == 0 ? 0 : d.key_end[i - 1];
  return std::string_view(d.key_text).substr(begin, d.key_end[i] - begin);
}

const Shape& ServedTensors::shape(size_t i) const {
  if (!deferred_) return (*stored_)[i].shape;
  const DeferredTensors& d = deferred_->deferred;
  return d.shapes[d.shape_of[i]];
}

DType ServedTensors::stored_dtype(size_t i) const {
  if (!deferred_) return (*stored_)[i].dtype;
  return source_->tensors[source_index_[i]].dtype;
}

const KeyPath& ServedTensors::path(size_t i) const {
  if (!deferred_) return (*stored_)[i].path;
  return source_->tensors[source_index_[i]].path;
}

const std::string& ServedTensors::storage_id(size_t i) const {
  // A deferred tensor is a new block of its sources' elements: it shares no storage by name.
  if (!deferred_) return (*stored_)[i].storage_id;
  return kNoStorageId;
}

Status ServedTensors::Stored(size_t i, const TensorEntry** out) const {
  if (!deferred_) {
    *out = &(*stored_)[i];
    return Status::OK();
  }
  std::atomic<TensorEntry*>& slot = deferred_->Slot(i);
  if (TensorEntry* made = slot.load(std::memory_order_acquire)) {
    *out = made;
    return Status::OK();
  }
  const DeferredTensors& d = deferred_->deferred;
  auto made = std::make_unique<TensorEntry>();
  CKPTFS_RETURN_IF_ERROR(d.make(i, made.get()));
  if (made->key != key(i) || made->shape != shape(i) || made->dtype != stored_dtype(i))
    return Status::Corruption(source_->source, std::string("view transform ") + d.transform + ": tensor '" +
                                                   std::string(key(i)) + "' was made with another key, shape or dtype");
  CKPTFS_RETURN_IF_ERROR(CheckServedEntry(*source_, *made, source_index(i), other_sources(i), d.transform));
  TensorEntry* expected = nullptr;
  if (slot.compare_exchange_strong(expected, made.get(), std::memory_order_acq_rel, std::memory_order_acquire)) {
    *out = made.release();
  } else {
    *out = expected;  // another thread made it first; ours is dropped
  }
  return Status::OK();
}

std::span<const uint32_t> ServedTensors::other_sources(size_t i) const {
  if (other_sources_.empty()) return {};
  return other_sources_[i];
}

void ServedTensorsEditor::Replace(std::vector<TensorEntry> stored, const std::vector<uint32_t>& from) {
  std::vector<uint32_t> source_index(from.size());
  std::vector<DType> dtypes;
  if (!s_.dtypes_.empty()) dtypes.resize(from.size());
  for (size_t k = 0; k < from.size(); ++k) {
    source_index[k] = static_cast<uint32_t>(s_.source_index(from[k]));
    if (!s_.dtypes_.empty()) dtypes[k] = s_.dtypes_[from[k]];
  }
  s_.stored_ = std::make_shared<const std::vector<TensorEntry>>(std::move(stored));
  s_.deferred_.reset();
  s_.source_index_ = std::move(source_index);
  s_.dtypes_ = std::move(dtypes);
  s_.other_sources_.clear();
}

void ServedTensorsEditor::ReplaceFromSources(std::vector<TensorEntry> stored, std::vector<uint32_t> from_sources,
                                             std::vector<std::vector<uint32_t>> others) {
  s_.stored_ = std::make_shared<const std::vector<TensorEntry>>(std::move(stored));
  s_.deferred_.reset();
  s_.source_index_ = std::move(from_sources);
  s_.dtypes_.clear();
  s_.other_sources_ = std::move(others);
  if (std::all_of(s_.other_sources_.begin(), s_.other_sources_.end(), [](const auto& o) { return o.empty(); }))
    s_.other_sources_.clear();
}

void ServedTensorsEditor::ReplaceDeferred(DeferredTensors deferred) {
  s_.source_index_ = std::move(deferred.from_sources);
  s_.other_sources_ = std::move(deferred.others);
  if (std::all_of(s_.other_sources_.begin(), s_.other_sources_.end(), [](const auto& o) { return o.empty(); }))
    s_.other_sources_.clear();
  deferred.from_sources = {};  // kept once, as source_index_
  s_.stored_.reset();
  s_.dtypes_.clear();
  s_.deferred_ = std::make_shared<const ServedTensors::DeferredState>(std::move(deferred));
}

void ServedTensorsEditor::SetDType(size_t i, DType dtype) {
  if (s_.dtypes_.empty()) {
    if (dtype == s_.stored_dtype(i)) return;
    s_.dtypes_.resize(s_.size());
    for (size_t k = 0; k < s_.dtypes_.size(); ++k) s_.dtypes_[k] = s_.stored_dtype(k);
  }
  s_.dtypes_[i] = dtype;
}

void ServedTensorsEditor::SetMetadata(nlohmann::json metadata) {
  s_.metadata_ = std::make_shared<const nlohmann::json>(std::move(metadata));
}

void ServedTensorsEditor::AddFile(std::string path, std::string content) {
  for (auto& [at, old] : s_.added_files_)
    if (at == path) {
      old = std::move(content);
      return;
    }
  s_.added_files_.emplace_back(std::move(path), std::move(content));
}

void ServedTensorsEditor::SetTree(std::vector<ModelComponent> components, std::vector<PassedFile> passed,
                                  std::vector<std::string> folders) {
  s_.components_ = std::move(components);
  s_.passed_files_ = std::move(passed);
  s_.folders_ = std::move(folders);
}

}  // namespace ckptfs
