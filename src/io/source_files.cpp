#include "ckptfs/source_files.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace ckptfs {
namespace {

FileIdentity IdentityOf(const struct stat& st) {
  FileIdentity id;
  id.dev = st.st_dev;
  id.ino = st.st_ino;
  id.size = static_cast<uint64_t>(st.st_size);
  id.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  id.ctime_ns = static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  return id;
}

}  // namespace

SourceFiles::~SourceFiles() {
  for (auto& f : files_)
    if (f.fd >= 0) ::close(f.fd);
}

Status SourceFiles::Add(const std::string& path, uint32_t* index) {
  for (uint32_t i = 0; i < files_.size(); ++i) {
    if (files_[i].path == path) {
      *index = i;
      return Status::OK();
    }
  }
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(path, "cannot open", errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return Status::FromErrno(path, "cannot stat", err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path, "not a regular file");
  }
  files_.push_back(File{path, fd, IdentityOf(st)});
  *index = static_cast<uint32_t>(files_.size() - 1);
  return Status::OK();
}

Status SourceFiles::ReadExact(uint32_t index, uint64_t offset, size_t length, void* out) const {
  const File& f = files_[index];
  if (offset > f.identity.size || length > f.identity.size - offset) {
    return Status::Corruption(f.path, "read of " + std::to_string(length) + " bytes at offset " +
                                          std::to_string(offset) + " is past the end of the file (" +
                                          std::to_string(f.identity.size) + " bytes)");
  }
  char* dst = static_cast<char*>(out);
  size_t done = 0;
  while (done < length) {
    ssize_t n = ::pread(f.fd, dst + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(f.path, "read failed", errno);
    }
    if (n == 0) return Status::SourceChanged(f.path, "file is shorter than when it was indexed");
    done += static_cast<size_t>(n);
  }
  return Status::OK();
}

Status SourceFiles::CheckUnchanged(uint32_t index) const {
  const File& f = files_[index];
  struct stat st;
  if (::fstat(f.fd, &st) != 0) return Status::FromErrno(f.path, "cannot stat", errno);
  if (!(IdentityOf(st) == f.identity))
    return Status::SourceChanged(f.path, "file changed since it was indexed (size, mtime or ctime differ)");
  if (::stat(f.path.c_str(), &st) != 0 || IdentityOf(st).ino != f.identity.ino ||
      IdentityOf(st).dev != f.identity.dev)
    return Status::SourceChanged(f.path, "file was replaced since it was indexed");
  return Status::OK();
}

}  // namespace ckptfs
