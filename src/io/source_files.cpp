#include "ckptfs/source_files.hpp"

namespace ckptfs {

Status SourceFiles::Add(const std::string& path, uint32_t* index) {
  for (uint32_t i = 0; i < files_.size(); ++i) {
    if (files_[i]->name() == path) {
      *index = i;
      return Status::OK();
    }
  }
  std::unique_ptr<SourceFile> file;
  CKPTFS_RETURN_IF_ERROR(env_->Open(path, &file));
  files_.push_back(std::move(file));
  *index = static_cast<uint32_t>(files_.size() - 1);
  return Status::OK();
}

std::string SourceFiles::Describe(const FileWindow& window) const {
  const std::string& name = path(window.file);
  if (window.base == 0 && window.length == size(window.file)) return name;
  return name + " [bytes " + std::to_string(window.base) + ".." + std::to_string(window.base + window.length) + ")";
}

Status SourceFiles::CheckBounds(uint32_t index, uint64_t offset, uint64_t length) const {
  const uint64_t file_size = size(index);
  if (offset > file_size || length > file_size - offset)
    return Status::Corruption(path(index), "read of " + std::to_string(length) + " bytes at offset " +
                                               std::to_string(offset) + " is past the end of the file (" +
                                               std::to_string(file_size) + " bytes)");
  return Status::OK();
}

Status SourceFiles::ReadExact(uint32_t index, uint64_t offset, size_t length, void* out) const {
  CKPTFS_RETURN_IF_ERROR(CheckBounds(index, offset, length));
  return files_[index]->Read(offset, length, out);
}

}  // namespace ckptfs
