// DiskCache: fetched blocks of one remote object in a cache folder, so a remount (or another
// process) reads them from disk instead of the network. An object's files are named by the
// hash of its URL and of its ETag and size: a changed object gets new files and can never be
// served from the old ones. A block is marked present only after its bytes are written.
// Thread-safety: all methods may be called concurrently.
#ifndef CKPTFS_REMOTE_DISK_CACHE_HPP_
#define CKPTFS_REMOTE_DISK_CACHE_HPP_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ckptfs/status.hpp"

namespace ckptfs {

class DiskCache {
 public:
  // Opens (creating) the cache files of the object `url` with identity `etag`/`size`, cut
  // into blocks of `block_bytes`. A cache that cannot be used is an error naming the folder.
  static Status Open(const std::string& folder, const std::string& url, const std::string& etag, uint64_t size,
                     uint64_t block_bytes, std::unique_ptr<DiskCache>* out);
  ~DiskCache();
  DiskCache(const DiskCache&) = delete;
  DiskCache& operator=(const DiskCache&) = delete;

  // Whether blocks [first, last] are all present.
  bool Has(uint64_t first, uint64_t last) const;
  // Reads `length` bytes at `offset` (inside present blocks).
  Status Read(uint64_t offset, size_t length, char* out) const;
  // Stores bytes [offset, offset+length) that cover blocks [first, last] whole (the last
  // block may end at the object's end), then marks them present. Failures are ignored: the
  // cache is an optimization, the network stays the source of truth.
  void Write(uint64_t offset, size_t length, const char* data, uint64_t first, uint64_t last);

 private:
  DiskCache(std::string path, int data_fd, int map_fd, std::vector<uint8_t> map)
      : path_(std::move(path)), data_fd_(data_fd), map_fd_(map_fd), present_(std::move(map)) {}
  std::string path_;
  int data_fd_;
  int map_fd_;
  mutable std::mutex mu_;
  std::vector<uint8_t> present_;  // one byte per block, as in the map file
};

}  // namespace ckptfs

#endif  // CKPTFS_REMOTE_DISK_CACHE_HPP_
