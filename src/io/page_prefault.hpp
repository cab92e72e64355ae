// Makes a range of fresh anonymous memory resident on a second thread, ahead of the thread
// that is about to fill it. A parse that streams a million tensors into a reserved catalog
// spends a large part of its time in page faults of that array (each first write of a page
// traps into the kernel, which zeroes it); populated from another core, the parse finds the
// pages already there. Only the kernel touches the range (madvise MADV_POPULATE_WRITE): its
// contents never change, so the filling thread needs no synchronization with this one.
#ifndef CKPTFS_IO_PAGE_PREFAULT_HPP_
#define CKPTFS_IO_PAGE_PREFAULT_HPP_

#include <atomic>
#include <cstddef>
#include <thread>

namespace ckptfs {

// Faults in, for writing, the whole pages inside [begin, begin + bytes), a piece of a few MB
// at a time, each piece taken from *next: threads that share one counter share the range.
// Returns early when *stop is set or when the kernel refuses (before Linux 5.14): the pages
// left are then faulted in where they are first written.
void PopulateForWrite(void* begin, size_t bytes, std::atomic<size_t>* next, const std::atomic<bool>* stop = nullptr);

class PagePrefault {
 public:
  // Ranges smaller than this are not worth a thread.
  static constexpr size_t kMinBytes = size_t{8} << 20;

  PagePrefault() = default;
  PagePrefault(const PagePrefault&) = delete;
  PagePrefault& operator=(const PagePrefault&) = delete;
  ~PagePrefault() { Stop(); }

  // Starts populating the whole pages inside [begin, begin + bytes), front to back. Does
  // nothing when a range is already being populated, when it is small, or when no thread
  // can be started (the faults then happen where the memory is first written, as without).
  // The range must stay mapped until Stop returns; memory freed and reused meanwhile is
  // harmless (populating only makes pages resident).
  void Start(void* begin, size_t bytes);
  // Stops populating (between two steps of a few MB) and waits for the thread.
  void Stop();

 private:
  std::thread thread_;
  std::atomic<bool> stop_{false};
};

}  // namespace ckptfs

#endif  // CKPTFS_IO_PAGE_PREFAULT_HPP_
