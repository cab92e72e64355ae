#include "format/catalog_cache.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include <xxhash.h>

#include "format/byte_reader.hpp"

namespace ckptfs {
namespace {

// "CKPTFS catalog", then the format version: bump it whenever what is written changes.
constexpr char kMagic[16] = {'C', 'K', 'P', 'T', 'F', 'S', ' ', 'c', 'a', 't', 'a', 'l', 'o', 'g', '\n', '\0'};
// 2: a tensor's path as KeyPath's packed bytes (one string), not element by element.
constexpr uint32_t kVersion = 2;
// Boxes have the rank of their tensor; a rank above this is a damaged entry.
constexpr uint64_t kMaxRank = 64;

class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U32(uint32_t v) { Fixed(v); }
  void U64(uint64_t v) { Fixed(v); }
  void Str(std::string_view s) {
    U64(s.size());
    out_.append(s);
  }
  template <typename Values>
  void Dims(const Values& dims) {
    for (uint64_t d : dims) U64(d);
  }
  std::string& bytes() { return out_; }

 private:
  template <typename T>
  void Fixed(T v) {
    for (size_t i = 0; i < sizeof(T); ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  }
  std::string out_;
};

// Reads what Writer wrote; every read is checked, so a damaged entry fails instead of
// reading past its end.
class Reader {
 public:
  explicit Reader(std::string_view bytes) : r_(bytes) {}
  bool U8(uint8_t* v) { return r_.U8(v); }
  bool U32(uint32_t* v) { return r_.U32(v); }
  bool U64(uint64_t* v) { return r_.U64(v); }
  bool I64(int64_t* v) {
    uint64_t u;
    if (!r_.U64(&u)) return false;
    *v = static_cast<int64_t>(u);
    return true;
  }
  bool Str(std::string* s) {
    std::string_view view;
    if (!View(&view)) return false;
    s->assign(view);
    return true;
  }
  // A string as Str reads it, left in the entry's bytes.
  bool View(std::string_view* view) {
    uint64_t n;
    return r_.U64(&n) && n <= r_.remaining() && r_.Bytes(n, view);
  }
  template <typename Values>
  bool Dims(uint64_t rank, Values* dims) {
    if (rank > kMaxRank) return false;
    dims->resize(rank);
    for (uint64_t& d : *dims)
      if (!r_.U64(&d)) return false;
    return true;
  }
  // A count of items each at least `min_bytes` long: bounded by what is left.
  bool Count(uint64_t min_bytes, uint64_t* n) { return r_.U64(n) && *n <= r_.remaining() / min_bytes; }
  bool at_end() const { return r_.at_end(); }
  size_t position() const { return r_.position(); }

 private:
  ByteReader r_;
};

// What, besides the source's bytes, decides the catalog a reader builds.
void WriteOptions(Writer* w, const SourceOptions& options) {
  w->U8(options.zero_moments ? 1 : 0);
  w->U64(options.limits.pickle_bytes);
  w->U64(options.limits.pickle_memory);
  w->U64(options.limits.header_bytes);
  w->U64(options.limits.tensors);
}

std::string AbsolutePath(const std::string& source) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(source, ec);
  return ec ? source : p.lexically_normal().string();
}

// The entry of `source` read with `options`: its name hashes both, and the entry records
// them too (a hash collision is a miss, not another checkpoint's catalog).
std::string EntryPath(const std::string& folder, const std::string& source, const std::string& options_bytes) {
  const std::string key = AbsolutePath(source) + '\0' + options_bytes;
  char name[40];
  std::snprintf(name, sizeof name, "%016llx.catalog", static_cast<unsigned long long>(XXH3_64bits(key.data(), key.size())));
  return JoinPath(folder, name);
}

std::string OptionsBytes(const SourceOptions& options) {
  Writer w;
  WriteOptions(&w, options);
  return std::move(w.bytes());
}

void WriteIdentity(Writer* w, const FileIdentity& id) {
  w->U64(id.dev);
  w->U64(id.ino);
  w->U64(id.size);
  w->U64(static_cast<uint64_t>(id.mtime_ns));
  w->U64(static_cast<uint64_t>(id.ctime_ns));
  w->Str(id.version);
}

bool ReadIdentity(Reader* r, FileIdentity* id) {
  return r->U64(&id->dev) && r->U64(&id->ino) && r->U64(&id->size) && r->I64(&id->mtime_ns) &&
         r->I64(&id->ctime_ns) && r->Str(&id->version);
}

void WriteTensor(Writer* w, const TensorEntry& t) {
  w->Str(t.key);
  w->Str(t.path.packed());
  w->U8(static_cast<uint8_t>(t.dtype));
  w->U64(t.shape.size());
  w->Dims(t.shape);
  w->Str(t.storage_id);
  w->U64(t.boxes.size());
  for (const Box& b : t.boxes) {
    w->U32(b.file);
    w->U64(b.base_offset);
    w->U64(b.rank());
    w->Dims(b.offset);
    w->Dims(b.extent);
    w->Dims(b.strides);
  }
}

bool ReadTensor(Reader* r, uint32_t file_count, TensorEntry* t) {
  uint64_t n;
  std::string_view packed_path;
  if (!r->Str(&t->key) || !r->View(&packed_path) || !KeyPath::FromPacked(packed_path, &t->path)) return false;
  uint8_t dtype;
  uint64_t rank;
  if (!r->U8(&dtype) || dtype > static_cast<uint8_t>(DType::kC32) || !r->U64(&rank) || !r->Dims(rank, &t->shape))
    return false;
  t->dtype = static_cast<DType>(dtype);
  if (!r->Str(&t->storage_id) || !r->Count(20, &n)) return false;
  t->boxes.resize(n);
  for (Box& b : t->boxes) {
    if (!r->U32(&b.file) || b.file >= file_count || !r->U64(&b.base_offset) || !r->U64(&rank) ||
        !r->Dims(rank, &b.offset) || !r->Dims(rank, &b.extent) || !r->Dims(rank, &b.strides))
      return false;
  }
  return true;
}

// Reads an entry's head: what it was written for and the identities of its files, which
// it checks (into catalog->files, opened afresh), then the distinct-keys flag. False:
// damaged. *stale: well formed but not for this source, these options or these files.
bool ReadEntryHead(Reader& r, const std::string& source, const std::string& options_bytes, Catalog* catalog,
                   bool* stale, std::string* why, bool* keys_distinct) {
  std::string recorded_source, recorded_options;
  if (!r.Str(&recorded_source) || !r.Str(&recorded_options)) return false;
  if (recorded_source != AbsolutePath(source) || recorded_options != options_bytes) {
    *stale = true;
    *why = "it was written for another source or other options";
    return true;
  }
  uint64_t n;
  if (!r.Str(&catalog->format) || !r.Str(&catalog->layout_file) || !r.Count(8, &n)) return false;
  // The files first: the rest is worth reading only when every one is unchanged.
  for (uint64_t i = 0; i < n; ++i) {
    std::string path;
    FileIdentity recorded;
    if (!r.Str(&path) || !ReadIdentity(&r, &recorded)) return false;
    uint32_t index;
    if (!catalog->files->Add(path, &index).ok() || index != i || !(catalog->files->identity(index) == recorded)) {
      *stale = true;
      *why = path + " changed since the entry was written";
      return true;
    }
  }
  uint8_t distinct;
  if (!r.U8(&distinct) || distinct > 1) return false;
  *keys_distinct = distinct == 1;
  return true;
}

// Parses an entry's body (after magic and version, before the checksum). False: damaged.
// *stale: well formed but not for this source, these options or these files.
// `release(n)`: the first n bytes of `body` are read and may be dropped from memory.
template <typename Release>
bool ReadEntry(std::string_view body, const std::string& source, const std::string& options_bytes, Catalog* catalog,
               bool* stale, std::string* why, Release release) {
  Reader r(body);
  bool keys_distinct = false;
  if (!ReadEntryHead(r, source, options_bytes, catalog, stale, why, &keys_distinct)) return false;
  if (*stale) return true;
  uint64_t n = catalog->files->count();
  const uint32_t file_count = static_cast<uint32_t>(n);
  if (!r.Count(4, &n)) return false;
  catalog->sibling_files.resize(n);
  for (uint32_t& f : catalog->sibling_files)
    if (!r.U32(&f) || f >= file_count) return false;
  std::string metadata;
  if (!r.Str(&metadata)) return false;
  catalog->metadata = nlohmann::json::from_cbor(metadata, true, false);
  if (catalog->metadata.is_discarded()) return false;
  if (!r.Count(40, &n)) return false;
  catalog->tensors.resize(n);
  for (size_t i = 0; i < catalog->tensors.size(); ++i) {
    if (!ReadTensor(&r, file_count, &catalog->tensors[i])) return false;
    if (i % 65536 == 65535) release(r.position());
  }
  return r.at_end();
}

}  // namespace

std::string CatalogCacheFolder(const SourceOptions& options) {
  if (options.catalog_cache != "auto") return options.catalog_cache;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg == '/') return JoinPath(JoinPath(xdg, "ckptfs"), "catalogs");
  const char* home = std::getenv("HOME");
  if (!home || *home != '/') return "";
  return JoinPath(JoinPath(JoinPath(home, ".cache"), "ckptfs"), "catalogs");
}

namespace {

// An entry mapped read-only, its checksum checked. Pages already read can be dropped.
class MappedEntry {
 public:
  ~MappedEntry() {
    if (base_) ::munmap(base_, size_);
  }
  // False with *note empty: no entry; with *note set: one that cannot be used.
  bool Open(const std::string& path, std::string* note) {
    // The entry is mapped, and the pages already checked or parsed are dropped as the
    // reading goes on: held whole, a million tensors' entry (~150 MB) added its size to the
    // peak memory of the mount that loads it. (Read into a string through
    // istreambuf_iterator, a byte at a time, it took longer than parsing the source's pickle.)
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;  // no entry yet
    struct stat st;
    void* mapped = MAP_FAILED;
    const bool stated = ::fstat(fd, &st) == 0;
    if (stated && st.st_size > 0)
      mapped = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    ::close(fd);
    if (!stated || (st.st_size > 0 && mapped == MAP_FAILED)) {
      *note = "cannot read the catalog cache entry " + path + "; reading the source";
      return false;
    }
    if (mapped != MAP_FAILED) {
      base_ = mapped;
      size_ = static_cast<size_t>(st.st_size);
    }
    const std::string_view bytes = this->bytes();
    uint64_t checksum = 0;
    uint32_t version = 0;
    if (bytes.size() >= kHeader + 8) {
      std::memcpy(&version, bytes.data() + sizeof kMagic, 4);
      for (size_t i = 0; i < 8; ++i)
        checksum |= uint64_t{static_cast<uint8_t>(bytes[bytes.size() - 8 + i])} << (8 * i);
    }
    bool intact = bytes.size() >= kHeader + 8 && std::memcmp(bytes.data(), kMagic, sizeof kMagic) == 0 && version == kVersion;
    if (intact) {
      // In pieces, each dropped once hashed (parsing maps it in again from the page cache).
      XXH3_state_t* state = XXH3_createState();
      intact = state != nullptr && XXH3_64bits_reset(state) == XXH_OK;
      constexpr size_t kPiece = size_t{8} << 20;
      for (size_t at = 0; intact && at < bytes.size() - 8; at += kPiece) {
        const size_t n = std::min(kPiece, bytes.size() - 8 - at);
        XXH3_64bits_update(state, bytes.data() + at, n);
        DropBefore(at + n);
      }
      intact = intact && XXH3_64bits_digest(state) == checksum;
      XXH3_freeState(state);
      dropped_ = 0;
    }
    if (!intact) {
      *note = "ignoring the catalog cache entry " + path + ": damaged or of another version; reading the source";
      return false;
    }
    return true;
  }
  std::string_view bytes() const { return std::string_view(static_cast<const char*>(base_), size_); }
  // The fields between the header and the checksum.
  std::string_view body() const { return bytes().substr(kHeader, size_ - 8 - kHeader); }
  // Bytes [0, offset) of the entry are read and may leave memory.
  void DropBefore(size_t offset) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    const size_t end = offset / page * page;
    if (end <= dropped_) return;
    ::madvise(static_cast<char*>(base_) + dropped_, end - dropped_, MADV_DONTNEED);
    dropped_ = end;
  }
  static constexpr size_t kHeader = sizeof kMagic + 4;

 private:
  void* base_ = nullptr;
  size_t size_ = 0;
  size_t dropped_ = 0;
};

}  // namespace

bool CachedCatalogUsable(const std::string& source, const SourceOptions& options) {
  const std::string folder = CatalogCacheFolder(options);
  if (folder.empty()) return false;
  const std::string options_bytes = OptionsBytes(options);
  MappedEntry entry;
  std::string note;
  if (!entry.Open(EntryPath(folder, source, options_bytes), &note)) return false;
  Catalog head;
  head.files = std::make_shared<SourceFiles>(options.env ? options.env : Env::Local());
  bool stale = false, keys_distinct = false;
  std::string why;
  Reader r(entry.body());
  try {
    return ReadEntryHead(r, source, options_bytes, &head, &stale, &why, &keys_distinct) && !stale && keys_distinct;
  } catch (const std::exception&) {
    return false;
  }
}

void LoadCachedCatalog(const std::string& source, const SourceOptions& options, std::shared_ptr<Catalog>* out,
                       std::string* note) {
  out->reset();
  note->clear();
  const std::string folder = CatalogCacheFolder(options);
  if (folder.empty()) return;
  const std::string options_bytes = OptionsBytes(options);
  const std::string path = EntryPath(folder, source, options_bytes);
  MappedEntry entry;
  if (!entry.Open(path, note)) return;
  auto catalog = std::make_shared<Catalog>();
  catalog->source = source;
  catalog->files = std::make_shared<SourceFiles>(options.env ? options.env : Env::Local());
  bool stale = false;
  std::string why;
  bool ok = false;
  try {
    ok = ReadEntry(entry.body(), source, options_bytes, catalog.get(), &stale, &why,
                   [&](size_t n) { entry.DropBefore(MappedEntry::kHeader + n); });
  } catch (const std::exception&) {  // nlohmann::json on a damaged CBOR document
    ok = false;
  }
  if (!ok) {
    *note = "ignoring the catalog cache entry " + path + ": its content is damaged; reading the source";
    return;
  }
  if (stale) return;  // the source changed: read afresh, and the new entry replaces this one
  *out = std::move(catalog);
}

Status StoreCachedCatalog(const std::string& source, const SourceOptions& options, const Catalog& catalog) {
  const std::string folder = CatalogCacheFolder(options);
  if (folder.empty()) return Status::OK();
  const std::string options_bytes = OptionsBytes(options);
  Writer w;
  w.bytes().append(kMagic, sizeof kMagic);
  w.U32(kVersion);
  w.Str(AbsolutePath(source));
  w.Str(options_bytes);
  w.Str(catalog.format);
  w.Str(catalog.layout_file);
  const SourceFiles& files = *catalog.files;
  w.U64(files.count());
  for (uint32_t i = 0; i < files.count(); ++i) {
    w.Str(files.path(i));
    WriteIdentity(&w, files.identity(i));
  }
  w.U8(FindRepeatedKey(catalog.tensors) ? 0 : 1);  // keys distinct
  w.U64(catalog.sibling_files.size());
  for (uint32_t f : catalog.sibling_files) w.U32(f);
  std::vector<uint8_t> metadata;
  try {
    metadata = nlohmann::json::to_cbor(catalog.metadata);
  } catch (const std::exception& e) {
    return Status::NotSupported(source, std::string("its metadata cannot be cached: ") + e.what());
  }
  w.Str(std::string_view(reinterpret_cast<const char*>(metadata.data()), metadata.size()));
  w.U64(catalog.tensors.size());
  for (const TensorEntry& t : catalog.tensors) WriteTensor(&w, t);
  w.U64(XXH3_64bits(w.bytes().data(), w.bytes().size()));

  std::error_code ec;
  std::filesystem::create_directories(folder, ec);
  if (ec) return Status::FromErrno(folder, "cannot create the catalog cache folder", ec.value());
  const std::string path = EntryPath(folder, source, options_bytes);
  const std::string temp = path + ".tmp-" + std::to_string(::getpid());
  std::FILE* f = std::fopen(temp.c_str(), "wb");
  if (!f) return Status::FromErrno(temp, "cannot write a catalog cache entry", errno);
  const bool written = std::fwrite(w.bytes().data(), 1, w.bytes().size(), f) == w.bytes().size();
  const int write_errno = errno;
  if (std::fclose(f) != 0 || !written) {
    std::remove(temp.c_str());
    return Status::FromErrno(temp, "cannot write a catalog cache entry", written ? errno : write_errno);
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(temp.c_str());
    return Status::FromErrno(path, "cannot rename a catalog cache entry into place", e);
  }
  return Status::OK();
}

}  // namespace ckptfs
