// Bounds-checked little-endian decoding of an in-memory byte range.
//
// Every getter returns false instead of reading past the end, so parsers can turn
// any truncation into a clear Corruption status.
#ifndef CKPTFS_CODEC_BYTE_READER_HPP_
#define CKPTFS_CODEC_BYTE_READER_HPP_

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "io/checked_math.hpp"

namespace ckptfs {

class ByteReader {
 public:
  explicit ByteReader(std::string_view bytes) : bytes_(bytes) {}

  size_t position() const { return pos_; }
  size_t remaining() const { return bytes_.size() - pos_; }
  bool at_end() const { return pos_ == bytes_.size(); }

  bool Skip(size_t n) {
    if (n > remaining()) return false;
    pos_ += n;
    return true;
  }
  bool Bytes(size_t n, std::string_view* out) {
    if (n > remaining()) return false;
    *out = bytes_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  bool U8(uint8_t* v) { return Fixed(v); }
  bool U16(uint16_t* v) { return Fixed(v); }
  bool U32(uint32_t* v) { return Fixed(v); }
  bool U64(uint64_t* v) { return Fixed(v); }
  // Reads up to and excluding the next '\n', consuming the newline.
  bool Line(std::string_view* out) {
    size_t nl = bytes_.find('\n', pos_);
    if (nl == std::string_view::npos) return false;
    *out = bytes_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return true;
  }

 private:
  // Little-endian on the wire: one load, swapped on a big-endian host. (Assembled a byte
  // at a time, a million-tensor catalog cache entry's fifteen million reads cost more.)
  template <typename T>
  bool Fixed(T* v) {
    if (sizeof(T) > remaining()) return false;
    T x;
    std::memcpy(&x, bytes_.data() + pos_, sizeof(T));
    if constexpr (std::endian::native == std::endian::big && sizeof(T) == 2) x = __builtin_bswap16(x);
    if constexpr (std::endian::native == std::endian::big && sizeof(T) == 4) x = __builtin_bswap32(x);
    if constexpr (std::endian::native == std::endian::big && sizeof(T) == 8) x = __builtin_bswap64(x);
    *v = x;
    pos_ += sizeof(T);
    return true;
  }

  std::string_view bytes_;
  size_t pos_ = 0;
};

}  // namespace ckptfs

#endif  // CKPTFS_CODEC_BYTE_READER_HPP_
