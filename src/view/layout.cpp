// Builds the virtual tree (the mount layout of README.md, "Mounting"):
//   model.safetensors, tensors/<escaped key>.safetensors, manifest.json, metadata.json,
//   and the sibling files of a model folder, passed through unchanged.
#include <algorithm>
#include <limits>
#include <numeric>
#include <map>
#include <set>
#include <string_view>
#include <tuple>
#include <utility>

#include <xxhash.h>

#include "ckptfs/names.hpp"
#include "ckptfs/view.hpp"
#include "io/json_text.hpp"
#include "io/parallel.hpp"
#include "view/safetensors_header.hpp"
#include "view/view_impl.hpp"

namespace ckptfs {

using json = nlohmann::json;

// Tensors per thread of the file-name sort, at least: below twice this, one thread.
constexpr size_t kSortTensorsPerWorker = 65536;

class ViewBuilder {
 public:
  // Lays out the tensors `view` serves (View::served_, set before).
  ViewBuilder(const ViewOptions& options, View* view)
      : served_(view->impl_->served_), catalog_(view->impl_->served_.source()), options_(options), view_(view) {}

  Status Build();

 private:
  View::NodeId AddEntry(View::NodeId parent, std::string name, bool is_dir);
  void AddLiteral(std::string bytes, uint64_t* pos);
  void FinishFile(View::NodeId id, uint64_t size, int64_t mtime_ns);
  View::NodeId FolderAt(const std::string& path);
  View::NodeId AddFileAt(const std::string& path);
  View::NodeId AddLiteralFile(const std::string& path, std::string content);
  void AddModelFile(View::NodeId folder, const ModelComponent& model, std::string name,
                    const std::vector<uint32_t>& members);
  void AddModelFileEntry(View::NodeId folder, View::Impl::ModelFile file);
  const WholeSafetensorsFile* ServedWhole(const ModelComponent& model, const std::vector<uint32_t>& members) const;
  std::vector<std::vector<uint32_t>> SplitIntoShards(const std::vector<uint32_t>& members) const;
  std::vector<std::vector<uint32_t>> SourceShards(const ModelComponent& model, const std::vector<uint32_t>& members,
                                                  std::vector<std::string>* names) const;
  void BuildModel(const ModelComponent& model, const std::vector<uint32_t>& members);
  void BuildModelFiles();
  void AddPassedFiles();
  Status SortTensorFiles();
  Status BuildManifest(View::NodeId manifest);

  const ServedTensors& served_;
  const Catalog& catalog_;  // the source: its files, format and path
  const ViewOptions& options_;
  View* view_;
  std::set<std::string> hidden_siblings_;
  std::map<std::string, std::string> renamed_siblings_;  // source name -> served name
  std::map<std::string, View::NodeId> folder_nodes_;     // path -> folder node, but the root
  std::vector<uint32_t> model_file_of_;                  // tensor index -> its model file
  // Each model and the path of the file a loader opens (its weights file or shard index).
  std::vector<std::pair<const ModelComponent*, std::string>> model_entries_;
};

// A source's own metadata.json (a Megatron step folder's: its backends and versions) is
// served under this name, since ckptfs's metadata.json has the name in every tree.
constexpr const char* kSourceMetadataName = "metadata.source.json";

View::NodeId ViewBuilder::AddEntry(View::NodeId parent, std::string name, bool is_dir) {
  View::NodeId id = static_cast<View::NodeId>(view_->impl_->entries_.size());
  View::Impl::Entry entry;
  entry.name = std::move(name);
  entry.parent = parent;
  entry.is_dir = is_dir;
  entry.mtime_ns = view_->impl_->newest_mtime_;
  entry.first_segment = static_cast<uint32_t>(view_->impl_->segments_.size());
  view_->impl_->entries_.push_back(std::move(entry));
  if (id != View::kRoot) view_->impl_->entries_[parent].children.push_back(id);
  return id;
}

void ViewBuilder::AddLiteral(std::string bytes, uint64_t* pos) {
  Segment seg;
  seg.kind = Segment::Kind::kLiteral;
  seg.ref = static_cast<uint32_t>(view_->impl_->literals_.size());
  seg.start = *pos;
  seg.length = bytes.size();
  *pos += bytes.size();
  view_->impl_->literals_.push_back(std::move(bytes));
  view_->impl_->segments_.push_back(seg);
}

void ViewBuilder::FinishFile(View::NodeId id, uint64_t size, int64_t mtime_ns) {
  View::Impl::Entry& n = view_->impl_->entries_[id];
  n.size = size;
  n.mtime_ns = mtime_ns;
  n.segment_count = static_cast<uint32_t>(view_->impl_->segments_.size() - n.first_segment);
}

// The source's safetensors file that a model file of `model` holding `members` would serve
// unchanged, if there is one: the same tensors under the same keys (no transform replaced the
// catalog's entries, and the model's folder is the prefix the file's keys lack), none of them
// converted and none empty (the catalog keeps no place for an empty tensor's bytes, which the
// file's header has). Serving the file itself then serves the same tensors, byte for byte,
// and keeps its own header and __metadata__.
const WholeSafetensorsFile* ViewBuilder::ServedWhole(const ModelComponent& model,
                                                     const std::vector<uint32_t>& members) const {
  // A shard size lays the model out anew, even where a shard would hold one file's tensors.
  if (!served_.SharesSourceEntries() || members.empty() || options_.shard_size > 0) return nullptr;
  const TensorEntry& first = catalog_.tensors[members.front()];
  if (first.boxes.empty()) return nullptr;
  const size_t key_prefix = model.folder.empty() ? 0 : model.folder.size() + 1;
  for (const WholeSafetensorsFile& whole : catalog_.whole_safetensors_files) {
    if (whole.file != first.boxes[0].file) continue;
    if (whole.key_prefix != key_prefix || whole.tensor_count != members.size()) return nullptr;
    for (uint32_t i : members) {
      const TensorEntry& t = catalog_.tensors[i];
      if (i < whole.first_tensor || i - whole.first_tensor >= whole.tensor_count || t.boxes.empty() ||
          t.boxes[0].file != whole.file || served_[i].converted())
        return nullptr;
    }
    return &whole;  // members are distinct: all of the file's tensors
  }
  return nullptr;
}

// One safetensors file of model `model` holding `members` (tensor indices, served order),
// in folder `folder`. Only its data order is settled here; its header and size are laid out
// on first need (View::LayOutModelFiles).
void ViewBuilder::AddModelFile(View::NodeId folder, const ModelComponent& model, std::string name,
                               const std::vector<uint32_t>& members) {
  if (const WholeSafetensorsFile* whole = ServedWhole(model, members)) {
    View::Impl::ModelFile file;
    file.name = name;
    file.folder = model.folder;
    file.key_prefix = whole->key_prefix;
    file.source_file = whole->file;
    file.source_data_start = whole->data_start;
    file.members.resize(whole->tensor_count);  // the file's data order
    std::iota(file.members.begin(), file.members.end(), static_cast<uint32_t>(whole->first_tensor));
    return AddModelFileEntry(folder, std::move(file));
  }
  // Lay data out by descending item size (the reference writer's order), keeping served
  // order among equals: every tensor is then aligned to its element size.
  const ServedTensors& tensors = served_;
  // Item sizes are few (1 to 16 bytes): one stable pass per size, largest first, instead of
  // a comparison sort of a million indices.
  auto served_itemsize = [&](size_t i) { return Info(ServedAs(tensors[i].dtype).dtype).itemsize; };
  std::vector<uint8_t> itemsizes(members.size());  // each looked up once, not once a pass
  for (size_t k = 0; k < members.size(); ++k) itemsizes[k] = static_cast<uint8_t>(std::min<uint64_t>(served_itemsize(members[k]), 255));
  View::Impl::ModelFile file;
  file.name = name;
  file.folder = model.folder;
  file.key_prefix = model.folder.empty() ? 0 : static_cast<uint32_t>(model.folder.size() + 1);
  std::vector<uint32_t>& order = file.members;
  order.reserve(members.size());
  for (uint64_t size = 16; size >= 1; size /= 2)
    for (size_t k = 0; k < members.size(); ++k)
      if (itemsizes[k] == size) order.push_back(members[k]);
  if (order.size() != members.size()) {  // an item size that is no power of two up to 16
    order = members;
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t a, uint32_t b) { return served_itemsize(a) > served_itemsize(b); });
  }
  AddModelFileEntry(folder, std::move(file));
}

void ViewBuilder::AddModelFileEntry(View::NodeId folder, View::Impl::ModelFile file) {
  const uint32_t index = static_cast<uint32_t>(view_->impl_->model_files_.size());
  for (uint32_t i : file.members) model_file_of_[i] = index;
  file.node = AddEntry(folder, file.name, false);
  View::Impl::Entry& entry = view_->impl_->entries_[file.node];
  entry.content = View::Impl::Content::kModelFile;
  entry.model_file = index;
  view_->impl_->model_files_.push_back(std::move(file));
}

// The folder node at `path` of the tree ("" the root), made with the folders above it.
View::NodeId ViewBuilder::FolderAt(const std::string& path) {
  if (path.empty()) return View::kRoot;
  if (auto it = folder_nodes_.find(path); it != folder_nodes_.end()) return it->second;
  const size_t slash = path.rfind('/');
  const View::NodeId parent = FolderAt(slash == std::string::npos ? "" : path.substr(0, slash));
  const View::NodeId id = AddEntry(parent, path.substr(slash == std::string::npos ? 0 : slash + 1), true);
  folder_nodes_.emplace(path, id);
  return id;
}

// The entry of a file at `path` of the tree, in its folder (made if need be).
View::NodeId ViewBuilder::AddFileAt(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return AddEntry(View::kRoot, path, false);
  return AddEntry(FolderAt(path.substr(0, slash)), path.substr(slash + 1), false);
}

// A file of `content` at `path` of the tree.
View::NodeId ViewBuilder::AddLiteralFile(const std::string& path, std::string content) {
  const View::NodeId id = AddFileAt(path);
  uint64_t pos = 0;
  AddLiteral(std::move(content), &pos);
  FinishFile(id, pos, view_->impl_->newest_mtime_);
  return id;
}

// Each model's files in its folder: its weights file, or with a shard size (or the source's
// own shards) the Hugging Face layout of shards named after its weights file and their index.
void ViewBuilder::BuildModelFiles() {
  const ServedTensors& tensors = served_;
  const std::vector<ModelComponent>& models = tensors.components();
  std::vector<std::vector<uint32_t>> members(models.size());
  if (models.size() == 1) {
    members[0].resize(tensors.size());
    std::iota(members[0].begin(), members[0].end(), 0);
  } else {
    for (uint32_t i = 0; i < tensors.size(); ++i) members[tensors.ComponentOf(i)].push_back(i);
  }
  model_file_of_.assign(tensors.size(), 0);
  for (size_t c = 0; c < models.size(); ++c) BuildModel(models[c], members[c]);
  if (view_->impl_->model_files_.size() > 1) view_->impl_->model_file_of_ = std::move(model_file_of_);
  model_file_of_ = {};
}

// Shards split in served order as huggingface_hub's split_state_dict_into_shards does (a
// tensor over the limit gets a shard of its own; tensors sharing storage follow the first
// one's shard and do not count toward sizes).
std::vector<std::vector<uint32_t>> ViewBuilder::SplitIntoShards(const std::vector<uint32_t>& members) const {
  const ServedTensors& tensors = served_;
  std::vector<std::vector<uint32_t>> shards;
  std::vector<uint32_t> current;
  uint64_t current_size = 0;
  std::map<std::string, uint32_t> first_of_storage;  // storage id -> first tensor
  std::vector<uint32_t> followers;
  for (uint32_t i : members) {
    const ServedTensor t = tensors[i];
    const std::string& storage_id = t.storage_id();
    if (!storage_id.empty()) {
      if (first_of_storage.count(storage_id)) {
        followers.push_back(i);
        continue;
      }
      first_of_storage[storage_id] = i;
    }
    const uint64_t size = t.nbytes();
    if (size > options_.shard_size) {
      shards.push_back({i});
      continue;
    }
    if (current_size + size > options_.shard_size) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(i);
    current_size += size;
  }
  if (!current.empty()) shards.push_back(std::move(current));
  for (uint32_t i : followers) {
    const uint32_t first = first_of_storage[tensors[i].storage_id()];
    for (auto& shard : shards)
      if (std::find(shard.begin(), shard.end(), first) != shard.end()) {
        shard.push_back(i);
        break;
      }
  }
  for (auto& shard : shards) std::sort(shard.begin(), shard.end());  // served order within a shard
  return shards;
}

// The tensors of `members` in the source's shards (by the file their first box is in; a
// tensor with no elements goes with the first shard), and the shards' served names.
std::vector<std::vector<uint32_t>> ViewBuilder::SourceShards(const ModelComponent& model,
                                                             const std::vector<uint32_t>& members,
                                                             std::vector<std::string>* names) const {
  std::map<uint32_t, size_t> shard_of_file;
  for (size_t k = 0; k < model.source_shards.size(); ++k) shard_of_file[model.source_shards[k].first] = k;
  std::vector<std::vector<uint32_t>> shards(model.source_shards.size());
  for (uint32_t i : members) {
    const TensorEntry* stored = nullptr;
    size_t shard = 0;
    if (served_[i].Stored(&stored).ok() && !stored->boxes.empty())
      if (auto it = shard_of_file.find(stored->boxes[0].file); it != shard_of_file.end()) shard = it->second;
    shards[shard].push_back(i);
  }
  std::vector<std::vector<uint32_t>> kept;
  for (size_t k = 0; k < shards.size(); ++k)
    if (!shards[k].empty()) {
      kept.push_back(std::move(shards[k]));
      names->push_back(model.source_shards[k].second);
    }
  return kept;
}

void ViewBuilder::BuildModel(const ModelComponent& model, const std::vector<uint32_t>& members) {
  const View::NodeId folder = FolderAt(model.folder);
  std::vector<std::vector<uint32_t>> shards;
  std::vector<std::string> names;
  std::string_view stem = model.weights_name;
  if (stem.ends_with(kTensorFileSuffix)) stem.remove_suffix(kTensorFileSuffix.size());
  if (options_.shard_size > 0) {
    shards = SplitIntoShards(members);
    char name[64];
    for (size_t k = 0; k < shards.size(); ++k) {
      std::snprintf(name, sizeof name, "-%05zu-of-%05zu.safetensors", k + 1, shards.size());
      names.push_back(std::string(stem) + name);
    }
  } else if (!model.source_shards.empty()) {
    shards = SourceShards(model, members, &names);
  }
  auto in_folder = [&](const std::string& name) { return model.folder.empty() ? name : model.folder + "/" + name; };
  if (shards.size() <= 1) {
    model_entries_.emplace_back(&model, in_folder(model.weights_name));
    return AddModelFile(folder, model, model.weights_name, members);
  }

  const size_t key_prefix = model.folder.empty() ? 0 : model.folder.size() + 1;
  for (size_t k = 0; k < shards.size(); ++k) AddModelFile(folder, model, names[k], shards[k]);
  uint64_t total_size = 0;
  std::set<std::string_view> storages;  // tensors sharing storage count once
  for (uint32_t i : members) {
    const ServedTensor t = served_[i];
    if (t.storage_id().empty() || storages.insert(t.storage_id()).second) total_size += t.nbytes();
  }
  json index;
  index["metadata"] = {{"total_size", total_size}};
  json weight_map = json::object();
  for (uint32_t i : members)
    weight_map[std::string(served_[i].key().substr(key_prefix))] = view_->impl_->model_files_[model_file_of_[i]].name;
  index["weight_map"] = std::move(weight_map);
  const std::string index_path = in_folder(model.weights_name + ".index.json");
  model_entries_.emplace_back(&model, index_path);
  view_->impl_->model_indexes_.push_back(
      AddLiteralFile(index_path, index.dump(2, ' ', false, json::error_handler_t::replace) + "\n"));
}

// The tensors/ folder in file-name order, and the check that no two keys share a file
// name. The names are made once into buffers for the sort and dropped: the folder keeps
// only the order (4 bytes per tensor) and makes a name again when it is asked for one.
//
// A large tensors/ folder is cut into a few consecutive parts whose names are made and sorted on
// threads of their own (for a million tensors each step is ~50 ms on one core), then
// merged; ties go to the earlier part, so the order is the one a stable sort of the whole
// gives, whatever the number of threads.
Status ViewBuilder::SortTensorFiles() {
  const ServedTensors& tensors = served_;
  const size_t count = tensors.size();
  // Sorted by (prefix, name, index) held side by side: comparing through the tensor entries costs
  // a cache miss per comparison. The prefix is 8 bytes of the name, big-endian, taken after
  // the part every name shares ("layers." of "layers.0.weight", "layers.1.weight", ...), so
  // most comparisons are one integer compare and not a memcmp of the shared part. A merge
  // sort: on such a folder (names that differ only in their numbers, "layers.1",
  // "layers.10") std::sort spends its time in its heap-sort fallback.
  // 24 bytes (a string_view would make it 32): a million of them are sorted.
  struct Keyed {
    uint64_t prefix;
    const char* data;
    uint32_t size;
    uint32_t index;
    std::string_view name() const { return std::string_view(data, size); }
  };
  const size_t parts = WorkerCount(count, kSortTensorsPerWorker);
  std::vector<std::string> names(parts);  // each part's names, end to end
  std::vector<Keyed> keyed(count);
  std::vector<size_t> shared_of(parts, std::numeric_limits<size_t>::max());
  std::string first_name;
  if (count > 0) AppendTensorFileName(&first_name, tensors[0].key());
  // Each part's names, and how many leading bytes they share with the first name.
  RunOnWorkers(parts, [&](size_t w) {
    const auto [begin, end] = PartRange(count, parts, w);
    std::string& buffer = names[w];
    // Sized for names without escapes, the usual case: grown by doubling, the buffer
    // held up to twice its size at the peak of a mount.
    size_t expected = 0;
    for (size_t i = begin; i < end; ++i) expected += std::min(tensors[i].key().size(), kMaxFileName) + kTensorFileSuffix.size();
    buffer.reserve(expected);
    // Each name's end goes into its prefix field until the buffer is whole (it may move).
    for (size_t i = begin; i < end; ++i) {
      AppendTensorFileName(&buffer, tensors[i].key());
      keyed[i].prefix = buffer.size();
    }
    size_t shared = std::numeric_limits<size_t>::max();
    const std::string_view first = first_name;
    uint64_t from = 0;
    for (size_t i = begin; i < end; ++i) {
      keyed[i].data = buffer.data() + from;
      keyed[i].size = static_cast<uint32_t>(keyed[i].prefix - from);  // a name is at most 255 bytes
      from = keyed[i].prefix;
      keyed[i].index = static_cast<uint32_t>(i);
      const std::string_view name = keyed[i].name();
      size_t n = 0;
      const size_t limit = std::min({shared, first.size(), name.size()});
      while (n < limit && first[n] == name[n]) ++n;
      shared = n;
    }
    shared_of[w] = shared;
  });
  size_t shared = *std::min_element(shared_of.begin(), shared_of.end());
  if (shared == std::numeric_limits<size_t>::max()) shared = 0;
  // Equal prefixes: the rest decides (a name that ends inside the prefix has zero bytes
  // there, and is the smaller when the other has zeros too only if it is shorter).
  auto less = [shared](const Keyed& a, const Keyed& b) {
    if (a.prefix != b.prefix) return a.prefix < b.prefix;
    return a.name().substr(shared) < b.name().substr(shared);
  };
  RunOnWorkers(parts, [&](size_t w) {
    const auto [begin, end] = PartRange(count, parts, w);
    for (size_t i = begin; i < end; ++i) {
      const std::string_view name = keyed[i].name();
      uint64_t prefix = 0;
      for (size_t b = 0; b < 8; ++b)
        prefix = (prefix << 8) | (shared + b < name.size() ? static_cast<unsigned char>(name[shared + b]) : 0);
      keyed[i].prefix = prefix;
    }
    std::stable_sort(keyed.begin() + begin, keyed.begin() + end, less);
  });
  // Merge the sorted parts into the folder's order, checking neighbours for a shared name.
  std::vector<size_t> at(parts), stop(parts);
  for (size_t w = 0; w < parts; ++w) std::tie(at[w], stop[w]) = PartRange(count, parts, w);
  view_->impl_->tensor_file_order_.resize(count);
  const Keyed* previous = nullptr;
  for (size_t k = 0; k < count; ++k) {
    size_t best = parts;
    for (size_t w = 0; w < parts; ++w)
      if (at[w] < stop[w] && (best == parts || less(keyed[at[w]], keyed[at[best]]))) best = w;
    const Keyed& next = keyed[at[best]++];
    if (previous && previous->name() == next.name())
      return Status::NotSupported(catalog_.source, "two tensor keys map to the file name '" + std::string(next.name()) + "'");
    view_->impl_->tensor_file_order_[k] = next.index;
    previous = &next;
  }
  return Status::OK();
}

Status ViewBuilder::BuildManifest(View::NodeId id) {
  json m;
  m["ckptfs_manifest_version"] = 1;
  json files = json::array();
  for (uint32_t f = 0; f < catalog_.files->count(); ++f)
    files.push_back({{"path", catalog_.files->path(f)},
                     {"size", catalog_.files->size(f)},
                     {"mtime_ns", catalog_.files->identity(f).mtime_ns}});
  m["source"] = {{"path", catalog_.source}, {"format", catalog_.format}, {"files", std::move(files)}};
  // The file a loader opens, for each model: its weights file, or its shards' index.
  json components = json::array();
  for (const auto& [model, opens] : model_entries_) {
    if (model->folder.empty()) m["model_file"] = opens;
    components.push_back({{"folder", model->folder}, {"format", model->format}, {"model_file", opens}});
  }
  if (model_entries_.size() > 1 || !m.contains("model_file")) m["components"] = std::move(components);
  // What the transforms record of themselves ("dtype", "root").
  for (const auto& [name, value] : served_.manifest_fields().items()) m[name] = value;
  if (options_.shard_size) m["shard_size"] = options_.shard_size;
  if (!hidden_siblings_.empty()) m["hidden_sibling_files"] = hidden_siblings_;
  if (!renamed_siblings_.empty()) m["renamed_sibling_files"] = renamed_siblings_;
  // The per-tensor entries are written as text: a json tree of 100,000 entries would take
  // most of a mount's start-up time and double its peak memory.
  std::string head = m.dump(1, ' ', false, json::error_handler_t::replace);
  head.pop_back();  // the closing brace; "tensors" goes last
  head += ",\n \"tensors\": [";
  std::string tail = served_.empty() ? "]\n}\n" : "\n ]\n}\n";
  if (!options_.checksums) {
    // Entries are made on read (View::ReadManifest), laid out on first need.
    view_->impl_->entries_[id].content = View::Impl::Content::kManifest;
    view_->impl_->manifest_head_ = std::move(head);
    view_->impl_->manifest_tail_ = std::move(tail);
    return Status::OK();
  }
  // Hashing reads every tensor: the entries are made once, here, and kept.
  view_->EnsureModelFiles();
  view_->EnsureManifest();  // shares_storage_; its layout of entries without hashes is unused
  std::string text = std::move(head);
  for (size_t i = 0; i < served_.size(); ++i) {
    uint64_t hash = 0;
    CKPTFS_RETURN_IF_ERROR(view_->Xxh3(view_->TensorFile(i), &hash));
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
    view_->AppendManifestEntry(i, hex, &text);
  }
  text += tail;
  uint64_t pos = 0;
  AddLiteral(std::move(text), &pos);
  FinishFile(id, pos, view_->impl_->newest_mtime_);
  return Status::OK();
}

// One tensor's entry in manifest.json, preceded by its separator; `xxh3_hex` may be null.
void View::AppendManifestEntry(size_t index, const char* xxh3_hex, std::string* text) const {
  const ServedTensor t = impl_->served_[index];
  *text += index == 0 ? "\n  {" : ",\n  {";
  bool shortened = false;
  AppendTensorSummary(text, t, &shortened);
  *text += ", \"model_file\": ";
  const Impl::ModelFile& model_file = impl_->model_files_[impl_->model_file_of_.empty() ? 0 : impl_->model_file_of_[index]];
  AppendJsonString(text, model_file.folder.empty() ? model_file.name : model_file.folder + "/" + model_file.name);
  *text += ", \"model_offsets\": [";
  const uint64_t begin = impl_->model_begin_[index];
  AppendDecimal(text, begin);
  *text += ", ";
  AppendDecimal(text, begin + t.nbytes());
  *text += ']';
  if (xxh3_hex) {
    *text += ", \"xxh3\": \"";
    *text += xxh3_hex;
    *text += '"';
  }
  if (impl_->shares_storage_[index]) {
    *text += ", \"shared_storage\": ";
    AppendJsonString(text, t.storage_id());
  }
  if (shortened) *text += ", \"file_name_shortened\": true";
  *text += '}';
}

Status ViewBuilder::Build() {
  for (uint32_t f = 0; f < catalog_.files->count(); ++f)
    view_->impl_->newest_mtime_ = std::max(view_->impl_->newest_mtime_, catalog_.files->identity(f).mtime_ns);
  if (served_.size() >= (size_t{1} << 31))
    return Status::NotSupported(catalog_.source, "more than 2^31 tensors");
  AddEntry(View::kRoot, "", true);  // the root

  for (const std::string& folder : served_.folders()) FolderAt(folder);
  BuildModelFiles();
  view_->impl_->tensors_dir_ = AddEntry(View::kRoot, "tensors", true);
  View::NodeId meta = AddEntry(View::kRoot, "metadata.json", false);
  uint64_t pos = 0;
  AddLiteral(served_.metadata().dump(1, ' ', false, json::error_handler_t::replace) + "\n", &pos);
  FinishFile(meta, pos, view_->impl_->newest_mtime_);
  // Files a transform made (a key map's config.json, a config saying the served dtype): they
  // win over passed files at their paths.
  for (const auto& [path, content] : served_.added_files()) AddLiteralFile(path, content);
  AddPassedFiles();
  View::NodeId manifest = AddEntry(View::kRoot, "manifest.json", false);
  view_->impl_->manifest_ = manifest;
  // Every held node is in place: the per-tensor files' ids follow.
  view_->impl_->first_tensor_file_ = static_cast<View::NodeId>(view_->impl_->entries_.size());
  CKPTFS_RETURN_IF_ERROR(SortTensorFiles());
  for (View::Impl::Entry& n : view_->impl_->entries_) {
    if (!n.is_dir) continue;
    std::stable_sort(n.children.begin(), n.children.end(),
                     [&](View::NodeId a, View::NodeId b) { return view_->impl_->entries_[a].name < view_->impl_->entries_[b].name; });
  }
  // Last: with checksums it reads every tensor file through the finished tree.
  return BuildManifest(manifest);
}

// The source files served unchanged, each at its path unless a file the view makes has that
// path (the generated one wins; the root's are listed in manifest.json). A source's own
// metadata.json at the root is served as metadata.source.json.
void ViewBuilder::AddPassedFiles() {
  std::set<std::string> ours = {"tensors", "metadata.json", "manifest.json"};
  const std::vector<View::Impl::Entry>& entries = view_->impl_->entries_;
  for (View::NodeId id = 1; id < entries.size(); ++id) {
    if (entries[id].is_dir) continue;
    std::string path = entries[id].name;
    for (View::NodeId up = entries[id].parent; up != View::kRoot; up = entries[up].parent) path = entries[up].name + "/" + path;
    ours.insert(std::move(path));
  }
  std::set<std::string> passed_paths;
  for (const PassedFile& p : served_.passed_files()) passed_paths.insert(p.path);
  for (const PassedFile& p : served_.passed_files()) {
    std::string path = p.path;
    // A sibling that has the new name itself keeps it; the renamed one is then hidden.
    if (path == "metadata.json" && !passed_paths.count(kSourceMetadataName) && !ours.count(kSourceMetadataName)) {
      renamed_siblings_[path] = kSourceMetadataName;
      path = kSourceMetadataName;
    }
    if (ours.count(path) || (path.find('/') != std::string::npos && ours.count(path.substr(0, path.find('/'))))) {
      hidden_siblings_.insert(path);  // the generated file of that path wins
      continue;
    }
    const View::NodeId id = AddFileAt(path);
    Segment seg;
    seg.kind = Segment::Kind::kExtent;
    seg.ref = p.file;
    seg.length = catalog_.files->size(p.file);
    if (seg.length > 0) view_->impl_->segments_.push_back(seg);
    FinishFile(id, seg.length, catalog_.files->identity(p.file).mtime_ns);
  }
}

json TensorSummary(const ServedTensor& t) {
  std::string_view dtype;
  std::vector<uint64_t> shape;
  ServedDTypeAndShape(t, &dtype, &shape);
  json path = json::array();
  for (const PathElement& p : t.path()) {
    if (const auto* s = std::get_if<std::string>(&p)) path.push_back(*s);
    else path.push_back(std::get<int64_t>(p));
  }
  return {{"key", t.key()},
          {"path", std::move(path)},
          {"dtype", dtype},
          {"torch_dtype", Info(t.stored_dtype()).torch_name},
          {"shape", std::move(shape)},
          {"nbytes", t.nbytes()},
          {"file", "tensors/" + TensorFileName(t.key())}};
}

void AppendTensorSummary(std::string* out, const ServedTensor& t, bool* file_name_shortened) {
  std::string_view dtype;
  std::vector<uint64_t> shape;
  ServedDTypeAndShape(t, &dtype, &shape);
  *out += "\"key\": ";
  AppendJsonString(out, t.key());
  *out += ", \"path\": [";
  bool first = true;
  t.path().ForEach(
      [&](std::string_view s) {
        if (!first) *out += ", ";
        first = false;
        AppendJsonString(out, s);
      },
      [&](int64_t i) {
        if (!first) *out += ", ";
        first = false;
        *out += std::to_string(i);
      });
  *out += "], \"dtype\": \"";
  *out += dtype;
  *out += "\", \"torch_dtype\": \"";
  *out += Info(t.stored_dtype()).torch_name;
  *out += "\", \"shape\": ";
  AppendJsonArray(out, shape);
  *out += ", \"nbytes\": ";
  AppendDecimal(out, t.nbytes());
  *out += ", \"file\": ";
  // One buffer per thread for the file name: a million entries made a million strings.
  thread_local std::string file;
  file.assign("tensors/");
  AppendTensorFileName(&file, t.key(), file_name_shortened);
  AppendJsonString(out, file);
}

Status View::Build(std::shared_ptr<const Catalog> catalog, const ViewOptions& options,
                   std::unique_ptr<View>* out) {
  std::unique_ptr<View> view(new View());
  CKPTFS_RETURN_IF_ERROR(ApplyViewOptions(std::move(catalog), options, &view->impl_->served_));
  ViewBuilder builder(options, view.get());
  CKPTFS_RETURN_IF_ERROR(builder.Build());
  *out = std::move(view);
  return Status::OK();
}

}  // namespace ckptfs
