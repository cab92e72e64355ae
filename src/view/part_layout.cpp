// The files with a part per tensor, laid out on first need and made again on read:
// model files (header pieces from the served tensors, then each tensor's data) and manifest.json
// (one entry per tensor). Only offsets are kept: for a million tensors the header text would
// be ~70 MB and the manifest entries ~250 MB, and laying them out takes ~0.4 s that a mount
// that is only listed never needs.
#include <algorithm>
#include <cstring>

#include <xxhash.h>

#include "ckptfs/view.hpp"
#include "view/gather.hpp"
#include "view/safetensors_header.hpp"
#include "view/view_impl.hpp"

namespace ckptfs {
namespace {

// Header entries per piece: a read of the header makes the pieces it meets (~70 bytes an
// entry), so a piece is a little more than a typical read.
constexpr uint32_t kEntriesPerPiece = 1024;

// `key_prefix`: the bytes of the key that name the model's folder, left out of its file.
void FillHeaderEntry(const ServedTensor& t, size_t key_prefix, uint64_t data_begin, HeaderEntry* e) {
  e->key = t.key().substr(key_prefix);
  ServedDTypeAndShape(t, &e->dtype, &e->shape);
  e->begin = data_begin;
  e->end = data_begin + t.nbytes();
}

}  // namespace

void View::EnsureModelFiles() const { std::call_once(impl_->model_once_, [this] { LayOutModelFiles(); }); }

void View::LayOutModelFiles() const {
  const ServedTensors& tensors = impl_->served_;
  impl_->model_begin_.assign(tensors.size(), 0);
  std::string scratch;  // one entry's text at a time, measured and dropped
  HeaderEntry e;
  for (Impl::ModelFile& f : impl_->model_files_) {
    f.pieces.clear();
    if (f.source_file) {  // the source file as it is: its header, its tensors where they lie
      f.header_size = f.source_data_start;
      f.size = tensors.source().files->size(*f.source_file);
      for (uint32_t i : f.members) impl_->model_begin_[i] = tensors.source().tensors[i].boxes[0].base_offset;
      continue;
    }
    uint64_t pos = kSafetensorsHeaderStartSize, data = 0;
    for (uint32_t k = 0; k < f.members.size(); ++k) {
      if (k % kEntriesPerPiece == 0 && k > 0) f.pieces.push_back(Impl::HeaderPiece{k, pos});
      if (k == 0) f.pieces.push_back(Impl::HeaderPiece{0, 0});
      const ServedTensor t = tensors[f.members[k]];
      FillHeaderEntry(t, f.key_prefix, data, &e);
      scratch.clear();
      AppendSafetensorsHeaderEntry(e, &scratch);
      pos += scratch.size();
      impl_->model_begin_[f.members[k]] = data;  // relative to the data until the header's size is known
      data += t.nbytes();
    }
    if (f.pieces.empty()) f.pieces.push_back(Impl::HeaderPiece{0, 0});
    // The end, as AppendSafetensorsHeaderEnd writes it: '}', then spaces to a multiple of 8.
    const uint64_t json_size = pos + 1 - 8;
    f.header_size = 8 + json_size + (8 - json_size % 8) % 8;
    for (uint32_t i : f.members) impl_->model_begin_[i] += f.header_size;
    f.size = f.header_size + data;
  }
}

void View::MakeHeaderPiece(size_t file, size_t p, std::string* out) const {
  const Impl::ModelFile& f = impl_->model_files_[file];
  out->clear();
  const uint32_t first = f.pieces[p].first_member;
  const uint32_t end = p + 1 < f.pieces.size() ? f.pieces[p + 1].first_member : static_cast<uint32_t>(f.members.size());
  if (p == 0) {
    AppendSafetensorsHeaderStart(out);
    const uint64_t json_size = f.header_size - 8;
    for (int b = 0; b < 8; ++b) (*out)[b] = static_cast<char>((json_size >> (8 * b)) & 0xFF);
  }
  HeaderEntry e;
  for (uint32_t k = first; k < end; ++k) {
    const uint32_t i = f.members[k];
    FillHeaderEntry(impl_->served_[i], f.key_prefix, impl_->model_begin_[i] - f.header_size, &e);
    AppendSafetensorsHeaderEntry(e, out);
  }
  if (p + 1 == f.pieces.size()) {
    *out += '}';
    const uint64_t piece_size = f.header_size - f.pieces[p].start;
    if (out->size() < piece_size) out->append(piece_size - out->size(), ' ');
  }
}

Status View::ReadModelFile(NodeId id, uint64_t offset, uint64_t end, char* out) const {
  EnsureModelFiles();
  const Impl::ModelFile& f = impl_->model_files_[impl_->entries_[id].model_file];
  if (f.source_file) {
    const SourceFiles& files = *impl_->served_.source().files;
    FileChecks checks(files);
    CKPTFS_RETURN_IF_ERROR(checks.Check(*f.source_file));
    return files.ReadExact(*f.source_file, offset, end - offset, out);
  }
  uint64_t pos = offset;
  thread_local std::string piece;
  while (pos < end && pos < f.header_size) {
    const size_t p = static_cast<size_t>(
        std::upper_bound(f.pieces.begin(), f.pieces.end(), pos, [](uint64_t o, const Impl::HeaderPiece& hp) { return o < hp.start; }) -
        f.pieces.begin() - 1);
    const uint64_t piece_end = p + 1 < f.pieces.size() ? f.pieces[p + 1].start : f.header_size;
    MakeHeaderPiece(impl_->entries_[id].model_file, p, &piece);
    // The layout measured the same entries of the same served tensors.
    if (piece.size() != piece_end - f.pieces[p].start)
      return Status::Corruption(PathOf(id), "header piece changed size");
    const uint64_t hi = std::min(end, piece_end);
    std::memcpy(out + (pos - offset), piece.data() + (pos - f.pieces[p].start), hi - pos);
    pos = hi;
  }
  if (pos >= end) return Status::OK();
  // The data: members in order, each at impl_->model_begin_; the last member that starts at or
  // before `pos` holds it (or is empty, and the next one does).
  const ServedTensors& tensors = impl_->served_;
  size_t k = static_cast<size_t>(
      std::upper_bound(f.members.begin(), f.members.end(), pos, [&](uint64_t o, uint32_t i) { return o < impl_->model_begin_[i]; }) -
      f.members.begin());
  if (k > 0) --k;
  FileChecks checks(*impl_->served_.source().files);  // each source file checked once for the whole read
  for (; pos < end && k < f.members.size(); ++k) {
    const uint32_t i = f.members[k];
    const ServedTensor t = tensors[i];
    const uint64_t begin = impl_->model_begin_[i], size = t.nbytes();
    if (begin + size <= pos) continue;
    const uint64_t hi = std::min(end, begin + size);
    const TensorEntry* stored = nullptr;
    if (RouteOf(t) == ReadRoute::kExtents && t.Stored(&stored).ok())
      CKPTFS_RETURN_IF_ERROR(ReadStored(*stored, pos - begin, hi - pos, out + (pos - offset), &checks));
    else
      CKPTFS_RETURN_IF_ERROR(ReadTensorData(i, pos - begin, hi - pos, out + (pos - offset)));
    pos = hi;
  }
  return Status::OK();
}

void View::EnsureManifest() const { std::call_once(impl_->manifest_once_, [this] { LayOutManifest(); }); }

void View::LayOutManifest() const {
  EnsureModelFiles();
  const ServedTensors& tensors = impl_->served_;
  // Storage shared by several tensors (tied weights): the manifest names the group on each
  // member. Found by sorting (hash of id, tensor) pairs and comparing the ids only within a
  // run of equal hashes: a map of a million ids would take ~100 MB and a second, and sorting
  // the ids as strings (a cache miss per comparison) most of a remount's View build.
  impl_->shares_storage_.assign(tensors.size(), false);
  {
    std::vector<std::pair<uint64_t, uint32_t>> ids;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const std::string& id = tensors[i].storage_id();
      if (!id.empty()) ids.emplace_back(XXH3_64bits(id.data(), id.size()), static_cast<uint32_t>(i));
    }
    std::sort(ids.begin(), ids.end());
    for (size_t k = 0; k < ids.size();) {
      size_t end = k + 1;
      while (end < ids.size() && ids[end].first == ids[k].first) ++end;
      for (size_t a = k; a < end; ++a)  // a run is one id, or rarely a few colliding ones
        for (size_t b = a + 1; b < end; ++b)
          if (tensors[ids[a].second].storage_id() == tensors[ids[b].second].storage_id())
            impl_->shares_storage_[ids[a].second] = impl_->shares_storage_[ids[b].second] = true;
      k = end;
    }
  }
  impl_->manifest_entry_end_.resize(tensors.size());
  std::string scratch;  // one entry's text at a time, measured and dropped
  uint64_t pos = impl_->manifest_head_.size();
  for (size_t i = 0; i < tensors.size(); ++i) {
    scratch.clear();
    AppendManifestEntry(i, nullptr, &scratch);
    pos += scratch.size();
    impl_->manifest_entry_end_[i] = pos;
  }
  impl_->manifest_size_ = pos + impl_->manifest_tail_.size();
}

Status View::ReadManifest(NodeId id, uint64_t offset, uint64_t end, char* out) const {
  EnsureManifest();
  const uint64_t head = impl_->manifest_head_.size();
  const uint64_t entries_end = impl_->manifest_entry_end_.empty() ? head : impl_->manifest_entry_end_.back();
  uint64_t pos = offset;
  if (pos < end && pos < head) {
    const uint64_t hi = std::min(end, head);
    std::memcpy(out, impl_->manifest_head_.data() + pos, hi - pos);
    pos = hi;
  }
  if (pos < end && pos < entries_end) {
    size_t i = static_cast<size_t>(std::upper_bound(impl_->manifest_entry_end_.begin(), impl_->manifest_entry_end_.end(), pos) -
                                   impl_->manifest_entry_end_.begin());
    thread_local std::string entry;
    for (; pos < end && i < impl_->manifest_entry_end_.size(); ++i) {
      const uint64_t begin = i == 0 ? head : impl_->manifest_entry_end_[i - 1];
      entry.clear();
      AppendManifestEntry(i, nullptr, &entry);
      if (entry.size() != impl_->manifest_entry_end_[i] - begin) return Status::Corruption(PathOf(id), "manifest entry changed size");
      const uint64_t hi = std::min(end, impl_->manifest_entry_end_[i]);
      std::memcpy(out + (pos - offset), entry.data() + (pos - begin), hi - pos);
      pos = hi;
    }
  }
  if (pos < end) std::memcpy(out + (pos - offset), impl_->manifest_tail_.data() + (pos - entries_end), end - pos);
  return Status::OK();
}

}  // namespace ckptfs
