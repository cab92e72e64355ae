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

}  // namespace ckptfs
