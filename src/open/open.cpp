// OpenSource: Env, catalog (cached or read), View, for every front end.
#include "ckptfs/open.hpp"

#include <malloc.h>

#include "ckptfs/remote.hpp"
#include "open/cached_catalog.hpp"

namespace ckptfs {

Status ChooseEnv(const std::string& source, const SourceOptions& options, std::shared_ptr<Env>* out) {
  if (options.env) {
    *out = options.env;
    return Status::OK();
  }
  return EnvForSource(source, options.remote, out);
}

Status OpenCatalog(const std::string& source, const SourceOptions& options, std::shared_ptr<const Catalog>* out,
                   std::vector<std::string>* notes) {
  std::shared_ptr<Env> env;
  CKPTFS_RETURN_IF_ERROR(ChooseEnv(source, options, &env));
  const bool cacheable = MayCacheCatalog(source, *env, options);
  std::shared_ptr<Catalog> catalog;
  if (cacheable) catalog = LoadCatalogFromCache(source, options, notes);
  if (catalog) {
    // Each of its tensors' layouts was checked as the entry was decoded.
    CKPTFS_RETURN_IF_ERROR(CheckTensorLimit(*catalog, source, options.limits));
  } else {
    CKPTFS_RETURN_IF_ERROR(ReadCatalog(source, std::move(env), options, &catalog));
    if (cacheable) StoreCatalogInCache(source, options, *catalog, notes);
  }
  *out = std::move(catalog);
  return Status::OK();
}

Status OpenSource(const std::string& source, const OpenRequest& request, OpenedSource* out) {
  std::shared_ptr<const Catalog> catalog;
  CKPTFS_RETURN_IF_ERROR(OpenCatalog(source, request.source, &catalog, &out->notes));
  if (!catalog->not_served.empty()) {
    // One line: a tree served in part says what it left out (`ckptfs info` lists each).
    std::string line = source + ": not served: ";
    for (size_t k = 0; k < catalog->not_served.size() && k < 3; ++k)
      line += (k ? "; " : "") + catalog->not_served[k].first + " (" + catalog->not_served[k].second + ")";
    if (catalog->not_served.size() > 3) line += " and " + std::to_string(catalog->not_served.size() - 3) + " more";
    out->notes.push_back(std::move(line) + " (see ckptfs info)");
  }
  if (request.stage == OpenStage::kServedTensors) return ApplyViewOptions(std::move(catalog), request.view, &out->served);
  // Parsing left freed memory in the heap (a million-tensor pickle's values, the catalog
  // reader's scratch): hand it back before the View's build allocates its own scratch on top
  // (the names it sorts), or the two add up in the peak; and again after, or the process keeps
  // that peak as its resident size.
  if (request.trim_heap) malloc_trim(0);
  CKPTFS_RETURN_IF_ERROR(View::Build(std::move(catalog), request.view, &out->view));
  if (request.trim_heap) malloc_trim(0);
  return Status::OK();
}

}  // namespace ckptfs
