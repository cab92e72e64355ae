// The reader registry: every checkpoint format ckptfs reads is one ReaderEntry, defined in its
// reader's file and listed once in registry.cpp, in the order detection tries them.
// ReadCatalog (source.cpp) walks the list; help texts, `ckptfs info --help` and the README's
// table of sources are made from it (or checked against it: tests/unit/registry_test.cpp).
//
// Adding a format: a reader file in its family's folder (src/format/FAMILY/) that defines
// `extern const ReaderEntry kMyReader` (detect and read below), its name in registry.cpp
// (declaration and list), its row in the README's table of sources. The build takes every
// file of a family's folder.
#ifndef CKPTFS_FORMAT_REGISTRY_HPP_
#define CKPTFS_FORMAT_REGISTRY_HPP_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "ckptfs/catalog.hpp"
#include "ckptfs/env.hpp"
#include "ckptfs/source.hpp"
#include "ckptfs/status.hpp"
#include "codec/zip.hpp"

namespace ckptfs {

// What detection knows of a source so far, shared by the entries' detect and read: its path,
// what is there, and (read once, on first request) its leading bytes and zip directory.
class SourceProbe {
 public:
  SourceProbe(std::string source, PathType type, Catalog* catalog)
      : source_(std::move(source)), type_(type), catalog_(catalog) {}

  const std::string& source() const { return source_; }
  PathType type() const { return type_; }
  bool is_file() const { return type_ == PathType::kFile; }
  bool is_folder() const { return type_ == PathType::kFolder; }
  Env& env() const { return catalog_->files->env(); }
  SourceFiles* files() const { return catalog_->files.get(); }
  // Whether the source's name ends with `suffix` (and is longer than it).
  bool NameEndsWith(std::string_view suffix) const;

  // Up to 512 leading bytes of a file source (a tar header is 512 bytes). The first call adds
  // the file to the catalog's files, where its reader finds it again.
  Status Head(std::string_view* out);
  // Whether Head starts with `magic`.
  Status HeadStartsWith(std::string_view magic, bool* starts);

  // Which torch reader a zip source needs ("torchscript", "torch-export" or "torch-zip";
  // TorchZipKind), its zip directory kept for the read (zip()).
  Status TorchZipKind(std::string_view* kind);
  ZipArchive* zip() { return &zip_; }

 private:
  std::string source_;
  PathType type_;
  Catalog* catalog_;
  std::optional<std::string> head_;
  std::optional<std::string> zip_kind_;
  ZipArchive zip_;
};

// One checkpoint format. Every entry has the same two functions: detect says whether the
// source is in this format (reading as little as it can; an error ends detection), and read
// fills the catalog (its files, tensors, metadata, and Catalog::format where the reader builds
// more than one format: an entry with one has it set before read).
struct ReaderEntry {
  // The reader's name, in the catalog cache's stamps (ReaderStamp) and the README's table.
  std::string_view name;
  // What it reads, for help texts: "torch .pt/.bin: a torch.save zip (torch >= 1.6)".
  std::string_view description;
  // The values of Catalog::format its catalogs have (empty entries: none).
  std::string_view formats[2] = {};
  // Its format number: bump it whenever the catalog it builds from the same bytes changes (a
  // tensor added, dropped, renamed, reshaped or placed at other bytes, metadata or sibling
  // files changed, a file accepted that was refused). The catalog cache serves a catalog
  // only while the numbers of the readers that built it are the same.
  uint32_t number = 1;
  // The other readers it reads files through (a folder's weight files): their numbers are in
  // the stamp of its catalogs too.
  std::string_view reads_through[3] = {};
  Status (*detect)(SourceProbe& probe, bool* is_format) = nullptr;
  Status (*read)(SourceProbe& probe, const SourceOptions& options, Catalog* catalog) = nullptr;
};

// detect of a folder format that `is_format(env, folder)` recognises.
template <bool (*is_format)(Env& env, const std::string& dir)>
Status DetectFolderOf(SourceProbe& probe, bool* is_format_out) {
  *is_format_out = probe.is_folder() && is_format(probe.env(), probe.source());
  return Status::OK();
}

// Every reader, in the order detection tries them.
std::span<const ReaderEntry* const> Readers();

// What identifies the code that builds a catalog whose Catalog::format is `format`, as the
// catalog cache records and compares it: the project version, the number of the detection
// order, and the numbers of the reader that builds such a catalog and of the readers it reads
// files through ("ckptfs 0.1.0; detection 2; torch-zip 2"). Empty when no reader builds
// `format`.
std::string ReaderStamp(std::string_view format);

}  // namespace ckptfs

#endif  // CKPTFS_FORMAT_REGISTRY_HPP_
