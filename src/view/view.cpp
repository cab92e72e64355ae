// Reads of virtual files: segment lookup by binary search, then literal copies, source
// preads, or tensor elements gathered from their boxes or converted.
#include "ckptfs/view.hpp"

#include <algorithm>
#include <cstring>

#include <xxhash.h>

#include "catalog/tiling.hpp"
#include "ckptfs/names.hpp"
#include "view/convert.hpp"
#include "view/gather.hpp"
#include "view/safetensors_header.hpp"
#include "view/view_impl.hpp"

namespace ckptfs {
namespace {

// Elements gathered per step, bounding the scratch memory of one read.
constexpr uint64_t kGatherChunkElements = uint64_t{1} << 18;

// Serves bytes [offset, offset+length) of an array of `elem_size`-byte elements that
// produce(first, count, buffer) fills in bounded chunks; the first and last element of
// the range may be partial. Whole chunks are produced straight into `out`; only a partial
// first or last element goes through `scratch` (a per-thread buffer of the caller's, kept
// between reads so a read allocates nothing).
template <typename Produce>
Status ReadElementwise(uint64_t offset, size_t length, uint64_t elem_size, char* out, std::vector<char>& scratch,
                       Produce produce) {
  uint64_t elem = offset / elem_size;
  const uint64_t end_elem = (offset + length + elem_size - 1) / elem_size;
  while (elem < end_elem) {
    const uint64_t count = std::min(kGatherChunkElements, end_elem - elem);
    const uint64_t chunk_begin = elem * elem_size;
    const uint64_t chunk_end = chunk_begin + count * elem_size;
    if (chunk_begin >= offset && chunk_end <= offset + length) {
      CKPTFS_RETURN_IF_ERROR(produce(elem, count, out + (chunk_begin - offset)));
    } else {
      if (scratch.size() < count * elem_size) scratch.resize(count * elem_size);
      CKPTFS_RETURN_IF_ERROR(produce(elem, count, scratch.data()));
      const uint64_t copy_from = std::max(chunk_begin, offset);
      const uint64_t copy_to = std::min(chunk_end, offset + length);
      std::memcpy(out + (copy_from - offset), scratch.data() + (copy_from - chunk_begin), copy_to - copy_from);
    }
    elem += count;
  }
  return Status::OK();
}

}  // namespace

View::View() : impl_(std::make_unique<Impl>()) {}
View::~View() = default;

const Catalog& View::source() const { return impl_->served_.source(); }
const ServedTensors& View::served() const { return impl_->served_; }
size_t View::node_count() const { return impl_->entries_.size() + impl_->served_.size(); }
bool View::IsDir(NodeId id) const { return id < impl_->entries_.size() && impl_->entries_[id].is_dir; }
View::NodeId View::ParentOf(NodeId id) const {
  return id < impl_->entries_.size() ? impl_->entries_[id].parent : impl_->tensors_dir_;
}
View::NodeId View::TensorFile(size_t index) const { return impl_->first_tensor_file_ + static_cast<NodeId>(index); }

int64_t View::TensorMTime(size_t index) const {
  // The newest of its source tensors' files: a served tensor's boxes are blocks of theirs, and
  // a key map's entry need not be made to be listed.
  int64_t m = 0;
  auto newest = [&](const TensorEntry& t) {
    for (const Box& box : t.boxes) m = std::max(m, source().files->identity(box.file).mtime_ns);
  };
  newest(source().tensors[impl_->served_.source_index(index)]);
  for (uint32_t o : impl_->served_.other_sources(index)) newest(source().tensors[o]);
  return m == 0 ? impl_->newest_mtime_ : m;
}

uint64_t View::TensorFileSize(size_t index) const {
  thread_local std::string header;  // measured and dropped
  header.clear();
  const ServedTensor t = impl_->served_[index];
  AppendTensorFileHeader(t, &header);
  return header.size() + t.nbytes();
}

View::Node View::node(NodeId id) const {
  Node n;
  if (id >= impl_->entries_.size()) {
    const size_t index = id - impl_->first_tensor_file_;
    n.name = TensorFileName(impl_->served_[index].key());
    n.parent = impl_->tensors_dir_;
    n.size = TensorFileSize(index);
    n.mtime_ns = TensorMTime(index);
    n.tensor = static_cast<int64_t>(index);
    return n;
  }
  const Impl::Entry& e = impl_->entries_[id];
  n.name = e.name;
  n.parent = e.parent;
  n.is_dir = e.is_dir;
  n.mtime_ns = e.mtime_ns;
  n.size = SizeOf(id);
  return n;
}

uint64_t View::SizeOf(NodeId id) const {
  if (id >= impl_->entries_.size()) return TensorFileSize(id - impl_->first_tensor_file_);
  const Impl::Entry& e = impl_->entries_[id];
  switch (e.content) {
    case Impl::Content::kSegments:
      return e.size;
    case Impl::Content::kModelFile:
      EnsureModelFiles();
      return impl_->model_files_[e.model_file].size;
    case Impl::Content::kManifest:
      EnsureManifest();
      return impl_->manifest_size_;
  }
  return 0;
}

std::string View::NameOf(NodeId id) const {
  if (id >= impl_->entries_.size()) return TensorFileName(impl_->served_[id - impl_->first_tensor_file_].key());
  return impl_->entries_[id].name;
}

void View::NameOf(NodeId id, std::string* name) const {
  name->clear();
  if (id >= impl_->entries_.size()) AppendTensorFileName(name, impl_->served_[id - impl_->first_tensor_file_].key());
  else name->assign(impl_->entries_[id].name);
}

size_t View::ChildCount(NodeId dir) const {
  if (dir == impl_->tensors_dir_) return impl_->tensor_file_order_.size();
  return dir < impl_->entries_.size() ? impl_->entries_[dir].children.size() : 0;
}

View::NodeId View::ChildAt(NodeId dir, size_t k) const {
  if (dir == impl_->tensors_dir_) return impl_->first_tensor_file_ + impl_->tensor_file_order_[k];
  return impl_->entries_[dir].children[k];
}

std::optional<View::NodeId> View::Child(NodeId dir, std::string_view name) const {
  if (!IsDir(dir)) return std::nullopt;
  if (dir == impl_->tensors_dir_) {
    // Binary search of the file-name order, each probe's name made again from its key.
    const ServedTensors& tensors = impl_->served_;
    thread_local std::string probe;
    auto it = std::lower_bound(impl_->tensor_file_order_.begin(), impl_->tensor_file_order_.end(), name, [&](uint32_t i, std::string_view n) {
      probe.clear();
      AppendTensorFileName(&probe, tensors[i].key());
      return probe < n;
    });
    if (it == impl_->tensor_file_order_.end()) return std::nullopt;
    probe.clear();
    AppendTensorFileName(&probe, tensors[*it].key());
    if (probe != name) return std::nullopt;
    return impl_->first_tensor_file_ + *it;
  }
  const std::vector<NodeId>& children = impl_->entries_[dir].children;
  auto it = std::lower_bound(children.begin(), children.end(), name,
                             [&](NodeId id, std::string_view n) { return impl_->entries_[id].name < n; });
  if (it == children.end() || impl_->entries_[*it].name != name) return std::nullopt;
  return *it;
}

std::optional<View::NodeId> View::Lookup(std::string_view path) const {
  NodeId id = kRoot;
  while (!path.empty()) {
    size_t slash = path.find('/');
    std::string_view part = path.substr(0, slash);
    path = slash == std::string_view::npos ? std::string_view() : path.substr(slash + 1);
    if (part.empty() || part == ".") continue;
    auto child = Child(id, part);
    if (!child) return std::nullopt;
    id = *child;
  }
  return id;
}

std::optional<uint32_t> View::PassedSourceFile(NodeId id) const {
  if (id >= impl_->entries_.size()) return std::nullopt;
  const Impl::Entry& e = impl_->entries_[id];
  if (e.is_dir || e.content != Impl::Content::kSegments || e.segment_count != 1) return std::nullopt;
  const Segment& seg = impl_->segments_[e.first_segment];
  if (seg.kind != Segment::Kind::kExtent) return std::nullopt;
  return seg.ref;
}

std::optional<uint32_t> View::SameAsSourceFile(NodeId id) const {
  if (id >= impl_->entries_.size()) return std::nullopt;
  const Impl::Entry& e = impl_->entries_[id];
  if (e.content == Impl::Content::kModelFile) return impl_->model_files_[e.model_file].source_file;
  const std::optional<uint32_t> passed = PassedSourceFile(id);
  if (!passed) return std::nullopt;
  const Segment& seg = impl_->segments_[e.first_segment];
  if (seg.source_offset != 0 || seg.length != source().files->size(*passed)) return std::nullopt;
  return passed;
}

bool View::IsModelFile(NodeId id) const {
  if (id >= impl_->entries_.size()) return false;
  return impl_->entries_[id].content == Impl::Content::kModelFile ||
         std::find(impl_->model_indexes_.begin(), impl_->model_indexes_.end(), id) != impl_->model_indexes_.end();
}

std::string View::PathOf(NodeId id) const {
  std::string path;
  while (id != kRoot) {
    path = NameOf(id) + (path.empty() ? "" : "/" + path);
    id = ParentOf(id);
  }
  return path;
}

Status View::Read(NodeId id, uint64_t offset, size_t length, char* out, size_t* nread) const {
  *nread = 0;
  if (IsDir(id)) return Status::InvalidArgument(PathOf(id), "is a directory");
  if (id >= impl_->entries_.size()) return ReadTensorFile(id, offset, length, out, nread);
  const uint64_t size = SizeOf(id);
  if (offset >= size || length == 0) return Status::OK();
  const uint64_t end = offset + std::min<uint64_t>(length, size - offset);
  switch (impl_->entries_[id].content) {
    case Impl::Content::kSegments:
      CKPTFS_RETURN_IF_ERROR(ReadSegments(id, offset, end, out));
      break;
    case Impl::Content::kModelFile:
      CKPTFS_RETURN_IF_ERROR(ReadModelFile(id, offset, end, out));
      break;
    case Impl::Content::kManifest:
      CKPTFS_RETURN_IF_ERROR(ReadManifest(id, offset, end, out));
      break;
  }
  *nread = end - offset;
  return Status::OK();
}

Status View::ReadSegments(NodeId id, uint64_t offset, uint64_t end, char* out) const {
  const Impl::Entry& n = impl_->entries_[id];
  const Segment* first = impl_->segments_.data() + n.first_segment;
  const Segment* last = first + n.segment_count;
  const Segment* seg = std::upper_bound(first, last, offset, [](uint64_t off, const Segment& s) { return off < s.start; }) - 1;
  uint64_t pos = offset;
  FileChecks checks(*source().files);
  for (; pos < end && seg < last; ++seg) {
    const uint64_t in_seg = pos - seg->start;
    const uint64_t piece = std::min(seg->length - in_seg, end - pos);
    char* dst = out + (pos - offset);
    switch (seg->kind) {
      case Segment::Kind::kLiteral:
        std::memcpy(dst, impl_->literals_[seg->ref].data() + in_seg, piece);
        break;
      case Segment::Kind::kExtent:
        CKPTFS_RETURN_IF_ERROR(checks.Check(seg->ref));
        CKPTFS_RETURN_IF_ERROR(source().files->ReadExact(seg->ref, seg->source_offset + in_seg, piece, dst));
        break;
    }
    pos += piece;
  }
  if (pos != end) return Status::Corruption(PathOf(id), "virtual file ended early");
  return Status::OK();
}

Status View::ReadTensorFile(NodeId id, uint64_t offset, size_t length, char* out, size_t* nread) const {
  const size_t index = id - impl_->first_tensor_file_;
  const ServedTensor t = impl_->served_[index];
  thread_local std::string header;
  header.clear();
  AppendTensorFileHeader(t, &header);
  const uint64_t data_size = t.nbytes();
  const uint64_t header_size = header.size();
  const uint64_t size = header_size + data_size;
  if (offset >= size || length == 0) return Status::OK();
  const uint64_t end = offset + std::min<uint64_t>(length, size - offset);
  uint64_t pos = offset;
  if (pos < header_size) {
    const uint64_t piece = std::min(header_size, end) - pos;
    std::memcpy(out, header.data() + pos, piece);
    pos += piece;
  }
  if (pos < end) CKPTFS_RETURN_IF_ERROR(ReadTensorData(index, pos - header_size, end - pos, out + (pos - offset)));
  *nread = end - offset;
  return Status::OK();
}

Status View::ReadStored(const TensorEntry& t, uint64_t offset, size_t length, char* out, FileChecks* shared) const {
  if (!StoredAsExtents(t)) return ReadGather(t, offset, length, out);
  // Each box is one run of the row-major bytes: read the part of each that the range meets.
  const std::vector<uint64_t> dims = TiledDims(t);
  const uint64_t itemsize = Info(t.dtype).itemsize, end = offset + length;
  std::optional<FileChecks> own;
  FileChecks& checks = shared ? *shared : own.emplace(*source().files);
  for (const Box& box : t.boxes) {
    const uint64_t begin = RowMajorPosition(box.offset, dims) * itemsize;
    const uint64_t lo = std::max(begin, offset), hi = std::min(begin + box.numel() * itemsize, end);
    if (lo >= hi) continue;
    CKPTFS_RETURN_IF_ERROR(checks.Check(box.file));
    CKPTFS_RETURN_IF_ERROR(source().files->ReadExact(box.file, box.base_offset + (lo - begin), hi - lo, out + (lo - offset)));
  }
  return Status::OK();
}

Status View::ReadConverted(const ServedTensor& t, uint64_t offset, size_t length, char* out) const {
  const DType from = t.stored_dtype(), to = t.dtype;
  const TensorEntry* entry = nullptr;
  CKPTFS_RETURN_IF_ERROR(t.Stored(&entry));
  const uint64_t in_size = Info(from).itemsize;
  // Per-thread buffers, reused by every read of this thread (FUSE workers live for the
  // mount): no allocation, and no page faults on fresh memory, per request.
  thread_local std::vector<char> stored, scratch;
  return ReadElementwise(offset, length, Info(to).itemsize, out, scratch, [&](uint64_t first, uint64_t count, char* dst) {
    const size_t need = count * in_size;
    if (stored.size() < need) stored.resize(need);
    CKPTFS_RETURN_IF_ERROR(ReadStored(*entry, first * in_size, need, stored.data()));
    ConvertElements(from, to, stored.data(), count, dst);
    return Status::OK();
  });
}

Status View::Xxh3(NodeId id, uint64_t* hash) const {
  XXH3_state_t* state = XXH3_createState();
  if (!state) return Status::InvalidArgument(PathOf(id), "out of memory");
  XXH3_64bits_reset(state);
  std::vector<char> buf(size_t{1} << 20);
  Status s;
  const uint64_t size = SizeOf(id);
  for (uint64_t off = 0; off < size;) {
    size_t n = 0;
    s = Read(id, off, buf.size(), buf.data(), &n);
    if (!s.ok()) break;
    if (n == 0) {
      s = Status::Corruption(PathOf(id), "virtual file ended early");
      break;
    }
    XXH3_64bits_update(state, buf.data(), n);
    off += n;
  }
  *hash = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return s;
}

Status View::ReadGather(const TensorEntry& t, uint64_t offset, size_t length, char* out) const {
  thread_local GatherBuffers buffers;
  thread_local std::vector<char> scratch;
  Gather gather(*source().files, t, &buffers);
  return ReadElementwise(offset, length, Info(t.dtype).itemsize, out, scratch,
                         [&](uint64_t first, uint64_t count, char* elems) { return gather.Read(first, count, elems); });
}

// The served bytes of a tensor's data, for the device loader (src/device/).
Status View::ReadTensorData(size_t tensor_index, uint64_t offset, size_t length, char* out) const {
  if (tensor_index >= impl_->served_.size())
    return Status::InvalidArgument(source().source, "tensor index " + std::to_string(tensor_index) + " out of range");
  const ServedTensor t = impl_->served_[tensor_index];
  const uint64_t size = t.nbytes();
  if (offset > size || length > size - offset)
    return Status::InvalidArgument(t.key(), "read of " + std::to_string(length) + " bytes at " + std::to_string(offset) +
                                              " is past the tensor's " + std::to_string(size) + " bytes");
  if (length == 0) return Status::OK();
  if (RouteOf(t) == ReadRoute::kConvert) return ReadConverted(t, offset, length, out);
  const TensorEntry* stored = nullptr;
  CKPTFS_RETURN_IF_ERROR(t.Stored(&stored));
  return ReadStored(*stored, offset, length, out);
}

}  // namespace ckptfs
