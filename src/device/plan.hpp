// Planning a device load: which tensors, cut into pieces of at most one buffer, grouped into
// batches that fill one ring buffer each.
#ifndef CKPTFS_DEVICE_PLAN_HPP_
#define CKPTFS_DEVICE_PLAN_HPP_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "ckptfs/device.hpp"

namespace ckptfs::device {

inline constexpr uint64_t kAlign = 4096;
inline uint64_t AlignDown(uint64_t v) { return v & ~(kAlign - 1); }
inline uint64_t AlignUp(uint64_t v) { return (v + kAlign - 1) & ~(kAlign - 1); }

// How a piece's bytes reach the device.
enum class Route : uint8_t {
  kStored,  // source file range -> pinned buffer -> host-to-device copy
  kView,    // View::ReadTensorData (conversion, gather) -> pinned buffer -> copy
  kDirect,  // source file range -> device staging buffer (cuFile) -> device-to-device copy
};

// Bytes of one destination: `length` bytes to destination `dest` at `dst_offset`, from
// source file `file` at `src_offset` (kStored, kDirect) or from the tensor's served bytes at
// `src_offset` (kView).
struct Piece {
  Route route = Route::kStored;
  uint32_t dest = 0;
  uint32_t file = 0;
  uint64_t src_offset = 0;
  uint64_t length = 0;
  uint64_t dst_offset = 0;
  // Where the piece lands in its batch's buffer (set by the planner).
  uint64_t buffer_offset = 0;
};

// One read into a buffer: a source file range [offset, offset+length) covering pieces
// [first_piece, first_piece+piece_count) (gaps between them are read and dropped), or one
// kView piece. The read lands at `buffer_offset` (4 KiB aligned), widened down to a 4 KiB
// file offset for direct reads.
struct BufferRead {
  Route route = Route::kStored;
  uint32_t file = 0;
  uint64_t offset = 0, length = 0;
  uint64_t buffer_offset = 0;
  size_t first_piece = 0, piece_count = 0;
};

// What one ring buffer carries.
struct Batch {
  Route route = Route::kStored;  // kDirect batches use the device staging buffer
  std::vector<BufferRead> reads;
};

struct Plan {
  std::vector<Piece> pieces;
  std::vector<Batch> batches;
  size_t buffer_capacity = 0;  // bytes each ring buffer must hold
};

// Reads that are at most this far apart in one file share one read (the gap is read and
// dropped): packed tensors of a .pt or a ZeRO flat partition stream as one range.
inline constexpr uint64_t kMaxMergeGap = 64 * 1024;

// Cuts every destination into pieces and groups them into batches of at most
// `buffer_bytes` (+ alignment slack). `direct_file(file)` says whether a stored tensor in
// that file may take the direct route.
Status MakePlan(const View& view, const std::vector<DeviceDestination>& destinations, size_t buffer_bytes,
                const std::function<bool(uint32_t)>& direct_file, Plan* plan);

}  // namespace ckptfs::device

#endif  // CKPTFS_DEVICE_PLAN_HPP_
