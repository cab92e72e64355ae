#include "ckptfs/dtype.hpp"

#include <array>

namespace ckptfs {
namespace {

// Order matches the DType enum. Names: torch/_tensor_str + torch/storage.py for torch,
// safetensors/src/tensor.rs `Dtype` for safetensors (doc/FORMATS.md, "Dtype names"), numpy's
// own for the types numpy has (no bfloat16, float8, complex32 or float4).
constexpr std::array<DTypeInfo, 22> kInfos = {{
    {DType::kF64, "float64", "F64", "float64", 8, true},
    {DType::kF32, "float32", "F32", "float32", 4, true},
    {DType::kF16, "float16", "F16", "float16", 2, true},
    {DType::kBF16, "bfloat16", "BF16", "", 2, true},
    {DType::kF8_E4M3, "float8_e4m3fn", "F8_E4M3", "", 1, true},
    {DType::kF8_E5M2, "float8_e5m2", "F8_E5M2", "", 1, true},
    {DType::kF8_E4M3FNUZ, "float8_e4m3fnuz", "F8_E4M3FNUZ", "", 1, true},
    {DType::kF8_E5M2FNUZ, "float8_e5m2fnuz", "F8_E5M2FNUZ", "", 1, true},
    {DType::kF8_E8M0, "float8_e8m0fnu", "F8_E8M0", "", 1, true},
    {DType::kI64, "int64", "I64", "int64", 8, false},
    {DType::kI32, "int32", "I32", "int32", 4, false},
    {DType::kI16, "int16", "I16", "int16", 2, false},
    {DType::kI8, "int8", "I8", "int8", 1, false},
    {DType::kU64, "uint64", "U64", "uint64", 8, false},
    {DType::kU32, "uint32", "U32", "uint32", 4, false},
    {DType::kU16, "uint16", "U16", "uint16", 2, false},
    {DType::kU8, "uint8", "U8", "uint8", 1, false},
    {DType::kBool, "bool", "BOOL", "bool", 1, false},
    {DType::kC128, "complex128", "", "complex128", 16, false},
    {DType::kC64, "complex64", "C64", "complex64", 8, false},
    {DType::kC32, "complex32", "", "", 4, false},
    // Packed: no conversion (torch has none either); dtype= refuses it (transform_dtype.cpp).
    {DType::kF4x2, "float4_e2m1fn_x2", "F4", "", 1, false},
}};

struct StorageClass {
  std::string_view name;
  DType dtype;
};
// torch.storage._dtype_to_storage_type_map: the typed storages torch 1.x wrote and
// torch 2.x still writes for the classic dtypes.
constexpr std::array<StorageClass, 13> kStorageClasses = {{
    {"DoubleStorage", DType::kF64},
    {"FloatStorage", DType::kF32},
    {"HalfStorage", DType::kF16},
    {"BFloat16Storage", DType::kBF16},
    {"LongStorage", DType::kI64},
    {"IntStorage", DType::kI32},
    {"ShortStorage", DType::kI16},
    {"CharStorage", DType::kI8},
    {"ByteStorage", DType::kU8},
    {"BoolStorage", DType::kBool},
    {"ComplexDoubleStorage", DType::kC128},
    {"ComplexFloatStorage", DType::kC64},
    {"ComplexHalfStorage", DType::kC32},
}};

}  // namespace

const DTypeInfo& Info(DType dtype) { return kInfos[static_cast<size_t>(dtype)]; }

std::optional<DType> DTypeFromTorchName(std::string_view name) {
  for (const auto& info : kInfos)
    if (info.torch_name == name) return info.dtype;
  // Aliases torch also pickles under (torch.half, torch.cfloat, ...).
  if (name == "half") return DType::kF16;
  if (name == "float") return DType::kF32;
  if (name == "double") return DType::kF64;
  if (name == "long") return DType::kI64;
  if (name == "int") return DType::kI32;
  if (name == "short") return DType::kI16;
  if (name == "cfloat") return DType::kC64;
  if (name == "cdouble") return DType::kC128;
  if (name == "chalf") return DType::kC32;
  return std::nullopt;
}

std::optional<DType> DTypeFromStorageClass(std::string_view name) {
  for (const auto& sc : kStorageClasses)
    if (sc.name == name) return sc.dtype;
  return std::nullopt;
}

std::optional<DType> DTypeFromSafetensorsName(std::string_view name) {
  if (name.empty()) return std::nullopt;
  for (const auto& info : kInfos)
    if (info.safetensors_name == name) return info.dtype;
  return std::nullopt;
}

ServedType ServedAs(DType dtype) {
  switch (dtype) {
    case DType::kC128: return {DType::kF64, true};
    case DType::kC32: return {DType::kF16, true};
    default: return {dtype, false};
  }
}

}  // namespace ckptfs
