// Reader for folders with subfolders: the folder is served as the folder it is (doc/MOUNT.md,
// "Folders"). Each folder of the tree that holds a checkpoint is a model component, read by
// the reader its files call for (a model folder's by the weight-file rules, a DeepSpeed or DCP
// folder's by theirs) and served in a folder at the same path under the weight file names
// its loader looks for; every other file is passed through at its path. A diffusers pipeline
// (model_index.json, unet/, vae/, scheduler/, ...), a sentence-transformers folder (the
// transformer at the top, 1_Pooling/config.json) and a Trainer's output_dir of checkpoint-N/
// folders are all read this way.
//
// Tensor keys of a component in a subfolder start with its path and "/" ("unet/conv_in.weight");
// the top level's keep theirs. What the tree holds that is not served (a subfolder a reader
// refused, folders past the depth limit) is listed in metadata["not_served"], which `info`
// prints and the mount says in one line.
#include <algorithm>
#include <set>
#include <string_view>
#include <tuple>

#include "format/readers.hpp"
#include "format/safetensors/folder_weights.hpp"
#include "format/sibling_files.hpp"

namespace ckptfs {

extern const ReaderEntry kFolderTreeReader, kCheckpointFolderReader;

namespace {

using json = nlohmann::json;

// How deep the walk goes below the source, and how many folders it lists at most: a source
// given by mistake (a home folder) is refused before it is walked for minutes.
constexpr int kMostDepth = 8;
constexpr size_t kMostFolders = 4096;

// The format of a tree whose models are not one model at its top level.
constexpr const char* kFolderTreeFormat = "model-folders";

bool IsHidden(const std::string& name) { return name.empty() || name.front() == '.'; }

// The names the mount's root gives its own entries: a subfolder of those names is not served.
bool IsMountEntryName(const std::string& name) {
  return name == "tensors" || name == "metadata.json" || name == "manifest.json";
}

class TreeWalk {
 public:
  TreeWalk(const std::string& dir, const SourceOptions& options, Catalog* catalog)
      : dir_(dir), options_(options), catalog_(catalog) {}

  Status Run() {
    CKPTFS_RETURN_IF_ERROR(Visit("", 0));
    return Finish();
  }

 private:
  std::string PathOf(const std::string& rel) const { return rel.empty() ? dir_ : JoinPath(dir_, rel); }
  static std::string Join(const std::string& rel, const std::string& name) { return rel.empty() ? name : rel + "/" + name; }

  void NotServed(const std::string& rel, const std::string& why) { catalog_->not_served.emplace_back(rel + "/", why); }

  // Folder `rel` of the tree: a checkpoint another folder reader takes whole, else a model
  // folder or a folder of other files, then its subfolders.
  Status Visit(const std::string& rel, int depth) {
    const std::string path = PathOf(rel);
    if (!rel.empty()) {
      catalog_->folders.push_back(rel);
      bool taken = false;
      CKPTFS_RETURN_IF_ERROR(ReadByFolderReader(rel, &taken));
      if (taken) return Status::OK();
    }
    std::vector<FolderEntry> entries;
    CKPTFS_RETURN_IF_ERROR(catalog_->files->env().ListFolder(path, &entries));
    std::sort(entries.begin(), entries.end(), [](const FolderEntry& a, const FolderEntry& b) { return a.name < b.name; });
    std::vector<std::string> files, folders;
    for (const FolderEntry& e : entries) {
      if (IsHidden(e.name)) continue;
      if (e.type == PathType::kFile) files.push_back(e.name);
      else if (e.type == PathType::kFolder) folders.push_back(e.name);
    }
    const FolderWeights chosen = ChooseFolderWeights(files);
    if (!chosen.index.empty() || !chosen.files.empty()) {
      CKPTFS_RETURN_IF_ERROR(ReadModelFolder(rel, files));
    } else {
      for (const std::string& f : files) CKPTFS_RETURN_IF_ERROR(PassThrough(Join(rel, f)));
    }
    for (const std::string& f : folders) {
      const std::string sub = Join(rel, f);
      if (rel.empty() && IsMountEntryName(f)) {
        NotServed(sub, "its name is the mount's own " + f + (f == "tensors" ? "/ folder" : ""));
        continue;
      }
      if (depth + 1 > kMostDepth) {
        NotServed(sub, "deeper than " + std::to_string(kMostDepth) + " folders below the source");
        continue;
      }
      if (++folders_listed_ > kMostFolders)
        return Status::Refused(dir_, "more than " + std::to_string(kMostFolders) +
                                         " folders below it: not a checkpoint folder (give a model's folder as SOURCE)");
      CKPTFS_RETURN_IF_ERROR(Visit(sub, depth + 1));
    }
    return Status::OK();
  }

  // Whether a folder format other than a model folder's (DeepSpeed, DCP, veRL, torch rank
  // files) takes folder `rel`; if so it is read as one component.
  Status ReadByFolderReader(const std::string& rel, bool* taken) {
    *taken = false;
    Catalog sub;
    sub.source = PathOf(rel);
    sub.files = catalog_->files;
    SourceProbe probe(sub.source, PathType::kFolder, &sub);
    for (const ReaderEntry* reader : Readers()) {
      if (reader == &kFolderTreeReader || reader == &kCheckpointFolderReader) break;
      bool is_format = false;
      CKPTFS_RETURN_IF_ERROR(reader->detect(probe, &is_format));
      if (!is_format) continue;
      *taken = true;
      if (reader->formats[1].empty()) sub.format = std::string(reader->formats[0]);
      Status s = reader->read(probe, options_, &sub);
      if (!s.ok()) return Unread(rel, s);
      return Merge(rel, std::move(sub));
    }
    return Status::OK();
  }

  // Folder `rel` read by the model folder rules; its other files become its sibling files.
  Status ReadModelFolder(const std::string& rel, const std::vector<std::string>& files) {
    Catalog sub;
    sub.source = PathOf(rel);
    sub.files = catalog_->files;
    Status s = ReadCheckpointFolder(sub.source, &sub, options_.limits);
    if (!s.ok()) {
      CKPTFS_RETURN_IF_ERROR(Unread(rel, s));
      for (const std::string& f : files) CKPTFS_RETURN_IF_ERROR(PassThrough(Join(rel, f)));
      return Status::OK();
    }
    return Merge(rel, std::move(sub));
  }

  // A component whose reader refused it: errors that say the files are damaged or unreadable
  // refuse the whole source (as they would the folder alone); one that says the folder is
  // not a checkpoint ckptfs reads leaves it unserved, its files passed through and the
  // reason recorded.
  Status Unread(const std::string& rel, const Status& s) {
    if (s.code() != Status::Code::kNotSupported && s.code() != Status::Code::kInvalidArgument) return s;
    NotServed(rel, s.message());
    return Status::OK();
  }

  Status PassThrough(const std::string& rel) {
    uint32_t file = 0;
    CKPTFS_RETURN_IF_ERROR(catalog_->files->Add(PathOf(rel), &file));
    catalog_->sibling_files.push_back(file);
    sibling_paths_.push_back(rel);
    return Status::OK();
  }

  // The tensors, files and description of component `rel` become the tree's.
  Status Merge(const std::string& rel, Catalog sub) {
    const std::string prefix = rel.empty() ? "" : rel + "/";
    merged_.emplace_back(catalog_->tensors.size(), catalog_->tensors.size() + sub.tensors.size(), rel);
    for (TensorEntry& t : sub.tensors) {
      t.key.insert(0, prefix);
      // Storages are named per file: one component's "0" is not another's.
      if (!t.storage_id.empty()) t.storage_id.insert(0, prefix);
      catalog_->tensors.push_back(std::move(t));
    }
    for (WholeSafetensorsFile w : sub.whole_safetensors_files) {
      w.first_tensor += std::get<0>(merged_.back());
      w.key_prefix += static_cast<uint32_t>(prefix.size());
      catalog_->whole_safetensors_files.push_back(w);
    }
    for (uint32_t f : sub.sibling_files) {
      const std::string& whole = catalog_->files->path(f);
      catalog_->sibling_files.push_back(f);
      sibling_paths_.push_back(prefix + whole.substr(whole.rfind('/') + 1));
    }
    std::vector<ModelComponent> models = std::move(sub.components);
    if (models.empty()) models.push_back(ModelComponent{});
    for (ModelComponent& m : models) {
      m.folder = m.folder.empty() ? rel : Join(rel, m.folder);
      if (m.format.empty()) m.format = sub.format;
      catalog_->components.push_back(std::move(m));
    }
    if (rel.empty()) {
      root_format_ = sub.format;
      catalog_->metadata = std::move(sub.metadata);
      catalog_->model = std::move(sub.model);
      catalog_->layout_file = std::move(sub.layout_file);
    } else {
      components_[rel] = {{"format", sub.format}, {"metadata", std::move(sub.metadata)}};
    }
    return Status::OK();
  }

  // Every tensor must belong to the component it was read from: a top-level key that starts
  // with a component's folder ("unet/x" beside unet/) would be served in that folder.
  Status CheckComponentsApart() const {
    std::set<std::string, std::less<>> folders;
    for (const ModelComponent& m : catalog_->components)
      if (!m.folder.empty()) folders.insert(m.folder);
    for (const auto& [first, end, folder] : merged_) {
      for (size_t i = first; i < end; ++i) {
        const std::string& key = catalog_->tensors[i].key;
        std::string_view owner;
        for (size_t slash = key.find('/'); slash != std::string::npos; slash = key.find('/', slash + 1))
          if (folders.count(std::string_view(key).substr(0, slash))) owner = std::string_view(key).substr(0, slash);
        if (owner != folder)
          return Status::NotSupported(PathOf(folder), "tensor '" + key.substr(folder.empty() ? 0 : folder.size() + 1) +
                                                          "' would be served in the model folder " + std::string(owner) +
                                                          "/: its key starts with that folder's path");
      }
    }
    return Status::OK();
  }

  Status Finish() {
    if (catalog_->components.empty()) {
      std::string what = "no checkpoint in this folder or its subfolders (looked for DeepSpeed, DCP, veRL and torch rank "
                         "folders, then model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
                         "pytorch_model.bin.index.json, adapter_model.safetensors/.bin, other *.index.json, "
                         "*.safetensors, and .bin/.pt/.pth files that are not training state)";
      if (!catalog_->not_served.empty())
        what += "; not read: " + catalog_->not_served[0].first + " (" + catalog_->not_served[0].second + ")";
      return Status::InvalidArgument(dir_, what);
    }
    catalog_->sibling_paths = std::move(sibling_paths_);
    const bool one_at_top = catalog_->components.size() == 1 && catalog_->components[0].folder.empty();
    catalog_->format = one_at_top ? root_format_ : kFolderTreeFormat;
    json& meta = catalog_->metadata;
    if (!meta.is_object()) meta = json::object();
    if (!components_.empty()) meta["components"] = components_;
    for (const auto& [path, why] : catalog_->not_served) meta["not_served"].push_back({{"path", path}, {"why", why}});
    return CheckComponentsApart();
  }

  const std::string& dir_;
  const SourceOptions& options_;
  Catalog* catalog_;
  std::vector<std::string> sibling_paths_;
  std::string root_format_;
  json components_ = json::object();
  size_t folders_listed_ = 0;
  // The tensors each Merge added: [first, end) and the folder they were read from.
  std::vector<std::tuple<size_t, size_t, std::string>> merged_;
};

// A folder with a subfolder that is not hidden.
bool HasSubfolders(Env& env, const std::string& dir) {
  std::vector<FolderEntry> entries;
  if (!env.ListFolder(dir, &entries).ok()) return false;
  return std::any_of(entries.begin(), entries.end(),
                     [](const FolderEntry& e) { return e.type == PathType::kFolder && !IsHidden(e.name); });
}

Status ReadFolderTree(const std::string& dir, const SourceOptions& options, Catalog* catalog) {
  return TreeWalk(dir, options, catalog).Run();
}

}  // namespace

extern const ReaderEntry kFolderTreeReader = {
    "folders", "a folder with subfolders, served as itself: each folder that holds a checkpoint is a model "
                   "(diffusers pipelines, sentence-transformers, a Trainer's output_dir)",
    {"model-folders", ""}, DetectFolderOf<HasSubfolders>, ReadFolderOf<ReadFolderTree>};

}  // namespace ckptfs
