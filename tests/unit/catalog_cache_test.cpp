// The catalog cache's entries (src/open/catalog_cache.cpp): a catalog comes back from an
// entry exactly as it was stored, also when its tensors span several chunks that threads
// decode; an entry whose chunk table is damaged (its checksum made right again, so that
// only the table's own checks or the decoding can catch it), of an older version, or
// written by another ckptfs version or reader code stamp, is not used: the source is
// read instead and the entry replaced. A weight index's catalog is never cached (its folder
// can gain a file served beside the weights); URLs: tests/remote/test_remote_catalog_cache.py.
#define BOOST_TEST_MODULE catalog_cache_test
#include <boost/test/unit_test.hpp>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cctype>
#include <filesystem>
#include <random>
#include <tuple>

#include "format/readers.hpp"
#include "io/memory_env.hpp"
#include "open/catalog_cache.hpp"
#include "test_util.hpp"

using ckptfs::Box;
using ckptfs::Catalog;
using ckptfs::DType;
using ckptfs::SourceOptions;
using ckptfs::Status;
using ckptfs::TensorEntry;
using namespace ckptfs_test;

namespace {

// A safetensors file of `n` one-element float32 tensors "w.<i>", with metadata that says
// "pt" (so its catalog holds it as a whole file too).
void WriteSafetensors(const std::string& path, size_t n) {
  std::string header = "{\"__metadata__\": {\"format\": \"pt\", \"note\": \"cache test\"}";
  for (size_t i = 0; i < n; ++i)
    header += ", \"w." + std::to_string(i) + "\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [" +
              std::to_string(4 * i) + ", " + std::to_string(4 * i + 4) + "]}";
  header += "}";
  WriteFile(path, SafetensorsBytes(header, PatternBytes(4 * n, 7)));
}

SourceOptions CacheOptions(const std::string& folder) {
  SourceOptions options;
  options.catalog_cache = folder;
  return options;
}

std::shared_ptr<const Catalog> MustOpen(const std::string& path, const SourceOptions& options) {
  std::shared_ptr<const Catalog> catalog;
  Status s = ckptfs::OpenCatalog(path, options, &catalog);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  return catalog;
}

// The catalog of `source`'s entry, or null; the note in *note.
std::shared_ptr<Catalog> Load(const std::string& source, const SourceOptions& options, std::string* note) {
  std::shared_ptr<Catalog> catalog;
  ckptfs::LoadCachedCatalog(source, options, &catalog, note);
  return catalog;
}

template <typename A, typename B>
bool SameValues(const A& a, const B& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

void RequireSameCatalog(const Catalog& got, const Catalog& want) {
  BOOST_REQUIRE_EQUAL(got.format, want.format);
  BOOST_REQUIRE_EQUAL(got.layout_file, want.layout_file);
  BOOST_REQUIRE_EQUAL(got.files->count(), want.files->count());
  for (uint32_t f = 0; f < want.files->count(); ++f) {
    BOOST_REQUIRE_EQUAL(got.files->path(f), want.files->path(f));
    BOOST_REQUIRE(got.files->identity(f) == want.files->identity(f));
  }
  BOOST_REQUIRE(got.sibling_files == want.sibling_files);
  BOOST_REQUIRE_EQUAL(got.whole_safetensors_files.size(), want.whole_safetensors_files.size());
  for (size_t k = 0; k < want.whole_safetensors_files.size(); ++k) {
    const ckptfs::WholeSafetensorsFile& a = got.whole_safetensors_files[k];
    const ckptfs::WholeSafetensorsFile& b = want.whole_safetensors_files[k];
    BOOST_REQUIRE(std::tie(a.file, a.data_start, a.first_tensor, a.tensor_count, a.key_prefix) ==
                  std::tie(b.file, b.data_start, b.first_tensor, b.tensor_count, b.key_prefix));
  }
  BOOST_REQUIRE_EQUAL(got.metadata.dump(), want.metadata.dump());
  BOOST_REQUIRE_EQUAL(got.tensors.size(), want.tensors.size());
  for (size_t i = 0; i < want.tensors.size(); ++i) {
    const TensorEntry& a = got.tensors[i];
    const TensorEntry& b = want.tensors[i];
    BOOST_TEST_CONTEXT("tensor " << i << " " << b.key) {
      BOOST_REQUIRE_EQUAL(a.key, b.key);
      BOOST_REQUIRE(a.path.packed() == b.path.packed());
      BOOST_REQUIRE(a.dtype == b.dtype);
      BOOST_REQUIRE(SameValues(a.shape, b.shape));
      BOOST_REQUIRE_EQUAL(a.storage_id, b.storage_id);
      BOOST_REQUIRE_EQUAL(a.boxes.size(), b.boxes.size());
      for (size_t k = 0; k < b.boxes.size(); ++k) {
        BOOST_REQUIRE_EQUAL(a.boxes[k].file, b.boxes[k].file);
        BOOST_REQUIRE_EQUAL(a.boxes[k].base_offset, b.boxes[k].base_offset);
        BOOST_REQUIRE(SameValues(a.boxes[k].offset, b.boxes[k].offset));
        BOOST_REQUIRE(SameValues(a.boxes[k].extent, b.boxes[k].extent));
        BOOST_REQUIRE(SameValues(a.boxes[k].strides, b.boxes[k].strides));
      }
    }
  }
}

// The one entry in `folder`.
std::string EntryFile(const std::string& folder) {
  std::vector<std::string> found;
  for (const auto& e : std::filesystem::directory_iterator(folder))
    if (e.path().extension() == ".catalog") found.push_back(e.path().string());
  BOOST_REQUIRE_EQUAL(found.size(), 1u);
  return found[0];
}

// Makes an edited entry's trailing XXH3-64 right again.
void Reseal(std::string* bytes) {
  const uint64_t sum = XXH3_64bits(bytes->data(), bytes->size() - 8);
  PatchLE(bytes, bytes->size() - 8, sum, 8);
}

// Where an entry's chunk table starts: after its tensor count, tensors per chunk and chunk
// count, which the test knows.
size_t ChunkTableAt(const std::string& bytes, uint64_t tensors, uint64_t per_chunk) {
  const uint64_t chunks = (tensors - 1) / per_chunk + 1;
  const std::string counts = LE64(tensors) + LE64(per_chunk) + LE64(chunks);
  const size_t at = bytes.find(counts);
  BOOST_REQUIRE(at != std::string::npos);
  BOOST_REQUIRE(bytes.find(counts, at + 1) == std::string::npos);
  return at + counts.size();
}

uint64_t GetLE64(const std::string& bytes, size_t at) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t{static_cast<uint8_t>(bytes[at + i])} << (8 * i);
  return v;
}

// A catalog of `n` tensors of every kind a reader makes (contiguous ranges, a strided
// view, several boxes, shared storage, paths with ints and odd strings) over `source`.
Catalog MakeCatalog(const std::string& source, size_t n) {
  WriteFile(source, PatternBytes(1 << 16, 3));
  Catalog catalog;
  catalog.source = source;
  catalog.format = "safetensors";
  catalog.files = std::make_shared<ckptfs::SourceFiles>(ckptfs::Env::Local());
  uint32_t file;
  BOOST_REQUIRE(catalog.files->Add(source, &file).ok());
  catalog.metadata = {{"step", 12}, {"names", {"a", "b"}}};
  // Any record will do: the cache keeps it as it is.
  catalog.whole_safetensors_files.push_back(ckptfs::WholeSafetensorsFile{file, 4096, 3, 9, 6});
  std::mt19937 random(5);
  for (size_t i = 0; i < n; ++i) {
    TensorEntry t;
    t.key = "layer." + std::to_string(i) + (i % 7 == 0 ? "/odd%key" : ".weight");
    t.path = {std::string("layer"), static_cast<int64_t>(i), std::string(i % 7 == 0 ? "/odd%key" : "weight")};
    t.dtype = i % 3 == 0 ? DType::kBF16 : DType::kF32;
    const uint64_t item = ckptfs::Info(t.dtype).itemsize;
    const uint64_t base = item * (random() % 1000);
    switch (i % 4) {
      case 0:  // contiguous
        t.shape = {2, 3};
        t.boxes.push_back(Box::Range(file, base, 0, 6));
        break;
      case 1:  // a strided view (a transpose)
        t.shape = {3, 2};
        t.boxes.push_back(Box::Strided(file, base, {3, 2}, {1, 3}));
        break;
      case 2:  // two shards
        t.shape = {8};
        t.boxes.push_back(Box::Range(file, base, 0, 5));
        t.boxes.push_back(Box::Range(file, base + 4096, 5, 3));
        break;
      default:  // shares storage with the tensor before it
        t.shape = {2, 3};
        t.boxes.push_back(Box::Range(file, base, 0, 6));
        t.storage_id = "storage-" + std::to_string(i - 1);
    }
    catalog.tensors.push_back(std::move(t));
  }
  for (const TensorEntry& t : catalog.tensors) BOOST_REQUIRE(ckptfs::ValidateLayout(t, *catalog.files, source).ok());
  return catalog;
}

}  // namespace

// In chunks of 100 tensors, decoded on several threads: the catalog comes back equal.
BOOST_AUTO_TEST_CASE(round_trip_of_many_chunks) {
  TempDir dir;
  const std::string source = dir.File("data.bin");
  Catalog catalog = MakeCatalog(source, 1050);
  const SourceOptions options = CacheOptions(dir.File("cache"));
  Status s = ckptfs::StoreCachedCatalog(source, options, catalog, 100);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  std::string note;
  std::shared_ptr<Catalog> loaded = Load(source, options, &note);
  BOOST_REQUIRE_MESSAGE(loaded, note);
  BOOST_TEST(note.empty());
  RequireSameCatalog(*loaded, catalog);

  // A tensor whose boxes no longer tile it, stored as if it were fine: an entry can only
  // hold a checked catalog, so the entry is damaged.
  catalog.tensors[777].boxes[0].extent[0] = 5;
  BOOST_REQUIRE(ckptfs::StoreCachedCatalog(source, options, catalog, 100).ok());
  BOOST_TEST(!Load(source, options, &note));
  BOOST_TEST(Contains(note, "its content is damaged"), note);
}

// The cache folder is reached through the Env options.catalog_cache_env names: every entry
// read and written there (here an in-memory one), none on the local disk.
BOOST_AUTO_TEST_CASE(entries_live_on_the_cache_env) {
  TempDir dir;
  const std::string source = dir.File("data.bin");
  const Catalog catalog = MakeCatalog(source, 250);
  auto env = std::make_shared<ckptfs::MemoryEnv>();
  SourceOptions options = CacheOptions("/caches/catalogs");
  options.catalog_cache_env = env;
  std::string note;
  BOOST_TEST(!Load(source, options, &note));  // no entry yet, and no note for that
  BOOST_TEST(note.empty(), note);
  Status s = ckptfs::StoreCachedCatalog(source, options, catalog, 100);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  std::vector<ckptfs::FolderEntry> entries;
  BOOST_REQUIRE(env->ListFolder("/caches/catalogs", &entries).ok());
  BOOST_REQUIRE_EQUAL(entries.size(), 1u);
  BOOST_TEST(entries[0].name.ends_with(".catalog"), entries[0].name);
  BOOST_TEST(!std::filesystem::exists("/caches"));
  std::shared_ptr<Catalog> loaded = Load(source, options, &note);
  BOOST_REQUIRE_MESSAGE(loaded, note);
  RequireSameCatalog(*loaded, catalog);
  BOOST_TEST(ckptfs::CachedCatalogUsable(source, options));

  // A damaged entry on that Env is noticed as on disk.
  const std::string entry = "/caches/catalogs/" + entries[0].name;
  std::string bytes;
  BOOST_REQUIRE(env->ReadSmallFile(entry, 1 << 20, &bytes).ok());
  bytes[bytes.size() / 2] ^= 1;
  BOOST_REQUIRE(env->WriteFile(entry, bytes).ok());
  BOOST_TEST(!Load(source, options, &note));
  BOOST_TEST(Contains(note, "damaged"), note);
}

// An Env that takes no writes (a URL's) cannot hold the cache: storing says so.
BOOST_AUTO_TEST_CASE(cache_env_without_writes_is_refused_when_storing) {
  TempDir dir;
  const std::string source = dir.File("data.bin");
  const Catalog catalog = MakeCatalog(source, 3);
  // Reads as a MemoryEnv does; writes as Env's defaults (none).
  class ReadOnlyEnv final : public ckptfs::Env {
   public:
    Status Open(const std::string& path, std::unique_ptr<ckptfs::SourceFile>* out) override {
      return files_.Open(path, out);
    }
    Status Stat(const std::string& path, ckptfs::PathType* type) override { return files_.Stat(path, type); }
    Status ListFolder(const std::string& path, std::vector<ckptfs::FolderEntry>* out) override {
      return files_.ListFolder(path, out);
    }
    ckptfs::EnvTraits traits() const override { return files_.traits(); }

   private:
    ckptfs::MemoryEnv files_;
  };
  SourceOptions options = CacheOptions("/caches/catalogs");
  options.catalog_cache_env = std::make_shared<ReadOnlyEnv>();
  const Status s = ckptfs::StoreCachedCatalog(source, options, catalog);
  BOOST_TEST(!s.ok());
  BOOST_TEST(Contains(s.message(), "cannot create the catalog cache folder"), s.message());
}

// An entry has no place for a model description: a catalog with one is not stored (rather
// than stored without it, which a later hit would serve as a catalog without a model).
BOOST_AUTO_TEST_CASE(catalog_with_a_model_description_is_not_stored) {
  TempDir dir;
  const std::string source = dir.File("data.bin");
  Catalog catalog = MakeCatalog(source, 3);
  catalog.model.emplace();
  catalog.model->source = "common.pt args";
  const SourceOptions options = CacheOptions(dir.File("cache"));
  const Status s = ckptfs::StoreCachedCatalog(source, options, catalog);
  BOOST_TEST((s.code() == Status::Code::kNotSupported));
  BOOST_TEST(Contains(s.message(), "model description"), s.message());
  BOOST_TEST(!std::filesystem::exists(dir.File("cache")));
}

// More tensors than one chunk of the default size: two chunks, the second partly full.
BOOST_AUTO_TEST_CASE(round_trip_above_one_default_chunk) {
  TempDir dir;
  const std::string source = dir.File("data.bin");
  Catalog catalog = MakeCatalog(source, ckptfs::kCatalogCacheChunkTensors + 4465);
  const SourceOptions options = CacheOptions(dir.File("cache"));
  Status s = ckptfs::StoreCachedCatalog(source, options, catalog);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  std::string note;
  std::shared_ptr<Catalog> loaded = Load(source, options, &note);
  BOOST_REQUIRE_MESSAGE(loaded, note);
  RequireSameCatalog(*loaded, catalog);
}

// Each way a chunk table can be wrong, with the entry's checksum made right again: the
// entry is damaged, the source is read instead (the same catalog as without the cache),
// and the entry replaced by a good one.
BOOST_AUTO_TEST_CASE(damaged_chunk_table_reads_the_source) {
  TempDir dir;
  const std::string source = dir.File("ckpt.safetensors");
  const size_t n = 5000, per_chunk = 1000, chunks = 5;
  WriteSafetensors(source, n);
  const std::string cache = dir.File("cache");
  const SourceOptions options = CacheOptions(cache);
  std::shared_ptr<const Catalog> fresh = MustOpen(source, SourceOptions{});

  struct Damage {
    const char* what;
    // Whether the table's own checks catch it (CachedCatalogUsable, which decodes no
    // tensor, says no); the others show when a chunk's tensors are decoded.
    bool structural;
    void (*apply)(std::string* bytes, size_t table);
  };
  const Damage damages[] = {
      {"a chunk ending where it begins", true, [](std::string* b, size_t t) { PatchLE(b, t + 8, GetLE64(*b, t), 8); }},
      {"chunks out of order", true,
       [](std::string* b, size_t t) {
         const uint64_t first = GetLE64(*b, t), second = GetLE64(*b, t + 8);
         PatchLE(b, t, second, 8);
         PatchLE(b, t + 8, first, 8);
       }},
      {"a boundary moved into a record", false, [](std::string* b, size_t t) { PatchLE(b, t + 16, GetLE64(*b, t + 16) + 3, 8); }},
      {"the last chunk ending before the body", true, [](std::string* b, size_t t) { PatchLE(b, t + 32, GetLE64(*b, t + 32) - 1, 8); }},
      {"a chunk ending past the file", true, [](std::string* b, size_t t) { PatchLE(b, t + 24, uint64_t{1} << 40, 8); }},
      {"one chunk fewer than the tensors need", true, [](std::string* b, size_t t) { PatchLE(b, t - 8, 4, 8); }},
      {"a chunk size of zero", true, [](std::string* b, size_t t) { PatchLE(b, t - 16, 0, 8); }},
      {"more tensors per chunk than written", false, [](std::string* b, size_t t) { PatchLE(b, t - 16, 1001, 8); }},
  };
  for (const Damage& damage : damages) {
    BOOST_TEST_CONTEXT(damage.what) {
      std::filesystem::remove_all(cache);
      Status s = ckptfs::StoreCachedCatalog(source, options, *fresh, per_chunk);
      BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
      const std::string entry = EntryFile(cache);
      std::string bytes = ReadFile(entry);
      const size_t table = ChunkTableAt(bytes, n, per_chunk);
      // The table as written: increasing ends, the last at the body's end (before the checksum).
      for (size_t c = 1; c < chunks; ++c) BOOST_REQUIRE(GetLE64(bytes, table + 8 * c) > GetLE64(bytes, table + 8 * (c - 1)));
      BOOST_REQUIRE_EQUAL(GetLE64(bytes, table + 8 * (chunks - 1)), bytes.size() - 8 - 20);
      std::string note;
      BOOST_REQUIRE(Load(source, options, &note));  // intact, it is a hit

      damage.apply(&bytes, table);
      Reseal(&bytes);
      WriteFile(entry, bytes);
      BOOST_TEST(!Load(source, options, &note));
      BOOST_TEST(Contains(note, "ignoring the catalog cache entry " + entry), note);
      BOOST_TEST(ckptfs::CachedCatalogUsable(source, options) == !damage.structural);
      RequireSameCatalog(*MustOpen(source, options), *fresh);
      BOOST_REQUIRE(ReadFile(entry) != bytes);  // replaced
      std::shared_ptr<Catalog> again = Load(source, options, &note);
      BOOST_REQUIRE_MESSAGE(again, note);
      RequireSameCatalog(*again, *fresh);
    }
  }
}

// A safetensors file of 300 tensors opened once with the cache on: its entry is written.
struct CachedSafetensors {
  TempDir dir;
  const std::string source = dir.File("ckpt.safetensors");
  const std::string cache = dir.File("cache");
  const SourceOptions options = CacheOptions(cache);
  std::shared_ptr<const Catalog> fresh;
  std::string entry;

  CachedSafetensors() {
    WriteSafetensors(source, 300);
    fresh = MustOpen(source, options);
    entry = EntryFile(cache);
  }
};

// An entry of version 4 (no whole safetensors files) is of another version: not used, and
// replaced by one of the current version.
BOOST_AUTO_TEST_CASE(older_version_entry_is_replaced) {
  const CachedSafetensors c;
  std::string bytes = ReadFile(c.entry);
  BOOST_REQUIRE_EQUAL(GetLE64(bytes, 16) & 0xFFFFFFFF, 5u);
  PatchLE(&bytes, 16, 4, 4);
  Reseal(&bytes);
  WriteFile(c.entry, bytes);
  std::string note;
  BOOST_TEST(!Load(c.source, c.options, &note));
  BOOST_TEST(Contains(note, "of another version"), note);
  BOOST_TEST(!ckptfs::CachedCatalogUsable(c.source, c.options));
  RequireSameCatalog(*MustOpen(c.source, c.options), *c.fresh);
  BOOST_TEST((GetLE64(ReadFile(c.entry), 16) & 0xFFFFFFFF) == 5u);
  BOOST_TEST(ckptfs::CachedCatalogUsable(c.source, c.options));
  BOOST_TEST(Load(c.source, c.options, &note));
}

// The stamp the entry's head records, replaced by `other` of the same length (the chunk
// table's offsets stay right), with the checksum made right again.
void ReplaceStamp(std::string* bytes, const std::string& stamp, const std::string& other) {
  BOOST_REQUIRE_EQUAL(other.size(), stamp.size());
  const std::string field = LE64(stamp.size()) + stamp;
  const size_t at = bytes->find(field);
  BOOST_REQUIRE(at != std::string::npos);
  BOOST_REQUIRE(bytes->find(field, at + 1) == std::string::npos);
  bytes->replace(at + 8, other.size(), other);
  Reseal(bytes);
}

// An entry written by other reader code (another reader code stamp: any edit of the readers'
// sources) or another ckptfs version, everything else in it intact and its checksum right, is
// stale: not used, silently, as for a changed file; the source is read and the entry
// rewritten with this build's stamp.
BOOST_AUTO_TEST_CASE(entry_of_another_reader_is_replaced) {
  const CachedSafetensors c;
  BOOST_REQUIRE_EQUAL(c.fresh->format, "safetensors");
  const std::string stamp = ckptfs::ReaderStamp("safetensors");
  const std::string code = std::string("; readers ") + ckptfs::kReaderCodeStamp;
  BOOST_REQUIRE_EQUAL(stamp, std::string("ckptfs ") + CKPTFS_VERSION + code);
  const std::string written = ReadFile(c.entry);
  std::string note;
  BOOST_REQUIRE(Load(c.source, c.options, &note));  // intact, it is a hit

  // The stamp with the last character of `part` changed: another value of the same length.
  auto changed = [&](std::string_view part) {
    std::string other = stamp;
    char& last = other[other.find(part) + part.size() - 1];
    BOOST_REQUIRE(std::isxdigit(static_cast<unsigned char>(last)));
    last = last == '0' ? '1' : '0';
    return other;
  };
  const std::string others[] = {changed(code), changed(CKPTFS_VERSION)};
  for (const std::string& other : others) {
    BOOST_TEST_CONTEXT("written by '" << other << "'") {
      std::string bytes = written;
      ReplaceStamp(&bytes, stamp, other);
      WriteFile(c.entry, bytes);
      BOOST_TEST(!Load(c.source, c.options, &note));
      BOOST_TEST(note.empty(), note);
      BOOST_TEST(!ckptfs::CachedCatalogUsable(c.source, c.options));
      RequireSameCatalog(*MustOpen(c.source, c.options), *c.fresh);
      BOOST_TEST((ReadFile(c.entry) == written));  // rewritten as this build writes it
      std::shared_ptr<Catalog> again = Load(c.source, c.options, &note);
      BOOST_REQUIRE_MESSAGE(again, note);
      RequireSameCatalog(*again, *c.fresh);
    }
  }
}

// Every format a reader sets has the build's stamp (the reader code stamp: a hash of 32 hex
// digits; that it follows the sources is tests/unit/reader_code_stamp_test.cmake's); a
// catalog of a format no reader builds is not stored.
BOOST_AUTO_TEST_CASE(reader_stamps) {
  const std::string code = ckptfs::kReaderCodeStamp;
  BOOST_TEST(code.size() == 32u);
  BOOST_TEST(code.find_first_not_of("0123456789abcdef") == std::string::npos, code);
  for (const char* format : {"torch-zip", "torch-legacy", "torchscript", "torch-export", "safetensors",
                             "safetensors-folder", "torch-zip-folder", "deepspeed-zero", "deepspeed-pipeline",
                             "deepspeed-universal", "dcp", "dcp-hf-shards", "verl", "torch-ranks"})
    BOOST_TEST(ckptfs::ReaderStamp(format) == std::string("ckptfs ") + CKPTFS_VERSION + "; readers " + code, format);
  BOOST_TEST(ckptfs::ReaderStamp("unknown").empty());

  TempDir dir;
  const std::string source = dir.File("data.bin");
  Catalog catalog = MakeCatalog(source, 10);
  catalog.format = "unknown";
  const SourceOptions options = CacheOptions(dir.File("cache"));
  Status s = ckptfs::StoreCachedCatalog(source, options, catalog);
  BOOST_TEST(!s.ok());
  BOOST_TEST(Contains(s.message(), "no reader stamp"), s.message());
  BOOST_TEST(!std::filesystem::exists(dir.File("cache")));
}

// A weight index read as the source: its folder's other files are served beside the
// weights, so a file added there shows on the next open; no entry is ever written.
BOOST_AUTO_TEST_CASE(weight_index_is_not_cached) {
  TempDir dir;
  WriteSafetensors(dir.File("model-00001-of-00001.safetensors"), 3);
  WriteFile(dir.File("model.safetensors.index.json"),
            R"({"metadata": {}, "weight_map": {"w.0": "model-00001-of-00001.safetensors",
                "w.1": "model-00001-of-00001.safetensors", "w.2": "model-00001-of-00001.safetensors"}})");
  WriteFile(dir.File("config.json"), "{}");
  const std::string index = dir.File("model.safetensors.index.json");
  const std::string cache = dir.File("cache");
  const SourceOptions options = CacheOptions(cache);
  BOOST_REQUIRE_EQUAL(MustOpen(index, options)->sibling_files.size(), 1u);
  WriteFile(dir.File("tokenizer.json"), "{}");
  std::shared_ptr<const Catalog> again = MustOpen(index, options);
  BOOST_TEST(again->sibling_files.size() == 2u);
  BOOST_TEST(!std::filesystem::exists(cache));
  BOOST_TEST(!ckptfs::CatalogCacheHit(index, options));
}

// What the cache has to say comes back to the caller as notes, for its front end to show.
BOOST_AUTO_TEST_CASE(a_cache_that_cannot_be_written_is_a_note) {
  TempDir dir;
  const std::string source = dir.File("ckpt.safetensors");
  WriteSafetensors(source, 3);
  WriteFile(dir.File("not-a-folder"), "x");
  std::shared_ptr<const Catalog> catalog;
  std::vector<std::string> notes;
  Status s = ckptfs::OpenCatalog(source, CacheOptions(dir.File("not-a-folder") + "/cache"), &catalog, &notes);
  BOOST_REQUIRE_MESSAGE(s.ok(), s.message());
  BOOST_REQUIRE_EQUAL(notes.size(), 1u);
  BOOST_TEST(StartsWith(notes[0], "not cached: "), notes[0]);
}
