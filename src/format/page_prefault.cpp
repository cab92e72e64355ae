#include "format/page_prefault.hpp"

#include <sys/mman.h>
#include <unistd.h>

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

void PagePrefault::Start(void* begin, size_t bytes) {
  if (thread_.joinable() || bytes < kMinBytes) return;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t from = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page;
  const uintptr_t to = (reinterpret_cast<uintptr_t>(begin) + bytes) / page * page;
  if (to <= from) return;
  stop_.store(false, std::memory_order_relaxed);
  try {
    thread_ = std::thread([this, from, to] {
      for (uintptr_t at = from; at < to && !stop_.load(std::memory_order_relaxed); at += kStep) {
        const uintptr_t length = to - at < kStep ? to - at : kStep;
        if (::madvise(reinterpret_cast<void*>(at), length, kPopulateWrite) != 0) return;
      }
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
