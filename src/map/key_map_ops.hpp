// The operations of a key map (doc/MAPS.md) on a tensor's boxes: each takes a block of a
// tensor as boxes of the source files and gives another block of the same bytes, so what a
// map serves is still a set of sub-boxes of the source's (the sub-box invariant of
// transform.hpp). No operation reads or copies a tensor byte.
#ifndef CKPTFS_MAP_KEY_MAP_OPS_HPP_
#define CKPTFS_MAP_KEY_MAP_OPS_HPP_

#include <cstdint>
#include <string>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// A tensor as a map works on it: its shape and boxes of the same rank that tile it.
struct BoxedTensor {
  Shape shape;
  std::vector<Box> boxes;
  uint64_t itemsize = 1;
};

// The boxes of `t` with the rank of its shape: boxes that tile its flattened elements (rank
// 1, a range of row-major elements) become the few blocks of the shape that range covers.
// Refused (the error's text only; the caller names the tensor) when that takes more than
// `max_boxes` boxes.
Status ToBoxedTensor(const TensorEntry& t, size_t max_boxes, BoxedTensor* out);

// Each operation is given on shapes alone (a key map lays out its tensors from their shapes
// and makes their boxes on first use) and on boxes; the box form checks the shape through
// the shape form first, so both refuse the same shapes with the same words. Each returns
// false with *why set when the operation does not fit.
bool SelectShape(Shape* shape, size_t dim, uint64_t index, std::string* why);
bool SliceShape(Shape* shape, size_t dim, uint64_t start, uint64_t stop, std::string* why);
bool RowGroupsShape(Shape* shape, size_t dim, uint64_t groups, uint64_t size, uint64_t start, uint64_t stop,
                    std::string* why);
bool TransposeShape(Shape* shape, size_t a, size_t b, std::string* why);
// `parts` (their element sizes equal) joined along `dim`.
bool ConcatShape(const std::vector<Shape>& parts, size_t dim, Shape* out, std::string* why);

// Index `index` of dimension `dim`, that dimension removed.
bool SelectIndex(BoxedTensor* t, size_t dim, uint64_t index, std::string* why);
// The boxes of a tensor ordered by where they start along one dimension, and the longest of
// them there: the boxes holding an index are then found by binary search (a stacked tensor of
// many chunks, one layer selected at a time).
struct BoxOrder {
  size_t dim = 0;
  std::vector<uint32_t> by_start;
  uint64_t longest = 0;
};
BoxOrder OrderAlong(const BoxedTensor& t, size_t dim);
// The same into *out, `t` unchanged: only the boxes holding the index are copied (found through
// `order` when given, made by OrderAlong(t, dim)).
bool SelectIndexOf(const BoxedTensor& t, size_t dim, uint64_t index, BoxedTensor* out, std::string* why,
                   const BoxOrder* order = nullptr);
// Elements [start, stop) of dimension `dim`.
bool SliceDim(BoxedTensor* t, size_t dim, uint64_t start, uint64_t stop, std::string* why);
// Dimension `dim` is `groups` groups of `size`; keeps [g*size + start, g*size + stop) of each
// group g, in order. Refused when that cuts the boxes into more than kMaxRowGroupPieces.
inline constexpr size_t kMaxRowGroupPieces = size_t{1} << 20;
bool RowGroups(BoxedTensor* t, size_t dim, uint64_t groups, uint64_t size, uint64_t start, uint64_t stop,
               std::string* why);
// Dimensions `a` and `b` swapped (each box's strides with them: still a box of the bytes).
bool Transpose(BoxedTensor* t, size_t a, size_t b, std::string* why);
// `parts` joined along `dim` (their other dimensions equal), into *out.
bool Concat(std::vector<BoxedTensor>& parts, size_t dim, BoxedTensor* out, std::string* why);


}  // namespace ckptfs

#endif  // CKPTFS_MAP_KEY_MAP_OPS_HPP_
