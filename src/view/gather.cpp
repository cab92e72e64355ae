#include "view/gather.hpp"

#include <algorithm>
#include <cstring>

#include "catalog/tiling.hpp"
#include "io/checked_math.hpp"

namespace ckptfs {
namespace {

// A box's pieces are read through its file span covering them when that span is at most
// this large (in windows of kGatherWindow, so a thread keeps at most one window), and one
// pread per contiguous run otherwise. A transposed 32 MB tensor spans 32 MB for every
// 1 MiB of output: reading it whole per request kept 32+ MB per daemon thread.
constexpr uint64_t kMaxGatherSpan = uint64_t{64} << 20;
constexpr uint64_t kGatherWindow = uint64_t{4} << 20;
// Contiguous pieces at least this large on average are read straight into the output: a
// window would cost a second copy to save few system calls.
constexpr uint64_t kDirectPieceBytes = uint64_t{64} << 10;

// Copies `count` elements of N bytes, `step` bytes apart at `src`, to consecutive `dst`.
template <size_t N>
void CopyStrided(char* dst, const char* src, uint64_t count, uint64_t step) {
  for (uint64_t k = 0; k < count; ++k) std::memcpy(dst + k * N, src + k * step, N);
}

void CopyElements(uint64_t itemsize, char* dst, const char* src, uint64_t count, uint64_t step_elems) {
  const uint64_t step = step_elems * itemsize;
  if (step_elems == 1) return static_cast<void>(std::memcpy(dst, src, count * itemsize));
  switch (itemsize) {
    case 1: return CopyStrided<1>(dst, src, count, step);
    case 2: return CopyStrided<2>(dst, src, count, step);
    case 4: return CopyStrided<4>(dst, src, count, step);
    case 8: return CopyStrided<8>(dst, src, count, step);
    case 16: return CopyStrided<16>(dst, src, count, step);
  }
  for (uint64_t k = 0; k < count; ++k) std::memcpy(dst + k * itemsize, src + k * step, itemsize);
}

// The walk of `box` over `dims` (row-major strides `pitch`), or false for a box that does
// not fit them or holds no elements.
bool MakeWalk(const Box& box, const std::vector<uint64_t>& dims, const std::vector<uint64_t>& pitch, BoxWalk* walk) {
  const size_t rank = dims.size();
  if (box.rank() != rank || box.offset.size() != rank || box.strides.size() != rank || box.numel() == 0) return false;
  walk->box = &box;
  walk->first = RowMajorPosition(box.offset, dims);
  walk->last = 0;
  for (size_t d = 0; d < rank; ++d) walk->last += (box.offset[d] + box.extent[d] - 1) * pitch[d];
  // Grow the run outwards while it stays contiguous in the tensor (the dimensions inside
  // are whole) and evenly spaced in the file.
  walk->run_dim = rank;
  walk->run_length = 1;
  walk->step = 1;
  for (size_t d = rank; d-- > 0;) {
    if (d + 1 < rank && box.extent[d + 1] != dims[d + 1]) break;
    if (box.extent[d] != 1) {
      uint64_t spacing;
      if (walk->run_length == 1) walk->step = box.strides[d];
      else if (!CheckedMul(walk->step, walk->run_length, &spacing) || box.strides[d] != spacing) break;
    }
    walk->run_dim = d;
    walk->run_length *= box.extent[d];
  }
  return true;
}

}  // namespace

Status FileChecks::Check(uint32_t file) {
  const auto end = checked_.begin() + count_;
  if (std::find(checked_.begin(), end, file) != end) return Status::OK();
  CKPTFS_RETURN_IF_ERROR(files_.CheckUnchanged(file));
  if (count_ < checked_.size()) checked_[count_++] = file;
  return Status::OK();
}

Gather::Gather(const SourceFiles& files, const TensorEntry& tensor, GatherBuffers* buffers)
    : files_(files), buf_(*buffers), itemsize_(Info(tensor.dtype).itemsize), checks_(files) {
  buf_.dims = TiledDims(tensor);
  const size_t rank = buf_.dims.size();
  buf_.pitch.assign(rank, 1);
  for (size_t d = rank; d-- > 1;) buf_.pitch[d - 1] = buf_.pitch[d] * buf_.dims[d];
  buf_.index.resize(rank);
  buf_.walks.clear();
  for (const Box& box : tensor.boxes) {
    BoxWalk walk;
    if (MakeWalk(box, buf_.dims, buf_.pitch, &walk)) buf_.walks.push_back(walk);
  }
}

Status Gather::Read(uint64_t first, uint64_t count, char* out) {
  const uint64_t end = first + count;
  for (const BoxWalk& walk : buf_.walks) {
    if (walk.last < first || walk.first >= end) continue;
    ListPieces(walk, first, end);
    if (buf_.pieces.empty()) continue;
    CKPTFS_RETURN_IF_ERROR(checks_.Check(walk.box->file));
    CKPTFS_RETURN_IF_ERROR(ReadPieces(*walk.box, out));
  }
  return Status::OK();
}

// The runs of `walk`'s box that meet positions [first, end), clipped to them.
void Gather::ListPieces(const BoxWalk& walk, uint64_t first, uint64_t end) {
  const Box& box = *walk.box;
  const std::vector<uint64_t>& dims = buf_.dims;
  std::vector<uint64_t>& at = buf_.index;
  const size_t rank = dims.size();
  buf_.pieces.clear();
  // How many of the box's elements (in row-major order) come before position `first`.
  uint64_t rest = first;
  for (size_t d = rank; d-- > 0;) {
    at[d] = rest % dims[d];
    rest /= dims[d];
  }
  uint64_t before = 0, inner = box.numel();
  for (size_t d = 0; d < rank; ++d) {
    inner /= box.extent[d];
    if (at[d] < box.offset[d]) break;
    if (at[d] >= box.offset[d] + box.extent[d]) {
      before += box.extent[d] * inner;
      break;
    }
    before += (at[d] - box.offset[d]) * inner;
  }
  if (before >= box.numel()) return;
  // Start at that element: run number before / run_length, element j of it.
  uint64_t j = before % walk.run_length, run = before / walk.run_length;
  uint64_t src = 0, pos = 0;
  for (size_t d = rank; d-- > 0;) {
    if (d < walk.run_dim) {
      at[d] = run % box.extent[d];
      run /= box.extent[d];
    } else {
      at[d] = 0;
    }
    src += at[d] * box.strides[d];
    pos += (box.offset[d] + at[d]) * buf_.pitch[d];
  }
  for (;;) {
    if (pos + j >= end) break;
    const uint64_t n = std::min(walk.run_length - j, end - (pos + j));
    buf_.pieces.push_back(GatherPiece{pos + j - first, src + j * walk.step, n, walk.step});
    j = 0;
    // Next run: step the dimensions outside it like an odometer.
    bool done = true;
    for (size_t d = walk.run_dim; d-- > 0;) {
      src += box.strides[d];
      pos += buf_.pitch[d];
      if (++at[d] < box.extent[d]) {
        done = false;
        break;
      }
      src -= box.extent[d] * box.strides[d];
      pos -= box.extent[d] * buf_.pitch[d];
      at[d] = 0;
    }
    if (done) break;
  }
}

Status Gather::ReadPieces(const Box& box, char* out) {
  const std::vector<GatherPiece>& pieces = buf_.pieces;
  uint64_t lo = UINT64_MAX, hi = 0, total = 0;
  bool contiguous = true;
  for (const GatherPiece& p : pieces) {
    lo = std::min(lo, p.src);
    hi = std::max(hi, p.src + (p.count - 1) * p.step);
    total += p.count;
    contiguous = contiguous && (p.step == 1 || p.count == 1);
  }
  const uint64_t base = box.base_offset;
  if (contiguous && total * itemsize_ >= kDirectPieceBytes * pieces.size()) {
    for (const GatherPiece& p : pieces)
      CKPTFS_RETURN_IF_ERROR(files_.ReadExact(box.file, base + p.src * itemsize_, p.count * itemsize_, out + p.dst * itemsize_));
    return Status::OK();
  }
  uint64_t span_bytes;
  if (CheckedMul(hi - lo + 1, itemsize_, &span_bytes) && span_bytes <= kMaxGatherSpan) {
    const uint64_t window_elems = std::max<uint64_t>(1, kGatherWindow / itemsize_);
    for (uint64_t w_lo = lo; w_lo <= hi; w_lo += window_elems) {
      const uint64_t w_hi = std::min(hi, w_lo + window_elems - 1);
      const uint64_t w_bytes = (w_hi - w_lo + 1) * itemsize_;
      if (buf_.window.size() < w_bytes) buf_.window.resize(w_bytes);
      CKPTFS_RETURN_IF_ERROR(files_.ReadExact(box.file, base + w_lo * itemsize_, w_bytes, buf_.window.data()));
      for (const GatherPiece& p : pieces) {
        // The elements k of the piece whose file element src + k * step lies in the window.
        const uint64_t p_last = p.src + (p.count - 1) * p.step;
        if (p.src > w_hi || p_last < w_lo) continue;
        uint64_t k_lo = 0, k_hi = p.count - 1;
        if (p.step > 0) {
          if (p.src < w_lo) k_lo = (w_lo - p.src + p.step - 1) / p.step;
          k_hi = std::min(k_hi, (w_hi - p.src) / p.step);
        }
        if (k_lo > k_hi) continue;
        CopyElements(itemsize_, out + (p.dst + k_lo) * itemsize_,
                     buf_.window.data() + (p.src + k_lo * p.step - w_lo) * itemsize_, k_hi - k_lo + 1, p.step);
      }
    }
    return Status::OK();
  }
  // Too sparse for a window: each run of consecutive file elements on its own.
  for (const GatherPiece& p : pieces) {
    const uint64_t run = p.step == 1 ? p.count : 1;
    for (uint64_t k = 0; k < p.count; k += run)
      CKPTFS_RETURN_IF_ERROR(files_.ReadExact(box.file, base + (p.src + k * p.step) * itemsize_, run * itemsize_,
                                              out + (p.dst + k) * itemsize_));
  }
  return Status::OK();
}

}  // namespace ckptfs
