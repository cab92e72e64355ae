#include "open/catalog_cache.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>
#include <vector>

#include <xxhash.h>

#include "codec/byte_reader.hpp"
#include "format/readers.hpp"
#include "io/page_prefault.hpp"
#include "io/parallel.hpp"

namespace ckptfs {
namespace {

// "CKPTFS catalog", then the format version: bump it whenever what is written changes.
constexpr char kMagic[16] = {'C', 'K', 'P', 'T', 'F', 'S', ' ', 'c', 'a', 't', 'a', 'l', 'o', 'g', '\n', '\0'};
constexpr uint32_t kVersion = 5;
// Boxes have the rank of their tensor; a rank above this is a damaged entry.
constexpr uint64_t kMaxRank = 64;
// The fewest bytes a tensor's record takes (key, path, dtype, rank, storage id, box count).
constexpr uint64_t kMinTensorBytes = 40;

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
  // Writes v over the 8 bytes at `at`, written earlier as a placeholder.
  void PatchU64(size_t at, uint64_t v) {
    for (size_t i = 0; i < 8; ++i) out_[at + i] = static_cast<char>((v >> (8 * i)) & 0xFF);
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
    if (rank > kMaxRank || rank * 8 > r_.remaining()) return false;
    dims->resize(rank);
    for (uint64_t& d : *dims) r_.U64(&d);  // cannot fail: checked above
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
  w->U8(options.optimizer_state ? 1 : 0);
  w->U64(options.limits.pickle_bytes);
  w->U64(options.limits.pickle_memory);
  w->U64(options.limits.header_bytes);
  w->U64(options.limits.tensors);
}

// A local source's path as entries record it (only local files are cached).
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

// The file system the cache folder is on.
Env& CacheEnv(const SourceOptions& options) {
  return options.catalog_cache_env ? *options.catalog_cache_env : *Env::Local();
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
  if (!r->U8(&dtype) || dtype > static_cast<uint8_t>(DType::kF4x2) || !r->U64(&rank) || !r->Dims(rank, &t->shape))
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

// A source file as an entry records it.
struct RecordedFile {
  std::string path;
  FileIdentity identity;
};

// An entry's head: what it was written for, by which readers, its files, whether its keys
// are distinct.
struct EntryHead {
  std::string source, options, format, reader, layout_file;
  std::vector<RecordedFile> files;
  bool keys_distinct = false;
};

// False: damaged.
bool ReadEntryHead(Reader& r, EntryHead* head) {
  uint64_t n;
  if (!r.Str(&head->source) || !r.Str(&head->options) || !r.Str(&head->format) || !r.Str(&head->reader) ||
      !r.Str(&head->layout_file) || !r.Count(8, &n))
    return false;
  head->files.resize(n);
  for (RecordedFile& f : head->files)
    if (!r.Str(&f.path) || !ReadIdentity(&r, &f.identity)) return false;
  uint8_t distinct;
  if (!r.U8(&distinct) || distinct > 1) return false;
  head->keys_distinct = distinct == 1;
  return true;
}

// Whether `head` is an entry of `source` read with `options_bytes`, built by the readers
// this build has, whose files, opened afresh into catalog->files, are unchanged; if not,
// why not.
bool HeadMatches(const EntryHead& head, const std::string& source, const std::string& options_bytes, Catalog* catalog,
                 std::string* why) {
  if (head.source != AbsolutePath(source) || head.options != options_bytes) {
    *why = "it was written for another source or other options";
    return false;
  }
  // A reader that is fixed or changed builds another catalog from the same bytes: an entry
  // of another ckptfs version or reader code stamp is stale, like one of a changed file.
  if (head.reader != ReaderStamp(head.format)) {
    *why = "it was written by " + head.reader + ", not " + ReaderStamp(head.format);
    return false;
  }
  for (size_t i = 0; i < head.files.size(); ++i) {
    uint32_t index;
    if (!catalog->files->Add(head.files[i].path, &index).ok() || index != i ||
        !(catalog->files->identity(index) == head.files[i].identity)) {
      *why = head.files[i].path + " changed since the entry was written";
      return false;
    }
  }
  catalog->format = head.format;
  catalog->layout_file = head.layout_file;
  return true;
}

// The part of an entry's body after its head: sibling files, metadata, and where the
// chunks of tensor records lie.
struct EntryTensors {
  std::vector<uint32_t> sibling_files;
  std::vector<WholeSafetensorsFile> whole_safetensors_files;
  std::string_view metadata;  // CBOR
  uint64_t count = 0;
  uint64_t chunk_tensors = 0;
  // Chunk c holds tensors [c * chunk_tensors, ...) in body bytes [chunk_ends[c-1], chunk_ends[c]),
  // chunk 0 from `first_chunk`.
  std::vector<uint64_t> chunk_ends;
  uint64_t first_chunk = 0;

  uint64_t ChunkBegin(size_t c) const { return c == 0 ? first_chunk : chunk_ends[c - 1]; }
};

// False: damaged. The chunk table is checked whole here: every chunk non-empty, in order,
// inside the body, each ending where the next begins and the last where the body ends;
// so a damaged table cannot send a decoding thread outside the body or over another's bytes.
bool ReadEntryTensors(Reader& r, size_t body_size, EntryTensors* t) {
  uint64_t n;
  if (!r.Count(4, &n)) return false;
  t->sibling_files.resize(n);
  for (uint32_t& f : t->sibling_files)
    if (!r.U32(&f)) return false;
  if (!r.Count(32, &n)) return false;
  t->whole_safetensors_files.resize(n);
  for (WholeSafetensorsFile& w : t->whole_safetensors_files)
    if (!r.U32(&w.file) || !r.U64(&w.data_start) || !r.U64(&w.first_tensor) || !r.U64(&w.tensor_count) ||
        !r.U32(&w.key_prefix))
      return false;
  uint64_t chunks;
  if (!r.View(&t->metadata) || !r.Count(kMinTensorBytes, &t->count) || !r.U64(&t->chunk_tensors) ||
      t->chunk_tensors == 0 || !r.Count(8, &chunks))
    return false;
  const uint64_t expected_chunks = t->count == 0 ? 0 : (t->count - 1) / t->chunk_tensors + 1;
  if (chunks != expected_chunks) return false;
  t->chunk_ends.resize(chunks);
  for (uint64_t& end : t->chunk_ends)
    if (!r.U64(&end)) return false;
  t->first_chunk = r.position();
  uint64_t at = t->first_chunk;
  for (uint64_t end : t->chunk_ends) {
    if (end <= at || end > body_size) return false;
    at = end;
  }
  return at == body_size;
}

// Tensors of chunk c: [first, last).
std::pair<uint64_t, uint64_t> ChunkTensors(const EntryTensors& t, size_t c) {
  const uint64_t first = c * t.chunk_tensors;
  return {first, std::min(t.count, first + t.chunk_tensors)};
}

// An entry mapped read-only (Env::MapFile). Pages already read can be dropped.
class MappedEntry {
 public:
  // Maps the entry and checks its magic and version (not its checksum: ChecksumMatches).
  // False with *note empty: no entry; with *note set: one that cannot be used.
  bool Map(Env& env, const std::string& path, std::string* note) {
    // The entry is mapped, and the pages already checked or parsed are dropped as the
    // reading goes on: held whole, a million tensors' entry (~150 MB) added its size to the
    // peak memory of the mount that loads it.
    const Status mapped = env.MapFile(path, &file_);
    // No entry yet, or no folder to hold one (it is made, or refused, when one is stored).
    if (mapped.code() == Status::Code::kNotFound || mapped.sys_errno() == ENOTDIR) return false;
    if (!mapped.ok()) {
      *note = "cannot read the catalog cache entry " + path + " (" + mapped.message() + "); reading the source";
      return false;
    }
    const std::string_view bytes = this->bytes();
    uint32_t version = 0;
    if (bytes.size() >= kHeader + 8) std::memcpy(&version, bytes.data() + sizeof kMagic, 4);
    if (bytes.size() < kHeader + 8 || std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0 || version != kVersion) {
      *note = Damaged(path);
      return false;
    }
    return true;
  }
  // Whether the last 8 bytes are the XXH3-64 of all before them. Hashed in pieces, each
  // dropped once hashed when `drop` (else left for the decoding, which drops them).
  bool ChecksumMatches(bool drop = true) const {
    const std::string_view bytes = this->bytes();
    uint64_t checksum = 0;
    for (size_t i = 0; i < 8; ++i) checksum |= uint64_t{static_cast<uint8_t>(bytes[bytes.size() - 8 + i])} << (8 * i);
    XXH3_state_t* state = XXH3_createState();
    bool intact = state != nullptr && XXH3_64bits_reset(state) == XXH_OK;
    constexpr size_t kPiece = size_t{8} << 20;
    for (size_t at = 0; intact && at < bytes.size() - 8; at += kPiece) {
      const size_t n = std::min(kPiece, bytes.size() - 8 - at);
      XXH3_64bits_update(state, bytes.data() + at, n);
      if (drop) Drop(at, at + n);
    }
    intact = intact && XXH3_64bits_digest(state) == checksum;
    XXH3_freeState(state);
    return intact;
  }
  // Map and ChecksumMatches.
  bool Open(Env& env, const std::string& path, std::string* note) {
    if (!Map(env, path, note)) return false;
    if (ChecksumMatches()) return true;
    *note = Damaged(path);
    return false;
  }
  std::string_view bytes() const { return file_->bytes(); }
  // The fields between the header and the checksum.
  std::string_view body() const { return bytes().substr(kHeader, bytes().size() - 8 - kHeader); }
  // Entry bytes [begin, end) are read and may leave memory. Safe to call from several threads.
  void Drop(size_t begin, size_t end) const { file_->Release(begin, end); }
  static constexpr size_t kHeader = sizeof kMagic + 4;

 private:
  static std::string Damaged(const std::string& path) {
    return "ignoring the catalog cache entry " + path + ": damaged or of another version; reading the source";
  }
  std::unique_ptr<MappedFile> file_;
};

// A catalog of at least this many tensors has the pages of its tensor vector faulted in on
// two threads, and the whole-entry checksum computed beside that.
constexpr uint64_t kOverlapTensors = 65536;

// Decodes the entry's tensor chunks into catalog->tensors (sized already), on a few threads
// when there are several chunks; each tensor's layout is checked as it is decoded (the
// entry was written from a checked catalog, so a failure means a damaged entry). False:
// damaged.
bool DecodeTensors(const MappedEntry& entry, const EntryTensors& t, Catalog* catalog) {
  const std::string_view body = entry.body();
  const uint32_t file_count = static_cast<uint32_t>(catalog->files->count());
  const std::string& layout_name = catalog->layout_file.empty() ? catalog->source : catalog->layout_file;
  std::atomic<size_t> next_chunk{0};
  std::atomic<bool> damaged{false};
  auto decode = [&](size_t) {
    for (size_t c; !damaged.load(std::memory_order_relaxed) && (c = next_chunk.fetch_add(1)) < t.chunk_ends.size();) {
      const uint64_t begin = t.ChunkBegin(c), end = t.chunk_ends[c];
      Reader r(body.substr(begin, end - begin));
      const auto [first, last] = ChunkTensors(t, c);
      for (uint64_t i = first; i < last; ++i) {
        TensorEntry& tensor = catalog->tensors[i];
        if (!ReadTensor(&r, file_count, &tensor) || !ValidateLayout(tensor, *catalog->files, layout_name).ok()) {
          damaged = true;
          return;
        }
      }
      if (!r.at_end()) {
        damaged = true;
        return;
      }
      entry.Drop(MappedEntry::kHeader + begin, MappedEntry::kHeader + end);
    }
  };
  RunOnWorkers(WorkerCount(t.chunk_ends.size(), 1), decode);
  return !damaged;
}

}  // namespace

bool CachedCatalogUsable(const std::string& source, const SourceOptions& options) {
  const std::string folder = options.catalog_cache;
  if (folder.empty()) return false;
  const std::string options_bytes = OptionsBytes(options);
  MappedEntry entry;
  std::string note;
  if (!entry.Open(CacheEnv(options), EntryPath(folder, source, options_bytes), &note)) return false;
  Catalog head_only;
  head_only.files = std::make_shared<SourceFiles>(options.env ? options.env : Env::Local());
  EntryHead head;
  EntryTensors tensors;
  std::string why;
  Reader r(entry.body());
  try {
    return ReadEntryHead(r, &head) && ReadEntryTensors(r, entry.body().size(), &tensors) &&
           HeadMatches(head, source, options_bytes, &head_only, &why) && head.keys_distinct;
  } catch (const std::exception&) {
    return false;
  }
}

void LoadCachedCatalog(const std::string& source, const SourceOptions& options, std::shared_ptr<Catalog>* out,
                       std::string* note) {
  out->reset();
  note->clear();
  const std::string folder = options.catalog_cache;
  if (folder.empty()) return;
  const std::string options_bytes = OptionsBytes(options);
  const std::string path = EntryPath(folder, source, options_bytes);
  MappedEntry entry;
  if (!entry.Map(CacheEnv(options), path, note)) return;
  const std::string damaged = "ignoring the catalog cache entry " + path + ": its content is damaged; reading the source";
  auto catalog = std::make_shared<Catalog>();
  catalog->source = source;
  catalog->files = std::make_shared<SourceFiles>(options.env ? options.env : Env::Local());
  try {
    // The fields before the tensors are read first (every read bounded, nothing acted on)
    // for the tensor count: the vector of that size is faulted in while the checksum is
    // computed, the two on threads of their own.
    Reader r(entry.body());
    EntryHead head;
    EntryTensors tensors;
    if (!ReadEntryHead(r, &head) || !ReadEntryTensors(r, entry.body().size(), &tensors)) {
      *note = entry.ChecksumMatches() ? damaged : "ignoring the catalog cache entry " + path +
                                                      ": damaged or of another version; reading the source";
      return;
    }
    std::atomic<size_t> next_piece{0};
    bool intact = false;
    if (tensors.count >= kOverlapTensors) {
      catalog->tensors.reserve(tensors.count);
      char* storage = reinterpret_cast<char*>(catalog->tensors.data());
      const size_t storage_bytes = tensors.count * sizeof(TensorEntry);
      RunOnWorkers(WorkerCount(2, 1), [&](size_t w) {
        if (w == 1 || WorkerCount(2, 1) == 1) intact = entry.ChecksumMatches(/*drop=*/false);
        PopulateForWrite(storage, storage_bytes, &next_piece);
      });
    } else {
      intact = entry.ChecksumMatches();
    }
    if (!intact) {
      *note = "ignoring the catalog cache entry " + path + ": damaged or of another version; reading the source";
      return;
    }
    std::string why;
    if (!HeadMatches(head, source, options_bytes, catalog.get(), &why))
      return;  // the source changed: read afresh, and the new entry replaces this one
    const uint32_t file_count = static_cast<uint32_t>(catalog->files->count());
    for (uint32_t f : tensors.sibling_files)
      if (f >= file_count) {
        *note = damaged;
        return;
      }
    for (const WholeSafetensorsFile& w : tensors.whole_safetensors_files)
      if (w.file >= file_count || w.first_tensor > tensors.count || w.tensor_count > tensors.count - w.first_tensor) {
        *note = damaged;
        return;
      }
    catalog->sibling_files = std::move(tensors.sibling_files);
    catalog->whole_safetensors_files = std::move(tensors.whole_safetensors_files);
    catalog->metadata = nlohmann::json::from_cbor(tensors.metadata, true, false);
    catalog->tensors.resize(tensors.count);
    if (catalog->metadata.is_discarded() || !DecodeTensors(entry, tensors, catalog.get())) {
      *note = damaged;
      return;
    }
  } catch (const std::exception&) {  // nlohmann::json on a damaged CBOR document; no memory
    *note = damaged;
    return;
  }
  *out = std::move(catalog);
}

Status StoreCachedCatalog(const std::string& source, const SourceOptions& options, const Catalog& catalog,
                          uint64_t chunk_tensors) {
  const std::string folder = options.catalog_cache;
  if (folder.empty()) return Status::OK();
  if (chunk_tensors == 0) return Status::InvalidArgument(source, "catalog cache chunks of 0 tensors");
  // Only the DCP reader describes a model, and folders are never cached: an entry has no
  // place for a description, so a catalog with one is not stored rather than stored without.
  if (catalog.model) return Status::NotSupported(source, "a catalog with a model description is not cached");
  const std::string reader = ReaderStamp(catalog.format);
  if (reader.empty())
    return Status::NotSupported(source, "no reader stamp for catalogs of format '" + catalog.format + "'");
  const std::string options_bytes = OptionsBytes(options);
  Writer w;
  w.bytes().append(kMagic, sizeof kMagic);
  w.U32(kVersion);
  w.Str(AbsolutePath(source));
  w.Str(options_bytes);
  w.Str(catalog.format);
  w.Str(reader);
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
  w.U64(catalog.whole_safetensors_files.size());
  for (const WholeSafetensorsFile& whole : catalog.whole_safetensors_files) {
    w.U32(whole.file);
    w.U64(whole.data_start);
    w.U64(whole.first_tensor);
    w.U64(whole.tensor_count);
    w.U32(whole.key_prefix);
  }
  std::vector<uint8_t> metadata;
  try {
    metadata = nlohmann::json::to_cbor(catalog.metadata);
  } catch (const std::exception& e) {
    return Status::NotSupported(source, std::string("its metadata cannot be cached: ") + e.what());
  }
  w.Str(std::string_view(reinterpret_cast<const char*>(metadata.data()), metadata.size()));
  const uint64_t count = catalog.tensors.size();
  const uint64_t chunks = count == 0 ? 0 : (count - 1) / chunk_tensors + 1;
  w.U64(count);
  w.U64(chunk_tensors);
  w.U64(chunks);
  const size_t table = w.bytes().size();
  for (uint64_t c = 0; c < chunks; ++c) w.U64(0);  // each chunk's end, once written
  for (uint64_t i = 0; i < count; ++i) {
    WriteTensor(&w, catalog.tensors[i]);
    if ((i + 1) % chunk_tensors == 0 || i + 1 == count)
      w.PatchU64(table + 8 * (i / chunk_tensors), w.bytes().size() - MappedEntry::kHeader);
  }
  w.U64(XXH3_64bits(w.bytes().data(), w.bytes().size()));

  Env& env = CacheEnv(options);
  const Status created = env.CreateFolders(folder);
  if (!created.ok()) return Status::FromErrno(folder, "cannot create the catalog cache folder", created.ToErrno());
  const std::string path = EntryPath(folder, source, options_bytes);
  CKPTFS_RETURN_IF_ERROR(env.WriteFileAtomically(path, w.bytes()));
  return Status::OK();
}

}  // namespace ckptfs
