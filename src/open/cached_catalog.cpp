// The catalog cache as the open layer uses it: which sources may be cached, and the notes a
// damaged or stale entry, or a cache that cannot be written, leaves for the front end.
#include "open/cached_catalog.hpp"

#include "open/catalog_cache.hpp"

namespace ckptfs {
namespace {

bool IsWeightIndexName(std::string_view path) {
  auto ends_with = [&](std::string_view suffix) {
    return path.size() > suffix.size() && path.substr(path.size() - suffix.size()) == suffix;
  };
  return ends_with(".safetensors.index.json") || ends_with(".bin.index.json");
}

void AddNote(std::vector<std::string>* notes, std::string note) {
  if (notes && !note.empty()) notes->push_back(std::move(note));
}

}  // namespace

// Local checkpoint files only: an entry's files are opened again through the local file
// system and known by their identities. Not a folder, nor a weight index (whose folder is
// listed for the files served beside the weights): a folder can gain files that no recorded
// identity reveals. Not an Env without local files: a remote object is more than its URL (an
// s3:// URL's endpoint and region come from the environment), an object without an ETag has
// no identity finer than its size and Last-Modified second, and the remote Envs keep the bytes
// a reader parses in their own cache (cache_dir), keyed by URL, ETag and size.
bool MayCacheCatalog(const std::string& source, Env& env, const SourceOptions& options) {
  if (options.catalog_cache.empty() || !env.traits().local_files || IsWeightIndexName(source)) return false;
  PathType type;
  return env.Stat(source, &type).ok() && type == PathType::kFile;
}

std::shared_ptr<Catalog> LoadCatalogFromCache(const std::string& source, const SourceOptions& options,
                                              std::vector<std::string>* notes) {
  std::shared_ptr<Catalog> cached;
  std::string note;
  LoadCachedCatalog(source, options, &cached, &note);
  AddNote(notes, std::move(note));
  return cached;
}

void StoreCatalogInCache(const std::string& source, const SourceOptions& options, const Catalog& catalog,
                         std::vector<std::string>* notes) {
  // A cache that cannot be written costs the next open its speed, nothing else.
  if (Status s = StoreCachedCatalog(source, options, catalog); !s.ok()) AddNote(notes, "not cached: " + s.message());
}

bool CatalogCacheHit(const std::string& source, const SourceOptions& options) {
  std::shared_ptr<Env> env;
  if (!ChooseEnv(source, options, &env).ok()) return false;
  return MayCacheCatalog(source, *env, options) && CachedCatalogUsable(source, options);
}

}  // namespace ckptfs
