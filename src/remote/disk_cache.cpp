#include "remote/disk_cache.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "io/full_pread.hpp"
#include "remote/disk_cache_budget.hpp"

namespace ckptfs {
namespace {

namespace fmt = disk_cache_format;

std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// A cache file that fails a read or ends early is a miss, whatever the cause.
bool PreadAll(int fd, char* out, size_t length, uint64_t offset) {
  size_t done = 0;
  return PreadFull(fd, out, length, offset, {}, &done).ok() && done == length;
}

bool PwriteAll(int fd, const char* data, size_t length, uint64_t offset) {
  size_t done = 0;
  while (done < length) {
    ssize_t n = ::pwrite(fd, data + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// Holds a lock taken by LockRange until it goes out of scope.
struct RangeLock {
  int fd;
  uint64_t offset, length;
  ~RangeLock() { UnlockRange(fd, offset, length); }
};

// Writes the map's header when the map is new; false when the map holds another layout or
// block size (the caller starts the object's files afresh) or cannot be written.
bool EnsureHeader(int map_fd, int data_fd, uint64_t block_bytes) {
  if (!LockRange(map_fd, 0, fmt::kHeaderBytes, /*exclusive=*/true, /*wait=*/true)) return false;
  RangeLock held{map_fd, 0, fmt::kHeaderBytes};
  char want[fmt::kHeaderBytes];
  std::memcpy(want, fmt::kMagic, 8);
  std::memcpy(want + 8, &block_bytes, 8);
  char have[fmt::kHeaderBytes];
  struct stat st;
  if (::fstat(map_fd, &st) != 0) return false;
  if (st.st_size >= static_cast<off_t>(fmt::kHeaderBytes) && PreadAll(map_fd, have, sizeof have, 0))
    if (std::memcmp(have, want, sizeof want) == 0) return true;
  // New, or not ours: no entry may claim a block, so the data goes too.
  if (st.st_size != 0 && (::ftruncate(map_fd, 0) != 0 || ::ftruncate(data_fd, 0) != 0)) return false;
  return PwriteAll(map_fd, want, sizeof want, 0);
}

}  // namespace

bool LockRange(int fd, uint64_t offset, uint64_t length, bool exclusive, bool wait) {
  struct flock fl {};
  fl.l_type = exclusive ? F_WRLCK : F_RDLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = static_cast<off_t>(offset);
  fl.l_len = static_cast<off_t>(length);
  for (;;) {
    if (::fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl) == 0) return true;
    if (errno != EINTR) return false;
  }
}

void UnlockRange(int fd, uint64_t offset, uint64_t length) {
  struct flock fl {};
  fl.l_type = F_UNLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = static_cast<off_t>(offset);
  fl.l_len = static_cast<off_t>(length);
  ::fcntl(fd, F_OFD_SETLK, &fl);
}

uint64_t DiskCacheNow() {
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  return us > 0 ? static_cast<uint64_t>(us) : 1;
}

Status DiskCache::Open(const std::string& folder, const std::string& url, const std::string& etag, uint64_t size,
                       uint64_t block_bytes, DiskCacheBudget* budget, std::unique_ptr<DiskCache>* out) {
  if (::mkdir(folder.c_str(), 0700) != 0 && errno != EEXIST)
    return Status::FromErrno(folder, "cannot create the cache folder", errno);
  // The layout's name is part of the identity: files of an older layout are never opened.
  const std::string identity =
      std::string(fmt::kMagic, 8) + "\n" + etag + "\n" + std::to_string(size) + "\n" + std::to_string(block_bytes);
  const std::string base = folder + "/" + Hex64(XXH3_64bits(url.data(), url.size())) + "-" +
                           Hex64(XXH3_64bits(identity.data(), identity.size()));
  // An eviction pass may remove the files of an object nobody has open between our open and
  // our lock: then they are unlinked once we hold the lock, and we open them again.
  for (int attempt = 0; attempt < 8; ++attempt) {
    const int data_fd = ::open((base + ".data").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (data_fd < 0) return Status::FromErrno(folder, "cannot write to the cache folder", errno);
    const int map_fd = ::open((base + ".map").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (map_fd < 0) {
      const int err = errno;
      ::close(data_fd);
      return Status::FromErrno(folder, "cannot write to the cache folder", err);
    }
    auto fail = [&](const char* what) {
      const int err = errno ? errno : EIO;
      ::close(data_fd);
      ::close(map_fd);
      return Status::FromErrno(folder, what, err);
    };
    if (!LockRange(map_fd, fmt::kOpenLockOffset, 1, /*exclusive=*/false, /*wait=*/true))
      return fail("cannot lock a file of the cache folder (does its file system support locks?)");
    struct stat data_st, map_st;
    if (::fstat(data_fd, &data_st) != 0 || ::fstat(map_fd, &map_st) != 0) return fail("cannot read the cache folder");
    if (data_st.st_nlink == 0 || map_st.st_nlink == 0) {
      ::close(data_fd);
      ::close(map_fd);
      continue;
    }
    if (!EnsureHeader(map_fd, data_fd, block_bytes)) return fail("cannot write to the cache folder");
    out->reset(new DiskCache(base, data_fd, map_fd, (size + block_bytes - 1) / block_bytes, budget));
    return Status::OK();
  }
  return Status::FromErrno(folder, "cache files keep being removed under us", EAGAIN);
}

DiskCache::~DiskCache() {
  ::close(data_fd_);
  ::close(map_fd_);  // drops the open lock
}

bool DiskCache::TryRead(uint64_t first, uint64_t last, uint64_t offset, size_t length, char* out) const {
  if (first > last || last >= blocks_) return false;
  const uint64_t n = last - first + 1;
  const uint64_t at = fmt::EntryOffset(first);
  if (!LockRange(map_fd_, at, n * fmt::kEntryBytes, /*exclusive=*/false, /*wait=*/true)) return false;
  RangeLock held{map_fd_, at, n * fmt::kEntryBytes};
  std::vector<uint64_t> entries(n);
  if (!PreadAll(map_fd_, reinterpret_cast<char*>(entries.data()), n * fmt::kEntryBytes, at)) return false;
  for (uint64_t e : entries)
    if (e == 0) return false;
  if (!PreadAll(data_fd_, out, length, offset)) return false;
  // The time of this use, for the eviction order (a failure only makes it look older).
  entries.assign(n, DiskCacheNow());
  PwriteAll(map_fd_, reinterpret_cast<const char*>(entries.data()), n * fmt::kEntryBytes, at);
  return true;
}

void DiskCache::Write(uint64_t offset, size_t length, const char* data, uint64_t first, uint64_t last) {
  if (first > last || last >= blocks_) return;
  const uint64_t n = last - first + 1;
  const uint64_t at = fmt::EntryOffset(first);
  {
    if (!LockRange(map_fd_, at, n * fmt::kEntryBytes, /*exclusive=*/true, /*wait=*/true)) return;
    RangeLock held{map_fd_, at, n * fmt::kEntryBytes};
    if (!PwriteAll(data_fd_, data, length, offset)) return;
    // Data first, then the entries: a process that dies between the two leaves the blocks
    // absent (fetched again), never present and torn.
    const std::vector<uint64_t> entries(n, DiskCacheNow());
    if (!PwriteAll(map_fd_, reinterpret_cast<const char*>(entries.data()), n * fmt::kEntryBytes, at)) return;
  }
  if (budget_) budget_->Wrote(length);
}

}  // namespace ckptfs
