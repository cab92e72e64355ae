// Reads of source file ranges into aligned buffers: O_DIRECT where the file system takes
// it (widened to 4 KiB, the caller trims the slack), buffered otherwise (tmpfs and other
// file systems refuse O_DIRECT with EINVAL; sources without a local path have no
// descriptor at all).
#ifndef CKPTFS_DEVICE_SOURCE_READER_HPP_
#define CKPTFS_DEVICE_SOURCE_READER_HPP_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "ckptfs/source_files.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs::device {

class SourceReader {
 public:
  SourceReader(const SourceFiles& files, bool direct_io);
  ~SourceReader();
  SourceReader(const SourceReader&) = delete;
  SourceReader& operator=(const SourceReader&) = delete;

  // Opens a descriptor of `file` for the reads below (once; not thread-safe: call before
  // reading), checking that its path still names the file that was indexed. Files without
  // a local path get none (fd() stays -1) and are read through SourceFiles.
  Status Open(uint32_t file);

  // Reads [offset, offset+length) of `file`; byte `offset` lands at
  // buf + (offset - AlignDown(offset)). `buf` is 4 KiB aligned with room for
  // AlignUp(offset+length) - AlignDown(offset) bytes. *bytes_read counts what was read
  // from the file (with alignment slack). Checks the file is unchanged first.
  Status Read(uint32_t file, uint64_t offset, uint64_t length, char* buf, uint64_t* bytes_read) const;

  // The descriptor opened for `file` (O_DIRECT when it was accepted); -1 before Open.
  int fd(uint32_t file) const;
  bool is_direct(uint32_t file) const;
  bool any_direct() const;

 private:
  struct Handle {
    int fd = -1;
    std::atomic<bool> direct{false};
  };
  const SourceFiles& files_;
  bool want_direct_;
  std::vector<std::unique_ptr<Handle>> handles_;
};

}  // namespace ckptfs::device

#endif  // CKPTFS_DEVICE_SOURCE_READER_HPP_
