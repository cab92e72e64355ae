// Element-wise dtype conversion on read, bit-identical to torch's Tensor.to(dtype).
#ifndef CKPTFS_VIEW_CONVERT_HPP_
#define CKPTFS_VIEW_CONVERT_HPP_

#include <cstddef>

#include "ckptfs/dtype.hpp"

namespace ckptfs {

// Whether a view converting floating tensors to `to` converts tensors of `from`: floating
// types only (F64, F32, F16, BF16, fp8); integers, bool and complex are served as stored.
bool ConvertsTo(DType from, DType to);

// Converts `count` little-endian elements of `from` at `src` to `to` at `dst`. Like torch,
// every conversion goes through float32 (so float64 -> bfloat16 rounds twice, as
// c10::BFloat16(float) does); float32 -> bfloat16/float16 round to nearest even. Every
// non-NaN result is bit-identical to torch's; NaN stays NaN with the bit pattern torch's
// usual x86 path gives (torch's own NaN bits vary with its code path, see convert.cpp).
void ConvertElements(DType from, DType to, const char* src, size_t count, char* dst);

}  // namespace ckptfs

#endif  // CKPTFS_VIEW_CONVERT_HPP_
