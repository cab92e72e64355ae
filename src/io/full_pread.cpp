#include "io/full_pread.hpp"

#include <unistd.h>

#include <cerrno>

namespace ckptfs {

Status PreadFull(int fd, void* out, size_t length, uint64_t offset, std::string_view name, size_t* done) {
  char* const dst = static_cast<char*>(out);
  *done = 0;
  while (*done < length) {
    const ssize_t n = ::pread(fd, dst + *done, length - *done, static_cast<off_t>(offset + *done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(name, "read failed", errno);
    }
    if (n == 0) break;
    *done += static_cast<size_t>(n);
  }
  return Status::OK();
}

Status WriteFull(int fd, const void* data, size_t length, std::string_view name) {
  const char* src = static_cast<const char*>(data);
  while (length > 0) {
    const ssize_t n = ::write(fd, src, length);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::FromErrno(name, "write failed", n < 0 ? errno : EIO);
    src += n;
    length -= static_cast<size_t>(n);
  }
  return Status::OK();
}

}  // namespace ckptfs
