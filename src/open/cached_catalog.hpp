// The catalog cache (open/catalog_cache.hpp) as OpenCatalog uses it.
#ifndef CKPTFS_OPEN_CACHED_CATALOG_HPP_
#define CKPTFS_OPEN_CACHED_CATALOG_HPP_

#include <memory>
#include <string>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/env.hpp"
#include "ckptfs/open.hpp"
#include "ckptfs/source.hpp"

namespace ckptfs {

// Whether the catalog of `source`, read through `env`, may come from and go into the cache
// `options` name (none: false).
bool MayCacheCatalog(const std::string& source, Env& env, const SourceOptions& options);

// The cached catalog of `source`, or null (why, for a damaged or stale entry, added to *notes).
std::shared_ptr<Catalog> LoadCatalogFromCache(const std::string& source, const SourceOptions& options,
                                              std::vector<std::string>* notes);

// Writes `catalog` into the cache; a failure is a note, not an error.
void StoreCatalogInCache(const std::string& source, const SourceOptions& options, const Catalog& catalog,
                         std::vector<std::string>* notes);

}  // namespace ckptfs

#endif  // CKPTFS_OPEN_CACHED_CATALOG_HPP_
