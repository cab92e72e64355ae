// The header of a safetensors blob: its tensors (dtype, shape, where their bytes lie) and
// its "__metadata__" strings, parsed and validated in place in a window of a file. A whole
// .safetensors file is one window; DCP's safetensors serialization appends a blob to a
// .distcp file after its pickled objects, which is another.
// Layout facts: doc/FORMATS.md, "safetensors layout".
#ifndef CKPTFS_CODEC_SAFETENSORS_HEADER_HPP_
#define CKPTFS_CODEC_SAFETENSORS_HEADER_HPP_

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/dtype.hpp"
#include "ckptfs/limits.hpp"
#include "ckptfs/source_files.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

struct SafetensorsTensor {
  std::string key;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  uint64_t data_offset = 0;  // of its first byte, in the file (not the window)
  uint64_t nbytes = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsTensor> tensors;  // in data order
  uint64_t data_start = 0;  // where the tensors' bytes start, in the file (8 + the header's length past the window's start)
  nlohmann::json metadata = nlohmann::json::object();  // "__metadata__": string values only
};

// Parses the blob that fills `window` of file window.file: 8-byte header length, JSON
// header, then the tensors' bytes, which must tile the rest of the window exactly. Messages
// name the window (files.Describe).
Status ParseSafetensorsHeader(const SourceFiles& files, const FileWindow& window, const ReadLimits& limits,
                              SafetensorsHeader* out);

// True when `window` starts like a safetensors blob: a header length that fits in the
// window, followed by '{'. Reads 9 bytes.
bool LooksLikeSafetensors(const SourceFiles& files, const FileWindow& window);

}  // namespace ckptfs

#endif  // CKPTFS_CODEC_SAFETENSORS_HEADER_HPP_
