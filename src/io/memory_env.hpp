// MemoryEnv: an Env whose files live in memory, for unit tests and fuzz targets. Sources
// of any shape (a ZeRO folder, an archive at an offset inside a larger file) are built
// without touching the disk, and replacing or removing a file behaves as on a real file
// system: files opened before keep their old bytes and report kSourceChanged.
// Paths are plain strings split at '/'; a file's parent folders exist implicitly.
// Thread-safety: every method may be called concurrently.
#ifndef CKPTFS_IO_MEMORY_ENV_HPP_
#define CKPTFS_IO_MEMORY_ENV_HPP_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/env.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

class MemoryEnv final : public Env {
 public:
  MemoryEnv();

  // Adds file `path` holding `bytes`, or replaces the file there. Fails when `path` is a
  // folder or lies under a file.
  Status WriteFile(const std::string& path, std::string bytes);
  // Removes file `path`; kNotFound when there is none.
  Status RemoveFile(const std::string& path);
  // Adds an empty folder (and its parents). Fails when `path` or a parent is a file.
  Status AddFolder(const std::string& path);

  Status Open(const std::string& path, std::unique_ptr<SourceFile>* out) override;
  Status Stat(const std::string& path, PathType* type) override;
  Status ListFolder(const std::string& path, std::vector<FolderEntry>* out) override;
  // Files only this process sees: nothing to record for a later run, nothing to push.
  EnvTraits traits() const override { return EnvTraits{}; }
  Status CreateFolders(const std::string& path) override { return AddFolder(path); }
  Status WriteFileAtomically(const std::string& path, std::string_view bytes) override {
    return WriteFile(path, std::string(bytes));
  }

 private:
  struct Tree;      // the files and folders, shared with the files opened from them
  class OpenFile;  // a SourceFile opened from the tree
  std::shared_ptr<Tree> tree_;
};

}  // namespace ckptfs

#endif  // CKPTFS_IO_MEMORY_ENV_HPP_
