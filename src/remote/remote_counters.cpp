#include "remote/remote_counters.hpp"

#include <atomic>

#include "ckptfs/remote.hpp"

namespace ckptfs {
namespace {

std::atomic<uint64_t> g_requests{0};
std::atomic<uint64_t> g_bytes{0};
std::atomic<uint64_t> g_retries{0};
std::atomic<uint64_t> g_disk_cache_bytes{0};

}  // namespace

void CountRequest() { g_requests.fetch_add(1, std::memory_order_relaxed); }
void CountRetry() { g_retries.fetch_add(1, std::memory_order_relaxed); }
void CountBytes(uint64_t n) { g_bytes.fetch_add(n, std::memory_order_relaxed); }
void CountDiskCacheBytes(uint64_t n) { g_disk_cache_bytes.fetch_add(n, std::memory_order_relaxed); }

RemoteCounters RemoteCountersNow() {
  RemoteCounters c;
  c.requests = g_requests.load(std::memory_order_relaxed);
  c.bytes = g_bytes.load(std::memory_order_relaxed);
  c.retries = g_retries.load(std::memory_order_relaxed);
  c.disk_cache_bytes = g_disk_cache_bytes.load(std::memory_order_relaxed);
  return c;
}

}  // namespace ckptfs
