// Element types of the tensors ckptfs serves, and their names in torch and safetensors.
#ifndef CKPTFS_DTYPE_HPP_
#define CKPTFS_DTYPE_HPP_

#include <cstdint>
#include <optional>
#include <string_view>

namespace ckptfs {

enum class DType : uint8_t {
  kF64, kF32, kF16, kBF16,
  kF8_E4M3, kF8_E5M2, kF8_E4M3FNUZ, kF8_E5M2FNUZ, kF8_E8M0,
  kI64, kI32, kI16, kI8,
  kU64, kU32, kU16, kU8,
  kBool,
  kC128, kC64, kC32,
  // Two float4_e2m1fn values per byte, as torch holds them: shapes count bytes (torch's
  // float4_e2m1fn_x2 elements); safetensors' F4 headers count the values (last dimension doubled).
  kF4x2,
};

struct DTypeInfo {
  DType dtype;
  std::string_view torch_name;        // "float32": torch.<name>
  std::string_view safetensors_name;  // "F32"; empty when safetensors has no name for it
  std::string_view numpy_name;        // "float32"; empty when numpy has no such type
  uint8_t itemsize;                   // bytes per element
  bool is_float;                      // a floating type that dtype conversion may touch
};

const DTypeInfo& Info(DType dtype);

// torch dtype attribute name ("float8_e4m3fn") to DType.
std::optional<DType> DTypeFromTorchName(std::string_view name);
// torch typed-storage class name ("HalfStorage") to DType.
std::optional<DType> DTypeFromStorageClass(std::string_view name);
// safetensors dtype string ("BF16") to DType.
std::optional<DType> DTypeFromSafetensorsName(std::string_view name);

// How a tensor of `dtype` is written in safetensors. Complex types safetensors cannot
// name are served as their real view (torch.view_as_real): the component float type,
// with a trailing dimension of 2. `extra_dim` tells whether that dimension is added.
struct ServedType {
  DType dtype;
  bool extra_dim;
};
ServedType ServedAs(DType dtype);

// safetensors' F4 header shape counts the float4 values, two per byte; ckptfs (like torch)
// counts bytes. The last dimension of a kF4x2 shape is doubled in headers and halved when read.
inline constexpr uint64_t kF4ValuesPerByte = 2;

}  // namespace ckptfs

#endif  // CKPTFS_DTYPE_HPP_
