#include "diff/decode.hpp"

#include <cstdint>
#include <cstring>

#include "view/convert.hpp"

namespace ckptfs::diff {
namespace {

template <typename T>
void Widen(const char* src, size_t count, double* dst) {
  for (size_t i = 0; i < count; ++i) {
    T v;
    std::memcpy(&v, src + i * sizeof(T), sizeof(T));
    dst[i] = static_cast<double>(v);
  }
}

}  // namespace

DType ValueType(DType dtype) {
  switch (dtype) {
    case DType::kC128: return DType::kF64;
    case DType::kC64: return DType::kF32;
    case DType::kC32: return DType::kF16;
    default: return dtype;
  }
}

void DecodeToDouble(DType value_type, const char* src, size_t count, double* dst, float* scratch) {
  switch (value_type) {
    case DType::kF64: return Widen<double>(src, count, dst);
    case DType::kF32: return Widen<float>(src, count, dst);
    case DType::kI64: return Widen<int64_t>(src, count, dst);
    case DType::kI32: return Widen<int32_t>(src, count, dst);
    case DType::kI16: return Widen<int16_t>(src, count, dst);
    case DType::kI8: return Widen<int8_t>(src, count, dst);
    case DType::kU64: return Widen<uint64_t>(src, count, dst);
    case DType::kU32: return Widen<uint32_t>(src, count, dst);
    case DType::kU16: return Widen<uint16_t>(src, count, dst);
    case DType::kU8: return Widen<uint8_t>(src, count, dst);
    // Packed float4 pairs have no conversion (torch has none either): their bytes are compared
    // as numbers, so "differing" counts bytes and the norms are of the bytes.
    case DType::kF4x2: return Widen<uint8_t>(src, count, dst);
    case DType::kBool:
      for (size_t i = 0; i < count; ++i) dst[i] = src[i] != 0 ? 1.0 : 0.0;
      return;
    default:
      // The 16- and 8-bit floats: every value is exact in float32, and the view's own
      // conversion (bit-identical to torch's) takes them there.
      ConvertElements(value_type, DType::kF32, src, count, reinterpret_cast<char*>(scratch));
      for (size_t i = 0; i < count; ++i) dst[i] = static_cast<double>(scratch[i]);
      return;
  }
}

}  // namespace ckptfs::diff
