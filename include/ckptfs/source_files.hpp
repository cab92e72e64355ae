// The set of source files a checkpoint is made of, opened once and read with pread.
//
// Each file's identity (device, inode, size, mtime, ctime) is recorded when it is opened.
// Every read re-checks it, so a file replaced or rewritten under ckptfs makes reads
// fail with kSourceChanged instead of returning bytes of a different file.
// Thread-safety: all const methods may be called concurrently.
#ifndef CKPTFS_SOURCE_FILES_HPP_
#define CKPTFS_SOURCE_FILES_HPP_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ckptfs/status.hpp"

namespace ckptfs {

struct FileIdentity {
  uint64_t dev = 0;
  uint64_t ino = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  // ctime cannot be set back by any process: it catches a rewrite whose mtime was restored.
  int64_t ctime_ns = 0;
  bool operator==(const FileIdentity&) const = default;
};

class SourceFiles {
 public:
  SourceFiles() = default;
  SourceFiles(const SourceFiles&) = delete;
  SourceFiles& operator=(const SourceFiles&) = delete;
  ~SourceFiles();

  // Opens `path` read-only and returns its index through `index`. Opening the same
  // path twice returns the first index.
  Status Add(const std::string& path, uint32_t* index);

  size_t count() const { return files_.size(); }
  const std::string& path(uint32_t index) const { return files_[index].path; }
  const FileIdentity& identity(uint32_t index) const { return files_[index].identity; }
  uint64_t size(uint32_t index) const { return files_[index].identity.size; }

  // Reads exactly `length` bytes at `offset`. Reading past the recorded size is
  // kCorruption (the caller's offsets were wrong); a short read, or a file whose
  // identity changed, is kSourceChanged.
  Status ReadExact(uint32_t index, uint64_t offset, size_t length, void* out) const;

  // Compares the file on disk (by path, and through the open descriptor) with the
  // identity recorded at open.
  Status CheckUnchanged(uint32_t index) const;

 private:
  struct File {
    std::string path;
    int fd = -1;
    FileIdentity identity;
  };
  std::vector<File> files_;
};

}  // namespace ckptfs

#endif  // CKPTFS_SOURCE_FILES_HPP_
