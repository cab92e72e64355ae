// The transform registry, ApplyViewOptions, and the check of the sub-box invariant
// (transform.hpp).
#include "view/transform.hpp"

#include <algorithm>
#include <numeric>

namespace ckptfs {
namespace {

// In the order they apply: the selection first, so later transforms see only what is served.
constexpr TransformEntry kTransforms[] = {
    {"root", MakeRootTransform},
    {"dtype", MakeDTypeTransform},
};

bool SameBox(const Box& a, const Box& b) {
  return a.file == b.file && a.base_offset == b.base_offset && a.offset == b.offset && a.extent == b.extent &&
         a.strides == b.strides;
}

bool SameLayout(const TensorEntry& a, const TensorEntry& b) {
  if (a.shape != b.shape || a.boxes.size() != b.boxes.size()) return false;
  for (size_t k = 0; k < a.boxes.size(); ++k)
    if (!SameBox(a.boxes[k], b.boxes[k])) return false;
  return true;
}

}  // namespace

std::span<const TransformEntry> Transforms() { return kTransforms; }

bool IsSubBox(const Box& box, const Box& of, uint64_t itemsize) {
  if (box.numel() == 0) return true;
  const size_t rank = box.rank();
  if (box.file != of.file || of.rank() != rank || box.offset.size() != rank || box.strides.size() != rank ||
      of.strides.size() != rank || itemsize == 0)
    return false;
  for (size_t d = 0; d < rank; ++d)
    if (box.strides[d] != of.strides[d] || box.extent[d] > of.extent[d]) return false;
  if (box.base_offset < of.base_offset || (box.base_offset - of.base_offset) % itemsize != 0) return false;
  // The block's first element, box-relative to `of`: the element distance split over the
  // dimensions, largest stride first.
  uint64_t rest = (box.base_offset - of.base_offset) / itemsize;
  std::vector<size_t> order(rank);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return of.strides[a] > of.strides[b]; });
  for (size_t d : order) {
    if (of.strides[d] == 0) continue;
    const uint64_t start = rest / of.strides[d];
    if (start > of.extent[d] - box.extent[d]) return false;
    rest -= start * of.strides[d];
  }
  return rest == 0;
}

Status CheckSubBoxInvariant(const ServedTensors& served, const char* transform) {
  const Catalog& source = served.source();
  if (served.SharesSourceEntries()) return Status::OK();
  for (size_t i = 0; i < served.size(); ++i) {
    const TensorEntry& t = served[i].stored;
    const size_t s = served.source_index(i);
    if (s >= source.tensors.size())
      return Status::Corruption(source.source, std::string("view transform ") + transform + ": tensor '" + t.key +
                                                   "' names no source tensor");
    const TensorEntry& from = source.tensors[s];
    const std::string what = std::string("view transform ") + transform + ": tensor '" + t.key + "' of '" + from.key + "'";
    if (t.dtype != from.dtype) return Status::Corruption(source.source, what + " changes the stored dtype");
    if (SameLayout(t, from)) continue;
    const uint64_t itemsize = Info(t.dtype).itemsize;
    for (size_t k = 0; k < t.boxes.size(); ++k) {
      const Box& box = t.boxes[k];
      if (!std::any_of(from.boxes.begin(), from.boxes.end(), [&](const Box& of) { return IsSubBox(box, of, itemsize); }))
        return Status::Corruption(source.source, what + ": box " + std::to_string(k) + " is not a sub-box of the source's");
    }
    CKPTFS_RETURN_IF_ERROR(ValidateLayout(t, *source.files, source.source));
  }
  return Status::OK();
}

Status ApplyViewOptions(std::shared_ptr<const Catalog> catalog, const ViewOptions& options, ServedTensors* out) {
  ServedTensors served(std::move(catalog));
  for (const TransformEntry& entry : Transforms()) {
    const std::unique_ptr<Transform> transform = entry.make(options);
    if (!transform) continue;
    CKPTFS_RETURN_IF_ERROR(transform->Apply(&served));
    CKPTFS_RETURN_IF_ERROR(CheckSubBoxInvariant(served, entry.name));
  }
  *out = std::move(served);
  return Status::OK();
}

}  // namespace ckptfs
