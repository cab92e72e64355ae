// A read-only view of a ZIP archive's central directory (PKWARE APPNOTE 6.3),
// enough to find stored records and their data offsets. Handles zip64 and the
// data-descriptor flag as torch.save writes them (doc/FORMATS.md, "torch.save archives").
// The archive is a window of a source file: a whole .pt file, or one chunk of a larger
// file. Offsets inside the archive are relative to the window's base; everything this
// class returns is an offset in the file. Never inflates or reads record contents itself.
#ifndef CKPTFS_CODEC_ZIP_HPP_
#define CKPTFS_CODEC_ZIP_HPP_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/source_files.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// 48 bytes: a torch.save of a million tensors has a million entries, all alive while its
// pickle is parsed. The name is a view into the archive's name blocks.
struct ZipEntry {
  std::string_view name;
  uint16_t flags = 0;
  uint16_t method = 0;  // 0 = stored, 8 = deflate
  uint64_t compressed_size = 0;
  uint64_t uncompressed_size = 0;
  uint64_t local_header_offset = 0;  // in the archive: relative to its window's base
};

class ZipArchive {
 public:
  static constexpr uint16_t kMethodStored = 0;

  ZipArchive() = default;
  // Entries view names held by the archive: moving keeps them valid, copying would not.
  ZipArchive(const ZipArchive&) = delete;
  ZipArchive& operator=(const ZipArchive&) = delete;
  ZipArchive(ZipArchive&&) noexcept = default;
  ZipArchive& operator=(ZipArchive&&) noexcept = default;

  // Parses the end records and central directory of the archive in `window`, refusing
  // directories of more than `max_entries` entries. Nothing outside the window is read.
  // `window_bytes`, when given, are the whole window's bytes, already read by the caller
  // (a DCP reader reads many small chunk archives of a file in one read); they are copied.
  Status Open(const SourceFiles& files, FileWindow window, uint64_t max_entries = uint64_t{1} << 24,
              std::string_view window_bytes = {});

  const FileWindow& window() const { return window_; }

  const std::vector<ZipEntry>& entries() const { return entries_; }
  // The entry named exactly `name`, or nullptr.
  const ZipEntry* Find(std::string_view name) const;

  // Where `entry`'s data begins in the file (not the window), from its local header (whose
  // extra field differs from the central one in torch files). Checks that the data fits
  // the window.
  // Not thread-safe: local headers are read through a small cache, because a
  // checkpoint of many small tensors has many headers close together.
  Status DataOffset(const ZipEntry& entry, uint64_t* offset) const;

  // Reads a whole stored record into `out`, refusing records above `max_size` bytes.
  Status ReadStored(const ZipEntry& entry, uint64_t max_size, std::string* out) const;

 private:
  // Parses `entry_count` entries of the directory at `cd_offset` (archive offset), `cd_size`
  // bytes, reading it a window at a time (a million entries are ~70 MB of directory).
  // Reads the archive's tail into tail_ (the whole window when its bytes are given) until it
  // holds the end-of-central-directory record; *eocd: where that starts in tail_.
  Status ReadTail(std::string_view window_bytes, size_t* eocd);
  // The zip64 end record, when a locator right before the EOCD (at eocd_offset) points at
  // one: the entry count and the central directory's size and offset it gives.
  Status ReadZip64End(uint64_t eocd_offset, uint64_t* entry_count, uint64_t* cd_size, uint64_t* cd_offset,
                      bool* zip64);
  Status ParseCentralDirectory(uint64_t cd_offset, uint64_t cd_size, uint64_t entry_count);
  // A copy of `name` in the name blocks, stable for the archive's life.
  std::string_view KeepName(std::string_view name, uint64_t directory_bytes);
  // Indexes the entries by name, refusing a name listed twice.
  Status BuildNameIndex();
  // Refuses entries whose records (local header, name, data) overlap each other or the
  // central directory at `cd_offset`.
  Status CheckRecordsApart(uint64_t cd_offset) const;
  // Reads `length` bytes at `offset` of the archive (not the file).
  Status ReadAt(uint64_t offset, size_t length, void* out) const;
  Status Corrupt(std::string_view what) const;

  const SourceFiles* files_ = nullptr;
  FileWindow window_;
  std::vector<ZipEntry> entries_;
  // Entry names, back to back in blocks that never move.
  std::vector<std::unique_ptr<char[]>> name_blocks_;
  char* name_cursor_ = nullptr;
  size_t name_left_ = 0;
  // Open addressing over name hashes: entry index + 1, 0 for an empty slot; a power of two
  // at least twice the entry count (8 bytes per entry where a node map would take ~50).
  std::vector<uint32_t> by_name_;
  mutable std::string header_cache_;  // bytes of the window starting at header_cache_start_
  mutable uint64_t header_cache_start_ = 0;
  // The archive's last bytes, read by Open: reads inside them are served from memory.
  std::string tail_;
  uint64_t tail_start_ = 0;
};

}  // namespace ckptfs

#endif  // CKPTFS_CODEC_ZIP_HPP_
