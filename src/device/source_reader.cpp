#include "device/source_reader.hpp"

#include <unistd.h>

#include <cerrno>

#include "device/plan.hpp"
#include "io/full_pread.hpp"
#include "io/source_changed.hpp"

namespace ckptfs::device {

SourceReader::SourceReader(const SourceFiles& files, bool direct_io)
    : files_(files), want_direct_(direct_io), handles_(files.count()) {}

SourceReader::~SourceReader() {
  for (auto& h : handles_)
    if (h && h->fd >= 0) ::close(h->fd);
}

Status SourceReader::Open(uint32_t file) {
  // Files that have no local path (memory, remote) are read through SourceFiles.
  if (handles_[file] || files_.file(file).local_path().empty()) return Status::OK();
  auto h = std::make_unique<Handle>();
  bool direct = false;
  CKPTFS_RETURN_IF_ERROR(OpenLocalDescriptor(files_.file(file), want_direct_, &h->fd, &direct));
  h->direct = direct;
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
  CKPTFS_RETURN_IF_ERROR(files_.CheckBounds(file, offset, length));
  CKPTFS_RETURN_IF_ERROR(files_.CheckUnchanged(file));
  const uint64_t a0 = AlignDown(offset);
  Handle* h = handles_[file].get();
  if (h && h->direct) {
    const uint64_t want = AlignUp(offset + length) - a0;
    const uint64_t need = offset + length - a0;
    size_t done = 0;
    if (Status s = PreadFull(h->fd, buf, want, a0, path, &done); !s.ok()) {
      if (s.sys_errno() != EINVAL || done != 0) return s;
      // The file system took O_DIRECT at open but not this read: buffered from now on.
      h->direct = false;
    }
    if (h->direct) {
      *bytes_read = done;
      if (done < need) return ShorterThanIndexed(path);
      return Status::OK();
    }
  }
  // Buffered: through the catalog's own SourceFile (checked unchanged above).
  *bytes_read = length;
  return files_.ReadExact(file, offset, length, buf + (offset - a0));
}

}  // namespace ckptfs::device
