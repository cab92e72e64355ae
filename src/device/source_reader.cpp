#include "device/source_reader.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "device/plan.hpp"

namespace ckptfs::device {

SourceReader::SourceReader(const SourceFiles& files, bool direct_io)
    : files_(files), want_direct_(direct_io), handles_(files.count()) {}

SourceReader::~SourceReader() {
  for (auto& h : handles_)
    if (h && h->fd >= 0) ::close(h->fd);
}

Status SourceReader::Open(uint32_t file) {
  if (handles_[file]) return Status::OK();
  auto h = std::make_unique<Handle>();
  const std::string& path = files_.path(file);
  int fd = -1;
  if (want_direct_) {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (fd >= 0) h->direct = true;
  }
  if (fd < 0) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::SourceChanged(path, "file was removed since it was indexed");
    return Status::FromErrno(path, "cannot open", errno);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::FromErrno(path, "cannot stat", err);
  }
  const FileIdentity& id = files_.identity(file);
  if (st.st_dev != id.dev || st.st_ino != id.ino || static_cast<uint64_t>(st.st_size) != id.size) {
    ::close(fd);
    return Status::SourceChanged(path, "file was replaced since it was indexed");
  }
  h->fd = fd;
  handles_[file] = std::move(h);
  return Status::OK();
}

int SourceReader::fd(uint32_t file) const { return handles_[file] ? handles_[file]->fd : -1; }
bool SourceReader::is_direct(uint32_t file) const { return handles_[file] && handles_[file]->direct; }
bool SourceReader::any_direct() const {
  for (const auto& h : handles_)
    if (h && h->direct) return true;
  return false;
}

Status SourceReader::Read(uint32_t file, uint64_t offset, uint64_t length, char* buf, uint64_t* bytes_read) const {
  *bytes_read = 0;
  const std::string& path = files_.path(file);
  const uint64_t size = files_.size(file);
  if (offset > size || length > size - offset)
    return Status::Corruption(path, "read of " + std::to_string(length) + " bytes at offset " + std::to_string(offset) +
                                        " is past the end of the file (" + std::to_string(size) + " bytes)");
  CKPTFS_RETURN_IF_ERROR(files_.CheckUnchanged(file));
  const uint64_t a0 = AlignDown(offset);
  Handle* h = handles_[file].get();
  if (h && h->direct) {
    const uint64_t want = AlignUp(offset + length) - a0;
    const uint64_t need = offset + length - a0;
    uint64_t done = 0;
    while (done < want) {
      ssize_t n = ::pread(h->fd, buf + done, want - done, static_cast<off_t>(a0 + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EINVAL && done == 0) {
          // The file system took O_DIRECT at open but not this read: buffered from now on.
          h->direct = false;
          break;
        }
        return Status::FromErrno(path, "read failed", errno);
      }
      if (n == 0) break;  // end of file
      done += static_cast<uint64_t>(n);
    }
    if (h->direct) {
      *bytes_read = done;
      if (done < need) return Status::SourceChanged(path, "file is shorter than when it was indexed");
      return Status::OK();
    }
  }
  // Buffered: the catalog's own descriptor reads the same file (checked unchanged above).
  *bytes_read = length;
  return files_.ReadExact(file, offset, length, buf + (offset - a0));
}

}  // namespace ckptfs::device
