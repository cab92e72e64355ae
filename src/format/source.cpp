// Format detection: which reader a source path needs.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <vector>

#include "ckptfs/remote.hpp"
#include "format/catalog_cache.hpp"
#include "format/limit_hint.hpp"
#include "format/readers.hpp"
#include "format/zip.hpp"
#include "io/parallel.hpp"

namespace ckptfs {
namespace {

// Up to 512 leading bytes of the source file (added to the catalog's files, where its
// reader finds it again) to tell the formats apart: a tar header is 512 bytes.
Status Sniff(const std::string& path, SourceFiles* files, std::string* head) {
  uint32_t file;
  CKPTFS_RETURN_IF_ERROR(files->Add(path, &file));
  head->resize(std::min<uint64_t>(512, files->size(file)));
  return files->ReadExact(file, 0, head->size(), head->data());
}

// Tensors per thread of the layout check, at least: below twice this, one thread.
constexpr size_t kLayoutsPerWorker = 65536;

// ValidateLayout of every tensor, on a few threads for a large catalog. The error is the
// first tensor's in catalog order whatever the threads' timing: each thread checks a
// consecutive range and stops at its first bad tensor, and the earliest range's error wins.
Status ValidateLayouts(const Catalog& catalog, const std::string& source) {
  const std::string& layout_file = catalog.layout_file.empty() ? source : catalog.layout_file;
  const size_t count = catalog.tensors.size();
  const size_t workers = WorkerCount(count, kLayoutsPerWorker);
  std::vector<Status> first_error(workers);
  RunOnWorkers(workers, [&](size_t w) {
    const auto [begin, end] = PartRange(count, workers, w);
    for (size_t i = begin; i < end; ++i) {
      Status s = ValidateLayout(catalog.tensors[i], *catalog.files, layout_file);
      if (!s.ok()) {
        first_error[w] = std::move(s);
        return;
      }
    }
  });
  for (Status& s : first_error)
    if (!s.ok()) return s;
  return Status::OK();
}

bool IsWeightIndexName(std::string_view path) {
  auto ends_with = [&](std::string_view suffix) {
    return path.size() > suffix.size() && path.substr(path.size() - suffix.size()) == suffix;
  };
  return ends_with(".safetensors.index.json") || ends_with(".bin.index.json");
}

// Whether the catalog of `source`, when it is a file, may come from and go into the catalog
// cache: local checkpoint files only, reached through the local file system (an entry's
// files are opened again through it). Not a weight index: its folder is listed for the
// files served beside the weights, and a file added there is in no recorded identity. Not a
// URL: an object is more than its URL (an s3:// URL's endpoint and region come from the
// environment), an object without an ETag has no identity finer than its size and
// Last-Modified second, and the remote Envs keep the bytes a reader parses in their own
// cache (cache_dir), keyed by URL, ETag and size.
bool CacheableSource(const std::string& source, const SourceOptions& options) {
  return !options.catalog_cache.empty() && !options.env && !IsRemoteSource(source) && !IsWeightIndexName(source);
}

// The number of OpenCatalog's choice of reader: bump it whenever the choice changes (a format
// told apart differently, a new reader), so that no catalog cached from a reader a source no
// longer goes to is served.
constexpr uint32_t kDetectionFormat = 1;

struct ReaderNumber {
  std::string_view reader;  // empty: none
  uint32_t number = 0;
};
constexpr ReaderNumber kTorchZip{"torch-zip", kTorchZipFormat};
constexpr ReaderNumber kTorchLegacy{"torch-legacy", kTorchLegacyFormat};
constexpr ReaderNumber kTorchScript{"torchscript", kTorchScriptFormat};
constexpr ReaderNumber kTorchExport{"torch-export", kTorchExportFormat};
constexpr ReaderNumber kSafetensors{"safetensors", kSafetensorsFormat};
constexpr ReaderNumber kFolder{"folder", kCheckpointFolderFormat};
constexpr ReaderNumber kDeepSpeed{"deepspeed", kDeepSpeedFormat};
constexpr ReaderNumber kDcp{"dcp", kDcpFormat};
constexpr ReaderNumber kDcpHfShards{"dcp-hf-shards", kDcpHfShardsFormat};

// Each Catalog::format a reader sets, and the readers whose output such a catalog holds:
// the one that builds it first, then those it reads files through.
struct FormatReaders {
  std::string_view format;
  ReaderNumber readers[4];
};
constexpr FormatReaders kFormatReaders[] = {
    {"torch-zip", {kTorchZip}},
    {"torch-legacy", {kTorchLegacy}},
    {"torchscript", {kTorchScript}},
    {"torch-export", {kTorchExport}},
    {"safetensors", {kSafetensors}},
    // A folder's weight files are read by the file readers.
    {"safetensors-folder", {kFolder, kSafetensors, kTorchZip, kTorchLegacy}},
    {"torch-zip-folder", {kFolder, kSafetensors, kTorchZip, kTorchLegacy}},
    {"deepspeed-zero", {kDeepSpeed}},
    {"deepspeed-pipeline", {kDeepSpeed}},
    // The non-tensor values of the torch_save serialization are torch.save archives.
    {"dcp", {kDcp, kTorchZip}},
    {"dcp-hf-shards", {kDcpHfShards}},
};

}  // namespace

std::string ReaderStamp(std::string_view format) {
  for (const FormatReaders& f : kFormatReaders) {
    if (f.format != format) continue;
    std::string stamp = std::string("ckptfs ") + CKPTFS_VERSION + "; detection " + std::to_string(kDetectionFormat);
    for (const ReaderNumber& r : f.readers)
      if (!r.reader.empty()) stamp += std::string("; ").append(r.reader) + " " + std::to_string(r.number);
    return stamp;
  }
  return "";
}

bool CatalogCacheHit(const std::string& source, const SourceOptions& options) {
  // As OpenCatalog decides below (no entry is ever written for a folder).
  return CacheableSource(source, options) && CachedCatalogUsable(source, options);
}

Status OpenCatalog(const std::string& source, const SourceOptions& options, std::shared_ptr<const Catalog>* out) {
  auto catalog = std::make_shared<Catalog>();
  catalog->source = source;
  std::shared_ptr<Env> source_env = options.env;
  if (!source_env) CKPTFS_RETURN_IF_ERROR(EnvForSource(source, options.remote, &source_env));
  catalog->files = std::make_shared<SourceFiles>(std::move(source_env));
  Env& env = catalog->files->env();
  PathType type;
  CKPTFS_RETURN_IF_ERROR(env.Stat(source, &type));
  if (type == PathType::kMissing) return Status::FromErrno(source, "cannot access", ENOENT);
  // Files only: a folder can gain files that no recorded identity reveals.
  const bool cacheable = type == PathType::kFile && CacheableSource(source, options);
  bool from_cache = false;
  if (cacheable) {
    std::shared_ptr<Catalog> cached;
    std::string note;
    LoadCachedCatalog(source, options, &cached, &note);
    if (!note.empty()) std::fprintf(stderr, "ckptfs: %s\n", note.c_str());
    if (cached) {
      catalog = std::move(cached);
      from_cache = true;
    }
  }
  if (from_cache) {
    // Read from the cache: checked below like a freshly read catalog.
  } else if (type == PathType::kFolder) {
    if (IsDeepSpeedFolder(env, source))
      CKPTFS_RETURN_IF_ERROR(ReadDeepSpeedCheckpoint(source, options, catalog.get()));
    else if (IsDcpFolder(env, source))
      CKPTFS_RETURN_IF_ERROR(ReadDcpCheckpoint(source, options, catalog.get()));
    else if (IsDcpHfShardFolder(env, source))
      CKPTFS_RETURN_IF_ERROR(ReadDcpHfShards(source, options, catalog.get()));
    else
      CKPTFS_RETURN_IF_ERROR(ReadCheckpointFolder(source, catalog.get(), options.limits));
  } else if (type == PathType::kFile && IsWeightIndexName(source)) {
    // An index names its shards relative to its own folder, which is read as a checkpoint
    // folder with that index (over HTTP the index is how the shards are found at all).
    const size_t slash = source.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : source.substr(0, slash);
    const std::string index_name = slash == std::string::npos ? source : source.substr(slash + 1);
    CKPTFS_RETURN_IF_ERROR(ReadCheckpointFolder(dir, catalog.get(), options.limits, index_name));
  } else if (type == PathType::kFile) {
    std::string head;
    CKPTFS_RETURN_IF_ERROR(Sniff(source, catalog->files.get(), &head));
    if (head.size() >= 4 && head.compare(0, 4, "PK\x03\x04", 4) == 0) {
      ZipArchive zip;
      CKPTFS_RETURN_IF_ERROR(TorchZipKind(source, catalog->files.get(), &catalog->format, &zip));
      if (catalog->format == "torchscript")
        CKPTFS_RETURN_IF_ERROR(ReadTorchScript(source, catalog.get(), &catalog->metadata, options.limits));
      else if (catalog->format == "torch-export")
        CKPTFS_RETURN_IF_ERROR(ReadTorchExport(source, catalog.get(), &catalog->metadata, options.limits));
      else
        CKPTFS_RETURN_IF_ERROR(ReadTorchZip(source, catalog.get(), &catalog->metadata, options.limits, &zip));
    } else if ((head.size() >= 9 && head[8] == '{') ||
               (source.size() > 12 && source.compare(source.size() - 12, 12, ".safetensors") == 0)) {
      // By content, or by name so that a damaged header gets a safetensors error message.
      catalog->format = "safetensors";
      CKPTFS_RETURN_IF_ERROR(ReadSafetensorsFile(source, catalog.get(), &catalog->metadata, options.limits));
    } else if (IsTorchLegacy(head)) {
      catalog->format = "torch-legacy";
      CKPTFS_RETURN_IF_ERROR(ReadTorchLegacy(source, head, catalog.get(), &catalog->metadata, options.limits));
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
  // Nothing reads a tensor whose boxes do not tile it exactly inside their files. (A
  // catalog from the cache had each tensor checked as it was decoded.)
  if (!from_cache) CKPTFS_RETURN_IF_ERROR(ValidateLayouts(*catalog, source));
  if (cacheable && !from_cache) {
    // A cache that cannot be written costs the next open its speed, nothing else.
    if (Status s = StoreCachedCatalog(source, options, *catalog); !s.ok())
      std::fprintf(stderr, "ckptfs: not cached: %s\n", s.message().c_str());
  }
  *out = std::move(catalog);
  return Status::OK();
}

}  // namespace ckptfs
