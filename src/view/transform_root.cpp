// The `root=PREFIX` view: only the tensors whose keys start with `PREFIX.`, that prefix
// removed, and the metadata of the same subtree when the checkpoint nests it the same way.
#include <set>

#include "view/transform.hpp"

namespace ckptfs {
namespace {

class RootTransform : public Transform {
 public:
  explicit RootTransform(std::string root) : root_(std::move(root)) {}

  Status Apply(ServedTensors* served) const override {
    for (const ModelComponent& model : served->components())
      if (model.folder == root_) return SelectFolder(served);
    const std::string prefix = root_ + ".";
    std::vector<TensorEntry> kept;
    std::vector<uint32_t> from;
    for (size_t i = 0; i < served->size(); ++i) {
      if (!(*served)[i].key().starts_with(prefix)) continue;
      const TensorEntry* entry = nullptr;
      CKPTFS_RETURN_IF_ERROR((*served)[i].Stored(&entry));
      const TensorEntry& t = *entry;
      TensorEntry copy = t;
      copy.key = t.key.substr(prefix.size());
      kept.push_back(std::move(copy));
      from.push_back(static_cast<uint32_t>(i));
    }
    if (kept.empty()) {
      std::set<std::string> tops;
      for (size_t i = 0; i < served->size(); ++i) {
        const std::string_view key = (*served)[i].key();
        tops.emplace(key.substr(0, key.find('.')));
      }
      std::string list;
      for (const auto& top : tops) list += (list.empty() ? "" : ", ") + top;
      std::string folders;
      for (const ModelComponent& model : served->components())
        if (!model.folder.empty()) folders += (folders.empty() ? "" : ", ") + model.folder;
      return Status::InvalidArgument("root=" + root_, "no tensor keys start with '" + prefix + "'; top-level prefixes: " + list +
                                                        (folders.empty() ? "" : "; model folders: " + folders));
    }
    ServedTensorsEditor edit(served);
    edit.Replace(std::move(kept), from);
    edit.SetMetadata(Narrowed(served->metadata()));
    (*edit.mutable_manifest_fields())["root"] = root_;
    return Status::OK();
  }

 private:
  // root= names a model folder of the tree (unet of a pipeline): that folder is served as the
  // tree, as if it were the source, its tensors' keys without the folder.
  Status SelectFolder(ServedTensors* served) const {
    const std::string prefix = root_ + "/";
    auto under = [&](const std::string& path, std::string* rest) {
      if (!path.starts_with(prefix)) return false;
      *rest = path.substr(prefix.size());
      return true;
    };
    std::vector<TensorEntry> kept;
    std::vector<uint32_t> from;
    for (size_t i = 0; i < served->size(); ++i) {
      const std::string_view key = (*served)[i].key();
      if (!key.starts_with(prefix)) continue;
      const TensorEntry* entry = nullptr;
      CKPTFS_RETURN_IF_ERROR((*served)[i].Stored(&entry));
      TensorEntry copy = *entry;
      copy.key = entry->key.substr(prefix.size());
      kept.push_back(std::move(copy));
      from.push_back(static_cast<uint32_t>(i));
    }
    std::vector<ModelComponent> models;
    for (const ModelComponent& model : served->components()) {
      std::string rest;
      if (model.folder == root_) rest.clear();
      else if (!under(model.folder, &rest)) continue;
      ModelComponent m = model;
      m.folder = rest;
      models.push_back(std::move(m));
    }
    std::vector<PassedFile> passed;
    for (const PassedFile& file : served->passed_files())
      if (std::string rest; under(file.path, &rest)) passed.push_back(PassedFile{rest, file.file});
    std::vector<std::string> folders;
    for (const std::string& folder : served->folders())
      if (std::string rest; under(folder, &rest)) folders.push_back(rest);
    nlohmann::json metadata = nlohmann::json::object();
    const nlohmann::json& all = served->metadata();
    if (all.contains("components") && all["components"].contains(root_)) metadata = all["components"][root_]["metadata"];
    ServedTensorsEditor edit(served);
    edit.Replace(std::move(kept), from);
    edit.SetTree(std::move(models), std::move(passed), std::move(folders));
    edit.SetMetadata(std::move(metadata));
    (*edit.mutable_manifest_fields())["root"] = root_;
    return Status::OK();
  }

  // The node of `metadata` at the root's path (its dot-separated parts as object keys), or
  // an empty object when the metadata does not nest that way.
  nlohmann::json Narrowed(const nlohmann::json& metadata) const {
    const nlohmann::json* node = &metadata;
    size_t start = 0;
    bool found = true;
    while (found && start <= root_.size()) {
      const size_t dot = root_.find('.', start);
      const std::string part = root_.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      found = node->is_object() && node->contains(part);
      if (found) node = &(*node)[part];
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    return found ? *node : nlohmann::json::object();
  }

  std::string root_;
};

}  // namespace

std::unique_ptr<Transform> MakeRootTransform(const ViewOptions& options) {
  if (options.root.empty()) return nullptr;
  return std::make_unique<RootTransform>(options.root);
}

}  // namespace ckptfs
