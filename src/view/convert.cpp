#include "view/convert.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace ckptfs {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN becomes `nan_bits`. torch's NaN patterns depend on its code
// path: the vectorized x86 float->bfloat16 conversion (ATen cvtfp32_bf16 without native
// bf16 instructions), which float32 and float64 sources take, gives 0xFFFF; the scalar
// c10::BFloat16 path, which float16 and fp8 sources take, gives 0x7FC0.
constexpr uint16_t kBF16NanVector = 0xFFFF, kBF16NanScalar = 0x7FC0;
uint16_t FloatToBF16(float f, uint16_t nan_bits) {
  if (std::isnan(f)) return nan_bits;
  const uint32_t u = Bits(f);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// IEEE binary32 -> binary16, round to nearest even (the algorithm of c10's
// fp16_ieee_from_fp32_value, from the FP16 library): scale so the hardware rounds at the
// half-precision boundary, then assemble the bits. NaN keeps its sign and the top of its
// payload, with the quiet bit set, as the F16C instruction torch uses on x86 does.
uint16_t FloatToHalf(float f) {
  if (std::isnan(f)) {
    const uint32_t u = Bits(f);
    return static_cast<uint16_t>(((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF));
  }
  const float scale_to_inf = FromBits(UINT32_C(0x77800000));
  const float scale_to_zero = FromBits(UINT32_C(0x08800000));
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = Bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & UINT32_C(0x80000000);
  uint32_t bias = shl1_w & UINT32_C(0xFF000000);
  if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
  base = FromBits((bias >> 1) + UINT32_C(0x07800000)) + base;
  const uint32_t bits = Bits(base);
  const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
  const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT16_C(0x7E00) : nonsign));
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  if (exp == 0x1F) return FromBits(sign | 0x7F800000 | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return FromBits(sign);
    // Subnormal: normalize.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400) == 0);
    return FromBits(sign | ((127 - 15 - e) << 23) | ((mant & 0x3FF) << 13));
  }
  return FromBits(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

float BF16ToFloat(uint16_t b) { return FromBits(static_cast<uint32_t>(b) << 16); }

// fp8 formats, decoded to float32 the way c10/util/Float8_*.h does (NaN bit patterns
// included, since a later step may keep them).
float Fp8ToFloat(DType t, uint8_t v) {
  switch (t) {
    case DType::kF8_E5M2:  // the top byte of a binary16
      return HalfToFloat(static_cast<uint16_t>(v << 8));
    case DType::kF8_E4M3: {
      const uint32_t w = static_cast<uint32_t>(v) << 24;
      const uint32_t sign = w & UINT32_C(0x80000000);
      const uint32_t nonsign = w & UINT32_C(0x7FFFFFFF);
      if (nonsign == 0) return FromBits(sign);
      uint32_t renorm_shift = static_cast<uint32_t>(__builtin_clz(nonsign));
      renorm_shift = renorm_shift > 4 ? renorm_shift - 4 : 0;
      const uint32_t inf_nan_mask =
          static_cast<uint32_t>((static_cast<int32_t>(nonsign + 0x01000000) >> 8) & INT32_C(0x7F800000));
      return FromBits(sign | (((nonsign << renorm_shift >> 4) + ((0x78 - renorm_shift) << 23)) | inf_nan_mask));
    }
    case DType::kF8_E4M3FNUZ:
    case DType::kF8_E5M2FNUZ: {  // no infinities, no negative zero: 0x80 is the only NaN
      // The NaN patterns torch 2.15 produces for these (checked for every tensor length).
      if (v == 0x80) return FromBits(0x7F800001);
      const bool e4 = t == DType::kF8_E4M3FNUZ;
      const int mant_bits = e4 ? 3 : 2, bias = e4 ? 8 : 16;
      const int exp = (v & 0x7F) >> mant_bits, mant = v & ((1 << mant_bits) - 1);
      const float value = exp == 0 ? std::ldexp(static_cast<float>(mant), 1 - bias - mant_bits)
                                   : std::ldexp(static_cast<float>(mant | (1 << mant_bits)), exp - bias - mant_bits);
      return (v & 0x80) ? -value : value;
    }
    case DType::kF8_E8M0:  // exponent only: 2^(v-127); 0xFF is NaN
      if (v == 0xFF) return FromBits(0x7F800001);  // the NaN torch 2.15 produces
      return v == 0 ? FromBits(0x00400000) : FromBits(static_cast<uint32_t>(v) << 23);
    default:
      return 0;
  }
}

float LoadAsFloat(DType t, const char* p) {
  switch (t) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kF64: {
      double d;
      std::memcpy(&d, p, 8);
      return static_cast<float>(d);  // round to nearest even, NaN stays NaN
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return HalfToFloat(h);
    }
    case DType::kBF16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return BF16ToFloat(b);
    }
    default: return Fp8ToFloat(t, static_cast<uint8_t>(*p));
  }
}

// The common case, fp32 -> bf16, as a branch-free loop the compiler vectorizes (this file
// is built with -O3; see CMakeLists.txt): same results as FloatToBF16(f, kBF16NanVector).
// Built twice, for AVX2 and for the baseline (SSE2), and picked at load time by the CPU
// (an ifunc): the AVX2 loop converts 8 elements per step instead of 4. Not under
// ThreadSanitizer, which instruments the ifunc's resolver: that runs during relocation,
// before the sanitizer's runtime exists, and would crash every program at start.
#if defined(__SANITIZE_THREAD__)
#define CKPTFS_AVX2_CLONE
#else
#define CKPTFS_AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#endif
CKPTFS_AVX2_CLONE void F32ToBF16(const char* src, size_t count, char* dst) {
  for (size_t i = 0; i < count; ++i) {
    uint32_t u;
    std::memcpy(&u, src + 4 * i, 4);
    const uint32_t rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
    const bool nan = (u & 0x7FFFFFFF) > 0x7F800000;
    const uint16_t b = static_cast<uint16_t>(nan ? kBF16NanVector : rounded);
    std::memcpy(dst + 2 * i, &b, 2);
  }
}

}  // namespace

bool ConvertsTo(DType from, DType to) {
  const bool target_ok = to == DType::kF32 || to == DType::kF16 || to == DType::kBF16;
  return target_ok && Info(from).is_float && from != to;
}

void ConvertElements(DType from, DType to, const char* src, size_t count, char* dst) {
  const size_t in = Info(from).itemsize;
  if (from == DType::kF32 && to == DType::kBF16) return F32ToBF16(src, count, dst);
  const uint16_t bf16_nan = (from == DType::kF32 || from == DType::kF64) ? kBF16NanVector : kBF16NanScalar;
  for (size_t i = 0; i < count; ++i) {
    const float f = LoadAsFloat(from, src + i * in);
    if (to == DType::kF32) {
      std::memcpy(dst + 4 * i, &f, 4);
    } else {
      const uint16_t h = to == DType::kBF16 ? FloatToBF16(f, bf16_nan) : FloatToHalf(f);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  }
}

}  // namespace ckptfs
