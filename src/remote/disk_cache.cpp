#include "remote/disk_cache.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>

namespace ckptfs {
namespace {

std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

bool PreadAll(int fd, char* out, size_t length, uint64_t offset) {
  size_t done = 0;
  while (done < length) {
    ssize_t n = ::pread(fd, out + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
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

}  // namespace

Status DiskCache::Open(const std::string& folder, const std::string& url, const std::string& etag, uint64_t size,
                       uint64_t block_bytes, std::unique_ptr<DiskCache>* out) {
  if (::mkdir(folder.c_str(), 0700) != 0 && errno != EEXIST)
    return Status::FromErrno(folder, "cannot create the cache folder", errno);
  const std::string identity = etag + "\n" + std::to_string(size) + "\n" + std::to_string(block_bytes);
  const std::string base = folder + "/" + Hex64(XXH3_64bits(url.data(), url.size())) + "-" +
                           Hex64(XXH3_64bits(identity.data(), identity.size()));
  const int data_fd = ::open((base + ".data").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (data_fd < 0) return Status::FromErrno(folder, "cannot write to the cache folder", errno);
  const int map_fd = ::open((base + ".map").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (map_fd < 0) {
    const int err = errno;
    ::close(data_fd);
    return Status::FromErrno(folder, "cannot write to the cache folder", err);
  }
  const uint64_t blocks = (size + block_bytes - 1) / block_bytes;
  std::vector<uint8_t> map(blocks, 0);
  // A map shorter than the object (a cache written by an interrupted run) counts its
  // missing tail as absent.
  struct stat st;
  if (::fstat(map_fd, &st) == 0 && st.st_size > 0) {
    const size_t have = std::min<uint64_t>(blocks, static_cast<uint64_t>(st.st_size));
    if (!PreadAll(map_fd, reinterpret_cast<char*>(map.data()), have, 0)) std::fill(map.begin(), map.end(), 0);
  }
  for (uint8_t& b : map) b = b == 1 ? 1 : 0;
  out->reset(new DiskCache(base, data_fd, map_fd, std::move(map)));
  return Status::OK();
}

DiskCache::~DiskCache() {
  ::close(data_fd_);
  ::close(map_fd_);
}

bool DiskCache::Has(uint64_t first, uint64_t last) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (last >= present_.size()) return false;
  for (uint64_t b = first; b <= last; ++b)
    if (!present_[b]) return false;
  return true;
}

Status DiskCache::Read(uint64_t offset, size_t length, char* out) const {
  if (!PreadAll(data_fd_, out, length, offset)) return Status::FromErrno(path_ + ".data", "cannot read the cache", EIO);
  return Status::OK();
}

void DiskCache::Write(uint64_t offset, size_t length, const char* data, uint64_t first, uint64_t last) {
  if (!PwriteAll(data_fd_, data, length, offset)) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (last >= present_.size()) return;
  std::vector<char> ones(last - first + 1, 1);
  // Data first, then the mark: a process that dies between the two leaves blocks unmarked
  // (fetched again), never marked and missing.
  if (!PwriteAll(map_fd_, ones.data(), ones.size(), first)) return;
  for (uint64_t b = first; b <= last; ++b) present_[b] = 1;
}

}  // namespace ckptfs
