// Element conversion (view/convert.cpp), on hand-picked bit patterns
// whose torch results are known (checked with torch 2.15 on x86).
#define BOOST_TEST_MODULE convert_test
#include <boost/test/unit_test.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

#include "ckptfs/view.hpp"
#include "view/convert.hpp"

using ckptfs::ConvertElements;
using ckptfs::DType;

namespace {

uint16_t F32To16(uint32_t bits, DType to) {
  char src[4], dst[2];
  std::memcpy(src, &bits, 4);
  ConvertElements(DType::kF32, to, src, 1, dst);
  uint16_t out;
  std::memcpy(&out, dst, 2);
  return out;
}

uint32_t To32(DType from, uint16_t bits) {
  char src[2], dst[4];
  std::memcpy(src, &bits, 2);
  ConvertElements(from, DType::kF32, src, 1, dst);
  uint32_t out;
  std::memcpy(&out, dst, 4);
  return out;
}

}  // namespace

BOOST_AUTO_TEST_CASE(float_to_bfloat16_rounds_to_nearest_even) {
  BOOST_TEST(F32To16(0x3F800000, DType::kBF16) == 0x3F80);  // 1.0
  BOOST_TEST(F32To16(0x3F808000, DType::kBF16) == 0x3F80);  // tie, even stays
  BOOST_TEST(F32To16(0x3F818000, DType::kBF16) == 0x3F82);  // tie, odd rounds up
  BOOST_TEST(F32To16(0x3F808001, DType::kBF16) == 0x3F81);  // above the tie
  BOOST_TEST(F32To16(0x7F7FFFFF, DType::kBF16) == 0x7F80);  // max float rounds to inf
  BOOST_TEST(F32To16(0x80000000, DType::kBF16) == 0x8000);  // -0.0
  BOOST_TEST(F32To16(0x00000001, DType::kBF16) == 0x0000);  // smallest subnormal
  BOOST_TEST(F32To16(0x7FC00000, DType::kBF16) == 0xFFFF);  // NaN as torch's vector path
}

BOOST_AUTO_TEST_CASE(float_to_half_handles_range_and_subnormals) {
  BOOST_TEST(F32To16(0x3F800000, DType::kF16) == 0x3C00);  // 1.0
  BOOST_TEST(F32To16(0x477FE000, DType::kF16) == 0x7BFF);  // 65504, the largest half
  BOOST_TEST(F32To16(0x477FF000, DType::kF16) == 0x7C00);  // 65520 rounds to inf
  BOOST_TEST(F32To16(0x33800000, DType::kF16) == 0x0001);  // 2^-24, the smallest subnormal
  BOOST_TEST(F32To16(0x33000000, DType::kF16) == 0x0000);  // 2^-25: tie to even (zero)
  BOOST_TEST(F32To16(0x33000001, DType::kF16) == 0x0001);  // just above the tie
  BOOST_TEST(F32To16(0xFF800000, DType::kF16) == 0xFC00);  // -inf
  BOOST_TEST(F32To16(0x7FC00000, DType::kF16) == 0x7E00);  // NaN
  BOOST_TEST(F32To16(0xFFF00000, DType::kF16) == 0xFF80);  // NaN keeps sign and payload top
}

BOOST_AUTO_TEST_CASE(widening_is_exact) {
  BOOST_TEST(To32(DType::kF16, 0x0001) == 0x33800000u);  // half subnormal
  BOOST_TEST(To32(DType::kF16, 0x7BFF) == 0x477FE000u);
  BOOST_TEST(To32(DType::kF16, 0xFC00) == 0xFF800000u);
  BOOST_TEST(To32(DType::kBF16, 0x3F81) == 0x3F810000u);
  char e4m3 = 0x7F;  // float8_e4m3fn NaN decodes as c10 does
  char out[4];
  ConvertElements(DType::kF8_E4M3, DType::kF32, &e4m3, 1, out);
  uint32_t bits;
  std::memcpy(&bits, out, 4);
  BOOST_TEST(bits == 0x7FF00000u);
}

BOOST_AUTO_TEST_CASE(only_floating_types_convert) {
  BOOST_TEST(ckptfs::ConvertsTo(DType::kF32, DType::kBF16));
  BOOST_TEST(ckptfs::ConvertsTo(DType::kF8_E5M2, DType::kF16));
  BOOST_TEST(!ckptfs::ConvertsTo(DType::kI64, DType::kBF16));
  BOOST_TEST(!ckptfs::ConvertsTo(DType::kBool, DType::kF32));
  BOOST_TEST(!ckptfs::ConvertsTo(DType::kC64, DType::kF32));
  BOOST_TEST(!ckptfs::ConvertsTo(DType::kBF16, DType::kBF16));
}
