// Format detection: which reader a source path needs.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "format/limit_hint.hpp"
#include "format/readers.hpp"

namespace ckptfs {
namespace {

// Reads up to 16 leading bytes of `path` to tell the formats apart.
Status Sniff(const std::string& path, std::string* head) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::FromErrno(path, "cannot open", errno);
  char buf[16];
  ssize_t n = ::pread(fd, buf, sizeof buf, 0);
  int err = errno;
  ::close(fd);
  if (n < 0) return Status::FromErrno(path, "cannot read", err);
  head->assign(buf, static_cast<size_t>(n));
  return Status::OK();
}

}  // namespace

Status OpenCatalog(const std::string& source, const SourceOptions& options, std::shared_ptr<const Catalog>* out) {
  auto catalog = std::make_shared<Catalog>();
  catalog->source = source;
  struct stat st;
  if (::stat(source.c_str(), &st) != 0) return Status::FromErrno(source, "cannot access", errno);
  if (S_ISDIR(st.st_mode)) {
    CKPTFS_RETURN_IF_ERROR(IsDeepSpeedFolder(source) ? ReadDeepSpeedCheckpoint(source, options, catalog.get())
                                                     : ReadCheckpointFolder(source, catalog.get(), options.limits));
  } else if (S_ISREG(st.st_mode)) {
    std::string head;
    CKPTFS_RETURN_IF_ERROR(Sniff(source, &head));
    if (head.size() >= 4 && head.compare(0, 4, "PK\x03\x04", 4) == 0) {
      catalog->format = "torch-zip";
      CKPTFS_RETURN_IF_ERROR(ReadTorchZip(source, catalog.get(), &catalog->metadata, options.limits));
    } else if ((head.size() >= 9 && head[8] == '{') ||
               (source.size() > 12 && source.compare(source.size() - 12, 12, ".safetensors") == 0)) {
      // By content, or by name so that a damaged header gets a safetensors error message.
      catalog->format = "safetensors";
      CKPTFS_RETURN_IF_ERROR(ReadSafetensorsFile(source, catalog.get(), &catalog->metadata, options.limits));
    } else if (!head.empty() && static_cast<uint8_t>(head[0]) == 0x80) {
      return Status::NotSupported(source, "legacy (pre-1.6) torch.save format; re-save it with a newer torch");
    } else {
      return Status::InvalidArgument(source, "not a recognized checkpoint (expected a torch zip or safetensors file)");
    }
  } else {
    return Status::InvalidArgument(source, "not a file or folder");
  }
  // Every reader bounds what it parses; this also covers formats whose tensors come from
  // several files (folders, ZeRO ranks).
  if (catalog->tensors.size() > options.limits.tensors)
    return Status::Refused(source, std::to_string(catalog->tensors.size()) + " tensors, over the limit of " +
                                       std::to_string(options.limits.tensors) + LimitHint("max_tensors"));
  // Nothing reads a tensor whose boxes do not tile it exactly inside their files.
  for (const TensorEntry& t : catalog->tensors) CKPTFS_RETURN_IF_ERROR(ValidateLayout(t, *catalog->files, source));
  *out = std::move(catalog);
  return Status::OK();
}

}  // namespace ckptfs
