// View::ReadSlices: a read of a virtual file as slices, so a FUSE reply can be written
// straight from memory a source already holds (the remote block cache) instead of being
// copied into a reply buffer first. Only plain byte ranges of source files (kExtent
// segments) are borrowed; literals, headers, gathers and conversions are made by View::Read
// into the caller's scratch buffer, so this file knows nothing of how they are made.
#include <algorithm>

#include "ckptfs/view.hpp"
#include "view/gather.hpp"

namespace ckptfs {
namespace {

// Appends `slice`, joined to the previous one when it continues it in memory (consecutive
// cache blocks of one request, consecutive pieces of the scratch buffer): fewer iovecs.
void Append(BorrowedBytes slice, std::vector<BorrowedBytes>* out) {
  if (slice.length == 0) return;
  if (!out->empty()) {
    BorrowedBytes& last = out->back();
    if (last.data + last.length == slice.data && (last.keep == slice.keep || !slice.keep)) {
      last.length += slice.length;
      return;
    }
  }
  out->push_back(std::move(slice));
}

}  // namespace

Status View::ReadSlices(NodeId id, uint64_t offset, size_t length, char* scratch, std::vector<BorrowedBytes>* out,
                        size_t* nread) const {
  *nread = 0;
  const Node& n = nodes_[id];
  // Per-tensor files and directories: the ordinary read (it also reports the errors).
  if (n.is_dir || n.tensor >= 0 || n.segment_count == 0) {
    CKPTFS_RETURN_IF_ERROR(Read(id, offset, length, scratch, nread));
    Append(BorrowedBytes{scratch, *nread, nullptr}, out);
    return Status::OK();
  }
  if (offset >= n.size || length == 0) return Status::OK();
  const uint64_t end = offset + std::min<uint64_t>(length, n.size - offset);
  const Segment* first = segments_.data() + n.first_segment;
  const Segment* last = first + n.segment_count;
  const Segment* seg =
      std::upper_bound(first, last, offset, [](uint64_t off, const Segment& s) { return off < s.start; }) - 1;
  const SourceFiles& files = *catalog_->files;
  FileChecks checks(files);
  std::vector<BorrowedBytes> lent;
  uint64_t pos = offset;
  for (; pos < end && seg < last; ++seg) {
    const uint64_t in_seg = pos - seg->start;
    const uint64_t piece = std::min(seg->length - in_seg, end - pos);
    char* dst = scratch + (pos - offset);
    if (seg->kind == Segment::Kind::kExtent) {
      CKPTFS_RETURN_IF_ERROR(checks.Check(seg->ref));
      const uint64_t at = seg->source_offset + in_seg;
      CKPTFS_RETURN_IF_ERROR(files.CheckBounds(seg->ref, at, piece));
      lent.clear();
      CKPTFS_RETURN_IF_ERROR(files.file(seg->ref).Borrow(at, piece, dst, &lent));
      for (BorrowedBytes& slice : lent) Append(std::move(slice), out);
    } else {
      size_t made = 0;
      CKPTFS_RETURN_IF_ERROR(Read(id, pos, piece, dst, &made));
      if (made != piece) return Status::Corruption(PathOf(id), "segment shorter than its length");
      Append(BorrowedBytes{dst, piece, nullptr}, out);
    }
    pos += piece;
  }
  *nread = pos - offset;
  return Status::OK();
}

}  // namespace ckptfs
