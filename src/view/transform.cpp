// The transform registry, ApplyViewOptions, and the check of the sub-box invariant
// (transform.hpp).
#include "view/transform.hpp"

#include <algorithm>
#include <numeric>
#include <unordered_map>

#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

// In the order they apply: the selection first, so later transforms see only what is served.
// The map after the selection and before the conversion: it maps stored tensors, and a
// dtype view converts what it serves.
constexpr TransformEntry kTransforms[] = {
    {"root", MakeRootTransform},
    {"map", MakeMapTransform},
    {"dtype", MakeDTypeTransform},
};

// Matches the dimensions of `box` (those with more than one element, in `dims`) from `next`
// on to distinct dimensions of `of` with the same stride and room for them.
bool MatchDims(const Box& box, const Box& of, const std::vector<size_t>& dims, size_t next, std::vector<int>* match,
               std::vector<bool>* used) {
  if (next == dims.size()) return true;
  const size_t j = dims[next];
  for (size_t d = 0; d < of.rank(); ++d) {
    if ((*used)[d] || of.strides[d] != box.strides[j] || of.extent[d] < box.extent[j]) continue;
    (*used)[d] = true;
    (*match)[d] = static_cast<int>(j);
    if (MatchDims(box, of, dims, next + 1, match, used)) return true;
    (*used)[d] = false;
    (*match)[d] = -1;
  }
  return false;
}

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

// Whether `t` is one box of its shape's rank at the origin with the shape's extents.
bool CoversShape(const TensorEntry& t) {
  if (t.boxes.size() != 1) return false;
  const Box& box = t.boxes[0];
  if (box.rank() != t.shape.size() || box.offset.size() != box.rank() || box.strides.size() != box.rank()) return false;
  for (size_t d = 0; d < box.rank(); ++d)
    if (box.offset[d] != 0 || box.extent[d] != t.shape[d]) return false;
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

bool IsViewOfBox(const Box& box, const Box& of, uint64_t itemsize) {
  if (box.numel() == 0) return true;
  if (box.rank() == of.rank() && IsSubBox(box, of, itemsize)) return true;
  if (box.file != of.file || itemsize == 0 || box.offset.size() != box.rank() || box.strides.size() != box.rank() ||
      of.offset.size() != of.rank() || of.strides.size() != of.rank())
    return false;
  if (of.rank() == 1 && of.strides[0] == 1) {
    // Any block of a contiguous range: its first and last element within the range.
    uint64_t span = 0, term;
    for (size_t d = 0; d < box.rank(); ++d) {
      if (!CheckedMul(box.extent[d] - 1, box.strides[d], &term) || !CheckedAdd(span, term, &span)) return false;
    }
    if (box.base_offset < of.base_offset || (box.base_offset - of.base_offset) % itemsize != 0) return false;
    const uint64_t first = (box.base_offset - of.base_offset) / itemsize;
    uint64_t last;
    return CheckedAdd(first, span, &last) && last < of.extent[0];
  }
  std::vector<size_t> dims;
  for (size_t j = 0; j < box.rank(); ++j)
    if (box.extent[j] != 1) dims.push_back(j);
  if (dims.size() > of.rank()) return false;
  std::vector<int> match(of.rank(), -1);
  std::vector<bool> used(of.rank(), false);
  if (!MatchDims(box, of, dims, 0, &match, &used)) return false;
  // The box in `of`'s dimensions: matched ones as the box has them, the others one element.
  Box as_of;
  as_of.file = box.file;
  as_of.base_offset = box.base_offset;
  for (size_t d = 0; d < of.rank(); ++d) {
    as_of.offset.push_back(0);
    as_of.extent.push_back(match[d] < 0 ? 1 : box.extent[match[d]]);
    as_of.strides.push_back(of.strides[d]);
  }
  return IsSubBox(as_of, of, itemsize);
}

namespace {

// Per source tensor of many boxes: its boxes' indices by (file, base offset), made once.
class BoxesByOffset {
 public:
  const std::vector<uint32_t>& Of(const TensorEntry& of) {
    auto [it, made] = sorted_.try_emplace(&of);
    if (made) {
      it->second.resize(of.boxes.size());
      for (size_t k = 0; k < of.boxes.size(); ++k) it->second[k] = static_cast<uint32_t>(k);
      std::sort(it->second.begin(), it->second.end(), [&](uint32_t a, uint32_t b) {
        const Box &x = of.boxes[a], &y = of.boxes[b];
        return x.file != y.file ? x.file < y.file : x.base_offset < y.base_offset;
      });
    }
    return it->second;
  }

 private:
  std::unordered_map<const TensorEntry*, std::vector<uint32_t>> sorted_;
};

Status CheckEntry(const Catalog& source, const TensorEntry& t, size_t s, std::span<const uint32_t> others,
                  const char* transform, BoxesByOffset* by_offset) {
  if (s >= source.tensors.size())
    return Status::Corruption(source.source, std::string("view transform ") + transform + ": tensor '" + t.key +
                                                 "' names no source tensor");
  const TensorEntry& from = source.tensors[s];
  // Made only for a refusal: this runs once per served tensor.
  auto what = [&] { return std::string("view transform ") + transform + ": tensor '" + t.key + "' of '" + from.key + "'"; };
  if (t.dtype != from.dtype) return Status::Corruption(source.source, what() + " changes the stored dtype");
  if (SameLayout(t, from)) return Status::OK();
  const uint64_t itemsize = Info(t.dtype).itemsize;
  for (uint32_t o : others) {
    if (o >= source.tensors.size() || source.tensors[o].dtype != t.dtype)
      return Status::Corruption(source.source, what() + " names another source tensor of another dtype or none");
  }
  auto within = [&](const Box& box, const TensorEntry& of) {
    // A stacked tensor's many chunks (a layer per tensor-parallel rank, each served tensor a
    // layer of them): first the chunk of that file starting nearest below the box, the one
    // whose bytes hold its first element when chunks do not interleave; else all of them.
    if (of.boxes.size() > 8 && by_offset) {
      const std::vector<uint32_t>& order = by_offset->Of(of);
      auto at = std::upper_bound(order.begin(), order.end(), box, [&](const Box& b, uint32_t k) {
        const Box& o = of.boxes[k];
        return b.file != o.file ? b.file < o.file : b.base_offset < o.base_offset;
      });
      if (at != order.begin() && IsViewOfBox(box, of.boxes[*(at - 1)], itemsize)) return true;
    }
    return std::any_of(of.boxes.begin(), of.boxes.end(), [&](const Box& b) { return IsViewOfBox(box, b, itemsize); });
  };
  for (size_t k = 0; k < t.boxes.size(); ++k) {
    const Box& box = t.boxes[k];
    if (!within(box, from) &&
        !std::any_of(others.begin(), others.end(), [&](uint32_t o) { return within(box, source.tensors[o]); }))
      return Status::Corruption(source.source, what() + ": box " + std::to_string(k) + " is not a sub-box of the source's");
  }
  // Every box is a view of a validated source box, so its elements lie in its file; what is
  // left is the tiling. One box over the whole shape tiles it (nearly every mapped tensor:
  // a renamed, unstacked or sliced one), checked here in O(rank) instead of ValidateLayout.
  if (CoversShape(t)) return Status::OK();
  return ValidateLayout(t, *source.files, source.source);
}

}  // namespace

Status CheckServedEntry(const Catalog& source, const TensorEntry& t, size_t source_index, std::span<const uint32_t> others,
                        const char* transform) {
  return CheckEntry(source, t, source_index, others, transform, nullptr);
}

Status CheckSubBoxInvariant(const ServedTensors& served, const char* transform) {
  // Deferred tensors are checked as each is made (ServedTensors::Stored).
  if (served.SharesSourceEntries() || served.deferred()) return Status::OK();
  BoxesByOffset by_offset;
  for (size_t i = 0; i < served.size(); ++i) {
    const TensorEntry* t = nullptr;
    CKPTFS_RETURN_IF_ERROR(served.Stored(i, &t));
    CKPTFS_RETURN_IF_ERROR(CheckEntry(served.source(), *t, served.source_index(i), served.other_sources(i), transform, &by_offset));
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
