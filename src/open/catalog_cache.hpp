// A validated on-disk cache of catalogs, so that reopening an unchanged checkpoint skips
// parsing it (a torch.save of a million tensors: its pickle is most of the time to mount).
//
// One file per source and reading options, in the folder options.catalog_cache names (-o
// catalog_cache=DIR, "auto" resolved by the option table; never beside the source). It holds the
// identity (device, inode, size, mtime, ctime, version) of every source file the catalog reads
// and the ckptfs version and reader code stamp that built it (ReaderStamp), and is used only
// when each file, opened afresh, still has its identity and the readers of this build would have
// built it; any difference, a damaged or foreign cache file, or options that differ make
// OpenCatalog parse the source as if there were no cache, and write a new entry. Written under a
// temporary name and renamed, so a reader never sees half of one.
//
// Only local single-file sources (torch.save archives, safetensors files) are cached: a
// folder, or the folder of a weight index, can gain files that no recorded identity would
// reveal, and a URL's object has an identity the URL does not hold (the open layer's
// MayCacheCatalog, src/open/cached_catalog.cpp, says why).
// Layout: doc/FORMATS.md, "Catalog cache".
#ifndef CKPTFS_OPEN_CATALOG_CACHE_HPP_
#define CKPTFS_OPEN_CATALOG_CACHE_HPP_

#include <cstdint>
#include <memory>
#include <string>

#include "ckptfs/catalog.hpp"
#include "ckptfs/source.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// The cached catalog of `source`, its files opened afresh and checked against the recorded
// identities and every tensor's layout checked (ValidateLayout), in *out; null when there is none that may be used (the reason, for a damaged
// or stale entry, in *note).
void LoadCachedCatalog(const std::string& source, const SourceOptions& options, std::shared_ptr<Catalog>* out,
                       std::string* note);

// Whether `source` opened with `options` would read its catalog from the cache: an intact
// entry of the current version whose files, opened afresh, are unchanged, and whose tensor
// keys are distinct (a View of it cannot fail for two keys naming one file). Checks the
// entry's checksum, head and chunk table; decodes no tensor; reports nothing (OpenCatalog
// returns a note, when it reads).
bool CachedCatalogUsable(const std::string& source, const SourceOptions& options);

// Tensors per chunk of an entry: the unit that threads decode. A catalog of at most this
// many is decoded on the calling thread alone.
constexpr uint64_t kCatalogCacheChunkTensors = 65536;

// Writes `catalog` (read from `source` with `options`) into the cache, its tensors in
// chunks of `chunk_tensors` (tests make smaller ones).
Status StoreCachedCatalog(const std::string& source, const SourceOptions& options, const Catalog& catalog,
                          uint64_t chunk_tensors = kCatalogCacheChunkTensors);

}  // namespace ckptfs

#endif  // CKPTFS_OPEN_CATALOG_CACHE_HPP_
