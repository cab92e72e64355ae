// Selection of tensors and the cutting of a load into ring-buffer batches.
#include "device/plan.hpp"

#include <fnmatch.h>

#include <algorithm>

namespace ckptfs {

Status SelectTensors(const View& view, const std::vector<std::string>& select, std::vector<size_t>* indices) {
  const ServedTensors& tensors = view.served();
  indices->clear();
  if (select.empty()) {
    for (size_t i = 0; i < tensors.size(); ++i) indices->push_back(i);
    return Status::OK();
  }
  std::vector<bool> picked(tensors.size(), false);
  for (const std::string& pattern : select) {
    bool any = false;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const std::string key(tensors[i].key());
      if (key == pattern || ::fnmatch(pattern.c_str(), key.c_str(), 0) == 0) {
        picked[i] = true;
        any = true;
      }
    }
    if (!any) return Status::NotFound(pattern, "no tensor of " + view.source().source + " matches");
  }
  for (size_t i = 0; i < tensors.size(); ++i)
    if (picked[i]) indices->push_back(i);
  return Status::OK();
}

namespace device {
namespace {

// Appends pieces of at most `max` bytes covering [0, length) of one source range.
void Cut(Route route, uint32_t dest, uint32_t file, uint64_t src, uint64_t length, uint64_t dst, uint64_t max,
         std::vector<Piece>* out) {
  for (uint64_t done = 0; done < length;) {
    const uint64_t n = std::min(max, length - done);
    Piece p;
    p.route = route;
    p.dest = dest;
    p.file = file;
    p.src_offset = src + done;
    p.length = n;
    p.dst_offset = dst + done;
    out->push_back(p);
    done += n;
  }
}

}  // namespace

Status MakePlan(const View& view, const std::vector<DeviceDestination>& destinations, size_t buffer_bytes,
                const std::function<bool(uint32_t)>& direct_file, Plan* plan) {
  const ServedTensors& served = view.served();
  *plan = Plan();
  const uint64_t max_piece = std::max<uint64_t>(kAlign, AlignDown(buffer_bytes));
  for (size_t d = 0; d < destinations.size(); ++d) {
    const DeviceDestination& dest = destinations[d];
    if (dest.index >= served.size())
      return Status::InvalidArgument(served.source().source, "tensor index " + std::to_string(dest.index) + " out of range");
    const ServedTensor t = served[dest.index];
    if (dest.nbytes != t.nbytes())
      return Status::InvalidArgument(t.key(), "destination holds " + std::to_string(dest.nbytes) +
                                                  " bytes, the tensor has " + std::to_string(t.nbytes()));
    if (dest.nbytes > 0 && dest.device_ptr == nullptr) return Status::InvalidArgument(t.key(), "null destination");
    if (t.nbytes() == 0) continue;
    const uint32_t di = static_cast<uint32_t>(d);
    if (RouteOf(t) != ReadRoute::kExtents) {
      Cut(Route::kView, di, 0, 0, t.nbytes(), 0, max_piece, &plan->pieces);
      continue;
    }
    const TensorEntry* stored = nullptr;
    CKPTFS_RETURN_IF_ERROR(t.Stored(&stored));
    uint64_t dst = 0;
    for (const Extent& e : ExtentsOf(*stored)) {
      const Route route = direct_file && direct_file(e.file) ? Route::kDirect : Route::kStored;
      Cut(route, di, e.file, e.offset, e.length, dst, max_piece, &plan->pieces);
      dst += e.length;
    }
    if (dst != stored->nbytes()) return Status::Corruption(t.key(), "extents do not add up to the tensor's size");
  }

  // A widened piece of max_piece bytes spans at most max_piece + 2 * kAlign - 1.
  const uint64_t cap = max_piece + 2 * kAlign;
  plan->buffer_capacity = cap;
  Batch cur;
  uint64_t used = 0;
  auto flush = [&] {
    if (!cur.reads.empty()) plan->batches.push_back(std::move(cur));
    cur = Batch();
    used = 0;
  };
  for (size_t i = 0; i < plan->pieces.size(); ++i) {
    Piece& p = plan->pieces[i];
    const Route batch_route = p.route == Route::kDirect ? Route::kDirect : Route::kStored;
    if (!cur.reads.empty() && cur.route != batch_route) flush();
    cur.route = batch_route;
    if (p.route != Route::kView && !cur.reads.empty()) {
      BufferRead& last = cur.reads.back();
      const uint64_t last_end = last.offset + last.length;
      if (last.route == p.route && last.file == p.file && p.src_offset >= last_end &&
          p.src_offset - last_end <= kMaxMergeGap) {
        const uint64_t span = AlignUp(p.src_offset + p.length) - AlignDown(last.offset);
        if (last.buffer_offset + span <= cap) {
          last.length = p.src_offset + p.length - last.offset;
          last.piece_count = i + 1 - last.first_piece;
          p.buffer_offset = last.buffer_offset + (p.src_offset - AlignDown(last.offset));
          used = last.buffer_offset + span;
          continue;
        }
      }
    }
    const uint64_t span =
        p.route == Route::kView ? AlignUp(p.length) : AlignUp(p.src_offset + p.length) - AlignDown(p.src_offset);
    if (used + span > cap) flush();
    cur.route = batch_route;
    BufferRead r;
    r.route = p.route;
    r.file = p.file;
    r.offset = p.src_offset;
    r.length = p.length;
    r.buffer_offset = used;
    r.first_piece = i;
    r.piece_count = 1;
    p.buffer_offset = used + (p.route == Route::kView ? 0 : p.src_offset - AlignDown(p.src_offset));
    cur.reads.push_back(r);
    used += span;
  }
  flush();
  return Status::OK();
}

}  // namespace device
}  // namespace ckptfs
