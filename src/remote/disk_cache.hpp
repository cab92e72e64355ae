// DiskCache: fetched blocks of one remote object in a cache folder, so a remount (or another
// process) reads them from disk instead of the network. An object's files are named by the
// hash of its URL and of its ETag and size: a changed object gets new files and can never be
// served from the old ones.
//
// Files of one object: "<base>.data" holds the blocks at their offsets in the object (a
// sparse file), "<base>.map" a header and then, per block, when it was last used
// (microseconds since the epoch; 0: absent). Several processes may share a folder, and a
// DiskCacheBudget (disk_cache_budget.hpp) may evict blocks of any object at any time, so
// every step takes an open-file-description lock on the block's map entries:
//   write:  exclusive; data first, then the entries (a crash in between leaves the block
//           absent, never present and torn);
//   read:   shared; the entries must all be present, then the data is read, then the
//           entries get the time of this use;
//   evict:  exclusive, never waiting; the entry is cleared, then the data's hole punched.
// A block is therefore served only while no eviction can touch it, and a reader that finds
// an entry cleared (or cannot read the map) fetches from the network instead: every failure
// of the cache is a miss, never wrong bytes. Each open object also holds a shared lock on
// one byte far past its entries for its whole life, so an eviction pass removes the files of
// an emptied object only while nobody has them open.
// Thread-safety: all methods may be called concurrently; the caller never writes and reads
// the same block at once (the BlockCache lets one thread fetch a block at a time).
#ifndef CKPTFS_REMOTE_DISK_CACHE_HPP_
#define CKPTFS_REMOTE_DISK_CACHE_HPP_

#include <cstdint>
#include <memory>
#include <string>

#include "ckptfs/status.hpp"

namespace ckptfs {

class DiskCacheBudget;

// The map file's layout, shared with the eviction pass.
namespace disk_cache_format {
constexpr char kMagic[8] = {'c', 'k', 'p', 't', 'L', 'R', 'U', '1'};
constexpr uint64_t kHeaderBytes = 16;  // magic, then block_bytes (little-endian u64)
constexpr uint64_t kEntryBytes = 8;
// The byte an open object holds a shared lock on (far past any entry).
constexpr uint64_t kOpenLockOffset = uint64_t{1} << 60;
inline uint64_t EntryOffset(uint64_t block) { return kHeaderBytes + block * kEntryBytes; }
}  // namespace disk_cache_format

class DiskCache {
 public:
  // Opens (creating) the cache files of the object `url` with identity `etag`/`size`, cut
  // into blocks of `block_bytes`. A cache that cannot be used is an error naming the folder.
  // `budget` (may be null: unbounded) hears of every write and outlives the DiskCache.
  static Status Open(const std::string& folder, const std::string& url, const std::string& etag, uint64_t size,
                     uint64_t block_bytes, DiskCacheBudget* budget, std::unique_ptr<DiskCache>* out);
  ~DiskCache();
  DiskCache(const DiskCache&) = delete;
  DiskCache& operator=(const DiskCache&) = delete;

  // Reads bytes [offset, offset+length), which are blocks [first, last] whole, into `out`
  // when they are all present; false (a miss) otherwise or on any failure.
  bool TryRead(uint64_t first, uint64_t last, uint64_t offset, size_t length, char* out) const;
  // Stores bytes [offset, offset+length) that cover blocks [first, last] whole (the last
  // block may end at the object's end), then marks them present. Failures are ignored: the
  // cache is an optimization, the network stays the source of truth.
  void Write(uint64_t offset, size_t length, const char* data, uint64_t first, uint64_t last);

 private:
  DiskCache(std::string path, int data_fd, int map_fd, uint64_t blocks, DiskCacheBudget* budget)
      : path_(std::move(path)), data_fd_(data_fd), map_fd_(map_fd), blocks_(blocks), budget_(budget) {}
  std::string path_;
  int data_fd_;
  int map_fd_;
  uint64_t blocks_;
  DiskCacheBudget* budget_;
};

// Open-file-description byte-range locks on `fd` (they conflict between two opens of a file
// in one process too, and go away with the descriptor if the process dies). `wait`: block
// until granted, else fail at once when someone holds a conflicting lock.
bool LockRange(int fd, uint64_t offset, uint64_t length, bool exclusive, bool wait);
void UnlockRange(int fd, uint64_t offset, uint64_t length);
// Microseconds since the epoch, never 0 (0 marks an absent block).
uint64_t DiskCacheNow();

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_DISK_CACHE_HPP_
