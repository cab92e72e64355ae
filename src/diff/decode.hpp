// Stored elements of any served dtype taken to float64 for the diff's arithmetic.
#ifndef CKPTFS_DIFF_DECODE_HPP_
#define CKPTFS_DIFF_DECODE_HPP_

#include <cstddef>

#include "ckptfs/dtype.hpp"

namespace ckptfs::diff {

// The type whose values `dtype`'s elements are compared as: itself, or for a complex type
// its component float type (an element is two values, real and imaginary).
DType ValueType(DType dtype);

// Converts `count` little-endian values of `value_type` (a ValueType) at `src` to float64
// at `dst`. Every floating value is exact in float64; integers beyond 2^53 are rounded.
// `scratch` holds `count` floats (for the types decoded through float32).
void DecodeToDouble(DType value_type, const char* src, size_t count, double* dst, float* scratch);

}  // namespace ckptfs::diff

#endif  // CKPTFS_DIFF_DECODE_HPP_
