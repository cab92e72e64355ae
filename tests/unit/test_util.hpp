// Helpers shared by the unit tests: in-memory sources and temporary files, and byte
// builders for the formats ckptfs parses (zip archives, pickles, safetensors). The
// builders write bytes by hand so the tests need neither Python nor a zip library, and
// can produce malformed input.
#ifndef CKPTFS_TESTS_UNIT_TEST_UTIL_HPP_
#define CKPTFS_TESTS_UNIT_TEST_UTIL_HPP_

#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/open.hpp"
#include "ckptfs/view.hpp"
#include "io/memory_env.hpp"

namespace ckptfs_test {

// ---- in-memory sources ---------------------------------------------------------------

// A MemoryEnv, and catalogs read from it: what parser tests use instead of the disk.
class MemorySource {
 public:
  const std::shared_ptr<ckptfs::MemoryEnv>& env() const { return env_; }

  // Adds or replaces file `path`; returns the path.
  const std::string& Write(const std::string& path, std::string_view bytes) {
    ckptfs::Status s = env_->WriteFile(path, std::string(bytes));
    if (!s.ok()) throw std::runtime_error(s.message());
    return path;
  }

  ckptfs::SourceOptions Options(const ckptfs::ReadLimits& limits = ckptfs::ReadLimits{}) const {
    ckptfs::SourceOptions options;
    options.limits = limits;
    options.env = env_;
    return options;
  }
  ckptfs::Status OpenCatalog(const std::string& path, std::shared_ptr<const ckptfs::Catalog>* out) const {
    return ckptfs::OpenCatalog(path, Options(), out);
  }
  // An empty catalog whose files open in this env, for calling one reader directly.
  void Attach(ckptfs::Catalog* catalog) const { catalog->files = std::make_shared<ckptfs::SourceFiles>(env_); }

 private:
  std::shared_ptr<ckptfs::MemoryEnv> env_ = std::make_shared<ckptfs::MemoryEnv>();
};

// The catalog of `bytes` written as one in-memory file: what reader tests open and inspect.
struct BuiltCatalog {
  MemorySource source;
  std::string path;
  std::shared_ptr<const ckptfs::Catalog> catalog;
  ckptfs::Status status;
  BuiltCatalog(const std::string& bytes, std::string at) : path(std::move(at)) {
    source.Write(path, bytes);
    status = source.OpenCatalog(path, &catalog);
  }
};

// ---- files ---------------------------------------------------------------------------

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/ckptfs-unit-XXXXXX";
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string File(std::string_view name) const { return path_ + "/" + std::string(name); }

 private:
  std::string path_;
};

// Served tensor `t`'s stored entry (a key map's made on first use); throws when it cannot be made.
inline const ckptfs::TensorEntry& StoredEntry(const ckptfs::ServedTensor& t) {
  const ckptfs::TensorEntry* entry = nullptr;
  ckptfs::Status s = t.Stored(&entry);
  if (!s.ok()) throw std::runtime_error(s.message());
  return *entry;
}

inline void WriteFile(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}
inline bool Contains(std::string_view s, std::string_view part) { return s.find(part) != std::string_view::npos; }

// ---- little-endian encoding ----------------------------------------------------------

inline void PutLE(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
inline std::string LE16(uint16_t v) { std::string s; PutLE(&s, v, 2); return s; }
inline std::string LE32(uint32_t v) { std::string s; PutLE(&s, v, 4); return s; }
inline std::string LE64(uint64_t v) { std::string s; PutLE(&s, v, 8); return s; }
// Overwrites `bytes` little-endian bytes of `s` at `pos` (for corrupting built files).
inline void PatchLE(std::string* s, size_t pos, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) (*s)[pos + i] = static_cast<char>((v >> (8 * i)) & 0xFF);
}

// ---- zip -----------------------------------------------------------------------------

inline uint32_t Crc32(std::string_view data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char c : data) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

// The torch-style alignment block: "FB", a u16 length, then that many 'Z' bytes.
inline std::string PaddingExtra(uint16_t n) { return "FB" + LE16(n) + std::string(n, 'Z'); }

struct ZipEntrySpec {
  ZipEntrySpec(std::string n, std::string d) : name(std::move(n)), data(std::move(d)) {}

  std::string name;
  std::string data;  // written as is, whatever `method` says
  uint16_t method = 0;
  uint16_t flags = 0;
  std::string local_extra;    // extra field of the local header
  std::string central_extra;  // extra field of the central header (after any zip64 block)
  // Central sizes / offset saturated to 0xFFFFFFFF, real values in a zip64 extra block.
  bool zip64_sizes = false;
  bool zip64_offset = false;
  // Flag bit 3: the local header holds zero CRC and sizes; a descriptor follows the data.
  bool data_descriptor = false;
  // Declared uncompressed size when it differs from data.size() (method 8 entries).
  int64_t uncompressed_size = -1;

  // Chainable setters: ZipEntrySpec("a/b", bytes).LocalExtra(PaddingExtra(60)).
  ZipEntrySpec& Method(uint16_t m, uint64_t usize) { method = m; uncompressed_size = static_cast<int64_t>(usize); return *this; }
  ZipEntrySpec& Flags(uint16_t f) { flags = f; return *this; }
  ZipEntrySpec& LocalExtra(std::string x) { local_extra = std::move(x); return *this; }
  ZipEntrySpec& CentralExtra(std::string x) { central_extra = std::move(x); return *this; }
  ZipEntrySpec& Zip64Sizes() { zip64_sizes = true; return *this; }
  ZipEntrySpec& Zip64Offset() { zip64_offset = true; return *this; }
  ZipEntrySpec& DataDescriptor() { data_descriptor = true; return *this; }
};

// Where the parts of a built archive landed, so tests can patch them.
struct ZipLayout {
  std::vector<uint64_t> local_header_offsets;
  std::vector<uint64_t> data_offsets;
  std::vector<uint64_t> central_offsets;  // of each central header
  uint64_t cd_offset = 0, cd_size = 0;
  uint64_t zip64_end_offset = 0;  // 0 when absent
  uint64_t eocd_offset = 0;
};

// Writes a zip archive of stored records, optionally with the zip64 end records that
// torch.save always writes.
class ZipBuilder {
 public:
  void Add(ZipEntrySpec spec) { specs_.push_back(std::move(spec)); }

  // `zip64_end`: add the zip64 end record and locator, and saturate the classic EOCD's
  // counts and offsets so that only the zip64 record can give the right values.
  std::string Build(bool zip64_end = false, std::string_view comment = "", ZipLayout* layout = nullptr) const {
    std::string out;
    ZipLayout lay;
    std::vector<std::string> centrals;
    for (const ZipEntrySpec& e : specs_) {
      const uint64_t lho = out.size();
      const uint64_t usize = e.uncompressed_size >= 0 ? static_cast<uint64_t>(e.uncompressed_size) : e.data.size();
      const uint64_t csize = e.data.size();
      const uint32_t crc = Crc32(e.data);
      const uint16_t flags = e.flags | (e.data_descriptor ? 0x0008 : 0);
      lay.local_header_offsets.push_back(lho);
      out += LE32(0x04034b50);
      out += LE16(20) + LE16(flags) + LE16(e.method) + LE16(0) + LE16(0);
      if (e.data_descriptor) out += LE32(0) + LE32(0) + LE32(0);
      else out += LE32(crc) + LE32(static_cast<uint32_t>(csize)) + LE32(static_cast<uint32_t>(usize));
      out += LE16(static_cast<uint16_t>(e.name.size())) + LE16(static_cast<uint16_t>(e.local_extra.size()));
      out += e.name + e.local_extra;
      lay.data_offsets.push_back(out.size());
      out += e.data;
      if (e.data_descriptor) out += LE32(0x08074b50) + LE32(crc) + LE32(static_cast<uint32_t>(csize)) + LE32(static_cast<uint32_t>(usize));

      std::string zip64;
      if (e.zip64_sizes) zip64 += LE64(usize) + LE64(csize);
      if (e.zip64_offset) zip64 += LE64(lho);
      std::string extra;
      if (!zip64.empty()) extra = LE16(0x0001) + LE16(static_cast<uint16_t>(zip64.size())) + zip64;
      extra += e.central_extra;
      std::string c = LE32(0x02014b50) + LE16(20) + LE16(20) + LE16(flags) + LE16(e.method) + LE16(0) + LE16(0);
      c += LE32(crc);
      c += LE32(e.zip64_sizes ? 0xFFFFFFFFu : static_cast<uint32_t>(csize));
      c += LE32(e.zip64_sizes ? 0xFFFFFFFFu : static_cast<uint32_t>(usize));
      c += LE16(static_cast<uint16_t>(e.name.size())) + LE16(static_cast<uint16_t>(extra.size()));
      c += LE16(0) + LE16(0) + LE16(0) + LE32(0);
      c += LE32(e.zip64_offset ? 0xFFFFFFFFu : static_cast<uint32_t>(lho));
      c += e.name + extra;
      centrals.push_back(std::move(c));
    }
    lay.cd_offset = out.size();
    for (const std::string& c : centrals) {
      lay.central_offsets.push_back(out.size());
      out += c;
    }
    lay.cd_size = out.size() - lay.cd_offset;
    const uint64_t n = specs_.size();
    if (zip64_end) {
      lay.zip64_end_offset = out.size();
      out += LE32(0x06064b50) + LE64(44) + LE16(0x031E) + LE16(45) + LE32(0) + LE32(0);
      out += LE64(n) + LE64(n) + LE64(lay.cd_size) + LE64(lay.cd_offset);
      out += LE32(0x07064b50) + LE32(0) + LE64(lay.zip64_end_offset) + LE32(1);
    }
    lay.eocd_offset = out.size();
    out += LE32(0x06054b50) + LE16(0) + LE16(0);
    out += zip64_end ? LE16(0xFFFF) + LE16(0xFFFF) + LE32(0xFFFFFFFF) + LE32(0xFFFFFFFF)
                     : LE16(static_cast<uint16_t>(n)) + LE16(static_cast<uint16_t>(n)) +
                           LE32(static_cast<uint32_t>(lay.cd_size)) + LE32(static_cast<uint32_t>(lay.cd_offset));
    out += LE16(static_cast<uint16_t>(comment.size()));
    out += comment;
    if (layout) *layout = lay;
    return out;
  }

 private:
  std::vector<ZipEntrySpec> specs_;
};

// ---- pickle --------------------------------------------------------------------------

// Appends pickle opcodes; each method is one opcode with its argument.
class PickleBuilder {
 public:
  PickleBuilder& Op(uint8_t op) { s_.push_back(static_cast<char>(op)); return *this; }
  PickleBuilder& Raw(std::string_view bytes) { s_ += bytes; return *this; }
  PickleBuilder& Proto(uint8_t v) { return Op(0x80).Op(v); }
  PickleBuilder& BinUnicode(std::string_view v) { Op('X'); s_ += LE32(static_cast<uint32_t>(v.size())); s_ += v; return *this; }
  PickleBuilder& ShortBinUnicode(std::string_view v) { Op(0x8c).Op(static_cast<uint8_t>(v.size())); s_ += v; return *this; }
  PickleBuilder& BinInt1(uint8_t v) { return Op('K').Op(v); }
  PickleBuilder& BinInt2(uint16_t v) { Op('M'); s_ += LE16(v); return *this; }
  PickleBuilder& BinInt(int32_t v) { Op('J'); s_ += LE32(static_cast<uint32_t>(v)); return *this; }
  PickleBuilder& Long1(std::string_view le) { Op(0x8a).Op(static_cast<uint8_t>(le.size())); s_ += le; return *this; }
  PickleBuilder& BinFloat(double v) {
    uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    Op('G');
    for (int i = 7; i >= 0; --i) s_.push_back(static_cast<char>((bits >> (8 * i)) & 0xFF));  // big-endian
    return *this;
  }
  PickleBuilder& Global(std::string_view module, std::string_view name) {
    Op('c');
    s_ += std::string(module) + "\n" + std::string(name) + "\n";
    return *this;
  }
  PickleBuilder& BinPut(uint8_t i) { return Op('q').Op(i); }
  PickleBuilder& BinGet(uint8_t i) { return Op('h').Op(i); }
  PickleBuilder& Frame(uint64_t n) { Op(0x95); s_ += LE64(n); return *this; }
  // Common no-argument opcodes.
  PickleBuilder& Mark() { return Op('('); }
  PickleBuilder& Stop() { return Op('.'); }
  PickleBuilder& None() { return Op('N'); }
  PickleBuilder& EmptyDict() { return Op('}'); }
  PickleBuilder& EmptyList() { return Op(']'); }
  PickleBuilder& EmptyTuple() { return Op(')'); }
  PickleBuilder& Tuple() { return Op('t'); }
  PickleBuilder& Tuple2() { return Op(0x86); }
  PickleBuilder& SetItem() { return Op('s'); }
  PickleBuilder& SetItems() { return Op('u'); }
  PickleBuilder& Reduce() { return Op('R'); }
  PickleBuilder& NewFalse() { return Op(0x89); }
  PickleBuilder& BinPersId() { return Op('Q'); }

  const std::string& bytes() const { return s_; }

 private:
  std::string s_;
};

// Pickles `_rebuild_tensor_v2(storage(FloatStorage/..., key, numel), offset, size, stride,
// False, OrderedDict())`, as torch.save writes a tensor (reference A.5).
inline void PickleTensor(PickleBuilder* p, std::string_view storage_class, std::string_view key, uint32_t numel,
                         uint32_t offset, const std::vector<uint32_t>& size, const std::vector<uint32_t>& stride) {
  p->Global("torch._utils", "_rebuild_tensor_v2").Mark();
  p->Mark().BinUnicode("storage").Global("torch", storage_class).BinUnicode(key).BinUnicode("cpu").BinInt(static_cast<int32_t>(numel));
  p->Tuple().BinPersId().BinInt(static_cast<int32_t>(offset));
  p->Mark();
  for (uint32_t d : size) p->BinInt(static_cast<int32_t>(d));
  p->Tuple().Mark();
  for (uint32_t d : stride) p->BinInt(static_cast<int32_t>(d));
  p->Tuple().NewFalse().Global("collections", "OrderedDict").EmptyTuple().Reduce();
  p->Tuple().Reduce();
}

// ---- safetensors ---------------------------------------------------------------------

// The u64 little-endian header length, the header text, then the data buffer.
inline std::string SafetensorsBytes(std::string_view header, std::string_view data) {
  return LE64(header.size()) + std::string(header) + std::string(data);
}

// `n` bytes of a deterministic pattern that differs per `seed` (tensor payloads).
inline std::string PatternBytes(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 12345u;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1103515245u + 12345u;
    s[i] = static_cast<char>(x >> 24);
  }
  return s;
}

}  // namespace ckptfs_test

#endif  // CKPTFS_TESTS_UNIT_TEST_UTIL_HPP_
