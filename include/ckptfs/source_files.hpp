// The source files a checkpoint is made of: opened once through an Env, numbered, and read
// at offsets. Bounds are checked here, once, for every kind of source; each read of tensor
// data is preceded by SourceFile::CheckUnchanged where it matters (the View does it once per
// file per read), so a replaced or rewritten file never yields bytes of another.
// Thread-safety: all const methods may be called concurrently.
#ifndef CKPTFS_SOURCE_FILES_HPP_
#define CKPTFS_SOURCE_FILES_HPP_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ckptfs/env.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// A byte range of a source file that holds one archive or record: [base, base+length).
// A whole file is {file, 0, size}. Parsers work inside a window and report offsets
// relative to the file, so a torch.save archive stored inside a larger file (a DCP chunk)
// reads the same way as one stored on its own.
struct FileWindow {
  uint32_t file = 0;
  uint64_t base = 0;
  uint64_t length = 0;
};

class SourceFiles {
 public:
  explicit SourceFiles(std::shared_ptr<Env> env = Env::Local()) : env_(std::move(env)) {}
  SourceFiles(const SourceFiles&) = delete;
  SourceFiles& operator=(const SourceFiles&) = delete;

  Env& env() const { return *env_; }
  const std::shared_ptr<Env>& shared_env() const { return env_; }

  // Opens `path` through the Env and returns its index through `index`. Opening the same
  // path twice returns the first index. Not thread-safe (readers call it while building).
  Status Add(const std::string& path, uint32_t* index);

  size_t count() const { return files_.size(); }
  const SourceFile& file(uint32_t index) const { return *files_[index]; }
  const std::string& path(uint32_t index) const { return files_[index]->name(); }
  const FileIdentity& identity(uint32_t index) const { return files_[index]->identity(); }
  uint64_t size(uint32_t index) const { return files_[index]->size(); }
  // The whole file as a window.
  FileWindow whole(uint32_t index) const { return FileWindow{index, 0, size(index)}; }
  // "path" for a whole file, "path [bytes B..E)" for part of one: how messages name a window.
  std::string Describe(const FileWindow& window) const;

  // kCorruption unless [offset, offset+length) lies within file `index`: the one bounds
  // check of every source read (ReadExact makes it; readers that reach a file by another
  // route, such as the device loader's O_DIRECT descriptors, make it first).
  Status CheckBounds(uint32_t index, uint64_t offset, uint64_t length) const;

  // Reads exactly `length` bytes at `offset`. Reading past the recorded size is
  // kCorruption (the caller's offsets were wrong); a short read, or a file whose identity
  // changed, is kSourceChanged.
  Status ReadExact(uint32_t index, uint64_t offset, size_t length, void* out) const;

  Status CheckUnchanged(uint32_t index) const { return files_[index]->CheckUnchanged(); }

 private:
  std::shared_ptr<Env> env_;
  std::vector<std::unique_ptr<SourceFile>> files_;
};

}  // namespace ckptfs

#endif  // CKPTFS_SOURCE_FILES_HPP_
