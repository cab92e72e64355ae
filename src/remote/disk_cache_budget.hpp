// DiskCacheBudget: keeps a cache folder (cache_dir) within a size (cache_dir_size) by
// evicting the least recently used blocks of any object in it, whichever process wrote
// them. Each process counts what it writes and, every sixteenth of the bound and when the
// source closes, measures the folder (the space its files take on disk) and, when over the
// bound, evicts down to three quarters of it. One process at a time evicts (an flock on
// "evict.lock" in the folder, which the others wait for). While processes write, the folder
// may pass the bound by what they wrote since their last pass (a request, up to 16 MiB);
// once they stop, each has at most a sixteenth of the bound uncounted, so up to four
// writers end within it. Evicting a block clears its map entry and punches a hole in the
// data file under the entry's lock (disk_cache.hpp says why that is safe for readers in any
// process); an object left with no block and open nowhere loses its files.
// Thread-safety: all methods may be called concurrently.
#ifndef CKPTFS_REMOTE_DISK_CACHE_BUDGET_HPP_
#define CKPTFS_REMOTE_DISK_CACHE_BUDGET_HPP_

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

namespace ckptfs {

class DiskCacheBudget {
 public:
  // `max_bytes` 0: unbounded (Wrote never evicts).
  DiskCacheBudget(std::string folder, uint64_t max_bytes);
  ~DiskCacheBudget();
  DiskCacheBudget(const DiskCacheBudget&) = delete;
  DiskCacheBudget& operator=(const DiskCacheBudget&) = delete;

  // Hears of `bytes` just written to the folder; may run an eviction pass in this thread.
  void Wrote(uint64_t bytes);

  // One pass now: when the folder's cache files take more than the bound, evicts least
  // recently used blocks until they take at most three quarters of it. Returns the bytes they
  // take afterwards.
  uint64_t EvictNow();

  // The bytes the folder's cache files take on disk.
  static uint64_t Measure(const std::string& folder);

 private:
  const std::string folder_;
  const uint64_t max_bytes_;
  const uint64_t check_every_;
  std::atomic<uint64_t> since_check_{0};
  std::mutex pass_mu_;  // one pass at a time in this process
};

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_DISK_CACHE_BUDGET_HPP_
