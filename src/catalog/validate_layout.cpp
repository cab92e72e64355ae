// ValidateLayout: a tensor's boxes tile it exactly and stay inside their files, so that
// every reader of the layout (View, device plan) may trust it.
#include <algorithm>

#include "catalog/tiling.hpp"
#include "ckptfs/catalog.hpp"
#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

// The tiling check marks the cells of the grid that all boxes' edges cut the tensor into.
// Sharded layouts make grids of about one cell per box (ZeRO-3 at 256 ranks, DCP meshes);
// boxes cut at unrelated places make far more, and beyond this bound the check refuses.
constexpr uint64_t kMaxTilingCells = uint64_t{1} << 22;
// The widest element of any dtype: a tensor's size must fit in 64 bits whatever the view
// converts it to.
constexpr uint64_t kWidestItem = 16;

// "[0:4, 2:3]": the index ranges of one cell of the grid.
std::string DescribeCell(const std::vector<std::vector<uint64_t>>& cuts, const std::vector<size_t>& cell) {
  std::string text = "[";
  for (size_t d = 0; d < cell.size(); ++d) {
    if (d) text += ", ";
    text += std::to_string(cuts[d][cell[d]]) + ":" + std::to_string(cuts[d][cell[d] + 1]);
  }
  return text + "]";
}

class LayoutCheck {
 public:
  LayoutCheck(const TensorEntry& tensor, const SourceFiles& files, const std::string& source)
      : tensor_(tensor), files_(files), source_(source) {}

  Status Run();

 private:
  Status Bad(const std::string& what) const {
    return Status::Corruption(source_, "tensor '" + tensor_.key + "': " + what);
  }
  Status CheckBox(size_t i) const;
  Status CheckTiling() const;

  const TensorEntry& tensor_;
  const SourceFiles& files_;
  const std::string& source_;
  // What the boxes tile (TiledDims); inline: a std::vector would be an allocation for
  // every tensor of a catalog.
  Shape dims_;
};

Status LayoutCheck::Run() {
  uint64_t numel = 1, widest;
  for (uint64_t d : tensor_.shape)
    if (!CheckedMul(numel, d, &numel)) return Bad("shape overflows");
  if (!CheckedMul(numel, kWidestItem, &widest)) return Bad("shape overflows");
  TiledDims(tensor_, &dims_);
  for (size_t i = 0; i < tensor_.boxes.size(); ++i) CKPTFS_RETURN_IF_ERROR(CheckBox(i));
  return CheckTiling();
}

Status LayoutCheck::CheckBox(size_t i) const {
  const Box& box = tensor_.boxes[i];
  auto name = [i] { return "box " + std::to_string(i); };
  if (box.offset.size() != box.rank() || box.strides.size() != box.rank())
    return Bad(name() + " has " + std::to_string(box.offset.size()) + " offsets, " + std::to_string(box.rank()) +
               " extents and " + std::to_string(box.strides.size()) + " strides");
  if (box.rank() != dims_.size()) {
    const std::string tiles = "boxes tile the shape (rank " + std::to_string(tensor_.shape.size()) +
                              ") or the flattened elements (rank 1)";
    if (i == 0) return Bad(name() + " has rank " + std::to_string(box.rank()) + "; " + tiles);
    return Bad("boxes have mixed ranks (box 0: " + std::to_string(tensor_.boxes[0].rank()) + ", " + name() + ": " +
               std::to_string(box.rank()) + "); " + tiles);
  }
  for (size_t d = 0; d < box.rank(); ++d) {
    uint64_t end;
    if (!CheckedAdd(box.offset[d], box.extent[d], &end) || end > dims_[d]) return Bad(name() + " lies outside the shape");
  }
  if (box.file >= files_.count())
    return Bad(name() + " names source file " + std::to_string(box.file) + " of " + std::to_string(files_.count()));
  if (box.numel() == 0) return Status::OK();
  // The element furthest into the file is the one at the last index along every dimension.
  uint64_t last = 0;
  for (size_t d = 0; d < box.rank(); ++d) {
    uint64_t span;
    if (!CheckedMul(box.extent[d] - 1, box.strides[d], &span) || !CheckedAdd(last, span, &last))
      return Bad(name() + ": strides overflow");
  }
  uint64_t end;
  if (!CheckedAdd(last, 1, &end) || !CheckedMul(end, Info(tensor_.dtype).itemsize, &end) ||
      !CheckedAdd(end, box.base_offset, &end))
    return Bad(name() + ": strides overflow");
  if (end > files_.size(box.file))
    return Bad(name() + " reads past the end of " + files_.path(box.file) + " (" + std::to_string(files_.size(box.file)) +
               " bytes)");
  return Status::OK();
}

// Every box lies inside the dims (CheckBox); they tile them when no cell of the grid cut by
// all their edges is covered twice or not at all.
Status LayoutCheck::CheckTiling() const {
  const size_t rank = dims_.size();
  // Most tensors are one box over all of them.
  if (tensor_.boxes.size() == 1 && std::equal(tensor_.boxes[0].extent.begin(), tensor_.boxes[0].extent.end(),
                                             dims_.begin(), dims_.end()))
    return Status::OK();
  std::vector<size_t> boxes;  // the non-empty ones
  for (size_t i = 0; i < tensor_.boxes.size(); ++i)
    if (tensor_.boxes[i].numel() > 0) boxes.push_back(i);

  std::vector<std::vector<uint64_t>> cuts(rank);
  for (size_t d = 0; d < rank; ++d) {
    cuts[d] = {0, dims_[d]};
    for (size_t i : boxes) {
      cuts[d].push_back(tensor_.boxes[i].offset[d]);
      cuts[d].push_back(tensor_.boxes[i].offset[d] + tensor_.boxes[i].extent[d]);
    }
    std::sort(cuts[d].begin(), cuts[d].end());
    cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
    if (cuts[d].size() < 2) return Status::OK();  // a zero-length dimension: nothing to cover
  }
  // Cell strides of the grid, row-major.
  std::vector<uint64_t> cell_stride(rank);
  uint64_t cells = 1;
  for (size_t d = rank; d-- > 0;) {
    cell_stride[d] = cells;
    if (!CheckedMul(cells, cuts[d].size() - 1, &cells) || cells > kMaxTilingCells)
      return Status::NotSupported(source_, "tensor '" + tensor_.key + "': its " + std::to_string(boxes.size()) +
                                               " boxes cut it into more than " + std::to_string(kMaxTilingCells) +
                                               " cells, too many to check their tiling");
  }
  std::vector<uint32_t> owner(cells, 0);  // 1 + the box covering each cell; 0: none yet
  std::vector<size_t> lo(rank), hi(rank), at(rank);
  for (size_t i : boxes) {
    const Box& box = tensor_.boxes[i];
    uint64_t cell = 0;
    for (size_t d = 0; d < rank; ++d) {
      lo[d] = std::lower_bound(cuts[d].begin(), cuts[d].end(), box.offset[d]) - cuts[d].begin();
      hi[d] = std::lower_bound(cuts[d].begin(), cuts[d].end(), box.offset[d] + box.extent[d]) - cuts[d].begin();
      at[d] = lo[d];
      cell += lo[d] * cell_stride[d];
    }
    // Visit the box's cells like an odometer.
    for (;;) {
      if (owner[cell] != 0)
        return Bad("boxes " + std::to_string(owner[cell] - 1) + " and " + std::to_string(i) + " overlap");
      owner[cell] = static_cast<uint32_t>(i + 1);
      bool done = true;  // until some dimension steps without wrapping
      for (size_t d = rank; d-- > 0;) {
        cell += cell_stride[d];
        if (++at[d] < hi[d]) {
          done = false;
          break;
        }
        cell -= (at[d] - lo[d]) * cell_stride[d];
        at[d] = lo[d];
      }
      if (done) break;
    }
  }
  const auto gap = std::find(owner.begin(), owner.end(), 0u);
  if (gap == owner.end()) return Status::OK();
  if (rank == 0) return Bad("its one element is not covered by any box");
  uint64_t rest = static_cast<uint64_t>(gap - owner.begin());
  std::vector<size_t> cell(rank);
  for (size_t d = 0; d < rank; ++d) {
    cell[d] = rest / cell_stride[d];
    rest %= cell_stride[d];
  }
  return Bad("elements " + DescribeCell(cuts, cell) + " are not covered by any box");
}

}  // namespace

Status ValidateLayout(const TensorEntry& tensor, const SourceFiles& files, const std::string& source) {
  return LayoutCheck(tensor, files, source).Run();
}

}  // namespace ckptfs
