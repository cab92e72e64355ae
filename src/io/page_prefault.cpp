#include "io/page_prefault.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <system_error>

namespace ckptfs {
namespace {

// madvise(MADV_POPULATE_WRITE) (Linux 5.14), which older C library headers lack. An older
// kernel answers EINVAL: nothing is populated, nothing else changes.
#ifdef MADV_POPULATE_WRITE
constexpr int kPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kPopulateWrite = 23;
#endif
// Populated per call: small enough that Stop waits little, large enough that the calls
// cost nothing beside the faults.
constexpr uintptr_t kStep = uintptr_t{4} << 20;

}  // namespace

void PopulateForWrite(void* begin, size_t bytes, std::atomic<size_t>* next, const std::atomic<bool>* stop) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t from = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page;
  const uintptr_t to = (reinterpret_cast<uintptr_t>(begin) + bytes) / page * page;
  if (to <= from) return;
  const size_t pieces = (to - from + kStep - 1) / kStep;
  for (size_t k; !(stop && stop->load(std::memory_order_relaxed)) && (k = next->fetch_add(1)) < pieces;) {
    const uintptr_t at = from + k * kStep;
    if (::madvise(reinterpret_cast<void*>(at), std::min(kStep, to - at), kPopulateWrite) != 0) return;
  }
}

void PagePrefault::Start(void* begin, size_t bytes) {
  if (thread_.joinable() || bytes < kMinBytes) return;
  stop_.store(false, std::memory_order_relaxed);
  try {
    thread_ = std::thread([this, begin, bytes] {
      std::atomic<size_t> next{0};
      PopulateForWrite(begin, bytes, &next, &stop_);
    });
  } catch (const std::system_error&) {
    // No thread: the memory is faulted in where it is written.
  }
}

void PagePrefault::Stop() {
  if (!thread_.joinable()) return;
  stop_.store(true, std::memory_order_relaxed);
  thread_.join();
}

}  // namespace ckptfs
