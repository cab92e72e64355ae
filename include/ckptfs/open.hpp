// Opening a source: the one path from a SOURCE string to what a front end serves.
//
// The open layer sits above the readers (format), the remote Envs and the View: it picks the
// Env for the SOURCE string, takes the catalog from the catalog cache or reads it (ReadCatalog)
// and stores it there, and builds the View. The mount, the command line and the C API each call
// OpenSource once; none of them names a kind of source or a format. Warnings (a stale cache
// entry, a cache that cannot be written) come back as notes for the front end to show its way.
#ifndef CKPTFS_OPEN_HPP_
#define CKPTFS_OPEN_HPP_

#include <memory>
#include <string>
#include <vector>

#include "ckptfs/catalog.hpp"
#include "ckptfs/env.hpp"
#include "ckptfs/source.hpp"
#include "ckptfs/status.hpp"
#include "ckptfs/view.hpp"

namespace ckptfs {

// How far OpenSource goes.
enum class OpenStage : uint8_t {
  kServedTensors,  // the tensors the view options serve (ls, info: no tree built)
  kView,           // the View (mount, cat, export, hash, load, the C API)
};

struct OpenRequest {
  SourceOptions source;
  ViewOptions view;
  OpenStage stage = OpenStage::kView;
  // Hand freed heap memory back to the system after parsing and after the View's build: a
  // long-lived process (the mount) otherwise keeps their peak as its resident size.
  bool trim_heap = false;
};

struct OpenedSource {
  ServedTensors served;        // OpenStage::kServedTensors
  std::unique_ptr<View> view;  // OpenStage::kView (its tensors: view->served())
  std::vector<std::string> notes;  // warnings, one line each, for the caller to show
};

// The Env of `source`: options.env when set, else the one EnvForSource picks for the string.
Status ChooseEnv(const std::string& source, const SourceOptions& options, std::shared_ptr<Env>* out);

// The catalog of `source` (its Env chosen as ChooseEnv does), from the catalog cache when
// options.catalog_cache names one and the source may be cached, else read and then stored
// there. Warnings go to *notes when given.
Status OpenCatalog(const std::string& source, const SourceOptions& options, std::shared_ptr<const Catalog>* out,
                   std::vector<std::string>* notes = nullptr);
inline Status OpenCatalog(const std::string& source, std::shared_ptr<const Catalog>* out) {
  return OpenCatalog(source, SourceOptions{}, out);
}

// OpenCatalog, then the tensors request.view serves of it, or its View.
Status OpenSource(const std::string& source, const OpenRequest& request, OpenedSource* out);

// Whether OpenCatalog(source, options) would find the catalog in the catalog cache: an
// intact entry of the current version, for these options, whose files are unchanged and
// whose tensor keys are distinct. Checks the entry's checksum and the files' identities only
// (a small part of reading it) and reports nothing. A mount that gets true mounts first and
// opens the catalog in its daemon.
bool CatalogCacheHit(const std::string& source, const SourceOptions& options);

}  // namespace ckptfs

#endif  // CKPTFS_OPEN_HPP_
