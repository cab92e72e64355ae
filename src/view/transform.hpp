// View transforms: the stage between the catalog and the layout that decides what a view
// serves.
//
// A catalog describes a source; a view serves tensors made from it. Each view option that
// changes what is served (`root`, `dtype`; later key maps and slices) is one Transform, in a
// file of its own, listed once in the registry (transform.cpp). ApplyViewOptions starts from
// every catalog tensor as stored and applies the transforms the options ask for, in registry
// order; the layout (layout.cpp) then lays the result out as files. Neither the View nor a
// front end names a transform.
//
// The sub-box invariant: a transform maps tensors to tensors, and every box of a served
// tensor is a sub-box of a box of the one source tensor it serves elements of (IsSubBox):
// same file, same strides, a block of that box's elements where that box stores them. A
// served tensor's stored dtype is its source tensor's (a conversion changes the served
// dtype only). So a view reads no byte the catalog did not validate (ValidateLayout), and
// however transforms combine, the layout and every read route stay those of boxes.
// ApplyViewOptions checks the invariant after each transform (CheckSubBoxInvariant); a
// transform that defers its entries (DeferredTensors, a key map's) has each checked
// as it is made (CheckServedEntry).
#ifndef CKPTFS_VIEW_TRANSFORM_HPP_
#define CKPTFS_VIEW_TRANSFORM_HPP_

#include <memory>
#include <span>

#include "ckptfs/view.hpp"
#include "view/served_edit.hpp"

namespace ckptfs {

class Transform {
 public:
  virtual ~Transform() = default;
  // Maps the tensors served so far to those served next, through a ServedTensorsEditor
  // (served_edit.hpp): a new set (Replace: a selection, new keys, sub-boxes; ReplaceDeferred),
  // served dtypes (SetDType), the metadata served (SetMetadata), and what manifest.json
  // records of it (mutable_manifest_fields).
  virtual Status Apply(ServedTensors* served) const = 0;
};

// One entry of the registry: a transform and the view options that ask for it.
struct TransformEntry {
  const char* name;
  // The transform `options` ask for, or null when they ask for none.
  std::unique_ptr<Transform> (*make)(const ViewOptions& options);
};

// Every transform, in the order they apply.
std::span<const TransformEntry> Transforms();

// The transforms' makers, one per transform file.
std::unique_ptr<Transform> MakeRootTransform(const ViewOptions& options);   // transform_root.cpp
std::unique_ptr<Transform> MakeDTypeTransform(const ViewOptions& options);  // transform_dtype.cpp
std::unique_ptr<Transform> MakeMapTransform(const ViewOptions& options);    // transform_map.cpp

// Whether `box` is a sub-box of `of`, for elements of `itemsize` bytes: the same file, rank
// and strides, no larger along any dimension, and its base at the element of `of` where its
// block starts (a block of `of`'s elements, stored where `of` stores them). Where the block
// starts is found by dividing the byte distance by the strides, largest first, which is
// exact for strides that nest (row-major, permuted and sliced layouts). A box without
// elements is a sub-box of any box.
bool IsSubBox(const Box& box, const Box& of, uint64_t itemsize);

// Whether `box` reads only elements of `of` as a view of them: a sub-box (IsSubBox), or
// one with fewer or reordered dimensions (a key map's selected index, transpose) whose
// dimensions match dimensions of `of` with the same strides, or any block of the elements
// of a contiguous range (`of` of rank 1, stride 1).
bool IsViewOfBox(const Box& box, const Box& of, uint64_t itemsize);

// Checks the sub-box invariant for every served tensor once a transform replaced the
// catalog's entries: its stored dtype is the source's, each of its boxes is a view of a box of its
// source tensors (IsViewOfBox), and a changed shape or set of boxes still tiles the served shape
// (ValidateLayout). The error names `transform`.
// A set of deferred tensors (DeferredTensors) is checked tensor by tensor as each is
// made, through CheckServedEntry.
Status CheckSubBoxInvariant(const ServedTensors& served, const char* transform);
// The same for one served entry `t`, made from source tensor `source_index` and `others` of
// `source`.
Status CheckServedEntry(const Catalog& source, const TensorEntry& t, size_t source_index, std::span<const uint32_t> others,
                        const char* transform);

}  // namespace ckptfs

#endif  // CKPTFS_VIEW_TRANSFORM_HPP_
