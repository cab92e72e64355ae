// Opening a source: which format reader a path needs, and what the reader includes.
//
// The format layer's public entry point: the front ends (mount, command line, C API) call
// OpenCatalog and never a reader directly, so a new format is a new reader behind it.
#ifndef CKPTFS_SOURCE_HPP_
#define CKPTFS_SOURCE_HPP_

#include <memory>
#include <string>

#include "ckptfs/catalog.hpp"
#include "ckptfs/env.hpp"
#include "ckptfs/limits.hpp"
#include "ckptfs/remote.hpp"
#include "ckptfs/status.hpp"

namespace ckptfs {

// What a reader should include beyond the weights, and its limits (the source options of
// include/ckptfs/options.hpp).
struct SourceOptions {
  // DeepSpeed ZeRO: also serve each trainable parameter's Adam moments, as
  // "exp_avg.<name>" and "exp_avg_sq.<name>" after the weights.
  bool zero_moments = false;
  ReadLimits limits;
  // Where the source lives; null means the Env EnvForSource picks for the SOURCE string
  // (a remote Env for http(s):// and s3:// URLs, else the local file system).
  std::shared_ptr<Env> env;
  // How remote sources are fetched and cached.
  RemoteOptions remote;
  // A folder for validated catalogs of single-file local sources ("" = off, "auto" = the
  // user's cache folder): reopening an unchanged checkpoint then skips parsing it.
  std::string catalog_cache;
};

// Detects the format of `source` (a file or a folder) and reads its catalog.
Status OpenCatalog(const std::string& source, const SourceOptions& options, std::shared_ptr<const Catalog>* out);
inline Status OpenCatalog(const std::string& source, std::shared_ptr<const Catalog>* out) {
  return OpenCatalog(source, SourceOptions{}, out);
}

// Whether OpenCatalog(source, options) would find the catalog in the catalog cache: an
// intact entry of the current version, for these options, whose files are unchanged and
// whose tensor keys are distinct. Checks the entry's checksum and the files' identities only
// (a small part of reading it) and prints nothing. A mount that gets true mounts first and
// opens the catalog in its daemon.
bool CatalogCacheHit(const std::string& source, const SourceOptions& options);

}  // namespace ckptfs

#endif  // CKPTFS_SOURCE_HPP_
