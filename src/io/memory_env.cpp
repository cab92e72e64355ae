#include "io/memory_env.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "io/source_changed.hpp"

namespace ckptfs {

// Each write of a file gets a new generation: it plays the part of the inode number, so a
// file opened before a replacement can tell that its name now holds another file.
struct MemoryEnv::Tree {
  struct File {
    std::shared_ptr<const std::string> bytes;
    uint64_t generation = 0;
  };
  std::mutex mutex;
  std::map<std::string, File> files;
  std::set<std::string> folders;
  uint64_t next_generation = 1;

  // The generation of file `path` now; 0 when there is none.
  uint64_t GenerationOf(const std::string& path) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = files.find(path);
    return it == files.end() ? 0 : it->second.generation;
  }
};

namespace {

// The folder holding `path`: "a/b" for "a/b/c", "/" for "/c", "" for "c".
std::string ParentOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return "";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// `path` and the folders above it, innermost first.
std::vector<std::string> SelfAndAncestors(const std::string& path) {
  std::vector<std::string> out;
  for (std::string p = path; !p.empty(); p = ParentOf(p)) {
    out.push_back(p);
    if (p == "/") break;
  }
  return out;
}

const std::string& PathOf(const std::string& folder) { return folder; }
template <typename V>
const std::string& PathOf(const std::pair<const std::string, V>& file) { return file.first; }

// Appends the entries of `paths` (a sorted set or map of paths) directly under `prefix`.
template <typename SortedPaths>
void AddChildren(const SortedPaths& paths, const std::string& prefix, PathType type, std::vector<FolderEntry>* out) {
  for (auto it = paths.lower_bound(prefix); it != paths.end(); ++it) {
    const std::string& child = PathOf(*it);
    if (child.compare(0, prefix.size(), prefix) != 0) break;
    if (child.size() > prefix.size() && child.find('/', prefix.size()) == std::string::npos)
      out->push_back(FolderEntry{child.substr(prefix.size()), type});
  }
}

}  // namespace

class MemoryEnv::OpenFile final : public SourceFile {
 public:
  OpenFile(std::shared_ptr<Tree> tree, std::string path, std::shared_ptr<const std::string> bytes,
           uint64_t generation)
      : tree_(std::move(tree)), path_(std::move(path)), bytes_(std::move(bytes)) {
    identity_.ino = generation;
    identity_.size = bytes_->size();
  }

  const std::string& name() const override { return path_; }
  const FileIdentity& identity() const override { return identity_; }

  // The bytes as they were at open: a replacement is reported by CheckUnchanged, never read.
  Status Read(uint64_t offset, size_t length, void* out) const override {
    if (offset > bytes_->size() || length > bytes_->size() - offset) return ShorterThanIndexed(path_);
    std::memcpy(out, bytes_->data() + offset, length);
    return Status::OK();
  }

  Status CheckUnchanged() const override {
    if (tree_->GenerationOf(path_) != identity_.ino) return ReplacedSinceIndexed(path_);
    return Status::OK();
  }

 private:
  std::shared_ptr<Tree> tree_;
  std::string path_;
  std::shared_ptr<const std::string> bytes_;
  FileIdentity identity_;
};

MemoryEnv::MemoryEnv() : tree_(std::make_shared<Tree>()) {}

Status MemoryEnv::WriteFile(const std::string& path, std::string bytes) {
  std::lock_guard<std::mutex> lock(tree_->mutex);
  if (tree_->folders.count(path)) return Status::InvalidArgument(path, "is a folder");
  const std::vector<std::string> ancestors = SelfAndAncestors(ParentOf(path));
  for (const std::string& folder : ancestors)
    if (tree_->files.count(folder)) return Status::InvalidArgument(path, "lies under file " + folder);
  tree_->folders.insert(ancestors.begin(), ancestors.end());
  tree_->files[path] = Tree::File{std::make_shared<const std::string>(std::move(bytes)), tree_->next_generation++};
  return Status::OK();
}

Status MemoryEnv::RemoveFile(const std::string& path) {
  std::lock_guard<std::mutex> lock(tree_->mutex);
  if (tree_->files.erase(path) == 0) return Status::FromErrno(path, "cannot remove", ENOENT);
  return Status::OK();
}

Status MemoryEnv::AddFolder(const std::string& path) {
  std::lock_guard<std::mutex> lock(tree_->mutex);
  const std::vector<std::string> folders = SelfAndAncestors(path);
  for (const std::string& folder : folders)
    if (tree_->files.count(folder)) return Status::InvalidArgument(path, "lies under file " + folder);
  tree_->folders.insert(folders.begin(), folders.end());
  return Status::OK();
}

Status MemoryEnv::Open(const std::string& path, std::unique_ptr<SourceFile>* out) {
  std::lock_guard<std::mutex> lock(tree_->mutex);
  auto it = tree_->files.find(path);
  if (it == tree_->files.end()) {
    if (tree_->folders.count(path)) return Status::InvalidArgument(path, "not a regular file");
    return Status::FromErrno(path, "cannot open", ENOENT);
  }
  *out = std::make_unique<OpenFile>(tree_, path, it->second.bytes, it->second.generation);
  return Status::OK();
}

Status MemoryEnv::Stat(const std::string& path, PathType* type) {
  std::lock_guard<std::mutex> lock(tree_->mutex);
  if (tree_->files.count(path)) *type = PathType::kFile;
  else if (tree_->folders.count(path)) *type = PathType::kFolder;
  else *type = PathType::kMissing;
  return Status::OK();
}

Status MemoryEnv::ListFolder(const std::string& path, std::vector<FolderEntry>* out) {
  out->clear();
  std::lock_guard<std::mutex> lock(tree_->mutex);
  if (!tree_->folders.count(path))
    return Status::FromErrno(path, "cannot open folder", tree_->files.count(path) ? ENOTDIR : ENOENT);
  // "/" + name for the root, "<path>/" + name below it.
  const std::string prefix = path == "/" ? path : path + "/";
  AddChildren(tree_->files, prefix, PathType::kFile, out);
  AddChildren(tree_->folders, prefix, PathType::kFolder, out);
  std::sort(out->begin(), out->end(), [](const FolderEntry& a, const FolderEntry& b) { return a.name < b.name; });
  return Status::OK();
}

}  // namespace ckptfs
