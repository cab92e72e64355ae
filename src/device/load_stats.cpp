// The statistics of a load as JSON: what `ckptfs load --json` prints and the C API's
// ckptfs_last_load_stats returns, written once so that scripts read the same keys from both.
#include <nlohmann/json.hpp>

#include "ckptfs/device.hpp"

namespace ckptfs {

std::string LoadStatsJson(const DeviceLoadStats& stats, std::string_view backend, std::string_view device,
                          bool verified) {
  nlohmann::json j = {{"backend", backend},
                      {"device", device},
                      {"tensors", stats.tensors},
                      {"bytes", stats.bytes},
                      {"bytes_read", stats.bytes_read},
                      {"direct_bytes", stats.direct_bytes},
                      {"view_bytes", stats.view_bytes},
                      {"buffers_filled", stats.buffers_filled},
                      {"o_direct", stats.used_o_direct},
                      {"seconds", stats.seconds},
                      {"gb_per_s", stats.gb_per_s()},
                      {"verified", verified}};
  if (backend == kMapLoadBackend) {
    j["mapped_bytes"] = stats.mapped_bytes;
    j["maps"] = stats.maps;
  }
  return j.dump();
}

}  // namespace ckptfs
