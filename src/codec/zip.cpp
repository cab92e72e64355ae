#include "codec/zip.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <utility>

#include <xxhash.h>

#include "codec/byte_reader.hpp"
#include "io/page_prefault.hpp"
#include "io/parallel.hpp"

namespace ckptfs {
namespace {

constexpr uint32_t kLocalHeaderSig = 0x04034b50;      // PK\3\4
constexpr uint32_t kCentralHeaderSig = 0x02014b50;    // PK\1\2
constexpr uint32_t kEndOfCentralDirSig = 0x06054b50;  // PK\5\6
constexpr uint32_t kZip64EndSig = 0x06064b50;         // PK\6\6
constexpr uint32_t kZip64LocatorSig = 0x07064b50;     // PK\6\7
constexpr size_t kEocdSize = 22;
constexpr size_t kZip64LocatorSize = 20;
constexpr size_t kZip64EndSize = 56;
constexpr size_t kCentralHeaderSize = 46;
constexpr size_t kLocalHeaderSize = 30;
constexpr size_t kMaxCommentSize = 0xFFFF;
constexpr uint16_t kZip64ExtraId = 0x0001;
constexpr uint16_t kFlagEncrypted = 0x0001;
// A central directory larger than this is not a checkpoint we want to hold in memory
// (1 GiB is ~10 million entries).
constexpr uint64_t kMaxCentralDirSize = uint64_t{1} << 30;
// Bytes read at once when looking up a local header: many small records' headers per read,
// little waste when records are far apart.
constexpr uint64_t kHeaderWindow = 16 << 10;
// Bytes first read at the end of an archive (see Open).
constexpr uint64_t kShortTail = 8 << 10;
// Directories up to this many entries are searched without a name table.
constexpr size_t kLinearFindEntries = 16;
// Bytes of the central directory read at once.
constexpr uint64_t kDirectoryWindow = 1 << 20;
// Directories of at least this many entries build their name index on a second thread.
constexpr size_t kThreadedIndexEntries = size_t{1} << 16;
// Entry names are copied into blocks of this size.
constexpr uint64_t kNameBlock = 64 << 10;

size_t NameHash(std::string_view name) { return static_cast<size_t>(XXH3_64bits(name.data(), name.size())); }

}  // namespace

Status ZipArchive::Corrupt(std::string_view what) const {
  return Status::Corruption(files_->Describe(window_), what);
}

Status ZipArchive::ReadAt(uint64_t offset, size_t length, void* out) const {
  // Cannot overflow: Open checked that the window lies inside the file, and callers that
  // the range lies inside the window.
  for (const auto& [start, bytes] : {std::pair<uint64_t, const std::string*>{tail_start_, &tail_},
                                     std::pair<uint64_t, const std::string*>{header_cache_start_, &header_cache_}}) {
    if (offset >= start && offset - start <= bytes->size() && length <= bytes->size() - (offset - start)) {
      std::memcpy(out, bytes->data() + (offset - start), length);
      return Status::OK();
    }
  }
  return files_->ReadExact(window_.file, window_.base + offset, length, out);
}

namespace {

// The EOCD's position in `tail` (the archive's last bytes): the last signature whose
// comment length reaches exactly the end; npos when there is none.
size_t FindEocd(std::string_view tail) {
  if (tail.size() < kEocdSize) return std::string_view::npos;
  for (size_t pos = tail.size() - kEocdSize + 1; pos-- > 0;) {
    ByteReader r(tail.substr(pos));
    uint32_t sig;
    uint16_t comment_len = 0;
    if (!r.U32(&sig) || sig != kEndOfCentralDirSig) continue;
    r.Skip(16);
    if (r.U16(&comment_len) && pos + kEocdSize + comment_len == tail.size()) return pos;
  }
  return std::string_view::npos;
}

}  // namespace

Status ZipArchive::Open(const SourceFiles& files, FileWindow window, uint64_t max_entries,
                        std::string_view window_bytes) {
  files_ = &files;
  window_ = window;
  entries_.clear();
  by_name_.clear();
  name_blocks_.clear();
  name_cursor_ = nullptr;
  name_left_ = 0;
  header_cache_.clear();
  header_cache_start_ = 0;
  tail_.clear();
  tail_start_ = 0;
  uint64_t window_end;
  if (!CheckedAdd(window.base, window.length, &window_end) || window_end > files.size(window.file))
    return Corrupt("archive window extends past the end of the file");
  // Below, offsets and sizes are those of the archive: relative to the window's base.
  const uint64_t size = window.length;
  if (size < kEocdSize) return Corrupt("not a zip archive: too short for an end-of-central-directory record");

  size_t eocd = std::string::npos;
  CKPTFS_RETURN_IF_ERROR(ReadTail(window_bytes, &eocd));
  ByteReader r(std::string_view(tail_).substr(eocd + 4));
  uint16_t disk = 0, cd_disk = 0, disk_entries = 0, total_entries = 0;
  uint32_t cd_size32 = 0, cd_offset32 = 0;
  r.U16(&disk), r.U16(&cd_disk), r.U16(&disk_entries), r.U16(&total_entries);
  r.U32(&cd_size32), r.U32(&cd_offset32);
  uint64_t entry_count = total_entries, cd_size = cd_size32, cd_offset = cd_offset32;
  const uint64_t eocd_offset = tail_start_ + eocd;
  bool zip64 = false;
  CKPTFS_RETURN_IF_ERROR(ReadZip64End(eocd_offset, &entry_count, &cd_size, &cd_offset, &zip64));
  if (!zip64 && (disk != 0 || cd_disk != 0)) return Corrupt("multi-disk zip archives are not supported");

  uint64_t cd_end;
  if (!CheckedAdd(cd_offset, cd_size, &cd_end) || cd_end > eocd_offset)
    return Corrupt("central directory lies outside the file");
  if (cd_size > kMaxCentralDirSize) return Corrupt("central directory is implausibly large");
  if (entry_count > cd_size / kCentralHeaderSize)
    return Corrupt("central directory is too small for its entry count");
  if (entry_count > max_entries)
    return Status::Refused(files.Describe(window_), "zip directory lists " + std::to_string(entry_count) +
                                                        " entries, over the limit of " + std::to_string(max_entries))
                                                            .WithLimitOption("max_tensors");
  CKPTFS_RETURN_IF_ERROR(ParseCentralDirectory(cd_offset, cd_size, entry_count));
  // The name index and the check that records lie apart only read the entries: a large
  // directory (a million entries: ~40 ms of the two) builds its index on a second thread
  // meanwhile. A duplicate name is reported before an overlap, whichever thread finishes
  // first.
  Status indexed, apart;
  const size_t workers = entries_.size() >= kThreadedIndexEntries ? 2 : 1;
  RunOnWorkers(workers, [&](size_t w) {
    if (w == 0) apart = CheckRecordsApart(cd_offset);
    if (w == 1 || workers == 1) indexed = BuildNameIndex();
  });
  CKPTFS_RETURN_IF_ERROR(indexed);
  return apart;
}

Status ZipArchive::ReadTail(std::string_view window_bytes, size_t* eocd) {
  const uint64_t size = window_.length;
  // The EOCD sits in the last 22 + up to 65535 comment bytes; scan backwards. Archives
  // without a comment (every torch.save) have it in the last few KB, which usually hold the
  // zip64 records and the central directory too, and a small archive (a DCP chunk) whole: the
  // tail is kept, and reads it covers are served from memory (a million chunks are a million
  // reads rather than eight million).
  uint64_t tail_len = std::min<uint64_t>(size, kShortTail);
  *eocd = std::string::npos;
  if (!window_bytes.empty()) {
    if (window_bytes.size() != size) return Corrupt("internal: the bytes given for the archive are not its window's");
    tail_.assign(window_bytes);
    tail_start_ = 0;
    *eocd = FindEocd(tail_);
  }
  while (window_bytes.empty()) {
    tail_.resize(tail_len);
    tail_start_ = size - tail_len;
    CKPTFS_RETURN_IF_ERROR(files_->ReadExact(window_.file, window_.base + tail_start_, tail_len, tail_.data()));
    *eocd = FindEocd(tail_);
    const uint64_t full = std::min<uint64_t>(size, kEocdSize + kMaxCommentSize);
    if (*eocd != std::string::npos || tail_len == full) break;
    tail_len = full;
  }
  if (*eocd == std::string::npos) return Corrupt("not a zip archive: no end-of-central-directory record");
  return Status::OK();
}

Status ZipArchive::ReadZip64End(uint64_t eocd_offset, uint64_t* entry_count, uint64_t* cd_size, uint64_t* cd_offset,
                                bool* zip64) {
  const uint64_t size = window_.length;
  if (eocd_offset < kZip64LocatorSize) return Status::OK();
  char loc[kZip64LocatorSize];
  CKPTFS_RETURN_IF_ERROR(ReadAt(eocd_offset - kZip64LocatorSize, sizeof loc, loc));
  ByteReader lr(std::string_view(loc, sizeof loc));
  uint32_t sig, zip64_disk, disks;
  uint64_t end_offset;
  lr.U32(&sig), lr.U32(&zip64_disk), lr.U64(&end_offset), lr.U32(&disks);
  if (sig != kZip64LocatorSig) return Status::OK();
  if (end_offset > size - kZip64LocatorSize - kEocdSize ||
      size - kZip64LocatorSize - kEocdSize - end_offset < kZip64EndSize)
    return Corrupt("zip64 locator points outside the file");
  char end[kZip64EndSize];
  CKPTFS_RETURN_IF_ERROR(ReadAt(end_offset, sizeof end, end));
  ByteReader er(std::string_view(end, sizeof end));
  uint32_t end_sig, disk32, cd_disk32;
  uint64_t record_size, count_disk, count_total;
  uint16_t made_by, needed;
  er.U32(&end_sig), er.U64(&record_size), er.U16(&made_by), er.U16(&needed);
  er.U32(&disk32), er.U32(&cd_disk32), er.U64(&count_disk), er.U64(&count_total);
  er.U64(cd_size), er.U64(cd_offset);
  if (end_sig != kZip64EndSig) return Corrupt("zip64 end-of-central-directory record has a bad signature");
  if (disk32 != 0 || cd_disk32 != 0) return Corrupt("multi-disk zip archives are not supported");
  *entry_count = count_total;
  *zip64 = true;
  return Status::OK();
}

Status ZipArchive::CheckRecordsApart(uint64_t cd_offset) const {
  // Records lie one after another before the central directory. Two entries that share bytes
  // (the trick of overlapping-entry zip bombs, or a forged offset) or an entry that runs into
  // the directory make the same bytes mean two things: refuse them (corpus cases
  // pt-entries-overlap, pt-entry-overlaps-central-dir). Each entry is taken as its local
  // header, name and data; the local extra field is not known yet, so this is a lower bound.
  // Writers list the records in the order they wrote them (torch.save does): then the
  // directory's order is the sorted one and no sort is needed (a million entries take ~15 ms
  // to sort). Strictly increasing only: equal offsets take the sorted path, so the pair a
  // message names does not depend on the directory's order.
  bool in_order = true;
  for (size_t i = 1; i < entries_.size() && in_order; ++i)
    in_order = entries_[i - 1].local_header_offset < entries_[i].local_header_offset;
  std::vector<uint32_t> order;  // entry_count < 2^32: the directory is under 1 GiB
  if (!in_order) {
    order.resize(entries_.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<uint32_t>(i);
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      return entries_[a].local_header_offset < entries_[b].local_header_offset;
    });
  }
  auto Sorted = [&](size_t k) -> const ZipEntry& { return in_order ? entries_[k] : entries_[order[k]]; };
  for (size_t k = 0; k < entries_.size(); ++k) {
    const ZipEntry& e = Sorted(k);
    // Cannot overflow: ParseCentralDirectory checked header + data lies inside the window,
    // and a name is at most 65535 bytes.
    const uint64_t end = e.local_header_offset + kLocalHeaderSize + e.name.size() + e.compressed_size;
    if (k + 1 < entries_.size() && end > Sorted(k + 1).local_header_offset)
      return Corrupt("entries '" + std::string(e.name) + "' and '" + std::string(Sorted(k + 1).name) + "' overlap");
    if (end > cd_offset) return Corrupt("entry '" + std::string(e.name) + "' overlaps the central directory");
  }
  return Status::OK();
}

std::string_view ZipArchive::KeepName(std::string_view name, uint64_t directory_bytes) {
  if (name.empty()) return {};
  if (name.size() > name_left_) {
    // Blocks of 64 KiB, or the whole directory's size when smaller (a DCP chunk's archive
    // has ~300 bytes of names): names never exceed the directory that holds them.
    const size_t size = std::max<size_t>(name.size(), std::min<uint64_t>(directory_bytes, kNameBlock));
    name_blocks_.push_back(std::unique_ptr<char[]>(new char[size]));
    name_cursor_ = name_blocks_.back().get();
    name_left_ = size;
  }
  std::memcpy(name_cursor_, name.data(), name.size());
  std::string_view kept(name_cursor_, name.size());
  name_cursor_ += name.size();
  name_left_ -= name.size();
  return kept;
}

Status ZipArchive::ParseCentralDirectory(uint64_t cd_offset, uint64_t cd_size, uint64_t entry_count) {
  const uint64_t archive_size = window_.length;
  // The directory is read a window at a time: `window` holds archive bytes
  // [window_start, window_start + window.size()), `pos` is the next entry's offset in it.
  // A directory inside the tail already read (a small archive's) is parsed in place.
  std::string window;
  std::string_view bytes;
  uint64_t window_start = cd_offset;
  size_t pos = 0;
  const uint64_t cd_end = cd_offset + cd_size;  // Open checked it lies before the EOCD
  const bool in_tail = cd_offset >= tail_start_;
  if (in_tail) bytes = std::string_view(tail_).substr(cd_offset - tail_start_, cd_size);
  // Makes `need` bytes from `pos` available in `bytes`; false when the directory ends first.
  auto Need = [&](size_t need) -> Status {
    if (bytes.size() - pos >= need) return Status::OK();
    const uint64_t at = window_start + pos;
    if (in_tail || cd_end - at < need) return Status::OK();  // the caller's reader reports truncation
    const uint64_t length = std::min<uint64_t>(cd_end - at, std::max<uint64_t>(need, kDirectoryWindow));
    window.resize(length);
    CKPTFS_RETURN_IF_ERROR(ReadAt(at, length, window.data()));
    bytes = window;
    window_start = at;
    pos = 0;
    return Status::OK();
  };
  entries_.reserve(entry_count);
  // A million entries are ~48 MB of fresh pages: made resident on another core while this
  // one reads and parses the directory into them (stopped on any return).
  PagePrefault prefault;
  prefault.Start(entries_.data(), entry_count * sizeof(ZipEntry));
  for (uint64_t i = 0; i < entry_count; ++i) {
    CKPTFS_RETURN_IF_ERROR(Need(kCentralHeaderSize));
    ByteReader head(bytes.substr(std::min(pos, bytes.size())));
    uint32_t sig, crc, csize32, usize32, lho32, external_attr;
    uint16_t made_by, needed, flags, method, mtime, mdate, name_len, extra_len, comment_len;
    uint16_t disk_start, internal_attr;
    if (!head.U32(&sig) || sig != kCentralHeaderSig)
      return Corrupt("central directory entry " + std::to_string(i) + " has a bad signature");
    if (!(head.U16(&made_by) && head.U16(&needed) && head.U16(&flags) && head.U16(&method) && head.U16(&mtime) &&
          head.U16(&mdate) && head.U32(&crc) && head.U32(&csize32) && head.U32(&usize32) && head.U16(&name_len) &&
          head.U16(&extra_len) && head.U16(&comment_len) && head.U16(&disk_start) && head.U16(&internal_attr) &&
          head.U32(&external_attr) && head.U32(&lho32)))
      return Corrupt("central directory entry " + std::to_string(i) + " is truncated");
    const size_t entry_size = kCentralHeaderSize + size_t{name_len} + extra_len + comment_len;
    CKPTFS_RETURN_IF_ERROR(Need(entry_size));
    ByteReader r(bytes.substr(std::min(pos, bytes.size())));
    std::string_view name, extra;
    if (!r.Skip(kCentralHeaderSize) || !r.Bytes(name_len, &name) || !r.Bytes(extra_len, &extra) || !r.Skip(comment_len))
      return Corrupt("central directory entry " + std::to_string(i) + " is truncated");
    pos += entry_size;

    ZipEntry e;
    e.flags = flags;
    e.method = method;
    e.compressed_size = csize32;
    e.uncompressed_size = usize32;
    e.local_header_offset = lho32;
    auto Named = [&](const char* what) { return Corrupt("entry '" + std::string(name) + "' " + what); };
    // zip64 extra: only the fields whose 32-bit value is saturated, in this order.
    ByteReader xr(extra);
    while (xr.remaining() >= 4) {
      uint16_t id = 0, len = 0;
      std::string_view body;
      xr.U16(&id), xr.U16(&len);
      if (!xr.Bytes(len, &body)) return Named("has a truncated extra field");
      if (id != kZip64ExtraId) continue;
      ByteReader zr(body);
      if (usize32 == 0xFFFFFFFF && !zr.U64(&e.uncompressed_size)) return Named("has a short zip64 field");
      if (csize32 == 0xFFFFFFFF && !zr.U64(&e.compressed_size)) return Named("has a short zip64 field");
      if (lho32 == 0xFFFFFFFF && !zr.U64(&e.local_header_offset)) return Named("has a short zip64 field");
    }
    if (flags & kFlagEncrypted)
      return Status::NotSupported(files_->Describe(window_), "entry '" + std::string(name) + "' is encrypted");
    if (method == kMethodStored && e.compressed_size != e.uncompressed_size)
      return Corrupt("stored entry '" + std::string(name) + "' has different compressed and uncompressed sizes");
    uint64_t end;
    if (!CheckedAdd(e.local_header_offset, kLocalHeaderSize, &end) || !CheckedAdd(end, e.compressed_size, &end) ||
        end > archive_size)
      return Named("extends past the end of the file");
    e.name = KeepName(name, cd_size);
    entries_.push_back(e);
  }
  return Status::OK();
}

Status ZipArchive::BuildNameIndex() {
  if (entries_.size() <= kLinearFindEntries) {
    // A small directory (a DCP chunk's archive: 6 entries, a million of them) is searched in
    // place: a hash table per archive cost more than the searches it saves.
    for (size_t i = 1; i < entries_.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        if (entries_[i].name == entries_[j].name)
          return Corrupt("duplicate entry name '" + std::string(entries_[i].name) + "'");
    return Status::OK();
  }
  by_name_.assign(std::bit_ceil(entries_.size() * 2), 0);
  const size_t mask = by_name_.size() - 1;
  for (size_t i = 0; i < entries_.size(); ++i) {
    for (size_t slot = NameHash(entries_[i].name) & mask;; slot = (slot + 1) & mask) {
      if (by_name_[slot] == 0) {
        by_name_[slot] = static_cast<uint32_t>(i + 1);
        break;
      }
      if (entries_[by_name_[slot] - 1].name == entries_[i].name)
        return Corrupt("duplicate entry name '" + std::string(entries_[i].name) + "'");
    }
  }
  return Status::OK();
}

const ZipEntry* ZipArchive::Find(std::string_view name) const {
  if (entries_.size() <= kLinearFindEntries) {
    for (const ZipEntry& e : entries_)
      if (e.name == name) return &e;
    return nullptr;
  }
  const size_t mask = by_name_.size() - 1;
  for (size_t slot = NameHash(name) & mask; by_name_[slot] != 0; slot = (slot + 1) & mask)
    if (entries_[by_name_[slot] - 1].name == name) return &entries_[by_name_[slot] - 1];
  return nullptr;
}

Status ZipArchive::DataOffset(const ZipEntry& entry, uint64_t* offset) const {
  const uint64_t at = entry.local_header_offset;
  if (at < header_cache_start_ || at + kLocalHeaderSize > header_cache_start_ + header_cache_.size()) {
    // Open() checked that local header + 30 bytes lies inside the window.
    // Read aside first: ReadAt serves from the cache being replaced.
    std::string bytes(std::min(kHeaderWindow, window_.length - at), '\0');
    CKPTFS_RETURN_IF_ERROR(ReadAt(at, bytes.size(), bytes.data()));
    header_cache_ = std::move(bytes);
    header_cache_start_ = at;
  }
  ByteReader r(std::string_view(header_cache_).substr(at - header_cache_start_, kLocalHeaderSize));
  uint32_t sig = 0;
  uint16_t name_len = 0, extra_len = 0;
  r.U32(&sig);
  r.Skip(22);
  r.U16(&name_len), r.U16(&extra_len);
  if (sig != kLocalHeaderSig) return Corrupt("local header of '" + std::string(entry.name) + "' has a bad signature");
  uint64_t data = entry.local_header_offset + kLocalHeaderSize + name_len + extra_len;
  uint64_t end;
  if (!CheckedAdd(data, entry.compressed_size, &end) || end > window_.length)
    return Corrupt("data of '" + std::string(entry.name) + "' extends past the end of the file");
  *offset = window_.base + data;
  return Status::OK();
}

Status ZipArchive::ReadStored(const ZipEntry& entry, uint64_t max_size, std::string* out) const {
  if (entry.method != kMethodStored)
    return Status::NotSupported(files_->Describe(window_), "record '" + std::string(entry.name) + "' is compressed (method " +
                                                         std::to_string(entry.method) + "); only stored records are supported");
  if (entry.uncompressed_size > max_size)
    return Corrupt("record '" + std::string(entry.name) + "' is implausibly large (" + std::to_string(entry.uncompressed_size) + " bytes)");
  uint64_t offset;
  CKPTFS_RETURN_IF_ERROR(DataOffset(entry, &offset));
  out->resize(entry.uncompressed_size);
  return ReadAt(offset - window_.base, out->size(), out->data());
}

}  // namespace ckptfs
