// Box operations of key maps (key_map_ops.hpp).
#include "map/key_map_ops.hpp"

#include <algorithm>

#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

bool DimFits(const Shape& shape, size_t dim, const char* op, std::string* why) {
  if (dim < shape.size()) return true;
  *why = std::string(op) + ": the tensor of shape " + ShapeText(shape) + " has no dimension " + std::to_string(dim);
  return false;
}

// The part of `box` (of a tensor's boxes) along dimension `dim` within [lo, hi), placed at
// `to` along that dimension of the result; false when they do not meet.
bool Clip(const Box& box, size_t dim, uint64_t lo, uint64_t hi, uint64_t to, uint64_t itemsize, Box* out) {
  const uint64_t begin = std::max(box.offset[dim], lo);
  const uint64_t end = std::min(box.offset[dim] + box.extent[dim], hi);
  if (begin >= end) return false;
  *out = box;
  out->base_offset = box.base_offset + (begin - box.offset[dim]) * box.strides[dim] * itemsize;
  out->offset[dim] = to + (begin - lo);
  out->extent[dim] = end - begin;
  return true;
}

}  // namespace

bool SelectShape(Shape* shape, size_t dim, uint64_t index, std::string* why) {
  if (!DimFits(*shape, dim, "select", why)) return false;
  if (index >= (*shape)[dim]) {
    *why = "select: index " + std::to_string(index) + " of dimension " + std::to_string(dim) + " of shape " +
           ShapeText(*shape) + " is out of range";
    return false;
  }
  Shape out;
  for (size_t d = 0; d < shape->size(); ++d)
    if (d != dim) out.push_back((*shape)[d]);
  *shape = std::move(out);
  return true;
}

bool SliceShape(Shape* shape, size_t dim, uint64_t start, uint64_t stop, std::string* why) {
  if (!DimFits(*shape, dim, "slice", why)) return false;
  if (start > stop || stop > (*shape)[dim]) {
    *why = "slice: [" + std::to_string(start) + ", " + std::to_string(stop) + ") of dimension " + std::to_string(dim) +
           " of shape " + ShapeText(*shape) + " is out of range";
    return false;
  }
  (*shape)[dim] = stop - start;
  return true;
}

bool RowGroupsShape(Shape* shape, size_t dim, uint64_t groups, uint64_t size, uint64_t start, uint64_t stop,
                    std::string* why) {
  if (!DimFits(*shape, dim, "row_groups", why)) return false;
  uint64_t total;
  if (groups == 0 || size == 0 || !CheckedMul(groups, size, &total) || total != (*shape)[dim]) {
    *why = "row_groups: dimension " + std::to_string(dim) + " of shape " + ShapeText(*shape) + " is " +
           std::to_string((*shape)[dim]) + " long, not groups * size = " + std::to_string(groups) + " * " +
           std::to_string(size) + " = " + (CheckedMul(groups, size, &total) ? std::to_string(total) : "(overflow)");
    return false;
  }
  if (start >= stop || stop > size) {
    *why = "row_groups: rows [" + std::to_string(start) + ", " + std::to_string(stop) + ") do not lie in a group of " +
           std::to_string(size);
    return false;
  }
  (*shape)[dim] = groups * (stop - start);
  return true;
}

bool TransposeShape(Shape* shape, size_t a, size_t b, std::string* why) {
  if (!DimFits(*shape, a, "transpose", why) || !DimFits(*shape, b, "transpose", why)) return false;
  std::swap((*shape)[a], (*shape)[b]);
  return true;
}

bool ConcatShape(const std::vector<Shape>& parts, size_t dim, Shape* out, std::string* why) {
  if (parts.empty()) {
    *why = "concat: no parts";
    return false;
  }
  if (!DimFits(parts[0], dim, "concat", why)) return false;
  *out = parts[0];
  uint64_t at = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const Shape& part = parts[p];
    bool same = part.size() == out->size();
    for (size_t d = 0; same && d < part.size(); ++d) same = d == dim || part[d] == (*out)[d];
    if (!same) {
      *why = "concat: part " + std::to_string(p) + " of shape " + ShapeText(part) + " does not join part 0 of shape " +
             ShapeText(parts[0]) + " along dimension " + std::to_string(dim);
      return false;
    }
    if (!CheckedAdd(at, part[dim], &at)) {
      *why = "concat: the parts' lengths along dimension " + std::to_string(dim) + " overflow";
      return false;
    }
  }
  (*out)[dim] = at;
  return true;
}

Status ToBoxedTensor(const TensorEntry& t, size_t max_boxes, BoxedTensor* out) {
  out->shape = t.shape;
  out->itemsize = Info(t.dtype).itemsize;
  out->boxes.clear();
  const size_t rank = t.shape.size();
  for (const Box& box : t.boxes) {
    if (box.numel() == 0) continue;
    if (box.rank() == rank || rank == 0) {
      out->boxes.push_back(box);
      continue;
    }
    // A range of row-major elements [pos, end): cut into blocks, each the largest aligned
    // one that starts at pos (at most 2 * rank of them).
    std::vector<uint64_t> pitch(rank, 1);
    for (size_t d = rank; d-- > 1;) pitch[d - 1] = pitch[d] * t.shape[d];
    uint64_t pos = box.offset[0];
    const uint64_t first = pos, end = pos + box.extent[0];
    while (pos < end) {
      size_t level = rank - 1;
      for (size_t d = 0; d < rank; ++d)
        if (pos % pitch[d] == 0 && pos + pitch[d] <= end) {
          level = d;
          break;
        }
      const uint64_t index_at_level = (pos / pitch[level]) % t.shape[level];
      const uint64_t count = std::min((end - pos) / pitch[level], t.shape[level] - index_at_level);
      Box block;
      block.file = box.file;
      block.base_offset = box.base_offset + (pos - first) * box.strides[0] * out->itemsize;
      uint64_t rest = pos;
      block.offset.resize(rank);
      for (size_t d = rank; d-- > 0;) {
        block.offset[d] = rest % t.shape[d];
        rest /= t.shape[d];
      }
      for (size_t d = 0; d < rank; ++d) {
        block.extent.push_back(d < level ? 1 : d == level ? count : t.shape[d]);
        block.strides.push_back(pitch[d] * box.strides[0]);
      }
      out->boxes.push_back(std::move(block));
      if (out->boxes.size() > max_boxes)
        return Status::NotSupported("", "its stored ranges make more than " + std::to_string(max_boxes) + " blocks");
      pos += count * pitch[level];
    }
  }
  return Status::OK();
}

BoxOrder OrderAlong(const BoxedTensor& t, size_t dim) {
  BoxOrder order;
  order.dim = dim;
  if (dim >= t.shape.size()) return order;
  order.by_start.resize(t.boxes.size());
  for (size_t k = 0; k < t.boxes.size(); ++k) {
    order.by_start[k] = static_cast<uint32_t>(k);
    order.longest = std::max(order.longest, t.boxes[k].extent[dim]);
  }
  std::stable_sort(order.by_start.begin(), order.by_start.end(),
                   [&](uint32_t a, uint32_t b) { return t.boxes[a].offset[dim] < t.boxes[b].offset[dim]; });
  return order;
}

bool SelectIndexOf(const BoxedTensor& t, size_t dim, uint64_t index, BoxedTensor* out, std::string* why,
                   const BoxOrder* order) {
  Shape shape = t.shape;
  if (!SelectShape(&shape, dim, index, why)) return false;
  out->itemsize = t.itemsize;
  out->shape = std::move(shape);
  out->boxes.clear();
  // Only the boxes that hold the index are copied (a stacked tensor has one or more per
  // layer, and every layer is selected in turn): with an order, those starting in
  // (index - longest, index].
  auto copy = [&](const Box& box) {
    if (index < box.offset[dim] || index - box.offset[dim] >= box.extent[dim]) return;
    Box& piece = out->boxes.emplace_back();
    piece.file = box.file;
    piece.base_offset = box.base_offset + (index - box.offset[dim]) * box.strides[dim] * t.itemsize;
    for (size_t d = 0; d < box.rank(); ++d) {
      if (d == dim) continue;
      piece.offset.push_back(box.offset[d]);
      piece.extent.push_back(box.extent[d]);
      piece.strides.push_back(box.strides[d]);
    }
  };
  if (order && order->dim == dim && order->by_start.size() == t.boxes.size()) {
    const uint64_t from = index >= order->longest ? index - order->longest + 1 : 0;
    auto start = [&](uint32_t k) { return t.boxes[k].offset[dim]; };
    auto first = std::lower_bound(order->by_start.begin(), order->by_start.end(), from,
                                  [&](uint32_t k, uint64_t v) { return start(k) < v; });
    auto last = std::upper_bound(first, order->by_start.end(), index, [&](uint64_t v, uint32_t k) { return v < start(k); });
    for (auto it = first; it != last; ++it) copy(t.boxes[*it]);
  } else {
    for (const Box& box : t.boxes) copy(box);
  }
  return true;
}

bool SelectIndex(BoxedTensor* t, size_t dim, uint64_t index, std::string* why) {
  BoxedTensor out;
  if (!SelectIndexOf(*t, dim, index, &out, why)) return false;
  *t = std::move(out);
  return true;
}

bool SliceDim(BoxedTensor* t, size_t dim, uint64_t start, uint64_t stop, std::string* why) {
  Shape shape = t->shape;
  if (!SliceShape(&shape, dim, start, stop, why)) return false;
  // In place: a box is clipped or dropped, never more than one piece.
  size_t kept = 0;
  for (size_t k = 0; k < t->boxes.size(); ++k) {
    Box& box = t->boxes[k];
    const uint64_t begin = std::max(box.offset[dim], start);
    const uint64_t end = std::min(box.offset[dim] + box.extent[dim], stop);
    if (begin >= end) continue;
    box.base_offset += (begin - box.offset[dim]) * box.strides[dim] * t->itemsize;
    box.offset[dim] = begin - start;
    box.extent[dim] = end - begin;
    if (kept != k) t->boxes[kept] = std::move(box);
    ++kept;
  }
  t->boxes.resize(kept);
  t->shape = std::move(shape);
  return true;
}

bool RowGroups(BoxedTensor* t, size_t dim, uint64_t groups, uint64_t size, uint64_t start, uint64_t stop,
               std::string* why) {
  Shape shape = t->shape;
  if (!RowGroupsShape(&shape, dim, groups, size, start, stop, why)) return false;
  const uint64_t width = stop - start;
  std::vector<Box> kept;
  for (const Box& box : t->boxes) {
    // Only the groups this box meets.
    const uint64_t first_group = box.offset[dim] / size;
    const uint64_t last_group = (box.offset[dim] + box.extent[dim] - 1) / size;
    for (uint64_t g = first_group; g <= last_group && g < groups; ++g) {
      Box piece;
      if (Clip(box, dim, g * size + start, g * size + stop, g * width, t->itemsize, &piece)) kept.push_back(std::move(piece));
      if (kept.size() > kMaxRowGroupPieces) {
        *why = "row_groups: " + std::to_string(groups) + " groups cut the tensor's boxes into more than " +
               std::to_string(kMaxRowGroupPieces) + " pieces";
        return false;
      }
    }
  }
  t->boxes = std::move(kept);
  t->shape = std::move(shape);
  return true;
}

bool Transpose(BoxedTensor* t, size_t a, size_t b, std::string* why) {
  if (!TransposeShape(&t->shape, a, b, why)) return false;
  for (Box& box : t->boxes) {
    std::swap(box.offset[a], box.offset[b]);
    std::swap(box.extent[a], box.extent[b]);
    std::swap(box.strides[a], box.strides[b]);
  }
  return true;
}

bool Concat(std::vector<BoxedTensor>& parts, size_t dim, BoxedTensor* out, std::string* why) {
  std::vector<Shape> shapes;
  for (const BoxedTensor& part : parts) shapes.push_back(part.shape);
  Shape shape;
  if (!ConcatShape(shapes, dim, &shape, why)) return false;
  for (size_t p = 0; p < parts.size(); ++p)
    if (parts[p].itemsize != parts[0].itemsize) {
      *why = "concat: part " + std::to_string(p) + " has elements of " + std::to_string(parts[p].itemsize) +
             " bytes, part 0 of " + std::to_string(parts[0].itemsize);
      return false;
    }
  out->shape = std::move(shape);
  out->itemsize = parts[0].itemsize;
  out->boxes.clear();
  uint64_t at = 0;
  for (BoxedTensor& part : parts) {
    for (Box& box : part.boxes) {
      box.offset[dim] += at;
      out->boxes.push_back(std::move(box));
    }
    at += part.shape[dim];
  }
  return true;
}

}  // namespace ckptfs
