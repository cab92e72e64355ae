// The reader registry: the readers in the order detection tries them, and what they share.
#include "format/registry.hpp"

#include <algorithm>

#include "format/readers.hpp"

namespace ckptfs {

// Folders first (a folder is tried as a DeepSpeed universal checkpoint, then DeepSpeed, then
// DCP, then DCP Hugging Face shards, then veRL, then torch.save rank files, then a folder
// with subfolders, then a model folder, which takes any folder), then files: a weight index
// (the model folder reader), the zip-based torch formats (TorchScript and torch.export before
// the plain zip they also are), safetensors, the legacy torch stream.
// Each entry is defined in its reader's file, in its family's folder: deepspeed/
// (zero_universal.cpp, zero.cpp), dcp/ (dcp.cpp, dcp_hf_shards.cpp), verl/verl.cpp, torch/
// (torch_ranks.cpp, torchscript.cpp, torch_export.cpp, torch.cpp, torch_legacy.cpp),
// safetensors/ (folder_tree.cpp, folder.cpp, safetensors.cpp).
extern const ReaderEntry kDeepSpeedUniversalReader, kDeepSpeedReader, kDcpReader, kDcpHfShardsReader, kVerlReader,
    kTorchRanksReader, kFolderTreeReader, kCheckpointFolderReader, kTorchScriptReader, kTorchExportReader, kTorchZipReader,
    kSafetensorsReader, kTorchLegacyReader;

namespace {

constexpr const ReaderEntry* kReaders[] = {
    &kDeepSpeedUniversalReader, &kDeepSpeedReader,   &kDcpReader,         &kDcpHfShardsReader,
    &kVerlReader,               &kTorchRanksReader,  &kFolderTreeReader,  &kCheckpointFolderReader,
    &kTorchScriptReader,        &kTorchExportReader, &kTorchZipReader,    &kSafetensorsReader, &kTorchLegacyReader,
};

}  // namespace

std::span<const ReaderEntry* const> Readers() { return kReaders; }

std::string ReaderStamp(std::string_view format) {
  for (const ReaderEntry* r : kReaders)
    if (!format.empty() && std::find(std::begin(r->formats), std::end(r->formats), format) != std::end(r->formats))
      return std::string("ckptfs ") + CKPTFS_VERSION + "; readers " + kReaderCodeStamp;
  return "";
}

bool SourceProbe::NameEndsWith(std::string_view suffix) const {
  return source_.size() > suffix.size() && std::string_view(source_).substr(source_.size() - suffix.size()) == suffix;
}

Status SourceProbe::Head(std::string_view* out) {
  if (!head_) {
    uint32_t file;
    CKPTFS_RETURN_IF_ERROR(files()->Add(source_, &file));
    std::string head(std::min<uint64_t>(512, files()->size(file)), '\0');
    CKPTFS_RETURN_IF_ERROR(files()->ReadExact(file, 0, head.size(), head.data()));
    head_ = std::move(head);
  }
  *out = *head_;
  return Status::OK();
}

Status SourceProbe::HeadStartsWith(std::string_view magic, bool* starts) {
  std::string_view head;
  CKPTFS_RETURN_IF_ERROR(Head(&head));
  *starts = head.substr(0, magic.size()) == magic;
  return Status::OK();
}

Status SourceProbe::TorchZipKind(std::string_view* kind) {
  if (!zip_kind_) {
    std::string found;
    CKPTFS_RETURN_IF_ERROR(ckptfs::TorchZipKind(source_, files(), &found, &zip_));
    zip_kind_ = std::move(found);
  }
  *kind = *zip_kind_;
  return Status::OK();
}

}  // namespace ckptfs
