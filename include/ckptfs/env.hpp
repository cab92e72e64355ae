// Env: how ckptfs reaches the bytes and folders of a checkpoint.
//
// Every read of a source — format sniffing, folder listings, index files, zip directories,
// pickles and tensor data — goes through an Env and the SourceFiles it opens, so a new kind
// of source (an HTTP server, an object store) is a new Env and nothing else changes. The
// local file system is Env::Local(); MemoryEnv (src/io/memory_env.hpp) keeps files in
// memory for unit tests and fuzz targets. Modelled on LevelDB's Env.
// Thread-safety: every method of Env and SourceFile may be called concurrently.
#ifndef CKPTFS_ENV_HPP_
#define CKPTFS_ENV_HPP_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/status.hpp"

namespace ckptfs {

// What a source file was when it was opened. Reads compare the file with it, so a file
// replaced or rewritten under ckptfs makes reads fail instead of returning other bytes.
struct FileIdentity {
  uint64_t dev = 0;
  uint64_t ino = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  // ctime cannot be set back by any process: it catches a rewrite whose mtime was restored.
  int64_t ctime_ns = 0;
  // A version string where the source has one (an HTTP ETag); empty for local files.
  std::string version;
  bool operator==(const FileIdentity&) const = default;
};

// Who may read a file, as its file system says: owner, group and permission bits.
struct FileAccess {
  uint32_t uid = 0;
  uint32_t gid = 0;
  uint32_t mode = 0;  // the permission bits (07777)
};

// One opened source file.
class SourceFile {
 public:
  virtual ~SourceFile() = default;

  // The name the user knows the file by (a path or a URL); every message uses it.
  virtual const std::string& name() const = 0;
  virtual const FileIdentity& identity() const = 0;
  uint64_t size() const { return identity().size; }

  // Reads exactly `length` bytes at `offset`. The caller has checked that the range lies
  // within size() (SourceFiles::ReadExact does); fewer bytes than that is kSourceChanged.
  virtual Status Read(uint64_t offset, size_t length, void* out) const = 0;

  // kSourceChanged when the file differs from the one that was opened.
  virtual Status CheckUnchanged() const = 0;

  // A path the operating system can open, for O_DIRECT and cuFile reads; "" when the file
  // has none (memory, remote).
  virtual const std::string& local_path() const;
  // Its owner, group and mode when it was opened, where the source has them (local files);
  // a mount serves what it makes of the file with no more access than this.
  virtual std::optional<FileAccess> access() const { return std::nullopt; }
  // The descriptor this process reads the file through, open for the file's life, where it
  // has one (local files): the very file that was indexed, for a FUSE mount to hand to the
  // kernel (passthrough); -1 otherwise.
  virtual int descriptor() const { return -1; }
};

enum class PathType : uint8_t { kMissing, kFile, kFolder, kOther };

// What an Env is, as far as anyone above the readers needs to know.
struct EnvTraits {
  // Its files are files of the local file system (SourceFile::local_path is set): their
  // identities can be recorded and checked again later (the catalog cache).
  bool local_files = false;
  // A mount should push bytes ahead of a sequential reader into the page cache. False for an
  // Env that reads ahead itself, where a push would fetch bytes nobody may read.
  bool push_ahead = false;
};

// What an Env fetched over a network so far (for remote Envs: all of this process's).
struct FetchCounters {
  uint64_t requests = 0;          // requests sent, retries included
  uint64_t bytes = 0;             // body bytes received
  uint64_t retries = 0;           // requests that were tries after a transient failure
  uint64_t disk_cache_bytes = 0;  // bytes served from the on-disk cache instead of the network
};

struct FolderEntry {
  std::string name;
  PathType type = PathType::kOther;
};

// A whole file's bytes held read-only (Env::MapFile): mapped where the Env can map, else read.
class MappedFile {
 public:
  virtual ~MappedFile() = default;
  virtual std::string_view bytes() const = 0;
  // Bytes [begin, end) are done with: the whole pages among them may leave memory (a
  // large file read once is not held whole). Safe to call from several threads.
  virtual void Release(size_t begin, size_t end) const {}
};

class Env {
 public:
  virtual ~Env() = default;

  // The local file system (one instance per process).
  static std::shared_ptr<Env> Local();

  virtual Status Open(const std::string& path, std::unique_ptr<SourceFile>* out) = 0;

  // What is at `path` (following symbolic links); kMissing, with an OK status, when
  // nothing is. Errors other than absence (permission denied) are errors.
  virtual Status Stat(const std::string& path, PathType* type) = 0;

  // The entries of folder `path`, sorted by name, without "." and "..".
  virtual Status ListFolder(const std::string& path, std::vector<FolderEntry>* out) = 0;

  // The whole content of file `path` (an index, a tag file). A file larger than
  // `max_bytes` is kRefused with "<what> is N bytes, over the limit of M", naming
  // `limit_option` (the option that raises the limit: Status::WithLimitOption).
  Status ReadSmallFile(const std::string& path, uint64_t max_bytes, std::string* out,
                       std::string_view what = "file", std::string_view limit_option = {});

  // What the Env is, for those above the readers (the open layer, the front ends) that
  // must treat sources differently without naming their kind.
  virtual EnvTraits traits() const = 0;

  // The name a long-lived user of `path` (a mount: its fsname, its catalog's source) should
  // know it by: for local files the absolute path with links resolved; `path` itself where
  // there is nothing to resolve (or it cannot be).
  virtual std::string CanonicalName(const std::string& path) const { return path; }

  // What the Env fetched so far; false (and *out untouched) for an Env that fetches nothing.
  virtual bool fetch_counters(FetchCounters* out) const { return false; }

  // The whole of file `path`, read-only; kNotFound when there is none. The default reads it
  // through Open; an Env that can map files maps them.
  virtual Status MapFile(const std::string& path, std::unique_ptr<MappedFile>* out);

  // Writing, for the files ckptfs keeps of its own (the catalog cache). An Env of sources
  // only (a URL's) has none: kNotSupported.
  // Creates folder `path` and its parents, where missing.
  virtual Status CreateFolders(const std::string& path);
  // Makes file `path` hold `bytes`: written under another name in its folder, then renamed
  // over it, so a reader finds the old file or the whole new one, never a part.
  virtual Status WriteFileAtomically(const std::string& path, std::string_view bytes);
};

// What ListFolder returns where the Env has no folder listing (a plain HTTP server); readers
// then find a folder's files by the names they expect (an index, the Hugging Face layout).
Status FolderNotListable(std::string_view path);
bool IsFolderNotListable(const Status& status);

// `folder` + "/" + `name` ("name" alone when folder is empty; no second '/' when folder
// ends with one, as a folder URL does).
std::string JoinPath(std::string_view folder, std::string_view name);

// A local file's descriptor for direct reads (the device loader's O_DIRECT and cuFile
// path): opens file.local_path() with O_DIRECT when `direct` is asked for and the file
// system takes it (*is_direct says whether it did), else without, and checks that the
// descriptor reaches the file that was indexed. The caller closes *fd.
Status OpenLocalDescriptor(const SourceFile& file, bool direct, int* fd, bool* is_direct);

}  // namespace ckptfs

#endif  // CKPTFS_ENV_HPP_
