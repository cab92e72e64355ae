// The parts of Env and SourceFile that every kind of source shares.
#include "ckptfs/env.hpp"

#include <cerrno>
#include <utility>

namespace ckptfs {

const std::string& SourceFile::local_path() const {
  static const std::string kNone;
  return kNone;
}

Status Env::ReadSmallFile(const std::string& path, uint64_t max_bytes, std::string* out, std::string_view what,
                          std::string_view limit_option) {
  std::unique_ptr<SourceFile> file;
  CKPTFS_RETURN_IF_ERROR(Open(path, &file));
  const uint64_t size = file->size();
  if (size > max_bytes)
    return Status::Refused(path, std::string(what) + " is " + std::to_string(size) + " bytes, over the limit of " +
                                     std::to_string(max_bytes))
        .WithLimitOption(limit_option);
  out->resize(size);
  return file->Read(0, size, out->data());
}

namespace {

// A file read whole into memory: MapFile of an Env that cannot map.
class ReadFile final : public MappedFile {
 public:
  explicit ReadFile(std::string bytes) : bytes_(std::move(bytes)) {}
  std::string_view bytes() const override { return bytes_; }

 private:
  std::string bytes_;
};

}  // namespace

Status Env::MapFile(const std::string& path, std::unique_ptr<MappedFile>* out) {
  std::unique_ptr<SourceFile> file;
  CKPTFS_RETURN_IF_ERROR(Open(path, &file));
  std::string bytes(file->size(), '\0');
  CKPTFS_RETURN_IF_ERROR(file->Read(0, bytes.size(), bytes.data()));
  *out = std::make_unique<ReadFile>(std::move(bytes));
  return Status::OK();
}

Status Env::CreateFolders(const std::string& path) {
  return Status::NotSupported(path, "this source's file system takes no writes");
}

Status Env::WriteFileAtomically(const std::string& path, std::string_view) {
  return Status::NotSupported(path, "this source's file system takes no writes");
}

Status FolderNotListable(std::string_view path) {
  return Status::FromErrno(path, "the source gives no folder listing", EOPNOTSUPP);
}

bool IsFolderNotListable(const Status& status) {
  return status.code() == Status::Code::kIOError && status.ToErrno() == EOPNOTSUPP;
}

std::string JoinPath(std::string_view folder, std::string_view name) {
  std::string path;
  path.reserve(folder.size() + 1 + name.size());
  if (!folder.empty()) {
    path.append(folder);
    if (folder.back() != '/') path.push_back('/');
  }
  path.append(name);
  return path;
}

}  // namespace ckptfs
