// View options: the catalog a view presents (root subtree, conversion marks). The options
// themselves are parsed by the option table (include/ckptfs/options.hpp).
#include <set>

#include "ckptfs/view.hpp"
#include "view/convert.hpp"

namespace ckptfs {

Status ApplyViewOptions(std::shared_ptr<const Catalog> catalog, const ViewOptions& options,
                        std::shared_ptr<const Catalog>* out) {
  if (options.root.empty() && !options.dtype) {
    *out = std::move(catalog);
    return Status::OK();
  }
  auto view = std::make_shared<Catalog>();
  view->format = catalog->format;
  view->source = catalog->source;
  view->files = catalog->files;
  view->sibling_files = catalog->sibling_files;
  view->layout_file = catalog->layout_file;
  view->metadata = catalog->metadata;
  const std::string prefix = options.root.empty() ? "" : options.root + ".";
  for (const TensorEntry& t : catalog->tensors) {
    if (!prefix.empty() && t.key.compare(0, prefix.size(), prefix) != 0) continue;
    TensorEntry copy = t;
    copy.key = t.key.substr(prefix.size());
    if (options.dtype && ConvertsTo(t.dtype, *options.dtype)) copy.convert_to = options.dtype;
    view->tensors.push_back(std::move(copy));
  }
  if (!prefix.empty()) {
    if (view->tensors.empty()) {
      std::set<std::string> tops;
      for (const TensorEntry& t : catalog->tensors) tops.insert(t.key.substr(0, t.key.find('.')));
      std::string list;
      for (const auto& top : tops) list += (list.empty() ? "" : ", ") + top;
      return Status::InvalidArgument("root=" + options.root,
                                     "no tensor keys start with '" + prefix + "'; top-level prefixes: " + list);
    }
    // The metadata of the subtree, when the checkpoint nests it the same way.
    nlohmann::json narrowed = nlohmann::json::object();
    const nlohmann::json* node = &catalog->metadata;
    size_t start = 0;
    bool found = true;
    while (found && start <= options.root.size()) {
      const size_t dot = options.root.find('.', start);
      const std::string part = options.root.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      found = node->is_object() && node->contains(part);
      if (found) node = &(*node)[part];
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    view->metadata = found ? *node : narrowed;
  }
  *out = std::move(view);
  return Status::OK();
}

}  // namespace ckptfs
