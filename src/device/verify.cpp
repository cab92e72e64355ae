// --verify: every loaded tensor's device bytes, copied back, against the View's bytes.
#include <algorithm>
#include <cstring>
#include <vector>

#include "ckptfs/device.hpp"

namespace ckptfs {

Status VerifyDeviceTensors(const View& view, DeviceBackend& backend, const std::vector<DeviceTensor>& tensors) {
  constexpr uint64_t kChunk = uint64_t{8} << 20;
  ScopedDeviceBinding binding(backend);
  CKPTFS_RETURN_IF_ERROR(binding.status());
  std::vector<char> expected, actual;
  for (const DeviceTensor& t : tensors) {
    for (uint64_t off = 0; off < t.nbytes; off += kChunk) {
      const uint64_t n = std::min(kChunk, t.nbytes - off);
      expected.resize(n);
      actual.resize(n);
      CKPTFS_RETURN_IF_ERROR(view.ReadTensorData(t.index, off, n, expected.data()));
      CKPTFS_RETURN_IF_ERROR(backend.CopyToHost(actual.data(), static_cast<const char*>(t.device_ptr) + off, n));
      if (std::memcmp(expected.data(), actual.data(), n) != 0) {
        uint64_t at = 0;
        while (at < n && expected[at] == actual[at]) ++at;
        return Status::Corruption(t.key, "device bytes differ from the view's at byte " + std::to_string(off + at) +
                                             " of " + std::to_string(t.nbytes));
      }
    }
  }
  return Status::OK();
}

}  // namespace ckptfs
