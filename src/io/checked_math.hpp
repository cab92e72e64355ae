// Arithmetic that reports overflow instead of wrapping, for sizes and offsets computed from
// untrusted input (shapes, strides, offsets read from checkpoints).
#ifndef CKPTFS_IO_CHECKED_MATH_HPP_
#define CKPTFS_IO_CHECKED_MATH_HPP_

#include <cstdint>

namespace ckptfs {

// a + b and a * b without wrapping; false on overflow.
inline bool CheckedAdd(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}
inline bool CheckedMul(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

}  // namespace ckptfs

#endif  // CKPTFS_IO_CHECKED_MATH_HPP_
