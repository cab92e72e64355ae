// The process-wide counters behind RemoteCountersNow (include/ckptfs/remote.hpp).
#ifndef CKPTFS_REMOTE_REMOTE_COUNTERS_HPP_
#define CKPTFS_REMOTE_REMOTE_COUNTERS_HPP_

#include <cstdint>

namespace ckptfs {

void CountRequest();
void CountRetry();
void CountBytes(uint64_t n);
void CountDiskCacheBytes(uint64_t n);

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_REMOTE_COUNTERS_HPP_
