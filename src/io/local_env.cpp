// The local file system as an Env: files opened once with open(2) and read with pread(2),
// their identity taken from fstat(2) and re-checked on demand.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "ckptfs/env.hpp"
#include "io/full_pread.hpp"
#include "io/source_changed.hpp"

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

// Whether `st` describes the very file `id` was taken from (not one put in its place).
bool SameFile(const struct stat& st, const FileIdentity& id) { return st.st_dev == id.dev && st.st_ino == id.ino; }

PathType TypeOf(const struct stat& st) {
  if (S_ISREG(st.st_mode)) return PathType::kFile;
  if (S_ISDIR(st.st_mode)) return PathType::kFolder;
  return PathType::kOther;
}

class LocalFile final : public SourceFile {
 public:
  LocalFile(std::string path, int fd, const struct stat& st)
      : path_(std::move(path)),
        fd_(fd),
        identity_(IdentityOf(st)),
        access_{static_cast<uint32_t>(st.st_uid), static_cast<uint32_t>(st.st_gid),
                static_cast<uint32_t>(st.st_mode & 07777)} {}
  ~LocalFile() override { ::close(fd_); }
  LocalFile(const LocalFile&) = delete;
  LocalFile& operator=(const LocalFile&) = delete;

  const std::string& name() const override { return path_; }
  const FileIdentity& identity() const override { return identity_; }
  const std::string& local_path() const override { return path_; }
  std::optional<FileAccess> access() const override { return access_; }
  int descriptor() const override { return fd_; }

  Status Read(uint64_t offset, size_t length, void* out) const override {
    size_t done = 0;
    CKPTFS_RETURN_IF_ERROR(PreadFull(fd_, out, length, offset, path_, &done));
    return done < length ? ShorterThanIndexed(path_) : Status::OK();
  }

  // Through the descriptor: the file was not rewritten. Through the path: the name still
  // reaches it (a rename over it leaves our descriptor on the old, unchanged file).
  Status CheckUnchanged() const override {
    struct stat st;
    if (::fstat(fd_, &st) != 0) return Status::FromErrno(path_, "cannot stat", errno);
    if (!(IdentityOf(st) == identity_)) return ChangedSinceIndexed(path_);
    if (::stat(path_.c_str(), &st) != 0 || !SameFile(st, identity_)) return ReplacedSinceIndexed(path_);
    return Status::OK();
  }

 private:
  std::string path_;
  int fd_;
  FileIdentity identity_;
  FileAccess access_;
};

// A local file mapped read-only; released pages are dropped (madvise), so a file read once
// from start to end does not stay in the process's memory whole.
class MappedLocalFile final : public MappedFile {
 public:
  MappedLocalFile(void* base, size_t size) : base_(base), size_(size) {}
  ~MappedLocalFile() override {
    if (base_) ::munmap(base_, size_);
  }
  MappedLocalFile(const MappedLocalFile&) = delete;
  MappedLocalFile& operator=(const MappedLocalFile&) = delete;

  std::string_view bytes() const override { return std::string_view(static_cast<const char*>(base_), size_); }
  void Release(size_t begin, size_t end) const override {
    static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    begin = (begin + page - 1) / page * page;
    end = std::min(end, size_) / page * page;
    if (base_ && end > begin) ::madvise(static_cast<char*>(base_) + begin, end - begin, MADV_DONTNEED);
  }

 private:
  void* base_;  // null for an empty file
  size_t size_;
};

// Opens regular file `path` for reading: its descriptor in *fd (the caller closes it) and its
// status in *st.
Status OpenRegularFile(const std::string& path, int* fd, struct stat* st) {
  *fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (*fd < 0) return Status::FromErrno(path, "cannot open", errno);
  Status s;
  if (::fstat(*fd, st) != 0) s = Status::FromErrno(path, "cannot stat", errno);
  else if (!S_ISREG(st->st_mode)) s = Status::InvalidArgument(path, "not a regular file");
  if (!s.ok()) {
    ::close(*fd);
    *fd = -1;
  }
  return s;
}

class LocalEnv final : public Env {
 public:
  // The page cache is all the readahead a local file gets from the kernel's side of a mount.
  EnvTraits traits() const override { return EnvTraits{.local_files = true, .push_ahead = true}; }

  std::string CanonicalName(const std::string& path) const override {
    char resolved[PATH_MAX];
    return ::realpath(path.c_str(), resolved) ? std::string(resolved) : path;
  }

  Status Open(const std::string& path, std::unique_ptr<SourceFile>* out) override {
    int fd;
    struct stat st;
    CKPTFS_RETURN_IF_ERROR(OpenRegularFile(path, &fd, &st));
    *out = std::make_unique<LocalFile>(path, fd, st);
    return Status::OK();
  }

  Status Stat(const std::string& path, PathType* type) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      if (errno != ENOENT) return Status::FromErrno(path, "cannot access", errno);
      *type = PathType::kMissing;
      return Status::OK();
    }
    *type = TypeOf(st);
    return Status::OK();
  }

  Status ListFolder(const std::string& path, std::vector<FolderEntry>* out) override {
    out->clear();
    DIR* d = ::opendir(path.c_str());
    if (!d) return Status::FromErrno(path, "cannot open folder", errno);
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      // stat, not d_type: a symbolic link counts as what it points to.
      struct stat st;
      const PathType type = ::stat(JoinPath(path, name).c_str(), &st) == 0 ? TypeOf(st) : PathType::kMissing;
      out->push_back(FolderEntry{std::move(name), type});
    }
    ::closedir(d);
    std::sort(out->begin(), out->end(), [](const FolderEntry& a, const FolderEntry& b) { return a.name < b.name; });
    return Status::OK();
  }

  Status MapFile(const std::string& path, std::unique_ptr<MappedFile>* out) override {
    int fd;
    struct stat st;
    CKPTFS_RETURN_IF_ERROR(OpenRegularFile(path, &fd, &st));
    void* base = nullptr;
    const size_t size = static_cast<size_t>(st.st_size);
    if (size > 0) {
      base = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
      if (base == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        return Status::FromErrno(path, "cannot map", err);
      }
    }
    ::close(fd);  // the mapping holds the file
    *out = std::make_unique<MappedLocalFile>(base, size);
    return Status::OK();
  }

  Status CreateFolders(const std::string& path) override {
    std::error_code ec;
    std::filesystem::create_directories(path, ec);
    return ec ? Status::FromErrno(path, "cannot create the folder", ec.value()) : Status::OK();
  }

  // The temporary name holds the process id, so two processes writing the same file each
  // rename a whole file of their own.
  Status WriteFileAtomically(const std::string& path, std::string_view bytes) override {
    const std::string temp = path + ".tmp-" + std::to_string(::getpid());
    const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return Status::FromErrno(temp, "cannot create", errno);
    Status written = WriteFull(fd, bytes.data(), bytes.size(), temp);
    if (::close(fd) != 0 && written.ok()) written = Status::FromErrno(temp, "cannot write", errno);
    if (written.ok() && ::rename(temp.c_str(), path.c_str()) != 0)
      written = Status::FromErrno(path, "cannot rename a new file into place", errno);
    if (!written.ok()) ::unlink(temp.c_str());
    return written;
  }
};

}  // namespace

std::shared_ptr<Env> Env::Local() {
  static const std::shared_ptr<Env> env = std::make_shared<LocalEnv>();
  return env;
}

Status OpenLocalDescriptor(const SourceFile& file, bool direct, int* fd, bool* is_direct) {
  *fd = -1;
  *is_direct = false;
  const std::string& path = file.local_path();
  if (path.empty()) return Status::InvalidArgument(file.name(), "not a local file");
  int opened = -1;
  if (direct) {
    opened = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    *is_direct = opened >= 0;
  }
  if (opened < 0) opened = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (opened < 0) {
    if (errno == ENOENT) return Status::SourceChanged(path, "file was removed since it was indexed");
    return Status::FromErrno(path, "cannot open", errno);
  }
  struct stat st;
  if (::fstat(opened, &st) != 0) {
    const int err = errno;
    ::close(opened);
    return Status::FromErrno(path, "cannot stat", err);
  }
  if (!SameFile(st, file.identity()) || static_cast<uint64_t>(st.st_size) != file.size()) {
    ::close(opened);
    *is_direct = false;
    return ReplacedSinceIndexed(path);
  }
  *fd = opened;
  return Status::OK();
}

}  // namespace ckptfs
