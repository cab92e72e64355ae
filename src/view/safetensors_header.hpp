// Synthesis of safetensors headers for virtual files.
#ifndef CKPTFS_VIEW_SAFETENSORS_HEADER_HPP_
#define CKPTFS_VIEW_SAFETENSORS_HEADER_HPP_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/view.hpp"

namespace ckptfs {

// One tensor as a safetensors header describes it.
struct HeaderEntry {
  std::string_view key;
  std::string_view dtype;  // safetensors dtype string
  std::vector<uint64_t> shape;
  uint64_t begin = 0, end = 0;  // relative to the data buffer
};

// The 8-byte length plus the JSON header, `{"__metadata__":{"format":"pt"}, ...}` with
// entries in the given (data) order, space-padded to a multiple of 8 as the reference
// writer does, so the data buffer that follows starts 8-aligned.
std::string SafetensorsHeader(const std::vector<HeaderEntry>& entries);
// The same, appended to *out.
void AppendSafetensorsHeader(const HeaderEntry* entries, size_t count, std::string* out);
// The same in three steps, for headers written an entry at a time: the start (its 8 length
// bytes left for the end to fill in), each entry, the end (closing brace, padding, length)
// given where in *out the start was written.
void AppendSafetensorsHeaderStart(std::string* out);
// What AppendSafetensorsHeaderStart writes: the 8 length bytes (zero until the end fills them
// in) and the metadata, the bytes before the first entry.
inline constexpr char kSafetensorsHeaderStart[] = "\0\0\0\0\0\0\0\0" R"({"__metadata__":{"format":"pt"})";
inline constexpr uint64_t kSafetensorsHeaderStartSize = sizeof kSafetensorsHeaderStart - 1;
void AppendSafetensorsHeaderEntry(const HeaderEntry& e, std::string* out);
void AppendSafetensorsHeaderEnd(size_t start, std::string* out);

// Appends the header of tensor `t`'s own file (tensors/<name>): `t` alone, data at
// [0, nbytes). Into a caller's buffer: the View measures a million of them at build time.
void AppendTensorFileHeader(const ServedTensor& t, std::string* out);

}  // namespace ckptfs

#endif  // CKPTFS_VIEW_SAFETENSORS_HEADER_HPP_
