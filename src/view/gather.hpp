// Gathering a tensor's elements from its boxes (include/ckptfs/catalog.hpp) into row-major
// order: any number of boxes, in any files, strided or not.
#ifndef CKPTFS_VIEW_GATHER_HPP_
#define CKPTFS_VIEW_GATHER_HPP_

#include <array>
#include <cstdint>
#include <vector>

#include "ckptfs/catalog.hpp"

namespace ckptfs {

// Checks each source file once per read, before its bytes are used, so that a file replaced
// or rewritten under the mount fails the read instead of serving other bytes.
class FileChecks {
 public:
  explicit FileChecks(const SourceFiles& files) : files_(files) {}
  Status Check(uint32_t file);

 private:
  const SourceFiles& files_;
  // The files checked so far; a read touching more than these checks the rest every time.
  std::array<uint32_t, 8> checked_{};
  size_t count_ = 0;
};

// A box as a gather walks it: in row-major order its elements fall into runs of
// `run_length` elements that are contiguous in the tensor and `step` elements apart in the
// file (a row of a transposed matrix, a whole row-major block).
struct BoxWalk {
  const Box* box = nullptr;
  uint64_t first = 0, last = 0;  // row-major positions of its first and last element
  size_t run_dim = 0;            // dimensions [run_dim, rank) make up one run
  uint64_t run_length = 1;
  uint64_t step = 1;
};

// Output elements [dst, dst + count) of a read come from the box's file elements src,
// src + step, ... (counted from the box's base_offset).
struct GatherPiece {
  uint64_t dst = 0;
  uint64_t src = 0;
  uint64_t count = 0;
  uint64_t step = 1;
};

// What a gather reuses from read to read. Kept per thread by the caller (FUSE workers live
// for the mount), so that a read allocates nothing once they have grown; the window is
// bounded (kGatherWindow in gather.cpp).
struct GatherBuffers {
  std::vector<uint64_t> dims, pitch, index;
  std::vector<BoxWalk> walks;
  std::vector<GatherPiece> pieces;
  std::vector<char> window;
};

class Gather {
 public:
  // Prepares reads of `tensor`'s elements; all three must outlive the Gather. Boxes that
  // do not match the tensor's tiled dimensions are skipped (ValidateLayout refuses them).
  Gather(const SourceFiles& files, const TensorEntry& tensor, GatherBuffers* buffers);

  // Elements [first, first + count) of the tensor in row-major order into `out`.
  Status Read(uint64_t first, uint64_t count, char* out);

 private:
  void ListPieces(const BoxWalk& walk, uint64_t first, uint64_t end);
  Status ReadPieces(const Box& box, char* out);

  const SourceFiles& files_;
  GatherBuffers& buf_;
  const uint64_t itemsize_;
  FileChecks checks_;
};

}  // namespace ckptfs

#endif  // CKPTFS_VIEW_GATHER_HPP_
